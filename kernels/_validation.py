"""Argument checks every built-in kernel shares: errors that name the offending values."""

from __future__ import annotations

import jax


def axis_size(kernel: str, mesh: jax.sharding.Mesh, axis_name: str) -> int:
    """The size of ``axis_name`` in ``mesh``; ``ValueError`` naming the axis if it is not one."""
    if axis_name not in mesh.axis_names:
        raise ValueError(f"{kernel}: axis_name {axis_name!r} is not a mesh axis {tuple(mesh.axis_names)}")
    return mesh.shape[axis_name]


def require_divisible(kernel: str, what: str, size: int, n: int, axis_name: str) -> None:
    """``ValueError`` naming ``what=size`` and ``n`` unless ``n`` divides ``size``."""
    if size % n:
        raise ValueError(f"{kernel}: {what}={size}, not divisible by the {n} devices of axis {axis_name!r}")
