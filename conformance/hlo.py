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
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections import defaultdict
from collections.abc import Iterable

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
_PAIRS = re.compile(r"source_target_pairs=\{(?P<body>[0-9,{}\s]*)\}")
_GROUPS = re.compile(r"replica_groups=(?P<body>\{[0-9,{}\s]*\}|\[[0-9,]+\]<=\[[0-9,]+\](?:T\([0-9,]+\))?)")
_CALLEE = re.compile(r"\b(?:body|condition|calls|to_apply|true_computation|false_computation)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_TRIP = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"?(\d+)"?')


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


def _nested_ints(body: str) -> tuple[tuple[int, ...], ...]:
    return tuple(
        tuple(int(x) for x in group.split(",") if x.strip()) for group in re.findall(r"\{([0-9,\s]*)\}", body)
    )


def _iota_groups(text: str) -> tuple[tuple[int, ...], ...]:
    """Expand the compact ``[G,S]<=[dims]T(perm)`` replica-group form."""
    m = re.match(r"\[([0-9,]+)\]<=\[([0-9,]+)\](?:T\(([0-9,]+)\))?", text)
    assert m, text
    out_dims = [int(x) for x in m[1].split(",")]
    src_dims = [int(x) for x in m[2].split(",")]
    ids = list(range(math.prod(src_dims)))
    if m[3]:
        perm = [int(x) for x in m[3].split(",")]
        strides = [math.prod(src_dims[i + 1 :]) for i in range(len(src_dims))]
        new_dims = [src_dims[p] for p in perm]
        ids = []
        for flat in range(math.prod(new_dims)):
            idx, rem = [], flat
            for d in reversed(new_dims):
                idx.append(rem % d)
                rem //= d
            idx.reverse()
            ids.append(sum(idx[k] * strides[perm[k]] for k in range(len(perm))))
    size = out_dims[-1]
    return tuple(tuple(ids[i : i + size]) for i in range(0, len(ids), size))


def parse_hlo(text: str) -> CollectiveSummary:
    """Every collective in a compiled HLO module's text, with multiplicities."""
    computations: dict[str, list[tuple[str, str, str, str]]] = defaultdict(list)
    entry = None
    current = None
    for line in text.splitlines():
        if not line.strip() or line.lstrip().startswith(("//", "HloModule")):
            continue
        inst = _INSTRUCTION.match(line)
        if inst and current is not None:
            operands, attrs = _split_call(inst["rest"])
            computations[current].append(
                (inst["name"], inst["type"], inst["opcode"], operands + "\x00" + attrs)
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
        for _name, _type, opcode, payload in computations.get(comp, ()):
            attrs = payload.split("\x00", 1)[1]
            callees = _CALLEE.findall(attrs)
            for branch in _BRANCHES.findall(attrs):
                callees += [c.strip().lstrip("%") for c in branch.split(",") if c.strip()]
            if not callees:
                continue
            factor: int | None = 1
            if opcode == "while":
                trip = _TRIP.search(attrs)
                factor = int(trip[1]) if trip else None
            for callee in callees:
                t = None if times is None or factor is None else times * factor
                if callee in multiplicity:
                    prev = multiplicity[callee]
                    t = None if prev is None or t is None else prev + t
                multiplicity[callee] = t
                order.append(callee)

    ops = []
    for comp, insts in computations.items():
        if comp not in multiplicity:
            continue  # unreachable from ENTRY (dead helper computations)
        types = {name: typ for name, typ, _, _ in insts}
        for name, typ, opcode, payload in insts:
            base, phase = opcode, "sync"
            for suffix in ("-start", "-done"):
                if opcode.endswith(suffix):
                    base, phase = opcode[: -len(suffix)], suffix[1:]
            if base not in COLLECTIVE_KINDS:
                continue
            operands, attrs = payload.split("\x00", 1)
            operand_shapes = tuple(s for n in _operand_names(operands) for s in _shapes(types.get(n, "")))
            pairs = _PAIRS.search(attrs)
            groups = _GROUPS.search(attrs)
            replica_groups = None
            if groups:
                body = groups["body"]
                replica_groups = _nested_ints(body) if body.startswith("{") else _iota_groups(body)
            ops.append(
                CollectiveOp(
                    kind=base,
                    phase=phase,
                    name=name,
                    computation=comp,
                    operand_shapes=operand_shapes,
                    result_shapes=_shapes(typ),
                    source_target_pairs=(
                        tuple((a, b) for a, b in _nested_ints(pairs["body"])) if pairs else None
                    ),
                    replica_groups=replica_groups,
                    multiplicity=multiplicity[comp],
                )
            )
    return CollectiveSummary(tuple(ops))


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


def parse_stablehlo(text: str) -> CollectiveSummary:
    """Collectives in a lowered (not yet compiled) StableHLO module, e.g. one lowered for TPU.

    Multiplicity is not tracked here (loops are ``stablehlo.while`` regions);
    use this for *which* collectives a target will see, and :func:`parse_hlo`
    for byte accounting.
    """
    ops = []
    lines = text.splitlines()
    for i, line in enumerate(lines):
        m = _STABLEHLO_OP.search(line)
        if not m:
            continue
        # The function type "(operands) -> results" closes the op, possibly lines later.
        tail = " ".join(lines[i : i + 40])
        sig = re.search(r":\s*\((?P<ins>[^)]*)\)\s*->\s*(?P<outs>[^\n]*?)(?:$|\s{2}|\s%)", tail)
        shapes_in: tuple[Shape, ...] = ()
        if sig:
            shapes_in = tuple(
                Shape(_MLIR_TO_HLO_DTYPE.get(t["dtype"], t["dtype"]),
                      tuple(int(d) for d in t["dims"].split("x") if d))
                for t in _STABLEHLO_TYPE.finditer(sig["ins"])
            )  # fmt: skip
        pairs = re.search(r"source_target_pairs\s*=\s*dense<(\[\[.*?\]\])>", tail)
        groups = re.search(r"replica_groups\s*=\s*dense<(\[\[.*?\]\]|\[\])>", tail)
        ops.append(
            CollectiveOp(
                kind=m["op"].replace("_", "-"),
                phase="sync",
                name=m["result"].split(",")[0].strip(),
                computation="",
                operand_shapes=shapes_in,
                result_shapes=(),
                source_target_pairs=(tuple(tuple(p) for p in json.loads(pairs[1])) if pairs else None),
                replica_groups=(tuple(tuple(g) for g in json.loads(groups[1])) if groups else None),
                multiplicity=1,
            )
        )
    return CollectiveSummary(tuple(ops))


def disallowed(summary: CollectiveSummary, allowed: Iterable[str]) -> tuple[CollectiveOp, ...]:
    """The collectives of ``summary`` whose kind is not in ``allowed``."""
    allowed = frozenset(allowed)
    return tuple(op for op in summary.ops if op.kind not in allowed)
