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

Limits. The rings run over one mesh axis; other mesh axes are replicated.
The loop is unrolled in Python (n is static), which keeps each transfer a
separate collective-permute XLA can schedule against the matmuls; for very
large n a ``fori_loop`` form would compile faster. Sub-32-bit floats accumulate
in float32 and are rounded once to the input dtype.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

import conformance
from kernels.allgather_matmul._common import local_matmul, validate


def ring_perm(n: int, shift: int) -> list[tuple[int, int]]:
    """Source->target pairs moving every device's buffer ``shift`` hops along the ring."""
    return [(j, (j + shift) % n) for j in range(n)]


def _unidirectional_body(lhs_block: jax.Array, rhs_block: jax.Array, *, axis_name: str) -> jax.Array:
    n = lax.axis_size(axis_name)
    me = lax.axis_index(axis_name)
    m = lhs_block.shape[0]
    out = jnp.zeros((m * n, rhs_block.shape[1]), lhs_block.dtype)
    block = lhs_block  # at step s: row block of device (me + s) % n
    for step in range(n):
        with jax.named_scope(f"ring_step_{step}"):
            if step < n - 1:
                # Issue the transfer first so it overlaps the matmul below.
                next_block = lax.ppermute(block, axis_name, ring_perm(n, -1))
            owner = (me + step) % n
            out = lax.dynamic_update_slice(out, local_matmul(block, rhs_block), (owner * m, 0))
            if step < n - 1:
                block = next_block
    return out


def _bidirectional_body(lhs_block: jax.Array, rhs_block: jax.Array, *, axis_name: str) -> jax.Array:
    n = lax.axis_size(axis_name)
    me = lax.axis_index(axis_name)
    m = lhs_block.shape[0]
    top_rows = (m + 1) // 2  # ceil: the top half is never the empty one
    bottom_rows = m - top_rows
    out = jnp.zeros((m * n, rhs_block.shape[1]), lhs_block.dtype)
    with jax.named_scope("own_block"):
        top = lhs_block[:top_rows]  # travels left: at step s, top half of block (me + s)
        bottom = lhs_block[top_rows:]  # travels right: at step s, bottom half of block (me - s)
        next_top = lax.ppermute(top, axis_name, ring_perm(n, -1)) if n > 1 else top
        next_bottom = lax.ppermute(bottom, axis_name, ring_perm(n, +1)) if n > 1 and bottom_rows else bottom
        out = lax.dynamic_update_slice(out, local_matmul(lhs_block, rhs_block), (me * m, 0))
    for step in range(1, n):
        with jax.named_scope(f"ring_step_{step}"):
            top, bottom = next_top, next_bottom
            if step < n - 1:
                next_top = lax.ppermute(top, axis_name, ring_perm(n, -1))
                if bottom_rows:
                    next_bottom = lax.ppermute(bottom, axis_name, ring_perm(n, +1))
            top_owner = (me + step) % n
            out = lax.dynamic_update_slice(out, local_matmul(top, rhs_block), (top_owner * m, 0))
            if bottom_rows:
                bottom_owner = (me - step) % n
                out = lax.dynamic_update_slice(
                    out, local_matmul(bottom, rhs_block), (bottom_owner * m + top_rows, 0)
                )
    return out


def _shard_mapped(body, lhs, rhs, mesh, axis_name):
    return jax.shard_map(
        functools.partial(body, axis_name=axis_name),
        mesh=mesh,
        in_specs=(P(axis_name, None), P(None, axis_name)),
        out_specs=P(None, axis_name),
    )(lhs, rhs)


@conformance.register(
    "allgather_matmul",
    name="ring_allgather_matmul_unidirectional",
    description="one ring direction; transfer of block s+1 overlaps the matmul of block s",
)
def ring_allgather_matmul_unidirectional(
    lhs: jax.Array, rhs: jax.Array, *, mesh: jax.sharding.Mesh, axis_name: str
) -> jax.Array:
    validate("ring_allgather_matmul_unidirectional", lhs, rhs, mesh, axis_name)
    return _shard_mapped(_unidirectional_body, lhs, rhs, mesh, axis_name)


@conformance.register(
    "allgather_matmul",
    name="ring_allgather_matmul_bidirectional",
    description="half of each row block travels each way round the ring",
)
def ring_allgather_matmul_bidirectional(
    lhs: jax.Array, rhs: jax.Array, *, mesh: jax.sharding.Mesh, axis_name: str
) -> jax.Array:
    validate("ring_allgather_matmul_bidirectional", lhs, rhs, mesh, axis_name)
    return _shard_mapped(_bidirectional_body, lhs, rhs, mesh, axis_name)
