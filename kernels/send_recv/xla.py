"""Baseline: JAX's own buffer copy, ``jax.device_put`` of each shard to its destination device.

Device ``i`` of the source mesh holds the same index of ``x`` as device ``i`` of the destination
mesh (same spec, same mesh shape), so each single-device shard is copied as it is and the
copies are assembled under ``dst`` (``jax.make_array_from_single_device_arrays``).

Why not ``jax.device_put(x, dst)`` on the whole array: on CPU, when ``dst`` holds the source's
devices in another order, JAX runs a resharding program that does not preserve bits: a
bfloat16 or float8 NaN's payload comes back canonical (0x7fc1 -> 0x7fc0; JAX 0.6.2, 0.10.2 and
0.12), and in JAX 0.10.2 every shard of an empty array gets the global shape. Both were found by
this family's values check; a shard-by-shard copy shows neither.

Limits: one process (a shard whose destination device belongs to another process cannot be
copied with ``device_put``; that needs JAX's cross-host transfers, see the README).
"""

from __future__ import annotations

import jax
from jax.sharding import NamedSharding

import conformance
from conformance.kernels.send_recv._validation import device_pairs, validate_destination


@conformance.register(
    "send_recv",
    name="xla_device_put",
    baseline=True,
    description="jax.device_put of each shard to its destination device (one process)",
)
def xla_device_put(x: jax.Array, *, dst: NamedSharding) -> jax.Array:
    src = validate_destination("xla_device_put", x, dst)
    shards = {s.device: s.data for s in x.addressable_shards}
    copies, me = {}, jax.process_index()
    for s, d in device_pairs(src, dst):
        if me not in (s.process_index, d.process_index):
            continue  # neither end is this process's
        if s.process_index != d.process_index:
            raise NotImplementedError(
                f"xla_device_put: device {s.id} (process {s.process_index}) sends to device {d.id} "
                f"(process {d.process_index}); a copy between processes is not jax.device_put's"
            )
        copies[d] = jax.device_put(shards[s], d)
    local = [d for d in dst.mesh.devices.flat if d.process_index == jax.process_index()]
    return jax.make_array_from_single_device_arrays(x.shape, dst, [copies[d] for d in local])
