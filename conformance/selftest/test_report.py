"""The end-of-run summary groups failures by cause and points at the smallest failing case."""

from __future__ import annotations

import dataclasses
import html
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from conformance.checks import ConformanceFailure
from conformance.fixtures.meshes import MESH_CONFIGS, parse_mesh
from conformance.reports import failure_summary, html_page, results
from conformance.runner import Case

pytestmark = pytest.mark.selftest

FAMILY, IMPL = "all_gather", "kernel_dropping_odd_rows"
WRONG = "values differ from the numpy float64 reference"


def _case(mesh: str, rows: int, dma: str | None = "on_wait") -> Case:
    return Case.make(
        FAMILY, IMPL, parse_mesh(mesh), {"rows_per_shard": rows, "cols": 128}, "float32", dma_mode=dma
    )


def _outcome(
    check: str,
    outcome: str,
    shape: str | None = None,
    case: Case | None = None,
    what: str | None = None,
    impl: str = IMPL,
    mesh: str | None = None,
    dtype: str | None = None,
) -> results.Outcome:
    """A test's outcome as the run log has it; a failure carries the check's failure, if it gave one."""
    failure = None
    if case is not None:
        error = ConformanceFailure(what)
        error.case, error.check, error.what = case, check, what
        failure = results.FailureCause.of(error)
    return results.Outcome(
        id=f"{FAMILY}/{impl}/{check}",
        nodeid=f"test_{check}[{impl}]",
        outcome=outcome,
        family=FAMILY,
        impl=impl,
        check=check,
        shape=shape,
        what=what,
        failure=failure,
        mesh=mesh,
        dtype=dtype,
    )


def _fixed(check: str, shape: str, failed: bool, mesh: str = "8-x-explicit") -> results.Outcome:
    if not failed:
        return _outcome(check, "passed", shape)
    return _outcome(check, "failed", shape, _case(mesh, 3), WRONG)


#: The fixed-shape failures' meshes: every standard mesh of more than 2 devices, so that the drawn
#: case on 2 devices is the smallest failing case.
LARGER = [config for config in MESH_CONFIGS if config.num_devices > 2]


def test_one_defect_in_many_checks_is_one_cause_at_its_smallest_case() -> None:
    verdicts = [
        _fixed(check, shape, shape == "odd", config.label)
        for config in LARGER
        for check in ("output_sharding", "races")
        for shape in ("odd", "even")
    ]
    hypothesis_minimal = _case("2-x-auto", 1, "eager")
    verdicts.append(_outcome("values", "failed", None, hypothesis_minimal, WRONG))
    lines = failure_summary.summarize(verdicts)
    text = "\n".join(lines)
    n = len(LARGER)
    assert lines[0] == f"{FAMILY}/{IMPL}: {2 * n + 1} failed, {2 * n} passed", text
    assert f"odd (rows_per_shard=3, cols=128) {2 * n} of {2 * n} failed" in text, text
    assert f"even (rows_per_shard=4, cols=128) 0 of {2 * n} failed" in text, text
    assert "needs the odd shape" in text, text
    assert text.count(WRONG) == 1, text  # one cause, not forty-odd failures
    assert f"in output_sharding {n}, races {n}, values 1" in text, text
    assert "smallest: 2-x-auto:rows_per_shard=1,cols=128:float32:seed=0:dma=eager (values)" in text, text
    assert lines[-2].startswith("  start here : python -m conformance replay values all_gather"), text
    assert lines[-1] == f"               ({failure_summary.START_HERE_RULE})", text


def test_distinct_causes_are_listed_smallest_first_and_passing_kernels_not_at_all() -> None:
    verdicts = [
        _outcome("races", "failed", "odd", _case("8-x-explicit", 3), "a race"),
        _outcome("determinism", "failed", "even", _case("2-x-explicit", 4), "differ"),
        _outcome("tpu_layout", "failed"),  # a failure that gave no verdict line
        _outcome("races", "passed", "odd", impl="fine_kernel"),
        _outcome("races", "skipped", "even"),  # neither passed nor failed: not counted
    ]
    lines = failure_summary.summarize(verdicts)
    text = "\n".join(lines)
    assert "fine_kernel" not in text
    causes = [m[1] for line in lines if (m := re.match(r"\s+\d+x (.*)$", line))]
    assert causes == ["differ", "a race", "tpu_layout: no verdict line (see the test's report)"], text
    assert "needs the" not in text  # both shapes fail: no hint that one shape is the cause


def _on_rings(check: str, failing: set[int], *, what: str = WRONG, dtype: str | None = None) -> list:
    """``check`` on a 1-D ring of each length 1 to 8, failed on the ``failing`` lengths."""
    return [
        _outcome(check, "failed", None, _case(f"{n}-x-auto", 1), what, mesh=f"{n}-x-auto", dtype=dtype)
        if n in failing
        else _outcome(check, "passed", mesh=f"{n}-x-auto", dtype=dtype)
        for n in range(1, 9)
    ]


def test_failures_on_some_ring_lengths_only_are_named_with_what_they_share() -> None:
    """A ring wrapped with a bit mask: wrong on rings of 3, 5, 6 and 7, right on 1, 2, 4 and 8."""
    text = "\n".join(
        failure_summary.summarize(_on_rings("values", {3, 5, 6, 7}) + _on_rings("gradients", {3, 5, 6, 7}))
    )
    assert (
        "  meshes: gradients, values failed on rings of 3, 5, 6, 7 only and passed on rings of 1, 2, 4, 8"
        in text
    ), text
    assert "-> every failing ring length is no power of two" in text, text
    odd = "\n".join(failure_summary.summarize(_on_rings("values", {3, 5, 7})))
    assert "failed on rings of 3, 5, 7 only" in odd and "every failing ring longer than one is odd" in odd, (
        odd
    )
    everywhere = "\n".join(failure_summary.summarize(_on_rings("values", set(range(1, 9)))))
    assert "meshes:" not in everywhere, everywhere  # nothing tells the failing meshes apart


def test_failures_on_other_device_orders_only_are_named() -> None:
    meshes = {"8-x-auto": "passed", "8-x-explicit": "passed", "8-x-explicit-reversed": "failed"}
    verdicts = [
        _outcome(
            "values",
            got,
            None,
            _case(m, 1) if got == "failed" else None,
            WRONG if got == "failed" else None,
            mesh=m,
        )
        for m, got in meshes.items()
    ]
    text = "\n".join(failure_summary.summarize(verdicts))
    assert "meshes: values failed on device order reversed only and passed on device order ids" in text, text
    assert "device ids, not mesh positions" in text, text


def test_failures_at_some_dtypes_only_are_named() -> None:
    verdicts = [
        _outcome("dtype", "failed", None, _case("8-x-auto", 1), "wrong dtype", dtype=d)
        for d in ("bfloat16", "float16")
    ] + [_outcome("dtype", "passed", dtype=d) for d in ("float32", "int32")]
    text = "\n".join(failure_summary.summarize(verdicts))
    assert "  dtypes: dtype failed at bfloat16, float16 only and passed at float32, int32" in text, text


def test_start_here_is_the_first_wrong_result_before_a_smaller_performance_defect() -> None:
    """A kernel whose overlap fails on 2 devices and whose accuracy fails on 8: the wrong result
    comes first (then precision, program, performance), whatever the case sizes."""
    verdicts = [
        _outcome("overlap", "failed", None, _case("2-x-auto", 1), "no matmul is independent of it"),
        _outcome("accuracy", "failed", None, _case("8-x-auto", 3), "less accurate than the baseline"),
        _outcome("values", "failed", None, _case("8-x-auto", 3), WRONG),
    ]
    lines = failure_summary.summarize(verdicts)
    causes = [m[1] for line in lines if (m := re.match(r"\s+\d+x (.*)$", line))]
    assert causes == [WRONG, "less accurate than the baseline", "no matmul is independent of it"], lines
    start = next(line for line in lines if "start here" in line)
    assert "replay values" in start, lines


def test_no_failures_no_summary() -> None:
    assert failure_summary.summarize([_outcome("races", "passed", "odd")]) == []


# ----------------------------------------------------------------------------- the HTML page


def _ladder_document() -> dict:
    """A run with two causes of failure in one kernel and the three ladders the page draws."""
    import datetime

    from conformance.checks import TpuMemoryRecord, TpuScheduleRecord
    from conformance.reports.bench import BenchRecord

    failed = []
    for i, (check, what) in enumerate([("values", WRONG)] * 3 + [("tpu_schedule", "transfers exposed")]):
        failed.append(
            results.Outcome(
                id=f"{FAMILY}/{IMPL}/{check}/{i}",
                nodeid=f"test_{check}[{i}]",
                outcome="failed",
                family=FAMILY,
                impl=IMPL,
                check=check,
                message=f"[{check}] {what}\n  details {i}",
                case=f"{2 ** (i + 1)}-x-auto:rows_per_shard={i + 1},cols=128:float32:seed=0",
                replay=f"python -m conformance replay {check} {FAMILY} {IMPL} case{i}",
                what=what,
            )
        )
    passed = [
        results.Outcome(id="ok", nodeid="ok", outcome="passed", family=FAMILY, impl="ring", check="values")
    ]
    schedule = [  # the ring hides every hop; the compiler's own leaves one exposed
        TpuScheduleRecord(
            "allgather_matmul",
            impl,
            "v5e:2x4",
            8,
            (),
            hop,
            hidden,
            7,
            "SMD",
            base,
            "libtpu x",
            exposed_bytes=(7 - hidden) * hop,
            compiler_exposed=None if base else 6 * hop,
            argument=3 * hop,
        )
        for impl, base, hidden in (("ring", False, 7), ("xla", True, 1))
        for hop in (1 << 18, 1 << 20, 1 << 22)
    ]
    memory = [
        TpuMemoryRecord(
            "allgather_matmul", impl, "v5e:2x4", (), peak, 0, 1, arg, 2, "xla", arg * 3, 1, base, "j"
        )
        for impl, base, factor in (("ring", False, 4), ("xla", True, 3))
        for arg, peak in ((1 << 20, factor << 20), (4 << 20, factor << 22))
    ] + [  # a kernel with no peak at the larger size: it failed there
        TpuMemoryRecord(
            "allgather_matmul", "ring2", "v5e:2x4", (), peak, 0, 1, arg, 2, "xla", arg * 3, 1, False, "j"
        )
        for arg, peak in ((1 << 20, 2 << 20), (4 << 20, None))
    ]
    bench = [
        BenchRecord("all_gather", impl, base, "8-x-auto", 8, size // 8, "d", t, size, size, "cpu")
        for impl, base, scale in (("ring", False, 2e-9), ("xla", True, 1e-9))
        for size, t in ((1 << 16, 1e-4), (1 << 20, 1e-3), (1 << 24, 1e-2))
    ]
    tables = [
        results.Table("TPU schedule", ["..."], schedule),
        results.Table("TPU memory", ["..."], memory),
        results.Table("benchmark", ["..."], bench),
    ]
    return results.to_json(
        [*failed, *passed],
        tables,
        started=datetime.datetime(2026, 1, 1),
        duration_s=1.0,
        stale=[],
        command=["pytest"],
        summary=failure_summary.summarize(failed),
    )


def test_the_html_page_groups_failures_by_cause_and_draws_the_ladders() -> None:
    page = html_page.to_html(_ladder_document())
    assert page.count('<section class="kernel"') == 2 and page.count(" failed</h3>") == 1, "one kernel failed"
    assert page.count('<section class="cause"') == 2, "two causes, each once"
    assert f"<b>3x</b> {WRONG}" in page and "<b>1x</b> transfers exposed" in page
    # each cause open: its replay line (with a copy button) before its smallest case's message
    replay = page.index('<p class="replay">replay: <code>python -m conformance replay values')
    assert replay < page.index('class="copy"') < page.index("smallest: <code>all_gather/"), page
    # the terminal's summary above the causes: where to start and why there
    assert page.index('<pre class="summary"') < page.index('<section class="kernel"'), page
    # a failing cell links to its cause, an implementation to its section
    assert f'<a href="#cause-{html_page.slug(FAMILY + "/" + IMPL)}-1">FAIL' in page, page
    assert f'<a href="#kernel-{html_page.slug(FAMILY + "/" + IMPL)}">' in page, page
    assert f"3x {WRONG}" in page[page.index('<pre class="summary"') :], page
    assert page.count('<svg class="ladder"') == 3, "one plot per ladder table"
    assert page.count('class="series"') == 7 and 'stroke-dasharray="5 3"' in page, "baseline dashed"
    assert page.count('class="limit"') == 2 and "the limit: 3x the baseline" in page, "memory's limit"
    assert "MiB exposed per call" in page and "collective matmul: a kernel above it" in page
    assert page.count('class="missing"') == 1 and "ring2: no value at 4 MiB (it failed there)" in page
    assert "<rect x=" in page and "<polygon points=" in page, "a marker shape per line"
    assert "<script" not in page and "http" not in page.replace("http://www.w3.org/2000/svg", "")


def _in_browser(profile: Path, page: Path, *args: str) -> subprocess.CompletedProcess:
    """Headless Chromium on ``page`` with ``args`` and a profile of the test's own; the test fails
    where no Chromium is installed (the page is judged in a real browser: .ci/run installs it)."""
    from conformance.selftest.test_downstream import CHROMIUM_FLAGS

    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        pytest.fail(
            "chromium is not installed: the HTML report is checked in a real browser (.ci/run installs it)"
        )
    return subprocess.run(
        [chromium, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", *args, page.as_uri()],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_html_page_renders_its_plots_in_a_browser(tmp_path) -> None:
    path = tmp_path / "report.html"
    html_page.write_html(str(path), _ladder_document())
    dom = _in_browser(tmp_path / "profile", path, "--dump-dom")
    assert dom.returncode == 0, dom.stderr[-2000:]
    shown = dom.stdout
    assert shown.count('class="series"') == 7 and shown.count("<svg") == 3, shown[:3000]
    assert shown.count('class="limit"') == 2 and shown.count('class="missing"') == 1, shown[:3000]
    shot = tmp_path / "report.png"
    done = _in_browser(tmp_path / "profile", path, "--window-size=1400,1400", f"--screenshot={shot}")
    assert done.returncode == 0 and shot.stat().st_size > 10_000, done.stderr[-2000:]


#: Measures the page as the browser laid it out, into an attribute of its body (the test's own script,
#: added to a copy of the page: the report itself runs none but its copy buttons').
_MEASURE = """<script>
const box = document.querySelector('.matrix-scroll'), edge = box.getBoundingClientRect();
const links = [...document.querySelectorAll('a[href^="#"]')];
document.body.setAttribute('data-measured', JSON.stringify({
  windowWidth: innerWidth, boxRight: edge.right, scrolls: box.scrollWidth > box.clientWidth,
  firstColumn: getComputedStyle(document.querySelector('#matrix-table td.impl')).position,
  headers: document.querySelectorAll('#matrix-table th').length,
  unreachable: [...document.querySelectorAll('#matrix-table th')].filter(
    th => th.getBoundingClientRect().right - edge.left > box.scrollWidth + 1).length,
  links: links.length,
  unresolved: links.map(a => a.getAttribute('href')).filter(h => !document.getElementById(h.slice(1))),
  summaryScrolls: (s => s.scrollWidth > s.clientWidth)(document.querySelector('pre.summary')),
}));
</script>"""


def _wide_document() -> dict:
    """A run over 32 checks (wider than 1400 px) with a failure in each of two kernels."""
    import datetime

    checks = [f"check_number_{i:02d}" for i in range(32)]
    outcomes = [
        results.Outcome(
            id=f"{impl}/{c}", nodeid=f"t[{impl}-{c}]", outcome="passed", family=FAMILY, impl=impl, check=c
        )
        for impl in (IMPL, "ring")
        for c in checks[1:]
    ] + [
        results.Outcome(
            id=f"{FAMILY}/{impl}/{checks[0]}",
            nodeid=f"t[{impl}]",
            outcome="failed",
            family=FAMILY,
            impl=impl,
            check=checks[0],
            message=f"[{checks[0]}] {WRONG}\n  " + "a long line of the failure " * 20,
            case="8-x-auto:rows_per_shard=1,cols=128:float32:seed=0",
            replay=f"python -m conformance replay {checks[0]} {FAMILY} {impl} 8-x-auto",
            what=WRONG,
        )
        for impl in (IMPL, "ring")
    ]
    summary = ["a summary line " * 30]
    return results.to_json(
        outcomes,
        [],
        started=datetime.datetime(2026, 1, 1),
        duration_s=1.0,
        stale=[],
        command=["pytest"],
        summary=summary,
    )


def test_the_html_page_holds_a_wide_matrix_and_every_link_resolves_in_a_browser(tmp_path) -> None:
    """At 1400 px a matrix of 32 checks scrolls in its own box with its first column held, every
    column inside the box, every in-page link (failing cells, implementations, the navigation) lands on
    an element, and the summary wraps rather than scrolls; the screenshot is kept beside the page."""
    import json

    page = html_page.to_html(_wide_document())
    assert "<script" not in page, "the report runs no script of its own"
    measured_page = tmp_path / "measured.html"
    measured_page.write_text(page.replace("</body>", _MEASURE + "</body>"))
    window = "--window-size=1400,1000"
    dom = _in_browser(tmp_path / "profile", measured_page, window, "--dump-dom")
    assert dom.returncode == 0, dom.stderr[-2000:]
    found = re.search(r'data-measured="([^"]*)"', dom.stdout)
    assert found, dom.stdout[-2000:]
    measured = json.loads(html.unescape(found.group(1)))
    assert measured["headers"] == 33 and measured["unreachable"] == 0, measured
    assert measured["boxRight"] <= measured["windowWidth"], measured  # the box is not cut off the page
    assert measured["scrolls"] and measured["firstColumn"] == "sticky", measured
    assert measured["links"] >= 8 and measured["unresolved"] == [], measured
    assert not measured["summaryScrolls"], measured
    shot = tmp_path / "wide-report.png"
    done = _in_browser(tmp_path / "profile", measured_page, window, f"--screenshot={shot}")
    assert done.returncode == 0 and shot.stat().st_size > 10_000, done.stderr[-2000:]
    print(f"screenshot: {shot}")


def test_the_html_page_starts_where_the_terminal_does() -> None:
    """The smallest case of a cause is the terminal's (fewer devices first, then fewer elements), not
    the one whose token has the smallest numbers."""
    import datetime

    cases = [
        "8-x-auto:rows_per_shard=1,cols=1:float32:seed=0",
        "2-x-auto:rows_per_shard=64,cols=64:float32:seed=0",
    ]
    failed = [
        results.Outcome(
            id=f"{FAMILY}/{IMPL}/values/{case.split(':')[0]}",
            nodeid=f"test_values[{i}]",
            outcome="failed",
            family=FAMILY,
            impl=IMPL,
            check="values",
            message=f"[values] {WRONG}",
            case=case,
            replay=f"python -m conformance replay values {FAMILY} {IMPL} {case}",
            what=WRONG,
        )
        for i, case in enumerate(cases)
    ]
    document = results.to_json(
        failed, [], started=datetime.datetime(2026, 1, 1), duration_s=1.0, stale=[], command=["pytest"]
    )
    page = html_page.to_html(document)
    assert f"smallest: <code>{FAMILY}/{IMPL}/values/2-x-auto</code>" in page, page[-3000:]


def test_a_cause_says_why_in_the_summary_and_the_page() -> None:
    """Where a check said more than its verdict (which block landed where), the smallest case's line
    is under the cause in the terminal's summary and in the page's cause line, open or not."""
    import datetime

    why = "out rows 3:6 on device 0 holds device 3's block (expected device 1's)"
    case = _case("4-x-auto", 3)
    error = ConformanceFailure(WRONG)
    error.case, error.check, error.what, error.why = case, "values", WRONG, why
    verdict = _outcome("values", "failed", None, case, WRONG)
    verdict.failure = results.FailureCause.of(error)
    verdict.why = why
    lines = failure_summary.summarize([verdict])
    assert f"       why: {why}" in lines, lines
    document = results.to_json(
        [verdict], [], started=datetime.datetime(2026, 1, 1), duration_s=1.0, stale=[], command=["pytest"]
    )
    page = html_page.to_html(document)
    summary = page[page.index('<section class="cause"') :]
    summary = summary[: summary.index("<pre>")]
    assert "why: out rows 3:6 on device 0 holds device 3&#x27;s block" in summary, summary


def test_a_cause_with_a_block_map_draws_it_as_a_grid() -> None:
    """The block map's picture in a failure's message becomes a coloured grid in its cause's section:
    a cell per device and row block, classed by what it holds; a message without one draws none."""
    import datetime

    from conformance.checks import block_picture

    cells = {("device 0 (p0)", 0): ".", ("device 0 (p0)", 1): "2", ("device 1 (p1)", 0): "-"}
    cells[("device 1 (p1)", 1)] = "?"
    drawn = block_picture.lines(cells, ["device 0 (p0)", "device 1 (p1)"], 2)
    message = "\n".join([f"[values] {WRONG}", *("  " + line for line in drawn), "  replay: ..."])
    verdict = _outcome("values", "failed", None, _case("2-x-auto", 3), WRONG)
    verdict.message = message
    document = results.to_json(
        [verdict], [], started=datetime.datetime(2026, 1, 1), duration_s=1.0, stale=[], command=["pytest"]
    )
    page = html_page.to_html(document)
    grid = page[
        page.index('<table class="blocks">') : page.index("</table>", page.index('<table class="blocks">'))
    ]
    assert grid.count("<tr>") == 3 and "<th>0</th><th>1</th>" in grid, grid
    for css in ("b-right", "b-other", "b-zeros", "b-mixed"):
        assert grid.count(f'class="{css}"') == 1, (css, grid)
    assert "device 0 (p0), block 1: holds row block 2&#x27;s data" in grid, grid
    verdict.message = f"[values] {WRONG}"
    plain = html_page.to_html(
        results.to_json(
            [verdict], [], started=datetime.datetime(2026, 1, 1), duration_s=1.0, stale=[], command=["pytest"]
        )
    )
    assert '<table class="blocks">' not in plain


def _with_why(check: str, case: Case, what: str, why: str | None) -> results.Outcome:
    error = ConformanceFailure(what)
    error.case, error.check, error.what, error.why = case, check, what, why
    verdict = _outcome(check, "failed", None, case, what)
    verdict.failure = results.FailureCause.of(error)
    return verdict


def test_a_known_mistake_leads_the_summary_and_its_cause() -> None:
    """A cause whose failure matched a known mistake of the family comes first (before a wrong result
    of a smaller case that names none), and within a cause the failure that matched one is shown
    before a smaller one that did not: the defect named by what it is."""
    mistake = "the result is exactly what receiver-side output offsets give"
    gradients = "gradient d_x differs from the numpy float64 reference"
    verdicts = [
        _with_why("gradients", _case("2-x-auto", 1), gradients, "rows of 1 of 2 devices' results are wrong"),
        _with_why("values", _case("3-x-auto", 1), WRONG, "rows of 1 of 3 devices' results are wrong"),
        _with_why("values", _case("8-x-explicit", 3), WRONG, mistake),
    ]
    lines = failure_summary.summarize(verdicts)
    text = "\n".join(lines)
    causes = [line for line in lines if line.startswith("    ") and "x " in line[:8]]
    assert causes[0].endswith(WRONG) and causes[1].endswith(gradients), text
    assert f"       why: {mistake}" in lines, text
    assert "rows of 1 of 3 devices" not in text, text
    assert "start here : python -m conformance replay values all_gather" in text, text
    assert "8-x-explicit:rows_per_shard=3" in lines[-2], text

    unnamed = failure_summary.summarize(verdicts[:2])  # without it: the smallest case leads
    assert "start here : python -m conformance replay gradients" in "\n".join(unnamed), unnamed


def test_a_ring_hint_claims_only_the_rings_that_ran() -> None:
    """Failing on the rings of 5 and 8 and passing on the ring of one says so of the rings that ran, and
    names the lengths between that did not run (the ring of 2 may well pass)."""
    verdicts = [
        _outcome("values", "failed", None, _case(f"{n}-x-auto", 1), WRONG, mesh=f"{n}-x-auto") for n in (5, 8)
    ]
    verdicts.append(_outcome("values", "passed", mesh="1-x-explicit"))
    text = "\n".join(failure_summary.summarize(verdicts))
    assert "failed on rings of 5, 8 only and passed on rings of 1" in text, text
    assert "every ring longer than one that ran fails (rings of 2, 3, 4, 6, 7 did not run)" in text, text


def test_the_fixed_shape_line_gives_the_dims_that_ran() -> None:
    """A kernel that claims even rows only runs the odd fixed shape at 4 rows and its twin at 8: the line
    names those dims, and the family's they were moved from."""
    verdicts = []
    for shape, rows in (("odd", 4), ("even", 8)):
        run = _case("8-x-explicit", rows)
        failed = _outcome("output_sharding", "failed", shape, run, WRONG)
        verdicts.append(dataclasses.replace(failed, case=run.token))
    text = "\n".join(failure_summary.summarize(verdicts))
    moved = "the family's rows_per_shard={}, cols=128, moved to what the kernel claims"
    assert f"odd (rows_per_shard=4, cols=128: {moved.format(3)}) 1 of 1 failed" in text, text
    assert f"even (rows_per_shard=8, cols=128: {moved.format(4)}) 1 of 1 failed" in text, text
