"""Baseline: XLA's own ``psum`` of the partials, widened to float32 for 16-bit floats and rounded once at
the end (the accuracy the rings are held to); a min or max as ``lax.pmin``/``lax.pmax``."""

from __future__ import annotations

import jax
from jax import lax
from jax.sharding import PartitionSpec as P

import conformance
from conformance.kernels._reduction import OVER_MESH_AXIS, REDUCTIONS, combine, validate
from conformance.kernels._ring import accumulator_dtype
from conformance.specs.all_reduce import ALL_REDUCE


@conformance.register(
    "all_reduce",
    name="xla_all_reduce",
    baseline=True,
    differentiable=True,
    dtypes=ALL_REDUCE.dtypes,
    reductions=REDUCTIONS,
    description="lax.psum of the float32-widened partials (XLA's own collective)",
)
def xla_all_reduce(
    x: jax.Array, *, mesh: jax.sharding.Mesh, axis_name: str, reduction: str = "add"
) -> jax.Array:
    validate("xla_all_reduce", x, mesh, axis_name)
    combine("xla_all_reduce", reduction)

    def per_device(block: jax.Array) -> jax.Array:
        if reduction != "add":
            return OVER_MESH_AXIS[reduction](block[0], axis_name)
        return lax.psum(block[0].astype(accumulator_dtype(block.dtype)), axis_name).astype(block.dtype)

    return jax.shard_map(per_device, mesh=mesh, in_specs=P(axis_name, None, None), out_specs=P())(x)
