"""Point-to-point through JAX's transfer servers (``jax.experimental.transfer``).

A transfer server is a small socket server inside a JAX process that hands device buffers to a
peer that asks for them by number: the sender *offers* arrays under a ``uuid``
(``server.await_pull(uuid, arrays)``, which returns at once) and the receiver *pulls* them onto
its own devices (``server.connect(address).pull(uuid, shape_dtype_structs)``). Bytes move as they
are, so every bit pattern arrives.

The algorithm, per call of ``jax_transfer_server(x, dst=...)``:

1. Pair device ``i`` of the source mesh with device ``i`` of the destination mesh, and group the
   pairs by (sending process, receiving process); a process takes part only in its own groups.
2. One server per process, started on first use, listening on the loopback interface (or the
   host named by ``CONFORMANCE_TRANSFER_HOST``), port chosen by the OS. Its address travels to
   the other processes through the ``jax.distributed`` key-value store as plain text
   (``conformance/transfer_server/<process>``); one connection per peer is opened once and
   cached. A process also pulls from its own server, so a one-process run moves its bytes through
   the same sockets as a job does.
3. Every process counts its calls; since every process calls with the same arguments in the same
   order, call ``n`` has the same number everywhere, and the group (sender ``p``, receiver ``q``)
   of call ``n`` is offered and pulled under ``uuid = n * 2**32 + q * 2**16 + p``: numbers never
   repeat, and no process needs to ask another which number to use.
4. The sender offers the group's shards in pair order; the receiver pulls them, in the same order,
   each onto its destination device, and assembles the result under ``dst``. Shards of zero
   elements carry no bits and are made at the destination: a pull of a zero-byte buffer never
   completed (JAX 0.10.2 on CPU; found by this family's values check).

Limits: no ``timeout=`` (``pull(..., timeout=)`` exists from JAX 0.7, but on CPU a pull whose
offer never comes did not end in JAX 0.10.2 or 0.12 when measured, so it is not claimed); an offer
that is never pulled keeps its shards alive in the server; at most 65536 processes.
"""

from __future__ import annotations

import itertools
import math
import os
import threading
from collections import defaultdict

import jax
import numpy as np
from jax.sharding import NamedSharding, SingleDeviceSharding

import conformance
from conformance.kernels.send_recv._validation import device_pairs, key_value_client, validate_destination

#: Key-value store key under which process ``p`` publishes its server's address.
ADDRESS_KEY = "conformance/transfer_server/{process}"
#: How long a process waits for a peer to publish its address.
ADDRESS_TIMEOUT_MS = 60_000

_lock = threading.Lock()
_server = None
_connections: dict[int, object] = {}
_calls = itertools.count()


def _transfer():
    from jax.experimental import transfer

    return transfer


def server():
    """This process's transfer server, started (and its address published) on first use."""
    global _server
    with _lock:
        if _server is None:
            host = os.environ.get("CONFORMANCE_TRANSFER_HOST", "127.0.0.1")
            client = jax.local_devices()[0].client
            _server = _transfer().start_transfer_server(client, f"{host}:0", [f"{host}:0"])
            if jax.process_count() > 1:
                key = ADDRESS_KEY.format(process=jax.process_index())
                key_value_client("jax_transfer_server").key_value_set(key, _server.address())
        return _server


def connection(process: int):
    """The cached connection to the server of ``process`` (this one's own included)."""
    own = server()
    with _lock:
        if process not in _connections:
            if process == jax.process_index():
                address = own.address()
            else:
                key = ADDRESS_KEY.format(process=process)
                client = key_value_client("jax_transfer_server")
                address = client.blocking_key_value_get(key, ADDRESS_TIMEOUT_MS)
            _connections[process] = own.connect(address)
        return _connections[process]


def transfer_uuid(call: int, sender: int, receiver: int) -> int:
    """The number group (``sender`` -> ``receiver``) of call ``call`` is offered and pulled under."""
    if not (0 <= sender < 2**16 and 0 <= receiver < 2**16):
        raise ValueError(f"jax_transfer_server: process indices {sender}, {receiver} do not fit 16 bits")
    return call * 2**32 + receiver * 2**16 + sender


@conformance.register(
    "send_recv",
    name="jax_transfer_server",
    description="jax.experimental.transfer: a transfer server per process, shards offered and pulled by uuid",
    resources=lambda: {"transfer connections": len(_connections)},
)
def jax_transfer_server(x: jax.Array, *, dst: NamedSharding) -> jax.Array:
    src = validate_destination("jax_transfer_server", x, dst)
    call = next(_calls)
    me = jax.process_index()
    groups: dict[tuple[int, int], list[tuple[jax.Device, jax.Device]]] = defaultdict(list)
    for s, d in device_pairs(src, dst):
        groups[s.process_index, d.process_index].append((s, d))
    shard_shape = dst.shard_shape(x.shape)
    if math.prod(shard_shape) == 0:  # no bits to move (a zero-byte pull never completes)
        empty = np.zeros(shard_shape, x.dtype)
        return jax.make_array_from_callback(x.shape, dst, lambda _: empty, dtype=x.dtype)
    shards = {s.device: s.data for s in x.addressable_shards}
    with jax.named_scope("offer"):  # every offer first: a pull never waits on this process's own offer
        for (sender, receiver), pairs in sorted(groups.items()):
            if sender == me:
                server().await_pull(transfer_uuid(call, sender, receiver), [shards[s] for s, _ in pairs])
    received: dict[jax.Device, jax.Array] = {}
    with jax.named_scope("pull"):
        for (sender, receiver), pairs in sorted(groups.items()):
            if receiver == me:
                wanted = [
                    jax.ShapeDtypeStruct(shard_shape, x.dtype, sharding=SingleDeviceSharding(d))
                    for _, d in pairs
                ]
                pulled = connection(sender).pull(transfer_uuid(call, sender, receiver), wanted)
                received.update(zip((d for _, d in pairs), pulled, strict=True))
    local = [d for d in dst.mesh.devices.flat if d.process_index == me]
    return jax.make_array_from_single_device_arrays(x.shape, dst, [received[d] for d in local], dtype=x.dtype)
