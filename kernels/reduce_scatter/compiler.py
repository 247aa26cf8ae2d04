"""The compiler's own reduce-scatter: ``jax.jit`` of ``x.sum(0)`` with the family's result sharding and
no ``shard_map``, left to XLA (which writes a reduce-scatter of the partials, or an all-reduce and a
slice). What a user gets without writing a kernel or a collective; a ring is worth its code where it
uses less memory or time than this.

Not registered ``differentiable``: the sharding of its gradient is the partitioner's choice; the
family's ``shard_map`` baseline is the backward pass's reference.
"""

from __future__ import annotations

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import conformance
from conformance.kernels._reduction import REDUCTIONS, combine, summed_by_the_compiler, validate
from conformance.specs.reduce_scatter import REDUCE_SCATTER


@conformance.register(
    "reduce_scatter",
    name="xla_jit_reduce_scatter",
    baseline=True,
    compilers_own=True,
    dtypes=REDUCE_SCATTER.dtypes,
    reductions=REDUCTIONS,
    description="jit(x.sum(0)) with the result sharded by rows: the compiler's own reduce-scatter",
)
def xla_jit_reduce_scatter(
    x: jax.Array, *, mesh: jax.sharding.Mesh, axis_name: str, reduction: str = "add"
) -> jax.Array:
    validate("xla_jit_reduce_scatter", x, mesh, axis_name)
    combine("xla_jit_reduce_scatter", reduction)
    return summed_by_the_compiler(x, out=NamedSharding(mesh, P(axis_name, None)), reduction=reduction)
