"""Which block landed where: a wrong result of a data-movement or collective-matmul kernel explained
by the blocks it moved.

The case is run again on source-tagged inputs (:attr:`conformance.specs.base.FamilySpec.block_tags`),
once per ring position ``s``: every operand zero but what position ``s`` holds, whose values name
the row block of the result they belong to (block ``r`` carries ``r + 1``, a small integer exact in
every dtype, float8 and int8 included). The families are linear in those operands, so each run shows
where position ``s``'s data went and nothing else: every row of the result carries the tag of the
block it came from, or zero. Each wrong (device, row block) of the result is then named by what it
holds against what the spec puts there ("holds device 6's block (expected device 3's)", "lacks device
2's partial"), with the ring step that would have brought it, and patterns across devices are said
once ("ring position 0's block (device 0) is missing everywhere", "in each of the 6 wrong blocks only
row 2 is wrong").

A kernel whose placement is right on tagged inputs gets that said instead: its wrong values come from
its arithmetic (accumulation, a cast), not from where its blocks went.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable

import jax
import numpy as np

from conformance import runner
from conformance.blame import error_text
from conformance.checks import block_picture
from conformance.runner import Case

#: How the line saying the family's baseline is wrong too begins (conformance.checks.base).
BASELINE_PREFIX = "baseline       :"
#: How the lines begin that name a cause outright, which the failure summary shows before where blocks
#: landed: a known mistake the result matches, and a family's account of what the result lacks
#: (:attr:`conformance.specs.base.FamilySpec.explain_wrong`: a MoE dispatch's rows missing or extra),
#: and a gradient off by roundings alone where its math needs no arithmetic (checks.autodiff).
ROUNDED_PREFIX = "rounded        :"
CAUSE_PREFIXES = ("known mistake  :", "rows missing   :", "rows extra     :", ROUNDED_PREFIX)
#: At most this many wrong blocks are named one by one; the rest are counted.
MAX_NAMED = 4


@dataclasses.dataclass(frozen=True)
class Slot:
    """One row block of the result on one device."""

    device: int
    position: int  #: the device's place on the ring
    block: int
    rows: tuple[int, int]  #: global rows of the result [start, stop)


@dataclasses.dataclass(frozen=True)
class Finding:
    """What is wrong in one slot in the run of one ring position: ``holds`` its data where none of it
    belongs, ``lacks`` its data where it belongs, ``other`` its data tagged for another block."""

    kind: str
    source: int  #: the ring position whose run showed it
    rows: tuple[int, ...]  #: the slot's rows it concerns, from 0
    tags: tuple[float, ...]  #: what those rows hold (the tag, 0, or NaN for a mixed row)


def _row_tags(block: np.ndarray) -> np.ndarray:
    """Each row's tag (rows along dim -2, every other dim flattened): its value where every element
    of the row has it, else NaN (a mixed row)."""
    rows = np.moveaxis(block, -2, 0).reshape(block.shape[-2], -1)
    first = rows[:, :1]
    return np.where(np.all(rows == first, axis=1), first[:, 0], np.nan)


def _column_pieces(block: np.ndarray) -> tuple[tuple[int, int, float], ...]:
    """A slot's columns in runs of one tag (every row of the column has it; NaN: mixed), as
    (first column, stop, tag): one run where the slot's rows are whole, two where a bidirectional ring
    splits its columns between directions."""
    cols = np.moveaxis(block, -1, 0).reshape(block.shape[-1], -1)
    tags = np.where(np.all(cols == cols[:, :1], axis=1), cols[:, 0], np.nan)
    runs: list[tuple[int, int, float]] = []
    for c, tag in enumerate(tags.tolist()):
        if runs and _same(runs[-1][2], tag):
            runs[-1] = (runs[-1][0], c + 1, tag)
        else:
            runs.append((c, c + 1, tag))
    return tuple(runs)


def _partials_shifted(
    wrong: list[Slot], pieces: dict[Slot, dict[int, tuple[tuple[int, int, float], ...]]], n: int, unit: str
) -> list[str]:
    """Every wrong slot holding, from every device's partial, the rows of the ring position the same
    number of places from its own (per run of columns, where a ring splits them): one sentence for
    what would otherwise be a clause per device per slot (a ring that stops a step early or late)."""
    shifts: set[tuple[tuple[int, int, int], ...]] = set()
    for slot in wrong:
        runs = pieces.get(slot, {})
        if len(runs) != n:
            return []
        for columns in runs.values():
            if any(t != t or t != int(t) or not 1 <= t <= n for _, _, t in columns):
                return []  # a column of mixed rows, zeros, or a value no tag has
            shifts.add(tuple((a, b, (int(t) - 1 - slot.block) % n) for a, b, t in columns))
    if len(shifts) != 1:
        return []
    (shift,) = shifts
    if all(k == 0 for _, _, k in shift):
        return []

    def away(k: int) -> str:
        return "its own" if k == 0 else f"{k} after its own" if k <= n // 2 else f"{n - k} before its own"

    devices = len({s.device for s in wrong})
    said = (
        f"the rows of the ring position {away(shift[0][2])}"
        if len(shift) == 1
        else " and ".join(f"in columns {a}:{b} the rows of the ring position {away(k)}" for a, b, k in shift)
    )
    return [
        f"  each of the {len(wrong)} wrong blocks, on {devices} device{'s' * (devices > 1)}, holds, from "
        f"every device's {unit}, {said}: a ring whose steps are counted off by "
        f"{' and '.join(sorted({str(min(k, n - k)) for _, _, k in shift if k}))}"
    ]


def _slots_of(index: tuple[slice, ...], out_shape: tuple[int, ...], n: int) -> list[tuple[int, int, int]]:
    """The row blocks a shard covers: (block, first global row, stop), rows along dim -2."""
    start, stop, _ = index[-2].indices(out_shape[-2])
    per_block = out_shape[-2] // n
    spans = [(b, max(start, b * per_block), min(stop, (b + 1) * per_block)) for b in range(n)]
    return [(b, lo, hi) for b, lo, hi in spans if lo < hi]


def _findings_by_tag(got: np.ndarray, want: np.ndarray, n: int) -> list[Finding]:
    """What is wrong in one slot in a run where every position was tagged (each row from one): a
    row's tag names the position it came from."""
    by: dict[tuple[str, int], list[tuple[int, float]]] = {}
    for i, (g, w) in enumerate(zip(got.tolist(), want.tolist(), strict=True)):
        if g == w:
            continue
        if g == 0:
            key = ("lacks", int(w) - 1)
        elif g == g and g == int(g) and 1 <= g <= n:  # g == g: not NaN
            key = ("holds", int(g) - 1)
        else:  # a mixed row, or a value no position was tagged with
            key = ("other", int(w) - 1)
        by.setdefault(key, []).append((i, g))
    return [
        Finding(kind, source, tuple(i for i, _ in rows), tuple(g for _, g in rows))
        for (kind, source), rows in by.items()
    ]


def _findings(source: int, got: np.ndarray, want: np.ndarray) -> list[Finding]:
    out = []
    for kind, rows in (
        ("holds", (want == 0) & (got != 0)),
        ("lacks", (want != 0) & (got == 0)),
        ("other", (want != 0) & (got != 0) & ~(got == want)),
    ):
        idx = tuple(int(i) for i in np.flatnonzero(rows))
        if idx:
            out.append(Finding(kind, source, idx, tuple(float(got[i]) for i in idx)))
    return out


def where_blocks_landed(case: Case, run: Callable[[tuple[np.ndarray, ...]], jax.Array]) -> list[str]:
    """Lines naming, per wrong row block of the result, whose block it holds, from ``run`` (the kernel
    on given global inputs) on source-tagged inputs: one run with every ring position tagged (a
    "block" family), or one per position (a "partial" one); ``[]`` where the family has no tags (a
    transfer's block map) or the result has no rows, or rows that do not divide into the ring's blocks."""
    lines = _where_blocks_landed(case, run)
    if case.spec.block_axis == -1:  # the blocks are column blocks: said so
        return [_ROWS.sub(r"column\1", line) for line in lines]
    return lines


#: The word "row" or "rows" in the block map's lines.
_ROWS = re.compile(r"\brow(s?)\b")


def _swapped_shape(shape: tuple) -> tuple:
    """A shape (or an index) with its last two entries swapped."""
    return (*shape[:-2], shape[-1], shape[-2])


def _where_blocks_landed(case: Case, run: Callable[[tuple[np.ndarray, ...]], jax.Array]) -> list[str]:
    """:func:`where_blocks_landed`, the blocks read along the result's rows (a form whose blocks run
    along its columns read transposed)."""
    spec = case.spec
    n = case.mesh.axis_size
    # a form whose blocks run along the result's columns (FamilySpec.block_axis) is read transposed
    columns = spec.block_axis == -1
    out_shape = _swapped_shape(tuple(case.out_shape)) if columns else tuple(case.out_shape)
    if spec.block_tags is None or not out_shape[-2] or out_shape[-2] % n:
        return []
    if jax.process_count() > 1:  # a rank whose own shards are right would not join the tagged runs
        return ["block map      : not traced in a multi-process job (replay the case in one process)"]
    mesh = runner.mesh_of(case)
    ring = mesh.axis_names.index(case.mesh.axis_name)
    coords = {int(d.id): tuple(int(i) for i in np.argwhere(mesh.devices == d)[0]) for d in mesh.devices.flat}
    device_at = {c: d for d, c in coords.items()}

    def device(of: int, position: int) -> int:
        """The device at ring ``position`` in the ring of device ``of``."""
        c = list(coords[of])
        c[ring] = position
        return device_at[tuple(c)]

    found: dict[Slot, list[Finding]] = {}
    pieces: dict[Slot, dict[int, tuple[tuple[int, int, float], ...]]] = {}  # a partial's column runs
    scaled: list[tuple[Slot, int, float, float]] = []  # every wrong row: its slot, row, got, want
    tagged: dict[Slot, list[tuple[np.ndarray, np.ndarray]]] = {}  # each run's row tags, got and wanted
    unit = spec.block_unit
    one_run = unit in ("block", "group")
    runs: list[tuple[int, ...]] = [tuple(range(n))] if one_run else [(s,) for s in range(n)]
    # operands that are not data (a ragged all-to-all's offsets and sizes) keep the case's values
    inputs = runner.make_inputs(case)
    for sources in runs:
        tagged64 = tuple(
            tags if op.is_data else fixed.astype(np.float64)
            for op, tags, fixed in zip(
                spec.operands, spec.block_tags(case.operand_shapes, n, sources), inputs, strict=True
            )
        )
        expected = spec.expected(tagged64, axis_size=n)
        expected = np.swapaxes(expected, -1, -2) if columns else expected
        try:
            out = run(runner.as_operands(case, tagged64))
        except Exception as e:  # the kernel's own error on these inputs: said, and the verdict stands
            return [
                f"block map      : not traced: the kernel raised {type(e).__name__} on source-tagged inputs: "
                + error_text(e, head=2, tail=2).removeprefix(f"{type(e).__name__}: ")
            ]
        for shard in out.addressable_shards:
            data, index = np.asarray(shard.data).astype(np.float64), tuple(shard.index)
            if columns:
                data, index = np.swapaxes(data, -1, -2), _swapped_shape(index)
            first_row = index[-2].indices(out_shape[-2])[0]
            for block, lo, hi in _slots_of(index, out_shape, n):
                dev = int(shard.device.id)
                slot = Slot(dev, coords[dev][ring], block, (lo, hi))
                mine = data[..., lo - first_row : hi - first_row, :]
                theirs = expected[(*index[:-2], slice(lo, hi), index[-1])]
                got, want = _row_tags(mine), _row_tags(theirs)
                tagged.setdefault(slot, []).append((got, want))
                scaled.extend(
                    (slot, i, g, w)
                    for i, (g, w) in enumerate(zip(got.tolist(), want.tolist(), strict=True))
                    if g != w
                )
                findings = _findings_by_tag(got, want, n) if one_run else _findings(sources[0], got, want)
                found.setdefault(slot, []).extend(findings)
                if not one_run and not columns:
                    pieces.setdefault(slot, {})[sources[0]] = _column_pieces(mine)
    wrong = sorted((s for s, f in found.items() if f), key=lambda s: (s.device, s.block))
    head = {
        "block": "on source-tagged inputs (each ring position's rows tagged with their block)",
        "group": "on source-tagged inputs (each device's rows tagged with it, the output buffer zero)",
    }.get(
        unit,
        f"on source-tagged inputs (one run per ring position, its {unit}'s rows tagged with their block)",
    )
    if not wrong:
        return [
            f"block map      : {head}, every block lands where the spec puts it: the wrong values come "
            "from the arithmetic (accumulation, a cast), not from where blocks go"
        ]
    factor = _common_factor([(g, w) for _, _, g, w in scaled], n)
    if factor is not None:
        rows: dict[Slot, list[int]] = {}
        for slot, i, _, _ in scaled:
            rows.setdefault(slot, []).append(i)
        named = [
            (
                ""
                if len(set(r)) == s.rows[1] - s.rows[0]
                else f"row{'s' * (len(r) > 1)} {', '.join(map(str, sorted(set(r))))} of "
            )
            + f"out rows {s.rows[0]}:{s.rows[1]} on device {s.device}"
            for s, r in sorted(rows.items(), key=lambda item: (item[0].device, item[0].block))[:MAX_NAMED]
        ]
        more = f" and {len(rows) - MAX_NAMED} more blocks" if len(rows) > MAX_NAMED else ""
        return [
            f"block map      : {head}, every block lands where the spec puts it, but its values come out "
            f"{factor:g} times what they are ({'; '.join(named)}{more}): the arithmetic scales them, "
            "not where blocks go"
        ]
    if unit == "group":
        return _group_lines(head, scaled, len(found), device)
    per_block = out_shape[-2] // n
    lines = [f"block map      : {head}: {len(wrong)} of {len(found)} row blocks of the result are wrong"]
    for slot in wrong[:MAX_NAMED]:
        lines.append("  " + _describe(slot, found[slot], n, per_block, unit, device))
    if len(wrong) > MAX_NAMED:
        lines.append(f"  ... and {len(wrong) - MAX_NAMED} more")
    return (
        lines
        + _patterns(wrong, found, n, per_block, unit, device)
        + _partials_shifted(wrong, pieces, n, unit)
        + block_picture.of_slots(found, tagged, coords, ring, n)
    )


def _common_factor(pairs: list[tuple[float, float]], n: int) -> float | None:
    """The one factor every wrong row's value is of the tag it should hold, where that explains them
    better than a block out of place: a tagged row that comes out doubled holds another block's tag,
    but the same factor on rows of different tags, or a value no tag has, is the arithmetic's."""
    if not pairs or any(w == 0 or w != w or g != g or g == 0 for g, w in pairs):  # g != g: a mixed row
        return None
    factors = {round(g / w, 9) for g, w in pairs}
    if len(factors) != 1:
        return None
    (factor,) = factors
    is_tag = all(g == int(g) and 1 <= g <= n for g, _ in pairs)
    return factor if len({w for _, w in pairs}) > 1 or not is_tag else None


def _rows_of_block(block: int, per_block: int) -> str:
    return f"{block * per_block}:{(block + 1) * per_block}"


def _tag_rows(tag: float, n: int, per_block: int) -> str:
    """The rows a tag names (tag ``r + 1``: row block ``r``), or the value itself."""
    if tag == tag and tag == int(tag) and 1 <= tag <= n:  # tag == tag: not NaN
        return f"rows {_rows_of_block(int(tag) - 1, per_block)}"
    return "mixed values" if tag != tag else f"{tag:g}"


def _describe(
    slot: Slot, findings: list[Finding], n: int, per_block: int, unit: str, device: Callable[[int, int], int]
) -> str:
    """What one wrong row block holds against what belongs there, with the ring step that brings it."""
    expected = device(slot.device, slot.block)
    where = f"out rows {slot.rows[0]}:{slot.rows[1]} on device {slot.device} "
    same_rows = {f.rows for f in findings}
    if unit == "block" and len(same_rows) == 1 and len(next(iter(same_rows))) < per_block:
        # the same rows wrong in every run: they never arrived; what they hold instead is secondary
        (rows,) = same_rows
        instead = ", ".join(
            sorted(
                {
                    "zeros"
                    if f.kind == "lacks"
                    else f"device {device(slot.device, f.source)}'s rows"
                    if f.kind == "holds"
                    else "values no block has (stale or mixed)"
                    for f in findings
                }
            )
        )
        return (
            f"{where}row{'s' * (len(rows) > 1)} {', '.join(map(str, rows))} of device {expected}'s block "
            f"never arrived (in its place: {instead}){_step(slot.position, slot.block, n)}"
        )
    replaced = any(
        len(f.rows) == per_block and (f.kind, f.source == slot.block) in (("lacks", True), ("holds", False))
        for f in findings
    )
    holds = any(f.kind == "holds" for f in findings)
    parts = []
    for f in sorted(findings, key=lambda f: ("holds", "other", "lacks").index(f.kind)):
        src = device(slot.device, f.source)
        some = len(f.rows) < per_block
        rows = f"row{'s' * (len(f.rows) > 1)} {', '.join(map(str, f.rows))}"
        if f.kind == "holds":
            text = f"holds {rows + ' of ' if some else ''}device {src}'s {unit}"
            if unit == "block":
                text += f" (expected device {expected}'s)" if replaced else ""
                text += _step(slot.position, f.source, n)
            elif set(f.tags) != {float(slot.block + 1)}:
                text += " of " + ", ".join(sorted({_tag_rows(t, n, per_block) for t in f.tags}))
        elif f.kind == "lacks":
            if unit == "block" and replaced and holds and f.source == slot.block:
                continue  # said by "(expected ...)" above
            if some:
                text = f"{rows} of device {src}'s {unit} {'are' if len(f.rows) > 1 else 'is'} zero"
            else:
                text = f"lacks device {src}'s {unit}" + (" (holds zeros)" if not holds else "")
                text += _step(slot.position, f.source, n) if unit == "block" else ""
        elif unit == "block":  # a value no position was tagged with, where position f.source's belongs
            text = (
                f"holds values no block has (stale or mixed) in place of {rows + ' of ' if some else ''}"
                f"device {src}'s block{_step(slot.position, f.source, n)}"
            )
        else:
            held = ", ".join(sorted({_tag_rows(t, n, per_block) for t in f.tags}))
            belongs = _rows_of_block(slot.block, per_block)
            text = f"holds {rows + ' of ' if some else ''}device {src}'s {unit} of {held}"
            text += f" where its rows {belongs} belong"
        parts.append((text, src))
    if unit == "block":
        return where + "; ".join(text for text, _ in parts)
    # a partial's clauses that differ only in whose partial they name: said once, naming them all
    whose: dict[str, list[int]] = {}
    for text, src in parts:
        whose.setdefault(text.replace(f"device {src}'s {unit}", "{whose}", 1), []).append(src)
    said = []
    for template, sources in whose.items():
        who = (
            "every device's"
            if len(set(sources)) == n
            else f"device{'s' * (len(sources) > 1)} {', '.join(map(str, sorted(set(sources))))}'s"
        )
        said.append(template.replace("{whose}", f"{who} {unit}{'s' * (len(sources) > 1)}"))
    return where + "; ".join(said)


def _group_lines(
    head: str, wrong_rows: list[tuple[Slot, int, float, float]], slots: int, device: Callable[[int, int], int]
) -> list[str]:
    """A "group" family's wrong rows (each row of a device's result comes from the group of whichever
    device the routing says, or is the caller's buffer): runs of rows, per device, that hold one
    device's group where another's (or the untouched buffer) belongs."""
    per_slot: dict[Slot, list[tuple[int, float, float]]] = {}
    for slot, i, got, want in wrong_rows:
        per_slot.setdefault(slot, []).append((i, got, want))

    def named(tag: float, slot: Slot) -> str:
        if tag != tag:
            return "mixed values"
        if tag == 0:
            return "the caller's output (no group)"
        if tag == int(tag) and 1 <= tag <= slots:
            return f"device {device(slot.device, int(tag) - 1)}'s group"
        return f"{tag:g}"

    lines = [f"block map      : {head}: rows of {len(per_slot)} of {slots} devices' results are wrong"]
    for slot in sorted(per_slot, key=lambda s: s.device)[:MAX_NAMED]:
        runs: list[tuple[int, int, float, float]] = []  # (first row, last row, got, want)
        for i, got, want in sorted(per_slot[slot], key=lambda r: r[0]):
            last = runs[-1] if runs else None
            if last and last[1] == i - 1 and _same(last[2], got) and _same(last[3], want):
                runs[-1] = (last[0], i, got, want)
            else:
                runs.append((i, i, got, want))
        first = slot.rows[0]
        said = [
            f"rows {first + a}:{first + b + 1} hold {named(g, slot)} where {named(w, slot)} belongs"
            if b > a
            else f"row {first + a} holds {named(g, slot)} where {named(w, slot)} belongs"
            for a, b, g, w in runs[:MAX_NAMED]
        ]
        more = f"; and {len(runs) - MAX_NAMED} more runs of rows" if len(runs) > MAX_NAMED else ""
        lines.append(f"  on device {slot.device}: " + "; ".join(said) + more)
    if len(per_slot) > MAX_NAMED:
        lines.append(f"  ... and {len(per_slot) - MAX_NAMED} more devices")
    return lines


def _same(a: float, b: float) -> bool:
    """Equal, NaN (a mixed row) equal to NaN."""
    return a == b or (a != a and b != b)


def _step(position: int, source: int, n: int) -> str:
    """Which ring step brings ring position ``source``'s block to ``position``, each way round."""
    step = (position - source) % n
    if step == 0:
        return ": its own block"
    return f": what a ring going right brings at step {step} (going left: step {n - step})"


def _patterns(
    wrong: list[Slot],
    found: dict[Slot, list[Finding]],
    n: int,
    per_block: int,
    unit: str,
    device: Callable[[int, int], int],
) -> list[str]:
    """What the wrong blocks share, said once: a ring position's block missing from every device, the
    same rows zero in every wrong block."""
    lines = []
    for source in range(n):
        due = [s for s in found if s.block == source] if unit == "block" else list(found)
        missing = [
            s
            for s in due
            if any(f.kind == "lacks" and f.source == source and len(f.rows) == per_block for f in found[s])
        ]
        anywhere = any(f.source == source and f.kind != "lacks" for s in wrong for f in found[s])
        if due and len(missing) == len(due) and not anywhere:
            holders = sorted({device(s.device, source) for s in due})
            lines.append(
                f"  ring position {source}'s {unit} (device{'s' * (len(holders) > 1)} "
                f"{', '.join(map(str, holders))}) is missing everywhere"
            )
    if unit == "block":
        lines += _shift(wrong, found, n, per_block)
    every = [f for s in wrong for f in found[s]]
    if every:
        rows = {f.rows for f in every}
        if len(rows) == 1 and len(next(iter(rows))) < per_block:
            (only,) = rows
            rows_text = (
                f"row{'s' * (len(only) > 1)} {', '.join(map(str, only))} {'are' if len(only) > 1 else 'is'}"
            )
            lines.append(f"  in each of the {len(wrong)} wrong blocks only {rows_text} wrong")
    return lines


def _shift(wrong: list[Slot], found: dict[Slot, list[Finding]], n: int, per_block: int) -> list[str]:
    """Every wrong block, on every device that has one, holding the whole block of the ring position
    the same number of places before its own: said in one sentence (the blocks a ring step off)."""
    offsets = set()
    for slot in wrong:
        held = [f for f in found[slot] if f.kind == "holds" and len(f.rows) == per_block]
        others = [f for f in found[slot] if f.kind != "lacks" and f not in held]
        if len(held) != 1 or others:
            return []
        offsets.add((slot.block - held[0].source) % n)
    if len(offsets) != 1 or 0 in offsets:
        return []
    (k,) = offsets
    devices = len({s.device for s in wrong})
    away = f"{k} before" if k <= n // 2 else f"{n - k} after"
    slot = f"p+{k}" if k <= n // 2 else f"p-{n - k}"
    return [
        f"  each of the {len(wrong)} wrong blocks, on {devices} device{'s' * (devices > 1)}, holds the block "
        f"of the ring position {away} its own (position p's block in position {slot}'s slot)"
    ]


def summary_line(lines: list[str]) -> str | None:
    """The one line of a wrong result's explanation that the failure summary shows: the baseline wrong
    too, else a cause named outright (:data:`CAUSE_PREFIXES`), else of :func:`where_blocks_landed`'s a
    pattern across devices where there is one, the first wrong block named, the verdict on placement."""
    if not lines:
        return None
    below = [line for line in lines if line.startswith(BASELINE_PREFIX)]
    if below:  # the baseline wrong as well: that is the cause, whatever the blocks say
        return below[0].removeprefix(BASELINE_PREFIX).strip()
    named_cause = [line for line in lines if line.startswith(CAUSE_PREFIXES)]
    if named_cause:  # a cause named outright says more than where the blocks went
        return named_cause[0].split(":", 1)[1].strip()
    patterns = [
        line
        for line in lines[1:]
        if "missing everywhere" in line or "wrong blocks only" in line or "wrong blocks, on" in line
    ]
    named = [line for line in lines[1:] if line.startswith("  out rows")]
    if patterns or named:
        return (patterns or named)[0].strip()
    return lines[0].removeprefix("block map      : ").strip()
