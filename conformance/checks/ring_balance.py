"""What a bidirectional ring promises: half of each block each way round the ring.

A ring that sends the top rows of each block one way and the rest the other uses both directions of
every link at once, and a link's time is then the larger direction's. Split a third one way and two
thirds the other, such a ring still gives exact values, hides its transfers as well in a schedule,
and moves no more bytes in all: only the time of its transfers tells, a third longer than the
balanced split's. So a kernel that declares itself bidirectional (``register(...,
bidirectional=True)``) has the bytes of its compiled module held to the balanced split, per ring
direction.

How it is read. Every collective-permute of the compiled module whose pairs all move along the mesh
axis the kernel runs over by the same number of hops is a transfer of that ring direction: +1 (each
position to the next, ``d -> d+1 mod n``) or -1 (``d -> d-1``). Pairs are read in the module's
partition ids, the mesh's positions in its own device order, so a ring over a permuted or 2-D mesh
is read as the ring it is. A device's bytes per call in each direction count a loop's transfers once
per trip. On a ring of two the two directions are the same pairs: the check runs on rings of three
or more.

What balanced means. A block cut in two along one of its dims, ``ceil`` and ``floor`` of that
extent, gives halves that differ by one slice along it where the extent is odd: a 3-row block's 2 and
1 rows. So the directions may differ by one slice of each transfer of the larger direction, along its
shortest dim (which is at least the slice along whatever dim the kernel cut: rows, columns or a
batch); a transfer of one row cannot be cut and may go one way whole. Any more is a split that is not
the halves. A Pallas kernel moves its rows by DMAs inside the kernel, which the compiled module does
not show: its directions are not read here, and its test is not made (the Pallas rings' halves are
their docstrings' and the values check's).
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict

import numpy as np

from conformance import hlo, runner
from conformance.checks.base import Axes, Check, NotJudged, call_kernel, fail, keeping
from conformance.runner import Case

#: The two ring directions, as a shift along the mesh axis, and their names in failures.
DIRECTIONS = {+1: "d -> d+1", -1: "d -> d-1"}


@dataclasses.dataclass(frozen=True)
class DirectionRecord:
    """Bytes one device receives per call in each ring direction, for the run's table."""

    family: str
    impl: str
    mesh: str
    forward: int  #: +1 direction
    backward: int  #: -1 direction

    @property
    def larger_share(self) -> float | None:
        total = self.forward + self.backward
        return max(self.forward, self.backward) / total if total else None


def ring_shift(pair: tuple[int, int], *, mesh_shape: tuple[int, ...], axis: int) -> int | None:
    """The hops ``pair`` (partition ids) moves along mesh axis ``axis``, as a shift in
    ``(-n/2, n/2]``; ``None`` if it also moves along another axis."""
    src, dst = (np.unravel_index(p, mesh_shape) for p in pair)
    if any(s != d for i, (s, d) in enumerate(zip(src, dst, strict=True)) if i != axis):
        return None
    n = mesh_shape[axis]
    shift = (int(dst[axis]) - int(src[axis])) % n
    return shift - n if shift > n // 2 else shift


@dataclasses.dataclass
class Direction:
    """What one device receives per call by one shift along the axis: bytes, and the slack a balanced
    cut allows (one slice of each transfer along its shortest dim)."""

    received: int = 0
    slack: int = 0


def by_direction(
    summary: hlo.CollectiveSummary, *, mesh_shape: tuple[int, ...], axis: int
) -> tuple[dict[int | None, Direction], list[str]]:
    """Per shift (``None``: transfers along no one shift of the axis), the device that receives most,
    and a line per collective-permute saying which shift it is. Raises ``NotJudged`` for a transfer in a
    loop of unknown trip count."""
    per_device: dict[int | None, dict[int, Direction]] = defaultdict(lambda: defaultdict(Direction))
    lines = []
    for op in summary.of_kind("collective-permute"):
        pairs = [p for p in op.source_target_pairs or () if p[0] != p[1]]
        if not pairs or op.phase == "done":
            continue
        shifts = {ring_shift(p, mesh_shape=mesh_shape, axis=axis) for p in pairs}
        shift = shifts.pop() if len(shifts) == 1 else None
        if op.multiplicity is None:
            raise NotJudged(
                f"{op.describe()} runs in a loop of unknown trip count: its bytes cannot be counted"
            )
        lines.append(f"  {DIRECTIONS.get(shift, 'neither ring direction'):<22} {op.describe()}")
        extents = [d for d in op.operand_shapes[0].dims if d > 0] if op.operand_shapes else []
        for _, target in pairs:
            received = op.received_bytes(target) * op.multiplicity
            per_device[shift][target].received += received
            per_device[shift][target].slack += received // min(extents, default=1)
    return {
        shift: max(devices.values(), key=lambda d: d.received) for shift, devices in per_device.items()
    }, lines


def check_direction_balance(case: Case) -> DirectionRecord:
    """A kernel declared bidirectional moves half of each block each way: the bytes a device receives
    per call in the two ring directions differ by at most one slice of a halved extent per transfer."""
    if case.implementation.pallas:
        raise NotJudged(
            "a Pallas kernel moves its rows by DMAs inside the kernel, which the compiled module does not "
            "show; its directions are not read here"
        )
    summary = hlo.parse_hlo(call_kernel(case, "direction_balance", lambda: runner.compiled(case).as_text()))
    mesh = case.mesh
    axis = mesh.axis_names.index(mesh.axis_name)
    directions, lines = by_direction(summary, mesh_shape=mesh.shape, axis=axis)
    forward, backward = directions.get(+1, Direction()), directions.get(-1, Direction())
    record = DirectionRecord(case.family, case.impl, mesh.label, forward.received, backward.received)
    total = forward.received + backward.received
    if not total:
        raise NotJudged(
            "the compiled module has no collective-permute along the ring: there are no ring directions "
            "to weigh (the collectives check judges what it moves instead)"
        )
    larger, smaller = (forward, backward) if forward.received >= backward.received else (backward, forward)
    with keeping([record]):
        if larger.received - smaller.received > larger.slack:
            name = "d -> d+1" if larger is forward else "d -> d-1"
            share = larger.received / total
            raise fail(
                case,
                "direction_balance",
                "a ring declared bidirectional moves more of each block one way than the other",
                [
                    f"bytes received per device per call: {forward.received} going d -> d+1, "
                    f"{backward.received} going d -> d-1 ({total} in all)",
                    f"{name} carries {share:.0%} of them, {larger.received - smaller.received} bytes more "
                    "than the other; halves of a block differ by one slice along a dim at most, "
                    f"{larger.slack} bytes here",
                    f"on a link that carries both directions at once the transfers take as long as {name}'s, "
                    f"{share / 0.5 - 1:.0%} longer than the balanced split's: cut each block in two halves, "
                    "ceil and floor of one dim",
                    "collective-permutes of the compiled module, by ring direction:",
                    *lines,
                ],
            )
    return record


def direction_table(records: list[DirectionRecord]) -> list[tuple[str, list[str]]]:
    """Per implementation: the larger direction's share of a bidirectional ring's bytes."""
    by_impl: dict[tuple[str, str], list[DirectionRecord]] = defaultdict(list)
    for record in records:
        by_impl[(record.family, record.impl)].append(record)
    if not by_impl:
        return []
    width = max(len(impl) for _, impl in by_impl)
    lines = []
    for (family, impl), recs in sorted(by_impl.items()):
        shares = [r.larger_share for r in recs if r.larger_share is not None]
        span = f"{min(shares):.0%}-{max(shares):.0%}" if shares else "n/a"
        lines.append(
            f"{family:<21} {impl:<{width}}  larger direction {span:>9} of the bytes on {len(recs)} cases"
        )
    return [("bidirectional rings: the larger direction's share of the bytes (compiled module)", lines)]


CHECKS = (
    Check(
        "direction_balance",
        check_direction_balance,
        concern="performance",
        tables=direction_table,
        # the cut follows the block's extents (odd and even) and the ring's kind; rings of 3 or more, where
        # the two directions are different pairs
        # the DMAs of a Pallas kernel are inside it, where the compiled module does not show them
        axes=Axes(
            meshes="covering", shapes=True, implementations=("bidirectional", "not_pallas"), min_ring=3
        ),
    ),
)
