"""A collective matmul right on TPU and wrong on GPU: its overlap is the GPU compiler's to undo.

``broken_agmm_steps_share_the_weight`` is the built-in gather ring (paced, every transfer issued
before the matmul of the block in hand) with every step's matmul reading the one weight block. It
passes every CPU check and the real TPU schedule (v5e, v6e: every transfer hidden). XLA:GPU's dot
merger fuses matmuls that share an operand: compiled for 8 H100s the steps' matmuls become a few
larger ones that each wait for several transfers, and the transfers run back to back (0 of 14
hidden, jax-cuda12-plugin 0.10.2 and 0.12.0.1). The built-in rings give each step its own operand
(``conformance.kernels._ring.unmerged``). ``EXPECTED_GPU_SCHEDULE_REJECTION`` names it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

import conformance
from conformance.kernels._ring import dot, ring_gather_visit
from conformance.kernels.allgather_matmul._common import validate

EXPECTED_GPU_SCHEDULE_REJECTION: tuple[str, ...] = ("broken_agmm_steps_share_the_weight",)


@conformance.register("allgather_matmul", name="broken_agmm_steps_share_the_weight")
def broken_agmm_steps_share_the_weight(lhs, rhs, *, mesh, axis_name):
    """The paced bidirectional gather ring, each step multiplying by the shared weight block."""
    n = validate("broken_agmm_steps_share_the_weight", lhs, rhs, mesh, axis_name)

    def per_device(lhs_block, rhs_block):
        m = lhs_block.shape[0]
        out = jnp.zeros((m * n, rhs_block.shape[1]), lhs_block.dtype)

        def multiply_into_rows(owner, first, rows):
            nonlocal out
            product = dot(rows, rhs_block).astype(lhs_block.dtype)
            out = lax.dynamic_update_slice(out, product, (owner * m + first, 0))
            return product

        ring_gather_visit(lhs_block, axis_name, multiply_into_rows, bidirectional=True)
        return out

    return jax.shard_map(
        per_device, mesh=mesh, in_specs=(P(axis_name, None), P(None, axis_name)), out_specs=P(None, axis_name)
    )(lhs, rhs)
