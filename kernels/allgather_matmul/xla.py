"""Baseline: XLA's own all-gather, then a local matmul. The oracle the rings are compared with."""

from __future__ import annotations

import jax
from jax import lax
from jax.sharding import PartitionSpec as P

import conformance
from conformance.kernels.allgather_matmul._common import DTYPES, local_matmul, validate


@conformance.register(
    "allgather_matmul",
    name="xla_allgather_matmul",
    baseline=True,
    differentiable=True,
    dtypes=DTYPES,
    description="lax.all_gather of lhs, then one local dot (XLA's own collective)",
)
def xla_allgather_matmul(
    lhs: jax.Array, rhs: jax.Array, *, mesh: jax.sharding.Mesh, axis_name: str, out_dtype: object = None
) -> jax.Array:
    validate("xla_allgather_matmul", lhs, rhs, mesh, axis_name)

    def per_device(lhs_block: jax.Array, rhs_block: jax.Array) -> jax.Array:
        with jax.named_scope("all_gather_lhs"):
            lhs_full = lax.all_gather(lhs_block, axis_name, axis=0, tiled=True)
        with jax.named_scope("matmul"):
            return local_matmul(lhs_full, rhs_block, out_dtype)

    return jax.shard_map(
        per_device,
        mesh=mesh,
        in_specs=(P(axis_name, None), P(None, axis_name)),
        out_specs=P(None, axis_name),
    )(lhs, rhs)
