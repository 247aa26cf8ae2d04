"""Broken ``matmul_reduce_scatter`` kernels (and broken gradients). The suite must reject each.

Loaded like any third-party module (``--kernels=...``); ``EXPECTED_REJECTION``
names the check meant to catch each one, and the self-test asserts it does.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

import conformance
from conformance.kernels._ring import dot, ring_perm, ring_reduce_scatter, with_ring_vjp
from conformance.kernels.matmul_reduce_scatter import ring as good_ring
from conformance.kernels.matmul_reduce_scatter._common import validate

EXPECTED_REJECTION: dict[str, str] = {
    "broken_mrs_allreduce_then_slice": "test_collectives",
    "broken_mrs_wrong_neighbour": "test_values",
    "broken_mrs_wrong_custom_vjp_gradient": "test_gradients",
    "broken_mrs_bfloat16_partial_sums": "test_accuracy",
    "broken_mrs_counts_own_partial_twice": "test_values",
}
#: broken implementation -> a phrase its failure message must contain
EXPECTED_MESSAGE: dict[str, str] = {
    "broken_mrs_allreduce_then_slice": "forbidden      : all-reduce",
    "broken_mrs_wrong_custom_vjp_gradient": "gradient d_",
    "broken_mrs_bfloat16_partial_sums": "to match it    : keep the partial sums in float32",
}


def _shard_mapped(per_device, lhs, rhs, mesh, axis_name):
    return jax.shard_map(
        per_device, mesh=mesh, in_specs=(P(None, axis_name), P(axis_name, None)), out_specs=P(axis_name, None)
    )(lhs, rhs)


@conformance.register("matmul_reduce_scatter", name="broken_mrs_allreduce_then_slice")
def broken_mrs_allreduce_then_slice(lhs, rhs, *, mesh, axis_name):
    """Right values, wrong collective: all-reduces the whole partial, then keeps its own rows."""
    n = validate("broken_mrs_allreduce_then_slice", lhs, rhs, mesh, axis_name)

    def per_device(lhs_block, rhs_block):
        m = lhs_block.shape[0] // n
        total = lax.psum(dot(lhs_block, rhs_block), axis_name)
        return lax.dynamic_slice_in_dim(total, lax.axis_index(axis_name) * m, m).astype(lhs_block.dtype)

    return _shard_mapped(per_device, lhs, rhs, mesh, axis_name)


@conformance.register("matmul_reduce_scatter", name="broken_mrs_wrong_neighbour")
def broken_mrs_wrong_neighbour(lhs, rhs, *, mesh, axis_name):
    """Sends each accumulator to the right-hand neighbour while the schedule assumes the left.

    On 2 devices left and right are the same device, so it is right there; on
    3 or more, partial sums land on devices that add the wrong block to them.
    """
    n = validate("broken_mrs_wrong_neighbour", lhs, rhs, mesh, axis_name)

    def per_device(lhs_block, rhs_block):
        m, me = lhs_block.shape[0] // n, lax.axis_index(axis_name)

        def contribution(owner):
            return dot(lax.dynamic_slice_in_dim(lhs_block, owner * m, m), rhs_block)

        acc = contribution(lax.rem(me + 1, n))
        for step in range(1, n):
            acc = lax.ppermute(acc, axis_name, ring_perm(n, +1)) + contribution(lax.rem(me + step + 1, n))
        return acc.astype(lhs_block.dtype)

    return _shard_mapped(per_device, lhs, rhs, mesh, axis_name)


@conformance.register("matmul_reduce_scatter", name="broken_mrs_counts_own_partial_twice")
def broken_mrs_counts_own_partial_twice(lhs, rhs, *, mesh, axis_name):
    """Starts its accumulator with its own rows' partial, then adds the reduced sum, which holds that
    partial already: every device's own contribution counts twice (on a ring of one, the whole result
    doubles). Every block lands where it belongs: the block map must blame the arithmetic."""
    n = validate("broken_mrs_counts_own_partial_twice", lhs, rhs, mesh, axis_name)

    def per_device(lhs_block, rhs_block):
        m, me = lhs_block.shape[0] // n, lax.axis_index(axis_name)
        own = dot(lax.dynamic_slice_in_dim(lhs_block, me * m, m), rhs_block)
        total = lax.psum_scatter(dot(lhs_block, rhs_block), axis_name, scatter_dimension=0, tiled=True)
        return (own + total).astype(lhs_block.dtype)

    return _shard_mapped(per_device, lhs, rhs, mesh, axis_name)


@conformance.register("matmul_reduce_scatter", name="broken_mrs_bfloat16_partial_sums")
def broken_mrs_bfloat16_partial_sums(lhs, rhs, *, mesh, axis_name):
    """Rounds every partial sum to the input dtype between ring steps (half the bytes for bf16).

    Within the elementwise error bound, so only the comparison with the
    baseline's error can see it.
    """
    n = validate("broken_mrs_bfloat16_partial_sums", lhs, rhs, mesh, axis_name)

    def per_device(lhs_block, rhs_block):
        m = lhs_block.shape[0] // n

        def contribution(owner, first, rows):
            block = lax.dynamic_slice_in_dim(lhs_block, owner * m + first, rows)
            return dot(block, rhs_block).astype(lhs_block.dtype)  # the defect: no float32 accumulator

        return ring_reduce_scatter(contribution, m, axis_name, bidirectional=False)

    return _shard_mapped(per_device, lhs, rhs, mesh, axis_name)


@conformance.register(
    "matmul_reduce_scatter", name="broken_mrs_wrong_custom_vjp_gradient", differentiable=True
)
def broken_mrs_wrong_custom_vjp_gradient(lhs, rhs, *, mesh, axis_name):
    """A right forward ring whose custom_vjp forgets to gather the cotangent.

    Its backward uses only the cotangent rows the device holds: no collective
    at all (so the backward audit is happy), and wrong gradients on every mesh.
    """
    n = validate("broken_mrs_wrong_custom_vjp_gradient", lhs, rhs, mesh, axis_name)
    forward = functools.partial(good_ring._forward, axis_name=axis_name, bidirectional=False)

    def forgets_the_gather(lhs_block, rhs_block, ct):
        m = lhs_block.shape[0] // n
        start = lax.axis_index(axis_name) * m
        own_lhs_rows = lax.dynamic_slice_in_dim(lhs_block, start, m)
        d_lhs = lax.dynamic_update_slice(
            jnp.zeros_like(lhs_block), dot(ct, rhs_block.T).astype(lhs.dtype), (start, 0)
        )
        return d_lhs, dot(own_lhs_rows.T, ct).astype(rhs_block.dtype)

    ring = with_ring_vjp(forward, forgets_the_gather)
    return _shard_mapped(ring, lhs, rhs, mesh, axis_name)
