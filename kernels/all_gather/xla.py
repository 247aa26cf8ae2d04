"""Baseline: XLA's own ``lax.all_gather`` under ``shard_map``."""

from __future__ import annotations

import jax
from jax.sharding import PartitionSpec as P

import conformance
from conformance import compat
from conformance.kernels.all_gather._common import validate


@conformance.register(
    "all_gather",
    name="xla_all_gather",
    baseline=True,
    differentiable=True,
    description="lax.all_gather (tiled) under shard_map",
)
def xla_all_gather(x: jax.Array, *, mesh: jax.sharding.Mesh, axis_name: str) -> jax.Array:
    validate("xla_all_gather", x, mesh, axis_name)
    return jax.shard_map(
        lambda block: compat.all_gather_invariant(block, axis_name, axis=0, tiled=True),
        mesh=mesh,
        in_specs=P(axis_name),
        out_specs=P(),
    )(x)
