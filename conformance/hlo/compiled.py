"""Compiled (and lowered-to-HLO) modules: computations, instructions, and the collectives with
their multiplicity through ``while`` loops."""

from __future__ import annotations

import dataclasses
import re
from collections import defaultdict

from conformance.hlo.model import (
    _DTYPE_BITS,
    COLLECTIVE_KINDS,
    CollectiveOp,
    CollectiveSummary,
    Shape,
    _unknown,
)
from conformance.hlo.replica_groups import _pairs, _participants, parse_replica_groups

_COMPUTATION = re.compile(r"^\s*(?P<entry>ENTRY\s+)?%?(?P<name>[\w.\-]+)\s*(?:\(.*\))?.*\{\s*$")
_INSTRUCTION = re.compile(
    r"^\s*(?P<root>ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*(?P<type>.+?)\s+"
    r"(?P<opcode>[a-z][a-z0-9\-]*)\((?P<rest>.*)$"
)
_ARRAY = re.compile(r"(?P<dtype>[a-z][a-z0-9]*)\[(?P<dims>[0-9,]*)\]")
_CALLEE = re.compile(r"\b(?:body|condition|calls|to_apply|true_computation|false_computation)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_TRIP = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"?(\d+)"?')
_HEADER_COUNT = re.compile(r"\b(?P<key>replica_count|num_partitions)=(?P<n>\d+)")


def _shapes(type_text: str) -> tuple[Shape, ...]:
    shapes = []
    for m in _ARRAY.finditer(type_text):
        if m["dtype"] in _DTYPE_BITS:
            dims = tuple(int(d) for d in m["dims"].split(",") if d)
            shapes.append(Shape(m["dtype"], dims))
    return tuple(shapes)


def _split_call(rest: str) -> tuple[str, str]:
    """Split ``a, b), attr=...`` into the operand list and the attributes."""
    depth = 1
    for i, ch in enumerate(rest):
        if ch in "({[":
            depth += 1
        elif ch in ")}]":
            depth -= 1
            if depth == 0:
                return rest[:i], rest[i + 1 :]
    return rest, ""


#: XLA's printer puts ``/*index=5*/`` before every fifth operand of a long list.
_COMMENT = re.compile(r"/\*.*?\*/")


def _operand_names(operands: str) -> list[str]:
    names, depth, token = [], 0, ""
    for ch in _COMMENT.sub(" ", operands) + ",":
        if ch in "({[":
            depth += 1
        elif ch in ")}]":
            depth -= 1
        if ch == "," and depth == 0:
            token = token.strip()
            if token:
                names.append(token.split()[-1].lstrip("%"))
            token = ""
        else:
            token += ch
    return names


def _attribute(attrs: str, key: str) -> str | None:
    """The text of attribute ``key=``, up to the next top-level ``, name=`` (brackets, quotes balanced)."""
    m = re.search(rf"(?:^|[\s,]){re.escape(key)}=", attrs)
    if not m:
        return None
    depth, quote, i = 0, False, m.end()
    while i < len(attrs):
        ch = attrs[i]
        if ch == "'":
            quote = not quote
        elif not quote and ch in "({[":
            depth += 1
        elif not quote and ch in ")}]":
            depth -= 1
        elif not quote and ch == "," and depth == 0:
            nxt = re.match(r",\s*([a-z_]+)=", attrs[i:])
            if nxt and nxt[1] != "device_ids":
                break
        i += 1
    return attrs[m.end() : i].strip()


# ----------------------------------------------------------------------------- replica groups


@dataclasses.dataclass(frozen=True)
class Instruction:
    """One HLO instruction: its own operands and attributes, nothing read from another line."""

    name: str
    type: str
    opcode: str
    operands: tuple[str, ...]
    attrs: str
    #: Computations it calls (``calls=``, ``to_apply=``, a while's ``body``/``condition``, branches).
    callees: tuple[str, ...]
    #: Instructions it must follow without reading their values (``control-predecessors={...}``).
    control_predecessors: tuple[str, ...] = ()
    #: Whether it is its computation's ``ROOT``.
    root: bool = False


@dataclasses.dataclass(frozen=True)
class HloModule:
    """A compiled (or lowered-to-HLO) module: its computations, instructions in text order."""

    computations: dict[str, tuple[Instruction, ...]]
    entry: str
    replica_count: int
    num_partitions: int
    #: Times each computation reachable from ENTRY runs per call; ``None``: inside a loop of unknown trip.
    multiplicity: dict[str, int | None]
    #: Whether XLA printed the module as scheduled (``is_scheduled=true``): text order is run order.
    scheduled: bool = False


_CONTROL_PREDECESSORS = re.compile(r"control-predecessors=\{([^}]*)\}")


def _callees(attrs: str) -> tuple[str, ...]:
    callees = _CALLEE.findall(attrs)
    for branch in _BRANCHES.findall(attrs):
        callees += [c.strip().lstrip("%") for c in branch.split(",") if c.strip()]
    called = re.search(r"called_computations=\{([^}]*)\}", attrs)
    if called:
        callees += [c.strip().lstrip("%") for c in called[1].split(",") if c.strip()]
    return tuple(dict.fromkeys(callees))


def parse_module(text: str) -> HloModule:
    """The computations of an HLO module's text (compiled, or ``Lowered.as_text(dialect="hlo")``)."""
    computations: dict[str, list[Instruction]] = defaultdict(list)
    entry = None
    current = None
    scheduled = False
    counts = {"replica_count": 1, "num_partitions": 1}
    for line in text.splitlines():
        if line.lstrip().startswith("HloModule"):
            counts.update((m["key"], int(m["n"])) for m in _HEADER_COUNT.finditer(line))
            scheduled = re.search(r"\bis_scheduled=true\b", line) is not None
            continue
        if not line.strip() or line.lstrip().startswith("//"):
            continue
        inst = _INSTRUCTION.match(line)
        if inst and current is not None:
            operands, attrs = _split_call(inst["rest"])
            control = _CONTROL_PREDECESSORS.search(attrs)
            computations[current].append(
                Instruction(
                    name=inst["name"],
                    type=inst["type"],
                    opcode=inst["opcode"],
                    operands=tuple(_operand_names(operands)),
                    attrs=attrs,
                    callees=_callees(attrs),
                    control_predecessors=tuple(_operand_names(control[1])) if control else (),
                    root=inst["root"] is not None,
                )
            )
            continue
        comp = _COMPUTATION.match(line)
        if comp:
            current = comp["name"]
            computations.setdefault(current, [])
            if comp["entry"]:
                entry = current
    if entry is None:
        raise ValueError("no ENTRY computation found: is this compiled HLO text?")

    # How often each computation runs per call, propagated from ENTRY.
    multiplicity: dict[str, int | None] = {entry: 1}
    order = [entry]
    while order:
        comp = order.pop()
        times = multiplicity[comp]
        for inst in computations.get(comp, ()):
            if not inst.callees:
                continue
            factor: int | None = 1
            if inst.opcode == "while":
                trip = _TRIP.search(inst.attrs)
                factor = int(trip[1]) if trip else counted_trips(computations, comp, inst)
            for callee in inst.callees:
                t = None if times is None or factor is None else times * factor
                if callee in multiplicity:
                    prev = multiplicity[callee]
                    t = None if prev is None or t is None else prev + t
                multiplicity[callee] = t
                order.append(callee)
    return HloModule(
        computations={name: tuple(insts) for name, insts in computations.items()},
        entry=entry,
        replica_count=counts["replica_count"],
        num_partitions=counts["num_partitions"],
        multiplicity=multiplicity,
        scheduled=scheduled,
    )


_PASS_THROUGH = frozenset({"copy", "bitcast", "convert", "reshape"})
_INDEX = re.compile(r"(?:^|[\s,])index=(\d+)")
_DIRECTION = re.compile(r"direction=([A-Z]+)")
_COMPARE = {
    "LT": lambda a, b: a < b,
    "LE": lambda a, b: a <= b,
    "GT": lambda a, b: a > b,
    "GE": lambda a, b: a >= b,
    "NE": lambda a, b: a != b,
}
_SWAPPED = {"LT": "GT", "LE": "GE", "GT": "LT", "GE": "LE", "NE": "NE"}
#: A counted loop longer than this is not inferred (its count would be simulated step by step).
_MAX_INFERRED_TRIPS = 1 << 20


def counted_trips(
    computations: dict[str, list[Instruction]] | dict[str, tuple[Instruction, ...]],
    caller: str,
    loop: Instruction,
) -> int | None:
    """The trip count of a counted ``while`` that carries none in its ``backend_config`` (XLA:TPU's
    compiled modules drop ``known_trip_count``), read from the loop itself: a condition that compares
    one tuple element with a constant, a body that adds a constant to that element, and an initial
    value that is a constant. ``None`` for any other form (the loop is then of unknown trip count).

    Values are followed through ``copy``, ``bitcast``, ``convert`` and ``reshape``, which compilers
    put around loop counters; nothing else is assumed.
    """
    by_name = {c: {i.name: i for i in insts} for c, insts in computations.items()}
    cond_name = re.search(r"\bcondition=%?([\w.\-]+)", loop.attrs)
    body_name = re.search(r"\bbody=%?([\w.\-]+)", loop.attrs)
    if not (cond_name and body_name and loop.operands):
        return None
    cond, body, outer = by_name.get(cond_name[1]), by_name.get(body_name[1]), by_name.get(caller)
    if cond is None or body is None or outer is None:
        return None

    def source(insts: dict[str, Instruction], name: str) -> Instruction | None:
        inst = insts.get(name)
        while inst is not None and inst.opcode in _PASS_THROUGH and len(inst.operands) == 1:
            inst = insts.get(inst.operands[0])
        return inst

    def constant(insts: dict[str, Instruction], name: str) -> int | None:
        inst = source(insts, name)
        if inst is None or inst.opcode != "constant" or len(inst.operands) != 1:
            return None
        try:
            return int(inst.operands[0])
        except ValueError:
            return None

    def element(insts: dict[str, Instruction], name: str) -> int | None:
        """The tuple index of ``name`` if it is an element of the computation's parameter."""
        inst = source(insts, name)
        if inst is None or inst.opcode != "get-tuple-element":
            return None
        param = source(insts, inst.operands[0]) if inst.operands else None
        index = _INDEX.search(inst.attrs)
        return int(index[1]) if param is not None and param.opcode == "parameter" and index else None

    def root(insts: dict[str, Instruction]) -> Instruction | None:
        return next((i for i in insts.values() if i.root), None)

    compare = root(cond)
    direction = _DIRECTION.search(compare.attrs) if compare is not None else None
    if compare is None or compare.opcode != "compare" or not direction or len(compare.operands) != 2:
        return None
    op = direction[1]
    left, right = compare.operands
    index, bound = element(cond, left), constant(cond, right)
    if index is None or bound is None:
        index, bound, op = element(cond, right), constant(cond, left), _SWAPPED.get(op, "")
    if index is None or bound is None or op not in _COMPARE:
        return None
    update = root(body)
    if update is None or update.opcode != "tuple" or index >= len(update.operands):
        return None
    step_inst = source(body, update.operands[index])
    if step_inst is None or step_inst.opcode not in ("add", "subtract") or len(step_inst.operands) != 2:
        return None
    a, b = step_inst.operands
    if element(body, a) == index and constant(body, b) is not None:
        step = constant(body, b)
    elif step_inst.opcode == "add" and element(body, b) == index and constant(body, a) is not None:
        step = constant(body, a)
    else:
        return None
    assert step is not None
    step = -step if step_inst.opcode == "subtract" else step
    init_tuple = source(outer, loop.operands[0])
    if init_tuple is None or init_tuple.opcode != "tuple" or index >= len(init_tuple.operands):
        return None
    value = constant(outer, init_tuple.operands[index])
    if value is None or step == 0:
        return None
    trips = 0
    while _COMPARE[op](value, bound):
        value += step
        trips += 1
        if trips > _MAX_INFERRED_TRIPS:
            return None
    return trips


def _split_phase(opcode: str) -> tuple[str, str]:
    for suffix in ("-start", "-done"):
        if opcode.endswith(suffix):
            return opcode[: -len(suffix)], suffix[1:]
    return opcode, "sync"


def _op_name(attrs: str) -> str:
    """The ``op_name`` of an instruction's ``metadata={...}`` (``""`` where it has none)."""
    m = re.search(r'metadata=\{[^}]*?\bop_name="(?P<name>(?:[^"\\]|\\.)*)"', attrs)
    return m["name"] if m else ""


def parse_hlo(text: str) -> CollectiveSummary:
    """Every collective in a compiled HLO module's text, with multiplicities."""
    return collectives_of(parse_module(text))


def collectives_of(module: HloModule) -> CollectiveSummary:
    """Every collective of ``module`` reachable from ENTRY, with multiplicities."""
    counts = {"replica_count": module.replica_count, "num_partitions": module.num_partitions}
    multiplicity = module.multiplicity
    ops = []
    for comp, insts in module.computations.items():
        if comp not in multiplicity:
            continue  # unreachable from ENTRY (dead helper computations)
        types = {inst.name: inst.type for inst in insts}
        for inst in insts:
            name, opcode, attrs = inst.name, inst.opcode, inst.attrs
            base, phase = _split_phase(opcode)
            if base not in COLLECTIVE_KINDS:
                continue
            operand_shapes = tuple(s for n in inst.operands for s in _shapes(types.get(n, "")))
            pairs, replica_groups = None, None
            if phase != "done":  # a -done names its -start, which carries the attributes
                where = f"{opcode} {name}: {attrs.strip()}"
                if base == "collective-permute":
                    pairs_text = _attribute(attrs, "source_target_pairs")
                    if pairs_text is None:
                        raise _unknown("a collective-permute without source_target_pairs", where)
                    pairs = _pairs(pairs_text)
                else:
                    groups_text = _attribute(attrs, "replica_groups")
                    if groups_text is None:
                        raise _unknown(f"an {base} without replica_groups", where)
                    replica_groups = _participants(
                        parse_replica_groups(groups_text),
                        kind=base,
                        has_channel=re.search(r"(?:^|[\s,])channel_id=\d+", attrs) is not None,
                        global_ids=re.search(r"(?:^|[\s,])use_global_device_ids=true", attrs) is not None,
                        replicas=counts["replica_count"],
                        partitions=counts["num_partitions"],
                        text=groups_text,
                    )
            ops.append(
                CollectiveOp(
                    kind=base,
                    phase=phase,
                    name=name,
                    computation=comp,
                    operand_shapes=operand_shapes,
                    result_shapes=_shapes(inst.type),
                    source_target_pairs=pairs,
                    replica_groups=replica_groups,
                    multiplicity=multiplicity[comp],
                    op_name=_op_name(attrs),
                )
            )
    return CollectiveSummary(tuple(ops))


# ----------------------------------------------------------------------------- dataflow: overlap

#: Opcodes that are a matmul.
