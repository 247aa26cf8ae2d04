"""Argument validation shared by the all_gather kernels."""

from __future__ import annotations

import jax


def validate(name: str, x: jax.Array, mesh: jax.sharding.Mesh, axis_name: str) -> int:
    """Raise ``ValueError`` naming the offending values; return the axis size."""
    if axis_name not in mesh.axis_names:
        raise ValueError(f"{name}: axis_name {axis_name!r} is not a mesh axis {tuple(mesh.axis_names)}")
    n = mesh.shape[axis_name]
    if x.ndim < 1 or x.shape[0] % n:
        raise ValueError(
            f"{name}: x has {x.shape[0] if x.ndim else 0} rows, not divisible by the {n} devices "
            f"of axis {axis_name!r}"
        )
    return n
