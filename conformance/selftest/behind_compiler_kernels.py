"""A collective matmul that passes the scheduled-overlap rule and is still behind the compiler's own.

``broken_agmm_behind_the_compiler`` runs the built-in paced ring (every hop hidden behind a matmul),
but first sends its block twice over in one transfer that nothing can hide (the ring starts from a
block that reads it). The rule, every transfer but one per ring direction hidden, passes it: 7 of
8. XLA:TPU's own windowed einsum for the same ``jit(lhs @ rhs)`` leaves one hop of one block
exposed; this kernel leaves two blocks' worth. The tables report it behind; with
``--behind-compiler=fail``, or registered ``ahead_of_compiler=True`` as its twin is, the schedule
check fails it. (Its first transfer also moves more bytes than the family allows: the byte checks
fail it too, which is not what these kernels are for.)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

import conformance
from conformance.kernels._ring import dot, ring_gather_visit, ring_perm, unmerged
from conformance.kernels.allgather_matmul._common import validate


def _behind(lhs, rhs, *, mesh, axis_name, name):
    validate(name, lhs, rhs, mesh, axis_name)

    def per_device(lhs_block, rhs_block):
        n, m = lax.axis_size(axis_name), lhs_block.shape[0]
        out = jnp.zeros((m * n, rhs_block.shape[1]), lhs_block.dtype)
        # two copies of the block, to the left neighbour, before anything else: exposed
        echo = lax.ppermute(jnp.concatenate([lhs_block, lhs_block]), axis_name, ring_perm(n, -1))

        def multiply_into_rows(owner, first, rows):
            nonlocal out
            product = dot(rows, unmerged(rhs_block, beside=owner)).astype(lhs_block.dtype)
            out = lax.dynamic_update_slice(out, product, (owner * m + first, 0))
            return product

        # the ring starts from a block that reads the echo (times zero: the values are the block's), so
        # neither the transfer nor the wait is removed
        start = lhs_block + echo[:m] * jnp.zeros((), lhs_block.dtype)
        ring_gather_visit(start, axis_name, multiply_into_rows, bidirectional=False)
        return out

    return jax.shard_map(
        per_device, mesh=mesh, in_specs=(P(axis_name, None), P(None, axis_name)), out_specs=P(None, axis_name)
    )(lhs, rhs)


@conformance.register("allgather_matmul", name="broken_agmm_behind_the_compiler")
def broken_agmm_behind_the_compiler(lhs, rhs, *, mesh, axis_name):
    """The paced ring after one exposed transfer of two blocks: reported behind the compiler's own."""
    return _behind(lhs, rhs, mesh=mesh, axis_name=axis_name, name="broken_agmm_behind_the_compiler")


@conformance.register(
    "allgather_matmul", name="broken_agmm_declared_ahead_of_the_compiler", ahead_of_compiler=True
)
def broken_agmm_declared_ahead_of_the_compiler(lhs, rhs, *, mesh, axis_name):
    """The same kernel, registered as at least level with the compiler's own: failed where behind."""
    return _behind(
        lhs, rhs, mesh=mesh, axis_name=axis_name, name="broken_agmm_declared_ahead_of_the_compiler"
    )
