"""Parse compiled HLO (and lowered StableHLO) text into collective operations.

This is the only place in the project that reads HLO text. Checks ask it
questions ("which collectives, how many bytes does a device receive") and
never count substrings themselves.

For compiled HLO we parse every computation, resolve operand shapes through
the instruction table, and give each collective a *multiplicity*: how many
times it runs per call, following ``while`` bodies (with XLA's
``known_trip_count``), calls and conditionals from the ENTRY computation. A
collective inside a loop whose trip count XLA could not determine has
multiplicity ``None``, and byte accounting then reports "unbounded" instead
of guessing.

Bytes received per device follow the usual algorithm-independent accounting:

* collective-permute: the operand, on every device that is a target;
* all-gather: ``result - operand`` (everything but one's own piece);
* reduce-scatter and all-to-all: ``(g-1)/g`` of the operand, for group size g;
* all-reduce: ``2 (g-1)/g`` of the operand (reduce-scatter then all-gather).

Replica groups come in every form the supported XLAs print, each expanded to
explicit device-id groups: the list ``{{0,1},{2,3}}``, the iota form
``[4,2]<=[2,4]T(1,0)``, and the mesh-axes form ``mesh['x'=4,'y'=2] {'y'}``
(with sub-axes ``{'x':(2)4}`` and ``, device_ids=(...)``), which XLA prints
from JAX 0.10 for partitioner-made collectives and from 0.12 for all of them;
in StableHLO, ``dense<...>`` and ``#stablehlo.replica_group_mesh_axes<...>``
over an ``sdy.mesh``. Groups are read in the op's mode (cross-replica,
cross-partition, both, or flattened ids) and the module's replica and partition
counts, so an empty ``{}`` becomes the group it stands for. Text in a form not
listed here raises :class:`HloParseError` quoting it: a parser that guessed, or
returned no groups, would let the audit measure less than it says.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import re
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence

import numpy as np

#: Collective opcodes as HLO spells them (async forms add ``-start``/``-done``).
COLLECTIVE_KINDS = frozenset(
    {
        "all-gather",
        "all-reduce",
        "reduce-scatter",
        "all-to-all",
        "ragged-all-to-all",
        "collective-permute",
        "collective-broadcast",
    }
)

_DTYPE_BITS = {
    "pred": 8, "s2": 2, "u2": 2, "s4": 4, "u4": 4, "s8": 8, "u8": 8, "s16": 16, "u16": 16,
    "s32": 32, "u32": 32, "s64": 64, "u64": 64, "f16": 16, "bf16": 16, "f32": 32, "f64": 64,
    "c64": 64, "c128": 128, "f8e4m3fn": 8, "f8e5m2": 8, "f8e4m3": 8, "f8e4m3fnuz": 8,
    "f8e5m2fnuz": 8, "f8e4m3b11fnuz": 8, "f8e3m4": 8, "f4e2m1fn": 4, "f8e8m0fnu": 8,
    "token": 0,
}  # fmt: skip


class HloParseError(ValueError):
    """HLO or StableHLO text in a form this parser does not know; the message quotes the text."""


def _unknown(what: str, text: str) -> HloParseError:
    return HloParseError(
        f"conformance.hlo cannot read {what} {text!r}: a form it does not know (a newer XLA may print "
        "it differently); it refuses rather than guess. Teach conformance/hlo.py the form, with the "
        "verbatim line as a self-test."
    )


@dataclasses.dataclass(frozen=True)
class Shape:
    """An HLO array shape such as ``bf16[4,128]``."""

    dtype: str
    dims: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.ceil(_DTYPE_BITS.get(self.dtype, 0) * math.prod(self.dims) / 8)

    def __str__(self) -> str:
        return f"{self.dtype}[{','.join(map(str, self.dims))}]"


@dataclasses.dataclass(frozen=True)
class CollectiveOp:
    """One collective in a module, with everything a check may ask about it."""

    kind: str  #: e.g. ``collective-permute`` (the ``-start``/``-done`` suffix stripped)
    phase: str  #: ``sync``, ``start`` or ``done``
    name: str
    computation: str
    operand_shapes: tuple[Shape, ...]
    result_shapes: tuple[Shape, ...]
    source_target_pairs: tuple[tuple[int, int], ...] | None = None
    replica_groups: tuple[tuple[int, ...], ...] | None = None
    #: Times this op runs per call of the module; ``None`` if a loop bound is unknown.
    multiplicity: int | None = 1

    @property
    def operand_bytes(self) -> int:
        return sum(s.nbytes for s in self.operand_shapes)

    @property
    def group_size(self) -> int:
        if self.replica_groups:
            return max(len(g) for g in self.replica_groups)
        return 0

    def received_bytes(self, device: int | None = None) -> int:
        """Bytes one execution of this op delivers to ``device`` (any target if ``None``)."""
        if self.phase == "done":
            return 0  # counted once, at the start
        if self.kind == "collective-permute":
            if self.source_target_pairs is not None and device is not None:
                targets = {t for _, t in self.source_target_pairs}
                if device not in targets:
                    return 0
            data = self.operand_shapes[:1] if self.phase == "start" else self.operand_shapes
            return sum(s.nbytes for s in data)
        g = self.group_size
        if self.kind == "all-gather":
            if g:
                return self.operand_bytes * (g - 1)
            result = sum(s.nbytes for s in self.result_shapes)
            return max(result - self.operand_bytes, 0)
        frac = (g - 1) / g if g else 1.0
        if self.kind == "all-reduce":
            return math.ceil(2 * frac * self.operand_bytes)
        return math.ceil(frac * self.operand_bytes)

    def describe(self) -> str:
        shapes = ", ".join(map(str, self.operand_shapes)) or "?"
        extra = ""
        if self.source_target_pairs is not None:
            extra = f" pairs={list(self.source_target_pairs)}"
        elif self.replica_groups is not None:
            extra = f" groups={[list(g) for g in self.replica_groups]}"
        suffix = "" if self.phase == "sync" else f"-{self.phase}"
        times = "" if self.multiplicity == 1 else f" x{self.multiplicity or '?'}"
        return f"{self.kind}{suffix}({shapes}){extra}{times} [{self.name}]"


@dataclasses.dataclass(frozen=True)
class CollectiveSummary:
    """All collectives of a module and the bytes they deliver per device."""

    ops: tuple[CollectiveOp, ...]

    @property
    def kinds(self) -> frozenset[str]:
        return frozenset(op.kind for op in self.ops)

    def of_kind(self, *kinds: str) -> tuple[CollectiveOp, ...]:
        return tuple(op for op in self.ops if op.kind in kinds)

    def received_bytes_per_device(self) -> int | None:
        """Max over devices of bytes received per call; ``None`` if a loop bound is unknown."""
        devices: set[int | None] = {None}
        for op in self.ops:
            for src, dst in op.source_target_pairs or ():
                devices.update((src, dst))
        if len(devices) > 1:
            devices.discard(None)
        worst = 0
        for device in devices:
            total = 0
            for op in self.ops:
                per_call = op.received_bytes(device)
                if per_call and op.multiplicity is None:
                    return None
                total += per_call * (op.multiplicity or 0)
            worst = max(worst, total)
        return worst


# ----------------------------------------------------------------------------- compiled HLO

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

Groups = tuple[tuple[int, ...], ...]


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


def _rows(ids: np.ndarray, size: int) -> Groups:
    return tuple(tuple(int(i) for i in row) for row in ids.reshape(-1, size))


_EXPLICIT = re.compile(r"\{\s*(?:\{[0-9,\s]*\}\s*(?:,\s*\{[0-9,\s]*\}\s*)*)?\}")
_IOTA = re.compile(r"\[(?P<shape>\d+(?:,\d+)*)\]<=\[(?P<dims>\d+(?:,\d+)*)\](?:T\((?P<perm>\d+(?:,\d+)*)\))?")
_MESH = re.compile(
    r"mesh\[(?P<axes>[^\]]*)\](?:,\s*device_ids=\((?P<ids>[^()]*(?:\([^()]*\))?)\))?\s*\{(?P<grouped>[^}]*)\}"
)  # device_ids=(...) may hold an iota's T(...): matched here so that the refusal can name it
_MESH_AXIS = re.compile(r"\s*'?(?P<name>[^'=,\s]+)'?=(?P<size>\d+)\s*")
_AXIS_REF = re.compile(r"\s*'?(?P<name>[^':,\s]+)'?(?::\((?P<pre>\d+)\)(?P<size>\d+))?\s*")


def _iota_groups(text: str) -> Groups:
    """Expand the iota form ``[G,S]<=[dims]T(perm)``: iota over dims, transposed, cut into G groups of S."""
    m = _IOTA.fullmatch(text.strip())
    if not m:
        raise _unknown("the iota replica groups", text)
    shape, dims = _ints(m["shape"]), _ints(m["dims"])
    ids = np.arange(math.prod(dims)).reshape(dims)
    if m["perm"]:
        perm = _ints(m["perm"])
        if sorted(perm) != list(range(len(dims))):
            raise _unknown("the iota replica groups (transpose is not a permutation of the dims)", text)
        ids = ids.transpose(perm)
    if len(shape) != 2 or math.prod(shape) != ids.size:
        raise _unknown("the iota replica groups (group shape does not cover the devices)", text)
    return _rows(ids, shape[1])


def mesh_axes_groups(
    axes: Sequence[tuple[str, int]],
    grouped: Sequence[tuple[str, tuple[int, int] | None]],
    device_ids: np.ndarray | None = None,
) -> Groups:
    """Device groups of a collective over mesh axes, as XLA computes them.

    ``axes``: the mesh's ``(name, size)`` in order. ``grouped``: the axes the
    collective runs over, in the order given, each whole (``None``) or a
    sub-axis ``(pre_size, size)``: the ``size`` factor of the axis after its
    ``pre_size`` major-most part. ``device_ids``: the mesh's devices in
    row-major order (iota if ``None``). Each mesh axis is cut at its
    sub-axes' boundaries; the devices are laid out over those pieces, the
    pieces not grouped go first in mesh order, the grouped ones last in the
    order given (the last varying fastest), and consecutive runs of one group's
    size are the groups.
    """
    names = [name for name, _ in axes]
    sizes = dict(axes)
    cuts: dict[str, set[int]] = {name: {1, size} for name, size in axes}
    for name, sub in grouped:
        if name not in sizes:
            raise ValueError(f"axis {name!r} is not in the mesh {names}")
        if sub is not None:
            pre, size = sub
            if sizes[name] % (pre * size):
                raise ValueError(f"sub-axis {name}:({pre}){size} does not divide axis size {sizes[name]}")
            cuts[name] |= {pre, pre * size}
    pieces: list[tuple[str, int, int]] = []  # (axis, pre_size, size), major to minor
    for name in names:
        bounds = sorted(cuts[name])
        pieces += [(name, lo, hi // lo) for lo, hi in itertools.pairwise(bounds)]
        if len(bounds) == 1:  # an axis of size 1
            pieces.append((name, 1, 1))
    index = {}
    for name, sub in grouped:
        pre, size = sub if sub is not None else (1, sizes[name])
        match = [i for i, (n, lo, k) in enumerate(pieces) if n == name and lo == pre and k == size]
        if len(match) != 1:
            raise ValueError(f"grouped axis {name}:({pre}){size} overlaps another")
        index[(name, sub)] = match[0]
    order = [index[(name, sub)] for name, sub in grouped]
    if len(set(order)) != len(order):
        raise ValueError(f"an axis is grouped twice in {grouped}")
    kept = [i for i in range(len(pieces)) if i not in order]
    total = math.prod(sizes.values())
    ids = np.arange(total) if device_ids is None else np.asarray(device_ids).reshape(-1)
    if ids.size != total:
        raise ValueError(f"{ids.size} device ids for a mesh of {total} devices")
    laid = ids.reshape([k for _, _, k in pieces]).transpose(kept + order)
    return _rows(laid, math.prod(pieces[i][2] for i in order))


def _mesh_groups(text: str) -> Groups:
    """Expand the mesh-axes form ``mesh['x'=4,'y'=2] {'y'}`` (sub-axes, ``device_ids=(...)``)."""
    m = _MESH.fullmatch(text.strip())
    if not m:
        raise _unknown("the mesh-axes replica groups", text)
    axes = []
    for part in m["axes"].split(","):
        axis = _MESH_AXIS.fullmatch(part)
        if not axis:
            raise _unknown("the mesh-axes replica groups (mesh axis)", text)
        axes.append((axis["name"], int(axis["size"])))
    grouped: list[tuple[str, tuple[int, int] | None]] = []
    for part in m["grouped"].split(",") if m["grouped"].strip() else ():
        ref = _AXIS_REF.fullmatch(part)
        if not ref:
            raise _unknown("the mesh-axes replica groups (grouped axis)", text)
        grouped.append((ref["name"], (int(ref["pre"]), int(ref["size"])) if ref["pre"] else None))
    ids = None
    if m["ids"] is not None:
        # Only the explicit list is read: XLA also prints an iota ``([2,4]T(1,0))`` here, whose
        # meaning no JAX-made module has shown this project; refused rather than assumed.
        if not re.fullmatch(r"[0-9,\s]+", m["ids"]):
            raise _unknown("the mesh-axes replica groups (device_ids)", text)
        ids = np.array(_ints(m["ids"]))
    try:
        return mesh_axes_groups(axes, grouped, ids)
    except ValueError as e:
        raise _unknown(f"the mesh-axes replica groups ({e})", text) from e


def parse_replica_groups(text: str) -> Groups:
    """One ``replica_groups=`` value as XLA prints it, expanded to explicit groups of ids.

    ``{}`` (every participant) comes back as ``()``: which devices that is
    depends on the op's mode and the module, see :func:`_participants`.
    """
    text = text.strip()
    if _EXPLICIT.fullmatch(text):
        return tuple(_ints(group) for group in re.findall(r"\{([0-9,\s]*)\}", text[1:-1]))
    if text.startswith("["):
        return _iota_groups(text)
    if text.startswith("mesh["):
        return _mesh_groups(text)
    raise _unknown("the replica groups", text)


#: Kinds that take ``use_global_device_ids``; on the others a channel id means cross-partition.
_GLOBAL_IDS_KINDS = frozenset({"all-gather", "all-reduce", "reduce-scatter"})


def _participants(
    groups: Groups,
    *,
    kind: str,
    has_channel: bool,
    global_ids: bool,
    replicas: int,
    partitions: int,
    text: str,
) -> Groups:
    """Groups of device ids (``replica * partitions + partition``), in the op's collective mode.

    XLA's modes: no channel id, cross-replica; a channel id, cross-partition
    (kinds without ``use_global_device_ids``) or cross-replica-and-partition
    (``use_global_device_ids=false``); with ``use_global_device_ids=true``,
    the groups are device ids already. ``{}`` stands for every replica (or
    partition) of the mode.
    """
    if has_channel and global_ids:
        if not groups:
            raise _unknown("flattened-id replica groups (empty: XLA requires them listed)", text)
        return groups
    if not has_channel:  # cross-replica: each partition on its own
        groups = groups or (tuple(range(replicas)),)
        return tuple(tuple(r * partitions + p for r in g) for p in range(partitions) for g in groups)
    if kind not in _GLOBAL_IDS_KINDS:  # cross-partition: each replica on its own
        groups = groups or (tuple(range(partitions)),)
        return tuple(tuple(r * partitions + p for p in g) for r in range(replicas) for g in groups)
    groups = groups or (tuple(range(replicas)),)  # cross-replica-and-partition
    return tuple(tuple(r * partitions + p for r in g for p in range(partitions)) for g in groups)


def _pairs(text: str) -> tuple[tuple[int, int], ...]:
    if not _EXPLICIT.fullmatch(text.strip()):
        raise _unknown("the source-target pairs", text)
    pairs = tuple(_ints(p) for p in re.findall(r"\{([0-9,\s]*)\}", text.strip()[1:-1]))
    if any(len(p) != 2 for p in pairs):
        raise _unknown("the source-target pairs (not pairs)", text)
    return tuple((a, b) for a, b in pairs)


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
        return (f"{self.op.describe()}: waits for {names(self.waits_for)}; "
                f"then feeds {names(self.feeds)}; no matmul is independent of it")  # fmt: skip


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


# ----------------------------------------------------------------------------- StableHLO

_STABLEHLO_OP = re.compile(
    r"(?P<result>%[\w#:]+(?:\s*,\s*%[\w#:]+)*)\s*=\s*\"?stablehlo\."
    r"(?P<op>all_gather|all_reduce|reduce_scatter|all_to_all|collective_permute|collective_broadcast)\b"
)
_STABLEHLO_TYPE = re.compile(r"tensor<(?P<dims>(?:\d+x)*)(?P<dtype>[a-z][a-z0-9]*)>")
_MLIR_TO_HLO_DTYPE = {
    "f32": "f32", "f16": "f16", "bf16": "bf16", "f64": "f64", "i32": "s32", "i8": "s8",
    "i16": "s16", "i64": "s64", "ui32": "u32", "ui8": "u8", "i1": "pred", "f8E4M3FN": "f8e4m3fn",
}  # fmt: skip


_SDY_MESH = re.compile(r"sdy\.mesh\s+@(?P<name>[\w.$\-]+)\s*=\s*<\[(?P<axes>[^\]]*)\](?P<rest>[^>]*)>")
_STABLEHLO_MESH_GROUPS = re.compile(
    r"#stablehlo\.replica_group_mesh_axes<\s*mesh\s*=\s*(?P<mesh>.*?),\s*axes\s*=\s*\[(?P<axes>.*)\]\s*>"
)
_MLIR_MODULE_COUNT = re.compile(r"mhlo\.(?P<key>num_partitions|num_replicas)\s*=\s*(?P<n>\d+)")


def _closing(text: str, i: int, open_: str, close: str) -> int:
    """Index just past the ``close`` that balances the ``open_`` at ``text[i]``."""
    depth = 0
    for j in range(i, len(text)):
        if text[j] == open_:
            depth += 1
        elif text[j] == close:
            depth -= 1
            if depth == 0:
                return j + 1
    raise _unknown("an unbalanced op", text[i : i + 200])


def _dense_ints(text: str, what: str) -> np.ndarray:
    """A ``dense<...> : tensor<AxBxi64>`` integer attribute (list, splat or empty) as an array."""
    m = re.fullmatch(r"dense<(?P<value>[^>]*)>\s*:\s*tensor<(?P<shape>(?:\d+x)*)i\d+>", text.strip())
    if not m:
        raise _unknown(what, text)
    shape = tuple(int(d) for d in m["shape"].split("x") if d)
    value = m["value"].strip()
    if re.fullmatch(r"-?\d+", value):  # a splat: every element the same
        return np.full(shape, int(value))
    data = np.array(json.loads(value or "[]"), dtype=np.int64)
    if data.size != math.prod(shape):
        raise _unknown(what, text)
    return data.reshape(shape)


def _stablehlo_mesh_groups(text: str, meshes: dict[str, str]) -> Groups:
    """``#stablehlo.replica_group_mesh_axes<mesh = @m | #stablehlo.mesh<...>, axes = [...]>``."""
    m = _STABLEHLO_MESH_GROUPS.fullmatch(text.strip())
    if not m:
        raise _unknown("the StableHLO mesh-axes replica groups", text)
    mesh_text = m["mesh"].strip()
    ids = None
    if mesh_text.startswith("@"):
        if mesh_text[1:] not in meshes:
            raise _unknown("the StableHLO mesh-axes replica groups (no sdy.mesh of that name)", text)
        decl = _SDY_MESH.fullmatch(meshes[mesh_text[1:]])
        assert decl is not None  # meshes holds only lines _SDY_MESH matched
        axes = [
            (a["name"], int(a["size"]))
            for a in re.finditer(r'"(?P<name>[^"]+)"\s*=\s*(?P<size>\d+)', decl["axes"])
        ]
        rest = decl["rest"].strip()
        if rest:
            listed = re.fullmatch(r",\s*device_ids\s*=\s*\[(?P<ids>[0-9,\s]*)\]", rest)
            if not listed:
                raise _unknown("the sdy.mesh", meshes[mesh_text[1:]])
            ids = np.array(_ints(listed["ids"]))
    elif mesh_text.startswith("#stablehlo.mesh<"):
        axes = [
            (a["name"], int(a["size"]))
            for a in re.finditer(
                r'#stablehlo\.mesh_axis<\s*name\s*=\s*"(?P<name>[^"]+)"\s*,\s*size\s*=\s*(?P<size>\d+)\s*>',
                mesh_text,
            )
        ]
        if not axes or "device_ids" in mesh_text:
            raise _unknown("the StableHLO mesh", mesh_text)
    else:
        raise _unknown("the StableHLO mesh-axes replica groups (mesh)", text)
    grouped: list[tuple[str, tuple[int, int] | None]] = []
    for ref in re.split(r",\s*(?=[\"#])", m["axes"].strip()) if m["axes"].strip() else ():
        named = re.fullmatch(
            r'"(?P<name>[^"]+)"|#stablehlo\.axis_ref<\s*name\s*=\s*"(?P<ref>[^"]+)"\s*>', ref.strip()
        )
        if not named:  # e.g. a sub-axis, whose StableHLO spelling no supported JAX has printed
            raise _unknown("the StableHLO axis reference", ref)
        grouped.append((named["name"] or named["ref"], None))
    try:
        return mesh_axes_groups(axes, grouped, ids)
    except ValueError as e:
        raise _unknown(f"the StableHLO mesh-axes replica groups ({e})", text) from e


def _stablehlo_attributes(body: str) -> dict[str, str]:
    """``key = value`` pairs of an attribute dictionary's body (values with brackets balanced)."""
    out, depth, key_start, i = {}, 0, 0, 0
    for i, ch in enumerate(body + ","):
        if ch in "<[({":
            depth += 1
        elif ch in ">])}" and not (ch == ">" and body[i - 1 : i] == "-"):
            depth -= 1
        elif ch == "," and depth == 0:
            item = body[key_start:i].strip()
            key, _, value = item.partition("=")
            if item:
                out[key.strip()] = value.strip()
            key_start = i + 1
    return out


_FUNC = re.compile(r"^  func\.func\b[^@\n]*@(?P<name>[\w.$\-]+)\(", re.M)
_CALL = re.compile(r"\b(?:func\.)?call @(?P<name>[\w.$\-]+)\(")
_WHILE = re.compile(r"\bstablehlo\.while\b")


def _stablehlo_multiplicity(text: str) -> Callable[[int], int | None]:
    """How many times an op at a position in the module runs per call of ``@main``.

    Functions are the top-level ``func.func`` blocks (two-space indent, closed by a line
    ``  }``); a private one runs once per ``call`` of it, times its caller's count. An op
    inside a ``stablehlo.while`` body runs an unknown number of times: ``None``. Branches
    of a ``stablehlo.case`` count once each, as in :func:`parse_hlo`.
    """
    funcs: dict[str, tuple[int, int]] = {}
    for m in _FUNC.finditer(text):
        end = text.find("\n  }\n", m.end())
        if end < 0:
            line = text[m.start() : text.find("\n", m.start())]
            raise _unknown("a func.func with no closing line '  }'", line)
        funcs[m["name"]] = (m.start(), end)
    loops = []  # (start, end, trip count or None)
    for m in _WHILE.finditer(text):
        body = text.find(" do {", m.end())
        if body < 0:
            raise _unknown("a stablehlo.while with no 'do {' body", text[m.start() : m.start() + 200])
        end = _closing(text, body + 4, "{", "}")
        loops.append((m.start(), end, _stablehlo_trip_count(text, m.start(), body, end)))

    def enclosing(pos: int) -> str | None:
        return next((name for name, (a, b) in funcs.items() if a <= pos < b), None)

    def loop_factor(pos: int) -> int | None:
        """Product of the trip counts of the loops around ``pos`` (``None`` if one is unknown)."""
        factor: int | None = 1
        for a, b, trips in loops:
            if a <= pos < b:
                factor = None if factor is None or trips is None else factor * trips
        return factor

    def scaled(count: int | None, factor: int | None) -> int | None:
        return None if count is None or factor is None else count * factor

    calls: dict[str, list[int]] = {}
    for m in _CALL.finditer(text):
        calls.setdefault(m["name"], []).append(m.start())
    memo: dict[str, int | None] = {}

    def times(func: str | None, seen: frozenset[str] = frozenset()) -> int | None:
        if func is None or func == "main":
            return 1
        if func in seen:
            raise _unknown(f"a recursive call of @{func}", func)
        if func not in memo:
            total: int | None = 0
            for pos in calls.get(func, ()):
                caller = scaled(times(enclosing(pos), seen | {func}), loop_factor(pos))
                total = None if caller is None or total is None else total + caller
            memo[func] = total
        return memo[func]

    return lambda pos: scaled(times(enclosing(pos)), loop_factor(pos))


_WHILE_HEADER = re.compile(r"stablehlo\.while\((?P<args>[^)]*)\)")
_CONSTANT_DEF = r"{name}\s*=\s*stablehlo\.constant dense<(?P<value>-?\d+)>\s*:\s*tensor<[a-z]*\d+>"


def _stablehlo_trip_count(text: str, start: int, body: int, end: int) -> int | None:
    """Trips of a ``stablehlo.while`` in the counted form JAX lowers ``fori_loop`` and ``scan`` to.

    The condition is ``compare LT, %i, %N`` on one loop variable; ``%i`` starts at a constant and
    the body returns ``%i + step`` for a constant step in its place. Any other loop is one whose
    trips this parser cannot know: ``None``, which byte accounting reports as unbounded.
    """
    header = _WHILE_HEADER.match(text, start)
    if not header:
        return None
    args = [a.split("=") for a in header["args"].split(",")]
    if any(len(a) != 2 for a in args):
        return None
    names, inits = [a[0].strip() for a in args], [a[1].strip() for a in args]
    cond = text[start:body]
    compare = re.search(r"stablehlo\.compare\s+LT,\s*(?P<i>%[\w#]+),\s*(?P<n>%[\w#]+)", cond)
    if not compare or compare["i"] not in names:
        return None
    k = names.index(compare["i"])

    def constant(name: str, before: int) -> int | None:
        found = list(re.finditer(_CONSTANT_DEF.format(name=re.escape(name)), text[:before]))
        return int(found[-1]["value"]) if found else None  # the nearest definition before its use

    bound, first = constant(compare["n"], compare.end() + start), constant(inits[k], start)
    returned = re.findall(r"stablehlo\.return\s+([^:]*):", text[body:end])
    if bound is None or first is None or not returned:
        return None
    results = [r.strip() for r in returned[-1].split(",")]
    if len(results) != len(names):
        return None
    step_def = re.search(re.escape(results[k]) + r"\s*=\s*stablehlo\.add\s+" + re.escape(names[k])
                         + r",\s*(?P<c>%[\w#]+)", text[body:end])  # fmt: skip
    step = constant(step_def["c"], body + step_def.end()) if step_def else None
    if not step or step <= 0:
        return None
    return max(0, -(-(bound - first) // step))


def parse_stablehlo(text: str) -> CollectiveSummary:
    """Collectives in a lowered (not yet compiled) StableHLO module, e.g. one lowered for TPU.

    Each op is read in JAX's generic form, ``"stablehlo.x"(operands) <{attrs}>
    ({region})? : (types) -> types``, its attributes from its own dictionary
    only. Its multiplicity comes from the call graph of the module's functions
    (``None`` inside a ``stablehlo.while``); the types are the target's own, so a
    bfloat16 transfer counts 2 bytes an element here, where XLA CPU's compiled
    module converts it to float32 first.
    """
    multiplicity = _stablehlo_multiplicity(text)
    meshes = {m["name"]: m[0] for m in _SDY_MESH.finditer(text)}
    counts = {"num_replicas": 1, "num_partitions": 1}
    header = re.search(r"^\s*module\b.*$", text, re.M)
    if header:
        counts.update((m["key"], int(m["n"])) for m in _MLIR_MODULE_COUNT.finditer(header[0]))
    ops = []
    for m in _STABLEHLO_OP.finditer(text):
        kind = m["op"].replace("_", "-")
        line = text[m.start() : text.find("\n", m.start())]
        call = re.compile(r'"?\s*\((?P<operands>[^)]*)\)\s*').match(text, m.end())
        if not call or not text.startswith("<{", call.end()):
            raise _unknown(
                f"the StableHLO {kind} (not in the generic form with an attribute dictionary)", line
            )
        attrs_end = _closing(text, call.end() + 1, "{", "}")
        attrs = _stablehlo_attributes(text[call.end() + 2 : attrs_end - 1])
        after = attrs_end + 1
        region = re.compile(r"\s*\(\{").match(text, after)
        if region:
            after = _closing(text, region.end() - 2, "(", ")")
        sig = re.compile(r"\s*:\s*\((?P<ins>[^)]*)\)\s*->").match(text, after)
        if not sig:
            raise _unknown(f"the StableHLO {kind} (no function type after it)", line)
        shapes_in = tuple(
            Shape(
                _MLIR_TO_HLO_DTYPE.get(t["dtype"], t["dtype"]),
                tuple(int(d) for d in t["dims"].split("x") if d),
            )
            for t in _STABLEHLO_TYPE.finditer(sig["ins"])
        )
        pairs, groups = None, None
        if kind == "collective-permute":
            if "source_target_pairs" not in attrs:
                raise _unknown("a StableHLO collective_permute without source_target_pairs", line)
            array = _dense_ints(attrs["source_target_pairs"], "the StableHLO source_target_pairs")
            if array.size and (array.ndim != 2 or array.shape[1] != 2):
                raise _unknown("the StableHLO source_target_pairs (not pairs)", attrs["source_target_pairs"])
            pairs = tuple((int(a), int(b)) for a, b in array.reshape(-1, 2))
        else:
            value = attrs.get("replica_groups")
            if value is None:
                raise _unknown(f"a StableHLO {kind} without replica_groups", line)
            if value.startswith("dense<"):
                array = _dense_ints(value, "the StableHLO replica_groups")
                parsed = _rows(array, array.shape[-1]) if array.size else ()
            else:
                parsed = _stablehlo_mesh_groups(value, meshes)
            groups = _participants(
                parsed,
                kind=kind,
                has_channel="channel_handle" in attrs,
                global_ids="use_global_device_ids" in attrs,
                replicas=counts["num_replicas"],
                partitions=counts["num_partitions"],
                text=value,
            )
        ops.append(
            CollectiveOp(
                kind=kind,
                phase="sync",
                name=m["result"].split(",")[0].strip(),
                computation="",
                operand_shapes=shapes_in,
                result_shapes=(),
                source_target_pairs=pairs,
                replica_groups=groups,
                multiplicity=multiplicity(m.start()),
            )
        )
    return CollectiveSummary(tuple(ops))


def disallowed(summary: CollectiveSummary, allowed: Iterable[str]) -> tuple[CollectiveOp, ...]:
    """The collectives of ``summary`` whose kind is not in ``allowed``."""
    allowed = frozenset(allowed)
    return tuple(op for op in summary.ops if op.kind not in allowed)
