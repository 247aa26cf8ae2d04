"""What every send_recv implementation checks before it moves a byte, and the job's key-value store."""

from __future__ import annotations

import jax
from jax.sharding import NamedSharding, PartitionSpec


def _normalized(spec: PartitionSpec) -> tuple:
    parts = list(spec)
    while parts and parts[-1] is None:
        parts.pop()
    return tuple(tuple(p) if isinstance(p, (list, tuple)) else p for p in parts)


def validate_destination(name: str, x: jax.Array, dst: NamedSharding) -> NamedSharding:
    """The source's ``NamedSharding``, after checking ``dst`` against it; raises naming both.

    The destination must have the same ``PartitionSpec`` over a mesh of the same axis names and
    shape, in the same memory kind: device ``i`` of one mesh then pairs with device ``i`` of the
    other, and every shard keeps its shape. Called on every process before any transfer starts,
    so a refusal leaves no peer waiting.
    """
    if not isinstance(x, jax.Array):
        raise TypeError(f"{name}: x must be a jax.Array, got {type(x).__name__}")
    src = x.sharding
    if not isinstance(src, NamedSharding):
        raise TypeError(f"{name}: x must lie under a NamedSharding, got {src!r}")
    if not isinstance(dst, NamedSharding):
        raise TypeError(f"{name}: dst must be a NamedSharding, got {dst!r}")
    problems = []
    if src.mesh.axis_names != dst.mesh.axis_names or src.mesh.devices.shape != dst.mesh.devices.shape:
        problems.append(f"mesh shape {dict(src.mesh.shape)} -> {dict(dst.mesh.shape)}")
    if _normalized(src.spec) != _normalized(dst.spec):
        problems.append(f"spec {src.spec} -> {dst.spec}")
    if src.memory_kind != dst.memory_kind:
        problems.append(f"memory kind {src.memory_kind} -> {dst.memory_kind}")
    if problems:
        raise ValueError(
            f"{name}: the destination must have the source's PartitionSpec over an equally shaped "
            f"mesh in the same memory kind; they differ in {'; '.join(problems)}. "
            f"source: {src!r}; destination: {dst!r}"
        )
    return src


def device_pairs(src: NamedSharding, dst: NamedSharding) -> list[tuple[jax.Device, jax.Device]]:
    """``(source device, destination device)`` for each position of the two mesh device arrays."""
    return list(zip(src.mesh.devices.flat, dst.mesh.devices.flat, strict=True))


def key_value_client(name: str):
    """The ``jax.distributed`` key-value client of this job; raises naming ``name`` outside a job."""
    from jax._src import distributed

    client = distributed.global_state.client
    if client is None:
        raise RuntimeError(f"{name}: devices of other processes but no jax.distributed client")
    return client
