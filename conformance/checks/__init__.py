"""The checks, one module per concern, each a plain function of a :class:`~conformance.runner.Case`.

=====================  ==========================================================================
module                 checks
=====================  ==========================================================================
``values``             values, output_sharding, dtype, determinism, eager
``collectives``        collectives, cross_lowering, lowered_bytes, tpu_bytes (and the byte tables)
``overlap``            overlap (the dataflow of each module)
``tpu_schedule``       tpu_schedule (overlap in the run order the real TPU compiler schedules)
``tpu_memory``         tpu_memory (peak memory the real TPU compiler reserves, beside the baseline's)
``tpu_pod``            tpu_pod (compiles for 64 and 256 chips, or refuses naming the limit)
``gpu_compile``        gpu_schedule, gpu_memory, gpu_bytes (what XLA:GPU compiles for 8 and 16 H100s)
``autodiff``           gradients, backward_collectives
``accuracy``           accuracy, backward_accuracy
``pallas``             tpu_layout, races, barrier_protocol
``bad_inputs``         bad_inputs
``ring_balance``       direction_balance, dma_direction_balance (a bidirectional ring's bytes per direction)
``reductions``         other_reductions (the min and max a reduction kernel declares)
=====================  ==========================================================================

Each check raises :class:`ConformanceFailure` (an ``AssertionError``) whose message names the
implementation, family, mesh, dtype and shapes, pinpoints the first wrong shard or index, and ends
with a one-line replay command; it returns the records it made for the run's tables. Each module
lists its checks in ``CHECKS`` (:class:`~conformance.checks.base.Check`: name, function, tables);
:data:`CHECKS` here is every one by name, which the pytest tests, absltest, the replay command and
the worker process run through :func:`conformance.run.run_check`; each declares the axes of its
pytest test (:class:`~conformance.checks.base.Axes`), from which :mod:`conformance.family_tests`
makes the test. Adding a check is one module here (it joins :data:`MODULES` by itself) and the
self-test kernel that shows it can fail.
"""

from __future__ import annotations

import importlib
import pkgutil
import types

from conformance.checks import (
    accuracy,
    autodiff,
    bad_inputs,
    collectives,
    gpu_compile,
    overlap,
    pallas,
    tpu_memory,
    tpu_pod,
    tpu_schedule,
    values,
)
from conformance.checks.accuracy import (
    BACKWARD_ACCURACY_CURE,
    BACKWARD_ACCURACY_HINT,
    AccuracyRecord,
    baseline_of,
    check_accuracy,
    check_backward_accuracy,
)
from conformance.checks.autodiff import (
    DEFENSIVE_ALL_REDUCE_HINT,
    BackwardAudit,
    assert_backward_collectives,
    audit_backward,
    check_backward_collectives,
    check_gradients,
)
from conformance.checks.bad_inputs import check_bad_inputs
from conformance.checks.base import Check, ConformanceFailure, NotJudged, fail, records_of
from conformance.checks.collectives import (
    ByteRecord,
    allowed_collectives,
    check_collectives,
    check_cross_lowering,
    check_lowered_bytes,
    compiled_collectives,
)
from conformance.checks.overlap import PALLAS_OVERLAP, OverlapRecord, check_overlap
from conformance.checks.pallas import TpuLayoutRecord, check_barrier_protocol, check_races, check_tpu_layout
from conformance.checks.tpu_memory import TpuMemoryRecord, check_tpu_memory
from conformance.checks.tpu_schedule import TpuScheduleRecord, check_tpu_schedule
from conformance.checks.values import (
    check_determinism,
    check_dtype,
    check_eager,
    check_output_sharding,
    check_values,
)


def _modules() -> tuple[types.ModuleType, ...]:
    """The built-in check modules in their order, then any other module of this package that lists
    ``CHECKS`` (a new check joins by being a module here)."""
    builtin = (
        values,
        collectives,
        overlap,
        tpu_schedule,
        tpu_memory,
        tpu_pod,
        gpu_compile,
        autodiff,
        accuracy,
        pallas,
        bad_inputs,
    )
    known = {m.__name__ for m in builtin} | {f"{__name__}.base"}
    more = []
    for info in pkgutil.iter_modules(__path__, f"{__name__}."):
        if info.name not in known:
            module = importlib.import_module(info.name)
            if hasattr(module, "CHECKS"):
                more.append(module)
    return (*builtin, *more)


#: The modules whose ``CHECKS`` make up the suite's checks.
MODULES = _modules()

#: Name -> :class:`Check` (callable like its function), for every way of running a check; in the
#: order of :data:`MODULES` (the run's tables follow it).
CHECKS: dict[str, Check] = {check.name: check for module in MODULES for check in module.CHECKS}

__all__ = [
    "BACKWARD_ACCURACY_CURE",
    "BACKWARD_ACCURACY_HINT",
    "CHECKS",
    "DEFENSIVE_ALL_REDUCE_HINT",
    "PALLAS_OVERLAP",
    "AccuracyRecord",
    "BackwardAudit",
    "ByteRecord",
    "Check",
    "ConformanceFailure",
    "NotJudged",
    "OverlapRecord",
    "TpuLayoutRecord",
    "TpuMemoryRecord",
    "TpuScheduleRecord",
    "allowed_collectives",
    "assert_backward_collectives",
    "audit_backward",
    "baseline_of",
    "check_accuracy",
    "check_backward_accuracy",
    "check_backward_collectives",
    "check_bad_inputs",
    "check_barrier_protocol",
    "check_collectives",
    "check_cross_lowering",
    "check_determinism",
    "check_dtype",
    "check_eager",
    "check_gradients",
    "check_lowered_bytes",
    "check_output_sharding",
    "check_overlap",
    "check_races",
    "check_tpu_layout",
    "check_tpu_memory",
    "check_tpu_schedule",
    "check_values",
    "compiled_collectives",
    "fail",
    "records_of",
]
