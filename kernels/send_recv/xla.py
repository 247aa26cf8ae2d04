"""Baseline: what JAX itself offers for the move.

In one process, ``jax.device_put`` of each shard to its destination device. Device ``i`` of the
source mesh holds the same index of ``x`` as device ``i`` of the destination mesh (same spec,
same mesh shape), so each single-device shard is copied as it is and the copies are assembled
under ``dst`` (``jax.make_array_from_single_device_arrays``).

Across processes, where ``device_put`` cannot reach, a ``ppermute`` over a one-axis mesh of every
device that sends or receives (sources and destinations together, each once): row ``j`` of a
stacked array is the shard of the ``j``-th device (zeros where that device only receives), and
the permutation sends the row of each source's position to its destination's. XLA lowers it to
one collective-permute; gloo moves the bytes between processes on CPU, NCCL on GPUs.

Why not ``jax.device_put(x, dst)`` on the whole array: on CPU, when ``dst`` holds the source's
devices in another order, JAX runs a resharding program that does not preserve bits: a
bfloat16 or float8 NaN's payload comes back canonical (0x7fc1 -> 0x7fc0; JAX 0.6.2, 0.10.2 and
0.12), and in JAX 0.10.2 every shard of an empty array gets the global shape. Both were found by
this family's values check; a shard-by-shard copy shows neither.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import conformance
from conformance.kernels.send_recv._validation import device_pairs, validate_destination


@conformance.register(
    "send_recv",
    name="xla_device_put",
    baseline=True,
    description="jax.device_put shard by shard in one process; a ppermute between processes",
)
def xla_device_put(x: jax.Array, *, dst: NamedSharding) -> jax.Array:
    src = validate_destination("xla_device_put", x, dst)
    pairs = device_pairs(src, dst)
    if any(s.process_index != d.process_index for s, d in pairs):
        return _by_ppermute(x, dst, pairs)
    shards = {s.device: s.data for s in x.addressable_shards}
    me = jax.process_index()
    copies = {d: jax.device_put(shards[s], d) for s, d in pairs if d.process_index == me}
    local = [d for d in dst.mesh.devices.flat if d.process_index == me]
    return jax.make_array_from_single_device_arrays(x.shape, dst, [copies[d] for d in local], dtype=x.dtype)


def _moved_as_bits(rows: jax.Array, perm: tuple[tuple[int, int], ...]) -> jax.Array:
    """``ppermute`` of the rows' bit patterns: XLA's CPU collective-permute of bfloat16 and IEEE-like
    float8 rows canonicalizes NaN payloads (found by the values check), one of unsigned ints does not."""
    if not jnp.issubdtype(rows.dtype, jnp.floating):
        return jax.lax.ppermute(rows, "u", perm)
    bits = jax.lax.bitcast_convert_type(rows, jnp.dtype(f"uint{8 * rows.dtype.itemsize}"))
    return jax.lax.bitcast_convert_type(jax.lax.ppermute(bits, "u", perm), rows.dtype)


@functools.cache
def _permute(devices: tuple[jax.Device, ...], perm: tuple[tuple[int, int], ...]):
    mesh = Mesh(np.array(devices), ("u",))
    body = jax.shard_map(
        functools.partial(_moved_as_bits, perm=perm), mesh=mesh, in_specs=P("u"), out_specs=P("u")
    )
    return mesh, jax.jit(body)


def _by_ppermute(x: jax.Array, dst: NamedSharding, pairs: list[tuple[jax.Device, jax.Device]]) -> jax.Array:
    union = tuple(dict.fromkeys(d for pair in pairs for d in pair))  # each device once, in order
    where = {d: j for j, d in enumerate(union)}
    perm = tuple((where[s], where[d]) for s, d in pairs)
    mesh, permute = _permute(union, perm)
    shard_shape = dst.shard_shape(x.shape)
    shards = {s.device: s.data for s in x.addressable_shards}
    me = jax.process_index()
    local = [d for d in dst.mesh.devices.flat if d.process_index == me]
    if not any(d.process_index == me for d in union):  # neither end here: nothing to run
        return jax.make_array_from_single_device_arrays(x.shape, dst, [], dtype=x.dtype)
    rows = [
        (shards[d] if d in shards else jnp.zeros(shard_shape, x.dtype, device=d)).reshape(1, *shard_shape)
        for d in union
        if d.process_index == me
    ]
    stacked = jax.make_array_from_single_device_arrays(
        (len(union), *shard_shape), NamedSharding(mesh, P("u")), rows
    )
    moved = {s.device: s.data.reshape(shard_shape) for s in permute(stacked).addressable_shards}
    return jax.make_array_from_single_device_arrays(x.shape, dst, [moved[d] for d in local], dtype=x.dtype)
