"""Argument validation shared by the all_gather kernels."""

from __future__ import annotations

import jax

from conformance.kernels._validation import axis_size, require_divisible


def validate(name: str, x: jax.Array, mesh: jax.sharding.Mesh, axis_name: str) -> int:
    """Raise ``ValueError`` naming the offending values; return the axis size."""
    n = axis_size(name, mesh, axis_name)
    if x.ndim < 1:
        raise ValueError(f"{name}: x must have a row dimension, got shape {x.shape}")
    require_divisible(name, "rows of x", x.shape[0], n, axis_name)
    return n
