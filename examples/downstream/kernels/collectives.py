"""Five kernels of this project, registered with the conformance suite with what they support.

``downstream_ring_all_gather``
    a ``ppermute`` ring under ``shard_map``: ``n - 1`` hops to the next device, each
    block placed by its owner. It is written for float32 and bfloat16 only, and
    declares that: the suite checks those two dtypes and reports int32 and int8 as
    not claimed.
``downstream_tiled_allgather_matmul``
    gathers the LHS round a ``ppermute`` ring, then multiplies in row tiles of 8, on
    1-D meshes only;
    ``supports`` says so. The suite moves its fixed shapes and draws to multiples of
    8 rows per shard and reports 2-D meshes as not claimed. It does not yet overlap
    its transfer with compute: ``known_failures.txt`` lists the overlap check.
``downstream_moe_token_exchange``
    an MoE layer's token exchange, ``lax.ragged_all_to_all``'s signature: each device pads
    its group for every peer to the largest group that fits, one ``all_to_all`` moves them,
    and each receiver writes a sender's rows where that sender's ``output_offsets`` say.
    XLA:CPU has no ragged-all-to-all, so this is what the project runs on CPU hosts.
``downstream_moe_dispatch`` and ``downstream_moe_combine``
    the same layer's two halves as the suite's MoE families take them (top-k expert ids and the
    experts' placement): each token device works out where each of its (token, choice) rows lands
    on its expert device, sends the rows with their slots in one padded ``all_to_all``, and the
    combine sends the slots it wants and gets those rows back in a second one.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

import conformance

#: Rows per tile of the tiled matmul: a shard must hold whole tiles.
ROW_TILE = 8


def _ring_gather(block: jax.Array, axis_name: str, n: int) -> jax.Array:
    """Every device's block, in device order: ``n - 1`` hops to the next device round the ring."""
    me = lax.axis_index(axis_name)
    to_next = [(j, (j + 1) % n) for j in range(n)]
    held, blocks = block, [block]
    for _ in range(n - 1):  # after hop s this device holds the block of device me - s
        held = lax.ppermute(held, axis_name, to_next)
        blocks.append(held)
    owners = (me - jnp.arange(n)) % n
    placed = jnp.zeros((n, *block.shape), block.dtype).at[owners].set(jnp.stack(blocks))
    return placed.reshape(n * block.shape[0], *block.shape[1:])


@conformance.register(
    "all_gather",
    name="downstream_ring_all_gather",
    dtypes=("float32", "bfloat16"),
    description="ppermute ring, n - 1 hops; float32 and bfloat16 only",
)
def downstream_ring_all_gather(x: jax.Array, *, mesh: jax.sharding.Mesh, axis_name: str) -> jax.Array:
    n = mesh.shape[axis_name]
    per_device = lambda block: _ring_gather(block, axis_name, n)
    return jax.shard_map(per_device, mesh=mesh, in_specs=P(axis_name), out_specs=P(), check_vma=False)(x)


def _whole_row_tiles_on_one_axis(*, dims, dtype, axis_size, mesh_shape) -> str | None:
    """The declaration of :func:`downstream_tiled_allgather_matmul` (``None``: supported)."""
    if len(mesh_shape) != 1:
        return f"1-D meshes only (got {dict(mesh_shape)})"
    if dims["rows_per_shard"] % ROW_TILE:
        return f"rows_per_shard={dims['rows_per_shard']} is not a multiple of the row tile {ROW_TILE}"
    return None


@conformance.register(
    "allgather_matmul",
    name="downstream_tiled_allgather_matmul",
    supports=_whole_row_tiles_on_one_axis,
    description="ppermute ring gather of lhs, then a matmul in row tiles of 8; 1-D meshes",
)
def downstream_tiled_allgather_matmul(
    lhs: jax.Array, rhs: jax.Array, *, mesh: jax.sharding.Mesh, axis_name: str
) -> jax.Array:
    n = mesh.shape[axis_name]
    if lhs.shape[0] % n or rhs.shape[1] % n:
        raise ValueError(
            f"downstream_tiled_allgather_matmul: lhs rows {lhs.shape[0]} and rhs columns "
            f"{rhs.shape[1]} must divide by the axis size {n}"
        )

    def per_device(lhs_block: jax.Array, rhs_block: jax.Array) -> jax.Array:
        rows = _ring_gather(lhs_block, axis_name, n)
        tiles = rows.reshape(-1, ROW_TILE, rows.shape[-1])
        out = jnp.einsum("tik,kj->tij", tiles, rhs_block, preferred_element_type=jnp.float32)
        return out.reshape(rows.shape[0], -1).astype(lhs_block.dtype)

    return jax.shard_map(
        per_device, mesh=mesh, in_specs=(P(axis_name, None), P(None, axis_name)), out_specs=P(None, axis_name)
    )(lhs, rhs)


@conformance.register(
    "ragged_all_to_all",
    name="downstream_moe_token_exchange",
    differentiable=True,
    description="groups padded to the largest that fits, one all_to_all, written where the sender says",
)
def downstream_moe_token_exchange(
    x: jax.Array,
    output: jax.Array,
    input_offsets: jax.Array,
    send_sizes: jax.Array,
    output_offsets: jax.Array,
    recv_sizes: jax.Array,
    *,
    mesh: jax.sharding.Mesh,
    axis_name: str,
) -> jax.Array:
    n = mesh.shape[axis_name]

    def per_device(x, output, input_offsets, send_sizes, output_offsets, recv_sizes):
        capacity = min(x.shape[0], output.shape[0])  # the largest group that fits both sides
        rows = jnp.arange(capacity)
        at = jnp.clip(input_offsets[:, None] + rows, 0, x.shape[0] - 1)
        groups = jnp.where((rows < send_sizes[:, None])[..., None], x[at], jnp.zeros((), x.dtype))
        received = lax.all_to_all(groups, axis_name, 0, 0, tiled=True)  # [n, capacity, cols]: by sender
        slots = lax.all_to_all(output_offsets, axis_name, 0, 0, tiled=True)  # each sender's slot here
        target = jnp.where(rows < recv_sizes[:, None], slots[:, None] + rows, output.shape[0])
        return output.at[target.reshape(-1)].set(received.reshape(n * capacity, -1), mode="drop")

    return jax.shard_map(per_device, mesh=mesh, in_specs=(P(axis_name),) * 6, out_specs=P(axis_name))(
        x, output, input_offsets, send_sizes, output_offsets, recv_sizes
    )


def _where_rows_land(expert_ids: jax.Array, placement: jax.Array, axis_name: str, n: int):
    """For this device's (token, choice) pairs, in that order: the device of each one's expert (``n``,
    no device, for a choice routed nowhere: expert id -1), the row it lands on there, and its place
    in a buffer of ``t * min(k, x)`` rows per device."""
    t, k = expert_ids.shape
    x = placement.shape[1]
    experts = lax.all_gather(placement[0], axis_name, tiled=True)  # position p: device p // x
    ids = expert_ids.reshape(-1)
    # each pair's expert's position; n * x (past every expert) for a choice routed nowhere
    position = jnp.where(ids >= 0, jnp.argsort(experts)[jnp.maximum(ids, 0)], n * x)
    counts = lax.all_gather(jnp.zeros(n * x, jnp.int32).at[position].add(1, mode="drop"), axis_name)  # [n, E]
    per_expert = counts.sum(0).reshape(n, x)
    start = (jnp.cumsum(per_expert, 1) - per_expert).reshape(-1)  # an expert's first row on its device
    earlier_devices = (jnp.cumsum(counts, 0) - counts)[lax.axis_index(axis_name)]
    chose = jax.nn.one_hot(position, n * x, dtype=jnp.int32)
    pairs = jnp.arange(t * k)
    earlier_here = (jnp.cumsum(chose, 0) - chose)[pairs, position]
    device = position // x
    to_device = jax.nn.one_hot(device, n, dtype=jnp.int32)
    lane = (jnp.cumsum(to_device, 0) - to_device)[pairs, device]
    return device, start[position] + earlier_devices[position] + earlier_here, lane


@conformance.register(
    "moe_dispatch",
    name="downstream_moe_dispatch",
    differentiable=True,
    description="each row sent with its slot in one padded all_to_all, written where its slot says",
)
def downstream_moe_dispatch(
    tokens: jax.Array, expert_ids: jax.Array, placement: jax.Array, *, mesh: jax.sharding.Mesh, axis_name: str
) -> jax.Array:
    n = mesh.shape[axis_name]

    def per_device(tokens, expert_ids, placement):
        t, k = expert_ids.shape
        room, rows = t * min(k, placement.shape[1]), n * t * min(k, placement.shape[1])
        device, slot, lane = _where_rows_land(expert_ids, placement, axis_name, n)
        sent = (
            jnp.zeros((n, room, tokens.shape[1]), tokens.dtype)
            .at[device, lane]
            .set(tokens[jnp.arange(t * k) // k], mode="drop")
        )
        # padding aimed past the end
        slots = jnp.full((n, room), rows, jnp.int32).at[device, lane].set(slot, mode="drop")
        got = lax.all_to_all(sent, axis_name, 0, 0, tiled=True)
        got_slots = lax.all_to_all(slots, axis_name, 0, 0, tiled=True)
        out = jnp.zeros((rows, tokens.shape[1]), tokens.dtype)
        return out.at[got_slots.reshape(-1)].set(got.reshape(-1, tokens.shape[1]), mode="drop")

    return jax.shard_map(per_device, mesh=mesh, in_specs=(P(axis_name),) * 3, out_specs=P(axis_name))(
        tokens, expert_ids, placement
    )


@conformance.register(
    "moe_combine",
    name="downstream_moe_combine",
    differentiable=True,
    description="the slots each token device wants in one all_to_all, the rows back in another, summed",
)
def downstream_moe_combine(
    expert_rows: jax.Array,
    weights: jax.Array,
    expert_ids: jax.Array,
    placement: jax.Array,
    *,
    mesh: jax.sharding.Mesh,
    axis_name: str,
) -> jax.Array:
    n = mesh.shape[axis_name]

    def per_device(expert_rows, weights, expert_ids, placement):
        t, k = expert_ids.shape
        room, rows = t * min(k, placement.shape[1]), expert_rows.shape[0]
        device, slot, lane = _where_rows_land(expert_ids, placement, axis_name, n)
        wanted = jnp.full((n, room), rows, jnp.int32).at[device, lane].set(slot, mode="drop")
        asked = lax.all_to_all(wanted, axis_name, 0, 0, tiled=True)  # the rows each device wants of mine
        answer = jnp.where((asked < rows)[..., None], expert_rows[jnp.minimum(asked, rows - 1)], 0)
        back = lax.all_to_all(answer.astype(expert_rows.dtype), axis_name, 0, 0, tiled=True)
        routed = (device < n)[:, None]
        # nothing for a choice routed nowhere
        chosen = jnp.where(routed, back[jnp.minimum(device, n - 1), lane], 0)
        chosen = chosen.reshape(t, k, -1).astype(jnp.float32)
        return jnp.einsum("tk,tkh->th", weights.astype(jnp.float32), chosen).astype(expert_rows.dtype)

    return jax.shard_map(per_device, mesh=mesh, in_specs=(P(axis_name),) * 4, out_specs=P(axis_name))(
        expert_rows, weights, expert_ids, placement
    )
