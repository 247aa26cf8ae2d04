"""A ragged all-to-all from collectives every XLA backend runs: a padded dense ``all_to_all``, in rounds.

A group has at most ``C = min(R, S)`` rows (it must fit the sender's rows and the receiver's output).
The exchange runs in ``k`` rounds, ``k`` the largest divisor of ``C`` no larger than the ring, each of
``q = C / k`` rows per group: in round ``r`` each device packs rows ``r*q .. r*q + q`` of its group for
device ``j`` into slot ``j`` of an ``[n, q, cols]`` buffer (rows past the group's size zero), and one tiled
``lax.all_to_all`` hands slot ``j`` to device ``j``. Before the rounds, an all-to-all of the
``output_offsets`` tells each receiver where each sender wants its group (the sender's offsets, rule 2
of the family's contract; a caller that knows those slots already, an MoE layer from its gathered
counts, hands them over and that all-to-all is left out). Each round the receiver scatters the rows
that lie within each sender's ``recv_sizes[i]`` to those slots of its output; the padding rows are
aimed past the end and dropped, so every row no group writes keeps the caller's value.

Limits: it moves ``C`` rows to each peer whatever the groups' sizes (the family's byte bound allows
exactly that, and no more). Rounds keep its buffers at ``n * q`` rows, about one group's worth, where
one round would hold ``n`` groups' worth twice over (XLA:GPU measures that at 4.2x the peak memory of its
own ragged-all-to-all on 8 H100s, which writes the output in place); a kernel that moves only the rows
sent needs ``ragged_all_to_all`` or remote DMAs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

import conformance
from conformance.kernels.ragged_all_to_all._common import per_device, validate


def packed_groups(
    x: jax.Array, input_offsets: jax.Array, send_sizes: jax.Array, rows: int, *, skip: jax.Array | int = 0
) -> jax.Array:
    """``[n, rows, cols]``: rows ``skip .. skip + rows`` of each group of ``x`` in its slot, zero past
    the group's size."""
    r = skip + jnp.arange(rows)
    at = jnp.clip(input_offsets[:, None] + r[None, :], 0, x.shape[0] - 1)
    valid = r[None, :] < send_sizes[:, None]
    return jnp.where(valid[..., None], x[at], jnp.zeros((), x.dtype))


def written(
    output: jax.Array, groups: jax.Array, slots: jax.Array, sizes: jax.Array, *, skip: jax.Array | int = 0
) -> jax.Array:
    """``output`` with rows ``skip ..`` of each group written at ``slots[i] + skip ..``, those within
    ``sizes[i]``: rows past a group's size are aimed past the end of ``output`` and dropped."""
    n, rows = groups.shape[:2]
    r = skip + jnp.arange(rows)
    target = jnp.where(r[None, :] < sizes[:, None], slots[:, None] + r[None, :], output.shape[0])
    return output.at[target.reshape(-1)].set(groups.reshape(n * rows, *groups.shape[2:]), mode="drop")


def rounds_of(capacity: int, n: int) -> int:
    """The rounds ``k``: the largest divisor of ``capacity`` no larger than ``n``."""
    return max(k for k in range(1, min(capacity, n) + 1) if capacity % k == 0)


def exchanged(
    x: jax.Array,
    output: jax.Array,
    input_offsets: jax.Array,
    send_sizes: jax.Array,
    output_offsets: jax.Array,
    recv_sizes: jax.Array,
    *,
    axis_name: str,
    capacity: int | None = None,
    receiver_slots: jax.Array | None = None,
) -> jax.Array:
    """One device's part (the module doc's algorithm). ``capacity``: the most rows a group can have, where
    the caller knows a bound below ``min(R, S)`` (an MoE dispatch's ``T * min(k, X)``).
    ``receiver_slots``: where each sender's group lands here, where the caller already knows it (an MoE
    layer's gathered counts give every device every offset): the all-to-all of ``output_offsets`` is
    then left out, one collective fewer (at 256 chips each all-to-all is 10-20 s of libtpu's compile)."""
    n = send_sizes.shape[0]
    capacity = min(x.shape[0], output.shape[0], capacity or x.shape[0])
    rounds = rounds_of(capacity, n)
    rows = capacity // rounds
    slots = (  # where each sender's group lands here
        lax.all_to_all(output_offsets, axis_name, 0, 0, tiled=True)
        if receiver_slots is None
        else receiver_slots
    )

    def round_(r: jax.Array, result: jax.Array) -> jax.Array:
        send = packed_groups(x, input_offsets, send_sizes, rows, skip=r * rows)
        received = lax.all_to_all(send.reshape(n * rows, *x.shape[1:]), axis_name, 0, 0, tiled=True)
        return written(result, received.reshape(send.shape), slots, recv_sizes, skip=r * rows)

    return lax.fori_loop(0, rounds, round_, output) if rounds > 1 else round_(0, output)


#: :mod:`conformance.kernels._moe` hands this exchange the receiver's slots it computed from the routing
#: tables (an exchange without the mark is given only ``lax.ragged_all_to_all``'s operands).
exchanged.takes_receiver_slots = True


@conformance.register(
    "ragged_all_to_all",
    name="dense_ragged_all_to_all",
    differentiable=True,
    description="padded dense lax.all_to_all of fixed-size groups, scattered into the output",
)
def dense_ragged_all_to_all(*operands: jax.Array, mesh: jax.sharding.Mesh, axis_name: str) -> jax.Array:
    validate("dense_ragged_all_to_all", operands, mesh, axis_name)
    return per_device(lambda *blocks: exchanged(*blocks, axis_name=axis_name), mesh, axis_name, operands)
