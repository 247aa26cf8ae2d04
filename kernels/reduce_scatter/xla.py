"""Baseline: XLA's own ``psum_scatter`` of the partials, widened to float32 for 16-bit floats and rounded
once at the end (the accuracy the rings are held to)."""

from __future__ import annotations

import jax
from jax import lax
from jax.sharding import PartitionSpec as P

import conformance
from conformance.kernels._reduction import validate
from conformance.kernels._ring import accumulator_dtype
from conformance.specs.reduce_scatter import REDUCE_SCATTER


@conformance.register(
    "reduce_scatter",
    name="xla_reduce_scatter",
    baseline=True,
    differentiable=True,
    dtypes=REDUCE_SCATTER.dtypes,
    description="lax.psum_scatter of the float32-widened partials (XLA's own collective)",
)
def xla_reduce_scatter(x: jax.Array, *, mesh: jax.sharding.Mesh, axis_name: str) -> jax.Array:
    validate("xla_reduce_scatter", x, mesh, axis_name)

    def per_device(block: jax.Array) -> jax.Array:
        partial = block[0].astype(accumulator_dtype(block.dtype))
        summed = lax.psum_scatter(partial, axis_name, scatter_dimension=0, tiled=True)
        return summed.astype(block.dtype)

    return jax.shard_map(
        per_device, mesh=mesh, in_specs=P(axis_name, None, None), out_specs=P(axis_name, None)
    )(x)
