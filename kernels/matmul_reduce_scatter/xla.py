"""Baseline: a local matmul, then XLA's own ``psum_scatter``. The oracle the rings are compared with.

The partial products of sub-32-bit floats are summed in float32 (the
reduce-scatter carries float32) and rounded once at the end: the accuracy the
rings are held to.
"""

from __future__ import annotations

import jax
from jax import lax
from jax.sharding import PartitionSpec as P

import conformance
from conformance.kernels._ring import dot
from conformance.kernels.matmul_reduce_scatter._common import DTYPES, validate


@conformance.register(
    "matmul_reduce_scatter",
    name="xla_matmul_reduce_scatter",
    baseline=True,
    differentiable=True,
    dtypes=DTYPES,
    description="local dot, then lax.psum_scatter of the float32 partials (XLA's own collective)",
)
def xla_matmul_reduce_scatter(
    lhs: jax.Array, rhs: jax.Array, *, mesh: jax.sharding.Mesh, axis_name: str, out_dtype: object = None
) -> jax.Array:
    validate("xla_matmul_reduce_scatter", lhs, rhs, mesh, axis_name)

    def per_device(lhs_block: jax.Array, rhs_block: jax.Array) -> jax.Array:
        with jax.named_scope("partial_matmul"):
            partial = dot(lhs_block, rhs_block)
        with jax.named_scope("reduce_scatter"):
            summed = lax.psum_scatter(partial, axis_name, scatter_dimension=0, tiled=True)
        return summed.astype(out_dtype or lhs_block.dtype)

    return jax.shard_map(
        per_device,
        mesh=mesh,
        in_specs=(P(None, axis_name), P(axis_name, None)),
        out_specs=P(axis_name, None),
    )(lhs, rhs)
