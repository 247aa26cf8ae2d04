"""A ragged all-to-all from collectives every XLA backend runs: a padded dense ``all_to_all``.

Each device packs its group for device ``j`` into slot ``j`` of a ``[n, C, cols]`` send buffer, ``C =
min(R, S)`` rows each (the largest group that fits both its rows and any receiver's), rows past the
group's size zero; one tiled ``lax.all_to_all`` hands slot ``j`` to device ``j``. A second, of the
``output_offsets``, tells each receiver where each sender wants its group (the sender's offsets, rule 2
of the family's contract). The receiver then scatters each sender's first ``recv_sizes[i]`` rows to
those slots of its ``output``; the padding rows are aimed past the end and dropped, so every row no
group writes keeps the caller's value.

Limits: it moves ``C`` rows to each peer whatever the groups' sizes (the family's byte bound allows
exactly that, and no more), and its buffers are ``n`` times a group; a kernel that moves only the rows
sent needs ``ragged_all_to_all`` or remote DMAs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

import conformance
from conformance.kernels.ragged_all_to_all._common import per_device, validate


def packed_groups(x: jax.Array, input_offsets: jax.Array, send_sizes: jax.Array, capacity: int) -> jax.Array:
    """``[n, capacity, cols]``: group ``j`` of ``x`` in slot ``j``, zero past its size."""
    r = jnp.arange(capacity)
    rows = jnp.clip(input_offsets[:, None] + r[None, :], 0, x.shape[0] - 1)
    valid = r[None, :] < send_sizes[:, None]
    return jnp.where(valid[..., None], x[rows], jnp.zeros((), x.dtype))


def written(output: jax.Array, groups: jax.Array, slots: jax.Array, sizes: jax.Array) -> jax.Array:
    """``output`` with the first ``sizes[i]`` rows of ``groups[i]`` written at ``slots[i]``: rows past
    a group's size are aimed past the end of ``output`` and dropped."""
    n, capacity = groups.shape[:2]
    r = jnp.arange(capacity)
    target = jnp.where(r[None, :] < sizes[:, None], slots[:, None] + r[None, :], output.shape[0])
    return output.at[target.reshape(-1)].set(groups.reshape(n * capacity, *groups.shape[2:]), mode="drop")


def exchanged(
    x: jax.Array,
    output: jax.Array,
    input_offsets: jax.Array,
    send_sizes: jax.Array,
    output_offsets: jax.Array,
    recv_sizes: jax.Array,
    *,
    axis_name: str,
) -> jax.Array:
    """One device's part (the module doc's algorithm)."""
    n = send_sizes.shape[0]
    capacity = min(x.shape[0], output.shape[0])
    send = packed_groups(x, input_offsets, send_sizes, capacity)
    received = lax.all_to_all(send.reshape(n * capacity, *x.shape[1:]), axis_name, 0, 0, tiled=True)
    slots = lax.all_to_all(
        output_offsets, axis_name, 0, 0, tiled=True
    )  # where each sender's group lands here
    return written(output, received.reshape(send.shape), slots, recv_sizes)


@conformance.register(
    "ragged_all_to_all",
    name="dense_ragged_all_to_all",
    differentiable=True,
    description="padded dense lax.all_to_all of fixed-size groups, scattered into the output",
)
def dense_ragged_all_to_all(*operands: jax.Array, mesh: jax.sharding.Mesh, axis_name: str) -> jax.Array:
    validate("dense_ragged_all_to_all", operands, mesh, axis_name)
    return per_device(lambda *blocks: exchanged(*blocks, axis_name=axis_name), mesh, axis_name, operands)
