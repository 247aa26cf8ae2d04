"""The end of a pytest session: each test's outcome into the run log, then the tables, the
kernel x check matrix, the failures by cause, the JSON and HTML files and the JUnit properties,
all drawn from that log (:class:`conformance.reports.results.RunLog`)."""

from __future__ import annotations

import re
import time

import pytest

from conformance import checks, claims
from conformance.fixtures import devices as devices_lib
from conformance.jobs import distributed
from conformance.plugin import xdist_workers
from conformance.reports import bench, failure_summary, html_page, provenance, results
from conformance.run import interpret_outcomes
from conformance.session import Session

#: The JUnit property of a test whose verdict was read back, not run
#: (:mod:`conformance.run.interpret_outcomes`).
READ_BACK = "interpret_outcome"
#: The JUnit property (and JSON field) of a verdict that ran an op emulated on CPU: what ran so.
EMULATED = "emulated"

#: The pytest session's :class:`~conformance.session.Session` (settings, state and run log).
SESSION = pytest.StashKey[Session]()
#: When the session started (wall clock, monotonic).
STARTED = pytest.StashKey[tuple]()
#: The platforms whose tests were selected.
PLATFORMS = pytest.StashKey[set]()
#: Platforms whose tests were selected but whose backend this host lacks: the host's description.
MISSING_BACKENDS = pytest.StashKey[dict]()
#: pytest's exit status, once the session finished.
EXIT_STATUS = pytest.StashKey[int]()
#: The report files the end of the run wrote (``None``) or could not (the error).
WRITTEN = pytest.StashKey[dict]()


def run_log(config: pytest.Config) -> results.RunLog:
    """This pytest session's :class:`~conformance.reports.results.RunLog`."""
    return config.stash[SESSION].log


def conformance_failure(error: BaseException | None):
    """The check's failure inside a test's exception (hypothesis may group several: take the smallest)."""
    from conformance.checks import ConformanceFailure

    found, caseless, stack = [], [], [error]
    while stack:
        e = stack.pop()
        if e is None:
            continue
        if isinstance(e, ConformanceFailure):
            (found if e.case is not None else caseless).append(e)
        stack += [getattr(e, "failure", None), *getattr(e, "exceptions", ())]
    smallest = min(found, key=lambda f: f.case.size_key(), default=None)
    return smallest or next((f for f in caseless if getattr(f, "what", None)), None)


def skip_reason(rep: pytest.TestReport) -> str:
    text = (
        str(rep.longrepr[2])
        if isinstance(rep.longrepr, tuple) and len(rep.longrepr) == 3
        else str(rep.longrepr or "")
    )
    # pytest prefixes "Skipped: " (or the class of a skip subclass, e.g. claims.NotClaimed)
    return re.sub(r"^(Skipped|[\w.]*NotClaimed): ", "", text)


def _is_not_claimed(rep: pytest.TestReport) -> bool:
    return rep.skipped and not hasattr(rep, "wasxfail") and skip_reason(rep).startswith(claims.NOT_CLAIMED)


def _outcome_of(rep: pytest.TestReport) -> str | None:
    """The results-model outcome one phase's report gives (``None``: the phase says nothing)."""
    if rep.failed:
        text = str(rep.longrepr or "")
        return "xpassed" if rep.when == "call" and text.startswith("[XPASS(strict)]") else "failed"
    if rep.skipped:
        if hasattr(rep, "wasxfail"):
            return "xfailed"
        return "not_claimed" if _is_not_claimed(rep) else "skipped"
    if rep.when == "call":
        return "xpassed" if hasattr(rep, "wasxfail") else "passed"
    return None


#: The line pytest-xdist puts before a worker's failure ("[gw0] linux -- Python 3.11.7 /.../python"):
#: not the kernel's message.
_WORKER_LINE = re.compile(r"\A\[gw\d+\] [^\n]* -- Python [^\n]*\n")


class OutcomeRecorder:
    """Writes each test's outcome into the run log (registered at configure: this hook gets no config)."""

    def __init__(self, log: results.RunLog, *, from_workers: bool = False) -> None:
        self.log = log
        #: The reports come from pytest-xdist workers, with their tests' id parts and records.
        self.from_workers = from_workers

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if self.from_workers:
            xdist_workers.take_report_payload(self.log, report)
        props = dict(report.user_properties)
        if "conformance_id" not in props:
            return
        got = _outcome_of(report)
        if got is None:
            return
        prior = self.log.outcomes.get(report.nodeid)
        if prior is not None and prior.outcome in ("failed", "xpassed"):
            return  # a teardown does not undo a failure
        cause = getattr(report, "conformance_failure", None) if report.failed else None
        if report.failed or report.skipped:
            message = skip_reason(report) if report.skipped and got != "xfailed" else str(report.longreprtext)
        else:
            message = ""
        message = _WORKER_LINE.sub("", message, count=1)
        self.log.outcomes[report.nodeid] = results.Outcome(
            id=props["conformance_id"],
            nodeid=report.nodeid,
            outcome=got,
            message=message[:8000],
            case=props.get("case"),
            replay=props.get("replay"),
            duration_s=round(report.duration + (prior.duration_s if prior else 0.0), 4),
            xfail_reason=getattr(report, "wasxfail", None) or None,
            what=cause.get("what") if cause else None,
            why=cause.get("why") if cause else None,
            emulated=props.get(EMULATED) or None,
            failure=results.FailureCause.from_json(cause) if cause else None,
        )


def pytest_report_teststatus(report: pytest.TestReport, config: pytest.Config):
    """A case the kernel does not claim is its own category: ``n`` / NOT CLAIMED, counted apart."""
    if _is_not_claimed(report):
        return "not claimed", "n", ("NOT CLAIMED", {"yellow": True})
    return None


def outcomes(log: results.RunLog) -> list[results.Outcome]:
    """Every outcome of this run, with the parts of its id filled in."""
    out = []
    for nodeid, o in log.outcomes.items():
        meta = log.item_meta.get(nodeid, {})
        for key in ("family", "impl", "check", "mesh", "platform", "dtype", "shape", "dma_mode"):
            setattr(o, key, meta.get(key))
        out.append(o)
    return out


def tables(log: results.RunLog) -> list[results.Table]:
    """Every table of this run: each check's, from its records, in the order of the checks; then
    the benchmarks'."""
    made = []
    for check in checks.CHECKS.values():
        records = log.records.get(check.name, [])
        if check.tables is not None and records:
            made += [results.Table(title, lines, records) for title, lines in check.tables(records)]
    benchmarks = log.records.get(bench.SOURCE, [])
    made += [
        results.Table(title, lines, [r for r in benchmarks if r.family in title])
        for title, lines in bench.tables(benchmarks)
    ]
    return made


def missing_backends(config: pytest.Config) -> dict[str, str]:
    """Each platform whose tests were selected but whose backend this host lacks, with the host's
    description (under pytest-xdist, as the workers found them)."""
    if MISSING_BACKENDS in config.stash:
        return config.stash[MISSING_BACKENDS]
    platforms = sorted(config.stash.get(PLATFORMS, set()))
    missing = [p for p in platforms if not devices_lib.has_platform(p)]
    return {p: devices_lib.describe_host() for p in missing}


def _missing_backends(config: pytest.Config) -> list[str]:
    """Lines for each platform whose tests were selected but whose backend this host lacks."""
    lines = []
    for platform, host in sorted(missing_backends(config).items()):
        every = outcomes(run_log(config))
        ran = [o for o in every if o.platform == platform and o.outcome in ("passed", "failed")]
        skipped = sum(o.platform == platform and o.outcome == "skipped" for o in every)
        if not skipped:
            continue  # nothing of that platform was left undone (a compile tier's tests, say)
        lines.append(
            f"no {platform} backend on this host ({host}): {skipped} {platform} tests skipped, "
            f"{len(ran)} ran; --require-backend={platform} makes this a failure"
        )
    return lines


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    tr = terminalreporter
    if distributed.is_multi_process() and distributed.rank_and_size()[0] != 0:
        rank, size = distributed.rank_and_size()
        tr.write_line(f"rank {rank} of {size}: the tables, matrix and failure summary are printed by rank 0")
        return
    log = run_log(config)
    for table in tables(log):
        tr.section(table.title)
        for line in table.lines:
            tr.write_line(line)
    lines = results.matrix_lines(outcomes(log))
    if lines:
        tr.section("conformance matrix: implementation x check")
        for line in lines:
            tr.write_line(line)
    lines = failure_summary.summarize(outcomes(log))
    if lines:
        tr.section("conformance failures by implementation: each cause once, smallest failing case first")
        for line in lines:
            tr.write_line(line)
    if log.stale:
        tr.section("stale known-failure lines: they match no collected test")
        for s in log.stale:
            tr.write_line(f"{s['file']}:{s['line']}: {s['pattern']}  ({s['kind']})")
    read_back = [
        r
        for key in ("passed", "failed")
        for r in tr.stats.get(key, [])
        if getattr(r, "when", "") == "call" and dict(getattr(r, "user_properties", ())).get(READ_BACK)
    ]
    if read_back:
        tr.write_line(
            f"conformance: {len(read_back)} checks of Pallas kernels {interpret_outcomes.READ_BACK_NOTE} "
            "(--compilation-cache=off runs them all)"
        )
    emulated = sorted({o.emulated for o in log.outcomes.values() if o.emulated})
    for label in emulated:
        ran = sum(o.emulated == label for o in log.outcomes.values())
        tr.write_line(f"conformance: {ran} verdicts ran so: {label}", yellow=True)
    for line in _missing_backends(config):
        tr.write_line(line, yellow=True, bold=True)
    for path, error in config.stash.get(WRITTEN, {}).items():
        if error is None:
            tr.write_line(f"conformance: wrote {path}")
        else:
            tr.write_line(f"conformance: could not write {path}: {error}", red=True, bold=True)


@pytest.hookimpl(tryfirst=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus) -> None:
    config = session.config
    config.stash[EXIT_STATUS] = int(exitstatus)
    log = run_log(config)
    if xdist_workers.is_worker(config):  # the controller reports; it needs what collection found here
        platforms = config.stash.get(PLATFORMS, set())
        output = xdist_workers.worker_output(log, platforms, missing_backends(config))
        config.workeroutput[xdist_workers.WORKER_OUTPUT_KEY] = output  # type: ignore[attr-defined]
        return
    if not log.outcomes:
        return
    made = tables(log)
    xml = junit_xml(config)
    if xml is not None:  # the tables reach JUnit as testsuite properties, with what made the verdicts
        xml.add_global_property(provenance.PROPERTY, provenance.source_digest())
        for table in made:
            xml.add_global_property(f"conformance: {table.title}", "\n".join(table.lines))
    json_path, html_path = config.getoption("conformance_json"), config.getoption("conformance_html")
    if not (json_path or html_path) or (distributed.is_multi_process() and distributed.rank_and_size()[0]):
        return  # in a multi-process job rank 0 writes them
    started, t0 = config.stash[STARTED]
    document = results.to_json(
        outcomes(log),
        made,
        started=started,
        duration_s=time.monotonic() - t0,
        stale=log.stale,
        command=results.command_line(list(config.invocation_params.args)),
        summary=failure_summary.summarize(outcomes(log)),
    )
    written = config.stash.setdefault(WRITTEN, {})
    for path, write in ((json_path, results.write_json), (html_path, html_page.write_html)):
        if not path:
            continue
        try:  # made writable at configure; a disk that filled since must not lose the run's summary
            write(path, document)
            written[path] = None
        except OSError as e:
            written[path] = f"{type(e).__name__}: {e}"
            session.exitstatus = session.exitstatus or pytest.ExitCode.TESTS_FAILED


def junit_xml(config: pytest.Config):
    """pytest's JUnit writer of this run (``--junitxml``), or ``None``."""
    try:
        from _pytest.junitxml import xml_key
    except ImportError:  # pragma: no cover - pytest moved it
        return None
    return config.stash.get(xml_key, None)
