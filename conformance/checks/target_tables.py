"""The tables of the compile tiers (TPU and GPU schedule, memory, pod): one row per implementation
and topology, one cell per size, the baselines marked, and the compilers and flags that judged them."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from typing import Any


def topology_rows(records: list[Any], cells: Callable[[list[Any]], str], *, baseline_note: str) -> list[str]:
    """A TPU-tier table's lines: one per implementation and topology (``cells`` of its records, one
    per size), the baseline's marked, then the libtpu versions that judged them."""
    rows: dict[tuple[str, str, str], list[Any]] = defaultdict(list)
    for r in records:
        rows[(r.family, r.impl, r.topology)].append(r)
    width = max(len(r.impl) for r in records)
    lines = []
    for (family, impl, topology), recs in sorted(rows.items()):
        line = f"{family:<21} {impl:<{width}}  {topology:<8} {cells(recs)}"
        if getattr(recs[0], "compilers_own", False):
            line += "  (the compiler's own: jit of the family's math)"
        elif recs[0].baseline:
            line += f"  ({baseline_note})"
        lines.append(line)
    return [*lines, judges_line(records)]


def judges_line(records: list[Any]) -> str:
    """``judge: libtpu 0.0.42.1``: the compilers (libtpu, XLA:GPU's plugin) that gave the records'
    verdicts."""
    flags = sorted({getattr(r, "flags", "compiler defaults") for r in records})
    judges = ", ".join(sorted({r.judge.split(" (")[0] for r in records}))
    return f"judge: {judges}; flags: {' | '.join(flags)}"


def schedule_table(records: list[Any], name: str) -> list[tuple[str, list[str]]]:
    """:func:`tpu_schedule_table` for the ``name`` (``"TPU"``, ``"GPU"``) compiler's records."""
    if not records:
        return []
    title = (
        f"{name} schedule: transfers with a matmul inside them / all transfers, and the bytes a device "
        f"receives in the others, per size, in the module the real {name} compiler scheduled; each kernel "
        "ahead of (fewer bytes exposed), level with or behind the compiler's own collective matmul (jit of "
        "the family's math); a kernel fails where it leaves transfers exposed and is behind (--schedule-"
        "verdict=compiler, the default) or anywhere it leaves them exposed (hidden)"
    )

    number, legend = size_legend(records)

    def cell(r: Any) -> str:
        size = number[(r.family, r.dims)]
        if r.order.startswith("refused: "):
            return f"#{size}: {r.order}"
        standing = f", {r.standing}" if getattr(r, "standing", "") else ""
        exposed = size_text(getattr(r, "exposed_bytes", 0))
        verdict = "; fails" if getattr(r, "failed", False) else ""
        return f"#{size}: {r.hidden}/{r.total} ({exposed} exposed{standing}{verdict})"

    def cells(recs: list[Any]) -> str:
        return "  ".join(cell(r) for r in sorted(recs, key=lambda r: number[(r.family, r.dims)]))

    rows = topology_rows(records, cells, baseline_note="shard_map baseline: reported, not judged")
    return [(title, [*legend, *rows])]


def size_legend(records: list[Any]) -> tuple[dict[tuple[str, tuple[tuple[str, int], ...]], int], list[str]]:
    """Each family's sizes numbered from its smallest (``#1``), keyed by (family, dims), and a line per
    family that says what each number is: one column of a table is one size, whatever each kernel's
    transfers are."""
    number: dict[tuple[str, tuple[tuple[str, int], ...]], int] = {}
    lines = []
    for family in sorted({r.family for r in records}):
        sizes = sorted(
            {r.dims for r in records if r.family == family}, key=lambda d: (sorted(v for _, v in d), d)
        )
        for i, dims in enumerate(sizes, start=1):
            number[(family, dims)] = i
        described = "; ".join(
            f"#{i} {', '.join(f'{k}={v}' for k, v in d)}" for i, d in enumerate(sizes, start=1)
        )
        lines.append(f"{family} sizes: {described}")
    return number, lines


def size_text(nbytes: int) -> str:
    """``1.5 MiB``, ``256 KiB``, ``512 B``."""
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:g} {unit}"
    return f"{nbytes} B"
