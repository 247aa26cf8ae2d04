"""The compiler's own collective matmul: ``jax.jit`` of ``lhs @ rhs`` with the family's shardings
(the contraction sharded, the result's rows scattered) and no ``shard_map``, left to XLA.

What a user gets without writing a kernel: XLA's partitioner multiplies the local blocks and
reduce-scatters the float32 partials, and XLA:TPU (and XLA:GPU behind its windowed-einsum flags)
may turn that into a loop of collective-permutes overlapped with the partial matmuls. A ring kernel
is worth its code where it hides more of its transfers than this, or needs less memory.

Not registered ``differentiable``: the sharding of its gradients is the partitioner's choice (on a
mesh of ``Auto`` axes it leaves ``d_lhs`` replicated), which the gradient check's rule (sharded like
the operand) does not grant; the family's ``shard_map`` baseline is the backward pass's reference.
"""

from __future__ import annotations

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import conformance
from conformance.kernels._ring import sharded_dot
from conformance.kernels.matmul_reduce_scatter._common import DTYPES, validate


@conformance.register(
    "matmul_reduce_scatter",
    name="xla_jit_matmul_reduce_scatter",
    baseline=True,
    compilers_own=True,
    dtypes=DTYPES,
    description="jit(lhs @ rhs) with the family's shardings: the compiler's own collective matmul",
)
def xla_jit_matmul_reduce_scatter(
    lhs: jax.Array, rhs: jax.Array, *, mesh: jax.sharding.Mesh, axis_name: str, out_dtype: object = None
) -> jax.Array:
    validate("xla_jit_matmul_reduce_scatter", lhs, rhs, mesh, axis_name)
    out = sharded_dot(lhs, rhs, out=NamedSharding(mesh, P(axis_name, None)))
    return out.astype(out_dtype or lhs.dtype)
