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
the halves.

A Pallas kernel moves its rows by DMAs inside the kernel, which the compiled module does not show:
its directions are read from a run in TPU interpret mode instead (``dma_direction_balance``), every
remote DMA noted as the interpreter reads its source (:func:`conformance.compat.note_interpreted_copies`:
source and target device, shape and bytes), each weighed as a collective-permute's pairs are. It runs
at the family's TPU-native dims, where a block fills whole TPU tiles an even number of times: a
Pallas kernel cuts its blocks where a chip's DMA windows may be cut, on tile boundaries, and a block
of one tile (every block at the small fixed shapes) cannot be halved on a chip at all.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict

import numpy as np

from conformance import compat, hlo, runner
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


def _most_received(per_device: dict[int | None, dict[int, Direction]]) -> dict[int | None, Direction]:
    """Per shift, the device that receives most that way, with its own transfers the other ways
    (:attr:`Direction.others`), so that a failure compares one device's two directions."""
    most = {}
    for shift, devices in per_device.items():
        device, direction = max(devices.items(), key=lambda item: item[1].received)
        direction.device = device
        direction.others = {
            other: per_device[other][device]
            for other in per_device
            if other != shift and device in per_device[other]
        }
        most[shift] = direction
    return most


@dataclasses.dataclass
class Direction:
    """What one device receives per call by one shift along the axis: bytes, and the slack a balanced
    cut allows (one slice of each transfer along its shortest dim)."""

    received: int = 0
    slack: int = 0
    #: Each transfer's bytes, in the order the module (or the interpreter) has them.
    transfers: list[int] = dataclasses.field(default_factory=list)
    #: The device (partition id) it is of, and that device's own transfers by the other shifts.
    device: int = -1
    others: dict = dataclasses.field(default_factory=dict)


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
            per_device[shift][target].transfers += [op.received_bytes(target)] * op.multiplicity
    return _most_received(per_device), lines


def interpreted_by_direction(
    copies: list[tuple[int, int, tuple[int, ...], int]], *, mesh_shape: tuple[int, ...], axis: int
) -> tuple[dict[int | None, Direction], list[str]]:
    """:func:`by_direction` for a Pallas kernel's remote DMAs in one interpreted call (source, target,
    shape, bytes), and a line per kind of DMA: its direction, shape, bytes and how many there were."""
    per_device: dict[int | None, dict[int, Direction]] = defaultdict(lambda: defaultdict(Direction))
    kinds: dict[tuple[int | None, tuple[int, ...], int], int] = defaultdict(int)
    for source, target, shape, nbytes in copies:
        if source == target:  # a copy within a device (HBM to VMEM): no link carries it
            continue
        shift = ring_shift((source, target), mesh_shape=mesh_shape, axis=axis)
        per_device[shift][target].received += nbytes
        per_device[shift][target].slack += nbytes // min(shape[-2:], default=1)
        per_device[shift][target].transfers.append(nbytes)
        kinds[(shift, shape, nbytes)] += 1
    lines = [
        f"  {DIRECTIONS.get(shift, 'neither ring direction'):<22} {count} remote DMAs of {list(shape)}, "
        f"{nbytes} bytes each"
        for (shift, shape, nbytes), count in sorted(kinds.items(), key=lambda k: (str(k[0][0]), k[0][1:]))
    ]
    return _most_received(per_device), lines


def check_direction_balance(case: Case) -> DirectionRecord:
    """A kernel declared bidirectional moves half of each block each way: the bytes a device receives
    per call in the two ring directions differ by at most one slice of a halved extent per transfer."""
    mesh = case.mesh
    axis = mesh.axis_names.index(mesh.axis_name)
    check = "dma_direction_balance" if case.implementation.pallas else "direction_balance"
    if case.implementation.pallas:
        with compat.note_interpreted_copies() as copies:
            call_kernel(case, check, lambda: runner.execute(case))
        directions, lines = interpreted_by_direction(copies, mesh_shape=mesh.shape, axis=axis)
        read_from = "the kernel's remote DMAs in TPU interpret mode, by ring direction:"
    else:
        text = call_kernel(case, check, lambda: runner.compiled(case).as_text())
        directions, lines = by_direction(hlo.parse_hlo(text), mesh_shape=mesh.shape, axis=axis)
        read_from = "collective-permutes of the compiled module, by ring direction:"
    forward, backward = directions.get(+1, Direction()), directions.get(-1, Direction())
    record = DirectionRecord(case.family, case.impl, mesh.label, forward.received, backward.received)
    total = forward.received + backward.received
    if not total:
        raise NotJudged(
            "no transfer along the ring (a collective-permute, or a Pallas kernel's remote DMA): there are "
            "no ring directions to weigh (the collectives check judges what it moves instead)"
        )
    larger, smaller = (forward, backward) if forward.received >= backward.received else (backward, forward)
    with keeping([record]):
        if larger.received - smaller.received > larger.slack:
            name = "d -> d+1" if larger is forward else "d -> d-1"
            other = "d -> d-1" if larger is forward else "d -> d+1"
            share = larger.received / total
            raise fail(
                case,
                check,
                "a ring declared bidirectional moves more of each block one way than the other",
                [
                    f"bytes received per device per call: {forward.received} going d -> d+1, "
                    f"{backward.received} going d -> d-1 ({total} in all)",
                    f"{name} carries {share:.0%} of them, {larger.received - smaller.received} bytes more "
                    "than the other; halves of a block differ by one slice along a dim at most, "
                    f"{larger.slack} bytes here",
                    *_what_differs(larger, +1 if larger is backward else -1, name, other),
                    f"on a link that carries both directions at once the transfers take as long as {name}'s, "
                    f"{share / 0.5 - 1:.0%} longer than the balanced split's",
                    read_from,
                    *lines,
                ],
            )
    return record


#: Steps listed one by one in a failure (the rest counted).
SHOWN_STEPS = 8


def _what_differs(larger: Direction, other_shift: int, name: str, other: str) -> list[str]:
    """What the device that receives most one way received, transfer by transfer each way, and the
    advice that fits: transfers the other way lacks (more steps one way), or transfers of unequal size
    (a block not cut in halves)."""
    big, small = larger.transfers, larger.others.get(other_shift, Direction()).transfers
    steps = [
        f"  transfer {i + 1:>2}: {big[i] if i < len(big) else 'none':>8} going {name}, "
        f"{small[i] if i < len(small) else 'none':>8} going {other}"
        for i in range(min(max(len(big), len(small)), SHOWN_STEPS))
    ]
    if max(len(big), len(small)) > SHOWN_STEPS:
        steps.append(f"  ... and {max(len(big), len(small)) - SHOWN_STEPS} more transfers")
    counted = (
        f"counted on device {larger.device} (it receives most going {name}): {len(big)} transfers going "
        f"{name}, {len(small)} going {other}, in the order they ran (bytes):"
    )
    if len(big) > len(small):
        extra = len(big) - len(small)
        said = (
            f"the {_ordinal(len(small) + 1)} transfer going {name} and after"
            if extra > 1
            else f"the {_ordinal(len(big))} transfer going {name} ({big[-1]} bytes)"
        )
        return [
            counted,
            *steps,
            f"why            : {extra} transfer{'s' if extra > 1 else ''} more going {name} than {other}: "
            f"{said} has no counterpart the other way: send as many steps each way (a last transfer whose "
            "data no device reads, a step count taken from the other direction's)",
        ]
    return [
        counted,
        *steps,
        f"why            : as many transfers each way, each larger going {name}: cut each block in two "
        "halves, ceil and floor of one dim",
    ]


def _ordinal(n: int) -> str:
    return f"{n}{'th' if 10 <= n % 100 <= 20 else {1: 'st', 2: 'nd', 3: 'rd'}.get(n % 10, 'th')}"


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
    title = "bidirectional rings: the larger direction's share of the bytes (compiled module; Pallas: DMAs)"
    return [(title, lines)]


CHECKS = (
    Check(
        "direction_balance",
        check_direction_balance,
        concern="performance",
        tables=direction_table,
        # the cut follows the block's extents (odd and even) and the ring's kind; rings of 3 or more, where
        # the two directions are different pairs
        axes=Axes(
            meshes="covering",
            shapes=True,
            implementations=("bidirectional", "not_pallas"),
            min_ring=3,
        ),
    ),
    Check(
        "dma_direction_balance",
        check_direction_balance,
        concern="performance",
        tables=direction_table,
        # a Pallas kernel's remote DMAs, from a run in TPU interpret mode at the TPU-native dims (module
        # doc): a ring of 5 (steps both ways) and a ring on the second axis of a 2-D mesh (the devices'
        # logical ids read as mesh coordinates); rings of 8 at these dims exceed what interpret mode
        # holds on a 2-core host
        axes=Axes(
            case="tpu_native",
            meshes=("5-x-explicit", "2x3-y-explicit"),
            platforms=False,
            implementations=("bidirectional", "pallas"),
        ),
        doc="Pallas kernels declared bidirectional: their remote DMAs' bytes per ring direction, held to "
        "halves (interpret mode, TPU-native dims).",
    ),
)
