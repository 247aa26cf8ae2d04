"""Argument validation and the local matmul shared by the allgather_matmul kernels."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def validate(name: str, lhs: jax.Array, rhs: jax.Array, mesh: jax.sharding.Mesh, axis_name: str) -> int:
    """Raise ``ValueError`` naming the offending values; return the axis size."""
    if axis_name not in mesh.axis_names:
        raise ValueError(f"{name}: axis_name {axis_name!r} is not a mesh axis {tuple(mesh.axis_names)}")
    n = mesh.shape[axis_name]
    if lhs.ndim != 2 or rhs.ndim != 2 or lhs.shape[1] != rhs.shape[0]:
        raise ValueError(f"{name}: expected lhs[M,K] and rhs[K,N], got {lhs.shape} and {rhs.shape}")
    m, n_cols = lhs.shape[0], rhs.shape[1]
    if m % n:
        raise ValueError(
            f"{name}: lhs has M={m} rows, not divisible by the {n} devices of axis {axis_name!r}"
        )
    if n_cols % n:
        raise ValueError(
            f"{name}: rhs has N={n_cols} columns, not divisible by the {n} devices of axis {axis_name!r}"
        )
    if lhs.dtype != rhs.dtype:
        raise ValueError(f"{name}: lhs dtype {lhs.dtype} != rhs dtype {rhs.dtype}")
    return n


def local_matmul(a: jax.Array, b: jax.Array) -> jax.Array:
    """``a @ b`` accumulated in float32 for sub-32-bit floats, returned in the input dtype."""
    acc = jnp.float32 if jnp.issubdtype(a.dtype, jnp.floating) and a.dtype.itemsize < 4 else a.dtype
    return jnp.dot(a, b, preferred_element_type=acc).astype(a.dtype)
