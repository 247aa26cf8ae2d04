"""Pallas TPU kernels: races and leftover semaphores under TPU interpret mode, the barrier protocol
(static), and the layout the real TPU compiler accepts (libtpu, compiling for a TPU topology)."""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from typing import Any

import jax

from conformance import compat, runner, shared_runs
from conformance.checks import pallas_protocol
from conformance.checks.base import (
    Axes,
    Check,
    call_kernel,
    compare_with_reference,
    compiled_for,
    fail,
    keeping,
    require_array,
)
from conformance.runner import Case
from conformance.targets import mosaic, tpu_compiler

#: What a compile for a TPU may end in that the layout check judges itself: the kernel's refusal, the
#: compiler's.
REFUSALS = (mosaic.TpuConstraintError, tpu_compiler.CompilerRefusal)


@dataclasses.dataclass(frozen=True)
class TpuLayoutRecord:
    """What ``tpu_layout`` found for one (implementation, dtype, dims): accepted, or refused and why."""

    family: str
    impl: str
    dtype: str
    dims: tuple[tuple[str, int], ...]
    #: The kernel's own refusal (its :class:`~conformance.targets.mosaic.TpuConstraintError`), if it refused.
    refusal: str | None
    #: Who judged: the real compiler, its libtpu and topology (``libtpu 0.0.42.1 (v5e:2x2)``).
    judge: str = ""
    #: The compiler's refusal of the shape (asked with the kernel's refusal set aside), if it refused.
    compiler_refusal: str | None = None
    #: The kernel refused without :func:`conformance.refuse_on_tpu`, so the compiler could not be asked.
    refusal_unverified: bool = False


def check_tpu_layout(case: Case) -> TpuLayoutRecord:
    """Compiled for a TPU, the kernel accepts the shape where the TPU compiler compiles it and refuses
    it (naming the constraint) where the compiler refuses it.

    The judge is the real compiler (libtpu, :mod:`conformance.targets.tpu_compiler`), on a TPU topology
    of the case's device count. The kernel is lowered for it as it is: a
    :class:`~conformance.targets.mosaic.TpuConstraintError` is its refusal, anything else it lowers is
    compiled. A refused shape is then compiled with the kernel's refusals set aside
    (:func:`conformance.refuse_on_tpu`), so the compiler's verdict can be held against the
    kernel's; a refusal the kernel raises directly cannot be set aside, is recorded as unverified,
    and at the family's TPU-native dims fails. A host without libtpu skips, naming the install
    command.
    """
    reason = tpu_compiler.unavailable_reason()
    if reason is not None:
        raise compat.HostLimit(f"the TPU layout is judged by the real TPU compiler: {reason}")
    topology = tpu_compiler.topology_for(case.mesh.num_devices)
    judge = tpu_compiler.judge(topology)
    mesh = tpu_compiler.mesh_on(case.mesh, topology)
    fn = runner.kernel_on(case, mesh)
    args = runner.abstract_args(case, mesh=mesh)
    record = TpuLayoutRecord(case.family, case.impl, case.dtype, case.dims, None, judge=judge)
    records = [record]
    with keeping(records), compiled_for(topology):
        try:
            call_kernel(case, "tpu_layout", lambda: tpu_compiler.compile_on(fn, args), passing=REFUSALS)
        except mosaic.TpuConstraintError as refusal:
            records[0] = record = dataclasses.replace(record, refusal=str(refusal))
        except tpu_compiler.CompilerRefusal as compiler:
            records[0] = dataclasses.replace(record, compiler_refusal=str(compiler))
            raise fail(
                case,
                "tpu_layout",
                "the TPU compiler refuses this shape, and the kernel lowers it instead of refusing it "
                "(conformance.refuse_on_tpu, naming the rule)",
                [f"compiler       : {judge}", f"its refusal    : {compiler}"],
            ) from None
        else:
            return record
        records[0] = record = _asked_about_a_refusal(case, record, fn, args)
        return record


def _asked_about_a_refusal(case: Case, record: TpuLayoutRecord, fn: Any, args: tuple) -> TpuLayoutRecord:
    """The compiler's verdict on a shape the kernel refused, its refusals set aside."""
    with mosaic.asking_the_compiler():
        try:
            call_kernel(case, "tpu_layout", lambda: tpu_compiler.compile_on(fn, args), passing=REFUSALS)
        except mosaic.TpuConstraintError:  # raised directly: the compiler cannot be asked
            if case.at_tpu_native_dims:
                raise fail(
                    case,
                    "tpu_layout",
                    "refuses the family's TPU-native shape, which every buffer fills in whole tiles",
                    [
                        f"refusal        : {record.refusal}",
                        "the kernel raised it directly, so the compiler could not be asked whether it "
                        "compiles the shape; refuse through conformance.refuse_on_tpu to let it judge",
                    ],
                ) from None
            return dataclasses.replace(record, refusal_unverified=True)
        except tpu_compiler.CompilerRefusal as compiler:
            return dataclasses.replace(record, compiler_refusal=str(compiler))
    raise fail(
        case,
        "tpu_layout",
        "refuses a shape the TPU compiler compiles",
        [f"compiler       : {record.judge} compiles it", f"the refusal    : {record.refusal}"],
    )


def _indented(report: str) -> list[str]:
    """A race report's lines (buffer and index range, device, the kernel's source line, clocks)."""
    return [f"  {line.strip()}" for line in report.strip().splitlines() if line.strip()][:8]


def check_races(case: Case) -> None:
    """Under TPU interpret mode with race detection: no race, no semaphore left with a count, and
    exact values.

    Run once per DMA execution mode: "eager" starts every DMA at once, "on_wait"
    defers each until something waits on it, as late and out of order as the
    waits allow. A kernel whose semaphores can be satisfied by the wrong
    transfer passes the first and fails the second.

    Every semaphore must be back at zero once every device has left the kernel: on a chip a
    barrier semaphore left with a count lets the next call's barrier pass at once, and a DMA
    semaphore left with one means the kernel returned while its DMA could still read its buffers.
    Races and leftover counts are read at the end of every ``pallas_call`` the check runs
    (:func:`compat.watch_interpreted_calls`), not only the last.
    """
    if not case.implementation.pallas or not case.dma_mode:
        raise ValueError(f"check_races needs a Pallas implementation and a dma_mode: {case}")
    run = call_kernel(case, "races", lambda: shared_runs.watched_run(case))  # the run the case's checks share
    if run is not None:
        inputs64, out, ends, reports = run.inputs64, run.out, list(run.ends), list(run.reports)
        require_array(case, "races", out)
    else:  # this JAX's interpreter cannot be watched: said here, by the same calls
        with compat.watch_interpreted_calls() as ends, compat.race_reports() as reports:
            inputs64, out = call_kernel(case, "races", lambda: runner.execute(case, detect_races=True))
            require_array(case, "races", out)
    where = f"kernel {case.impl} on {case.mesh.describe()}, dma_execution_mode={case.dma_mode!r}"
    unread = [end.unreadable for end in ends if end.unreadable]
    if unread:
        raise RuntimeError(
            f"the races check cannot read JAX {jax.__version__}'s interpreter state at kernel "
            f"exit: {unread[0]}"
        )
    raced = [i for i, end in enumerate(ends, 1) if end.races_found]
    if raced or (not ends and compat.races_found()):
        calls = f"in pallas_call {raced} of {len(ends)}" if ends else "in the last pallas_call"
        raise fail(
            case,
            "races",
            "TPU interpret mode detected a race",
            [
                f"{where}, {calls}",
                *(
                    [f"racing accesses ({len(reports)} reported; the first):", *_indented(reports[0])]
                    if reports
                    else ["the interpreter reported no racing accesses this check could read"]
                ),
            ],
        )
    left = [(i, sem) for i, end in enumerate(ends, 1) for sem in end.leftover]
    if left:
        raise fail(
            case,
            "races",
            "a semaphore has a nonzero count at kernel exit",
            [
                where,
                *(f"pallas_call {i} of {len(ends)}: {sem.describe()}" for i, sem in left[:6]),
                *([f"... and {len(left) - 6} more"] if len(left) > 6 else []),
                "read once every device had left the kernel; on a chip the next call's barrier passes "
                "at once (a barrier signal nobody waited for) or the kernel returned while a DMA could "
                "still read its buffers (a send never waited for): wait for every signal and every DMA",
            ],
        )
    compare_with_reference(case, "races", out, inputs64, blocks=False)  # a race may not recur


def check_barrier_protocol(case: Case) -> None:
    """No remote DMA starts unprotected by a barrier (``conformance/checks/pallas_protocol.py`` says which).

    Static (read off the traced kernel): TPU interpret mode starts all devices'
    kernels together, so no run on CPU can show this defect. A kernel with no
    barrier of its own passes: JAX inserts a device barrier before it.
    """
    fn = runner.jitted_for(case)
    found = call_kernel(
        case, "barrier_protocol", lambda: pallas_protocol.violations(fn, runner.abstract_args(case))
    )
    if found:
        raise fail(
            case,
            "barrier_protocol",
            found[0].rule,
            [
                f"at {found[0].where}",
                "either wait for the neighbours' signals on the barrier semaphore before the first "
                "remote DMA (pltpu.get_barrier_semaphore, pl.semaphore_signal/semaphore_wait, "
                "CompilerParams(collective_id=...)), or take no barrier of your own and keep the "
                "device barrier JAX inserts before the kernel (no collective_id, no skip_device_barrier)",
            ],
        )


def tpu_layout_table(records: list[Any]) -> list[tuple[str, list[str]]]:
    """Per Pallas kernel and dtype: the tile-edge shapes it lowers and the compiler compiles, and the
    ones it refuses (the compiler refusing them too, or unverified), with the judge."""
    if not records:
        return []
    title = "TPU layout, judged by the real TPU compiler: shapes compiled, and refused by kernel and compiler"
    by_impl: dict[tuple[str, str, str], list] = defaultdict(list)
    for rec in records:
        by_impl[(rec.family, rec.impl, rec.dtype)].append(rec)
    width = max(len(impl) for _, impl, _ in by_impl)
    lines = []
    for (family, impl, dtype), recs in sorted(by_impl.items()):
        compiled = [
            "x".join(str(v) for _, v in r.dims) for r in recs if not (r.refusal or r.compiler_refusal)
        ]
        counts = {
            "refused by both": sum(bool(r.refusal and r.compiler_refusal) for r in recs),
            "refused unverified": sum(r.refusal_unverified for r in recs),
            "FALSE REFUSALS": sum(
                bool(r.refusal and not r.compiler_refusal and not r.refusal_unverified) for r in recs
            ),
            "MISSED REFUSALS": sum(bool(r.compiler_refusal and not r.refusal) for r in recs),
        }
        judges = sorted({r.judge for r in recs if r.judge})
        lines.append(
            f"{family:<21} {impl:<{width}}  {dtype:<9} compiled {len(compiled)}: {'; '.join(compiled)}"
            + "".join(f"  {what} {n}" for what, n in counts.items() if n or what == "refused by both")
            + (f"  [{', '.join(judges)}]" if judges else "")
        )
    return [(title, lines)]


CHECKS = (
    Check("tpu_layout", check_tpu_layout, concern="program", tables=tpu_layout_table),
    Check(
        "races",
        check_races,
        # a race is in the kernel's semaphore and buffer protocol, which turns on the steps the ring
        # takes (none, one, several each way, an odd split) and the mesh's kind: the adversarial DMA
        # order at the odd shape (both directions of a bidirectional ring carry rows) on a mesh of each
        # kind; the eager order and the even shape on a ring of each dimensionality (8 devices: one
        # step, steps past the semaphores in flight, neighbours over the other axes, a TPU's order)
        axes=Axes(
            meshes="covering",
            variants_on="dimensions",
            shapes=True,
            dma_modes=True,
            platforms=False,
            implementations=("pallas",),
        ),
        doc="Pallas kernels under TPU interpret mode with race detection, in both DMA modes.",
    ),
    Check(
        "barrier_protocol",
        check_barrier_protocol,
        axes=Axes(platforms=False, implementations=("pallas",)),
        doc="Pallas kernels: no remote DMA before the barrier (static; interpret mode cannot see it).",
    ),
)
