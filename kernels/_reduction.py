"""Argument validation the reduction families share (``reduce_scatter``, ``all_reduce``)."""

from __future__ import annotations

import jax

from conformance.kernels._validation import axis_size, require_divisible


def validate(name: str, x: jax.Array, mesh: jax.sharding.Mesh, axis_name: str) -> int:
    """Raise ``ValueError`` naming the offending values; return the axis size. ``x`` is the stacked
    partials ``[n, M, cols]``: one ``[M, cols]`` partial per device of the axis."""
    n = axis_size(name, mesh, axis_name)
    if x.ndim != 3 or x.shape[0] != n:
        raise ValueError(
            f"{name}: expected the partials stacked on the mesh axis, x[{n}, M, cols], got {x.shape}"
        )
    require_divisible(name, "M (rows of each partial, scattered)", x.shape[1], n, axis_name)
    return n
