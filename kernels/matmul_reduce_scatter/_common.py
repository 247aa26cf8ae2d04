"""Argument validation shared by the matmul_reduce_scatter kernels."""

from __future__ import annotations

import jax

from conformance.kernels._validation import axis_size, require_divisible
from conformance.specs.matmul_reduce_scatter import MATMUL_REDUCE_SCATTER

#: The family's dtypes, mixed-precision pairs included: what the built-ins claim.
DTYPES = MATMUL_REDUCE_SCATTER.dtypes


def validate(name: str, lhs: jax.Array, rhs: jax.Array, mesh: jax.sharding.Mesh, axis_name: str) -> int:
    """Raise ``ValueError`` naming the offending values; return the axis size."""
    n = axis_size(name, mesh, axis_name)
    if lhs.ndim != 2 or rhs.ndim != 2 or lhs.shape[1] != rhs.shape[0]:
        raise ValueError(f"{name}: expected lhs[M,K] and rhs[K,N], got {lhs.shape} and {rhs.shape}")
    require_divisible(name, "M (rows of lhs, scattered)", lhs.shape[0], n, axis_name)
    require_divisible(name, "K (the contraction, sharded)", lhs.shape[1], n, axis_name)
    if lhs.dtype != rhs.dtype:
        raise ValueError(f"{name}: lhs dtype {lhs.dtype} != rhs dtype {rhs.dtype}")
    return n
