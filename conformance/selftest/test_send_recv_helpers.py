"""What of the NCCL implementation and the send_recv checks can be tested without a GPU: the
dtype -> NCCL type and count mapping, the unique id's raw-byte encoding, communicator keys,
the special bit patterns and the pickle-stream detector. Nothing here pretends to run NCCL."""

from __future__ import annotations

import pickle

import ml_dtypes
import numpy as np
import pytest

from conformance import transfers
from conformance.kernels.send_recv import nccl_cupy
from conformance.specs.send_recv import DTYPES, available_dtypes, np_dtype

pytestmark = pytest.mark.selftest


@pytest.mark.parametrize("dtype", available_dtypes(DTYPES))
def test_every_dtype_moves_as_exactly_its_bytes(dtype: str) -> None:
    name, count = nccl_cupy.nccl_type_and_count(np_dtype(dtype), 7)
    width = {"UINT8": 1, "INT8": 1, "FLOAT16": 2, "FLOAT32": 4, "INT32": 4, "UINT32": 4, "FLOAT64": 8}[name]
    assert count * width == 7 * np_dtype(dtype).itemsize, (dtype, name, count)
    if dtype == "bfloat16" or dtype.startswith("float8"):
        assert name == "UINT8"  # no arithmetic type stands for them on every NCCL/CuPy
    if dtype == "complex64":
        assert (name, count) == ("FLOAT32", 14)  # pairs of reals


def test_a_dtype_nccl_cannot_move_is_refused_by_name() -> None:
    with pytest.raises(TypeError, match="int4"):
        nccl_cupy.nccl_type_and_count(np.dtype(ml_dtypes.int4), 3)


def test_the_unique_id_travels_as_raw_bytes_in_either_cupy_form() -> None:
    raw = bytes(range(128))
    signed = tuple(b - 256 if b > 127 else b for b in raw)  # CuPy < 14: C chars, signed on x86
    assert nccl_cupy.encode_unique_id(raw) == raw
    assert nccl_cupy.encode_unique_id(signed) == raw
    assert nccl_cupy.decode_unique_id(raw, as_bytes=True) == raw
    assert nccl_cupy.decode_unique_id(raw, as_bytes=False) == signed
    assert not transfers.is_pickle_stream(nccl_cupy.encode_unique_id(signed))
    with pytest.raises(ValueError, match="128"):
        nccl_cupy.encode_unique_id(b"\x00" * 127)
    with pytest.raises(TypeError, match="str"):
        nccl_cupy.encode_unique_id("not an id")
    with pytest.raises(ValueError, match="raw bytes"):
        nccl_cupy.decode_unique_id(pickle.dumps(raw), as_bytes=True)


def test_communicator_keys_and_ranks_do_not_depend_on_direction() -> None:
    assert nccl_cupy.communicator_key((5, 2)) == nccl_cupy.communicator_key((2, 5)) == "conformance/nccl/2-5"
    assert nccl_cupy.communicator_key((3, 3)) == "conformance/nccl/3"  # a shard that stays: one rank
    assert nccl_cupy.ranks_of((5, 2)) == {2: 0, 5: 1}
    with pytest.raises(ValueError):
        nccl_cupy.communicator_key(())


def test_the_pickle_detector_knows_a_pickle_from_text_and_raw_ids() -> None:
    for protocol in range(2, pickle.HIGHEST_PROTOCOL + 1):
        assert transfers.is_pickle_stream(pickle.dumps(bytes(128), protocol=protocol))
        assert transfers.is_pickle_stream(pickle.dumps(("id", 3), protocol=protocol))
    for value in (b"127.0.0.1:4567", "conformance/nccl/2-5", b"\x80", bytes(128)):
        assert not transfers.is_pickle_stream(value), value


@pytest.mark.parametrize("dtype", available_dtypes(DTYPES))
def test_special_values_are_the_patterns_named(dtype: str) -> None:
    dt = np_dtype(dtype)
    specials = transfers.special_values(dtype)
    assert specials.dtype == dt
    values = transfers.host_values(dtype, (4, 5), seed=1)
    assert values.shape == (4, 5) and values.dtype == dt
    assert values.reshape(-1)[: len(specials)].tobytes() == specials[:20].tobytes()
    if dtype in ("float32", "float16", "bfloat16"):
        bits = specials.view(f"uint{8 * dt.itemsize}")
        mant = {"float32": 23, "float16": 10, "bfloat16": 7}[dtype]
        exp_all = ((1 << (8 * dt.itemsize - 1 - mant)) - 1) << mant
        nans = [int(b) for b in bits if (b & exp_all) == exp_all and b & ((1 << mant) - 1)]
        quiet = [b for b in nans if b & (1 << (mant - 1))]
        assert any(b & 1 for b in quiet), "a quiet NaN with a payload"
        assert len(nans) > len(quiet), "a signalling NaN"
        assert any(0 < (int(b) & ~(1 << (8 * dt.itemsize - 1))) < (1 << mant) for b in bits), "a subnormal"
        assert (1 << (8 * dt.itemsize - 1)) in [int(b) for b in bits], "-0.0"
