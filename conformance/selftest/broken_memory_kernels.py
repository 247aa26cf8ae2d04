"""A collective matmul right in values, collectives, bytes and overlap, wrong in memory: the TPU
memory check (``tpu_memory``) must reject it, beside the baseline compiled for the same chips.

``EXPECTED_REJECTION`` names that check.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

import conformance
from conformance.kernels.allgather_matmul._common import validate

EXPECTED_REJECTION: dict[str, str] = {"broken_agmm_keeps_every_step": "test_tpu_memory"}


@conformance.register("allgather_matmul", name="broken_agmm_keeps_every_step")
def broken_agmm_keeps_every_step(lhs, rhs, *, mesh, axis_name):
    """A ring that writes each step's product into a fresh float32 buffer the size of its whole
    output, keeps all of them (as a pass that saved them for its backward would) and sums them at the
    end: exact (every other row of each buffer is zero), and n float32 copies of the output live at
    once."""
    n = validate("broken_agmm_keeps_every_step", lhs, rhs, mesh, axis_name)
    left = [(j, (j - 1) % n) for j in range(n)]

    def per_device(lhs_block, rhs_block):
        m, me = lhs_block.shape[0], lax.axis_index(axis_name)
        block, steps = lhs_block, []
        for step in range(n):
            incoming = lax.ppermute(block, axis_name, left) if step < n - 1 else None
            product = jnp.dot(block, rhs_block, preferred_element_type=jnp.float32)
            whole = jnp.zeros((m * n, rhs_block.shape[1]), jnp.float32)
            steps.append(lax.dynamic_update_slice(whole, product, (((me + step) % n) * m, 0)))
            block = incoming
        steps = lax.optimization_barrier(steps)  # all of them materialized, as residuals would be
        return sum(steps[1:], steps[0]).astype(lhs_block.dtype)

    return jax.shard_map(
        per_device, mesh=mesh, in_specs=(P(axis_name, None), P(None, axis_name)), out_specs=P(None, axis_name)
    )(lhs, rhs)
