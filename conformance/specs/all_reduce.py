"""Family ``all_reduce``: sum the devices' partials, every device ending with the whole sum (``lax.psum``).

``fn(x, *, mesh, axis_name)``: ``x[n, M, cols]`` sharded ``P(axis_name, None, None)`` holds each
device's ``[M, cols]`` partial on the leading mesh axis (:mod:`conformance.specs.reduction`); the
result is ``x.sum(0)``, ``[M, cols]``, replicated (``P()``), every replica bitwise the same (a device
that sums in its own order gives a different one, which the output-sharding check rejects).

A family of its own beside ``reduce_scatter`` (whose docstring says why): a ring all-reduce is a
reduce-scatter and then an all-gather of the reduced blocks, so each device must receive ``(n-1)/n``
of one partial twice; it may receive both in the partial sums' dtype (float32 for 16-bit floats), and
no more. Data may move by collective-permutes, XLA's all-reduce, or its reduce-scatter and all-gather.

Gradient: the result is replicated and every partial adds to all of it, so each device's gradient is
the (replicated) cotangent itself: nothing moves in the backward pass (an all-reduce there is the
defensive one ``shard_map`` adds when it cannot tell the output is replicated).
"""

from __future__ import annotations

from jax.sharding import PartitionSpec as P

from conformance.specs import reduction
from conformance.specs.base import Dims, FamilySpec, partial_itemsize


def _reduced_and_gathered(d: Dims, n: int, itemsize: int) -> int:
    """The least a ring all-reduce receives: a reduce-scatter's, then the n - 1 reduced blocks."""
    return 2 * reduction.scattered_blocks_received(d, n, itemsize)


def _partial_sums_received(d: Dims, n: int, itemsize: int) -> int:
    """The cap: that much, in the partial sums' dtype."""
    return _reduced_and_gathered(d, n, partial_itemsize(itemsize))


ALL_REDUCE = FamilySpec(
    name="all_reduce",
    **{**reduction.SHARED_FIELDS, "bad_inputs": reduction.replicated_bad_inputs},
    summary="x[n,M,cols] P(axis) (each device's partial) -> x.sum(0), [M,cols] replicated, P()",
    out_spec=lambda a: P(),
    allowed_collectives=frozenset({"collective-permute", "all-reduce", "reduce-scatter", "all-gather"}),
    max_received_bytes=_partial_sums_received,
    min_received_bytes=_reduced_and_gathered,
    byte_bound_text="each device may receive at most twice (n-1)/n of one partial, in the partial sums' "
    "dtype",
    backward_allowed_collectives=frozenset(),
    backward_max_received_bytes=lambda d, n, itemsize: 0,
    backward_byte_bound_text="nothing moves: each device's gradient is the replicated cotangent",
    backward_exact="each device's gradient is the replicated cotangent, as it is",
    accuracy_baseline_does="widens the partials to float32, all-reduces them (lax.psum) and rounds to the "
    "input dtype once, after the sum",
    accuracy_how_to_match="carry the partial sums in float32 between ring steps and cast once at the end; "
    "an all-reduce of 16-bit partials, XLA's own psum of the inputs as they are included, rounds at every "
    "addition",
)

#: This module's family (:mod:`conformance.specs` collects it).
SPEC = ALL_REDUCE
