"""MoE dispatch and combine kernels broken in one way each, the ways token routing breaks.

Each is a built-in form (:mod:`conformance.kernels.moe_dispatch`, :mod:`conformance.kernels.moe_combine`)
with one defect; the check meant for it must reject it (``EXPECTED_REJECTION``), naming what is wrong.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

import conformance
from conformance import compat
from conformance.kernels import _moe
from conformance.kernels.ragged_all_to_all.dense import exchanged as dense_exchange

EXPECTED_REJECTION: dict[str, str] = {
    "broken_moe_dispatch_rows_in_arrival_order": "test_values",
    "broken_moe_dispatch_offsets_read_on_the_receivers_side": "test_values",
    "broken_moe_dispatch_drops_tokens_past_a_capacity": "test_values",
    "broken_moe_dispatch_declares_token_order_drops_by_choice": "test_values",
    "broken_moe_dispatch_aligned_padding_holds_the_last_row": "test_values",
    "broken_moe_combine_reads_aligned_groups_as_packed": "test_values",
    "broken_moe_dispatch_maxtext_drops_past_an_undeclared_capacity": "test_values",
    "broken_moe_dispatch_maxtext_offsets_on_the_receivers_side": "test_values",
    "broken_moe_dispatch_maxtext_offsets_summed_over_receivers": "test_values",
    "broken_moe_dispatch_assumes_contiguous_placement": "test_values",
    "broken_moe_dispatch_sends_unrouted_choices_to_the_last_expert": "test_values",
    "broken_moe_dispatch_backward_returns_cotangents_in_dispatch_order": "test_gradients",
    "broken_moe_combine_weights_in_expert_order": "test_values",
    "broken_moe_combine_gathers_every_expert_row": "test_collectives",
    "broken_moe_dispatch_inverts_a_replicated_placement": "test_values",
}
EXPECTED_MESSAGE: dict[str, str] = {
    "broken_moe_dispatch_rows_in_arrival_order": "in the order the exchange delivers them",
    "broken_moe_dispatch_offsets_read_on_the_receivers_side": "values differ from the numpy float64",
    "broken_moe_dispatch_drops_tokens_past_a_capacity": "kept its first rows in token order",
    "broken_moe_dispatch_declares_token_order_drops_by_choice": "values differ from the numpy float64",
    "broken_moe_dispatch_aligned_padding_holds_the_last_row": "between the aligned groups",
    "broken_moe_combine_reads_aligned_groups_as_packed": "values differ from the numpy float64",
    "broken_moe_dispatch_maxtext_drops_past_an_undeclared_capacity": "kept its first rows in token order",
    "broken_moe_dispatch_maxtext_offsets_on_the_receivers_side": "own receive offsets as its output_offsets",
    "broken_moe_dispatch_maxtext_offsets_summed_over_receivers": "own input_offsets as its output_offsets",
    "broken_moe_dispatch_assumes_contiguous_placement": "values differ from the numpy float64 reference",
    "broken_moe_dispatch_sends_unrouted_choices_to_the_last_expert": "beyond the copies routed to its",
    "broken_moe_dispatch_backward_returns_cotangents_in_dispatch_order": "d_tokens",
    "broken_moe_combine_weights_in_expert_order": "in expert-id order",
    "broken_moe_combine_gathers_every_expert_row": "bytes",
    "broken_moe_dispatch_inverts_a_replicated_placement": "replica, whichever device sends it",
}
#: Correct kernels of another style: the checks each must pass (a replica rule the built-ins do not use).
EXPECTED_PASS: dict[str, set[str]] = {
    "correct_moe_dispatch_replicas_by_token": {"test_values", "test_gradients", "test_output_sharding"},
}


def _dispatch(name: str, body):
    """A dispatch kernel of ``body(tokens, expert_ids, placement, *, n)`` per device."""

    def kernel(tokens, expert_ids, placement, *, mesh, axis_name):
        n = _moe.validate(name, ("tokens", tokens), expert_ids, placement, mesh, axis_name)
        blocks = functools.partial(body, n=n, axis_name=axis_name)
        return _moe.per_device(blocks, mesh, axis_name, (tokens, expert_ids, placement))

    return kernel


@conformance.register("moe_dispatch", name="broken_moe_dispatch_rows_in_arrival_order")
def broken_moe_dispatch_rows_in_arrival_order(tokens, expert_ids, placement, *, mesh, axis_name):
    """Skips the permute to expert-major order: each expert device's rows stay sender-major."""

    def body(tokens, expert_ids, placement, *, n, axis_name):
        t, k = expert_ids.shape
        x = placement.shape[-1]
        me = lax.axis_index(axis_name)
        device, local, counts = _moe.routing_tables(expert_ids, placement, n=n, axis_name=axis_name)
        order = _moe.sorted_order(device, local, x)
        pairs = counts.sum(-1)
        return dense_exchange(
            tokens[order // k],
            compat.varying(jnp.zeros((n * t * min(k, x), tokens.shape[1]), tokens.dtype), axis_name),
            jnp.cumsum(pairs[me]) - pairs[me],
            pairs[me],
            (jnp.cumsum(pairs, 0) - pairs)[me],
            pairs[:, me],
            axis_name=axis_name,
            capacity=t * min(k, x),
        )

    return _dispatch("broken_moe_dispatch_rows_in_arrival_order", body)(
        tokens, expert_ids, placement, mesh=mesh, axis_name=axis_name
    )


@conformance.register("moe_dispatch", name="broken_moe_dispatch_offsets_read_on_the_receivers_side")
def broken_moe_dispatch_offsets_read_on_the_receivers_side(tokens, expert_ids, placement, *, mesh, axis_name):
    """Tells the exchange, as each group's ``output_offsets``, the slot this device gives that peer's
    group when it receives, not the slot the peer gives this device's (marin's sender-offsets bug)."""

    def receivers_side(
        x, output, input_offsets, send_sizes, output_offsets, recv_sizes, *, axis_name, capacity
    ):
        return dense_exchange(
            x,
            output,
            input_offsets,
            send_sizes,
            jnp.cumsum(recv_sizes) - recv_sizes,
            recv_sizes,
            axis_name=axis_name,
            capacity=capacity,
        )

    body = functools.partial(_moe.dispatched, exchange=receivers_side)
    return _dispatch("broken_moe_dispatch_offsets_read_on_the_receivers_side", body)(
        tokens, expert_ids, placement, mesh=mesh, axis_name=axis_name
    )


def _gathered(tokens, expert_ids, hosted, *, n, axis_name, kept=lambda routed: routed):
    """The all-gather form (:func:`conformance.kernels.moe_dispatch.allgather.kept`) on this device's
    experts ``hosted``, keeping the (expert, token) pairs ``kept(routed)`` of those routed: ``[C, H]``."""
    t, k = expert_ids.shape
    rows = n * t * min(k, hosted.shape[0])
    everyone = lax.all_gather(tokens, axis_name, tiled=True)
    chosen = lax.all_gather(expert_ids, axis_name, tiled=True)
    flat = kept((chosen[None, :, :] == hosted[:, None, None]).any(-1)).reshape(-1)  # [X, n*T]
    slot = jnp.where(flat, jnp.cumsum(flat) - 1, rows)
    source = jnp.tile(jnp.arange(n * t), hosted.shape[0])
    return jnp.zeros((rows, tokens.shape[1]), tokens.dtype).at[slot].set(everyone[source], mode="drop")


@conformance.register("moe_dispatch", name="broken_moe_dispatch_drops_tokens_past_a_capacity")
def broken_moe_dispatch_drops_tokens_past_a_capacity(tokens, expert_ids, placement, *, mesh, axis_name):
    """Gives each expert room for ``2 * T`` rows (a capacity factor) and drops the tokens past it: right
    while the routing is even, wrong once an expert is hot."""

    def body(tokens, expert_ids, placement, *, n, axis_name):
        t = expert_ids.shape[0]
        return _gathered(
            tokens,
            expert_ids,
            placement.reshape(-1),
            n=n,
            axis_name=axis_name,
            kept=lambda routed: routed & (jnp.cumsum(routed, axis=1) <= 2 * t),  # later tokens dropped
        )

    return _dispatch("broken_moe_dispatch_drops_tokens_past_a_capacity", body)(
        tokens, expert_ids, placement, mesh=mesh, axis_name=axis_name
    )


@conformance.register(
    "moe_dispatch",
    name="broken_moe_dispatch_declares_token_order_drops_by_choice",
    capacity=conformance.ExpertCapacity(1.0, group="device", order="token"),
)
def broken_moe_dispatch_declares_token_order_drops_by_choice(
    tokens, expert_ids, placement, *, mesh, axis_name
):
    """Declares MaxText's capacity (token order) and drops by GShard's priority (every first choice
    before any second): the same room an expert, other rows dropped where a hot expert is some tokens'
    second choice."""
    by_choice = conformance.ExpertCapacity(1.0, group="device", order="choice")

    def body(tokens, expert_ids, placement, *, n, axis_name):
        kept = _moe.past_capacity_unrouted(expert_ids, experts=placement.size * n, capacity=by_choice)
        return _moe.dispatched(tokens, kept, placement, n=n, axis_name=axis_name, exchange=_moe.xla_exchange)

    return _dispatch("broken_moe_dispatch_declares_token_order_drops_by_choice", body)(
        tokens, expert_ids, placement, mesh=mesh, axis_name=axis_name
    )


def _maxtext(name: str, **defect):
    """MaxText's ragged dispatch (:func:`conformance.kernels._moe.maxtext_style_dispatched`) with one
    defect, registered as ``name``."""

    def body(tokens, expert_ids, placement, *, n, axis_name):
        if defect.get("capacity") is not None:
            experts = n * placement.shape[-1]
            expert_ids = _moe.past_capacity_unrouted(expert_ids, experts=experts, capacity=defect["capacity"])
        offsets = defect.get("output_offsets_of")
        return _moe.maxtext_style_dispatched(
            tokens, expert_ids, placement, n=n, axis_name=axis_name, output_offsets_of=offsets
        )

    kernel = _dispatch(name, body)
    kernel.__name__ = kernel.__qualname__ = name
    return conformance.register("moe_dispatch", name=name, differentiable=True)(kernel)


broken_moe_dispatch_maxtext_drops_past_an_undeclared_capacity = _maxtext(
    "broken_moe_dispatch_maxtext_drops_past_an_undeclared_capacity",
    capacity=conformance.ExpertCapacity(1.0),  # MaxText's mask, but registered without capacity=
)
broken_moe_dispatch_maxtext_offsets_on_the_receivers_side = _maxtext(
    "broken_moe_dispatch_maxtext_offsets_on_the_receivers_side",
    output_offsets_of=lambda sizes, me: jnp.cumsum(sizes[:, me]) - sizes[:, me],  # its own recv offsets
)
broken_moe_dispatch_maxtext_offsets_summed_over_receivers = _maxtext(
    "broken_moe_dispatch_maxtext_offsets_summed_over_receivers",
    # the cumsum of the gathered counts over axis 1 (the receivers), not 0: the sender's input_offsets
    output_offsets_of=lambda sizes, me: jnp.concatenate(
        [jnp.zeros((sizes.shape[0], 1), sizes.dtype), sizes], axis=1
    ).cumsum(1)[me, :-1],
)


@conformance.register(
    "moe_dispatch", name="broken_moe_dispatch_aligned_padding_holds_the_last_row", group_alignment=8
)
def broken_moe_dispatch_aligned_padding_holds_the_last_row(tokens, expert_ids, placement, *, mesh, axis_name):
    """Declares groups at multiples of 8 rows and fills each aligned block by a clamped gather: the rows
    after a group's last hold that row again, not zeros (which a grouped matmul then multiplies)."""

    def body(tokens, expert_ids, placement, *, n, axis_name):
        packed = _moe.dispatched(
            tokens, expert_ids, placement, n=n, axis_name=axis_name, exchange=_moe.xla_exchange
        )
        sizes = _moe.received_per_expert(expert_ids, placement, n=n, axis_name=axis_name)
        x, alignment = sizes.shape[0], 8
        padded = (sizes + alignment - 1) // alignment * alignment
        q = jnp.arange(packed.shape[0] + x * (alignment - 1))
        group = jnp.minimum((jnp.cumsum(padded)[None, :] <= q[:, None]).sum(1), x - 1)
        within = q - (jnp.cumsum(padded) - padded)[group]
        source = (jnp.cumsum(sizes) - sizes)[group] + jnp.clip(within, 0, jnp.maximum(sizes[group] - 1, 0))
        return jnp.where((sizes[group] > 0)[:, None], packed[source], jnp.zeros((), packed.dtype))

    return _dispatch("broken_moe_dispatch_aligned_padding_holds_the_last_row", body)(
        tokens, expert_ids, placement, mesh=mesh, axis_name=axis_name
    )


@conformance.register("moe_dispatch", name="broken_moe_dispatch_assumes_contiguous_placement")
def broken_moe_dispatch_assumes_contiguous_placement(tokens, expert_ids, placement, *, mesh, axis_name):
    """Takes device ``d``'s experts to be ``d * X .. d * X + X - 1`` (expert ``e`` on device ``e // X``, as
    a layer written for one expert-parallel layout computes it) instead of reading ``placement``: right
    while the experts are placed contiguously, wrong once a load balancer has moved one."""

    def body(tokens, expert_ids, placement, *, n, axis_name):
        x = placement.shape[-1]
        hosted = lax.axis_index(axis_name) * x + jnp.arange(x, dtype=expert_ids.dtype)  # the assumption
        return _gathered(tokens, expert_ids, hosted, n=n, axis_name=axis_name)

    return _dispatch("broken_moe_dispatch_assumes_contiguous_placement", body)(
        tokens, expert_ids, placement, mesh=mesh, axis_name=axis_name
    )


@conformance.register("moe_dispatch", name="broken_moe_dispatch_sends_unrouted_choices_to_the_last_expert")
def broken_moe_dispatch_sends_unrouted_choices_to_the_last_expert(
    tokens, expert_ids, placement, *, mesh, axis_name
):
    """Uses each expert id as an index into the ``E`` experts, as ``table[expert_ids]`` does: an id of -1
    (a choice routed nowhere) wraps around to the last expert, which receives a row it was never sent."""

    def body(tokens, expert_ids, placement, *, n, axis_name):
        e = n * placement.shape[-1]
        wrapped = jnp.where(expert_ids < 0, expert_ids + e, expert_ids)  # Python's negative index
        return _gathered(tokens, wrapped, placement.reshape(-1), n=n, axis_name=axis_name)

    return _dispatch("broken_moe_dispatch_sends_unrouted_choices_to_the_last_expert", body)(
        tokens, expert_ids, placement, mesh=mesh, axis_name=axis_name
    )


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _dispatched_with_unsorted_backward(tokens, expert_ids, placement, n, axis_name):
    return _moe.dispatched(tokens, expert_ids, placement, n=n, axis_name=axis_name, exchange=dense_exchange)


def _forward(tokens, expert_ids, placement, n, axis_name):
    out = _dispatched_with_unsorted_backward(tokens, expert_ids, placement, n, axis_name)
    return out, (expert_ids, placement)


def _backward(n, axis_name, residuals, ct):
    """The rows' cotangents back to their tokens as a combine with unit weights would bring them, but
    summed in the order they come back (the dispatch's sorted order), not un-sorted to token order."""
    expert_ids, placement = residuals
    ones = jnp.ones(expert_ids.shape, jnp.float32)
    d_tokens = _moe.combined(
        ct,
        ones,
        expert_ids,
        placement,
        n=n,
        axis_name=axis_name,
        exchange=dense_exchange,
        in_token_order=False,
    )
    return d_tokens, None, None


_dispatched_with_unsorted_backward.defvjp(_forward, _backward)


@conformance.register(
    "moe_dispatch",
    name="broken_moe_dispatch_backward_returns_cotangents_in_dispatch_order",
    differentiable=True,
)
def broken_moe_dispatch_backward_returns_cotangents_in_dispatch_order(
    tokens, expert_ids, placement, *, mesh, axis_name
):
    """A right forward; its backward sums each token's ``k`` cotangent rows from the rows in the order
    the dispatch sorted them, so token ``t`` gets the cotangents of whichever rows sorted to its place."""

    def body(tokens, expert_ids, placement, *, n, axis_name):
        return _dispatched_with_unsorted_backward(tokens, expert_ids, placement, n, axis_name)

    return _dispatch("broken_moe_dispatch_backward_returns_cotangents_in_dispatch_order", body)(
        tokens, expert_ids, placement, mesh=mesh, axis_name=axis_name
    )


def _combine(name: str, body):
    def kernel(expert_rows, weights, expert_ids, placement, *, mesh, axis_name):
        n = _moe.validate(name, ("weights", weights), expert_ids, placement, mesh, axis_name)
        blocks = functools.partial(body, n=n, axis_name=axis_name)
        return _moe.per_device(blocks, mesh, axis_name, (expert_rows, weights, expert_ids, placement))

    return kernel


@conformance.register("moe_combine", name="broken_moe_combine_weights_in_expert_order")
def broken_moe_combine_weights_in_expert_order(
    expert_rows, weights, expert_ids, placement, *, mesh, axis_name
):
    """Takes each token's rows in expert-id order (as the expert devices sort them) but its weights in
    the router's order: ``weights[t, j]`` lands on the ``j``-th smallest expert's row."""

    def body(expert_rows, weights, expert_ids, placement, *, n, axis_name):
        by_expert = jnp.argsort(expert_ids, axis=1)  # row m of the sorted rows is choice by_expert[m]
        # sum_m w[m] * row[by_expert[m]] = sum_j w[inverse[j]] * row[j]
        inverse = jnp.argsort(by_expert, axis=1)
        misplaced = jnp.take_along_axis(weights, inverse, axis=1)
        return _moe.combined(
            expert_rows, misplaced, expert_ids, placement, n=n, axis_name=axis_name, exchange=dense_exchange
        )

    return _combine("broken_moe_combine_weights_in_expert_order", body)(
        expert_rows, weights, expert_ids, placement, mesh=mesh, axis_name=axis_name
    )


@conformance.register("moe_combine", name="broken_moe_combine_gathers_every_expert_row")
def broken_moe_combine_gathers_every_expert_row(
    expert_rows, weights, expert_ids, placement, *, mesh, axis_name
):
    """Right values, by gathering every device's expert rows whole and reading each token's own: ``n``
    times the rows it needs, past the family's byte bound."""

    def body(expert_rows, weights, expert_ids, placement, *, n, axis_name):
        t, _k = expert_ids.shape
        x = placement.shape[-1]
        rows = expert_rows.shape[0]
        everywhere = lax.all_gather(expert_rows, axis_name, tiled=True)  # [n*C, H]
        hosted = lax.all_gather(placement.reshape(x), axis_name, tiled=True)
        all_ids = lax.all_gather(expert_ids, axis_name, tiled=True)  # [n*T, k]
        me = lax.axis_index(axis_name)
        # the slot of (token, choice) on its expert device: the token's rank among the expert's tokens
        position = jnp.zeros(n * x, jnp.int32).at[hosted].set(jnp.arange(n * x, dtype=jnp.int32))
        routed = (all_ids[None, :, :] == hosted[:, None, None]).any(-1)  # [E positions, n*T]
        per_device = routed.reshape(n, x, -1)
        rank = (jnp.cumsum(per_device.reshape(n, -1), axis=1) - 1).reshape(n, x, -1)
        mine = me * t + jnp.arange(t)
        p = position[jnp.maximum(expert_ids, 0)]  # [t, k]
        slot = (p // x) * rows + rank[p // x, p % x, mine[:, None]]
        chosen = jnp.where((expert_ids >= 0)[..., None], everywhere[slot], 0)  # -1: routed nowhere
        summed = jnp.einsum("tk,tkh->th", weights.astype(jnp.float32), chosen.astype(jnp.float32))
        return summed.astype(expert_rows.dtype)

    return _combine("broken_moe_combine_gathers_every_expert_row", body)(
        expert_rows, weights, expert_ids, placement, mesh=mesh, axis_name=axis_name
    )


@conformance.register(
    "moe_combine", name="broken_moe_combine_reads_aligned_groups_as_packed", group_alignment=8
)
def broken_moe_combine_reads_aligned_groups_as_packed(
    expert_rows, weights, expert_ids, placement, *, mesh, axis_name
):
    """Declares groups at multiples of 8 rows and reads the rows as though packed back to back: each
    expert's rows after the first group's are read from its padding and its predecessor's."""

    def body(rows, weights, expert_ids, placement, *, n, axis_name):
        packed = rows[: rows.shape[0] - placement.shape[-1] * 7]
        return _moe.combined(
            packed, weights, expert_ids, placement, n=n, axis_name=axis_name, exchange=_moe.xla_exchange
        )

    return _combine("broken_moe_combine_reads_aligned_groups_as_packed", body)(
        expert_rows, weights, expert_ids, placement, mesh=mesh, axis_name=axis_name
    )


def _inverted_tables(expert_ids, placement, *, n: int, axis_name: str):
    """:func:`_moe.routing_tables` as a kernel that inverts the placement with a scatter computes them: an
    expert named twice keeps whichever slot the scatter writes last, the same one for every sender."""
    x = placement.shape[-1]
    hosted = lax.all_gather(placement.reshape(x).astype(jnp.int32), axis_name, tiled=True)
    slot_of = jnp.zeros(n * x, jnp.int32).at[hosted].set(jnp.arange(n * x, dtype=jnp.int32))
    routed = expert_ids >= 0
    slot = slot_of[jnp.maximum(expert_ids, 0)]
    device, local = jnp.where(routed, slot // x, n), jnp.where(routed, slot % x, 0)
    mine = jnp.zeros((n, x), jnp.int32).at[device, local].add(1, mode="drop")
    return device, local, lax.all_gather(mine, axis_name)


@conformance.register(
    "moe_dispatch",
    name="broken_moe_dispatch_inverts_a_replicated_placement",
    replicas=conformance.ExpertReplicas("sender"),
)
def broken_moe_dispatch_inverts_a_replicated_placement(tokens, expert_ids, placement, *, mesh, axis_name):
    """Declares that device ``s`` sends an expert hosted ``r`` times to its replica ``s % r``, and finds
    an expert's device by inverting the placement with a scatter: every sender's rows go to one replica."""

    def body(tokens, expert_ids, placement, *, n, axis_name):
        tables = _inverted_tables(expert_ids, placement, n=n, axis_name=axis_name)
        return _moe.dispatched(
            tokens, expert_ids, placement, n=n, axis_name=axis_name, exchange=dense_exchange, tables=tables
        )

    return _dispatch("broken_moe_dispatch_inverts_a_replicated_placement", body)(
        tokens, expert_ids, placement, mesh=mesh, axis_name=axis_name
    )


@conformance.register(
    "moe_dispatch",
    name="correct_moe_dispatch_replicas_by_token",
    differentiable=True,
    replicas=conformance.ExpertReplicas("token"),
)
def correct_moe_dispatch_replicas_by_token(tokens, expert_ids, placement, *, mesh, axis_name):
    """A correct dispatch that spreads the rows of an expert hosted ``r`` times over its replicas by
    global token, ``t % r``, as a round-robin balancer does (the built-ins go by sender)."""

    def body(tokens, expert_ids, placement, *, n, axis_name):
        tables = _moe.routing_tables(expert_ids, placement, n=n, axis_name=axis_name, rule="token")
        return _moe.dispatched(
            tokens, expert_ids, placement, n=n, axis_name=axis_name, exchange=dense_exchange, tables=tables
        )

    return _dispatch("correct_moe_dispatch_replicas_by_token", body)(
        tokens, expert_ids, placement, mesh=mesh, axis_name=axis_name
    )
