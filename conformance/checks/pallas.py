"""Pallas TPU kernels: races and leftover semaphores under TPU interpret mode, the barrier protocol
(static), and the layout a TPU's compiler accepts (lowered for TPU from this host)."""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from typing import Any

import jax

from conformance import compat, mosaic, pallas_protocol, runner
from conformance.checks.base import Axes, Check, call_kernel, compare_with_reference, fail
from conformance.runner import Case


@dataclasses.dataclass(frozen=True)
class TpuLayoutRecord:
    """What ``tpu_layout`` found for one (implementation, dtype, dims): accepted, or refused and why."""

    family: str
    impl: str
    dtype: str
    dims: tuple[tuple[str, int], ...]
    refusal: str | None
    #: Why this host could not lower the shape for TPU at all (neither accepted nor refused).
    host_limited: str | None = None


def check_tpu_layout(case: Case) -> TpuLayoutRecord:
    """Compiled for a TPU, the kernel refuses the shape naming the constraint, or lowers to DMA
    windows and buffers a TPU's compiler accepts (:mod:`conformance.mosaic`); at the family's
    TPU-native dims it must lower."""
    try:
        text = runner.lower_exactly(case, "tpu").as_text()
    except compat.HostCannotLower as limit:
        limit.records = [TpuLayoutRecord(case.family, case.impl, case.dtype, case.dims, None, str(limit))]
        raise
    except mosaic.TpuConstraintError as refusal:
        if case.at_tpu_native_dims:
            raise fail(
                case,
                "tpu_layout",
                "refuses the family's TPU-native shape, which every buffer fills in whole tiles",
                [f"refusal: {refusal}"],
            ) from None
        return TpuLayoutRecord(case.family, case.impl, case.dtype, case.dims, str(refusal))
    except Exception as e:
        raise fail(
            case,
            "tpu_layout",
            "lowering for TPU raised instead of refusing with conformance.TpuConstraintError",
            [f"{type(e).__name__}: {str(e)[:1500]}"],
        ) from None
    violations = list(dict.fromkeys(v.what for v in mosaic.audit_lowered(text)))
    if violations:
        shown = violations[:4] + ([f"... and {len(violations) - 4} more"] if len(violations) > 4 else [])
        raise fail(
            case,
            "tpu_layout",
            "lowers for TPU to something a TPU compiler refuses (interpret mode "
            "cannot see this); refuse such shapes with conformance.TpuConstraintError, or "
            "align the windows",
            shown,
        )
    return TpuLayoutRecord(case.family, case.impl, case.dtype, case.dims, None)


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
    with compat.watch_interpreted_calls() as ends:
        inputs64, out = call_kernel(case, "races", lambda: runner.execute(case, detect_races=True))
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
                "the interpreter printed the racing accesses (buffer, range, device, source line) "
                "to stderr above",
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
    compare_with_reference(case, "races", out, inputs64)


def check_barrier_protocol(case: Case) -> None:
    """No remote DMA starts unprotected by a barrier (``conformance/pallas_protocol.py`` says which).

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
    """Per Pallas kernel and dtype: tile-edge shapes lowered to windows a TPU accepts, and refused."""
    if not records:
        return []
    title = "TPU layout (lowered for TPU from this host): shapes accepted / refused with the constraint named"
    by_impl: dict[tuple[str, str, str], list] = defaultdict(list)
    for rec in records:
        by_impl[(rec.family, rec.impl, rec.dtype)].append(rec)
    width = max(len(impl) for _, impl, _ in by_impl)
    lines = []
    for (family, impl, dtype), recs in sorted(by_impl.items()):
        accepted = [
            "x".join(str(v) for _, v in r.dims) for r in recs if r.refusal is None and not r.host_limited
        ]
        refused = sum(r.refusal is not None for r in recs)
        limited = sum(r.host_limited is not None for r in recs)
        lines.append(
            f"{family:<21} {impl:<{width}}  {dtype:<9} accepted {len(accepted)}: "
            f"{'; '.join(accepted)}  refused {refused}"
            + (f"  not lowerable on this host {limited}" if limited else "")
        )
    return [(title, lines)]


CHECKS = (
    Check("tpu_layout", check_tpu_layout, tables=tpu_layout_table),
    Check(
        "races",
        check_races,
        axes=Axes(shapes=True, dma_modes=True, platforms=False, implementations=("pallas",)),
        doc="Pallas kernels under TPU interpret mode with race detection, in both DMA modes.",
    ),
    Check(
        "barrier_protocol",
        check_barrier_protocol,
        axes=Axes(platforms=False, implementations=("pallas",)),
        doc="Pallas kernels: no remote DMA before the barrier (static; interpret mode cannot see it).",
    ),
)
