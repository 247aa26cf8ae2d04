"""A mixture-of-experts dispatch and combine built on one ragged all-to-all, whichever does the exchange.

Both run per device under ``shard_map`` (``T`` tokens, ``k`` choices each, ``X`` experts a device, ``n``
devices; the families' contract is :mod:`conformance.specs.moe_routing`):

1. **Routing tables.** The placement is gathered (``[E]``: which device hosts each expert, and as which of
   its ``X``), each (token, choice) row gets its expert device and local expert, and every device's
   ``[n, X]`` counts (rows it sends each device's each expert) are gathered: ``[n, n, X]``, a few ints
   per expert, from which every device computes every offset without another exchange.
2. **Dispatch.** A token device sorts its ``T * k`` rows by (expert device, local expert, token) and hands
   them to the exchange: group ``j`` to device ``j``, landing after the groups of the senders before
   it (``output_offsets``, the sender's view: the receiver's slots for it, from the counts). Device ``d``
   then holds its rows sender-major, and permutes them expert-major (a gather): each expert's rows
   contiguous, in global token order, zero after.
3. **Combine.** The inverse: device ``d`` permutes its rows back to sender-major, the exchange returns
   each sender's group to the rows its tokens sent (the dispatch's sorted order, as that device's
   ``output_offsets`` say), and the token device un-sorts them and sums each token's ``k`` rows, weighted,
   in float32, rounded once.

The exchange is any function with ``lax.ragged_all_to_all``'s per-device signature: XLA's own op (TPU,
GPU) or a form every backend runs (a padded dense all-to-all, a ring of ppermutes), told the largest
group there can be (``T * min(k, X)`` rows: one device's tokens, each sending one device at most ``X``
of its choices), which is what a padded form moves per peer.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from conformance import compat
from conformance.kernels._validation import axis_size, require_divisible
from conformance.specs.moe_routing import ExpertCapacity

#: ``fn(x, output, input_offsets, send_sizes, output_offsets, recv_sizes, *, axis_name, capacity)``,
#: one device's ragged all-to-all (``capacity``: the largest group; an exchange may ignore it).
Exchange = Callable[..., jax.Array]


def validate(
    name: str,
    per_token: tuple[str, jax.Array],
    expert_ids: jax.Array,
    placement: jax.Array,
    mesh: jax.sharding.Mesh,
    axis_name: str,
) -> int:
    """Raise ``ValueError`` naming the offending values; return the axis size. ``per_token``: the operand
    with a row per token, and its name (a dispatch's tokens, a combine's weights)."""
    n = axis_size(name, mesh, axis_name)
    what, rows = per_token
    require_divisible(name, f"rows of {what}", rows.shape[0], n, axis_name)
    if expert_ids.ndim != 2 or expert_ids.shape[0] != rows.shape[0]:
        raise ValueError(
            f"{name}: expert_ids must be [tokens, k] with a row per token ({rows.shape[0]}), got "
            f"{list(expert_ids.shape)}"
        )
    if placement.ndim != 2 or placement.shape[0] != n:
        raise ValueError(
            f"{name}: placement must be [n, X] with a row per device (n = {n} devices of axis "
            f"{axis_name!r}), got {list(placement.shape)}"
        )
    for what, array in (("expert_ids", expert_ids), ("placement", placement)):
        if not jnp.issubdtype(array.dtype, jnp.integer):
            raise ValueError(f"{name}: {what} must be integers, got {array.dtype}")
    return n


def per_device(
    body: Callable[..., jax.Array], mesh: jax.sharding.Mesh, axis_name: str, operands
) -> jax.Array:
    """``body(*blocks)`` on each device's blocks of ``operands`` (each sharded along its first dim), as
    one program: under ``jax.jit`` inside a caller's ``jax.jit``, where it is inlined, and compiled once
    when the layer is called eagerly, where a bare ``shard_map`` body runs op by op (400-odd
    primitives, each compiled on its own: 17 s a layer on 8 CPU devices, 26 s in a job of two
    processes)."""
    specs = (P(axis_name),) * len(operands)
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=P(axis_name)))(*operands)


def xla_exchange(*operands: jax.Array, axis_name: str, capacity: int) -> jax.Array:
    """XLA's own ``lax.ragged_all_to_all`` (it needs no bound on a group)."""
    return lax.ragged_all_to_all(*operands, axis_name=axis_name)


def _slots_for(exchange: Exchange, receiver_slots: jax.Array) -> dict[str, jax.Array]:
    """``receiver_slots`` for an exchange marked ``takes_receiver_slots`` (the padded dense one, which
    then skips its all-to-all of the senders' ``output_offsets``); nothing for any other."""
    return {"receiver_slots": receiver_slots} if getattr(exchange, "takes_receiver_slots", False) else {}


def _exclusive(sizes: jax.Array, axis: int = 0) -> jax.Array:
    return jnp.cumsum(sizes, axis=axis) - sizes


def routing_tables(
    expert_ids: jax.Array, placement: jax.Array, *, n: int, axis_name: str, rule: str = "sender"
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(device, local, counts)``: each (token, choice)'s expert device and local expert (``[T, k]``
    each; a choice routed nowhere, expert id ``-1``, gets device ``n``, past every real one, so that it
    sorts last and counts nowhere), and every device's rows for every device's every expert
    (``[n senders, n receivers, X]``).

    An expert the placement names more than once (replicated by a load balancer) is sent to one of its
    ``r`` slots, in placement order, by ``rule`` (:class:`conformance.ExpertReplicas`): ``"sender"``, slot
    ``me % r``; ``"token"``, slot ``t % r`` for global token ``t``. Each slot's rank among its expert's
    slots is read from the gathered placement (an ``[E, E]`` comparison, a few ints), so a scatter that
    inverts the placement, whose duplicate indices keep one slot for every sender, is not needed."""
    if rule not in ("sender", "token"):
        raise ValueError(f"routing_tables: rule must be 'sender' or 'token', got {rule!r}")
    x = placement.shape[-1]
    hosted = lax.all_gather(
        placement.reshape(x).astype(jnp.int32), axis_name, tiled=True
    )  # position p: device p // X
    position = jnp.arange(n * x, dtype=jnp.int32)
    same = hosted[:, None] == hosted[None, :]
    rank = (same & (position[None, :] < position[:, None])).sum(1)  # among its expert's slots
    replicas = same.sum(1)
    t = expert_ids.shape[0]
    me = lax.axis_index(axis_name)
    key = me * t + jnp.arange(t, dtype=jnp.int32)[:, None, None] if rule == "token" else me
    picked = (hosted == expert_ids[..., None]) & (rank == key % replicas)  # [T, k, n*X]; -1 picks none
    routed = picked.any(-1)
    slot = (picked * position).sum(-1)
    device = jnp.where(routed, slot // x, n)
    local = jnp.where(routed, slot % x, 0)
    mine = jnp.zeros((n, x), jnp.int32).at[device, local].add(1, mode="drop")
    return device, local, lax.all_gather(mine, axis_name)


def sorted_order(device: jax.Array, local: jax.Array, x: int) -> jax.Array:
    """The (token, choice) rows, flattened, in (expert device, local expert, token) order."""
    t, _k = device.shape
    key = (device * x + local) * t + jnp.arange(t, dtype=jnp.int32)[:, None]
    return jnp.argsort(key.reshape(-1))


def regrouped(sizes: jax.Array, rows: int) -> tuple[jax.Array, jax.Array]:
    """Rows in groups ``(a, b)`` of ``sizes[a, b]`` each: for each of ``rows`` positions in b-major
    order (group ``(0, 0), (1, 0), ...``), the position of the same row in a-major order, and whether a
    row is there (positions past the last group hold none)."""
    a, b = sizes.shape
    by_b = sizes.T.reshape(-1)
    ends = jnp.cumsum(by_b)
    starts_a = _exclusive(sizes.reshape(-1)).reshape(a, b)
    p = jnp.arange(rows)
    g = (ends[None, :] <= p[:, None]).sum(1)  # the group of each position (a search JAX 0.6 cannot type)
    held = g < a * b
    g = jnp.minimum(g, a * b - 1)
    return jnp.where(held, starts_a[g % a, g // a] + p - (ends - by_b)[g], 0), held


def dispatched(
    tokens: jax.Array,
    expert_ids: jax.Array,
    placement: jax.Array,
    *,
    n: int,
    axis_name: str,
    exchange: Exchange,
    tables: tuple[jax.Array, jax.Array, jax.Array] | None = None,
) -> jax.Array:
    """One device's part of a dispatch (the module doc's steps 1 and 2): ``[C, H]``. ``tables``: the
    :func:`routing_tables` where the caller has them (a layer's combine reads the same)."""
    t, k = expert_ids.shape
    x = placement.shape[-1]
    rows = n * t * min(k, x)
    me = lax.axis_index(axis_name)
    device, local, counts = tables or routing_tables(expert_ids, placement, n=n, axis_name=axis_name)
    order = sorted_order(device, local, x)
    pairs = counts.sum(-1)  # [senders, receivers]
    send_sizes = pairs[me]
    arrived = exchange(
        tokens[order // k],
        compat.varying(jnp.zeros((rows, tokens.shape[1]), tokens.dtype), axis_name),
        _exclusive(send_sizes),
        send_sizes,
        _exclusive(pairs, axis=0)[me],
        pairs[:, me],
        axis_name=axis_name,
        capacity=t * min(k, x),
        **_slots_for(exchange, _exclusive(pairs, axis=0)[:, me]),
    )
    source, held = regrouped(counts[:, me, :], rows)  # expert-major position -> arrival position
    return jnp.where(held[:, None], arrived[source], jnp.zeros((), tokens.dtype))


def combined(
    expert_rows: jax.Array,
    weights: jax.Array,
    expert_ids: jax.Array,
    placement: jax.Array,
    *,
    n: int,
    axis_name: str,
    exchange: Exchange,
    in_token_order: bool = True,
    tables: tuple[jax.Array, jax.Array, jax.Array] | None = None,
) -> jax.Array:
    """One device's part of a combine (the module doc's steps 1 and 3): ``[T, H]``. ``in_token_order=False``
    leaves the returned rows in the order they come back (a self-test's defect); ``tables`` as for
    :func:`dispatched`."""
    t, k = expert_ids.shape
    x = placement.shape[-1]
    me = lax.axis_index(axis_name)
    device, local, counts = tables or routing_tables(expert_ids, placement, n=n, axis_name=axis_name)
    pairs = counts.sum(-1)
    source, held = regrouped(counts[:, me, :].T, expert_rows.shape[0])  # arrival position -> expert-major
    back = jnp.where(held[:, None], expert_rows[source], jnp.zeros((), expert_rows.dtype))
    returned = exchange(
        back,
        compat.varying(jnp.zeros((t * k, expert_rows.shape[1]), expert_rows.dtype), axis_name),
        _exclusive(pairs[:, me]),
        pairs[:, me],
        _exclusive(pairs, axis=1)[:, me],
        pairs[me],
        axis_name=axis_name,
        capacity=t * min(k, x),
        **_slots_for(exchange, _exclusive(pairs, axis=1)[me]),
    )
    order = sorted_order(device, local, x)
    chosen = (jnp.zeros_like(returned).at[order].set(returned) if in_token_order else returned).reshape(
        t, k, -1
    )
    summed = jnp.einsum("tk,tkh->th", weights.astype(jnp.float32), chosen.astype(jnp.float32))
    return summed.astype(expert_rows.dtype)


def past_capacity_unrouted(expert_ids: jax.Array, *, experts: int, capacity: ExpertCapacity) -> jax.Array:
    """One device's ``expert_ids[T, k]`` with the choices a ``group="device"`` capacity rule drops set to
    -1 (routed nowhere, which :func:`dispatched` and :func:`combined` skip): each expert's running count
    over the device's (token, choice) rows in ``capacity.order``, the rows past
    ``capacity.rows(T, k, experts)`` dropped, as MaxText masks its tokens before the exchange."""
    if capacity.group != "device":
        raise ValueError(f"past_capacity_unrouted applies a rule within a device's tokens, got {capacity}")
    t, k = expert_ids.shape
    room = capacity.rows(t, k, experts)
    by_token = capacity.order == "token"
    flat = (expert_ids if by_token else expert_ids.T).reshape(-1)
    chose = flat[:, None] == jnp.arange(experts)[None, :]  # [T*k, E]; -1 chooses none
    kept = (chose & (jnp.cumsum(chose, axis=0) <= room)).any(-1)
    kept = kept.reshape(t, k) if by_token else kept.reshape(k, t).T
    return jnp.where(kept, expert_ids, -1)


def maxtext_style_dispatched(
    tokens: jax.Array,
    expert_ids: jax.Array,
    placement: jax.Array,
    *,
    n: int,
    axis_name: str,
    output_offsets_of: Callable[[jax.Array, jax.Array], jax.Array] | None = None,
) -> jax.Array:
    """One device's dispatch as MaxText's ragged path writes it (``moe.py``: ``permute``,
    ``get_all_to_all_params``, ``lax.ragged_all_to_all``, ``local_permute``): ``[C, H]``.

    1. Sort the flattened (token, choice) rows by expert (``argsort``, stable: token order within an
       expert) and count each expert's rows (``bincount``). MaxText's expert id is its position in a
       contiguous placement; here the position is read from ``placement``, so any placement works.
    2. Gather every device's per-device counts, ``sizes[sender, receiver]``; the sender's
       ``input_offsets`` and ``send_sizes`` are its row, ``recv_sizes`` its column, and
       ``output_offsets`` the cumulative sum over the senders (a zero row first) at its own row: where
       its group lands on each receiver, after the senders before it.
    3. ``lax.ragged_all_to_all`` lands the groups sender-major; a stable sort of the received rows by
       local expert makes them expert-major, each expert's rows in global token order.

    ``output_offsets_of(sizes, me)``: a self-test's other offsets (MaxText's own: the sum over the
    senders before ``me``)."""
    t, k = expert_ids.shape
    x = placement.shape[-1]
    e = n * x
    rows = n * t * min(k, x)
    me = lax.axis_index(axis_name)
    every = lax.all_gather(placement.reshape(x).astype(jnp.int32), axis_name, tiled=True)
    position = jnp.zeros(e, jnp.int32).at[every].set(jnp.arange(e, dtype=jnp.int32))
    flat = expert_ids.reshape(-1)
    chosen = jnp.where(flat >= 0, position[jnp.maximum(flat, 0)], e)  # e: routed nowhere, sorted last
    order = jnp.argsort(chosen, stable=True)
    group_sizes = jnp.zeros(e, jnp.int32).at[chosen].add(1, mode="drop")
    sizes = lax.all_gather(group_sizes.reshape(n, x).sum(-1), axis_name)  # [senders, receivers]
    if output_offsets_of is None:
        output_offsets = jnp.concatenate([jnp.zeros((1, n), jnp.int32), sizes]).cumsum(0)[me]
    else:
        output_offsets = output_offsets_of(sizes, me)
    arrived = lax.ragged_all_to_all(
        tokens[order // k],
        compat.varying(jnp.zeros((rows, tokens.shape[1]), tokens.dtype), axis_name),
        _exclusive(sizes[me]),
        sizes[me],
        output_offsets,
        sizes[:, me],
        axis_name=axis_name,
    )
    # local_permute: each received row's local expert (sender-major, each sender's rows by expert)
    from_each = lax.all_gather(group_sizes, axis_name).reshape(n, n, x)[:, me]  # [senders, local experts]
    local = jnp.repeat(jnp.tile(jnp.arange(x), n), from_each.reshape(-1), total_repeat_length=rows)
    held = jnp.arange(rows) < from_each.sum()
    permuted = arrived[jnp.argsort(jnp.where(held, local, x), stable=True)]
    return jnp.where(held[:, None], permuted, jnp.zeros((), tokens.dtype))


def aligned_groups(rows: jax.Array, sizes: jax.Array, alignment: int) -> jax.Array:
    """One device's packed experts' rows ``[C, H]`` (groups of ``sizes[X]`` rows, back to back) with each
    group moved to the next multiple of ``alignment`` rows, the rows between zero: ``[C + X*(a-1), H]``
    (the layout a grouped matmul tiled by ``alignment`` rows reads)."""
    c, x = rows.shape[0], sizes.shape[0]
    total = c + x * (alignment - 1)
    padded = (sizes + alignment - 1) // alignment * alignment
    p = jnp.arange(c)
    group = (jnp.cumsum(sizes)[None, :] <= p[:, None]).sum(1)  # each packed row's group (x: none)
    held = group < x
    group = jnp.minimum(group, x - 1)
    to = jnp.where(held, _exclusive(padded)[group] + p - _exclusive(sizes)[group], total)
    return jnp.zeros((total, rows.shape[1]), rows.dtype).at[to].set(rows, mode="drop")


def packed_groups(aligned: jax.Array, sizes: jax.Array, alignment: int) -> jax.Array:
    """:func:`aligned_groups` undone: ``[C, H]`` of the aligned layout's ``[C + X*(a-1), H]``."""
    x = sizes.shape[0]
    c = aligned.shape[0] - x * (alignment - 1)
    padded = (sizes + alignment - 1) // alignment * alignment
    p = jnp.arange(c)
    group = (jnp.cumsum(sizes)[None, :] <= p[:, None]).sum(1)
    held = group < x
    group = jnp.minimum(group, x - 1)
    source = jnp.where(held, _exclusive(padded)[group] + p - _exclusive(sizes)[group], 0)
    return jnp.where(held[:, None], aligned[source], jnp.zeros((), aligned.dtype))


def received_per_expert(expert_ids: jax.Array, placement: jax.Array, *, n: int, axis_name: str) -> jax.Array:
    """``[X]``: the rows each of this device's experts receives from every device."""
    _, _, counts = routing_tables(expert_ids, placement, n=n, axis_name=axis_name)
    return counts[:, lax.axis_index(axis_name), :].sum(0)
