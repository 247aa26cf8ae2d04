"""Bidirectional rings whose halves are not halves: a third of each block one way, the rest the other.

Exact in values, no more bytes in all, transfers as independent of the matmuls as the balanced
ring's: every check but the one that weighs the ring's directions passes them, while one direction
of every link carries twice the other's bytes. Each declares itself bidirectional, as the built-ins
do, and must be rejected by the direction-balance check (at the even fixed shape: 4 rows split 1 and
3; the odd shape's 3 rows split 1 and 2, the one-row difference an odd block always has).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

import conformance
from conformance.kernels._reduction import validate as validate_partials
from conformance.kernels._ring import accumulator_dtype, dot, ring_gather_visit, ring_perm, unmerged
from conformance.kernels.allgather_matmul._common import validate as validate_matmul

EXPECTED_REJECTION: dict[str, str] = {
    "broken_agmm_bidirectional_split_in_thirds": "test_direction_balance",
    "broken_rs_bidirectional_split_in_thirds": "test_direction_balance",
}
EXPECTED_MESSAGE: dict[str, str] = {
    name: "a ring declared bidirectional moves more of each block one way than the other"
    for name in EXPECTED_REJECTION
}


def thirds(m: int) -> tuple[int, int]:
    """A third of ``m`` rows leftwards (``(m + 1) // 3``, where the halves are ``(m + 1) // 2``), the
    rest rightwards; a block too small to cut that way goes left whole."""
    left = (m + 1) // 3 or m
    return left, m - left


@conformance.register(
    "allgather_matmul", name="broken_agmm_bidirectional_split_in_thirds", bidirectional=True
)
def broken_agmm_bidirectional_split_in_thirds(lhs, rhs, *, mesh, axis_name):
    """The built-in bidirectional gather ring, paced as it is, with a third of each lhs block going
    left and two thirds right."""
    validate_matmul("broken_agmm_bidirectional_split_in_thirds", lhs, rhs, mesh, axis_name)

    def body(lhs_block, rhs_block):
        n, m = lax.axis_size(axis_name), lhs_block.shape[0]
        out = jnp.zeros((m * n, rhs_block.shape[1]), lhs_block.dtype)

        def multiply_into_rows(owner, first, rows):
            nonlocal out
            product = dot(rows, unmerged(rhs_block, beside=owner)).astype(lhs_block.dtype)
            out = lax.dynamic_update_slice(out, product, (owner * m + first, 0))
            return product

        ring_gather_visit(lhs_block, axis_name, multiply_into_rows, bidirectional=True, top_rows=thirds(m)[0])
        return out

    return jax.shard_map(
        body, mesh=mesh, in_specs=(P(axis_name, None), P(None, axis_name)), out_specs=P(None, axis_name)
    )(lhs, rhs)


@conformance.register("reduce_scatter", name="broken_rs_bidirectional_split_in_thirds", bidirectional=True)
def broken_rs_bidirectional_split_in_thirds(x, *, mesh, axis_name):
    """The bidirectional reduce-scatter ring with a third of each block's accumulator going left."""
    validate_partials("broken_rs_bidirectional_split_in_thirds", x, mesh, axis_name)

    def body(block):
        partial = block[0].astype(accumulator_dtype(block.dtype))
        n, me = lax.axis_size(axis_name), lax.axis_index(axis_name)
        m = partial.shape[0] // n
        left_rows, right_rows = thirds(m)

        def rows(owner, first, count):
            return lax.dynamic_slice_in_dim(partial, owner * m + first, count)

        left = rows(lax.rem(me + 1, n), 0, left_rows)
        right = rows(lax.rem(me - 1 + n, n), left_rows, right_rows)
        for step in range(1, n):
            left = lax.ppermute(left, axis_name, ring_perm(n, -1)) + rows(
                lax.rem(me + step + 1, n), 0, left_rows
            )
            if right_rows:
                owner = lax.rem(me - step - 1 + 2 * n, n)
                right = lax.ppermute(right, axis_name, ring_perm(n, +1)) + rows(owner, left_rows, right_rows)
        summed = jnp.concatenate([left, right]) if right_rows else left
        return summed.astype(block.dtype)

    return jax.shard_map(body, mesh=mesh, in_specs=P(axis_name, None, None), out_specs=P(axis_name, None))(x)
