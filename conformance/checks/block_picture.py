"""The block map as a picture: devices in ring order by the result's row blocks, each cell saying whose
data that block of that device's result holds, so that a pattern (a diagonal one step over, a column
of zeros) shows at a glance where the block map's sentences name blocks one by one::

    block picture  : whose row block each block of the result holds (. right, - zeros, ? mixed or
                     part right; blank: not on that device), devices by ring position:
      block                0  1  2  3
      device 0 (p0)        .  3  .  .
      device 1 (p1)        .  .  0  .

A block family's row block ``r`` is ring position ``r``'s block (an all-gather's); a partial family's
is row block ``r`` of every device's partial (a reduce-scatter's), the cell a number where every
partial brought that block's rows. The failure message carries the picture as these lines, which the
HTML report draws as a coloured grid (:func:`parse`); the terminal shows them as they are.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

#: How the picture's first line begins, and the label of its header row.
PREFIX = "block picture  :"
HEADER = "  block"
RIGHT, ZEROS, MIXED = ".", "-", "?"
#: The width of a row's label column, so that the cells line up under the header.
_LABEL = 20


@dataclasses.dataclass(frozen=True)
class Picture:
    """The picture read back from a message: the header's block labels, and each row's label and
    cells (``""``: a block that device does not hold)."""

    blocks: tuple[str, ...]
    rows: tuple[tuple[str, tuple[str, ...]], ...]


def cell(runs: Sequence[tuple[np.ndarray, np.ndarray]], n: int, *, right: bool) -> str:
    """One cell from the block's row tags in each tagged run, as ``(got, want)`` (tag ``r + 1``: row
    block ``r``; NaN: a mixed row): right, the one row block every run brought, zeros, or mixed. A run in
    which nothing belongs to the block and nothing came is left out."""
    if right:
        return RIGHT
    got = [g for g, w in runs if np.any(g != 0) or np.any(w != 0)]
    values = np.concatenate([np.ravel(g) for g in got]) if got else np.zeros(1)
    if np.all(values == 0):
        return ZEROS
    first = float(values[0])
    if np.all(values == first) and first == int(first) and 1 <= first <= n:
        return str(int(first) - 1)
    return MIXED


def lines(cells: dict[tuple[str, int], str], row_order: Sequence[str], n: int) -> list[str]:
    """The picture's lines from ``{(row label, block): cell}``, rows in ``row_order``."""
    width = max(3, len(str(n - 1)) + 2)
    out = [
        f"{PREFIX} whose row block each block of the result holds ({RIGHT} right, {ZEROS} zeros, {MIXED} "
        "mixed or part right; blank: not on that device), devices by ring position:",
        f"{HEADER:<{_LABEL}}" + "".join(f"{b:>{width}}" for b in range(n)),
    ]
    for label in row_order:
        row = "".join(f"{cells.get((label, b), ''):>{width}}" for b in range(n))
        out.append(f"  {label:<{_LABEL - 2}}{row}".rstrip())
    return out


def of_slots(
    found: dict[Any, list[Any]],
    tagged: dict[Any, list[tuple[np.ndarray, np.ndarray]]],
    coords: dict[int, tuple[int, ...]],
    ring: int,
    n: int,
) -> list[str]:
    """The picture of a block map's slots (:class:`conformance.checks.block_map.Slot`: ``device``,
    ``block``) from what was found wrong in each and its tagged runs' row tags: a row per device, by
    its ring (its coordinates on the other axes), then its place on the ring (mesh axis ``ring``)."""
    label = {d: f"device {d} (p{c[ring]})" for d, c in coords.items()}

    def place(d: int) -> tuple[int, ...]:
        return (*coords[d][:ring], *coords[d][ring + 1 :], coords[d][ring])

    cells = {(label[s.device], s.block): cell(tagged.get(s, []), n, right=not f) for s, f in found.items()}
    return lines(cells, [label[d] for d in sorted({s.device for s in found}, key=place)], n)


def parse(message: str) -> Picture | None:
    """The picture in a failure message (as :func:`lines` wrote it, each line perhaps indented alike),
    or ``None`` where it has none."""
    lines_ = message.splitlines()
    start = next((i for i, line in enumerate(lines_) if line.lstrip().startswith(PREFIX)), None)
    if start is None or start + 1 >= len(lines_):
        return None
    indent = len(lines_[start]) - len(lines_[start].lstrip())
    text = [line[indent:] for line in lines_]
    header = text[start + 1]
    if not header.startswith(HEADER):
        return None
    blocks = tuple(header[_LABEL:].split())
    width = (len(header) - _LABEL) // max(1, len(blocks))
    rows = []
    for line in text[start + 2 :]:
        if not line.startswith("  device "):
            break
        label, body = line[:_LABEL].strip(), line[_LABEL:].ljust(width * len(blocks))
        rows.append((label, tuple(body[i * width : (i + 1) * width].strip() for i in range(len(blocks)))))
    return Picture(blocks, tuple(rows)) if rows else None
