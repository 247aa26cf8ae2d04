"""Collective matmul over a ring: all-gather the LHS while multiplying, via ``ppermute``.

Problem. ``lhs[M, K]`` is sharded by rows over a mesh axis of n devices and
``rhs[K, N]`` by columns; device d must produce ``lhs @ rhs[:, cols_d]``, i.e.
every row block of ``lhs`` against its own columns. XLA's baseline all-gathers
``lhs`` first and only then multiplies, so the matmul waits for the whole
gather. Here the gather is cut into ring steps and each step's transfer is
issued *before* the matmul of the block already in hand, so the two overlap.

Unidirectional ring. Device d starts with row block d. At step s it holds the
block of device ``(d + s) mod n`` (blocks travel one hop "left", j -> j-1,
per step). It sends that block on, then multiplies it into output rows
``[(d + s) mod n] * m ...`` of its column block. After n-1 transfers every
device has seen every block; each device received exactly (n-1)/n of ``lhs``,
the minimum for this problem.

Bidirectional ring. Each row block is cut in two: the top ``ceil(m/2)`` rows
travel left and the bottom ``floor(m/2)`` rows travel right, so at step s
device d holds the top half of block ``d + s`` and the bottom half of block
``d - s`` (mod n). Both directions of every link carry data at once and each
transfer is half the size, which halves the per-step latency on bidirectional
interconnects (TPU ICI) for the same total bytes. An odd m is exact: the halves
are ``ceil`` and ``floor`` (never ``m // 2`` twice); with m == 1 the bottom half is
empty and only the leftward ring runs.

Backward pass. Both rings are ``jax.custom_vjp`` functions whose backward is
rings too (the schedules live in :mod:`conformance.kernels._ring`). With ``ct`` the
cotangent of this device's output columns:

* ``d_rhs[:, cols_d] = lhs.T @ ct``: the gather ring runs again over ``lhs``
  (recomputed rather than saved: ``(n-1)/n`` of ``lhs`` travels again, and no
  ``[M, K]`` residual is kept per device), each block contracted with its rows
  of ``ct``;
* ``d_lhs[rows_d] = sum_j ct[rows_d, cols_j] @ rhs[:, cols_j].T``: a sum over
  devices, scattered by rows, i.e. a matmul + reduce-scatter, done by the
  reduce-scatter ring with float32 accumulators for sub-32-bit floats.

Neither needs an all-reduce or an all-gather: the backward's collectives are
collective-permutes only, which the suite's backward audit checks.

Limits. The rings run over one mesh axis; other mesh axes are replicated.
The loop is unrolled in Python (n is static), which keeps each transfer a
separate collective-permute XLA can schedule against the matmuls; for very
large n a ``fori_loop`` form would compile faster. Sub-32-bit floats accumulate
in float32 (int8 in int32) and are rounded once to the result dtype: the inputs'
or, for float8 and int8 operands, the wider ``out_dtype`` the caller names
(``conformance.dtypes``); blocks travel in the operands' dtype.
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
from conformance.kernels.allgather_matmul._common import DTYPES, validate


def _forward(
    lhs_block: jax.Array,
    rhs_block: jax.Array,
    *,
    axis_name: str,
    bidirectional: bool,
    out_dtype: object = None,
    paced: bool = True,
) -> jax.Array:
    n = lax.axis_size(axis_name)
    m = lhs_block.shape[0]
    result = out_dtype or lhs_block.dtype
    out = jnp.zeros((m * n, rhs_block.shape[1]), result)

    def multiply_into_rows(owner: jax.Array, first: int, rows: jax.Array) -> jax.Array:
        nonlocal out
        product = dot(rows, unmerged(rhs_block, beside=owner)).astype(result)
        out = lax.dynamic_update_slice(out, product, (owner * m + first, 0))
        return product

    ring_gather_visit(lhs_block, axis_name, multiply_into_rows, bidirectional=bidirectional, paced=paced)
    return out


def _backward(
    lhs_block: jax.Array,
    rhs_block: jax.Array,
    ct: jax.Array,
    *,
    axis_name: str,
    bidirectional: bool,
    out_dtype: object = None,
) -> tuple[jax.Array, jax.Array]:
    m = lhs_block.shape[0]
    with jax.named_scope("d_rhs_gather_ring"):
        d_rhs = jnp.zeros(rhs_block.shape, dot(lhs_block[:1].T, ct[:1]).dtype)

        def contract_with_ct_rows(owner: jax.Array, first: int, rows: jax.Array) -> jax.Array:
            nonlocal d_rhs
            ct_rows = lax.dynamic_slice_in_dim(ct, owner * m + first, rows.shape[0])
            d_rhs = d_rhs + dot(rows.T, ct_rows)
            return d_rhs

        ring_gather_visit(lhs_block, axis_name, contract_with_ct_rows, bidirectional=bidirectional)
    with jax.named_scope("d_lhs_reduce_scatter_ring"):

        def contribution(owner: jax.Array, first: int, rows: int) -> jax.Array:
            return dot(lax.dynamic_slice_in_dim(ct, owner * m + first, rows), rhs_block.T)

        d_lhs = ring_reduce_scatter(contribution, m, axis_name, bidirectional=bidirectional)
    return d_lhs.astype(lhs_block.dtype), d_rhs.astype(rhs_block.dtype)


_shard_mapped = shard_mapped_ring(
    _forward, _backward, specs=lambda axis: ((P(axis, None), P(None, axis)), P(None, axis))
)


@conformance.register(
    "allgather_matmul",
    name="ring_allgather_matmul_unidirectional",
    differentiable=True,
    unpaced=unpaced(_shard_mapped, bidirectional=False),
    dtypes=DTYPES,
    description="one ring direction; transfer of block s+1 overlaps the matmul of block s",
)
def ring_allgather_matmul_unidirectional(
    lhs: jax.Array, rhs: jax.Array, *, mesh: jax.sharding.Mesh, axis_name: str, out_dtype: object = None
) -> jax.Array:
    validate("ring_allgather_matmul_unidirectional", lhs, rhs, mesh, axis_name)
    return _shard_mapped(lhs, rhs, mesh, axis_name, bidirectional=False, out_dtype=out_dtype)


@conformance.register(
    "allgather_matmul",
    name="ring_allgather_matmul_bidirectional",
    bidirectional=True,
    differentiable=True,
    unpaced=unpaced(_shard_mapped, bidirectional=True),
    dtypes=DTYPES,
    description="half of each row block travels each way round the ring",
)
def ring_allgather_matmul_bidirectional(
    lhs: jax.Array, rhs: jax.Array, *, mesh: jax.sharding.Mesh, axis_name: str, out_dtype: object = None
) -> jax.Array:
    validate("ring_allgather_matmul_bidirectional", lhs, rhs, mesh, axis_name)
    return _shard_mapped(lhs, rhs, mesh, axis_name, bidirectional=True, out_dtype=out_dtype)
