"""send_recv kernels broken in one way each (the suite must reject each by the check meant for
it), the seed's two NCCL defects on real NCCL (GPU), and correct kernels in other styles.

Each broken kernel copies shard by shard like the baseline and then does one wrong thing.
"""

from __future__ import annotations

import pickle
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

import conformance
from conformance.kernels.send_recv import nccl_cupy
from conformance.kernels.send_recv._validation import device_pairs, validate_destination

FAMILY = "send_recv"

#: broken kernel -> the test that must reject it
EXPECTED_REJECTION = {
    "broken_sr_flips_low_bit": "test_values",
    "broken_sr_canonicalizes_nan": "test_values",
    "broken_sr_pairs_reversed": "test_values",
    "broken_sr_whole_array_device_put": "test_values",
    "broken_sr_keeps_source_devices": "test_sharding",
    "broken_sr_deletes_source": "test_source_intact",
    "broken_sr_accepts_any_destination": "test_bad_destination",
    "broken_sr_thread_per_call": "test_resources",
    "broken_sr_seed_stream_cache": "test_resources",
    "broken_sr_pickles_unique_id": "test_no_pickle",
    "broken_sr_hangs_on_empty_shards": "test_values",
    "broken_sr_pairs_by_position": "test_block_map",
}
#: what the failure must say, where the check has more than one way to fail
EXPECTED_MESSAGE = {
    "broken_sr_hangs_on_empty_shards": "did not return within 9 s (hung)",
    "broken_sr_pairs_by_position": "(same shard shapes, another block map)",
}
#: GPU only (real NCCL): the seed's defects, each rejected by its check.
EXPECTED_REJECTION_GPU = {
    "broken_nccl_seed_stream_cache": "test_resources",
    "broken_nccl_seed_pickled_id": "test_no_pickle",
}
#: correct kernels in other styles: they must pass every check they run.
CORRECT = ("correct_sr_device_put_loop", "correct_sr_via_host")


def _copies(x: jax.Array, dst: NamedSharding) -> dict:
    shards = {s.device: s.data for s in x.addressable_shards}
    return {d: jax.device_put(shards[s], d) for s, d in device_pairs(x.sharding, dst)}


def _assemble(x: jax.Array, dst: NamedSharding, copies: dict) -> jax.Array:
    return jax.make_array_from_single_device_arrays(x.shape, dst, [copies[d] for d in dst.mesh.devices.flat])


def _bits(a: jax.Array) -> jax.Array:
    dt = np.dtype(a.dtype)
    return jax.lax.bitcast_convert_type(a, jnp.dtype(f"uint{8 * dt.itemsize}")) if dt != np.bool_ else a


@conformance.register(FAMILY, name="broken_sr_flips_low_bit")
def broken_sr_flips_low_bit(x, *, dst):
    """Flips the lowest bit of the last element of every shard (a stray write)."""
    validate_destination("broken_sr_flips_low_bit", x, dst)
    copies = {}
    for d, a in _copies(x, dst).items():
        host = np.array(a)
        if host.size:
            flat = host.reshape(-1).view(np.uint8)
            flat[-1] ^= 1
        copies[d] = jax.device_put(host, d)
    return _assemble(x, dst, copies)


#: What the hanging kernel waits on: nothing ever sets it.
_NEVER = threading.Event()


@conformance.register(FAMILY, name="broken_sr_hangs_on_empty_shards")
def broken_sr_hangs_on_empty_shards(x, *, dst):
    """Waits forever for a shard of zero elements, as a pull of a zero-byte buffer from JAX's
    transfer server did (found by the values check); the check's call bound must end it."""
    validate_destination("broken_sr_hangs_on_empty_shards", x, dst)
    if x.size == 0:
        _NEVER.wait()
    return _assemble(x, dst, _copies(x, dst))


@conformance.register(FAMILY, name="broken_sr_canonicalizes_nan")
def broken_sr_canonicalizes_nan(x, *, dst):
    """Moves floats through float32 arithmetic (``x * 1``): NaN payloads and signalling NaNs lost."""
    validate_destination("broken_sr_canonicalizes_nan", x, dst)
    out = {}
    for d, a in _copies(x, dst).items():
        if jnp.issubdtype(a.dtype, jnp.floating):
            a = (a.astype(jnp.float32) * 1).astype(a.dtype)
        out[d] = a
    return _assemble(x, dst, out)


@conformance.register(FAMILY, name="broken_sr_pairs_reversed")
def broken_sr_pairs_reversed(x, *, dst):
    """Pairs source device i with destination device n-1-i (the wrong peer); a ppermute, so it
    runs across processes too."""
    from conformance.kernels.send_recv import xla

    validate_destination("broken_sr_pairs_reversed", x, dst)
    pairs = device_pairs(x.sharding, dst)
    wrong = [(s, d) for (s, _), (_, d) in zip(pairs[::-1], pairs, strict=True)]
    return xla._by_ppermute(x, dst, wrong)


@conformance.register(FAMILY, name="broken_sr_whole_array_device_put")
def broken_sr_whole_array_device_put(x, *, dst):
    """Whole-array ``jax.device_put``: onto the source's devices in another order JAX runs a
    resharding program that drops bfloat16 and float8 NaN payloads (see the baseline's docstring)."""
    validate_destination("broken_sr_whole_array_device_put", x, dst)
    return jax.device_put(x, dst)


@conformance.register(FAMILY, name="broken_sr_keeps_source_devices")
def broken_sr_keeps_source_devices(x, *, dst):
    """Returns a copy of ``x`` where it is: right values, wrong devices."""
    validate_destination("broken_sr_keeps_source_devices", x, dst)
    return jax.device_put(x, x.sharding, may_alias=False)


@conformance.register(FAMILY, name="broken_sr_deletes_source")
def broken_sr_deletes_source(x, *, dst):
    """Consumes its input (as the seed's receive did): ``x`` is deleted after the copy."""
    validate_destination("broken_sr_deletes_source", x, dst)
    out = _assemble(x, dst, _copies(x, dst))
    out.block_until_ready()
    x.delete()
    return out


@conformance.register(FAMILY, name="broken_sr_accepts_any_destination")
def broken_sr_accepts_any_destination(x, *, dst):
    """No check of ``dst``: another spec or mesh is silently resharded."""
    return jax.device_put(x, dst)


_PARKED: list[threading.Event] = []


@conformance.register(FAMILY, name="broken_sr_thread_per_call")
def broken_sr_thread_per_call(x, *, dst):
    """Starts a helper thread on every call and never joins it."""
    validate_destination("broken_sr_thread_per_call", x, dst)
    stop = threading.Event()
    _PARKED.append(stop)
    threading.Thread(target=stop.wait, daemon=True).start()
    return _assemble(x, dst, _copies(x, dst))


_SEED_STREAMS: dict = {}
_SEED_MADE = {"streams": 0}


def _seed_stream(op: str, device):
    """The seed's cache: looked up under ``(op, device)``, stored under ``device``."""
    stream = _SEED_STREAMS.get((op, device))
    if stream is None:
        stream = object()  # stands for cupy.cuda.Stream(non_blocking=True)
        _SEED_MADE["streams"] += 1
        _SEED_STREAMS[device] = stream
    return stream


@conformance.register(FAMILY, name="broken_sr_seed_stream_cache", resources=lambda: dict(_SEED_MADE))
def broken_sr_seed_stream_cache(x, *, dst):
    """The seed's stream cache on CPU: a new "stream" per call and device."""
    validate_destination("broken_sr_seed_stream_cache", x, dst)
    for s, d in device_pairs(x.sharding, dst):
        _seed_stream("send", s)
        _seed_stream("recv", d)
    return _assemble(x, dst, _copies(x, dst))


@conformance.register(FAMILY, name="broken_sr_pickles_unique_id")
def broken_sr_pickles_unique_id(x, *, dst):
    """The seed's id exchange: the peer's id is a pickle, loaded (here from this process)."""
    validate_destination("broken_sr_pickles_unique_id", x, dst)
    pickle.loads(pickle.dumps(bytes(128)))
    return _assemble(x, dst, _copies(x, dst))


# -- the seed's defects on real NCCL (GPU) ---------------------------------------------------------

_NCCL_SEED_MADE = {"streams": 0}
_NCCL_SEED_STREAMS: dict = {}


def _nccl_seed_stream(device):
    import cupy

    stream = _NCCL_SEED_STREAMS.get(("send", device.id))  # read under one key ...
    if stream is None:
        with cupy.cuda.Device(device.local_hardware_id):
            stream = cupy.cuda.Stream(non_blocking=True)
        _NCCL_SEED_STREAMS[device.id] = stream  # ... written under another
        _NCCL_SEED_MADE["streams"] += 1
    return stream


@conformance.register(
    FAMILY,
    name="broken_nccl_seed_stream_cache",
    platforms=("gpu",),
    requires=("cupy", "cupy.cuda.nccl"),
    resources=lambda: dict(_NCCL_SEED_MADE),
)
def broken_nccl_seed_stream_cache(x, *, dst):
    """The NCCL implementation with the seed's stream cache: a new CUDA stream per call."""
    validate_destination("broken_nccl_seed_stream_cache", x, dst)
    return nccl_cupy.send_recv(x, dst, stream_for=_nccl_seed_stream)


def _pickled_id(raw: bytes) -> bytes:
    return pickle.loads(pickle.dumps(raw))  # the seed: pickle.dumps to the store, pickle.loads back


@conformance.register(
    FAMILY, name="broken_nccl_seed_pickled_id", platforms=("gpu",), requires=("cupy", "cupy.cuda.nccl")
)
def broken_nccl_seed_pickled_id(x, *, dst):
    """The NCCL implementation with the seed's id exchange: the unique id goes through pickle."""
    validate_destination("broken_nccl_seed_pickled_id", x, dst)
    # its own communicators each call, so every call exchanges an id
    return nccl_cupy.send_recv(x, dst, id_transport=_pickled_id, comms={})


# -- correct, in other styles -----------------------------------------------------------------------


@conformance.register(FAMILY, name="correct_sr_device_put_loop")
def correct_sr_device_put_loop(x, *, dst):
    """A general helper of another style: each device of ``dst`` gets, by ``jax.device_put``, the
    source's block at the index ``dst`` gives it (looked up by index, not paired by position), so
    a destination with another block-to-device map is moved correctly; one asking for a block the
    source does not hold whole, or another memory kind, is refused. One process."""

    def block(index):
        return tuple(s.indices(n)[:2] for s, n in zip(index, x.shape, strict=True))

    by_index = {}
    for shard in x.addressable_shards:
        by_index.setdefault(block(shard.index), shard.data)
    wanted = {device: block(index) for device, index in dst.addressable_devices_indices_map(x.shape).items()}
    missing = sorted({w for w in wanted.values() if w not in by_index})
    if missing or dst.memory_kind != x.sharding.memory_kind:
        raise ValueError(
            f"cannot send {x.sharding} to {dst}: blocks {missing} are no shard of the source, "
            f"memory kind {x.sharding.memory_kind} -> {dst.memory_kind}"
        )
    arrays = [jax.device_put(by_index[w], device) for device, w in wanted.items()]
    return jax.make_array_from_single_device_arrays(x.shape, dst, arrays)


@conformance.register(FAMILY, name="correct_sr_via_host")
def correct_sr_via_host(x, *, dst):
    """Through host memory as raw bytes: ``np.asarray`` and ``jax.make_array_from_callback``, so any
    destination with the source's device count, shard shape and memory kind is placed right (the
    equivalent spellings of the source's placement and other block maps alike). One process."""
    src = x.sharding
    if (dst.mesh.devices.size, dst.shard_shape(x.shape), dst.memory_kind) != (
        src.mesh.devices.size,
        src.shard_shape(x.shape),
        src.memory_kind,
    ):
        raise ValueError(
            f"source {src} and destination {dst} differ in device count, shard shape or memory kind"
        )
    host = np.asarray(x)
    return jax.make_array_from_callback(x.shape, dst, lambda index: host[index])


@conformance.register(FAMILY, name="broken_sr_pairs_by_position")
def broken_sr_pairs_by_position(x, *, dst):
    """Checks only that the shards keep their shapes, then sends the shard of source device ``i`` to
    destination device ``i``: on ``P('y', 'x')`` for ``P('x', 'y')`` the off-diagonal blocks land
    swapped (a real transfer helper did this)."""
    src = x.sharding
    if (dst.mesh.devices.size, dst.shard_shape(x.shape), dst.memory_kind) != (
        src.mesh.devices.size,
        src.shard_shape(x.shape),
        src.memory_kind,
    ):
        raise ValueError(f"broken_sr_pairs_by_position: cannot send {src} to {dst}")
    return _assemble(x, dst, _copies(x, dst))


#: Rejected in a multi-process job only (it needs the job's key-value store).
EXPECTED_REJECTION_MULTIPROCESS = {"broken_sr_publishes_pickle": "test_no_pickle"}
_PUBLISHED = [0]


@conformance.register(FAMILY, name="broken_sr_publishes_pickle")
def broken_sr_publishes_pickle(x, *, dst):
    """The seed's leader side: publishes its (stand-in) unique id as a pickle in the key-value store."""
    from conformance.jobs import distributed

    validate_destination("broken_sr_publishes_pickle", x, dst)
    client = distributed.client()
    if client is not None:
        _PUBLISHED[0] += 1
        client.key_value_set_bytes(f"broken/{jax.process_index()}/{_PUBLISHED[0]}", pickle.dumps(bytes(128)))
    from conformance.kernels.send_recv.xla import xla_device_put

    return xla_device_put(x, dst=dst)


# -- timeout= (checked in a job of 2 or more processes only) --------------------------------------


class KeyValueTransfer:
    """Shards through the job's key-value store as raw bytes: the sender sets one key per shard, the
    receiver waits for it (``blocking_key_value_get_bytes``, bounded by ``timeout``) and deletes it.
    Pairs inside one process are a ``device_put``. Call ``n`` uses keys ``.../n/<pair>``; a call that
    times out does not use up its number (the sender never reached it), so the next call of both
    sides meets under the same keys. The knobs break that, one way each."""

    def __init__(
        self,
        name: str,
        *,
        honours_timeout: bool = True,
        error: type[Exception] = TimeoutError,
        counts_timed_out_calls: bool = False,
    ) -> None:
        self.name, self.honours_timeout, self.error = name, honours_timeout, error
        self.counts_timed_out_calls = counts_timed_out_calls
        self.calls = 0

    def __call__(self, x, *, dst, timeout: float | None = None):
        from conformance.jobs import distributed

        src = validate_destination(self.name, x, dst)
        me, call = jax.process_index(), self.calls
        shards = {s.device: s.data for s in x.addressable_shards}
        shard_shape = dst.shard_shape(x.shape)
        client = distributed.client()
        key = f"conformance/selftest/{self.name}/{call}/{{pair}}"
        for k, (s, d) in enumerate(device_pairs(src, dst)):
            if s.process_index == me and d.process_index != me:
                client.key_value_set_bytes(key.format(pair=k), np.asarray(shards[s]).tobytes())
        copies = {}
        for k, (s, d) in enumerate(device_pairs(src, dst)):
            if d.process_index != me:
                continue
            if s.process_index == me:
                copies[d] = jax.device_put(shards[s], d)
                continue
            wait_s = timeout if (timeout is not None and self.honours_timeout) else 15.0
            raw = _poll_bytes(client, key.format(pair=k), wait_s)
            if raw is None:
                if self.counts_timed_out_calls:
                    self.calls += 1
                if timeout is None or self.error is not TimeoutError:
                    raise self.error(f"DEADLINE_EXCEEDED: {key.format(pair=k)} not set within {wait_s:g} s")
                raise TimeoutError(
                    f"{self.name}: process {s.process_index} (device {s.id}) sent nothing "
                    f"within {timeout:g} s"
                )
            client.key_value_delete(key.format(pair=k))
            host = np.frombuffer(raw, dtype=x.dtype).reshape(shard_shape)
            copies[d] = jax.device_put(host, d)
        self.calls += 1
        local = [d for d in dst.mesh.devices.flat if d.process_index == me]
        arrays = [copies[d] for d in local]
        return jax.make_array_from_single_device_arrays(x.shape, dst, arrays, dtype=x.dtype)


def _poll_bytes(client, key: str, wait_s: float) -> bytes | None:
    """The bytes at ``key`` once set, or ``None`` after ``wait_s``. Polled: under JAX 0.6.2 a
    ``blocking_key_value_get`` left waiting in one thread stalled the job's other key-value calls."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            return client.key_value_try_get_bytes(key)
        except Exception:  # NOT_FOUND: not set yet
            if time.monotonic() > deadline:
                return None
            time.sleep(0.01)


def _key_value_kernel(name: str, **knobs):
    transfer = KeyValueTransfer(name, **knobs)

    def kernel(x, *, dst, timeout: float | None = None):
        return transfer(x, dst=dst, timeout=timeout)

    kernel.__name__ = kernel.__qualname__ = name
    kernel.__doc__ = KeyValueTransfer.__doc__
    return kernel


#: In a job, these claim ``timeout=``: the correct one passes the timeout check, each broken one fails it.
TIMEOUT_CORRECT = "correct_sr_key_value_store"
EXPECTED_REJECTION_TIMEOUT = {
    "broken_sr_timeout_ignored": "did not return within 10 s",  # waits 15 s, past the bound
    "broken_sr_timeout_raises_runtime_error": "not TimeoutError",
    "broken_sr_timeout_loses_its_place": "the transfer after a timed-out call is wrong",
}
for _name, _knobs in (
    (TIMEOUT_CORRECT, {}),
    ("broken_sr_timeout_ignored", {"honours_timeout": False}),
    ("broken_sr_timeout_raises_runtime_error", {"error": RuntimeError}),
    ("broken_sr_timeout_loses_its_place", {"counts_timed_out_calls": True}),
):
    conformance.register(FAMILY, name=_name, accepts_timeout=True)(_key_value_kernel(_name, **_knobs))
