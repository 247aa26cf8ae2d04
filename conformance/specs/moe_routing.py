"""What the two mixture-of-experts families share (:mod:`~conformance.specs.moe_dispatch`,
:mod:`~conformance.specs.moe_combine`): the routing, the expert placement, the layout of the experts'
rows and the byte bounds of moving them.

**Routing.** Each of the ``n * T`` tokens (``T`` per device, the ``tokens_per_shard`` dim) picks its
top ``k`` experts of ``E = n * X`` (``X`` the ``experts_per_device`` dim; ``k`` the ``top_k`` dim, at most
``E``): ``expert_ids[n*T, k]`` int32, sharded ``P(axis)`` as the tokens are, row ``t`` the distinct
experts token ``t`` goes to, in the router's order (the order its weights come in, not sorted); on
one routing (:data:`UNROUTED_CHOICES`) some of them :data:`UNROUTED` (``-1``): that choice goes to no
expert, its row is sent nowhere and takes no slot, and a combine adds nothing for it.

**Placement.** ``placement[n, X]`` int32, sharded ``P(axis)``: row ``d`` (device ``d``'s shard) lists the
``X`` experts device ``d`` hosts, in the order its rows group them. The suite passes ``arange(E)``
(expert ``e`` on device ``e // X``, the contiguous layout of an expert-parallel mesh), and on one
routing (:data:`SHUFFLED_PLACEMENT`) a permutation of it, as a load balancer that moves hot experts
builds; a kernel may read its shard for its own experts, and must not assume more than the operand
says (a device that computes an expert's device as ``e // X`` sends rows to the wrong device there).
Its shape tells a kernel (and the reference) ``n`` and ``X``, as an expert-weight operand would.

**The experts' rows** (what a dispatch returns and a combine takes): device ``d`` holds ``C = n * T *
min(k, X)`` rows of ``[C, H]`` (the most a device can receive: every token sending it all the rows it
can, no token dropped), grouped by its experts in placement order; expert ``e``'s group holds the row of
every token routed to ``e``, in global token order (device ``i``'s tokens before device ``i + 1``'s);
the rows after the last group are zero. This is what a grouped matmul takes (each expert's rows
contiguous, their count the expert's group size), and what one ``lax.ragged_all_to_all`` and a local
permute give: a token device sorts its rows by destination device, expert and token, the exchange
lands sender ``i``'s group on device ``d`` after those of senders ``0 .. i-1`` (``output_offsets`` from
the gathered counts, as the sender sees them), and device ``d`` permutes its rows from sender-major to
expert-major order (docs/families.md).

**Capacity.** A kernel that drops tokens past an expert capacity declares its rule
(:class:`ExpertCapacity`, the registration option ``capacity`` of both families): the reference then
drops the same (token, choice) rows, each then as a choice routed nowhere, and the experts' rows are
the kept rows in the layout above. A kernel that drops without declaring it fails the values check,
which names each expert's missing rows.

**Routings** (the ``routing`` dim): kinds of traffic MoE kernels break on, laid out from the dims by a
fixed generator (:func:`expert_ids`), so that a case's token pins them.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
from jax.sharding import PartitionSpec as P

from conformance.specs.base import (
    BadInput,
    Dims,
    Operand,
)

#: The kinds of routing the ``routing`` dim names, by value (0, 1, ...).
ROUTINGS = (
    "each token's top-k experts drawn at random",
    "heavy imbalance: every token's first choice is expert 0 (device 0 receives a row of every token), "
    "its others drawn by a Zipf law over the expert ids (weight 1/id: the first devices' experts get "
    "most rows, the last ones few or none)",
    "no token picks device 0's experts (where the others can fill a top-k)",
    "each device's tokens pick the next device's experts first (all its rows to one peer)",
    "each token's top-k experts drawn at random, the experts placed in a shuffled order (a load "
    "balancer's placement: not arange, so that some expert e is not on device e // X or not in its "
    "place there)",
    "some choices unrouted (expert id -1, as a router that masks a choice or drops it past a capacity "
    "writes it), at any position of a token's row, some tokens with none routed",
    "the hottest experts replicated on a second device (a placement with repeated expert ids, as an "
    "expert-parallel load balancer builds; drawn only for a kernel that declares which replica a token "
    "goes to, ExpertReplicas), each token's first choice one of them, its others drawn at random",
)

#: The expert id of a choice that goes nowhere: its row is sent to no device, and a combine adds
#: nothing for it (its weight is unused).
UNROUTED = -1

#: The routing of heavy imbalance: one expert gets a row of every token, a few others most of the
#: rest (a router early in training, or a hot topic), the last experts few rows or none.
HEAVY_IMBALANCE = 1

#: The routing whose choices are partly :data:`UNROUTED`.
UNROUTED_CHOICES = 5

#: The routing whose placement is shuffled (:func:`placement`); every other routing's is contiguous.
SHUFFLED_PLACEMENT = 4

#: The routing whose placement hosts its hottest experts twice (:func:`placement`, :class:`ExpertReplicas`):
#: drawn only for a kernel that declares a replica rule.
REPLICATED_EXPERTS = 6

#: Expert ids and placement: one int32 each.
ROUTING_ITEMSIZE = 4


def top_k(d: Dims, n: int) -> int:
    """``k``: the ``top_k`` dim, at most the ``E = n * X`` experts there are."""
    return min(d["top_k"], n * d["experts_per_device"])


def capacity(d: Dims, n: int) -> int:
    """``C``: the most rows one device can receive, ``n * T * min(k, X)``."""
    return n * d["tokens_per_shard"] * min(top_k(d, n), d["experts_per_device"])


def replicated(d: Dims, n: int) -> int:
    """``R``: how many experts the routing :data:`REPLICATED_EXPERTS` hosts twice (experts ``0 .. R-1``,
    the hottest), a quarter of the ``n * X`` slots, at least one, leaving at least ``k`` experts; 0 on
    any other routing, on a ring of one and where no expert can be spared."""
    slots = n * d["experts_per_device"]
    if d["routing"] != REPLICATED_EXPERTS or n < 2:
        return 0
    return max(0, min(max(1, slots // 4), slots - top_k(d, n)))


def expert_ids(d: Dims, n: int) -> np.ndarray:
    """``[n*T, k]``: each token's distinct experts, in the router's order, for the dims' ``routing``
    (:data:`ROUTINGS`), from a generator seeded by the dims alone."""
    kind, t_per, x = d["routing"], d["tokens_per_shard"], d["experts_per_device"]
    if not 0 <= kind < len(ROUTINGS):
        raise ValueError(f"routing={kind} is not one of 0..{len(ROUTINGS) - 1} ({'; '.join(ROUTINGS)})")
    hot = replicated(d, n)
    k, e = top_k(d, n), n * x - hot
    rng = np.random.default_rng([kind, n, t_per, x, k, d["hidden"]])
    ids = np.zeros((n * t_per, k), dtype=np.int64)
    for t in range(n * t_per):
        first: list[int] = []
        if kind == HEAVY_IMBALANCE:
            first = [0]
            if k > 1:  # the other choices: a Zipf law over ids 1..E-1, drawn without replacement
                weights = 1.0 / np.arange(1, e)
                others = rng.choice(np.arange(1, e), k - 1, replace=False, p=weights / weights.sum())
                first += [int(c) for c in others]
        elif kind == 2 and e - x >= k:
            first = list(x + rng.permutation(e - x)[:k])
        elif kind == 3:
            peer = (t // t_per + 1) % n
            first = list(peer * x + rng.permutation(x)[: min(k, x)])
        elif hot:  # a replicated expert first, in turn
            first = [t % hot]
        rest = [int(c) for c in rng.permutation(e) if c not in first]
        ids[t] = (first + rest)[:k]
    if kind == UNROUTED_CHOICES:
        dropped = rng.random(ids.shape) < 0.4
        dropped[0] = True  # a token with no choice routed, on every mesh
        if ids.shape[0] > 1:
            dropped[1] = False  # and one with every choice routed
        ids[dropped] = UNROUTED
    return ids


def placement(d: Dims, n: int) -> np.ndarray:
    """``[n, X]``: the experts each device hosts: contiguous; on the routing :data:`SHUFFLED_PLACEMENT` a
    permutation of the ``E`` experts from a generator seeded by the dims (never ``arange`` where there
    are two experts or more, so that no case of it is contiguous); on :data:`REPLICATED_EXPERTS` the
    ``n * X - R`` experts in order, then experts ``0 .. R-1`` again (:func:`replicated`), each of those on
    two devices (its first slot is on device ``e // X``, its second past every expert's first)."""
    e = n * d["experts_per_device"]
    hot = replicated(d, n)
    if hot:  # every expert once, device-major, then experts 0 .. R-1 again in the last slots
        return np.concatenate([np.arange(e - hot), np.arange(hot)]).reshape(n, -1)
    if d["routing"] != SHUFFLED_PLACEMENT or e < 2:
        return np.arange(e).reshape(n, -1)
    rng = np.random.default_rng([SHUFFLED_PLACEMENT, n, d["tokens_per_shard"], d["experts_per_device"]])
    order = rng.permutation(e)
    while (order == np.arange(e)).all():
        order = rng.permutation(e)
    return order.reshape(n, -1)


def rows_per_device(ids: np.ndarray, where: np.ndarray) -> int:
    """``C`` of ``ids[n*T, k]`` and ``where[n, X]`` (the placement)."""
    _n, x = where.shape
    return ids.shape[0] * min(ids.shape[1], x)


def slots(ids: np.ndarray, where: np.ndarray) -> np.ndarray:
    """``[n*T, k]``: the row of the experts' rows (global, device ``d``'s from ``d * C``) at which each
    (token, choice) lands, for ``ids`` and ``where`` (the placement), float64 or int;
    :data:`UNROUTED` for a choice that lands nowhere."""
    ids, where = ids.astype(np.int64), where.astype(np.int64)
    rows = rows_per_device(ids, where)
    out = np.full(ids.shape, UNROUTED, dtype=np.int64)
    for d, hosted in enumerate(where):
        at = 0
        for e in hosted:
            for t, k in zip(*np.nonzero(ids == e), strict=True):  # nonzero's order: token order
                out[t, k] = d * rows + at
                at += 1
    return out


def at_slots(rows: np.ndarray, at: np.ndarray) -> np.ndarray:
    """``rows[at]`` (``at`` from :func:`slots`), zero where a choice is :data:`UNROUTED`."""
    routed = at != UNROUTED
    return np.where(routed.reshape(*at.shape, *(1,) * (rows.ndim - 1)), rows[np.where(routed, at, 0)], 0)


def owners(where: np.ndarray) -> np.ndarray:
    """``[E]``: the device hosting each expert, for the placement ``where[n, X]``."""
    owner = np.zeros(where.size, dtype=np.int64)
    owner[where.astype(np.int64).reshape(-1)] = np.arange(where.size) // where.shape[1]
    return owner


def rows_moved(ids: np.ndarray, where: np.ndarray) -> np.ndarray:
    """``[n senders, n receivers]``: how many (token, choice) rows each token device sends each expert
    device."""
    n, t_per, owner = where.shape[0], ids.shape[0] // where.shape[0], owners(where)
    moved = np.zeros((n, n), dtype=np.int64)
    for t, row in enumerate(ids.astype(np.int64)):
        for e in row[row != UNROUTED]:
            moved[t // t_per, owner[e]] += 1
    return moved


def most_received(d: Dims, n: int, *, back: bool) -> int:
    """The most rows one device receives from the others: an expert device's (``back``: a token
    device's, the rows coming back)."""
    return most_received_of(expert_ids(d, n), placement(d, n), back=back)


def most_received_of(ids: np.ndarray, where: np.ndarray, *, back: bool) -> int:
    """:func:`most_received` of the routing ``ids`` and placement ``where``."""
    moved = rows_moved(ids, where)
    np.fill_diagonal(moved, 0)
    return int((moved.sum(1) if back else moved.sum(0)).max(initial=0))


def padded_exchange_bytes(d: Dims, n: int, itemsize: int) -> int:
    """The cap on either trip: from each of the n - 1 others, a padded buffer of as many rows as one
    device can send another (``T * min(k, X)``), and the routing: an int per row and per expert, twice
    over (XLA:TPU compiles a gather of a few ints as an all-reduce, which moves them twice; a table of
    counts per device and expert, gathered, is ``n X`` ints from each peer)."""
    k, x, t_per = top_k(d, n), d["experts_per_device"], d["tokens_per_shard"]
    rows = t_per * min(k, x)
    return (n - 1) * (rows * d["hidden"] * itemsize + 2 * (t_per * k + (n + 1) * x) * ROUTING_ITEMSIZE)


#: What either trip may move by: rows by all-to-all (XLA's ragged one included) or collective-permutes,
#: all of them by all-gather (each token to each device), and the routing's few ints by an all-gather
#: (which XLA:TPU compiles as an all-reduce at these sizes).
COLLECTIVES = frozenset({"all-to-all", "ragged-all-to-all", "collective-permute", "all-gather", "all-reduce"})

PADDED_EXCHANGE_TEXT = (
    "each device may receive at most a padded buffer of T * min(k, X) rows from each of the n-1 others "
    "(as many as one device can send another) and the routing: an int per row and per expert, twice over"
)

#: The routing operands, as both families take them (the case lays them out from its dims).
EXPERT_IDS = Operand(
    "expert_ids",
    lambda a: P(a),
    lambda d, n: (n * d["tokens_per_shard"], top_k(d, n)),
    dtype="int32",
    values=expert_ids,
)
PLACEMENT = Operand(
    "placement", lambda a: P(a), lambda d, n: (n, d["experts_per_device"]), dtype="int32", values=placement
)

DIMS = ("tokens_per_shard", "experts_per_device", "top_k", "hidden", "routing")
CANONICAL_DIMS = {"tokens_per_shard": 3, "experts_per_device": 2, "top_k": 2, "hidden": 8, "routing": 0}
DIM_VALUES = {
    "tokens_per_shard": (1, 2, 3, 5, 8),
    "experts_per_device": (1, 2, 3),
    "top_k": (1, 2, 4),
    "hidden": (1, 8, 128),
    # the replicated placement only for a kernel that declares its replica rule (ExpertReplicas)
    "routing": tuple(kind for kind in range(len(ROUTINGS)) if kind != REPLICATED_EXPERTS),
}
TPU_NATIVE_DIMS = {"tokens_per_shard": 32, "experts_per_device": 2, "top_k": 2, "hidden": 128, "routing": 0}


def bench_dims(rows: int) -> dict[str, int]:
    """A benchmark's device holds ``rows`` tokens of 128 lanes, each routed to 2 of 2 experts a device."""
    return {"tokens_per_shard": rows, "experts_per_device": 2, "top_k": 2, "hidden": 128, "routing": 0}


def bad_inputs(first: str, n: int, *, shapes) -> tuple[BadInput, ...]:
    """Rows of ``first`` (the operand the rows are counted in) that do not divide by the ring, and an
    axis the mesh lacks; ``shapes(rows)`` the operands' shapes with ``rows`` rows."""
    rows_bad = 2 * n + 1
    divisibility = (
        BadInput(
            f"{first} of {rows_bad} rows, not divisible by the axis size {n}",
            shapes(rows_bad),
            None,
            (str(rows_bad), str(n)),
        ),
    )
    unknown_axis = (
        BadInput(
            "axis_name 'nonexistent_axis' is not a mesh axis",
            shapes(2 * n),
            "nonexistent_axis",
            ("nonexistent_axis",),
        ),
    )
    return (divisibility if n > 1 else ()) + unknown_axis


def kept_first(experts: list[tuple[list[int], list[int]]], t_per: int) -> str | None:
    """How each expert's rows kept are the first of its rows (``routed``, ``lost``) in token order:
    ``"overall"``, ``"within each sender's tokens"``; ``None`` where they are not."""

    def first(kept: list[int], lost: list[int]) -> bool:
        """A capacity keeps at least one row of a group that routes any (its room is at least 1)."""
        return not lost or (bool(kept) and max(kept) < min(lost))

    def split(tokens: list[int], s: int) -> list[int]:
        return [t for t in tokens if t // t_per == s]

    kept = [([t for t in routed if t not in lost], lost) for routed, lost in experts]
    if all(first(k, lost) for k, lost in kept):
        return "(overall)"
    if all(first(split(k, s), split(lost, s)) for k, lost in kept for s in {t // t_per for t in k + lost}):
        return "(within each sender's tokens)"
    return None


def spans(tokens: list[int]) -> str:
    """``[0, 1, 2, 5]`` as ``0-2, 5``."""
    spans: list[list[int]] = []
    for t in tokens:
        if spans and t == spans[-1][1] + 1:
            spans[-1][1] = t
        else:
            spans.append([t, t])
    return ", ".join(f"{a}-{b}" if b > a else f"{a}" for a, b in spans)


#: :attr:`ExpertCapacity.group`'s values: whose tokens compete for an expert's room.
CAPACITY_GROUPS = ("device", "all")
#: :attr:`ExpertCapacity.order`'s values: which of them an expert keeps.
CAPACITY_ORDERS = ("token", "choice")


@dataclasses.dataclass(frozen=True)
class ExpertCapacity:
    """A MoE kernel's capacity rule, declared with ``conformance.register(..., capacity=...)`` in both MoE
    families: each expert keeps at most :meth:`rows` of the (token, choice) rows a group of tokens routes
    to it, and drops the rest, as MaxText and GShard drop past an expert capacity. A dropped choice is as
    one routed nowhere (:data:`UNROUTED`): its row takes no slot, and a combine adds nothing for it.

    ``factor``: the capacity factor; a group of ``G`` tokens gives each of the ``E`` experts room for
    ``ceil(factor * G * k / E)`` rows (:meth:`rows`, which a kernel calls to size its buffers, so that it
    and the reference agree on the rounding).
    ``group``: whose tokens compete for that room: ``"device"``, each device's ``T`` tokens (the rule
    applied on each token device's own routing before the exchange, as an expert-parallel layer drops
    within its batch); ``"all"``, all ``n * T`` tokens in global order (a rule applied where every
    token's routing is known, as an all-gather form can).
    ``order``: which rows an expert keeps: ``"token"``, the first in token order (MaxText's cumulative
    count over a group's tokens and their choices); ``"choice"``, every token's first choice before any
    token's second (GShard's priority: a token's top choice is dropped last).
    """

    factor: float
    group: str = "device"
    order: str = "token"

    def __post_init__(self) -> None:
        if type(self.factor) not in (int, float) or not math.isfinite(self.factor) or self.factor <= 0:
            raise ValueError(f"ExpertCapacity: factor must be a positive number, got {self.factor!r}")
        if self.group not in CAPACITY_GROUPS:
            raise ValueError(f"ExpertCapacity: group must be one of {CAPACITY_GROUPS}, got {self.group!r}")
        if self.order not in CAPACITY_ORDERS:
            raise ValueError(f"ExpertCapacity: order must be one of {CAPACITY_ORDERS}, got {self.order!r}")

    def rows(self, tokens: int, top_k: int, experts: int) -> int:
        """The room of one expert in a group of ``tokens`` tokens routing ``top_k`` choices each over
        ``experts`` experts: ``ceil(factor * tokens * top_k / experts)``."""
        return math.ceil(self.factor * tokens * top_k / experts)

    def describe(self) -> str:
        whose = "each device's T tokens" if self.group == "device" else "all n*T tokens"
        which = "in token order" if self.order == "token" else "first choices before second ones"
        return (
            f"capacity factor {self.factor:g} over {whose}, ceil(factor*G*k/E) rows an expert, kept {which}"
        )


def capped(ids: np.ndarray, where: np.ndarray, capacity: ExpertCapacity) -> np.ndarray:
    """``ids[n*T, k]`` with the choices ``capacity`` drops set to :data:`UNROUTED`, for the placement
    ``where[n, X]`` (its size is ``E``)."""
    n, (total, k) = where.shape[0], ids.shape
    group = total // n if capacity.group == "device" else total
    room = capacity.rows(group, k, where.size)
    out = ids.copy()
    for first in range(0, total, max(group, 1)):
        tokens = range(first, first + group)
        if capacity.order == "token":
            pairs = [(t, j) for t in tokens for j in range(k)]
        else:
            pairs = [(t, j) for j in range(k) for t in tokens]
        taken: dict[int, int] = {}
        for t, j in pairs:
            expert = int(ids[t, j])
            if expert == UNROUTED:
                continue
            taken[expert] = taken.get(expert, 0) + 1
            if taken[expert] > room:
                out[t, j] = UNROUTED
    return out


#: :attr:`ExpertReplicas.rule`'s values: which of an expert's replicas a (token, choice) row goes to.
REPLICA_RULES = ("sender", "token")


@dataclasses.dataclass(frozen=True)
class ExpertReplicas:
    """A MoE kernel's rule for an expert hosted on several devices, declared with
    ``conformance.register(..., replicas=...)`` in the three MoE families: the placement may then name
    an expert more than once (the routing :data:`REPLICATED_EXPERTS`, as an expert-parallel load
    balancer replicates its hot experts), and each (token, choice) row routed to it goes to one of its
    replicas, its ``r`` slots in placement order (device-major):

    ``rule="sender"``: replica ``s % r`` for a token of device ``s`` (each device's rows to one replica,
    a static balance by rank); ``rule="token"``: replica ``t % r`` for global token ``t`` (round robin over
    the tokens). Each replica is an expert of its own in every other respect: its group of rows on its
    device, in token order, and (a layer's) its own slot of the weights. A kernel that declares no rule
    is never given a replicated placement.
    """

    rule: str = "sender"

    def __post_init__(self) -> None:
        if self.rule not in REPLICA_RULES:
            raise ValueError(f"ExpertReplicas: rule must be one of {REPLICA_RULES}, got {self.rule!r}")

    def describe(self) -> str:
        whose = "device s's tokens to replica s % r" if self.rule == "sender" else "token t to replica t % r"
        return f"an expert hosted r times takes {whose} (its slots in placement order)"


#: The replica a row goes to where a kernel ignores its rule (:func:`physical`'s other ``rule`` values: a
#: placement inverted by a scatter keeps one slot an expert, the same for every sender).
ONE_REPLICA_RULES = ("first", "last")


def physical(ids: np.ndarray, where: np.ndarray, rule: str) -> tuple[np.ndarray, np.ndarray]:
    """``(ids, where)`` of a placement that names an expert more than once, as every expert hosted once:
    each (token, choice) row's expert id the slot ``rule`` picks (:attr:`ExpertReplicas.rule`, or one
    of :data:`ONE_REPLICA_RULES`) of its expert's slots (flat positions in ``where``), the placement
    ``arange``. A placement of distinct experts is returned as it is."""
    flat = np.asarray(where).astype(np.int64).reshape(-1)
    if np.unique(flat).size == flat.size:
        return ids, where
    n, t_per = where.shape[0], ids.shape[0] // where.shape[0]
    slots_of = {int(e): np.nonzero(flat == e)[0] for e in np.unique(flat)}
    pick = {
        "sender": lambda t, r: (t // t_per) % r,
        "token": lambda t, r: t % r,
        "first": lambda t, r: 0,
        "last": lambda t, r: r - 1,
    }[rule]
    out = np.full(ids.shape, UNROUTED, dtype=np.int64)
    for (t, j), e in np.ndenumerate(np.asarray(ids).astype(np.int64)):
        if e == UNROUTED:
            continue
        if e not in slots_of:
            raise ValueError(f"expert {e} of token {t} is hosted nowhere in the placement {flat.tolist()}")
        hosts = slots_of[e]
        out[t, j] = hosts[pick(t, hosts.size)]
    return out.astype(np.asarray(ids).dtype), np.arange(flat.size).reshape(n, -1).astype(
        np.asarray(where).dtype
    )
