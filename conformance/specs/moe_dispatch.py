"""Family ``moe_dispatch``: each token goes to the devices of its top-k experts, as a mixture-of-experts
layer sends its tokens out before the experts' matmuls.

``fn(tokens, expert_ids, placement, *, mesh, axis_name)``, every operand sharded ``P(axis_name)`` along
its first dim:

* ``tokens[n*T, H]``: device ``i``'s ``T`` tokens;
* ``expert_ids[n*T, k]`` int32: each token's ``k`` distinct experts of ``E = n * X``, ``-1`` for a
  choice routed nowhere (:mod:`conformance.specs.moe_routing`);
* ``placement[n, X]`` int32: row ``d`` the ``X`` experts device ``d`` hosts;

and the result is the experts' rows, ``[n*C, H]`` sharded ``P(axis_name)``, ``C = n * T * min(k, X)``:
device ``d``'s experts' groups in placement order, each the rows of the tokens routed to that expert in
global token order, zero after the last group (the layout a grouped matmul takes; the routing module
says why it is this one). On a 2-D mesh the other axis is replicated.

It is ``lax.ragged_all_to_all`` with the sizes and offsets computed from the routing, and a permute on
either side: a token device sorts its (token, choice) rows by expert device, expert and token; the
exchange lands each sender's group after the groups of the senders before it; each expert device
permutes its rows from sender-major to expert-major order. A kernel that skips that last permute
returns the right rows in the wrong order (a known mistake the values check names); one that reads
its own receive offsets as its ``output_offsets`` puts groups in slots their receiver chose for
another sender (the ragged all-to-all family's marin bug).

Ground truth is the numpy transcription (:func:`reference`), bit-exact: rows are copied. Gradient: each
token's gradient is the sum of the cotangents of the ``k`` rows it became (a combine without weights),
rounded at each of ``k - 1`` additions at most. Bytes: the rows an expert device receives from the
others, exactly, is the least; a padded buffer of ``T * min(k, X)`` rows from each peer and the
routing is the most (:func:`conformance.specs.moe_routing.padded_exchange_bytes`); gathering every
token is within it (each token's ``k`` rows are at least one).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import numpy as np
from jax.sharding import PartitionSpec as P

from conformance import tolerances
from conformance.dtypes import operand_np
from conformance.specs import moe_forms, moe_routing
from conformance.specs.base import Dims, FamilySpec, KnownMistake, Operand, rows_tagged_by_position


def _tokens_shape(d: Dims, n: int) -> tuple[int, int]:
    return (n * d["tokens_per_shard"], d["hidden"])


def _rows_shape(d: Dims, n: int) -> tuple[int, int]:
    return (n * moe_routing.capacity(d, n), d["hidden"])


def reference(tokens: np.ndarray, expert_ids: np.ndarray, placement: np.ndarray) -> np.ndarray:
    """The experts' rows (module doc): each (token, choice) row at its slot, zero elsewhere."""
    n = placement.shape[0]
    out = np.zeros((n * moe_routing.rows_per_device(expert_ids, placement), tokens.shape[1]))
    for t, at in enumerate(moe_routing.slots(expert_ids, placement)):
        out[at[at != moe_routing.UNROUTED]] = tokens[t]
    return out


def _in_arrival_order(tokens: np.ndarray, expert_ids: np.ndarray, placement: np.ndarray, *, axis_size: int):
    """Each expert device's rows sender-major (by sender, then expert, then token): the exchange's
    order, without the permute to expert-major order."""
    n, t_per = axis_size, tokens.shape[0] // axis_size
    rows = moe_routing.rows_per_device(expert_ids, placement)
    at = moe_routing.slots(expert_ids, placement)
    out = np.zeros((n * rows, tokens.shape[1]))
    for d in range(n):
        mine = sorted((t // t_per, int(at[t, k]), t) for t, k in np.argwhere(at // rows == d))
        for i, (_, _, t) in enumerate(mine):
            out[d * rows + i] = tokens[t]
    return out


def _offsets_taken(start_of: Callable[[np.ndarray, int, int], int]) -> Callable[..., np.ndarray]:
    """The one-exchange dispatch (module doc) with sender ``i``'s group for device ``j`` written at
    ``start_of(sizes, i, j)`` (``sizes[sender, receiver]``) in place of the sum of what the senders
    before ``i`` send ``j``, the senders' groups written in sender order (a later one over an earlier
    where they overlap), then permuted to expert-major order as though each had landed where it
    should."""

    def result(tokens, expert_ids, placement, *, axis_size: int) -> np.ndarray:
        n, t_per = axis_size, tokens.shape[0] // axis_size
        rows = moe_routing.rows_per_device(expert_ids, placement)
        at = moe_routing.slots(expert_ids, placement)
        where = placement.astype(np.int64)
        local = np.zeros(where.size, dtype=np.int64)
        local[where.reshape(-1)] = np.arange(where.size) % where.shape[1]
        # each routed (token, choice): (receiver, sender, local expert, token, its expert-major slot), in
        # the order of arrival at each receiver
        routed = sorted(
            (int(at[t, j]) // rows, t // t_per, int(local[int(expert_ids[t, j])]), t, int(at[t, j]) % rows)
            for t, j in zip(*np.nonzero(at != moe_routing.UNROUTED), strict=True)
        )
        sizes = np.zeros((n, n), dtype=np.int64)
        for receiver, sender, *_ in routed:
            sizes[sender, receiver] += 1
        landed = np.zeros((n, rows, tokens.shape[1]))
        for sender in range(n):
            for receiver in range(n):
                group = [r[3] for r in routed if r[0] == receiver and r[1] == sender]
                start = start_of(sizes, sender, receiver)
                for i, t in enumerate(group[: max(rows - start, 0)]):
                    landed[receiver, start + i] = tokens[t]
        out = np.zeros((n * rows, tokens.shape[1]))
        for receiver in range(n):
            for arrival, (*_, slot) in enumerate(r for r in routed if r[0] == receiver):
                out[receiver * rows + slot] = landed[receiver, arrival]
        return out

    return result


KNOWN_MISTAKES = (
    KnownMistake(
        "leaving each expert device's rows in the order the exchange delivers them (by sender, then "
        "expert): permute them to expert-major order, each expert's rows contiguous in global token order",
        _in_arrival_order,
    ),
    KnownMistake(
        "giving the exchange each sender's own receive offsets as its output_offsets (the receiver's view; "
        "a sender's output_offsets[j] is where its group lands on device j, the sum of what the senders "
        "before it send j: gather the counts and sum them over the senders, as marin's 'Fix ragged "
        "all-to-all sender offsets' did)",
        _offsets_taken(lambda sizes, i, j: int(sizes[:j, i].sum())),
    ),
    KnownMistake(
        "giving the exchange each sender's own input_offsets as its output_offsets (a cumulative sum over "
        "the receivers it sends to, where output_offsets[j] sums over the senders before it what each "
        "sends j: the cumsum over the other axis of the gathered counts)",
        _offsets_taken(lambda sizes, i, j: int(sizes[i, :j].sum())),
    ),
)


def rows_missing(
    tokens, expert_ids, placement, got, tol, *, axis_size: int, dtype: str = "float32", rerun=None
) -> list[str]:
    """Each expert whose group lacks rows of its tokens, and whether every such expert kept the first of
    its rows in token order, as a capacity drops them; each device holding more copies of a token's row
    than its experts are routed; ``[]`` where no row is missing or extra. Each device's rows are read
    as the tokens they copy (bit for bit: rows are copied) and aligned with the rows the reference puts
    there, in order (a longest common subsequence), so that a group shifted by the rows missing before
    it, or holding another token's row in place of its own, is read as what it lacks; a token is short
    (or over) only by the copies of its row the device lacks (or holds beyond its own), so rows out of
    order are neither. Where the case's token rows are not each distinct and nonzero (one int8 column),
    the kernel is run again (``rerun``) on tokens tagged ``t + 1``, where its dtype holds every tag
    exactly; else nothing is said."""
    if not _distinct(tokens):
        tags = np.repeat(np.arange(1.0, tokens.shape[0] + 1)[:, None], tokens.shape[1], axis=1)
        if rerun is None or not np.array_equal(tags.astype(operand_np(dtype)).astype(np.float64), tags):
            return []
        tokens, got = tags, rerun(tokens=tags)
    rows = moe_routing.rows_per_device(expert_ids, placement)
    t_per = tokens.shape[0] // axis_size
    short: list[tuple[int, int, list[int], list[int]]] = []
    over: list[tuple[int, list[int], int]] = []
    for d, hosted in enumerate(placement.astype(np.int64)):
        expected = []  # (expert, token) of each of device d's rows, in the reference's order
        for e in hosted:
            expected += [(int(e), int(t)) for t in np.unique(np.nonzero(expert_ids == e)[0])]
        copies = [
            set(np.nonzero((tokens == row).all(axis=1))[0].tolist()) for row in got[d * rows : (d + 1) * rows]
        ]
        pairs = _aligned([t for _, t in expected], copies)
        balance = Counter(t for _, t in expected)  # > 0: copies lacking; < 0: copies beyond its own
        balance.subtract(t for held in copies for t in held)
        found = {i for i, _ in pairs}
        unmatched = [i for i in range(len(expected)) if i not in found]
        missing: set[int] = set()
        for t in {expected[i][1] for i in unmatched}:
            missing |= set([i for i in unmatched if expected[i][1] == t][: max(balance[t], 0)])
        for e in hosted:
            routed = [t for (x, t) in expected if x == e]
            lost = [t for i, (x, t) in enumerate(expected) if x == e and i in missing]
            if lost:
                short.append((int(e), d, routed, lost))
        beyond = sorted(t for t in balance if balance[t] < 0)
        if beyond:
            over.append((d, beyond, -sum(balance[t] for t in beyond)))
    lines = []
    if short:
        said = [
            f"expert {e} (on device {d}) received {len(routed) - len(lost)} of {len(routed)} rows, "
            f"missing token{'s' if len(lost) > 1 else ''} {moe_routing.spans(lost)}"
            for e, d, routed, lost in short
        ]
        listed = "; ".join(said[:4]) + (f"; and {len(said) - 4} more experts" if len(said) > 4 else "")
        kept = moe_routing.kept_first([(routed, lost) for _, _, routed, lost in short], t_per)
        if kept is None or over:
            lines.append(f"rows missing   : {listed}")
        else:
            lines += [
                f"rows missing   : every short expert kept its first rows in token order {kept} and lost the "
                f"rest, as dropping past an expert capacity does: {listed}",
                "               : a kernel that drops declares its rule, conformance.register(..., capacity="
                "conformance.ExpertCapacity(factor, group=, order=)), and the reference drops the same rows",
            ]
    if over:
        said = [
            f"device {d} holds {count} row{'s' if count > 1 else ''} of token{'s' if len(ts) > 1 else ''} "
            f"{moe_routing.spans(ts)} beyond the copies routed to its experts"
            for d, ts, count in over
        ]
        lines.append(
            f"rows extra     : {'; '.join(said[:4])}"
            + (f"; and {len(said) - 4} more devices" if len(said) > 4 else "")
        )
    return lines


def _distinct(tokens: np.ndarray) -> bool:
    """Whether every token's row differs from every other's and from a zero row."""
    rows = {row.tobytes() for row in np.ascontiguousarray(tokens)}
    return len(rows) == tokens.shape[0] and np.zeros(tokens.shape[1]).tobytes() not in rows


def _aligned(expected: list[int], copies: list[set[int]]) -> list[tuple[int, int]]:
    """The positions (of ``expected``, a token a row; of the rows ``copies``, the tokens each row is a
    copy of) matched in a longest common subsequence of the two."""
    m, k = len(expected), len(copies)
    best = np.zeros((m + 1, k + 1), dtype=np.int64)
    for i in range(m - 1, -1, -1):
        for j in range(k - 1, -1, -1):
            if expected[i] in copies[j]:
                best[i, j] = best[i + 1, j + 1] + 1
            else:
                best[i, j] = max(best[i + 1, j], best[i, j + 1])
    matched, i, j = [], 0, 0
    while i < m and j < k:
        if expected[i] in copies[j]:
            matched.append((i, j))
            i, j = i + 1, j + 1
        elif best[i + 1, j] >= best[i, j + 1]:
            i += 1
        else:
            j += 1
    return matched


def vjp_reference(tokens, expert_ids, placement, ct):
    """Each token's gradient: the sum of the cotangents of the rows it became."""
    at = moe_routing.slots(expert_ids, placement)
    return (moe_routing.at_slots(ct, at).sum(axis=1),)


def vjp_tolerance(tokens, expert_ids, placement, ct, dtype):
    """A rounding per addition of a token's ``k`` cotangent rows."""
    at = moe_routing.slots(expert_ids, placement)
    return (tolerances.reduction_tolerance(np.moveaxis(moe_routing.at_slots(ct, at), 1, 0), dtype),)


def _bad_inputs(n: int):
    return moe_routing.bad_inputs("tokens", n, shapes=lambda rows: ((rows, 8), (rows, 1), (n, 1)))


def _block_tags(shapes, n: int, sources: tuple[int, ...]) -> tuple[np.ndarray, ...]:
    """``tokens`` zero but the rows of the ring positions ``sources`` (position ``s``'s carry ``s + 1``):
    each row of the result names the device its token came from, each padding row is 0. (The routing
    operands are the case's own; the block map keeps them.)"""
    return (rows_tagged_by_position(shapes[0], n, sources), *(np.zeros(shape) for shape in shapes[1:]))


MOE_DISPATCH = FamilySpec(
    name="moe_dispatch",
    summary="tokens[n*T,H], expert_ids[n*T,k], placement[n,X], all P(axis) -> each device's experts' rows, "
    "expert-major in token order, zero after, [n*C,H] P(axis), C = n*T*min(k,X)",
    operands=(
        Operand("tokens", lambda a: P(a), _tokens_shape),
        moe_routing.EXPERT_IDS,
        moe_routing.PLACEMENT,
    ),
    out_spec=lambda a: P(a),
    out_shape=_rows_shape,
    dims=moe_routing.DIMS,
    canonical_dims=moe_routing.CANONICAL_DIMS,
    dim_values=moe_routing.DIM_VALUES,
    tpu_native_dims=moe_routing.TPU_NATIVE_DIMS,
    # the dtypes the transfer families move bit-exact
    dtypes=("float32", "bfloat16", "float16", "int32", "int8", "float8_e4m3fn", "float8_e5m2"),
    reference=reference,
    tolerance=lambda tokens, expert_ids, placement, dtype: tolerances.data_movement_tolerance(
        reference(tokens, expert_ids, placement).shape
    ),
    allowed_collectives=moe_routing.COLLECTIVES,
    max_received_bytes=moe_routing.padded_exchange_bytes,
    min_received_bytes=lambda d, n, itemsize: (
        moe_routing.most_received(d, n, back=False) * d["hidden"] * itemsize
    ),
    byte_bound_text=moe_routing.PADDED_EXCHANGE_TEXT,
    bad_inputs=_bad_inputs,
    vjp_reference=vjp_reference,
    vjp_tolerance=vjp_tolerance,
    # a gather's transpose is a reduce-scatter
    backward_allowed_collectives=moe_routing.COLLECTIVES | {"reduce-scatter"},
    backward_max_received_bytes=moe_routing.padded_exchange_bytes,
    backward_byte_bound_text="the rows' cotangents back to their tokens: " + moe_routing.PADDED_EXCHANGE_TEXT,
    block_tags=_block_tags,
    block_unit="group",
    known_mistakes=KNOWN_MISTAKES,
    explain_wrong=rows_missing,
    bench_dims=moe_routing.bench_dims,
    registration_options={
        # the alignment first: a capacity's routing is then the one the aligned layout is laid out by
        "group_alignment": moe_forms.alignment_option(rows_operand=None),
        "capacity": moe_forms.capacity_option(
            least_received=lambda ids, where: moe_routing.most_received_of(ids, where, back=False)
        ),
        # last, so that the forms before it meet each replica as an expert of its own
        "replicas": moe_forms.replicas_option(
            least_received=lambda ids, where: moe_routing.most_received_of(ids, where, back=False)
        ),
    },
)

#: This module's family (:mod:`conformance.specs` collects it).
SPEC = MOE_DISPATCH
