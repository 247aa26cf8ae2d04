"""XLA's ragged all-to-all's bytes as the op moves them: its groups, counted in a run on CPU.

A module's text gives the op's buffers (its sizes are data; a module compiled for TPU pads them to its
tiles), and the module compiled for the host holds the emulation's all-to-alls in the op's place
(:mod:`conformance.targets.cpu_ragged_all_to_all`): every bytes check puts the counted groups there.
"""

from __future__ import annotations

from conformance import hlo, shared_runs
from conformance.checks.base import NotJudged, call_kernel
from conformance.runner import Case
from conformance.targets import cpu_ragged_all_to_all


def as_the_op_moves_them(
    case: Case, summary: hlo.CollectiveSummary, *, backward: bool, check: str, bound: int | None = None
) -> tuple[int | None, list[str]]:
    """The bytes a device receives per call in ``summary`` (a module of ``case``'s forward or backward
    pass), with XLA's ragged all-to-all counted as the op moves them: its groups' rows from the other
    devices, as their senders size them, and nothing else. A module's text gives only the op's buffers
    (its sizes are data, and a TPU module's shapes are padded to its tiles), so the groups are counted
    in a run of the same pass on CPU (:func:`conformance.targets.cpu_ragged_all_to_all.delivered_by`),
    the device that receives most. Returns the count and the lines that say how it was made (none
    where the module holds no such op). Where no run can count the groups, the op counts as its buffers;
    a kernel that only they put past ``bound`` is not judged (what the op moves is data: no module's
    text says it), naming why no run counted."""

    def through_the_op(op: hlo.CollectiveOp) -> bool:
        return op.kind == "ragged-all-to-all" or cpu_ragged_all_to_all.is_the_emulations(op.op_name)

    ragged = [op for op in summary.ops if through_the_op(op)]
    if not ragged:
        return summary.received_bytes_per_device(), []
    emulated = ragged[0].kind != "ragged-all-to-all"
    what = (
        "ragged-all-to-all (emulated here: the all-to-alls its function holds)"
        if emulated
        else "ragged-all-to-all"
    )
    buffers = sum(op.received_bytes() * (op.multiplicity or 0) for op in ragged)
    delivered, why_not = _delivered(case, backward=backward, check=check)
    others = hlo.CollectiveSummary(tuple(op for op in summary.ops if not through_the_op(op)))
    rest = others.received_bytes_per_device()
    if delivered is None:
        received = summary.received_bytes_per_device()
        past = bound is not None and (received is None or received > bound)
        if past and not case.implementation.baseline and rest is not None and rest <= bound:
            raise NotJudged(
                f"{check}: within the bound but for XLA's ragged all-to-all, counted as its buffers "
                f"({buffers} bytes, {received} in all against {bound}): what the op moves is data, and "
                f"{why_not}"
            )
        return received, [f"  {what} counted as its buffers ({buffers} bytes): {why_not}"]
    device, most = delivered.most_received
    return None if rest is None else rest + most, [
        f"  {what} counted as the op moves them: {most} bytes of its groups' rows to the device that "
        f"receives most (the one at {device}), in a run of this case on CPU ({delivered.calls} calls; "
        f"{'the emulation moves' if emulated else 'its buffers'}: {buffers} bytes)"
    ]


def _delivered(
    case: Case, *, backward: bool, check: str
) -> tuple[cpu_ragged_all_to_all.Delivered | None, str]:
    """What XLA's ragged all-to-all delivers in a run of ``case``'s pass on CPU (the one run each pass of
    the case has, :func:`conformance.shared_runs.counted_run`), or why no run counts it."""
    import jax

    if not cpu_ragged_all_to_all.installed():
        return None, "no run counts its groups outside the suite's run (its CPU lowering is not installed)"
    if jax.process_count() > 1:
        return None, f"a run in a job of {jax.process_count()} processes counts each process's devices alone"
    if case.mesh.num_devices > len(jax.devices("cpu")):
        return (
            None,
            f"this host has {len(jax.devices('cpu'))} CPU devices, the case's mesh {case.mesh.num_devices}",
        )
    declared = case.implementation.platforms
    if declared is not None and case.platform not in declared:  # its run is no verdict, only a count
        try:
            counted = shared_runs.counted_run(case, backward)
        except Exception as error:
            said = (str(error).strip().splitlines() or [""])[0]
            return (
                None,
                f"{case.impl}, registered for {', '.join(declared)}, raised {type(error).__name__} on "
                f"CPU: {said}",
            )
    else:
        counted = call_kernel(case, check, lambda: shared_runs.counted_run(case, backward))
    if not counted.calls:
        return None, "the run on CPU made no call of it (the program XLA:CPU runs has none)"
    return counted, ""
