"""The compiler's own collective matmul: ``jax.jit`` of ``lhs @ rhs`` with the family's shardings and
no ``shard_map``, left to XLA's partitioner and scheduler.

What a user gets without writing a kernel. XLA:TPU turns this dot into a collective matmul of its
own when the operands are large enough (a windowed-einsum loop of collective-permutes, or with
``xla_tpu_all_gather_collective_matmul_mode=post_spmd`` a decomposed all-gather loop); XLA:GPU does
so behind its windowed-einsum flags; XLA:CPU gathers and multiplies. A ring kernel is worth its code
where it hides more of its transfers than this, or needs less memory.

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
from conformance.kernels.allgather_matmul._common import DTYPES, validate


@conformance.register(
    "allgather_matmul",
    name="xla_jit_allgather_matmul",
    baseline=True,
    compilers_own=True,
    dtypes=DTYPES,
    description="jit(lhs @ rhs) with the family's shardings: the compiler's own collective matmul",
)
def xla_jit_allgather_matmul(
    lhs: jax.Array, rhs: jax.Array, *, mesh: jax.sharding.Mesh, axis_name: str, out_dtype: object = None
) -> jax.Array:
    validate("xla_jit_allgather_matmul", lhs, rhs, mesh, axis_name)
    out = sharded_dot(lhs, rhs, out=NamedSharding(mesh, P(None, axis_name)))
    return out.astype(out_dtype or lhs.dtype)
