"""Argument validation and the local matmul shared by the allgather_matmul kernels."""

from __future__ import annotations

import jax

from conformance.kernels._ring import dot
from conformance.kernels._validation import axis_size, require_divisible
from conformance.specs.allgather_matmul import ALLGATHER_MATMUL


def validate(name: str, lhs: jax.Array, rhs: jax.Array, mesh: jax.sharding.Mesh, axis_name: str) -> int:
    """Raise ``ValueError`` naming the offending values; return the axis size."""
    n = axis_size(name, mesh, axis_name)
    if lhs.ndim != 2 or rhs.ndim != 2 or lhs.shape[1] != rhs.shape[0]:
        raise ValueError(f"{name}: expected lhs[M,K] and rhs[K,N], got {lhs.shape} and {rhs.shape}")
    require_divisible(name, "M (rows of lhs)", lhs.shape[0], n, axis_name)
    require_divisible(name, "N (columns of rhs)", rhs.shape[1], n, axis_name)
    if lhs.dtype != rhs.dtype:
        raise ValueError(f"{name}: lhs dtype {lhs.dtype} != rhs dtype {rhs.dtype}")
    return n


def local_matmul(a: jax.Array, b: jax.Array, out_dtype: object = None) -> jax.Array:
    """``a @ b`` accumulated in float32 for sub-32-bit floats (int32 for int8), returned in
    ``out_dtype`` (a mixed-precision result, :mod:`conformance.dtypes`) or the input dtype."""
    return dot(a, b).astype(out_dtype or a.dtype)


#: The family's dtypes, mixed-precision pairs included: what the built-ins claim.
DTYPES = ALLGATHER_MATMUL.dtypes
