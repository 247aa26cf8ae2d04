"""The ladders of a run as plots for the HTML report: inline SVG, no script, nothing fetched.

A table whose records climb a ladder of sizes is drawn as small multiples, one plot per family and
place (TPU topology, or mesh), a line per implementation, the baseline dashed:

* TPU and GPU schedule: the bytes a device receives in transfers with no matmul inside them, against
  the operand bytes per device, beside the compiler's own collective matmul's (dotted: the line a
  kernel with exposed transfers must not be above);
* TPU memory: peak HBM per chip, against the bytes of the arguments;
* benchmarks: median time per call, against the bytes of the operands.

Records are read from the JSON document (``tables[].records``), so a saved report re-renders.
"""

from __future__ import annotations

import dataclasses
import html
import math
from collections import defaultdict
from collections.abc import Callable
from typing import Any

#: Line colours, colour-blind safe (Okabe-Ito), in the order implementations are met.
PALETTE = ("#0072b2", "#d55e00", "#009e73", "#cc79a7", "#e69f00", "#56b4e9", "#000000")
#: Marker shapes, in the same order: lines that lie on top of each other still show every marker.
MARKERS = ("circle", "square", "triangle", "diamond")
WIDTH, HEIGHT = 380, 230
LEFT, RIGHT, TOP, BOTTOM = 58, 30, 26, 58


@dataclasses.dataclass(frozen=True)
class Ladder:
    """How to read one kind of record as a ladder."""

    #: Whether a record is of this kind (by its fields).
    matches: Callable[[dict[str, Any]], bool]
    #: The plot a record belongs to (family and place).
    panel: Callable[[dict[str, Any]], str]
    x: Callable[[dict[str, Any]], float]
    y: Callable[[dict[str, Any]], float | None]
    x_label: str
    y_label: str
    #: Every implementation is measured at the same x (the sizes of the ladder): an x one lacks is a
    #: size where it gave no value (it failed there), marked on its line.
    shared_x: bool = False
    #: A limit drawn as a dotted line (its name, and its y at a record's x; ``None``: none there).
    limit: tuple[str, Callable[[dict[str, Any]], float | None]] | None = None


LADDERS = (
    Ladder(
        matches=lambda r: {"hidden", "total", "argument", "topology", "exposed_bytes"} <= r.keys(),
        panel=lambda r: f"{r['family']} on {r['topology']}",
        x=lambda r: r["argument"],
        y=lambda r: None if r["order"].startswith("refused: ") else r["exposed_bytes"] / (1 << 20),
        x_label="operand bytes per device",
        y_label="MiB exposed per call",
        limit=(
            "the compiler's own collective matmul: a kernel above it with transfers exposed fails",
            lambda r: None if r.get("compiler_exposed") is None else r["compiler_exposed"] / (1 << 20),
        ),
    ),
    Ladder(
        matches=lambda r: {"peak", "baseline_peak", "topology", "argument"} <= r.keys(),
        panel=lambda r: f"{r['family']} on {r['topology']}",
        x=lambda r: r["argument"],
        y=lambda r: None if r["peak"] is None else r["peak"] / (1 << 20),
        x_label="argument bytes per chip",
        y_label="peak MiB per chip",
        shared_x=True,
        limit=(
            "the limit: 3x the baseline's peak",
            lambda r: None if not r.get("baseline_peak") else 3 * r["baseline_peak"] / (1 << 20),
        ),
    ),
    Ladder(
        matches=lambda r: {"median_s", "size_bytes", "mesh"} <= r.keys(),
        panel=lambda r: f"{r['family']} on {r['mesh']}, {r.get('dtype', 'float32')}",
        x=lambda r: r["size_bytes"],
        y=lambda r: r["median_s"] * 1e3,
        x_label="operand bytes",
        y_label="median ms per call",
        shared_x=True,
    ),
)


def _bytes(n: float) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:g} {unit}"
    return f"{n:g} B"


def _number(y: float) -> str:
    return f"{y:.3g}"


def _marker(shape: str, x: float, y: float, colour: str, tip: str) -> str:
    title = f"<title>{html.escape(tip)}</title>"
    if shape == "square":
        return f'<rect x="{x - 3:.1f}" y="{y - 3:.1f}" width="6" height="6" fill="{colour}">{title}</rect>'
    if shape == "triangle":
        pts = f"{x:.1f},{y - 4:.1f} {x - 4:.1f},{y + 3:.1f} {x + 4:.1f},{y + 3:.1f}"
        return f'<polygon points="{pts}" fill="{colour}">{title}</polygon>'
    if shape == "diamond":
        pts = f"{x:.1f},{y - 4:.1f} {x - 4:.1f},{y:.1f} {x:.1f},{y + 4:.1f} {x + 4:.1f},{y:.1f}"
        return f'<polygon points="{pts}" fill="{colour}">{title}</polygon>'
    return f'<circle cx="{x:.1f}" cy="{y:.1f}" r="3" fill="{colour}">{title}</circle>'


def panel_svg(
    title: str,
    series: dict[str, list[tuple[float, float]]],
    baselines: set[str],
    ladder: Ladder,
    *,
    missing: dict[str, list[float]] | None = None,
    limit: list[tuple[float, float]] | None = None,
) -> str:
    """One plot: a polyline per series over a log-2 x axis, each with its own marker and the earlier
    ones drawn wider (a line on top of another leaves it showing), a red cross where a series has no
    value at a size (``missing``), the ``limit`` dotted, a legend under it."""
    esc = html.escape
    missing = missing or {}
    xs = sorted(
        {x for points in series.values() for x, _ in points} | {x for m in missing.values() for x in m}
    )
    ys = [y for points in series.values() for _, y in points] + [y for _, y in limit or ()]
    top = max(ys) * 1.1 or 1.0
    lo, hi = math.log2(xs[0]), math.log2(xs[-1])
    span = hi - lo or 1.0
    legend_rows = math.ceil(len(series.keys() | missing.keys()) / 2) + (1 if limit else 0)
    height = HEIGHT + 14 * legend_rows
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM

    def px(x: float) -> float:
        return LEFT + (math.log2(x) - lo) / span * plot_w if len(xs) > 1 else LEFT + plot_w / 2

    def py(y: float) -> float:
        return TOP + plot_h - y / top * plot_h

    out = [
        '<svg class="ladder" role="img" xmlns="http://www.w3.org/2000/svg" '
        f'width="{WIDTH}" height="{height}" '
        f'viewBox="0 0 {WIDTH} {height}" aria-label="{esc(title)}: {esc(ladder.y_label)} against '
        f'{esc(ladder.x_label)}">',
        f'<text x="{WIDTH / 2}" y="15" text-anchor="middle" font-size="12" font-weight="bold">'
        f"{esc(title)}</text>",
        f'<rect x="{LEFT}" y="{TOP}" width="{plot_w}" height="{plot_h}" fill="none" stroke="#bbb"/>',
    ]
    for frac in (0, 0.5, 1):
        y = top * frac
        out.append(
            f'<line x1="{LEFT}" x2="{LEFT + plot_w}" y1="{py(y):.1f}" y2="{py(y):.1f}" stroke="#eee"/>'
            f'<text x="{LEFT - 4}" y="{py(y) + 4:.1f}" text-anchor="end" font-size="10">{_number(y)}</text>'
        )
    for x in xs:
        out.append(
            f'<text x="{px(x):.1f}" y="{TOP + plot_h + 13}" text-anchor="middle" font-size="10">'
            f"{esc(_bytes(x))}</text>"
        )
    out.append(
        f'<text x="{LEFT + plot_w / 2}" y="{TOP + plot_h + 28}" text-anchor="middle" font-size="10" '
        f'fill="#555">{esc(ladder.x_label)}</text>'
        f'<text x="12" y="{TOP + plot_h / 2}" text-anchor="middle" font-size="10" fill="#555" '
        f'transform="rotate(-90 12 {TOP + plot_h / 2})">{esc(ladder.y_label)}</text>'
    )
    if limit:
        path = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in sorted(limit))
        out.append(
            f'<polyline class="limit" fill="none" stroke="#999" stroke-width="1.5" stroke-dasharray="1 3" '
            f'points="{path}"><title>{esc(ladder.limit[0] if ladder.limit else "limit")}</title></polyline>'
        )
    names = sorted(series.keys() | missing.keys())
    for i, name in enumerate(names):
        points = series.get(name, [])
        colour, shape = PALETTE[i % len(PALETTE)], MARKERS[i % len(MARKERS)]
        dash = ' stroke-dasharray="5 3"' if name in baselines else ""
        width = 1.5 + 1.5 * (len(names) - 1 - i)
        path = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in sorted(points))
        out.append(
            f'<polyline class="series" fill="none" stroke="{colour}" stroke-width="{width:g}"{dash} '
            f'stroke-opacity="0.8" points="{path}">'
        )
        out.append(f"<title>{esc(name)}</title></polyline>")
        for x, y in points:
            out.append(_marker(shape, px(x), py(y), colour, f"{name}: {_number(y)} at {_bytes(x)}"))
        for x in missing.get(name, ()):
            cx, cy = px(x), TOP + plot_h - 6
            out.append(
                f'<path class="missing" d="M{cx - 4:.1f},{cy - 4:.1f}L{cx + 4:.1f},{cy + 4:.1f}'
                f'M{cx - 4:.1f},{cy + 4:.1f}L{cx + 4:.1f},{cy - 4:.1f}" stroke="#c00" stroke-width="2">'
                f"<title>{esc(name)}: no value at {esc(_bytes(x))} (it failed there)</title></path>"
            )
        lx = 8 + (i % 2) * (WIDTH / 2)
        ly = HEIGHT + 14 * (i // 2) - 10
        out.append(
            f'<line x1="{lx}" x2="{lx + 16}" y1="{ly - 4}" y2="{ly - 4}" stroke="{colour}" '
            f'stroke-width="2"{dash}/>{_marker(shape, lx + 8, ly - 4, colour, name)}'
            f'<text x="{lx + 20}" y="{ly}" font-size="10">{esc(name[:40])}</text>'
        )
    if limit and ladder.limit:
        ly = HEIGHT + 14 * math.ceil(len(names) / 2) - 10
        out.append(
            f'<line x1="8" x2="24" y1="{ly - 4}" y2="{ly - 4}" stroke="#999" stroke-dasharray="1 3"/>'
            f'<text x="28" y="{ly}" font-size="10">{esc(ladder.limit[0])}</text>'
        )
    out.append("</svg>")
    return "".join(out)


def ladder_figures(records: list[dict[str, Any]]) -> list[str]:
    """The plots of one table's records (none if they are not a ladder, or climb no more than one rung)."""
    ladder = next((lad for lad in LADDERS if records and all(lad.matches(r) for r in records)), None)
    if ladder is None:
        return []
    panels: dict[str, dict[str, list[tuple[float, float]]]] = defaultdict(lambda: defaultdict(list))
    baselines: dict[str, set[str]] = defaultdict(set)
    without: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    limits: dict[str, dict[float, float]] = defaultdict(dict)
    for r in records:
        y, x = ladder.y(r), ladder.x(r)
        panel = ladder.panel(r)
        if r.get("baseline"):
            baselines[panel].add(r["impl"])
        if not x:
            continue
        if y is None:
            without[panel][r["impl"]].append(x)
            continue
        panels[panel][r["impl"]].append((x, y))
        limit = ladder.limit[1](r) if ladder.limit else None
        if limit is not None:
            limits[panel][x] = max(limit, limits[panel].get(x, 0.0))
    figures = []
    for panel, series in sorted(panels.items()):
        xs = {x for points in series.values() for x, _ in points}
        if len(xs) < 2:
            continue  # a single size: the table says it all
        missing = {name: list(found) for name, found in without[panel].items()}
        if ladder.shared_x:  # a size the others have and this one lacks: it failed there
            for name, points in series.items():
                known = {x for x, _ in points} | set(missing.get(name, ()))
                missing.setdefault(name, []).extend(sorted(xs - known))
        missing = {name: found for name, found in missing.items() if found}
        limit = sorted(limits[panel].items()) or None
        figures.append(panel_svg(panel, dict(series), baselines[panel], ladder, missing=missing, limit=limit))
    return figures
