"""Reduce-scatter over a ring of ``ppermute`` s, uni- and bidirectional.

Problem. Each of n devices holds an ``[M, cols]`` partial; device ``d`` must end with row block ``d``
(``m = M/n`` rows) of the sum of all n partials. XLA's ``psum_scatter`` does it in one collective;
here the sum travels: an accumulator for each row block goes round the ring and every device adds
its own rows of that block as it passes (the schedule of the matmul + reduce-scatter rings,
:mod:`conformance.kernels._ring`, with a slice of the partial for a matmul). After n - 1 hops the
accumulator of block ``d`` arrives at ``d`` holding every device's contribution.
Bidirectionally the top ``ceil(m/2)`` rows of each block travel left and the rest right, each half
the size. Each device sends ``(n-1) m`` rows of accumulator, ``(n-1)/n`` of one partial: the least.

Accuracy. 16-bit floats are summed in float32 accumulators, which travel between hops (2x the bytes
of a 16-bit sum, within the family's bound) and are rounded once at the end: a ring that rounds its
partial sums to bfloat16 at each hop is 1.5-2x less accurate than XLA's own float32 reduce-scatter.

Backward. Every partial adds to every element of the result, so each device's gradient is the whole
cotangent: a gather ring brings the n - 1 row blocks of the cotangent it lacks, ``(n-1)/n`` of it,
by collective-permutes.

Along the partials' columns (``scatter_dimension=1``, the family's transposed form) the same ring
moves column blocks.

Limits: one mesh axis (others replicated). The steps are a ``fori_loop``, so a ring of 256 compiles
in the time of a ring of 2; with no matmul to hide the transfers behind there is no schedule to pace.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

import conformance
from conformance.kernels._reduction import COMBINE, REDUCTIONS, combine, validate
from conformance.kernels._ring import accumulator_dtype, halves, ring_perm
from conformance.specs.reduce_scatter import REDUCE_SCATTER


def scattered_sum(
    partial: jax.Array, axis_name: str, *, bidirectional: bool, reduction: str = "add", axis: int = 0
) -> jax.Array:
    """This device's row block of the sum of every device's ``partial``, in the accumulator dtype.

    At step s the leftward accumulator on device d is that of block ``d + s + 1`` and the rightward
    one that of block ``d - s - 1``; each receives its neighbour's and adds this device's rows of it.
    After n - 1 steps both are block d's, whole. ``reduction``: ``"min"`` or ``"max"`` combine by
    ``minimum``/``maximum`` instead of adding. ``axis``: the dim of ``partial`` scattered (its rows, or
    1: its columns, each "row" above then a column)."""
    op = COMBINE[reduction]
    n = lax.axis_size(axis_name)
    me = lax.axis_index(axis_name)
    m = partial.shape[axis] // n
    top_rows, bottom_rows = halves(m, bidirectional=bidirectional)
    acc = accumulator_dtype(partial.dtype)

    def rows(owner: jax.Array, first: int, count: int) -> jax.Array:
        return lax.dynamic_slice_in_dim(partial, owner * m + first, count, axis=axis).astype(acc)

    def step(s: jax.Array, carry: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
        top, bottom = carry
        top = op(lax.ppermute(top, axis_name, ring_perm(n, -1)), rows(lax.rem(me + s + 1, n), 0, top_rows))
        if bottom_rows:
            owner = lax.rem(me - s - 1 + 2 * n, n)
            bottom = op(lax.ppermute(bottom, axis_name, ring_perm(n, +1)), rows(owner, top_rows, bottom_rows))
        return top, bottom

    first = (rows(lax.rem(me + 1, n), 0, top_rows), rows(lax.rem(me - 1 + n, n), top_rows, bottom_rows))
    top, bottom = lax.fori_loop(1, n, step, first)
    return jnp.concatenate([top, bottom], axis=axis) if bottom_rows else top


def gathered_rows(block: jax.Array, axis_name: str, *, bidirectional: bool, axis: int = 0) -> jax.Array:
    """Every device's row ``block`` in ring order, ``[n * m, ...]``, on every device (bit-exact): at
    step s the top rows of block ``d + s`` arrive from the right and the bottom rows of ``d - s``
    from the left (``axis``: the dim of ``block`` gathered, its rows or 1, its columns)."""
    n = lax.axis_size(axis_name)
    me = lax.axis_index(axis_name)
    m = block.shape[axis]
    top_rows, bottom_rows = halves(m, bidirectional=bidirectional)
    shape = list(block.shape)
    shape[axis] = n * m
    out = lax.full_like(block, 0, shape=tuple(shape))  # varying over the axis, as block
    out = lax.dynamic_update_slice_in_dim(out, block, me * m, axis)

    def step(s: jax.Array, carry: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
        out, top, bottom = carry
        top = lax.ppermute(top, axis_name, ring_perm(n, -1))
        out = lax.dynamic_update_slice_in_dim(out, top, lax.rem(me + s, n) * m, axis)
        if bottom_rows:
            bottom = lax.ppermute(bottom, axis_name, ring_perm(n, +1))
            out = lax.dynamic_update_slice_in_dim(out, bottom, lax.rem(me - s + n, n) * m + top_rows, axis)
        return out, top, bottom

    first = (lax.slice_in_dim(block, 0, top_rows, axis=axis), lax.slice_in_dim(block, top_rows, m, axis=axis))
    out, _, _ = lax.fori_loop(1, n, step, (out, *first))
    return out


def _per_device(
    block: jax.Array, *, axis_name: str, bidirectional: bool, reduction: str, scatter_dimension: int
) -> jax.Array:
    @jax.custom_vjp
    def ring(x: jax.Array) -> jax.Array:
        summed = scattered_sum(
            x[0], axis_name, bidirectional=bidirectional, reduction=reduction, axis=scatter_dimension
        )
        return summed.astype(x.dtype)

    def forward(x: jax.Array) -> tuple[jax.Array, None]:
        return ring(x), None

    def backward(_: None, ct: jax.Array) -> tuple[jax.Array]:
        return (gathered_rows(ct, axis_name, bidirectional=bidirectional, axis=scatter_dimension)[None],)

    ring.defvjp(forward, backward)
    return ring(block)


def _shard_mapped(
    x: jax.Array,
    mesh: jax.sharding.Mesh,
    axis_name: str,
    *,
    bidirectional: bool,
    reduction: str = "add",
    scatter_dimension: int = 0,
) -> jax.Array:
    per_device = functools.partial(
        _per_device,
        axis_name=axis_name,
        bidirectional=bidirectional,
        reduction=reduction,
        scatter_dimension=scatter_dimension,
    )
    out_specs = P(None, axis_name) if scatter_dimension else P(axis_name, None)
    return jax.shard_map(per_device, mesh=mesh, in_specs=P(axis_name, None, None), out_specs=out_specs)(x)


@conformance.register(
    "reduce_scatter",
    name="ring_reduce_scatter_unidirectional",
    differentiable=True,
    dtypes=REDUCE_SCATTER.dtypes,
    reductions=REDUCTIONS,
    description="float32 accumulators travel one way round the ring, each device adding its rows",
)
def ring_reduce_scatter_unidirectional(
    x: jax.Array, *, mesh: jax.sharding.Mesh, axis_name: str, reduction: str = "add"
) -> jax.Array:
    validate("ring_reduce_scatter_unidirectional", x, mesh, axis_name)
    combine("ring_reduce_scatter_unidirectional", reduction)
    return _shard_mapped(x, mesh, axis_name, bidirectional=False, reduction=reduction)


@conformance.register(
    "reduce_scatter",
    name="ring_reduce_scatter_bidirectional",
    bidirectional=True,
    differentiable=True,
    dtypes=REDUCE_SCATTER.dtypes,
    reductions=REDUCTIONS,
    description="the top half of each block's accumulator travels left, the bottom half right",
)
def ring_reduce_scatter_bidirectional(
    x: jax.Array, *, mesh: jax.sharding.Mesh, axis_name: str, reduction: str = "add"
) -> jax.Array:
    validate("ring_reduce_scatter_bidirectional", x, mesh, axis_name)
    combine("ring_reduce_scatter_bidirectional", reduction)
    return _shard_mapped(x, mesh, axis_name, bidirectional=True, reduction=reduction)


@conformance.register(
    "reduce_scatter",
    name="ring_reduce_scatter_columns_bidirectional",
    bidirectional=True,
    differentiable=True,
    dtypes=REDUCE_SCATTER.dtypes,
    reductions=REDUCTIONS,
    scatter_dimension=1,
    description="the bidirectional ring scattering each partial's columns (scatter_dimension=1): the left "
    "half of each column block's accumulator travels left, the right half right",
)
def ring_reduce_scatter_columns_bidirectional(
    x: jax.Array, *, mesh: jax.sharding.Mesh, axis_name: str, reduction: str = "add"
) -> jax.Array:
    name = "ring_reduce_scatter_columns_bidirectional"
    validate(name, x, mesh, axis_name, scatter_dimension=1)
    combine(name, reduction)
    return _shard_mapped(x, mesh, axis_name, bidirectional=True, reduction=reduction, scatter_dimension=1)
