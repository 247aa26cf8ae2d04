"""What the HLO readers return: shapes, collective ops with their groups and multiplicity, and a
module's summary (bytes a device receives per call)."""

from __future__ import annotations

import dataclasses
import math
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
    "pred": 8,
    "s2": 2,
    "u2": 2,
    "s4": 4,
    "u4": 4,
    "s8": 8,
    "u8": 8,
    "s16": 16,
    "u16": 16,
    "s32": 32,
    "u32": 32,
    "s64": 64,
    "u64": 64,
    "f16": 16,
    "bf16": 16,
    "f32": 32,
    "f64": 64,
    "c64": 64,
    "c128": 128,
    "f8e4m3fn": 8,
    "f8e5m2": 8,
    "f8e4m3": 8,
    "f8e4m3fnuz": 8,
    "f8e5m2fnuz": 8,
    "f8e4m3b11fnuz": 8,
    "f8e3m4": 8,
    "f4e2m1fn": 4,
    "f8e8m0fnu": 8,
    "token": 0,
}


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
    def bits(self) -> int:
        """Bits per element (0 where the element type is not known here)."""
        return _DTYPE_BITS.get(self.dtype, 0)

    @property
    def nbytes(self) -> int:
        return math.ceil(self.bits * math.prod(self.dims) / 8)

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
    #: The JAX op it came from (a compiled module's ``metadata={op_name=...}``; ``""`` where none).
    op_name: str = ""

    @property
    def operand_bytes(self) -> int:
        return sum(s.nbytes for s in self.operand_shapes)

    @property
    def group_size(self) -> int:
        if self.replica_groups:
            return max(len(g) for g in self.replica_groups)
        return 0

    def received_bytes(self, device: int | None = None) -> int:
        """Bytes one execution of this op delivers to ``device`` (any target if ``None``) from another
        device: a pair whose source is its target (a ring of one's shift, which XLA keeps as a
        collective-permute) moves nothing between devices."""
        if self.phase == "done":
            return 0  # counted once, at the start
        if self.kind == "collective-permute":
            if self.source_target_pairs is not None:
                crossing = {t for s, t in self.source_target_pairs if s != t}
                if not crossing or (device is not None and device not in crossing):
                    return 0
            data = self.operand_shapes[:1] if self.phase == "start" else self.operand_shapes
            return sum(s.nbytes for s in data)
        g = self.group_size
        if self.kind == "ragged-all-to-all":
            # how many rows arrive is data; at most the output buffer (its result) is written by others
            return sum(s.nbytes for s in self.result_shapes) if g != 1 else 0
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
        return self._most_received()[1]

    def _most_received(self) -> tuple[int | None, int | None, bool]:
        """(the device that receives most per call, ``None`` where no op names devices; its bytes per
        call, ``None`` if a loop bound is unknown; whether every device receives as much)."""
        devices: set[int | None] = {None}
        for op in self.ops:
            for src, dst in op.source_target_pairs or ():
                devices.update((src, dst))
        if len(devices) > 1:
            devices.discard(None)
        totals: dict[int | None, int] = {}
        for device in sorted(devices, key=lambda d: -1 if d is None else d):
            total = 0
            for op in self.ops:
                per_call = op.received_bytes(device)
                if per_call and op.multiplicity is None:
                    return device, None, False
                total += per_call * (op.multiplicity or 0)
            totals[device] = total
        most = max(totals.values())
        device = next(d for d, total in totals.items() if total == most)
        return device, most, len(set(totals.values())) == 1

    def byte_lines(self, *, summed: bool = True) -> list[str]:
        """A failure's lines for the module's collectives: each with the bytes its runs deliver per call
        to the device that receives most (one of them, where every device receives alike), then
        (``summed``) their sum, the bytes that device receives; not where the caller counts some of them
        otherwise (a ragged all-to-all's rows as it moves them)."""
        if not self.ops:
            return ["  (none)"]
        device, total, alike = self._most_received()
        lines = []
        for op in self.ops:
            per_call = op.received_bytes(device)
            runs = op.multiplicity
            said = (
                "? bytes (a loop of unknown trip count)"
                if per_call and runs is None
                else f"{per_call * (runs or 0)} bytes"
            )
            lines.append(f"  {op.describe()}: {said}")
        to = "each device" if alike else f"device {device}, which receives most"
        said = f"{total} bytes to {to}" if total is not None else "unbounded (a loop of unknown trip count)"
        return [*lines, f"  in all: {said}, per call"] if summed else lines


# ----------------------------------------------------------------------------- compiled HLO
def disallowed(summary: CollectiveSummary, allowed: Iterable[str]) -> tuple[CollectiveOp, ...]:
    """The collectives of ``summary`` whose kind is not in ``allowed``. A kind qualified by a dtype
    (``all-gather:s32``) is allowed of operands of that dtype alone: a few routing ints, not rows."""
    allowed = frozenset(allowed)

    def fits(op: CollectiveOp) -> bool:
        dtypes = {s.dtype for s in op.operand_shapes}
        return op.kind in allowed or (bool(dtypes) and all(f"{op.kind}:{d}" in allowed for d in dtypes))

    return tuple(op for op in summary.ops if not fits(op))


def allowed_text(allowed: Iterable[str]) -> str:
    """``allowed`` as a failure's line says it (``all-gather of s32 only``), or ``none``."""
    kinds: dict[str, list[str]] = {}
    for entry in sorted(allowed):
        kind, _, dtype = entry.partition(":")
        kinds.setdefault(kind, []).append(dtype)
    said = [
        kind if "" in dtypes else f"{kind} of {'/'.join(dtypes)} only"
        for kind, dtypes in sorted(kinds.items())
    ]
    return ", ".join(said) or "none"


def _signature(op: CollectiveOp) -> tuple:
    """What identifies a collective across a lowered module and its compiled form: kind, operand dims
    (not dtypes: XLA:CPU widens 16-bit transfers), and the pairs or groups."""
    return (op.kind, tuple(s.dims for s in op.operand_shapes), op.source_target_pairs, op.replica_groups)


def less_what_compiling_removes(
    lowered: CollectiveSummary, compiled: CollectiveSummary
) -> tuple[CollectiveSummary, list[str]]:
    """``lowered`` (a module lowered for a target whose compiler is not here) less the runs of its
    collectives that the compiled module of the same program no longer has, and a line per op said so.

    XLA's loop simplification and dead-code elimination run for every target: a one-trip loop is
    inlined, and a transfer whose result nothing reads is then removed (a ring that permutes its
    block once more after the last use, on a ring of 2). A collective's runs are lowered only where
    the compiled module keeps at least one of the same kind, dims and pairs or groups, and fewer of
    them (a compiler that combined or split collectives changes their dims, and nothing is taken off);
    runs of unknown count are left as they are.
    """
    kept: dict[tuple, int] = {}
    for op in compiled.ops:
        if op.phase != "done" and op.multiplicity is not None:
            kept[_signature(op)] = kept.get(_signature(op), 0) + op.multiplicity
    lowered_runs: dict[tuple, int | None] = {}
    for op in lowered.ops:
        runs = lowered_runs.get(_signature(op), 0)
        lowered_runs[_signature(op)] = (
            None if runs is None or op.multiplicity is None else runs + op.multiplicity
        )
    surplus = {
        sig: runs - kept[sig]
        for sig, runs in lowered_runs.items()
        if runs is not None and 1 <= kept.get(sig, 0) < runs
    }
    ops, lines = [], []
    for op in reversed(lowered.ops):  # the last runs of a signature go first: a loop's trailing one
        extra = surplus.get(_signature(op), 0)
        take = min(extra, op.multiplicity or 0)
        if take:
            surplus[_signature(op)] = extra - take
            lines.append(
                f"  {op.describe()}: {take} of its runs not counted (the compiled module of the same "
                "program no longer has them)"
            )
            op = dataclasses.replace(op, multiplicity=op.multiplicity - take)
        if op.multiplicity != 0:
            ops.append(op)
    return CollectiveSummary(tuple(reversed(ops))), lines[::-1]
