"""What the Pallas TPU rings share: addressing a neighbour on the ring, a pipeline through VMEM."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu


def neighbour(mesh_axes: tuple[str, ...], axis_name: str, index: jax.Array) -> tuple[jax.Array, ...]:
    """Mesh coordinates of the device at ``index`` along ``axis_name``, this device's elsewhere.

    Remote DMAs and signals address devices by these coordinates: mesh addressing, the default of
    every supported JAX (``device_id_type=`` is deprecated from JAX 0.12, so the kernels never pass it).
    """
    return tuple(index if a == axis_name else lax.axis_index(a) for a in mesh_axes)


#: Buffers :func:`pipelined` takes: four VMEM ``[2, rows, cols]`` tile buffers (the fourth unread, and
#: any shape, where the output's dtype is the accumulators') and its DMA semaphores.
TILE_BUFFERS = 5


def pipelined(
    dst: Any,
    first: Any | None,
    second: Any,
    tiles: tuple[Any, ...],
    *,
    rows: int,
    combine: Callable[[jax.Array, jax.Array], jax.Array],
    written_back: bool = True,
) -> None:
    """``dst[...] = combine(first, second)`` (``second`` alone where ``first`` is None), cast to ``dst``'s
    dtype, for HBM refs: ``rows`` rows at a time through VMEM, two tiles in flight (each tile's operands
    fetched while the one before is combined, each result written back while the next is combined).
    ``tiles``: VMEM ``[2, rows, cols]`` buffers for ``first`` (the accumulators' dtype), ``second``, a
    result in the accumulators' dtype and one in the output's (unread where ``dst`` has the
    accumulators' dtype), then DMA semaphores ``[3, 2]``.
    ``written_back``: each result slot's write-back waited before the slot is written again (the
    self-tests take it out)."""
    first_tiles, second_tiles, acc_tiles, out_tiles, sems = tiles
    result = acc_tiles if dst.dtype == acc_tiles.dtype else out_tiles
    count = dst.shape[0] // rows

    def fetches(t: Any, slot: Any) -> list[Any]:
        window = pl.ds(t * rows, rows)
        copies = [pltpu.make_async_copy(second.at[window], second_tiles.at[slot], sems.at[0, slot])]
        if first is not None:
            copies.append(pltpu.make_async_copy(first.at[window], first_tiles.at[slot], sems.at[1, slot]))
        return copies

    def write(t: Any, slot: Any) -> Any:
        return pltpu.make_async_copy(result.at[slot], dst.at[pl.ds(t * rows, rows)], sems.at[2, slot])

    for copy in fetches(jnp.int32(0), jnp.int32(0)):
        copy.start()

    def tile(t: jax.Array, carry: jax.Array) -> jax.Array:
        slot = lax.rem(t, jnp.int32(2))

        @pl.when(t + 1 < count)
        def _fetch_next() -> None:
            for copy in fetches(t + 1, 1 - slot):
                copy.start()

        for copy in fetches(t, slot):
            copy.wait()

        @pl.when((t >= 2) & written_back)
        def _written() -> None:  # the write that last read this result buffer has left it
            write(t - 2, slot).wait()

        value = second_tiles[slot].astype(acc_tiles.dtype)
        if first is not None:
            value = combine(first_tiles[slot], value)
        result[slot] = value.astype(result.dtype)
        write(t, slot).start()
        return carry

    lax.fori_loop(jnp.int32(0), jnp.int32(count), tile, jnp.int32(0))
    for t in range(max(0, count - 2), count):
        write(jnp.int32(t), jnp.int32(t % 2)).wait()
