"""What the Pallas TPU rings share: addressing a neighbour on the ring."""

from __future__ import annotations

import jax
from jax import lax


def neighbour(mesh_axes: tuple[str, ...], axis_name: str, index: jax.Array) -> tuple[jax.Array, ...]:
    """Mesh coordinates of the device at ``index`` along ``axis_name``, this device's elsewhere.

    Remote DMAs and signals address devices by these coordinates: mesh addressing, the default of
    every supported JAX (``device_id_type=`` is deprecated from JAX 0.12, so the kernels never pass it).
    """
    return tuple(index if a == axis_name else lax.axis_index(a) for a in mesh_axes)
