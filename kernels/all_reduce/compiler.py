"""The compiler's own all-reduce: ``jax.jit`` of ``x.sum(0)`` with a replicated result and no
``shard_map``, left to XLA (an all-reduce of the partials). What a user gets without writing a kernel
or a collective.

Not registered ``differentiable``: the sharding of its gradient is the partitioner's choice; the
family's ``shard_map`` baseline is the backward pass's reference.
"""

from __future__ import annotations

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import conformance
from conformance.kernels._reduction import REDUCTIONS, combine, summed_by_the_compiler, validate
from conformance.specs.all_reduce import ALL_REDUCE


@conformance.register(
    "all_reduce",
    name="xla_jit_all_reduce",
    baseline=True,
    compilers_own=True,
    dtypes=ALL_REDUCE.dtypes,
    reductions=REDUCTIONS,
    description="jit(x.sum(0)) with a replicated result: the compiler's own all-reduce",
)
def xla_jit_all_reduce(
    x: jax.Array, *, mesh: jax.sharding.Mesh, axis_name: str, reduction: str = "add"
) -> jax.Array:
    validate("xla_jit_all_reduce", x, mesh, axis_name)
    combine("xla_jit_all_reduce", reduction)
    return summed_by_the_compiler(x, out=NamedSharding(mesh, P()), reduction=reduction)
