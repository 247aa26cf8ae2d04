"""What every send_recv implementation checks before it moves a byte, and the job's key-value store."""

from __future__ import annotations

import jax
from jax.sharding import NamedSharding


def _blocks(sharding: NamedSharding, shape: tuple[int, ...]) -> list[tuple[tuple[int, int], ...]]:
    """The block of ``shape`` each device of the sharding's mesh holds, in the mesh's device order."""
    index = sharding.devices_indices_map(shape)
    return [
        tuple(s.indices(n)[:2] for s, n in zip(index[d], shape, strict=True))
        for d in sharding.mesh.devices.flat
    ]


def validate_destination(name: str, x: jax.Array, dst: NamedSharding) -> NamedSharding:
    """The source's ``NamedSharding``, after checking ``dst`` against it; raises naming both.

    Device ``i`` of the source mesh (in its device order) sends its shard to device ``i`` of the
    destination mesh, so ``dst`` must put on its device ``i`` the block the source puts on its
    device ``i``, in the same memory kind. The spec and mesh shape may differ where the placement
    does not (``P()`` and ``P('x')`` on one device; ``P(('x', 'y'))`` on 2 x 2 and ``P('x')`` on the
    same 4 devices in a row); a destination with another block-to-device map (``P('y', 'x')`` for
    ``P('x', 'y')``) is refused even where its shards have the source's shapes. Called on every
    process before any transfer starts, so a refusal leaves no peer waiting.
    """
    if not isinstance(x, jax.Array):
        raise TypeError(f"{name}: x must be a jax.Array, got {type(x).__name__}")
    src = x.sharding
    if not isinstance(src, NamedSharding):
        raise TypeError(f"{name}: x must lie under a NamedSharding, got {src!r}")
    if not isinstance(dst, NamedSharding):
        raise TypeError(f"{name}: dst must be a NamedSharding, got {dst!r}")
    problems = []
    if src.mesh.devices.size != dst.mesh.devices.size:
        problems.append(f"device count {src.mesh.devices.size} -> {dst.mesh.devices.size}")
    else:
        for i, (a, b) in enumerate(zip(_blocks(src, x.shape), _blocks(dst, x.shape), strict=True)):
            if a != b:
                problems.append(
                    f"the block on device {i} of the mesh, {_text(a)} -> {_text(b)} "
                    f"(spec {src.spec} over {dict(src.mesh.shape)} -> {dst.spec} over "
                    f"{dict(dst.mesh.shape)})"
                )
                break
    if src.memory_kind != dst.memory_kind:
        problems.append(f"memory kind {src.memory_kind} -> {dst.memory_kind}")
    if problems:
        raise ValueError(
            f"{name}: the destination must place on each device of its mesh the block the source "
            f"places on the device at the same position, in the same memory kind; they differ in "
            f"{'; '.join(problems)}. source: {src!r}; destination: {dst!r}"
        )
    return src


def _text(block: tuple[tuple[int, int], ...]) -> str:
    return "[" + ", ".join(f"{a}:{b}" for a, b in block) + "]"


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
