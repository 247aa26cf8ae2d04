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
8 and of 16 chips, and on a 3-D v5p slice of 12. Where this verdict and the dataflow's disagree, this
one is the TPU verdict.
"""

from __future__ import annotations

import dataclasses
import functools
from collections import defaultdict
from collections.abc import Callable, Mapping
from typing import Any

import jax

from conformance import compat, dtypes, hlo, runner, tpu_compiler
from conformance.checks.base import Check, NotJudged, call_kernel, fail, keeping
from conformance.checks.overlap import PALLAS_OVERLAP
from conformance.runner import Case

#: The slices each ring length compiles for: one TPU generation with 4 ICI links per chip (v5e) and
#: the next (v6e), whose schedulers' cost models differ, at 8 and 16 chips; and a ring of 12 over a
#: 3-D v5p slice (2x2x3; ``jax.make_mesh`` threads the ring through the torus), the ring length that
#: is no power of two and the topology that is 3-D.
SCHEDULE_TOPOLOGIES: dict[int, tuple[str, ...]] = {
    8: ("v5e:2x4", "v6e:2x4"),
    12: ("v5p:2x2x3",),
    16: ("v5e:4x4", "v6e:4x4"),
}
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
    return check_schedule(
        case, tpu_compiler, SCHEDULE_TOPOLOGIES, check="tpu_schedule", record=TpuScheduleRecord
    )


def check_schedule(
    case: Case, compiler: Any, topologies: Mapping[int, tuple[str, ...]], *, check: str, record: type
) -> list[Any]:
    """The scheduled-overlap verdict of ``compiler`` (:mod:`~conformance.tpu_compiler` or
    :mod:`~conformance.gpu_compiler`) for each topology of the case's ring length, one ``record``
    each."""
    spec, impl = case.spec, case.implementation
    if impl.pallas:
        raise NotJudged(PALLAS_OVERLAP)
    if not spec.overlap:
        raise NotJudged(f"family {case.family} has no compute to hide its transfers behind")
    records: list[Any] = []
    with keeping(records):
        for topology in ring_topologies(case, compiler, topologies, what=f"the {compiler.NAME} schedule"):
            _judge(case, topology, records, compiler=compiler, check=check, record=record)
    return records


def ring_topologies(
    case: Case, compiler: Any, topologies: Mapping[int, tuple[str, ...]], *, what: str
) -> tuple[str, ...]:
    """The topologies of ``topologies`` for the case's ring length: a host limit where ``compiler``
    is not available here, not judged for a mesh that is no 1-D ring of one of those lengths."""
    reason = compiler.unavailable_reason()
    if reason is not None:
        raise compat.HostLimit(f"{what} is read from the real {compiler.NAME} compiler: {reason}")
    found = topologies.get(case.mesh.num_devices)
    if not found or len(case.mesh.shape) != 1:
        raise NotJudged(f"{what} is compiled for 1-D rings of {sorted(topologies)} {compiler.DEVICE}s")
    return found


def compiler_of(topology: str) -> Any:
    """The compiler module that compiles for ``topology``: ``h100:1x1x8`` is XLA:GPU's, ``v5e:2x4``
    libtpu's."""
    from conformance import gpu_compiler

    return gpu_compiler if topology.split(":", 1)[0] in gpu_compiler.TARGETS else tpu_compiler


@functools.lru_cache(maxsize=64)
def compiled_on_topology(case: Case, topology: str) -> Any:
    """``case``'s kernel compiled by the real compiler of ``topology`` (its forward pass, on a mesh of
    the case's shape over the topology's devices; :func:`compiler_of`): one compile shared by every
    check of the TPU (or GPU) tier. :class:`~conformance.tpu_compiler.CompilerRefusal` where the
    compiler refuses it."""
    compiler = compiler_of(topology)
    mesh = compiler.mesh_on(case.mesh, topology)
    fn = runner.kernel_on(case, mesh)
    return compiler.compile_on(fn, runner.abstract_args(case, mesh=mesh))


@functools.lru_cache(maxsize=32)
def compiled_pullback_on_topology(case: Case, topology: str) -> Any:
    """``case``'s VJP (:func:`conformance.runner.pullback_of`: the backward pass as a training step
    runs it) compiled by the real compiler of ``topology``."""
    compiler = compiler_of(topology)
    mesh = compiler.mesh_on(case.mesh, topology)
    fn = runner.kernel_on(case, mesh)
    out = runner.expected_out_sharding(case, mesh=mesh)
    cotangent = jax.ShapeDtypeStruct(case.out_shape, dtypes.result_np(case.dtype), sharding=out)
    args = (*runner.abstract_args(case, mesh=mesh), cotangent)
    return compiler.compile_on(runner.pullback_of(fn), args)


def module_text(compiled: Any, topology: str) -> str:
    """The compiled module's text; a host limit where this jaxlib gives none (jaxlib 0.6.2's
    deviceless GPU executable: "GetHloModules is not supported")."""
    text = compiled.as_text()
    if text is None:
        raise compat.HostLimit(
            f"jaxlib {jax.__version__}'s {compiler_of(topology).NAME} executable compiled for {topology} "
            "gives no module text to read"
        )
    return text


def compiled_or_fail(case: Case, topology: str, check: str) -> Any:
    """:func:`compiled_on_topology`; the compiler's refusal is the kernel's failure, quoted."""

    def compile_it() -> Any:
        try:
            return compiled_on_topology(case, topology)
        except tpu_compiler.CompilerRefusal as refusal:
            raise fail(
                case,
                check,
                f"the {compiler_of(topology).NAME} compiler refuses it ({topology})",
                [f"compiler       : {refusal}"],
            ) from refusal

    return call_kernel(case, check, compile_it)


def _judge(case: Case, topology: str, records: list[Any], *, compiler: Any, check: str, record: type) -> None:
    impl = case.implementation
    judge = compiler.judge(topology)
    module = hlo.parse_module(module_text(compiled_or_fail(case, topology, check), topology))
    scheduled = hlo.schedule(module)
    records.append(
        record(
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
        check,
        f"in the real {compiler.NAME} schedule its transfers do not run beside matmuls ({topology})",
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
    """``judge: libtpu 0.0.42.1``: the compilers (libtpu, XLA:GPU's plugin) that gave the records'
    verdicts."""
    return f"judge: {', '.join(sorted({r.judge.split(' (')[0] for r in records}))}"


def tpu_schedule_table(records: list[Any]) -> list[tuple[str, list[str]]]:
    """Per implementation and topology: transfers hidden / all in the real TPU schedule, per size."""
    return schedule_table(records, "TPU")


def schedule_table(records: list[Any], name: str) -> list[tuple[str, list[str]]]:
    """:func:`tpu_schedule_table` for the ``name`` (``"TPU"``, ``"GPU"``) compiler's records."""
    if not records:
        return []
    title = (
        f"{name} schedule: transfers with a matmul inside them / all transfers, per size (bytes per hop), "
        f"in the module the real {name} compiler scheduled"
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
