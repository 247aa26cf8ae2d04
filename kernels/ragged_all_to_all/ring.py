"""A ragged all-to-all as ``n - 1`` ring shifts of ``lax.ppermute``, every backend runs it.

At step ``k`` (1 .. n-1) device ``i`` sends its group for device ``i + k`` (mod n) by a ``ppermute``
that shifts the ring by ``k``: the group's rows, read at its ``input_offsets`` into a buffer of ``C =
min(R, S)`` rows (the largest group that fits), with its size and the slot its ``output_offsets`` picks
on the receiver (rule 2 of the family's contract: the sender says where). The receiver, device
``i + k``, writes the group's first ``size`` rows at that slot of its output. Step 0 is a device's group
to itself, written without a transfer.

What it shows beside :mod:`.dense`: a kernel that never exchanges ``output_offsets`` as a table, but
carries each group's slot with the group. One step is in flight at a time (each step's transfer leaves
once the last one is written: an ``optimization_barrier`` joins the rows it is cut from to the result so
far), so it holds one group's buffer, not ``n``:
unchained, XLA:GPU starts every step at once and holds 5.7x the peak memory of its own
ragged-all-to-all on 24 H100s. Its steps are unrolled, so its program grows with the
ring: it refuses rings longer than :data:`LONGEST_RING` (on a v5e slice of 256 chips XLA:TPU compiles
the 255 steps to 219 MiB of code in 32 s).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax import lax

import conformance
from conformance.kernels.ragged_all_to_all._common import per_device, validate
from conformance.kernels.ragged_all_to_all.dense import written

#: The longest ring it unrolls: each step is a transfer and a scatter in the program.
LONGEST_RING = 64


def group_for(x: jax.Array, offset: jax.Array, size: jax.Array, capacity: int) -> jax.Array:
    """``[capacity, cols]``: the group of ``size`` rows at ``offset`` of ``x``, zero past its size
    (``x`` padded first, so that no slice start is clamped back over other rows)."""
    padded = jnp.concatenate([x, jnp.zeros((capacity, *x.shape[1:]), x.dtype)])
    rows = lax.dynamic_slice_in_dim(padded, offset, capacity)
    keep = jnp.arange(capacity) < size
    return jnp.where(keep.reshape(-1, *(1,) * (x.ndim - 1)), rows, jnp.zeros((), x.dtype))


def shifted(
    x: jax.Array,
    output: jax.Array,
    input_offsets: jax.Array,
    send_sizes: jax.Array,
    output_offsets: jax.Array,
    recv_sizes: jax.Array,
    *,
    axis_name: str,
    shifts: Sequence[int] | None = None,
) -> jax.Array:
    """One device's part (the module doc's algorithm); ``recv_sizes`` is not read: each group comes
    with its size. ``shifts``: the ring shifts it visits, in order (default: 0 .. n-1, every peer)."""
    n = send_sizes.shape[0]
    me = lax.axis_index(axis_name)
    capacity = min(x.shape[0], output.shape[0])
    result = output
    for k in range(n) if shifts is None else shifts:
        peer = (me + k) % n
        # one step in flight: this step's group is cut (and leaves) once the last one is written
        rows, result = lax.optimization_barrier((x, result)) if k > 1 else (x, result)
        group = group_for(rows, input_offsets[peer], send_sizes[peer], capacity)
        where = jnp.stack([output_offsets[peer], send_sizes[peer]])
        if k:
            perm = [(i, (i + k) % n) for i in range(n)]
            group, where = lax.ppermute(group, axis_name, perm), lax.ppermute(where, axis_name, perm)
        result = written(result, group[None], where[:1], where[1:])
    return result


@conformance.register(
    "ragged_all_to_all",
    name="ring_ragged_all_to_all",
    differentiable=True,
    description="n-1 ppermute ring shifts, each group carrying its slot and size",
)
def ring_ragged_all_to_all(*operands: jax.Array, mesh: jax.sharding.Mesh, axis_name: str) -> jax.Array:
    n = validate("ring_ragged_all_to_all", operands, mesh, axis_name)
    if n > LONGEST_RING:
        conformance.refuse_on_tpu(
            f"ring_ragged_all_to_all unrolls its n-1 = {n - 1} steps: it takes rings of up to {LONGEST_RING} "
            "(on 256 v5e chips the unrolled ring compiles to 219 MiB of code); "
            "dense_ragged_all_to_all takes any"
        )
    return per_device(lambda *blocks: shifted(*blocks, axis_name=axis_name), mesh, axis_name, operands)
