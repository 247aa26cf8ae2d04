"""A kernel that takes batched operands (``batch_dims=1``) and mishandles the batch: right for a
batch of one, which is what a 2-D kernel wrapped in a reshape meets most, wrong for any other.
``EXPECTED_REJECTION`` names the check that must reject it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

import conformance
from conformance.kernels._ring import dot, ring_perm

EXPECTED_REJECTION: dict[str, str] = {"broken_batched_ring_folds_batch_into_rows": "test_output_sharding"}
EXPECTED_MESSAGE: dict[str, str] = {"broken_batched_ring_folds_batch_into_rows": "dims           : batch=2"}


@conformance.register("allgather_matmul", name="broken_batched_ring_folds_batch_into_rows", batch_dims=1)
def broken_batched_ring_folds_batch_into_rows(lhs, rhs, *, mesh, axis_name):
    """Folds each device's ``[B, m, K]`` block into ``B*m`` rows and runs the 2-D ring on them, then
    reads the gathered ``[n*B*m, N]`` rows back as ``[B, n*m, N]``, as if they were batch-major: they
    are block-major, so for B > 1 every batch but the first gets rows of the others."""

    def body(x, w):
        n, me = lax.axis_size(axis_name), lax.axis_index(axis_name)
        batch, m = x.shape[0], x.shape[1]
        rows = x.reshape(batch * m, x.shape[2])
        out = jnp.zeros((n * batch * m, w.shape[1]), x.dtype)
        for step in range(n):
            arriving = lax.ppermute(rows, axis_name, ring_perm(n, -1)) if step < n - 1 else None
            owner = lax.rem(me + step, n)
            out = lax.dynamic_update_slice(out, dot(rows, w).astype(x.dtype), (owner * batch * m, 0))
            rows = arriving if arriving is not None else rows
        return out.reshape(batch, n * m, w.shape[1])  # the defect: the rows are block-major

    return jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(P(None, axis_name, None), P(None, axis_name)),
        out_specs=P(None, None, axis_name),
    )(lhs, rhs)
