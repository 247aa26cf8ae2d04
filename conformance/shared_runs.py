"""One run of a case that every check reading its result shares.

The fixed-shape checks of one case (values' and output sharding's reading of the result,
determinism's first call, the dtype check at the case's own dtype) share one run
(:func:`shared_run`). A Pallas kernel's run in TPU interpret mode is the costly one (every DMA, load
and store a host callback on every simulated device, 1-3 s a case on 8 devices, its compile most
of it), and the races check runs the
same case again with race detection: so a Pallas kernel's shared run *is* that run, with race
detection on and the interpreter's end of each ``pallas_call`` and its race reports noted
(:func:`watched_run`), and the races check reads it (:func:`conformance.checks.pallas.check_races`).
Race detection costs a run about what it costs without (1.6-1.8 s against 1.8-1.9 s for the
all-reduce ring on 8 devices, 1.2 s against 1.0-1.1 s for the HBM reduce-scatter on 5), and it
changes no value. A check that needs a run of its own says why: determinism's second call, the other
DMA mode, the eager path, a bad input.

XLA's ragged all-to-all's groups are counted in a run of their own of the case's forward or backward
pass (:func:`counted_run`: each call of the op hands its groups' bytes to a callback), which every bytes check
of the case reads: the collectives check's, and the 16- and 8-bit bytes' for each target (TPU and
CUDA), whose modules are one pass's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools

import jax
import numpy as np

from conformance import compat, runner
from conformance.runner import Case
from conformance.targets import cpu_ragged_all_to_all


@dataclasses.dataclass(frozen=True)
class WatchedRun:
    """A Pallas kernel's run in interpret mode with race detection, and what the interpreter said."""

    inputs64: tuple[np.ndarray, ...]
    out: jax.Array
    #: Each ``pallas_call``'s end (:class:`conformance.compat.InterpretedCallEnd`).
    ends: tuple[compat.InterpretedCallEnd, ...]
    #: The interpreter's race reports made during the run.
    reports: tuple[str, ...]


def watched(case: Case) -> bool:
    """Whether ``case``'s shared run is a :class:`WatchedRun`: a Pallas kernel in interpret mode."""
    return runner.interpreted(case)


@functools.cache
def watched_run(case: Case) -> WatchedRun | None:
    """``case`` run once with race detection, the interpreter watched; ``None`` where this JAX's
    interpreter cannot be watched (then the races check runs and says why itself)."""
    with contextlib.ExitStack() as watching:
        try:
            ends = watching.enter_context(compat.watch_interpreted_calls())
            reports = watching.enter_context(compat.race_reports())
        except compat.HostLimit:
            return None
        inputs64, out = runner.execute(case, detect_races=True)
    return WatchedRun(inputs64, out, tuple(ends), tuple(reports))


def shared_run(case: Case) -> tuple[tuple[np.ndarray, ...], jax.Array]:
    """The run of ``case`` the checks reading its result share: (float64 inputs, output)."""
    run = watched_run(case) if watched(case) else None
    return (run.inputs64, run.out) if run is not None else runner.execute_cached(case)


@functools.cache
def counted_run(case: Case, backward: bool) -> cpu_ragged_all_to_all.Delivered:
    """What XLA's ragged all-to-all delivers in one run on CPU of ``case``'s forward pass (or, with
    ``backward``, its VJP on the case's cotangent),
    :func:`conformance.targets.cpu_ragged_all_to_all.delivered_by`.
    A run that raises is not held: the next check to ask runs it again and names itself."""
    inputs = runner.place(case, runner.make_inputs(case))
    if backward:
        cotangent = jax.device_put(runner.make_cotangent(case), runner.expected_out_sharding(case))
        return cpu_ragged_all_to_all.delivered_by(runner.jitted_pullback(case), *inputs, cotangent)
    return cpu_ragged_all_to_all.delivered_by(runner.jitted_for(case), *inputs)


def release() -> None:
    """Drop the runs held (with :func:`conformance.runner.release_cases`)."""
    watched_run.cache_clear()
    counted_run.cache_clear()
