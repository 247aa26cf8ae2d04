"""Family ``reduce_scatter``: sum the devices' partials and scatter the sum by rows (``lax.psum_scatter``).

``fn(x, *, mesh, axis_name)``: ``x[n, M, cols]`` sharded ``P(axis_name, None, None)`` holds each
device's ``[M, cols]`` partial on the leading mesh axis (:mod:`conformance.specs.reduction` argues the
form); the result is ``x.sum(0)``, ``[M, cols]``, sharded ``P(axis_name, None)``: device ``d`` ends
with row block ``d`` of the sum. On a 2-D mesh the other axis is replicated.

``scatter_dimension=1`` (a registration option; 0 is the form above) declares a kernel that scatters
each device's partial along its last dim, as ``lax.psum_scatter(..., scatter_dimension=1)``: it is
called with the partials transposed, ``x[n, cols, M]``, and returns ``[cols, M]`` sharded
``P(None, axis_name)``, device ``d`` ending with column block ``d`` (:meth:`FamilySpec.transposed`:
the same sums, tolerances, bytes and gradients on the swapped arrays; ``rows_per_shard`` is then the
result's columns per device).

One family and not a mode of the all-reduce's: the two differ in what a device ends with (its block,
or the whole sum), so in the result's sharding, in the bytes a device must receive and in the
backward pass, each of which the checks read off the spec.

Bytes: each device must receive the n - 1 other partials' contributions to its rows, ``(n-1)/n`` of
one partial; it may receive that much in the partial sums' dtype (float32 for 16-bit floats, summed
in float32 and rounded once: what keeps the rounding per hop out), and no more. Data may move by
collective-permutes (a ring) or XLA's reduce-scatter.

Gradient: every partial adds to every element of the result, so each device's gradient is the whole
cotangent: ``d_x[d] = ct``. The backward gathers the cotangent's row blocks, ``(n-1)/n`` of it per
device, by all-gather or collective-permutes: the transpose of a reduce-scatter is an all-gather.
"""

from __future__ import annotations

from jax.sharding import PartitionSpec as P

from conformance.specs import reduction
from conformance.specs.base import Dims, FamilySpec, RegistrationOption, partial_itemsize


def _partial_sums_received(d: Dims, n: int, itemsize: int) -> int:
    """The cap: the least a reduce-scatter receives, in the partial sums' dtype."""
    return reduction.scattered_blocks_received(d, n, partial_itemsize(itemsize))


#: ``scatter_dimension``, the family's registration option: the dim of each device's partial the sum
#: is scattered along (``lax.psum_scatter``'s ``scatter_dimension``).
SCATTER_DIMENSION_OPTION = RegistrationOption(
    default=0,
    accepts=lambda v: type(v) is int and v in (0, 1),
    expects="0 or 1",
    doc="the dim of each device's partial the sum is scattered along: 0, its rows (x[n, M, cols] -> "
    "[M, cols] P(axis, None)); 1, its last (x[n, cols, M] -> [cols, M] P(None, axis))",
    derive=lambda spec, _: spec.transposed(),
)

REDUCE_SCATTER = FamilySpec(
    name="reduce_scatter",
    **{
        **reduction.SHARED_FIELDS,
        "registration_options": {
            **reduction.SHARED_FIELDS["registration_options"],
            "scatter_dimension": SCATTER_DIMENSION_OPTION,
        },
    },
    summary="x[n,M,cols] P(axis) (each device's partial) -> x.sum(0), [M,cols] P(axis)",
    out_spec=lambda a: P(a, None),
    allowed_collectives=frozenset({"collective-permute", "reduce-scatter"}),
    max_received_bytes=_partial_sums_received,
    min_received_bytes=reduction.scattered_blocks_received,
    byte_bound_text="each device may receive at most (n-1)/n of one partial, in the partial sums' dtype",
    backward_allowed_collectives=frozenset({"all-gather", "collective-permute"}),
    backward_max_received_bytes=reduction.scattered_blocks_received,
    backward_byte_bound_text="one gather of the cotangent: (n-1)/n of it per device",
    backward_exact="each device's gradient is the whole cotangent, its blocks gathered",
    accuracy_baseline_does="widens the partials to float32, reduce-scatters them (lax.psum_scatter) and "
    "rounds to the input dtype once, after the sum",
    accuracy_how_to_match="carry the partial sums in float32 between ring steps (2x the bytes of a 16-bit "
    "sum, which the byte bound allows) and cast once at the end; a reduce-scatter of 16-bit partials, XLA's "
    "own psum_scatter of the inputs as they are included, rounds at every addition",
)

#: This module's family (:mod:`conformance.specs` collects it).
SPEC = REDUCE_SCATTER
