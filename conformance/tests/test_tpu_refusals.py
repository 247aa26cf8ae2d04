"""The TPU layout model, and what the built-in Pallas ring refuses when compiled for TPU chips.

:mod:`conformance.targets.mosaic` models the tiles a TPU's compiler gives each buffer;
its numbers are pinned here against the tilings XLA documents for TPU arrays
(f32 ``T(8,128)``, bf16 ``T(16,128)``, int8 ``T(32,128)``, small arrays a
smaller power of two). The built-in ring must refuse, naming the constraint,
every input a chip cannot run, and must lower under ``jax_enable_x64`` (its ring
arithmetic stays in int32).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from conformance import compat
from conformance.fixtures.meshes import build_mesh, parse_mesh
from conformance.kernels.all_gather.pallas_ring import (
    ANY_2D_WINDOW,
    ROWS_FREE_FOR_32_BITS,
    pallas_ring_all_gather_bidirectional,
    pallas_ring_all_gather_unidirectional,
    row_split,
)
from conformance.targets import mosaic, tpu_compiler

pytestmark = pytest.mark.cpu

RINGS = (pallas_ring_all_gather_bidirectional, pallas_ring_all_gather_unidirectional)
#: The registered implementations these tests run (``--impl`` deselects them when it names none).
IMPLEMENTATIONS = tuple(ring.__name__ for ring in RINGS)


def _id(value) -> str:
    """Readable parameter ids: ``12x128``, ``float32``, ``(4, 128) tiles``."""
    if isinstance(value, tuple):
        return "x".join(map(str, value))
    return getattr(value, "__name__", None) or str(value)


@pytest.mark.parametrize(
    ("rows", "dtype", "large_tiling", "tile"),
    [
        (256, "float32", False, 8),
        (256, "float32", True, 8),
        (256, "bfloat16", False, 8),
        (256, "bfloat16", True, 16),
        (256, "int8", False, 8),
        (256, "int8", True, 32),
        (1, "float32", False, 1),
        (3, "float32", False, 4),
        (5, "float32", False, 8),
        (1, "bfloat16", False, 2),
        (1, "int8", False, 4),
        (2, "int8", True, 4),
    ],
    ids=_id,
)
def test_second_minor_tile_matches_xla_tpu_tilings(
    rows: int, dtype: str, large_tiling: bool, tile: int
) -> None:
    got = mosaic.second_minor_tile(rows, mosaic.bitwidth(dtype), large_tiling=large_tiling)
    assert got == tile, f"{dtype}[{rows},128] large_tiling={large_tiling}: tile rows {got}, expected {tile}"


@pytest.mark.parametrize(
    ("shape", "dtype", "aligned"),
    [
        ((8, 128), "float32", True),
        ((16, 256), "bfloat16", True),
        ((8, 128), "bfloat16", True),
        ((24, 128), "bfloat16", False),
        ((3, 128), "float32", False),
        ((8, 64), "float32", False),
        ((32, 128), "int8", True),
        ((16, 128), "int8", True),
        ((40, 128), "int8", False),
    ],
    ids=_id,
)
def test_tile_aligned(shape: tuple[int, int], dtype: str, aligned: bool) -> None:
    assert mosaic.tile_aligned(shape, dtype) is aligned


@pytest.mark.parametrize(
    ("rows", "dtype", "split"),
    [
        (5, "float32", (3, 2)),
        (1, "float32", (1, 0)),
        (8, "float32", (8, 0)),
        (24, "float32", (16, 8)),
        (96, "int8", (64, 32)),
        (96, "bfloat16", (48, 48)),
        (3, "int8", (2, 1)),
    ],
    ids=_id,
)
def test_bidirectional_split_is_tile_aligned_where_the_shard_is(rows: int, dtype: str, split: tuple) -> None:
    assert row_split((rows, 128), dtype, bidirectional=True) == split
    assert row_split((rows, 128), dtype, bidirectional=False) == (rows, 0)
    # compiled for a TPU, a shard that does not fill whole tiles goes one way whole
    aligned = mosaic.tile_aligned((rows, 128), dtype)
    on_tpu = split if aligned else (rows, 0)
    assert row_split((rows, 128), dtype, bidirectional=True, for_tpu=True) == on_tpu


def _lower_for_tpu(kernel, shape: tuple[int, ...], dtype) -> str:
    mesh = build_mesh(parse_mesh("4-x-explicit"))
    x = jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, P("x")))
    fn = jax.jit(lambda x: kernel(x, mesh=mesh, axis_name="x"))
    return compat.lower_for_platform(fn, (x,), "tpu").as_text()


@pytest.mark.parametrize("kernel", RINGS, ids=lambda k: k.__name__)
@pytest.mark.parametrize(
    ("shape", "dtype", "named", "compiled_from"),
    [
        ((12, 128), jnp.float32, "(4, 128) tiles", ROWS_FREE_FOR_32_BITS),
        ((32, 64), jnp.float32, "128", ANY_2D_WINDOW),
        ((12, 128), jnp.bfloat16, "tiles", ANY_2D_WINDOW),
        ((32, 128), jnp.bool_, "bool", None),
        ((32, 128), jnp.float16, "float16", None),
        ((512,), jnp.float32, "1-D shard", None),
    ],
    ids=_id,
)
def test_ring_refuses_what_the_tpu_compiler_of_this_jax_refuses(
    kernel, shape: tuple[int, ...], dtype, named: str, compiled_from: tuple[int, ...] | None
) -> None:
    """Refused, naming the constraint, where the libtpu this JAX pins refuses it (measured with the
    real compiler: ``compiled_from`` is the first libtpu that compiles it, ``None`` none does);
    lowered where it compiles. ``tpu_layout`` holds the same against the compiler itself."""
    libtpu = tpu_compiler.libtpu_in_use()
    if compiled_from is not None and libtpu >= compiled_from:
        _lower_for_tpu(kernel, shape, dtype)  # no refusal
        return
    with pytest.raises(mosaic.TpuConstraintError, match=r".*") as refusal:
        _lower_for_tpu(kernel, shape, dtype)
    assert kernel.__name__ in str(refusal.value) and named in str(refusal.value), str(refusal.value)


@contextlib.contextmanager
def _x64() -> Iterator[None]:
    previous = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", True)
    try:
        yield
    finally:
        jax.config.update("jax_enable_x64", previous)


@pytest.mark.parametrize("kernel", RINGS, ids=lambda k: k.__name__)
def test_ring_lowers_under_x64_and_refuses_64_bit_elements(kernel) -> None:
    with _x64():
        _lower_for_tpu(kernel, (4 * 32, 128), jnp.float32)
        with pytest.raises(mosaic.TpuConstraintError, match=r"64-bit|float64") as refusal:
            _lower_for_tpu(kernel, (4 * 32, 128), jnp.float64)
    assert "32 bits" in str(refusal.value)
