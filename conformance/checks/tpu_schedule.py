"""Scheduled overlap: in the run order XLA:TPU really gives a collective matmul, each transfer has a
matmul running inside it.

The dataflow check (:mod:`conformance.checks.overlap`) judges what a scheduler *could* overlap. What
a TPU user buys is what XLA:TPU's latency-hiding scheduler *does*: compiled for a TPU topology by the
real compiler (libtpu, :mod:`conformance.tpu_compiler`), the module is scheduled (its text order is
its run order), and each asynchronous collective is a ``-start`` .. ``-done`` span. A transfer is
hidden when a matmul (or a fusion or kernel holding one) is scheduled inside its span; a synchronous
collective is never hidden. Loops count per trip (:func:`conformance.hlo.schedule`).

The scheduler decides by its cost model, so the check compiles a ladder of realistic bfloat16 sizes
(the family's ``schedule_ladder``: per-hop transfers of 256 KiB to 4 MiB) on a v5e and a v6e slice of
8 and of 16 chips. Where this verdict and the dataflow's disagree, this one is the TPU verdict.
"""

from __future__ import annotations

import dataclasses
import functools
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from conformance import compat, compilation_cache, hlo, runner, tpu_compiler
from conformance.checks.base import Check, NotJudged, call_kernel, fail, keeping
from conformance.checks.overlap import PALLAS_OVERLAP
from conformance.runner import Case

#: The slices each ring length compiles for: one TPU generation with 4 ICI links per chip (v5e) and
#: the next (v6e), whose schedulers' cost models differ.
SCHEDULE_TOPOLOGIES: dict[int, tuple[str, ...]] = {8: ("v5e:2x4", "v6e:2x4"), 16: ("v5e:4x4", "v6e:4x4")}
#: The mesh labels of the check's cases: a 1-D ring of each length in :data:`SCHEDULE_TOPOLOGIES`.
SCHEDULE_MESHES = tuple(f"{n}-x-explicit" for n in SCHEDULE_TOPOLOGIES)


@dataclasses.dataclass(frozen=True)
class TpuScheduleRecord:
    """One kernel compiled for one TPU topology at one size: transfers hidden in the real schedule."""

    family: str
    impl: str
    topology: str
    ring: int
    dims: tuple[tuple[str, int], ...]
    hop_bytes: int  #: bytes of the largest transfer
    hidden: int
    total: int
    order: str  #: the run order in letters (:meth:`conformance.hlo.Schedule.order_text`)
    baseline: bool
    judge: str  #: ``libtpu 0.0.42.1 (v5e:2x4)``


def _hop_bytes(module: hlo.HloModule) -> int:
    return max(
        (s.nbytes for op in hlo.collectives_of(module).ops if op.phase != "done" for s in op.operand_shapes),
        default=0,
    )


def check_tpu_schedule(case: Case) -> list[TpuScheduleRecord]:
    """Compiled by the real TPU compiler for a v5e and a v6e slice of the case's ring length, every
    transfer but one per ring direction (and at least one) has a matmul inside its span in the
    scheduled module. The baseline is recorded, not judged. A host without libtpu skips, naming the
    install command."""
    spec, impl = case.spec, case.implementation
    if impl.pallas:
        raise NotJudged(PALLAS_OVERLAP)
    if not spec.overlap:
        raise NotJudged(f"family {case.family} has no compute to hide its transfers behind")
    reason = tpu_compiler.unavailable_reason()
    if reason is not None:
        raise compat.HostLimit(f"the TPU schedule is read from the real TPU compiler: {reason}")
    topologies = SCHEDULE_TOPOLOGIES.get(case.mesh.num_devices)
    if topologies is None or len(case.mesh.shape) != 1:
        raise NotJudged(f"the TPU schedule is compiled for 1-D rings of {sorted(SCHEDULE_TOPOLOGIES)} chips")
    records: list[TpuScheduleRecord] = []
    with keeping(records):
        for topology in topologies:
            _judge(case, topology, records)
    return records


@functools.lru_cache(maxsize=64)
def compiled_on_topology(case: Case, topology: str) -> Any:
    """``case``'s kernel compiled by the real TPU compiler for ``topology`` (its forward pass, on a
    mesh of the case's shape over the topology's chips): one compile shared by every check of the TPU
    tier. :class:`~conformance.tpu_compiler.CompilerRefusal` where the compiler refuses it."""
    mesh = tpu_compiler.mesh_on(case.mesh, topology)
    fn = functools.partial(case.implementation.fn, mesh=mesh, axis_name=case.mesh.axis_name)
    return tpu_compiler.compile_on(fn, runner.abstract_args(case, mesh=mesh))


@functools.lru_cache(maxsize=32)
def compiled_pullback_on_topology(case: Case, topology: str) -> Any:
    """``case``'s VJP (:func:`conformance.runner.pullback_of`: the backward pass as a training step
    runs it) compiled by the real TPU compiler for ``topology``."""
    mesh = tpu_compiler.mesh_on(case.mesh, topology)
    fn = functools.partial(case.implementation.fn, mesh=mesh, axis_name=case.mesh.axis_name)
    out = runner.expected_out_sharding(case, mesh=mesh)
    cotangent = jax.ShapeDtypeStruct(case.out_shape, jnp.dtype(case.dtype), sharding=out)
    args = (*runner.abstract_args(case, mesh=mesh), cotangent)
    try:
        with compilation_cache.bypassed():  # a TPU topology's executable cannot be read back
            return runner.pullback_of(fn).lower(*args).compile()
    except Exception as e:
        raise tpu_compiler.CompilerRefusal(f"{type(e).__name__}: {tpu_compiler.first_lines(str(e))}") from e


def compiled_or_fail(case: Case, topology: str, check: str) -> Any:
    """:func:`compiled_on_topology`; the compiler's refusal is the kernel's failure, quoted."""

    def compile_it() -> Any:
        try:
            return compiled_on_topology(case, topology)
        except tpu_compiler.CompilerRefusal as refusal:
            raise fail(
                case, check, f"the TPU compiler refuses it ({topology})", [f"compiler       : {refusal}"]
            ) from refusal

    return call_kernel(case, check, compile_it)


def _judge(case: Case, topology: str, records: list[TpuScheduleRecord]) -> None:
    impl = case.implementation
    judge = tpu_compiler.judge(topology)
    module = hlo.parse_module(compiled_or_fail(case, topology, "tpu_schedule").as_text())
    scheduled = hlo.schedule(module)
    records.append(
        TpuScheduleRecord(
            case.family,
            case.impl,
            topology,
            case.mesh.axis_size,
            case.dims,
            _hop_bytes(module),
            scheduled.hidden,
            scheduled.total,
            scheduled.order_text(),
            impl.baseline,
            judge,
        )
    )
    if impl.baseline:
        return
    if not scheduled.transfers:
        raise NotJudged(f"the module compiled for {topology} has no collective: no transfer to judge")
    exposed = scheduled.total - scheduled.hidden
    if scheduled.hidden and exposed <= scheduled.rings:
        return
    shown = [t for t in scheduled.transfers if not t.hidden][:6]
    raise fail(
        case,
        "tpu_schedule",
        f"in the real TPU schedule its transfers do not run beside matmuls ({topology})",
        [
            f"hidden         : {scheduled.fraction} transfers have a matmul scheduled inside them",
            f"threshold      : every transfer but one per ring direction ({scheduled.rings} here), and at "
            "least one",
            f"run order      : {scheduled.order_text()}  (S/D a transfer's start/done, C a synchronous "
            "collective, M a matmul)",
            f"judge          : {judge}, the scheduled module of jit(...).lower(...).compile()",
            f"how            : {case.spec.overlap}",
            "exposed transfers:",
            *(
                f"  {t.kind} {t.name} in {t.computation}" + (f" (x{t.times})" if t.times != 1 else "")
                for t in shown
            ),
        ],
    )


def topology_rows(records: list[Any], cells: Callable[[list[Any]], str], *, baseline_note: str) -> list[str]:
    """A TPU-tier table's lines: one per implementation and topology (``cells`` of its records, one
    per size), the baseline's marked, then the libtpu versions that judged them."""
    rows: dict[tuple[str, str, str], list[Any]] = defaultdict(list)
    for r in records:
        rows[(r.family, r.impl, r.topology)].append(r)
    width = max(len(r.impl) for r in records)
    lines = []
    for (family, impl, topology), recs in sorted(rows.items()):
        line = f"{family:<21} {impl:<{width}}  {topology:<8} {cells(recs)}"
        lines.append(line + (f"  ({baseline_note})" if recs[0].baseline else ""))
    return [*lines, judges_line(records)]


def judges_line(records: list[Any]) -> str:
    """``judge: libtpu 0.0.42.1``: the libtpu versions that gave the records' verdicts."""
    return f"judge: {', '.join(sorted({r.judge.split(' (')[0] for r in records}))}"


def tpu_schedule_table(records: list[Any]) -> list[tuple[str, list[str]]]:
    """Per implementation and topology: transfers hidden / all in the real TPU schedule, per size."""
    if not records:
        return []
    title = (
        "TPU schedule: transfers with a matmul inside them / all transfers, per size (bytes per hop), "
        "in the module the real TPU compiler scheduled"
    )

    def cells(recs: list[Any]) -> str:
        return "  ".join(
            f"{_size(r.hop_bytes)}: {r.hidden}/{r.total}" for r in sorted(recs, key=lambda r: r.hop_bytes)
        )

    return [(title, topology_rows(records, cells, baseline_note="baseline: reported, not judged"))]


def _size(nbytes: int) -> str:
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:g} {unit}"
    return f"{nbytes} B"


CHECKS = (Check("tpu_schedule", check_tpu_schedule, tables=tpu_schedule_table),)
