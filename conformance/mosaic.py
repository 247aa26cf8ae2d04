"""What a TPU's Mosaic compiler will refuse, read off a Pallas kernel lowered for TPU on this host.

Lowering a Pallas TPU kernel from a CPU host runs only JAX's side of Mosaic: the
kernel body is serialized into the ``tpu_custom_call`` and the passes that give
every buffer its memory layout, and reject DMA windows that do not fit it, run
later inside libtpu on a TPU host. A kernel that is exact under interpret mode
(which has no layouts at all) can therefore fail to compile on chips. This
module re-derives the two rules that decide it from the serialized kernel, so
the suite can say so from a laptop.

1. *Tiled layouts.* Every buffer argument (HBM or VMEM) is stored in tiles over
   its two minor dims: ``(T, 128)``, where 128 is the lane count and ``T``, the
   sublane tile, depends on the element width and on the second-minor size
   (:func:`second_minor_tile`, Mosaic's ``getTilingFactor``). A 1-D buffer is
   tiled by ``T * 128`` elements. Element widths are powers of two from 4 to
   32 bits; a 64-bit buffer has no layout at all.
2. *Tile-aligned windows.* Every ``ref.at[...]`` becomes a ``tpu.memref_slice``
   and every DMA moves such a window. Along the tiled dims a window must start
   at a multiple of the tile, proven statically (a constant, a product with a
   multiple, ``pl.multiple_of``), and span a multiple of it (Mosaic's
   ``verifyOffsetAndSizeTileAlignment``). Its buffer is padded up to whole
   tiles, so a window over a dim that is not itself a multiple of the tile is
   refused even when it spans the whole dim.

**A model, and no longer a judge.** The TPU layout check asks the real compiler
(:mod:`conformance.tpu_compiler`; a host without libtpu skips it). Held against libtpu, the rules
below fit 0.0.17 (JAX 0.6.2) and are stricter than later versions, which compile many windows
they refuse. What the suite still uses of this module is the tiling (:func:`tiles`,
:func:`tile_aligned`: the built-in ring's split and its refusal rule for libtpu before 0.0.42) and
:func:`refuse`; :func:`audit_lowered` is kept, with its self-tests, as the documented model.

The rule is applied in its strictest form across TPU generations v4 and later:
with and without XLA's large second-minor tiling for 8- and 16-bit types, so a
window accepted here is accepted whichever tiling a chip's compiler picks. JAX's
own TPU ring all-gather test keeps to shapes such as (256, 128) for the same
reason. The rules are a model of libtpu, not libtpu: ``pytest -m tpu`` on chips
remains the final word, and a kernel refused there but accepted here is a bug in
this module.
"""

from __future__ import annotations

import base64
import contextlib
import contextvars
import dataclasses
import json
import re
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from conformance import compat

#: Lanes of a TPU vector register, and sublanes (rows of 32-bit words).
LANES: int = 128
SUBLANES: int = 8
#: Element widths (bits) Mosaic can lay out in memory.
SUPPORTED_BITWIDTHS: tuple[int, ...] = (4, 8, 16, 32)
#: XLA's large second-minor tiling per element width (when the flag for it is on).
_LARGE_TILE_ROWS: dict[int, int] = {4: 64, 8: 32, 16: 16}
#: Memory spaces whose buffers carry tiled layouts (SMEM and semaphores do not).
_TILED_SPACES: tuple[str, ...] = ("any", "hbm", "vmem", "")


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


def window_size_quantum(tile: tuple[int, ...], dim: int) -> int:
    """What a window's size along tiled ``dim`` must be a multiple of.

    The tile, except that a packed type's large second-minor tile (16 rows of
    bfloat16, 32 of int8) only needs whole 32-bit sublanes: 8 rows.
    """
    size = tile[dim]
    if (
        len(tile) == 2
        and dim == 0
        and size > SUBLANES
        and size % SUBLANES == 0
        and size // SUBLANES <= SUBLANES
    ):
        return SUBLANES
    return size


@dataclasses.dataclass(frozen=True)
class Violation:
    """One thing a TPU compile would refuse, in words a kernel author can act on."""

    kernel: str
    what: str

    def __str__(self) -> str:
        return f"{self.kernel}: {self.what}"


# -- reading the serialized kernels out of a lowered module ---------------------------------------------


def _decode_mlir_string(escaped: str) -> str:
    return re.sub(r"\\([0-9A-Fa-f]{2})", lambda m: chr(int(m.group(1), 16)), escaped)


def mosaic_kernels(lowered_text: str) -> list[tuple[str, bytes]]:
    """``(kernel name, serialized Mosaic module)`` of every ``tpu_custom_call`` in a lowered module."""
    found = []
    for match in re.finditer(
        r"@tpu_custom_call\([^)]*\)\s*\{backend_config\s*=\s*\"((?:[^\"\\]|\\.)*)\"", lowered_text
    ):
        config = json.loads(_decode_mlir_string(match.group(1)))
        call = config.get("custom_call_config", config)
        name = re.search(r"kernel_name\s*=\s*\"([^\"]*)\"", lowered_text[match.end() : match.end() + 4000])
        found.append((name.group(1) if name else "pallas kernel", base64.b64decode(call["body"])))
    return found


def _parse(body: bytes) -> Any:
    # jax._src: the MLIR bindings and TPU dialect JAX itself serializes with (no
    # public spelling exists); the same import works from 0.6.2 to the newest.
    from jax._src.lib import tpu
    from jax._src.lib.mlir import ir

    context = ir.Context()
    tpu.register_dialect(context)
    context.allow_unregistered_dialects = True
    with context:
        return context, ir.Module.parse(body)


def _name(op: Any) -> str:
    return op.operation.name.removeprefix("stable_mosaic.")


def _walk(op: Any) -> Iterator[Any]:
    for region in op.regions:
        for block in region.blocks:
            for inner in block.operations:
                yield inner
                yield from _walk(inner.operation)


# -- the rules ------------------------------------------------------------------------------------------


def _memref(value_type: Any) -> tuple[tuple[int, ...], Any, str] | None:
    from jax._src.lib.mlir import ir

    if not compat.mlir_isa(ir.MemRefType, value_type):
        return None
    memref = ir.MemRefType(value_type)
    space = str(memref.memory_space) if memref.memory_space is not None else ""
    space = re.sub(r".*<(\w+)>.*", r"\1", space)
    return tuple(memref.shape), memref.element_type, space


def _element_width(element_type: Any) -> int | None:
    from jax._src.lib.mlir import ir

    for kind in (ir.IntegerType, ir.FloatType):
        if compat.mlir_isa(kind, element_type):
            return kind(element_type).width
    return None


def _divisible(value: Any, divisor: int, fuel: int = 64) -> bool:
    """Mosaic's ``isGuaranteedDivisible``: constants, products, sums, ``assume_multiple``, casts."""
    from jax._src.lib.mlir import ir

    if divisor == 1:
        return True
    if fuel <= 0 or not isinstance(value.owner, ir.OpView | ir.Operation):
        return False
    op = value.owner
    name = _name(op)
    if name == "arith.constant":
        attr = op.attributes["value"]
        return compat.mlir_isa(ir.IntegerAttr, attr) and ir.IntegerAttr(attr).value % divisor == 0
    if name == "tpu.assume_multiple":
        return ir.IntegerAttr(op.attributes["multiple"]).value % divisor == 0
    if name == "arith.muli":
        return any(_divisible(operand, divisor, fuel // 2) for operand in op.operands)
    if name in ("arith.addi", "arith.subi"):
        return all(_divisible(operand, divisor, fuel // 2) for operand in op.operands)
    if name == "arith.index_cast":
        return _divisible(op.operands[0], divisor, fuel - 1)
    return False


def _describe_index(value: Any) -> str:
    from jax._src.lib.mlir import ir

    op = value.owner
    if isinstance(op, ir.OpView | ir.Operation) and _name(op) == "arith.constant":
        return str(ir.IntegerAttr(op.attributes["value"]).value)
    return "a dynamic index"


def _root_shape(value: Any) -> tuple[int, ...] | None:
    """Shape of the kernel argument (or scratch buffer) a window was cut from: it decides the tiling."""
    from jax._src.lib.mlir import ir

    while isinstance(value.owner, ir.OpView | ir.Operation) and _name(value.owner) in (
        "tpu.memref_slice",
        "tpu.memref_squeeze",
        "tpu.memref_reshape",
        "tpu.memref_bitcast",
    ):
        value = value.owner.operands[0]
    described = _memref(value.type)
    return described[0] if described else None


def audit_module(kernel: str, body: bytes) -> list[Violation]:
    """Every buffer and window of one serialized kernel that a TPU compile would refuse."""
    _, module = _parse(body)
    problems: list[Violation] = []
    for op in _walk(module.operation):
        name = _name(op)
        arguments = [a for region in op.operation.regions for block in region.blocks for a in block.arguments]
        for result in [*op.operation.results, *arguments]:
            described = _memref(result.type)
            if described and _element_width(described[1]) not in (*SUPPORTED_BITWIDTHS, None):
                buffer = f"{described[1]}[{','.join(map(str, described[0]))}]"
                widths = "/".join(map(str, SUPPORTED_BITWIDTHS))
                what = f"a {buffer} buffer: Mosaic lays out element widths of {widths} bits only"
                problems.append(Violation(kernel, what))
        if name != "tpu.memref_slice":
            continue
        source = op.operation.operands[0]
        described = _memref(source.type)
        root = _root_shape(source)
        if described is None or root is None:
            continue
        shape, element_type, space = described
        width = _element_width(element_type)
        if space not in _TILED_SPACES or width not in SUPPORTED_BITWIDTHS:
            continue
        result_shape = tuple(_memref(op.operation.results[0].type)[0])
        indices = list(op.operation.operands)[1 : 1 + len(shape)]
        problems.extend(_check_window(kernel, shape, root, width, element_type, space, indices, result_shape))
    return problems


def _check_window(
    kernel: str,
    shape: tuple[int, ...],
    root: tuple[int, ...],
    width: int,
    element_type: Any,
    space: str,
    indices: list[Any],
    result_shape: tuple[int, ...],
) -> list[Violation]:
    window = ", ".join(f"{_describe_index(i)}:+{s}" for i, s in zip(indices, result_shape, strict=True))
    where = f"window [{window}] of a {element_type}[{','.join(map(str, shape))}] {space or 'vmem'} buffer"
    for tile in tiles(root, width):
        first = len(shape) - len(tile)
        for k, tile_dim in enumerate(tile):
            dim = first + k
            if dim < 0:
                continue
            if not _divisible(indices[dim], tile_dim):
                start = _describe_index(indices[dim])
                what = (
                    f"{where}: its start along dim {dim} ({start}) is not provably a multiple of the "
                    f"{tile} tile; a TPU compile refuses it (Mosaic: 'Offsets along tiled dimensions "
                    "must be aligned to tiles')"
                )
                return [Violation(kernel, what)]
            quantum = window_size_quantum(tile, k)
            if result_shape[dim] % quantum:
                whole = (
                    ", the whole dim, but its buffer is padded to whole tiles"
                    if result_shape[dim] == shape[dim]
                    else ""
                )
                what = (
                    f"{where}: its size along dim {dim} ({result_shape[dim]}{whole}) is not a multiple "
                    f"of {quantum}, for the {tile} tile; a TPU compile refuses it (Mosaic: 'Slice sizes "
                    "along tiled dimensions must be aligned to tiles')"
                )
                return [Violation(kernel, what)]
    return []


def audit_lowered(lowered_text: str) -> list[Violation]:
    """Every violation in every Pallas TPU kernel of a module lowered for TPU."""
    return [v for kernel, body in mosaic_kernels(lowered_text) for v in audit_module(kernel, body)]


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
