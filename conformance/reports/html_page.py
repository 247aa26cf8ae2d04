"""The run's one self-contained HTML page, made from its JSON document
(:func:`conformance.reports.results.to_json`).

What a person opens instead of the terminal: the implementation x check matrix (its first column
sticky where the checks run past the window, each failing cell a link to the cause it failed with),
the terminal's failure summary, wrapped, then a section per kernel, each of its causes a section of
its own shown open (the verdict, why, the smallest failing case's message and its replay line with a
copy button, the block map drawn as a grid where the message has one; the cause's other failures
folded under it), and the tables with their plots. It works offline: no script but a copy button's
one line, no request to any host.
"""

from __future__ import annotations

import html
import math
import re
from collections import Counter, defaultdict
from typing import Any

from conformance.checks import block_picture
from conformance.reports import html_plots
from conformance.reports.results import cell_text, verdict_of

_CSS = """
body{font:14px/1.4 system-ui,sans-serif;margin:1.5em;color:#222;max-width:1400px}
h1{font-size:1.4em}h2{font-size:1.15em;margin-top:1.6em}h3{font-size:1.05em;margin:1.2em 0 .3em}
h4{font-size:1em;margin:.8em 0 .2em}
nav a{margin-right:1em}
.matrix-scroll{overflow-x:auto;max-width:100%;border:1px solid #ddd}
table{border-collapse:separate;border-spacing:0;margin:0}
th,td{border:1px solid #ccc;padding:.25em .5em;text-align:center;white-space:nowrap}
th{white-space:normal;vertical-align:bottom;font-size:12px;min-width:3.5em;background:#fff}
th.impl,td.impl{text-align:left;position:sticky;left:0;z-index:1;background:#fff;max-width:22em;
white-space:normal}
td a{color:inherit;text-decoration:none;display:block}
td.ok{background:#dff3df}td.FAIL{background:#f6c8c8;font-weight:bold}td.FAIL a{text-decoration:underline}
td.not-claimed{background:#eee;color:#666}td.xfail{background:#e8e1f7}td.skipped{background:#fbf3d5}
td.none{color:#bbb}
pre{background:#f6f6f6;padding:.6em;overflow-x:auto;font-size:12px}
section.cause pre{white-space:pre-wrap;overflow-wrap:anywhere}
details{margin:.4em 0}summary{cursor:pointer}
.counts span{margin-right:1em}td.impl small{color:#666}.legend{color:#555;font-size:12px}
.ladders{display:flex;flex-wrap:wrap;gap:.6em}svg.ladder{border:1px solid #eee;background:#fff}
section.kernel{border-top:2px solid #ccc;margin-top:1em}
section.cause{margin:.3em 0 .8em 1em;padding-left:.6em;border-left:3px solid #e0a0a0}
.why,.replay{font-size:90%;color:#333;margin:.2em 0}
.replay code{background:#f3f3f3;padding:.1em .3em;word-break:break-all}
button.copy{font-size:11px;margin-left:.5em}
table.blocks{margin:.3em 0 .5em}table.blocks td,table.blocks th{min-width:1.6em;padding:.1em .3em;
font:12px monospace}table.blocks td.label,table.blocks th.label{text-align:left;background:#fff}
td.b-right{background:#dff3df;color:#8a8}td.b-zeros{background:#ddd}td.b-mixed{background:#f8d9a8}
td.b-other{background:#f6a8a8;font-weight:bold}td.b-none{border-color:#eee}
pre.summary{background:#fbfbf4;border:1px solid #ddd;padding:.5em;white-space:pre-wrap;overflow-x:visible}
"""

#: A copy button's action: the replay line beside it onto the clipboard (the page's only script).
_COPY = "navigator.clipboard.writeText(this.previousElementSibling.textContent)"


def slug(text: str) -> str:
    """``text`` as an HTML id: letters, digits, dashes."""
    return re.sub(r"[^A-Za-z0-9]+", "-", text).strip("-") or "x"


def to_html(document: dict[str, Any]) -> str:
    """One self-contained page: matrix, failures by kernel and cause, tables."""
    esc = html.escape
    outcomes = document["outcomes"]
    v = document["versions"]
    checks = sorted({c for row in document["matrix"].values() for c in row})
    failures = [o for o in outcomes if o["outcome"] in ("failed", "xpassed")]
    causes = _causes(failures)
    out = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        "<title>Conformance results</title>",
        f"<style>{_CSS}</style></head><body>",
        "<h1>Conformance results</h1>",
        f"<p>jax {esc(v['jax'])}, jaxlib {esc(v['jaxlib'])}, Python {esc(v['python'])}; "
        f"{esc(document['platform']['host'])}; started {esc(document['started'])}, "
        f"{document['duration_s']:.1f} s</p>",
        '<p class="counts" id="counts">'
        + "".join(
            f'<span data-outcome="{k}">{esc(k.replace("_", " "))}: {n}</span>'
            for k, n in document["counts"].items()
        )
        + "</p>",
        '<nav><a href="#matrix">matrix</a><a href="#failures">failures</a><a href="#kernels">kernels</a>'
        '<a href="#tables">tables</a></nav>',
        *_matrix(document, checks, causes),
        f'<h2 id="failures">Failures ({len(failures)})</h2>',
    ]
    if document.get("summary"):  # the terminal's summary: each cause once, the patterns, where to start
        out.append(f'<pre class="summary" id="summary">{esc(chr(10).join(document["summary"]))}</pre>')
    elif not failures:
        out.append("<p>None.</p>")
    out.append('<h2 id="kernels">Kernels</h2>')
    out += _kernels(document, causes)
    stale = document["known_failures"]["stale"]
    if stale:
        out.append(f'<h2 id="stale">Stale known-failure lines ({len(stale)})</h2><ul>')
        out += [f"<li><code>{esc(s['file'])}:{s['line']}</code> {esc(s['pattern'])}</li>" for s in stale]
        out.append("</ul>")
    out.append('<h2 id="tables">Tables</h2>')
    for t in document["tables"]:
        out.append(f"<h3>{esc(t['title'])}</h3>")
        figures = html_plots.ladder_figures(t.get("records") or [])
        if figures:
            out.append('<div class="ladders">' + "".join(figures) + "</div>")
        out.append(f"<pre>{esc(chr(10).join(t['lines']))}</pre>")
    not_claimed = [o for o in outcomes if o["outcome"] == "not_claimed"]
    if not_claimed:
        reasons = Counter(o["message"] for o in not_claimed)
        out.append(f'<h2 id="not-claimed">Not claimed ({len(not_claimed)})</h2><ul>')
        out += [f"<li>{n} x {esc(r)}</li>" for r, n in reasons.most_common()]
        out.append("</ul>")
    out.append(f'<p class="legend">command: <code>{esc(" ".join(document["command"]))}</code></p>')
    out.append("</body></html>")
    return "\n".join(out) + "\n"


def write_html(path: str, document: dict[str, Any]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(to_html(document))


#: ``{implementation: [(cause, its failures, smallest first)]}``, most failures first.
Causes = dict[str, list[tuple[str, list[dict[str, Any]]]]]


def _impl_of(outcome: dict[str, Any]) -> str:
    return (
        f"{outcome.get('family')}/{outcome.get('impl')}"
        if outcome.get("impl")
        else outcome["id"].split("::")[0]
    )


def _causes(failures: list[dict[str, Any]]) -> Causes:
    """The failures as the terminal's summary groups them: per implementation, each cause (a check's
    one-line verdict) once, its failures smallest case first."""
    by_impl: dict[str, dict[str, list[dict[str, Any]]]] = defaultdict(lambda: defaultdict(list))
    for o in failures:
        cause = o.get("what") or (o["message"].splitlines() or ["(no message)"])[0]
        by_impl[_impl_of(o)][cause].append(o)
    return {
        impl: [
            (cause, sorted(group, key=case_size))
            for cause, group in sorted(found.items(), key=lambda kv: (-len(kv[1]), kv[0]))
        ]
        for impl, found in by_impl.items()
    }


def _cause_id(impl: str, index: int) -> str:
    return f"cause-{slug(impl)}-{index + 1}"


def _matrix(document: dict[str, Any], checks: list[str], causes: Causes) -> list[str]:
    """The matrix, in a box that scrolls sideways with its first column held: each failing cell links
    to the first cause its failures are in, each implementation to its kernel's section."""
    esc = html.escape
    out = [
        '<h2 id="matrix">Implementations x checks</h2>',
        '<p class="legend">Each cell: the verdict, then counts of tests (P passed, F failed, x xfailed, '
        "X xpassed, n not claimed, s skipped); a failing cell links to its cause, an implementation to its "
        "section.</p>",
        '<div class="matrix-scroll"><table id="matrix-table"><thead><tr><th class="impl">implementation</th>'
        + "".join(f"<th>{esc(c).replace('_', '_<wbr>')}</th>" for c in checks)
        + "</tr></thead><tbody>",
    ]
    emulated = {_impl_of(o): o["emulated"] for o in document["outcomes"] if o.get("emulated")}
    for impl, row in document["matrix"].items():
        cause_of_check: dict[str, str] = {}
        for index, (_, group) in enumerate(causes.get(impl, [])):
            for o in group:
                cause_of_check.setdefault(o.get("check") or "?", _cause_id(impl, index))
        cells = []
        for check in checks:
            counts_here = Counter(row.get(check, {}))
            if not counts_here:
                cells.append('<td class="none">-</td>')
                continue
            verdict, said = verdict_of(counts_here), esc(cell_text(counts_here))
            text = f"{esc(verdict)}<br><small>{said}</small>"
            if check in cause_of_check:
                text = f'<a href="#{cause_of_check[check]}">{text}</a>'
            cells.append(f'<td class="{verdict.replace(" ", "-")}" title="{esc(check)}: {said}">{text}</td>')
        family, _, name = impl.partition("/")
        label = f'<a href="#kernel-{slug(impl)}"><small>{esc(family)}</small><br>{esc(name)}</a>'
        if impl in emulated:
            label += f'<br><small class="emulated" title="{esc(emulated[impl])}">ran emulated on CPU</small>'
        out.append(f'<tr><td class="impl" title="{esc(impl)}">{label}</td>{"".join(cells)}</tr>')
    out.append("</tbody></table></div>")
    for label, ran in Counter(o["emulated"] for o in document["outcomes"] if o.get("emulated")).items():
        out.append(f'<p class="legend" id="emulated">{ran} verdicts ran so: {html.escape(label)}</p>')
    return out


def _kernels(document: dict[str, Any], causes: Causes) -> list[str]:
    """A section per implementation (failing ones first, most failures first): its counts, and each of
    its causes as a section, shown open."""
    esc = html.escape
    totals = {
        impl: sum((Counter(c) for c in row.values()), Counter()) for impl, row in document["matrix"].items()
    }
    for impl in causes:
        totals.setdefault(impl, Counter(failed=sum(len(g) for _, g in causes[impl])))
    order = sorted(totals, key=lambda impl: (-sum(len(g) for _, g in causes.get(impl, [])), impl))
    out = []
    for impl in order:
        total = totals[impl]
        failed = sum(len(g) for _, g in causes.get(impl, []))
        counted = ", ".join(f"{n} {k.replace('_', ' ')}" for k, n in sorted(total.items()) if n)
        title = f"{impl}: {failed} failed" if failed else impl
        out.append(f'<section class="kernel" id="kernel-{slug(impl)}"><h3>{esc(title)}</h3>')
        out.append(f'<p class="legend">{esc(counted)}</p>')
        if not failed:
            out.append("<p>No failure.</p>")
        for index, (cause, group) in enumerate(causes.get(impl, [])):
            first = group[0]
            checks = Counter(o.get("check") or "?" for o in group)
            where = ", ".join(f"{c} {n}" for c, n in checks.most_common())
            out.append(
                f'<section class="cause" id="{_cause_id(impl, index)}"><h4><b>{len(group)}x</b> {esc(cause)} '
                f"<small>(in {esc(where)})</small></h4>"
            )
            if first.get("why"):
                out.append(f'<p class="why">why: {esc(first["why"])}</p>')
            if first.get("replay"):
                out.append(
                    f'<p class="replay">replay: <code>{esc(first["replay"])}</code><button type="button" '
                    f'class="copy" onclick="{_COPY}">copy</button></p>'
                )
            out.append(f"<p>smallest: <code>{esc(first['id'])}</code></p>")
            out += _picture(first["message"])
            out.append(f"<pre>{esc(first['message'])}</pre>")
            for o in group[1:]:
                out.append(
                    f'<details class="failure"><summary><code>{esc(o["id"])}</code> ({esc(o["outcome"])})'
                    f"</summary><pre>{esc(o['message'])}</pre></details>"
                )
            out.append("</section>")
        out.append("</section>")
    return out


#: A block picture's cell class and what its mark means (conformance.checks.block_picture).
_MARKS = {
    block_picture.RIGHT: ("b-right", "right"),
    block_picture.ZEROS: ("b-zeros", "zeros"),
    block_picture.MIXED: ("b-mixed", "mixed, or only part right"),
    "": ("b-none", "not on this device"),
}


def _picture(message: str) -> list[str]:
    """The block map's picture in a failure message as a coloured grid (devices by row blocks, each
    cell whose row block it holds), or nothing where the message has none."""
    picture = block_picture.parse(message)
    if picture is None:
        return []
    esc = html.escape
    out = [
        '<table class="blocks"><tr><th class="label">block map</th>'
        + "".join(f"<th>{esc(b)}</th>" for b in picture.blocks)
        + "</tr>"
    ]
    for label, cells in picture.rows:
        tds = []
        for block, mark in zip(picture.blocks, cells, strict=True):
            css, said = _MARKS.get(mark, ("b-other", f"holds row block {mark}'s data"))
            tds.append(
                f'<td class="{css}" title="{esc(label)}, block {esc(block)}: {esc(said)}">{esc(mark)}</td>'
            )
        out.append(f'<tr><td class="label">{esc(label)}</td>{"".join(tds)}</tr>')
    return [*out, "</table>"]


def case_size(outcome: dict[str, Any]) -> tuple[int, int, int, str]:
    """A failing test's size for ordering, as the terminal's summary orders cases
    (:meth:`conformance.runner.Case.size_key`): fewer devices, then fewer elements, then a narrower
    dtype, read from its case token (``MESH:DIM=V,...:DTYPE:seed=S``); a test without one last."""
    token = str(outcome.get("case") or "")
    parts = token.split(":")
    if len(parts) < 3 or not re.fullmatch(r"\d+(x\d+)*", parts[0].split("-")[0]):
        return (1 << 62, 0, 0, outcome["id"])
    devices = math.prod(int(n) for n in parts[0].split("-")[0].split("x"))
    elements = math.prod(int(v) for _, v in re.findall(r"(\w+)=(\d+)", parts[1]))
    bits = re.search(r"\d+", parts[2])
    return devices, elements, int(bits[0]) if bits else 0, outcome["id"]
