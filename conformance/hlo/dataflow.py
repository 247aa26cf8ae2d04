"""Overlap from dataflow: which transfers a matmul independent of them can hide, and in a
scheduled module which asynchronous pairs bracket one."""

from __future__ import annotations

import dataclasses
import re
from collections import defaultdict
from collections.abc import Callable, Iterable

from conformance.hlo.compiled import HloModule, Instruction, _split_phase, collectives_of
from conformance.hlo.model import COLLECTIVE_KINDS, CollectiveOp, _unknown

MATMUL_OPCODES = frozenset({"dot", "convolution", "ragged-dot", "scaled-dot"})
#: Custom-call targets that are a matmul (cuBLAS/cuBLASLt, oneDNN, XNNPACK and the like).
_MATMUL_TARGET = re.compile(r"gemm|matmul|\bdot\b", re.I)
#: Custom-call targets of kernels whose inside HLO cannot see (Pallas on TPU or GPU, Triton, a host
#: callback that runs one): they may hold a matmul, so they count as compute, never as idle.
_KERNEL_TARGET = re.compile(r"tpu_custom_call|mosaic|triton|__gpu\$xla\.gpu\.triton|callback", re.I)
_TARGET = re.compile(r'custom_call_target="(?P<target>[^"]*)"')


@dataclasses.dataclass(frozen=True)
class Transfer:
    """One collective of a module and the matmuls a scheduler could run while its bytes move."""

    op: CollectiveOp
    #: Matmuls (or calls holding one) that neither feed the transfer nor depend on it.
    independent: tuple[str, ...]
    #: Matmuls the transfer waits for (its operand is computed from them).
    waits_for: tuple[str, ...]
    #: Matmuls that wait for the transfer (they read what it delivers, or something computed from it).
    feeds: tuple[str, ...]

    @property
    def hideable(self) -> bool:
        return bool(self.independent)

    def describe(self) -> str:
        def names(xs: tuple[str, ...]) -> str:
            return (
                ", ".join(xs[:3]) + (f" and {len(xs) - 3} more" if len(xs) > 3 else "") if xs else "no matmul"
            )

        if self.hideable:
            return f"{self.op.describe()}: can overlap {names(self.independent)}"
        return (
            f"{self.op.describe()}: waits for {names(self.waits_for)}; "
            f"then feeds {names(self.feeds)}; no matmul is independent of it"
        )


@dataclasses.dataclass(frozen=True)
class OverlapSummary:
    """Every transfer of a module, each judged by the dataflow around it."""

    transfers: tuple[Transfer, ...]
    #: On a scheduled module with asynchronous collectives: start/done pairs whose span holds a matmul,
    #: and all such pairs (``None`` if the module has no asynchronous transfer).
    scheduled: tuple[int, int] | None = None

    def _count(self, ts: Iterable[Transfer]) -> int | None:
        total = 0
        for t in ts:
            if t.op.multiplicity is None:
                return None
            total += t.op.multiplicity
        return total

    @property
    def total(self) -> int | None:
        """Transfers per call (loop bodies counted per trip); ``None`` if a trip count is unknown."""
        return self._count(self.transfers)

    @property
    def hideable(self) -> int | None:
        return self._count(t for t in self.transfers if t.hideable)

    @property
    def exposed(self) -> tuple[Transfer, ...]:
        return tuple(t for t in self.transfers if not t.hideable)

    @property
    def rings(self) -> int:
        """Distinct transfer patterns (a collective-permute's pairs, another op's kind and groups):
        one per ring direction."""
        return len({(t.op.kind, t.op.source_target_pairs, t.op.replica_groups) for t in self.transfers})

    @property
    def fraction(self) -> str:
        """``hideable/all`` per call; by op where a loop's trip count is unknown."""
        h, t = self.hideable, self.total
        if h is None or t is None:
            ops = sum(x.hideable for x in self.transfers)
            return f"{ops}/{len(self.transfers)} ops (loop trips unknown)"
        return f"{h}/{t}"


def _computes(module: HloModule) -> Callable[[Instruction], str | None]:
    """A predicate: what kind of compute an instruction is (``dot``, ``fusion(dot)``, ...), or ``None``."""
    memo: dict[str, str | None] = {}

    def in_computation(name: str, seen: frozenset[str]) -> str | None:
        if name not in memo:
            memo[name] = None
            found = None
            for inst in module.computations.get(name, ()):
                found = what(inst, seen | {name})
                if found:
                    break
            memo[name] = found
        return memo[name]

    def what(inst: Instruction, seen: frozenset[str] = frozenset()) -> str | None:
        if inst.opcode in MATMUL_OPCODES:
            return inst.opcode
        if inst.opcode == "custom-call":
            target = _TARGET.search(inst.attrs)
            name = target["target"] if target else ""
            if _MATMUL_TARGET.search(name) or _KERNEL_TARGET.search(name):
                return f"custom-call {name}"
        for callee in inst.callees:
            if callee in seen:
                continue
            inner = in_computation(callee, seen)
            if inner:
                return f"{inst.opcode}({inner.split('(')[-1].rstrip(')')})"
        return None

    return what


def _closure(start: Iterable[str], edges: dict[str, tuple[str, ...]]) -> set[str]:
    seen: set[str] = set()
    stack = list(start)
    while stack:
        x = stack.pop()
        if x in seen:
            continue
        seen.add(x)
        stack.extend(edges.get(x, ()))
    return seen


def overlap(module: HloModule) -> OverlapSummary:
    """Each transfer of ``module``, with the matmuls that are independent of it in the dataflow.

    A transfer (a collective, or the span from an asynchronous one's ``-start`` to its ``-done``)
    can hide behind a matmul that neither feeds it nor reads what it delivers: a scheduler may run
    the two at once. Dependence is read per computation, from each instruction's own operands and
    control predecessors; a matmul inside a fusion, call, while loop or conditional counts as its
    caller. A transfer in a loop body is judged in the body (one step of the loop: its other
    matmuls), and, if it has none there, by the computations that call the loop. Dependences across
    iterations are not followed.
    """
    collectives = collectives_of(module)
    is_compute = _computes(module)
    callers: dict[str, list[tuple[str, Instruction]]] = defaultdict(list)
    for comp, insts in module.computations.items():
        for inst in insts:
            if inst.opcode in ("call", "while", "conditional", "async-start") or (
                inst.opcode == "custom-call" and inst.callees
            ):
                for callee in inst.callees:
                    callers[callee].append((comp, inst))
    graphs: dict[str, tuple[dict[str, tuple[str, ...]], dict[str, tuple[str, ...]]]] = {}

    def graph(comp: str) -> tuple[dict[str, tuple[str, ...]], dict[str, tuple[str, ...]]]:
        if comp not in graphs:
            preds = {i.name: i.operands + i.control_predecessors for i in module.computations[comp]}
            succs: dict[str, list[str]] = defaultdict(list)
            for name, ps in preds.items():
                for p in ps:
                    succs[p].append(name)
            graphs[comp] = (preds, {k: tuple(v) for k, v in succs.items()})
        return graphs[comp]

    def judge(comp: str, first: str, last: str, seen: frozenset[str]) -> tuple[list, list, list]:
        """(independent, waited-for, fed) compute of ``comp`` around the span ``first``..``last``."""
        preds, succs = graph(comp)
        before = _closure(preds.get(first, ()), preds)
        after = _closure(succs.get(last, ()), succs)
        independent, waits, feeds = [], [], []
        for inst in module.computations[comp]:
            kind = is_compute(inst)
            if not kind or inst.name in (first, last):
                continue
            label = f"{kind} {inst.name}"
            (waits if inst.name in before else feeds if inst.name in after else independent).append(label)
        if not independent:  # the enclosing computations: compute beside the call of this one
            for parent, call in callers.get(comp, ()):
                if parent in seen:
                    continue
                more, _, _ = judge(parent, call.name, call.name, seen | {comp})
                independent += [f"{x} (beside {call.opcode} {call.name})" for x in more]
        return independent, waits, feeds

    transfers = []
    done_of: dict[tuple[str, str], str] = {}
    for comp, insts in module.computations.items():
        for inst in insts:
            if inst.opcode.endswith("-done") and inst.operands:
                done_of[(comp, inst.operands[0])] = inst.name
    for op in collectives.ops:
        if op.phase == "done":
            continue
        last = done_of.get((op.computation, op.name), op.name)
        independent, waits, feeds = judge(op.computation, op.name, last, frozenset())
        transfers.append(Transfer(op, tuple(independent), tuple(waits), tuple(feeds)))
    scheduled = _scheduled_overlap(module, is_compute) if module.scheduled else None
    return OverlapSummary(tuple(transfers), scheduled)


def _scheduled_overlap(
    module: HloModule, is_compute: Callable[[Instruction], str | None]
) -> tuple[int, int] | None:
    """In a scheduled module: asynchronous start/done pairs with a matmul between them in run order."""
    bracketing, pairs = 0, 0
    for comp, insts in module.computations.items():
        if comp not in module.multiplicity:
            continue
        position = {inst.name: i for i, inst in enumerate(insts)}
        for i, inst in enumerate(insts):
            base, phase = _split_phase(inst.opcode)
            if phase != "done" or base not in COLLECTIVE_KINDS or not inst.operands:
                continue
            start = position.get(inst.operands[0])
            if start is None:
                continue
            pairs += 1
            bracketing += any(is_compute(x) for x in insts[start + 1 : i])
    return (bracketing, pairs) if pairs else None


@dataclasses.dataclass(frozen=True)
class ScheduledTransfer:
    """One transfer in a scheduled module's run order: an asynchronous ``-start`` .. ``-done`` span
    (hidden if a matmul runs inside it) or a synchronous collective (never hidden)."""

    kind: str
    name: str  #: the ``-start`` (or the synchronous op)
    computation: str
    times: int  #: runs per call (a loop body's trips)
    #: Matmuls (or kernels) scheduled between start and done.
    inside: tuple[str, ...]
    pattern: tuple  #: source-target pairs or replica groups: one ring direction each
    #: Bytes one run delivers to a device from another (:meth:`CollectiveOp.received_bytes`).
    received: int = 0

    @property
    def hidden(self) -> bool:
        return bool(self.inside)


@dataclasses.dataclass(frozen=True)
class Schedule:
    """The transfers of a scheduled module, each judged by what runs inside its span."""

    transfers: tuple[ScheduledTransfer, ...]
    #: Per computation holding a transfer: its run order in letters, ``S``/``D`` an asynchronous
    #: start/done, ``C`` a synchronous collective, ``M`` a matmul, ``W`` a loop; and its runs per call.
    orders: tuple[tuple[str, int, str], ...]

    @property
    def total(self) -> int:
        return sum(t.times for t in self.transfers)

    @property
    def hidden(self) -> int:
        return sum(t.times for t in self.transfers if t.hidden)

    @property
    def rings(self) -> int:
        """Distinct transfer patterns: one per ring direction."""
        return len({(t.kind, t.pattern) for t in self.transfers})

    @property
    def exposed_bytes(self) -> int:
        """Bytes a device receives per call in transfers with no matmul inside them: the wait."""
        return sum(t.times * t.received for t in self.transfers if not t.hidden)

    @property
    def fraction(self) -> str:
        return f"{self.hidden}/{self.total}"

    @property
    def run_ahead(self) -> int:
        """Transfers of the computations run once per call (not loops) that are done before the first
        matmul runs: a chain of transfers the scheduler ran first, their matmuls after."""
        return sum(order.split("M", 1)[0].count("D") for _, times, order in self.orders if times == 1)

    def order_text(self) -> str:
        return "; ".join(
            f"{order}" + (f" (x{times}, loop {comp})" if times != 1 else "")
            for comp, times, order in self.orders
        )


def schedule(module: HloModule) -> Schedule:
    """The transfers of a scheduled module (``is_scheduled=true``: text order is run order), each with
    the matmuls that run inside its span, counted per call through loops (trip counts from
    ``known_trip_count`` or inferred from a counted loop, :func:`~conformance.hlo.compiled.counted_trips`).

    Raises :class:`~conformance.hlo.HloParseError` quoting what it cannot read: a module that is not
    scheduled, a transfer in a loop whose trips it cannot count, a ``-done`` whose ``-start`` is in
    another computation.
    """
    if not module.scheduled:
        raise _unknown("a module that is not scheduled", "HloModule ... (no is_scheduled=true)")
    is_compute = _computes(module)
    collectives = {(op.computation, op.name): op for op in collectives_of(module).ops}
    transfers, orders = [], []
    for comp, insts in module.computations.items():
        if comp not in module.multiplicity:
            continue
        times = module.multiplicity[comp]
        position = {inst.name: i for i, inst in enumerate(insts)}
        letters = []
        for i, inst in enumerate(insts):
            base, phase = _split_phase(inst.opcode)
            if base in COLLECTIVE_KINDS:
                letters.append({"start": "S", "done": "D", "sync": "C"}[phase])
                if phase == "start":
                    continue
                if times is None:
                    raise _unknown(
                        "a transfer in a loop whose trip count is neither in its backend_config nor "
                        "that of a counted loop",
                        f"{inst.name} in computation {comp}",
                    )
                start = i
                if phase == "done":
                    start = position.get(inst.operands[0]) if inst.operands else None
                    if start is None:
                        raise _unknown(f"a {inst.opcode} whose start is not in its computation", inst.name)
                op = collectives[(comp, insts[start].name)]
                inside = tuple(f"{is_compute(x)} {x.name}" for x in insts[start + 1 : i] if is_compute(x))
                pattern = op.source_target_pairs or op.replica_groups or ()
                transfers.append(
                    ScheduledTransfer(
                        base, insts[start].name, comp, times, inside, pattern, received=op.received_bytes()
                    )
                )
            elif inst.opcode == "while":
                letters.append("W")
            elif is_compute(inst):
                letters.append("M")
        if any(ch in "SDC" for ch in letters):
            orders.append((comp, times, "".join(letters)))
    return Schedule(tuple(transfers), tuple(orders))


# ----------------------------------------------------------------------------- StableHLO
