"""Baseline: XLA's own ``psum_scatter`` of the partials, widened to float32 for 16-bit floats and rounded
once at the end (the accuracy the rings are held to); a min or max as ``lax.pmin``/``lax.pmax`` of the
partials and this device's rows of it (JAX has no min or max ``psum_scatter``). Beside it, the same
along each partial's columns (``scatter_dimension=1``): what a kernel of that form would otherwise be,
a baseline too (XLA:TPU compiles it, at the family's small shapes, as an all-reduce of the whole
partial: twice a reduce-scatter's bytes, which a kernel may not receive)."""

from __future__ import annotations

import jax
from jax import lax
from jax.sharding import PartitionSpec as P

import conformance
from conformance.kernels._reduction import OVER_MESH_AXIS, REDUCTIONS, combine, validate
from conformance.kernels._ring import accumulator_dtype
from conformance.specs.reduce_scatter import REDUCE_SCATTER


@conformance.register(
    "reduce_scatter",
    name="xla_reduce_scatter",
    baseline=True,
    differentiable=True,
    dtypes=REDUCE_SCATTER.dtypes,
    reductions=REDUCTIONS,
    description="lax.psum_scatter of the float32-widened partials (XLA's own collective)",
)
def xla_reduce_scatter(
    x: jax.Array, *, mesh: jax.sharding.Mesh, axis_name: str, reduction: str = "add"
) -> jax.Array:
    n = validate("xla_reduce_scatter", x, mesh, axis_name)
    combine("xla_reduce_scatter", reduction)

    def per_device(block: jax.Array) -> jax.Array:
        if reduction != "add":  # JAX has no psum_scatter of a min or max: the whole reduction, then a slice
            whole = OVER_MESH_AXIS[reduction](block[0], axis_name)
            rows = whole.shape[0] // n
            return lax.dynamic_slice_in_dim(whole, lax.axis_index(axis_name) * rows, rows)
        partial = block[0].astype(accumulator_dtype(block.dtype))
        summed = lax.psum_scatter(partial, axis_name, scatter_dimension=0, tiled=True)
        return summed.astype(block.dtype)

    return jax.shard_map(
        per_device, mesh=mesh, in_specs=P(axis_name, None, None), out_specs=P(axis_name, None)
    )(x)


@conformance.register(
    "reduce_scatter",
    name="xla_reduce_scatter_columns",
    baseline=True,
    differentiable=True,
    dtypes=REDUCE_SCATTER.dtypes,
    scatter_dimension=1,
    description="lax.psum_scatter(scatter_dimension=1) of the float32-widened partials: XLA's own, along "
    "each partial's columns",
)
def xla_reduce_scatter_columns(x: jax.Array, *, mesh: jax.sharding.Mesh, axis_name: str) -> jax.Array:
    validate("xla_reduce_scatter_columns", x, mesh, axis_name, scatter_dimension=1)

    def per_device(block: jax.Array) -> jax.Array:
        partial = block[0].astype(accumulator_dtype(block.dtype))
        return lax.psum_scatter(partial, axis_name, scatter_dimension=1, tiled=True).astype(block.dtype)

    return jax.shard_map(
        per_device, mesh=mesh, in_specs=P(axis_name, None, None), out_specs=P(None, axis_name)
    )(x)
