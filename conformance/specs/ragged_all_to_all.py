"""Family ``ragged_all_to_all``: each device sends a group of rows, of its own size, to every device
(``lax.ragged_all_to_all``), as a mixture-of-experts layer moves tokens to their experts and back.

``fn(x, output, input_offsets, send_sizes, output_offsets, recv_sizes, *, mesh, axis_name)``, every
operand sharded ``P(axis_name)`` along its first dim, so that inside ``jax.shard_map`` device ``i``
holds exactly what ``lax.ragged_all_to_all`` takes:

* ``x[n*R, cols]``: device ``i``'s ``[R, cols]`` rows, its groups to send (padded, in any order);
* ``output[n*S, cols]``: device ``i``'s ``[S, cols]`` output buffer, as the caller passes it;
* ``input_offsets``, ``send_sizes``, ``output_offsets``, ``recv_sizes``: ``int32[n*n]``, device
  ``i``'s ``[n]`` each, entry ``j`` about its group for device ``j`` (or, for ``recv_sizes``, from
  device ``j``);

and the result is ``[n*S, cols]``, sharded ``P(axis_name)``: device ``j``'s output buffer with the
groups it receives written in. On a 2-D mesh the other axis is replicated.

The contract, rule by rule, from ``lax.ragged_all_to_all``'s documentation:

1. Device ``i`` sends rows ``x_i[input_offsets_i[j] : input_offsets_i[j] + send_sizes_i[j]]`` to device
   ``j`` ("the ``input_offsets`` and ``send_sizes`` arguments indicate the slices of the caller's
   ``operand`` to be sent"), group ``j`` going to the ``j``-th device of the axis (one group per device:
   ``K = n``, the documented ``len(input_offsets) // axis_size`` slices per device being one).
2. They land at ``output_j[output_offsets_i[j] : ... + send_sizes_i[j]]``: the *sender's*
   ``output_offsets`` say where its group lands on the receiver ("``output_offsets`` indicates the
   offsets at which the *sent* slices are written on their corresponding receivers"). A receiver finds
   its own slots only by exchanging them (an all-to-all of ``output_offsets``); a kernel that reads its
   local ``output_offsets`` as its own slots puts each group in the slot its receiver chose for some
   other sender (marin-community/marin's "Fix ragged all-to-all sender offsets").
3. ``recv_sizes`` is the transpose of ``send_sizes`` (``recv_sizes_j[i] == send_sizes_i[j]``). The op
   requires it and checks nothing; here a kernel may read either (every case the suite passes is
   consistent), and what it does with sizes that are not transposes is left undefined, as the op
   leaves it.
4. Rows of ``output`` that no group writes keep exactly the caller's values ("the same value of the
   argument ``output`` except with received values written at some slices"): not zeros.
5. Offsets are not derived from sizes: groups may be padded apart, in any order, and a group of zero
   rows moves nothing, wherever its offset points.
6. Groups that overlap in the output, or run past a buffer, are the caller's error; the suite passes
   none, and a kernel may leave them undefined.

Ground truth is the numpy transcription of rules 1-4 (:func:`reference`), bit-exact: there is no
arithmetic. The routing (offsets and sizes) is part of the case, not drawn per seed: the ``routing``
dim names one of :data:`ROUTINGS`, each a kind of traffic kernels break on (uneven groups, groups of
zero rows, a device that sends nothing, all of a device's rows to one peer, groups as large as the
buffers allow), laid out from the dims by a fixed generator (:func:`routing`), so that a case's token
pins it, and byte bounds can count the rows it sends.

Gradient: the transposed exchange (``lax.ragged_all_to_all``'s own transpose): each row a device sent
gets the cotangent of the row it landed on, rows sent nowhere get zero; ``output``'s gradient is the
cotangent where no group wrote, zero where one did. The offsets and sizes have none.

Bytes: a device must receive exactly the rows its groups bring; a kernel may move each peer a
fixed-size buffer of as many rows as a group can have (``min(R, S)``: a padded dense all-to-all),
plus the routing (each other device's four arrays of ``n`` int32s, which a wrapper may gather, as
JAX's Pallas ragged all-to-all gathers every device's offsets), and no more: never the whole operand
gathered. Rows may move by all-to-all, ragged-all-to-all or collective-permutes; an all-gather (or
the all-reduce XLA:TPU makes of a small one) of int32s only (:data:`COLLECTIVES`).

A dispatch/combine pair (tokens to experts and back, in the token order) is this op twice with the
routing transposed: a combine's ``send_sizes`` are its dispatch's ``recv_sizes``, its
``input_offsets`` the slots its dispatch wrote, and its ``output_offsets`` the rows the tokens came
from (docs/families.md).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import numpy as np
from jax.sharding import PartitionSpec as P

from conformance import tolerances
from conformance.specs.base import BadInput, Dims, FamilySpec, KnownMistake, Operand, rows_tagged_by_position

#: The kinds of traffic the ``routing`` dim names, by value (0, 1, ...): what each lays out.
ROUTINGS = (
    "uneven groups, padded apart",
    "groups of zero rows among uneven ones",
    "device 0 sends nothing",
    "each device sends all it can to one peer (the next one)",
    "groups as large as the buffers allow, no padding",
)

#: Offsets and sizes: one int32 per (device, peer).
ROUTING_ITEMSIZE = 4


def routing(d: Dims, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``(input_offsets, send_sizes, output_offsets, recv_sizes)``, each ``[n, n]``: row ``i`` is device
    ``i``'s, laid out for the dims' ``routing`` (:data:`ROUTINGS`) from a generator seeded by the dims
    alone. Every group fits: a sender's groups within its ``R`` rows, a receiver's within its ``S``,
    none overlapping; padding is spread between them, and each device orders its groups (and its
    slots for the groups it receives) in an order of its own, so that offsets follow from no sizes."""
    kind, rows, slots = d["routing"], d["rows_per_shard"], d["out_rows_per_shard"]
    if not 0 <= kind < len(ROUTINGS):
        raise ValueError(f"routing={kind} is not one of 0..{len(ROUTINGS) - 1} ({'; '.join(ROUTINGS)})")
    rng = np.random.default_rng([kind, n, rows, slots, d["cols"]])
    fair = max(1, min(rows, slots) // n)
    if kind == 0:
        sizes = rng.integers(0, 2 * fair + 1, size=(n, n))
    elif kind == 1:
        sizes = rng.integers(1, 2 * fair + 1, size=(n, n)) * (rng.random((n, n)) < 0.5)
    elif kind == 2:
        sizes = rng.integers(0, 2 * fair + 1, size=(n, n))
        sizes[0] = 0
    elif kind == 3:
        sizes = np.zeros((n, n), dtype=np.int64)
        sizes[np.arange(n), (np.arange(n) + 1) % n] = min(rows, slots)
    else:
        sizes = np.full((n, n), min(rows, slots) // n) + (rng.random((n, n)) < 0.5) * (min(rows, slots) % n)
    sizes = _fitted(sizes.astype(np.int64), rows, slots)
    input_offsets = _laid_out(sizes, rows, rng)
    output_offsets = _laid_out(sizes.T, slots, rng).T
    return input_offsets, sizes, output_offsets, sizes.T.copy()


def _fitted(sizes: np.ndarray, rows: int, slots: int) -> np.ndarray:
    """``sizes`` with the largest group of any sender over ``rows`` (or receiver over ``slots``)
    shrunk, one row at a time, until every sender's groups fit its rows and every receiver's its slots."""
    sizes = sizes.copy()
    while True:
        over_rows = np.flatnonzero(sizes.sum(1) > rows)
        over_slots = np.flatnonzero(sizes.sum(0) > slots)
        if over_rows.size:
            i = over_rows[0]
            sizes[i, np.argmax(sizes[i])] -= 1
        elif over_slots.size:
            j = over_slots[0]
            sizes[np.argmax(sizes[:, j]), j] -= 1
        else:
            return sizes


def _laid_out(sizes: np.ndarray, room: int, rng: np.random.Generator) -> np.ndarray:
    """Offsets for row ``i``'s groups (``sizes[i]``) in a buffer of ``room`` rows: in a random order of
    peers, the spare rows spread between them as padding."""
    offsets = np.zeros_like(sizes)
    for i, row in enumerate(sizes):
        spare = room - int(row.sum())
        gaps = np.sort(rng.integers(0, spare + 1, size=len(row)))  # cumulative padding before each group
        at = 0
        for k, j in enumerate(rng.permutation(len(row))):
            offsets[i, j] = at + gaps[k]
            at += int(row[j])
    return offsets


def _routing_operand(which: int) -> Operand:
    return Operand(
        ("input_offsets", "send_sizes", "output_offsets", "recv_sizes")[which],
        lambda a: P(a),
        lambda d, n: (n * n,),
        dtype="int32",
        values=lambda d, n: routing(d, n)[which].reshape(-1),
    )


def reference(
    x: np.ndarray,
    output: np.ndarray,
    input_offsets: np.ndarray,
    send_sizes: np.ndarray,
    output_offsets: np.ndarray,
    recv_sizes: np.ndarray,
    *,
    axis_size: int,
) -> np.ndarray:
    """Rules 1, 2 and 4 of the module doc, in numpy: ``output`` with each sender's group written where
    its ``output_offsets`` put it on the receiver (``recv_sizes`` is rule 3's transpose, unread)."""
    n = axis_size
    sent = x.reshape(n, -1, *x.shape[1:])
    out = output.reshape(n, -1, *output.shape[1:]).copy()
    io, ss, oo = (a.reshape(n, n).astype(np.int64) for a in (input_offsets, send_sizes, output_offsets))
    for i in range(n):
        for j in range(n):
            size = ss[i, j]
            out[j, oo[i, j] : oo[i, j] + size] = sent[i, io[i, j] : io[i, j] + size]
    return out.reshape(output.shape)


def _moved(x, output, input_offsets, send_sizes, output_offsets, *, axis_size, slot_of, rows_of, start):
    """The reference with its choices given: the slot each group lands at (``slot_of(oo, ss, i, j)``,
    of the output offsets and the send sizes), how many rows each moves (``rows_of(size)``), and the
    buffer the result starts from (``start``)."""
    n = axis_size
    sent = x.reshape(n, -1, *x.shape[1:])
    out = start(output.reshape(n, -1, *output.shape[1:]))
    io, ss, oo = (a.reshape(n, n).astype(np.int64) for a in (input_offsets, send_sizes, output_offsets))
    for i in range(n):
        for j in range(n):
            size = min(rows_of(ss[i, j]), sent.shape[1] - io[i, j])
            at = slot_of(oo, ss, i, j)
            size = min(size, out.shape[1] - at)
            out[j, at : at + size] = sent[i, io[i, j] : io[i, j] + size]
    return out.reshape(output.shape)


def _mistake(**choices) -> Callable[..., np.ndarray]:
    def result(x, output, input_offsets, send_sizes, output_offsets, recv_sizes, *, axis_size):
        defaults = {"slot_of": lambda oo, ss, i, j: oo[i, j], "rows_of": lambda size: size, "start": np.copy}
        return _moved(
            x,
            output,
            input_offsets,
            send_sizes,
            output_offsets,
            axis_size=axis_size,
            **{**defaults, **choices},
        )

    return result


#: The mistakes the values check names when a result matches one.
KNOWN_MISTAKES = (
    KnownMistake(
        "reading output_offsets on the receiver's side (each receiver writing sender i's group at its own "
        "output_offsets[i]; they are the sender's, where its group lands on the receiver: exchange them "
        "with an all-to-all, as marin-community/marin's 'Fix ragged all-to-all sender offsets' did)",
        _mistake(slot_of=lambda oo, ss, i, j: oo[j, i]),
    ),
    KnownMistake(
        "packing each receiver's groups from its recv_sizes (sender i's group at the sum of recv_sizes[:i]) "
        "in place of the caller's output_offsets: the caller says where each group lands, and its groups "
        "may be padded apart",
        _mistake(slot_of=lambda oo, ss, i, j: int(ss[:i, j].sum())),
    ),
    KnownMistake(
        "zeroing the output first (the rows no group writes must keep the caller's output values)",
        _mistake(start=np.zeros_like),
    ),
)


def vjp_reference(x, output, input_offsets, send_sizes, output_offsets, recv_sizes, ct):
    """The transposed exchange: each sent row of ``x`` gets the cotangent of the row it landed on (rows
    sent nowhere get zero), and ``output`` the cotangent of the rows no group wrote (zero where one did)."""
    n = math.isqrt(input_offsets.size)  # the routing holds n entries per device
    d_x = np.zeros(x.shape).reshape(n, -1, *x.shape[1:])
    d_output = ct.reshape(n, -1, *ct.shape[1:]).copy()
    cts = ct.reshape(d_output.shape)
    io, ss, oo = (a.reshape(n, n).astype(np.int64) for a in (input_offsets, send_sizes, output_offsets))
    for i in range(n):
        for j in range(n):
            size = ss[i, j]
            d_x[i, io[i, j] : io[i, j] + size] = cts[j, oo[i, j] : oo[i, j] + size]
    for i in range(n):
        for j in range(n):
            d_output[j, oo[i, j] : oo[i, j] + ss[i, j]] = 0
    return d_x.reshape(x.shape), d_output.reshape(output.shape)


def jax_transpose_vjp(
    x, output, input_offsets, send_sizes, output_offsets, recv_sizes, ct, *, axis_size, zeroed="above_zero"
):
    """The gradients JAX's own transpose of ``lax.ragged_all_to_all`` gives: ``d_x`` right (the op
    again, the routing transposed), but ``output``'s cotangent masked by a running sum of +1 at each
    received group's offset (a scatter that *sets*) and -1 at its end (a scatter that *adds*), and
    zeroed where the sum is ``zeroed``: ``"above_zero"`` (``lax.select`` of the int32 sum, as JAX
    0.10 to 0.12 write it: a sum of -1 keeps the cotangent) or ``"not_zero"`` (``jnp.where``, as
    JAX 0.6 wrote it). A group of zero rows sets +1 and takes -1 at one row: where its offset meets
    another group's rows, that group's mark is cancelled (or its end taken twice), and the cotangent
    of rows a group wrote passes through, or of rows none wrote is zeroed."""
    n = axis_size
    d_x, _ = vjp_reference(x, output, input_offsets, send_sizes, output_offsets, recv_sizes, ct)
    cts = ct.reshape(n, -1, *ct.shape[1:])
    slots = cts.shape[1]
    ss, oo = (a.reshape(n, n).astype(np.int64) for a in (send_sizes, output_offsets))
    d_output = cts.copy()
    for j in range(n):
        mark = np.zeros(slots, np.int64)
        starts = oo[:, j]
        mark[starts[(starts >= 0) & (starts < slots)]] = 1
        for end in starts + ss[:, j]:
            if 0 <= end < slots:
                mark[end] -= 1
        running = np.cumsum(mark)
        d_output[j][running > 0 if zeroed == "above_zero" else running != 0] = 0
    return d_x, d_output.reshape(output.shape)


_JAX_TRANSPOSE = (
    "JAX's own transpose of lax.ragged_all_to_all (its mask of output's cotangent, a running sum of +1 "
    "set at each group's offset and -1 added at its end, which a group of zero rows cancels where its "
    "offset meets another group's rows; zeroed where the sum is {}: "
    "conformance.specs.ragged_all_to_all.jax_transpose_vjp)"
)

#: The gradients' mistakes the gradients check names.
VJP_KNOWN_MISTAKES = (
    KnownMistake(
        _JAX_TRANSPOSE.format("above 0, as JAX 0.10 to 0.12 write it"),
        functools.partial(jax_transpose_vjp, zeroed="above_zero"),
    ),
    KnownMistake(
        _JAX_TRANSPOSE.format("not 0, as JAX 0.6 wrote it"),
        functools.partial(jax_transpose_vjp, zeroed="not_zero"),
    ),
)


def _x_shape(d: Dims, n: int) -> tuple[int, int]:
    return (n * d["rows_per_shard"], d["cols"])


def _output_shape(d: Dims, n: int) -> tuple[int, int]:
    return (n * d["out_rows_per_shard"], d["cols"])


def rows_received(d: Dims, n: int) -> int:
    """The most rows one device receives from the others in the case's routing."""
    sizes = routing(d, n)[1]
    return int(max((sizes[:, j].sum() - sizes[j, j] for j in range(n)), default=0))


def _received_exactly(d: Dims, n: int, itemsize: int) -> int:
    return rows_received(d, n) * d["cols"] * itemsize


def _padded_groups_and_routing(d: Dims, n: int, itemsize: int) -> int:
    """A fixed-size buffer of ``min(R, S)`` rows from each of the n - 1 others, and the routing: each
    other device's four ``n``-int routing arrays (what a wrapper that gathers them receives)."""
    group = min(d["rows_per_shard"], d["out_rows_per_shard"])
    return (n - 1) * (group * d["cols"] * itemsize + 4 * n * ROUTING_ITEMSIZE)


#: Rows move by all-to-all (XLA's ragged one included) or collective-permutes; the routing's ints may
#: also be gathered (an all-gather, which XLA:TPU compiles as an all-reduce at these sizes), rows not.
COLLECTIVES = frozenset(
    {"all-to-all", "ragged-all-to-all", "collective-permute", "all-gather:s32", "all-reduce:s32"}
)

COLLECTIVES_TEXT = (
    "the family hands each device its own offsets and sizes, and each group goes to one peer: rows move "
    "by all-to-all, ragged-all-to-all or collective-permutes, and only the routing's int32s may be "
    "gathered (as JAX's Pallas ragged all-to-all gathers every device's offsets). A kernel that "
    "computes its own sizes and offsets from the experts' choices belongs in moe_dispatch (and "
    "moe_combine), whose routing it is given"
)


def _bad_inputs(n: int) -> tuple[BadInput, ...]:
    """Operand rows that do not divide by the ring, and an axis the mesh lacks."""
    routing_shape = (n * n,)
    rows_bad = 2 * n + 1
    divisibility = (
        BadInput(
            f"x of {rows_bad} rows, not divisible by the axis size {n}",
            ((rows_bad, 8), (n * 4, 8), *(routing_shape,) * 4),
            None,
            (str(rows_bad), str(n)),
        ),
    )
    unknown_axis = (
        BadInput(
            "axis_name 'nonexistent_axis' is not a mesh axis",
            ((n * 4, 8), (n * 4, 8), *(routing_shape,) * 4),
            "nonexistent_axis",
            ("nonexistent_axis",),
        ),
    )
    return (divisibility if n > 1 else ()) + unknown_axis


def _block_tags(
    shapes: tuple[tuple[int, ...], ...], n: int, sources: tuple[int, ...]
) -> tuple[np.ndarray, ...]:
    """``x`` zero but the rows of the ring positions ``sources`` (position ``s``'s carry ``s + 1``),
    ``output`` zero: each written row of the result names its sender, each untouched one is 0. (The
    routing operands are the case's own; the block map keeps them.)"""
    return (rows_tagged_by_position(shapes[0], n, sources), *(np.zeros(shape) for shape in shapes[1:]))


RAGGED_ALL_TO_ALL = FamilySpec(
    name="ragged_all_to_all",
    summary="x[n*R,cols], output[n*S,cols], offsets and sizes int32[n*n], all P(axis) -> output with "
    "each device's groups written where their senders put them, [n*S,cols] P(axis)",
    operands=(
        Operand("x", lambda a: P(a), _x_shape),
        Operand("output", lambda a: P(a), _output_shape),
        *(_routing_operand(k) for k in range(4)),
    ),
    out_spec=lambda a: P(a),
    out_shape=_output_shape,
    dims=("rows_per_shard", "out_rows_per_shard", "cols", "routing"),
    canonical_dims={"rows_per_shard": 7, "out_rows_per_shard": 9, "cols": 8, "routing": 0},
    dim_values={
        "rows_per_shard": (1, 3, 5, 8, 13),
        "out_rows_per_shard": (2, 5, 8, 16),
        "cols": (1, 8, 128),
        "routing": tuple(range(len(ROUTINGS))),
    },
    tpu_native_dims={"rows_per_shard": 32, "out_rows_per_shard": 64, "cols": 128, "routing": 0},
    # the dtypes the transfer families move bit-exact
    dtypes=("float32", "bfloat16", "float16", "int32", "int8", "float8_e4m3fn", "float8_e5m2"),
    reference=reference,
    tolerance=lambda *inputs_and_dtype: tolerances.data_movement_tolerance(inputs_and_dtype[1].shape),
    allowed_collectives=COLLECTIVES,
    collectives_text=COLLECTIVES_TEXT,
    max_received_bytes=_padded_groups_and_routing,
    min_received_bytes=_received_exactly,
    byte_bound_text="each device may receive at most a group's worth of rows, min(R, S), from each of the "
    "n-1 others, and their routing (four arrays of n int32s each, gathered or not)",
    bad_inputs=_bad_inputs,
    vjp_reference=vjp_reference,
    vjp_tolerance=lambda *inputs_ct_and_dtype: tuple(
        tolerances.data_movement_tolerance(a.shape) for a in inputs_ct_and_dtype[:2]
    ),
    backward_allowed_collectives=COLLECTIVES,
    backward_max_received_bytes=_padded_groups_and_routing,
    backward_byte_bound_text="the transposed exchange: at most a group's worth of cotangent rows, min(R, S), "
    "from each of the n-1 others, and their routing (four arrays of n int32s each, gathered or not)",
    backward_exact="each row's gradient is its cotangent row, sent back by the transposed exchange",
    block_tags=_block_tags,
    # a benchmark's device holds `rows` rows and as large an output, routed unevenly
    bench_dims=lambda rows: {"rows_per_shard": rows, "out_rows_per_shard": rows, "cols": 128, "routing": 0},
    block_unit="group",
    known_mistakes=KNOWN_MISTAKES,
    vjp_known_mistakes=VJP_KNOWN_MISTAKES,
)

#: This module's family (:mod:`conformance.specs` collects it).
SPEC = RAGGED_ALL_TO_ALL
