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
    r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*(?P<type>.+?)\s+"
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


def _operand_names(operands: str) -> list[str]:
    names, depth, token = [], 0, ""
    for ch in operands + ",":
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
                factor = int(trip[1]) if trip else None
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


def _split_phase(opcode: str) -> tuple[str, str]:
    for suffix in ("-start", "-done"):
        if opcode.endswith(suffix):
            return opcode[: -len(suffix)], suffix[1:]
    return opcode, "sync"


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
                )
            )
    return CollectiveSummary(tuple(ops))


# ----------------------------------------------------------------------------- dataflow: overlap

#: Opcodes that are a matmul.
