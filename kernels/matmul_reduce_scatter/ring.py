"""Matmul + reduce-scatter overlapped on a ring of ``ppermute`` s (uni- and bidirectional).

Problem. ``lhs[M, K]`` is sharded over a mesh axis of n devices along the
contraction K (``P(None, axis)``) and ``rhs[K, N]`` along its rows
(``P(axis, None)``). Device d holds ``lhs[:, K_d]`` and ``rhs[K_d, :]``, so it
can compute its *partial product* ``lhs[:, K_d] @ rhs[K_d, :]``, an ``[M, N]``
addend of the result. The result is sharded by rows (``P(axis, None)``): row
block j is the sum over all devices of their partials' block j. XLA's baseline
computes the whole partial and then reduce-scatters it; nothing overlaps.

Algorithm (the reduce-scatter ring of :mod:`conformance.kernels._ring`). An accumulator per
row block travels round the ring; each device adds its contribution to that
block as it passes, and computes its next contribution while the accumulator is
in flight. Unidirectional: at step s device d holds the accumulator of block
``(d + s + 1) mod n``, so after n - 1 hops it holds its own block, complete.
Bidirectional: the top ``ceil(m/2)`` rows of every block travel left and the
bottom ``floor(m/2)`` rows right, using both directions of every link with
transfers half the size. Each device sends ``(n-1) m N`` accumulator elements,
``(n-1)/n`` of one ``[M, N]`` partial product, the minimum, and never computes
more than its own ``[M, N]`` partial in total.

Precision. Accumulators of bfloat16/float16 inputs are float32 and the result
is rounded once at the end, so the error matches the baseline's (the suite's
accuracy check compares them on the same inputs). Rounding each hop's partial
sum to bfloat16 would halve the bytes and add a rounding per hop.

Backward pass (``jax.custom_vjp``, rings as well). The cotangent ``ct`` is
sharded like the output, by rows. Both gradients need every row block of
``ct``, and one gather ring provides them: as block j of ``ct`` passes, a
device writes ``d_lhs[rows_j, K_d] = ct_j @ rhs[K_d, :].T`` and accumulates
``d_rhs[K_d, :] += lhs[rows_j, K_d].T @ ct_j``. One gather of the cotangent,
``(n-1)/n`` of it, is the only communication: no all-reduce, no all-gather.

Limits. One mesh axis per call (other axes replicated); the ring is unrolled in
Python (n static). M and K must be multiples of n; any N.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

import conformance
from conformance.kernels._ring import (
    dot,
    ring_gather_visit,
    ring_reduce_scatter,
    shard_mapped_ring,
    unmerged,
    unpaced,
)
from conformance.kernels.matmul_reduce_scatter._common import DTYPES, validate


def _forward(
    lhs_block: jax.Array,
    rhs_block: jax.Array,
    *,
    axis_name: str,
    bidirectional: bool,
    out_dtype: object = None,
    paced: bool = True,
) -> jax.Array:
    m = lhs_block.shape[0] // lax.axis_size(axis_name)

    def contribution(owner: jax.Array, first: int, rows: int) -> jax.Array:
        lhs_rows = lax.dynamic_slice_in_dim(lhs_block, owner * m + first, rows)
        return dot(lhs_rows, unmerged(rhs_block, beside=owner))

    summed = ring_reduce_scatter(contribution, m, axis_name, bidirectional=bidirectional, paced=paced)
    return summed.astype(out_dtype or lhs_block.dtype)


def _backward(
    lhs_block: jax.Array,
    rhs_block: jax.Array,
    ct: jax.Array,
    *,
    axis_name: str,
    bidirectional: bool,
    out_dtype: object = None,
) -> tuple[jax.Array, jax.Array]:
    m = ct.shape[0]
    d_lhs = jnp.zeros(lhs_block.shape, lhs_block.dtype)
    d_rhs = jnp.zeros(rhs_block.shape, dot(lhs_block[:1].T, ct[:1]).dtype)

    def both_gradients(owner: jax.Array, first: int, ct_rows: jax.Array) -> tuple[jax.Array, jax.Array]:
        nonlocal d_lhs, d_rhs
        start = owner * m + first
        d_lhs_rows = dot(ct_rows, rhs_block.T).astype(d_lhs.dtype)
        d_lhs = lax.dynamic_update_slice(d_lhs, d_lhs_rows, (start, 0))
        lhs_rows = lax.dynamic_slice_in_dim(lhs_block, start, ct_rows.shape[0])
        d_rhs = d_rhs + dot(lhs_rows.T, ct_rows)
        return d_lhs_rows, d_rhs

    with jax.named_scope("cotangent_gather_ring"):
        ring_gather_visit(ct, axis_name, both_gradients, bidirectional=bidirectional)
    return d_lhs, d_rhs.astype(rhs_block.dtype)


_shard_mapped = shard_mapped_ring(
    _forward, _backward, specs=lambda axis: ((P(None, axis), P(axis, None)), P(axis, None))
)


@conformance.register(
    "matmul_reduce_scatter",
    name="ring_matmul_reduce_scatter_unidirectional",
    differentiable=True,
    unpaced=unpaced(_shard_mapped, bidirectional=False),
    dtypes=DTYPES,
    description="float32 accumulators travel one way; next contribution computed while in flight",
)
def ring_matmul_reduce_scatter_unidirectional(
    lhs: jax.Array, rhs: jax.Array, *, mesh: jax.sharding.Mesh, axis_name: str, out_dtype: object = None
) -> jax.Array:
    validate("ring_matmul_reduce_scatter_unidirectional", lhs, rhs, mesh, axis_name)
    return _shard_mapped(lhs, rhs, mesh, axis_name, bidirectional=False, out_dtype=out_dtype)


@conformance.register(
    "matmul_reduce_scatter",
    name="ring_matmul_reduce_scatter_bidirectional",
    bidirectional=True,
    differentiable=True,
    unpaced=unpaced(_shard_mapped, bidirectional=True),
    dtypes=DTYPES,
    description="top half of each accumulator travels left, bottom half right",
)
def ring_matmul_reduce_scatter_bidirectional(
    lhs: jax.Array, rhs: jax.Array, *, mesh: jax.sharding.Mesh, axis_name: str, out_dtype: object = None
) -> jax.Array:
    validate("ring_matmul_reduce_scatter_bidirectional", lhs, rhs, mesh, axis_name)
    return _shard_mapped(lhs, rhs, mesh, axis_name, bidirectional=True, out_dtype=out_dtype)
