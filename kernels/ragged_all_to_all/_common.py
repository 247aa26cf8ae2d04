"""Argument validation and the per-device signature shared by the ragged all-to-all kernels."""

from __future__ import annotations

from collections.abc import Callable

import jax
from jax.sharding import PartitionSpec as P

from conformance.kernels._validation import axis_size, require_divisible

#: What each operand is called in error messages, in the family's order.
OPERANDS = ("x", "output", "input_offsets", "send_sizes", "output_offsets", "recv_sizes")


def validate(name: str, operands: tuple[jax.Array, ...], mesh: jax.sharding.Mesh, axis_name: str) -> int:
    """Raise ``ValueError`` naming the offending values; return the axis size."""
    n = axis_size(name, mesh, axis_name)
    x, output, *routing = operands
    for what, array in (("x", x), ("output", output)):
        if array.ndim < 1:
            raise ValueError(f"{name}: {what} must have a row dimension, got shape {array.shape}")
        require_divisible(name, f"rows of {what}", array.shape[0], n, axis_name)
    if x.shape[1:] != output.shape[1:]:
        raise ValueError(f"{name}: x rows {x.shape[1:]} and output rows {output.shape[1:]} differ in shape")
    for what, array in zip(OPERANDS[2:], routing, strict=True):
        if array.shape != (n * n,) or not jax.numpy.issubdtype(array.dtype, jax.numpy.integer):
            raise ValueError(
                f"{name}: {what} must be an integer array of n*n = {n * n} entries (n = {n} devices of axis "
                f"{axis_name!r}, one per peer per device), got {array.dtype}{list(array.shape)}"
            )
    return n


def per_device(
    body: Callable[..., jax.Array], mesh: jax.sharding.Mesh, axis_name: str, operands: tuple[jax.Array, ...]
) -> jax.Array:
    """``body(x, output, input_offsets, send_sizes, output_offsets, recv_sizes)`` on each device's
    blocks (``x[R, cols]``, ``output[S, cols]``, each routing array ``[n]``), under ``shard_map``."""
    return jax.shard_map(body, mesh=mesh, in_specs=(P(axis_name),) * 6, out_specs=P(axis_name))(*operands)
