"""TPU tiling, and the kernels' refusals the real TPU compiler can be asked about.

A TPU stores every buffer argument (HBM or VMEM) in tiles over its two minor dims: ``(T, 128)``,
where 128 is the lane count and ``T``, the sublane tile, depends on the element width and on the
second-minor size (:func:`second_minor_tile`, Mosaic's ``getTilingFactor``); a 1-D buffer is tiled
by ``T * 128`` elements; element widths are powers of two from 4 to 32 bits. Interpret mode has no
layouts, so a kernel planning DMA windows for a chip reads them here (:func:`tiles`,
:func:`tile_aligned`: the built-in ring's split and its refusal rule for libtpu before 0.0.42).

A kernel refuses what a chip cannot run with :func:`refuse` (public as
:func:`conformance.refuse_on_tpu`): a :class:`TpuConstraintError` naming the constraint, which the
TPU layout check can set aside (:func:`asking_the_compiler`) to hold the refusal against the real
compiler (:mod:`conformance.targets.tpu_compiler`). The judge of layout is that compiler; this module holds
no model of its rules (one, re-derived from the serialized kernel, fitted libtpu 0.0.17 alone and
was removed once every host could run the compiler).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

#: Lanes of a TPU vector register, and sublanes (rows of 32-bit words).
LANES: int = 128
SUBLANES: int = 8
#: Element widths (bits) Mosaic can lay out in memory.
SUPPORTED_BITWIDTHS: tuple[int, ...] = (4, 8, 16, 32)
#: XLA's large second-minor tiling per element width (when the flag for it is on).
_LARGE_TILE_ROWS: dict[int, int] = {4: 64, 8: 32, 16: 16}


class TpuConstraintError(ValueError):
    """An input a TPU cannot take: the message names the constraint (tile, width, memory space).

    Pallas kernels raise it when compiled for a TPU (``interpret`` left out) on
    an input that interpret mode runs but a chip's compiler would refuse; the
    suite treats it as a refusal, never as a crash.
    """


_ASKING_THE_COMPILER: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "conformance_asking_the_tpu_compiler", default=False
)


def refuse(message: str) -> None:
    """Refuse an input a TPU cannot take: raise :class:`TpuConstraintError` with ``message``.

    A kernel that refuses through this (rather than ``raise``) lets the suite hold its refusals
    against the real TPU compiler: while the suite asks the compiler about a shape
    (:func:`asking_the_compiler`) it returns instead, the kernel goes on to lower the shape, and
    the compiler's verdict on it is compared with the kernel's refusal (a refusal of a shape the
    compiler compiles is a false refusal). Exported as ``conformance.refuse_on_tpu``.
    """
    if not _ASKING_THE_COMPILER.get():
        raise TpuConstraintError(message)


@contextlib.contextmanager
def asking_the_compiler() -> Iterator[None]:
    """Inside the block :func:`refuse` does not raise (see there)."""
    token = _ASKING_THE_COMPILER.set(True)
    try:
        yield
    finally:
        _ASKING_THE_COMPILER.reset(token)


def bitwidth(dtype: Any) -> int:
    """Element width in bits (``int4`` is 4)."""
    dt = np.dtype(dtype)
    return 4 if dt.name in ("int4", "uint4") else dt.itemsize * 8


def second_minor_tile(rows: int, width: int, *, large_tiling: bool) -> int:
    """Sublane tile ``T`` Mosaic gives a buffer whose second-minor dim is ``rows`` (TPU v4+).

    A tall enough buffer gets the large tile (8 rows of 32-bit words; 16/32/64
    rows of 16/8/4-bit values when XLA's large tiling is on). A short one gets
    the smallest power of two, from one packed sublane up to 8, that covers it.
    """
    packing = 32 // width
    large = _LARGE_TILE_ROWS.get(width, SUBLANES) if large_tiling else SUBLANES
    if large <= rows:
        return large
    tile = packing
    while tile < min(rows, SUBLANES):
        tile *= 2
    return tile


def tiles(shape: Sequence[int], width: int) -> list[tuple[int, ...]]:
    """Every first tile a buffer of ``shape`` may get (both settings of XLA's large tiling)."""
    found = []
    for large in (False, True):
        if len(shape) == 1:
            tile: tuple[int, ...] = (
                second_minor_tile(-(-shape[0] // LANES), width, large_tiling=large) * LANES,
            )
        else:
            tile = (second_minor_tile(shape[-2], width, large_tiling=large), LANES)
        if tile not in found:
            found.append(tile)
    return found


def tile_aligned(shape: Sequence[int], dtype: Any) -> bool:
    """Whether a buffer of ``shape`` fills whole tiles under every tiling a TPU may give it.

    Windows of such a buffer that start and end on tile boundaries are accepted;
    a kernel can plan its DMAs from this.
    """
    width = bitwidth(dtype)
    if width not in SUPPORTED_BITWIDTHS:
        return False
    for tile in tiles(shape, width):
        trailing = tuple(shape[len(shape) - len(tile) :])
        if any(size % t for size, t in zip(trailing, tile, strict=True)):
            return False
    return True
