"""Explicit NCCL point-to-point transfers through CuPy, the JaxPP communication design.

The algorithm, per call of ``nccl_send_recv(x, dst=...)``:

1. Pair device ``i`` of the source mesh with device ``i`` of the destination mesh.
2. For each pair, one NCCL communicator over the pair's distinct devices (one rank when a shard
   stays on its device, else two, ranked by device id), created once and cached under the
   sorted device ids and the local rank. Creating one is collective: the rank of the lowest
   device id makes the NCCL unique id and publishes it through the ``jax.distributed``
   key-value store as its raw 128 bytes (never a pickle: unpickling bytes from the network
   runs code); the other rank reads them back. Every communicator this call needs is created
   inside one ``groupStart``/``groupEnd``, so ranks never wait on each other in a different order.
3. One non-blocking CUDA stream per local device, created once and cached under the device id
   (the seed cached streams under one key and looked them up under another: a new stream per
   call).
4. Inputs and freshly allocated outputs are made ready (``block_until_ready``), then every send
   and receive of this process is enqueued inside one NCCL group on those streams, by raw device
   pointer; then the streams are synchronized before the result is handed to JAX. The host waits:
   this implementation trades overlap for an ordering that needs no JAX-internal stream API.
5. NCCL moves bytes, so every dtype is sent as its bit pattern: bfloat16 and float8 as bytes
   (CuPy has no bfloat16 on every version), complex as pairs of reals.

Limits: GPU only; needs CuPy with NCCL; no ``timeout=`` (a blocking NCCL receive whose peer never
comes waits forever, so it is not claimed); a process that owns neither end of a pair makes no
communicator for it. With one GPU, the only destination is the source device itself (a one-rank
communicator sending to itself); NCCL refuses two ranks of one communicator on the same GPU.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import numpy as np

import conformance

#: dtype name -> (NCCL type, elements per array element): bytes for what NCCL has no exact type
#: for or what CuPy cannot name on every version, pairs of reals for complex.
_NCCL_TYPES: dict[str, tuple[str, int]] = {
    "float32": ("FLOAT32", 1),
    "float64": ("FLOAT64", 1),
    "float16": ("FLOAT16", 1),
    "int8": ("INT8", 1),
    "uint8": ("UINT8", 1),
    "int32": ("INT32", 1),
    "uint32": ("UINT32", 1),
    "int64": ("INT64", 1),
    "uint64": ("UINT64", 1),
    "complex64": ("FLOAT32", 2),
    "complex128": ("FLOAT64", 2),
    "bool": ("UINT8", 1),
}

#: Length of an NCCL unique id (``NCCL_UNIQUE_ID_BYTES``).
UNIQUE_ID_BYTES = 128


def nccl_type_and_count(dtype, size: int) -> tuple[str, int]:
    """``(NCCL type name, count)`` that moves ``size`` elements of ``dtype`` bit for bit.

    The name is the suffix of CuPy's ``nccl.NCCL_<NAME>`` constant. 16-bit brain floats and
    every 8-bit float go as bytes; a dtype this does not know raises ``TypeError`` naming it.
    """
    dt = np.dtype(dtype)
    name = dt.name
    if name in _NCCL_TYPES:
        nccl_name, per = _NCCL_TYPES[name]
        return nccl_name, size * per
    if name == "bfloat16" or name.startswith("float8"):
        return "UINT8", size * dt.itemsize
    raise TypeError(f"nccl_send_recv: no NCCL type moves dtype {name} bit for bit")


def encode_unique_id(unique_id: bytes | Sequence[int]) -> bytes:
    """NCCL's unique id as the raw bytes the key-value store carries.

    CuPy 14 returns ``bytes``; earlier CuPy returns a tuple of 128 C ``char`` values (signed on
    x86). Anything else, or another length, raises naming what it got.
    """
    if isinstance(unique_id, bytes | bytearray):
        raw = bytes(unique_id)
    elif isinstance(unique_id, tuple | list) and all(
        isinstance(v, int) and -128 <= v <= 255 for v in unique_id
    ):
        raw = bytes(v % 256 for v in unique_id)
    else:
        raise TypeError(f"an NCCL unique id is bytes or a tuple of ints, got {type(unique_id).__name__}")
    if len(raw) != UNIQUE_ID_BYTES:
        raise ValueError(f"an NCCL unique id has {UNIQUE_ID_BYTES} bytes, got {len(raw)}")
    return raw


def decode_unique_id(raw: bytes, *, as_bytes: bool) -> bytes | tuple[int, ...]:
    """Inverse of :func:`encode_unique_id`, in the form this CuPy's ``NcclCommunicator`` takes."""
    if not isinstance(raw, bytes) or len(raw) != UNIQUE_ID_BYTES:
        raise ValueError(f"expected the {UNIQUE_ID_BYTES} raw bytes of an NCCL unique id, got {raw!r:.60}")
    if as_bytes:
        return raw
    return tuple(b - 256 if b > 127 else b for b in raw)


def communicator_key(device_ids: Sequence[int]) -> str:
    """The key a communicator over these devices is cached and published under: sorted, distinct ids."""
    ids = sorted(set(device_ids))
    if not ids:
        raise ValueError("a communicator needs at least one device")
    return "conformance/nccl/" + "-".join(str(i) for i in ids)


def ranks_of(device_ids: Sequence[int]) -> dict[int, int]:
    """NCCL rank of each device of a communicator: its place among the sorted distinct ids."""
    return {d: r for r, d in enumerate(sorted(set(device_ids)))}


# -- the GPU side -------------------------------------------------------------------------------

_LOCK = threading.Lock()
#: (communicator key, device id) -> NcclCommunicator of that device's rank.
_COMMS: dict[tuple[str, int], object] = {}
#: device id -> the cupy Stream every transfer of that device is enqueued on.
_STREAMS: dict[int, object] = {}
#: How many of each this process ever made (the resources check reads these).
_MADE = {"communicators": 0, "streams": 0}
_ID_IS_BYTES: list[bool] = []
#: Milliseconds a non-leader rank waits for its communicator's unique id.
ID_TIMEOUT_MS = 60_000


def resources() -> dict[str, int]:
    """Communicators and CUDA streams this process has made so far."""
    return dict(_MADE)


def _nccl():
    from cupy.cuda import nccl

    return nccl


def _stream(device):
    import cupy

    stream = _STREAMS.get(device.id)
    if stream is None:
        with cupy.cuda.Device(device.local_hardware_id):
            stream = cupy.cuda.Stream(non_blocking=True)
        _STREAMS[device.id] = stream  # the same key it is read with
        _MADE["streams"] += 1
    return stream


def _ensure_communicators(needed: list[tuple[str, list[int], object]], comms: dict, id_transport) -> None:
    """Create, in one NCCL group, the communicators of ``(key, device ids, local device)`` not in
    ``comms``; ``id_transport`` (the self-tests') stands between making an id and using it."""
    import cupy
    import jax

    from conformance.kernels.send_recv._validation import key_value_client

    nccl = _nccl()
    missing = list({(k, d.id): (k, ids, d) for k, ids, d in needed if (k, d.id) not in comms}.values())
    if not missing:
        return
    if not _ID_IS_BYTES:
        _ID_IS_BYTES.append(isinstance(nccl.get_unique_id(), bytes))
    ids_by_key: dict[str, bytes] = {}
    by_id = {d.id: d for d in jax.devices()}
    for key, ids, _ in missing:
        if key in ids_by_key:
            continue
        leader = by_id[min(ids)]
        if leader.process_index == jax.process_index():
            raw = encode_unique_id(nccl.get_unique_id())
            if any(by_id[i].process_index != leader.process_index for i in ids):
                key_value_client("nccl_send_recv").key_value_set_bytes(key, raw)
        else:
            raw = key_value_client("nccl_send_recv").blocking_key_value_get_bytes(key, ID_TIMEOUT_MS)
        ids_by_key[key] = raw if id_transport is None else id_transport(raw)
    nccl.groupStart()
    try:
        for key, ids, device in missing:
            uid = decode_unique_id(ids_by_key[key], as_bytes=_ID_IS_BYTES[0])
            with cupy.cuda.Device(device.local_hardware_id):
                comm = nccl.NcclCommunicator(len(set(ids)), uid, ranks_of(ids)[device.id])
            comms[(key, device.id)] = comm
            if comms is _COMMS:
                _MADE["communicators"] += 1
    finally:
        nccl.groupEnd()


def send_recv(x, dst, *, stream_for=None, id_transport=None, comms=None):
    """The transfer of :func:`nccl_send_recv` after validation, as a ``jax.Array`` on ``dst``.
    The keywords let the self-tests swap in the seed's stream cache and id exchange; the
    implementation uses the defaults (its own caches, raw bytes)."""
    import jax

    outputs = _transfer(x, dst, stream_for or _stream, id_transport, _COMMS if comms is None else comms)
    local = [d for d in dst.mesh.devices.flat if d.process_index == jax.process_index()]
    return jax.make_array_from_single_device_arrays(
        x.shape, dst, [outputs[d.id] for d in local], dtype=x.dtype
    )


def _transfer(x, dst, stream_for, id_transport, comms):
    import cupy
    import jax
    import jax.numpy as jnp

    from conformance.kernels.send_recv._validation import device_pairs

    nccl = _nccl()
    me = jax.process_index()
    src_shards = {s.device.id: s.data for s in x.addressable_shards}
    pairs = [(s, d) for s, d in device_pairs(x.sharding, dst) if me in (s.process_index, d.process_index)]
    shard_shape = dst.shard_shape(x.shape)
    outputs = {}
    for _, d in pairs:
        if d.process_index == me and d.id not in outputs:
            outputs[d.id] = jnp.zeros(shard_shape, x.dtype, device=d)
    type_name, count = nccl_type_and_count(x.dtype, int(np.prod(shard_shape)))
    if count == 0:  # nothing to move: every shard is empty
        return outputs
    needed = []
    for s, d in pairs:
        key = communicator_key((s.id, d.id))
        for end in {s.id: s, d.id: d}.values():
            if end.process_index == me:
                needed.append((key, [s.id, d.id], end))
    with _LOCK:
        _ensure_communicators(needed, comms, id_transport)
        for a in (*src_shards.values(), *outputs.values()):
            a.block_until_ready()
        nccl_type = getattr(nccl, f"NCCL_{type_name}")
        used = {}
        nccl.groupStart()
        try:
            for s, d in pairs:
                key, ranks = communicator_key((s.id, d.id)), ranks_of((s.id, d.id))
                if s.process_index == me:
                    stream = used.setdefault(s.id, stream_for(s))
                    with cupy.cuda.Device(s.local_hardware_id):
                        comms[(key, s.id)].send(
                            src_shards[s.id].unsafe_buffer_pointer(),
                            count,
                            nccl_type,
                            ranks[d.id],
                            stream.ptr,
                        )
                if d.process_index == me:
                    stream = used.setdefault(d.id, stream_for(d))
                    with cupy.cuda.Device(d.local_hardware_id):
                        comms[(key, d.id)].recv(
                            outputs[d.id].unsafe_buffer_pointer(), count, nccl_type, ranks[s.id], stream.ptr
                        )
        finally:
            nccl.groupEnd()
        for stream in used.values():
            stream.synchronize()
    return outputs


@conformance.register(
    "send_recv",
    name="nccl_send_recv",
    platforms=("gpu",),
    requires=("cupy", "cupy.cuda.nccl"),
    resources=resources,
    description="NCCL send/recv through CuPy: raw-byte unique ids, one stream per device",
)
def nccl_send_recv(x, *, dst):
    """Each shard of ``x`` to the device of the same mesh position of ``dst``, by NCCL send/recv."""
    from conformance.kernels.send_recv._validation import validate_destination

    validate_destination("nccl_send_recv", x, dst)
    return send_recv(x, dst)
