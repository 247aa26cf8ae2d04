"""Ragged all-to-all kernels broken in one way each, the ways MoE token exchanges break.

Each is a built-in form (:mod:`conformance.kernels.ragged_all_to_all`) with one defect; the check meant
for it must reject it (``EXPECTED_REJECTION``), naming what is wrong.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

import conformance
from conformance.kernels.ragged_all_to_all import pallas_dma
from conformance.kernels.ragged_all_to_all._common import per_device, validate
from conformance.kernels.ragged_all_to_all.dense import packed_groups, written
from conformance.kernels.ragged_all_to_all.ring import group_for, shifted

EXPECTED_REJECTION: dict[str, str] = {
    "broken_ragged_offsets_read_on_the_receivers_side": "test_values",
    "broken_ragged_offsets_packed_from_sizes": "test_values",
    "broken_ragged_zero_size_group_moves_a_row": "test_values",
    "broken_ragged_unwritten_rows_zeroed": "test_values",
    "broken_ragged_sizes_read_untransposed": "test_values",
    "broken_ragged_bidirectional_ring_skips_a_peer_on_odd_rings": "test_values",
    "broken_ragged_backward_returns_cotangents_in_dispatch_order": "test_gradients",
    "broken_pallas_ragged_scatters_before_the_barrier": "test_barrier_protocol",
    "broken_pallas_ragged_returns_before_its_receives": "test_races",
    "broken_pallas_ragged_waits_for_sizes_untransposed": "test_values",
    "broken_ragged_gathers_every_row": "test_collectives",
}
EXPECTED_MESSAGE: dict[str, str] = {
    "broken_ragged_offsets_read_on_the_receivers_side": "reading output_offsets on the receiver's side",
    "broken_ragged_offsets_packed_from_sizes": "packing each receiver's groups from its recv_sizes",
    "broken_ragged_zero_size_group_moves_a_row": "values differ from the numpy float64 reference",
    "broken_ragged_unwritten_rows_zeroed": "zeroing the output first",
    "broken_ragged_sizes_read_untransposed": "values differ from the numpy float64 reference",
    "broken_ragged_bidirectional_ring_skips_a_peer_on_odd_rings": "where device",
    "broken_ragged_backward_returns_cotangents_in_dispatch_order": "d_x",
    "broken_pallas_ragged_scatters_before_the_barrier": "before the kernel waits on its barrier semaphore",
    # in the on_wait order its groups never land (no one waits on them): values; eager, a race
    # a receiver waits for rows its sender never sends: the time bound stops it and says where
    "broken_pallas_ragged_waits_for_sizes_untransposed": "did not finish within",
    "broken_ragged_gathers_every_row": "only the routing's int32s may be gathered",
}


def _dense(name, operands, mesh, axis_name, *, slots_of, sizes_of, sent_sizes=lambda s: s, start=None):
    """The dense form with its receiving side's choices given: where each sender's group lands
    (``slots_of(output_offsets, exchanged_offsets, recv_sizes)``), how many of its rows
    (``sizes_of(send_sizes, recv_sizes)``), how many rows a sender packs (``sent_sizes``), and the
    buffer it starts from."""
    validate(name, operands, mesh, axis_name)

    def body(x, output, input_offsets, send_sizes, output_offsets, recv_sizes):
        n = send_sizes.shape[0]
        capacity = min(x.shape[0], output.shape[0])
        send = packed_groups(x, input_offsets, sent_sizes(send_sizes), capacity)
        received = lax.all_to_all(send.reshape(n * capacity, *x.shape[1:]), axis_name, 0, 0, tiled=True)
        exchanged = lax.all_to_all(output_offsets, axis_name, 0, 0, tiled=True)
        base = output if start is None else start(output)
        return written(
            base,
            received.reshape(send.shape),
            slots_of(output_offsets, exchanged, recv_sizes),
            sizes_of(send_sizes, recv_sizes),
        )

    return per_device(body, mesh, axis_name, operands)


@conformance.register("ragged_all_to_all", name="broken_ragged_offsets_read_on_the_receivers_side")
def broken_ragged_offsets_read_on_the_receivers_side(*operands, mesh, axis_name):
    """Each receiver writes sender i's group at its *own* ``output_offsets[i]``, never exchanging them:
    the sender's offsets say where its group lands on the receiver, so each group lands in the slot
    that the receiver, as a sender, chose on device i (marin-community/marin's "Fix ragged all-to-all
    sender offsets")."""
    return _dense(
        "broken_ragged_offsets_read_on_the_receivers_side",
        operands,
        mesh,
        axis_name,
        slots_of=lambda mine, exchanged, recv: mine,
        sizes_of=lambda send, recv: recv,
    )


@conformance.register("ragged_all_to_all", name="broken_ragged_offsets_packed_from_sizes")
def broken_ragged_offsets_packed_from_sizes(*operands, mesh, axis_name):
    """Each receiver packs its groups one after another in sender order (sender i's group at the sum of
    ``recv_sizes[:i]``) instead of at the slots the senders' ``output_offsets`` give: right wherever the
    caller packs its groups so (an MoE dispatch), wrong for groups padded apart."""
    return _dense(
        "broken_ragged_offsets_packed_from_sizes",
        operands,
        mesh,
        axis_name,
        slots_of=lambda mine, exchanged, recv: jnp.cumsum(recv) - recv,
        sizes_of=lambda send, recv: recv,
    )


@conformance.register("ragged_all_to_all", name="broken_ragged_zero_size_group_moves_a_row")
def broken_ragged_zero_size_group_moves_a_row(*operands, mesh, axis_name):
    """Sizes clamped to at least one row ("a group is never empty"): each group of zero rows still
    sends its first row, written over the receiver's output at the group's slot."""
    return _dense(
        "broken_ragged_zero_size_group_moves_a_row",
        operands,
        mesh,
        axis_name,
        slots_of=lambda mine, exchanged, recv: exchanged,
        sizes_of=lambda send, recv: jnp.maximum(recv, 1),
        sent_sizes=lambda s: jnp.maximum(s, 1),
    )


@conformance.register("ragged_all_to_all", name="broken_ragged_unwritten_rows_zeroed")
def broken_ragged_unwritten_rows_zeroed(*operands, mesh, axis_name):
    """Starts from zeros instead of the caller's ``output``: the rows no group writes come back zero."""
    return _dense(
        "broken_ragged_unwritten_rows_zeroed",
        operands,
        mesh,
        axis_name,
        slots_of=lambda mine, exchanged, recv: exchanged,
        sizes_of=lambda send, recv: recv,
        start=jnp.zeros_like,
    )


@conformance.register("ragged_all_to_all", name="broken_ragged_sizes_read_untransposed")
def broken_ragged_sizes_read_untransposed(*operands, mesh, axis_name):
    """The receiver takes sender i's group size from its own ``send_sizes[i]`` (what it sends to i)
    instead of ``recv_sizes[i]`` (what i sends to it): right only where the routing is symmetric."""
    return _dense(
        "broken_ragged_sizes_read_untransposed",
        operands,
        mesh,
        axis_name,
        slots_of=lambda mine, exchanged, recv: exchanged,
        sizes_of=lambda send, recv: send,
    )


@conformance.register("ragged_all_to_all", name="broken_ragged_bidirectional_ring_skips_a_peer_on_odd_rings")
def broken_ragged_bidirectional_ring_skips_a_peer_on_odd_rings(*operands, mesh, axis_name):
    """A bidirectional ring: peers up to ``n // 2`` steps ahead are sent to clockwise, the rest
    counter-clockwise, over ``range(1, n // 2)`` steps. On an even ring that reaches every peer; on an
    odd one the counter-clockwise side stops a step short, and the group for the peer ``(n + 1) // 2``
    steps ahead is never sent."""
    validate("broken_ragged_bidirectional_ring_skips_a_peer_on_odd_rings", operands, mesh, axis_name)
    n = mesh.shape[axis_name]
    shifts = dict.fromkeys([0, *range(1, n // 2 + 1), *(n - k for k in range(1, n // 2))])

    def body(*blocks):
        return shifted(*blocks, axis_name=axis_name, shifts=tuple(shifts))

    return per_device(body, mesh, axis_name, operands)


def _exchanged_with_a_local_backward(
    x, output, input_offsets, send_sizes, output_offsets, recv_sizes, axis_name
):
    from conformance.kernels.ragged_all_to_all.dense import exchanged

    return exchanged(x, output, input_offsets, send_sizes, output_offsets, recv_sizes, axis_name=axis_name)


def _forward(x, output, input_offsets, send_sizes, output_offsets, recv_sizes, axis_name):
    out = _exchanged_with_a_local_backward(
        x, output, input_offsets, send_sizes, output_offsets, recv_sizes, axis_name
    )
    return out, (x.shape[0], input_offsets, send_sizes, output_offsets, recv_sizes)


def _backward(axis_name, residuals, ct):
    rows, input_offsets, send_sizes, output_offsets, recv_sizes = residuals
    n = send_sizes.shape[0]
    capacity = min(rows, ct.shape[0])
    # d_x: the cotangent of the rows each group wrote, read here at the slots it wrote on its receiver,
    # in the order the groups were dispatched, and never sent back to their senders
    here = jnp.stack([group_for(ct, output_offsets[j], send_sizes[j], capacity) for j in range(n)])
    d_x = written(jnp.zeros((rows, *ct.shape[1:]), ct.dtype), here, input_offsets, send_sizes)
    # d_output: the cotangent where no group wrote (right)
    slots = lax.all_to_all(output_offsets, axis_name, 0, 0, tiled=True)
    d_output = written(ct, jnp.zeros((n, capacity, *ct.shape[1:]), ct.dtype), slots, recv_sizes)
    return d_x, d_output, None, None, None, None


_exchanged_with_a_local_backward = jax.custom_vjp(_exchanged_with_a_local_backward, nondiff_argnums=(6,))
_exchanged_with_a_local_backward.defvjp(_forward, _backward)


@conformance.register(
    "ragged_all_to_all",
    name="broken_ragged_backward_returns_cotangents_in_dispatch_order",
    differentiable=True,
)
def broken_ragged_backward_returns_cotangents_in_dispatch_order(*operands, mesh, axis_name):
    """The dense form, right forward, with a hand-written backward that reads each group's cotangent
    at the slot it wrote, on the device that sent it, in dispatch order: the transposed exchange that
    should bring the cotangents back from the receivers is missing."""
    name = "broken_ragged_backward_returns_cotangents_in_dispatch_order"
    validate(name, operands, mesh, axis_name)
    return per_device(
        lambda *blocks: _exchanged_with_a_local_backward(*blocks, axis_name), mesh, axis_name, operands
    )


def _pallas_without(name: str, doc: str, **protocol: bool) -> None:
    """The built-in Pallas kernel with one guard of its protocol taken out or turned."""

    @conformance.register("ragged_all_to_all", name=name, pallas=True, dtypes=pallas_dma.DTYPES)
    def kernel(*operands, mesh, axis_name, interpret=False):
        return pallas_dma.exchange(
            operands,
            mesh=mesh,
            axis_name=axis_name,
            interpret=interpret,
            name=name,
            protocol=pallas_dma.Protocol(**protocol),
        )

    kernel.__name__ = kernel.__qualname__ = name
    kernel.__doc__ = doc


_pallas_without(
    "broken_pallas_ragged_scatters_before_the_barrier",
    "No barrier, while taking the barrier semaphore's collective_id (the sglang-jax fused EP-MoE kernel's "
    "removed barrier): a group may reach a device that has not entered the kernel, which interpret mode, "
    "starting every device together, never shows; the barrier protocol read off the kernel does.",
    barrier=False,
)
_pallas_without(
    "broken_pallas_ragged_returns_before_its_receives",
    "Returns once its own groups are sent, never waiting for the groups sent to it: its receive "
    "semaphores keep their counts, and its output may be read before a group lands.",
    wait_receives=False,
)
_pallas_without(
    "broken_pallas_ragged_waits_for_sizes_untransposed",
    "Waits for send_sizes[i] rows from each sender i, its own sizes to i, not recv_sizes[i], what i "
    "sends it: where a routing is not symmetric, a receiver waits for rows nobody sends.",
    receive_sizes_transposed=False,
)


@conformance.register("ragged_all_to_all", name="broken_ragged_gathers_every_row")
def broken_ragged_gathers_every_row(*operands, mesh, axis_name):
    """Every device's rows gathered, with every device's routing, and each receiver cuts its groups out:
    right values, and every row of every device moved to every device, where each group needs one peer."""
    validate("broken_ragged_gathers_every_row", operands, mesh, axis_name)

    def body(x, output, input_offsets, send_sizes, output_offsets, recv_sizes):
        n, rows, me = send_sizes.shape[0], x.shape[0], lax.axis_index(axis_name)
        every = lax.all_gather(x, axis_name)  # [n, R, cols]
        start, size, at = (
            lax.all_gather(a, axis_name)[:, me] for a in (input_offsets, send_sizes, output_offsets)
        )
        step = jnp.arange(rows)
        source = jnp.clip(start[:, None] + step, 0, rows - 1)
        groups = jnp.take_along_axis(every, source.reshape(n, rows, *(1,) * (x.ndim - 1)), axis=1)
        return written(output, groups, at, size)

    return per_device(body, mesh, axis_name, operands)
