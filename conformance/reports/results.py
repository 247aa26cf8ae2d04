"""One model of a run's results, and every report made from it: matrix, JSON, HTML.

Each test the plugin sees becomes one :class:`Outcome`, keyed by a uniform id::

    family/impl/check/mesh/platform[/dtype][/shape][/dma_mode]

e.g. ``all_gather/my_ring/values/2x4-y-auto/cpu`` or
``allgather_matmul/my_ring/dtype/4-x-explicit/cpu/bfloat16/odd``; a part the
test is not parametrized over is left out. Known-failures files and the kernel
x check matrix key on these ids (the suite's own fixed tests, which check the
built-in kernels, have ids ``suite/<module>/<test>[<params>]``).

An outcome is one of :data:`OUTCOMES`. ``not_claimed`` is a case the kernel's
registration declares it does not support (see :mod:`conformance.claims`);
it is neither a pass nor a skip.

The JSON (``--conformance-json``), schema version :data:`SCHEMA`::

    {"schema": "conformance-results/1",
     "versions": {"python", "jax", "jaxlib", "numpy", "conformance"},
     "platform": {"backend", "devices": [{"platform", "kind", "count"}], "host"},
     "command": [...], "started": ISO time, "duration_s": float,
     "counts": {outcome: n},
     "matrix": {"family/impl": {check: {outcome: n}}},
     "outcomes": [{"id", "nodeid", "family", "impl", "check", "mesh", "platform", "dtype",
                   "shape", "dma_mode", "outcome", "message", "case", "replay", "duration_s",
                   "xfail_reason", "what", "why", "emulated"}],
     "tables": [{"title", "lines": [...], "records": [{...}, ...]}],
     "known_failures": {"stale": [{"file", "line", "pattern"}]},
     "summary": [line, ...]}

The HTML (``--conformance-html``) is one self-contained file (no script, no
network): the matrix first, then every failure with its message and replay
line, then the tables.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import pathlib
import platform as platform_lib
import sys
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from typing import Any

SCHEMA = "conformance-results/1"
OUTCOMES = ("passed", "failed", "skipped", "xfailed", "xpassed", "not_claimed")
#: Matrix cell letters, in the order cells list them.
_LETTER = {"failed": "F", "xpassed": "X", "passed": "P", "xfailed": "x", "not_claimed": "n", "skipped": "s"}


#: The words every known mistake's ``why`` says, whichever check matched it.
KNOWN_MISTAKE_WORDS = " exactly what "


@dataclasses.dataclass(frozen=True)
class FailureCause:
    """What the failure summary needs of a check's failure, in plain values (with pytest-xdist it
    travels on the test's report from the worker that ran it to the process that reports)."""

    #: The check that failed.
    check: str | None
    #: Its one-line verdict, which the summary groups failures by.
    what: str | None
    #: The failing case's token, its size (smallest first) and its replay command; ``None`` when
    #: the failure names no case.
    case_token: str | None = None
    case_size: tuple[Any, ...] | None = None
    replay: str | None = None
    #: Why, in one line, where the check said more than its verdict (which block landed where).
    why: str | None = None

    @property
    def names_a_known_mistake(self) -> bool:
        """Whether ``why`` is a known mistake of the family that the result matched ("the result is
        exactly what ... gives", :mod:`conformance.checks.wrong_result`; "the gradients are exactly what
        ... gives", :mod:`conformance.checks.autodiff`): the defect named by what it is."""
        return bool(self.why) and KNOWN_MISTAKE_WORDS in self.why

    @classmethod
    def of(cls, failure: Any, *, check: str | None = None) -> FailureCause | None:
        """The cause of a :class:`~conformance.checks.ConformanceFailure` (``check``: the test's, for a
        failure that does not name one)."""
        if failure is None:
            return None
        case, named = getattr(failure, "case", None), getattr(failure, "check", None) or check
        if case is None:
            return cls(named, getattr(failure, "what", None), why=getattr(failure, "why", None))
        return cls(
            named,
            failure.what,
            case_token=case.token,
            case_size=tuple(case.size_key()),
            replay=case.replay_command(named) if named else None,
            why=getattr(failure, "why", None),
        )

    def as_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> FailureCause:
        size = data.get("case_size")
        return cls(**{**data, "case_size": tuple(size) if size is not None else None})


@dataclasses.dataclass
class Outcome:
    id: str
    nodeid: str
    outcome: str
    family: str | None = None
    impl: str | None = None
    check: str | None = None
    mesh: str | None = None
    platform: str | None = None
    dtype: str | None = None
    shape: str | None = None
    dma_mode: str | None = None
    message: str = ""
    case: str | None = None
    replay: str | None = None
    duration_s: float = 0.0
    xfail_reason: str | None = None
    #: A failure's one-line verdict (what the failure summary groups by), where a check gave one.
    what: str | None = None
    #: Why, in one line, where the check said more than its verdict (which block landed where).
    why: str | None = None
    #: What ran emulated for this verdict (XLA's ragged all-to-all on CPU), where something did.
    emulated: str | None = None
    #: The check's failure as the run's failure summary needs it; not part of the JSON.
    failure: FailureCause | None = dataclasses.field(default=None, compare=False, repr=False)

    def as_json(self) -> dict[str, Any]:
        """Its fields as the JSON report has them (the failure cause stays behind)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "failure"}


@dataclasses.dataclass
class RunLog:
    """Everything one pytest session's run produced, kept on that session (the plugin's
    :class:`~conformance.session.Session`, in ``config.stash``): the terminal tables, the JSON, the
    HTML and the JUnit properties are all drawn from it."""

    #: Every outcome of a test of the suite, by node id.
    outcomes: dict[str, Outcome] = dataclasses.field(default_factory=dict)
    #: Every collected test's uniform id and its parts, by node id.
    item_meta: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    #: Lines of ``--xfails-file`` / ``--skips-file`` that matched no collected test.
    stale: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    #: The records the checks (and benchmarks) made, by check name, in the order they came.
    records: dict[str, list[Any]] = dataclasses.field(default_factory=dict)
    #: By node id: the last check a test ran, and its case (the replay line of a passing test too).
    last_check: dict[str, Any] = dataclasses.field(default_factory=dict)
    #: The node id of the test running now.
    current: str | None = None
    #: Records not yet sent on, as ``(source, record)``, where another process reports this run (a
    #: pytest-xdist worker's log); ``None``: kept here only.
    unsent: list[tuple[str, Any]] | None = None

    def add(self, outcome: Any) -> None:
        """A :class:`~conformance.run.outcomes.CheckOutcome` of the running test: its records join the
        run's, and it becomes the test's last check."""
        self.add_records(outcome.check, outcome.records)
        if self.current is not None:
            self.last_check[self.current] = outcome

    def add_records(self, source: str, records: Iterable[Any]) -> None:
        records = list(records)
        self.records.setdefault(source, []).extend(records)
        if self.unsent is not None:
            self.unsent += [(source, r) for r in records]

    def take_unsent(self) -> list[tuple[str, Any]]:
        """The records made since the last call (to send with a test's report), and forget them."""
        if self.unsent is None:
            return []
        taken, self.unsent = self.unsent, []
        return taken


@dataclasses.dataclass
class Table:
    title: str
    lines: list[str]
    records: list[Any] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(frozen=True)
class IdParts:
    """Which test parameters a family's uniform ids are made of. A family test module whose tests
    name them otherwise sets ``ID_PARTS`` to its own (the send_recv tests: a route for the mesh, a
    layout for the shape, and the bad destination after it)."""

    #: The parameter that is the mesh (a value with ``label`` and ``num_devices``).
    mesh: str = "mesh_config"
    #: The parameter that is the shape.
    shape: str = "shape"
    #: Parameters that follow the shape in the id, before the DMA mode.
    extra: tuple[str, ...] = ()

    def of(self, module: object) -> IdParts:
        """``module``'s own ``ID_PARTS``, else these."""
        return getattr(module, "ID_PARTS", self)


#: The parts of the shard_map families' ids.
ID_PARTS = IdParts()


def uniform_id(family: str, impl: str, check: str, params: dict[str, Any], parts: IdParts = ID_PARTS) -> str:
    """``family/impl/check/mesh/platform[/dtype][/shape][/extra...][/dma_mode]`` (absent parts left
    out), the parameters named by ``parts``."""
    out = [family, impl, check]
    mesh = params.get(parts.mesh)
    out.append(mesh.label if mesh is not None else "no-mesh")
    out.append(str(params.get("platform", "cpu")))
    for key in ("dtype", parts.shape, *parts.extra, "dma_mode"):
        if key in params:
            out.append(str(params[key]))
    return "/".join(out)


def matrix(outcomes: Iterable[Outcome]) -> dict[str, dict[str, Counter]]:
    """``{"family/impl": {check: Counter(outcome)}}`` over the family tests."""
    out: dict[str, dict[str, Counter]] = defaultdict(lambda: defaultdict(Counter))
    for o in outcomes:
        if o.family and o.impl and o.check:
            out[f"{o.family}/{o.impl}"][o.check][o.outcome] += 1
    return out


def cell_text(counts: Counter) -> str:
    return " ".join(f"{counts[k]}{_LETTER[k]}" for k in _LETTER if counts[k])


def verdict_of(counts: Counter) -> str:
    if counts["failed"] or counts["xpassed"]:
        return "FAIL"
    if counts["passed"]:
        return "ok"
    if counts["xfailed"]:
        return "xfail"
    if counts["not_claimed"] and not counts["skipped"]:
        return "not claimed"
    return "skipped"


def matrix_lines(outcomes: Iterable[Outcome]) -> list[str]:
    """The kernel x check matrix as text: one row per implementation, one column per check."""
    m = matrix(outcomes)
    if not m:
        return []
    checks = sorted({c for row in m.values() for c in row})
    width = max(len(k) for k in m)
    lines = [
        "cells: P passed, F failed, x xfailed, X xpassed, n not claimed, s skipped (counts of tests)",
    ]
    for impl, row in sorted(m.items()):
        total = sum((c for c in row.values()), Counter())
        lines.append(f"{impl:<{width}}  {verdict_of(total):<11} {cell_text(total)}")
        for check in checks:
            if check in row:
                lines.append(
                    f"{'':<{width}}    {check:<22} {verdict_of(row[check]):<11} {cell_text(row[check])}"
                )
    return lines


def _jsonable(record: Any) -> Any:
    if dataclasses.is_dataclass(record) and not isinstance(record, type):
        out = {}
        for f in dataclasses.fields(record):
            value = getattr(record, f.name)
            out[f.name] = (
                value if isinstance(value, (str, int, float, bool, type(None))) else _jsonable(value)
            )
        return out
    if isinstance(record, (list, tuple)):
        return [_jsonable(v) for v in record]
    if isinstance(record, dict):
        return {str(k): _jsonable(v) for k, v in record.items()}
    if isinstance(record, (str, int, float, bool, type(None))):
        return record
    return str(record)


def environment() -> dict[str, Any]:
    import jax
    import jaxlib
    import numpy as np

    import conformance
    from conformance.fixtures import devices as devices_lib

    kinds: Counter = Counter()
    for name in devices_lib.PLATFORMS:
        for d in devices_lib.devices_of(name):
            kinds[(name, getattr(d, "device_kind", "?"))] += 1
    return {
        "versions": {
            "python": platform_lib.python_version(),
            "jax": jax.__version__,
            "jaxlib": jaxlib.__version__,
            "numpy": np.__version__,
            "conformance": conformance.__version__,
        },
        "platform": {
            "backend": jax.default_backend(),
            "devices": [{"platform": p, "kind": k, "count": n} for (p, k), n in sorted(kinds.items())],
            "host": devices_lib.describe_host(),
            "machine": platform_lib.machine(),
            "system": platform_lib.system(),
        },
    }


def to_json(
    outcomes: list[Outcome],
    tables: list[Table],
    *,
    started: datetime.datetime,
    duration_s: float,
    stale: list[dict[str, Any]],
    command: list[str],
    summary: list[str] = (),
) -> dict[str, Any]:
    """The run as the JSON document; ``summary``: the failure summary's lines as the terminal printed
    them (:func:`conformance.reports.failure_summary.summarize`), which the HTML page shows above the
    failures."""
    m = matrix(outcomes)
    return {
        "schema": SCHEMA,
        **environment(),
        "command": command,
        "started": started.isoformat(timespec="seconds"),
        "duration_s": round(duration_s, 3),
        "counts": {k: sum(o.outcome == k for o in outcomes) for k in OUTCOMES},
        "matrix": {impl: {c: dict(n) for c, n in row.items()} for impl, row in sorted(m.items())},
        "outcomes": [o.as_json() for o in outcomes],
        "tables": [{"title": t.title, "lines": t.lines, "records": _jsonable(t.records)} for t in tables],
        "known_failures": {"stale": stale},
        "summary": list(summary),
    }


def report_path_problem(path: str, *, option: str) -> str | None:
    """Make ``path`` a file the run can write at its end: its directory created if missing. ``None``
    when it is, else the usage error naming ``option`` and why not (a directory, a directory that
    cannot be made, one this user cannot write), so that a run is refused before it starts rather
    than lost at its end."""
    target = pathlib.Path(path)
    if target.is_dir():
        return f"{option}={path}: that is a directory; give the path of a file to write"
    parent = target.parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        return f"{option}={path}: cannot create its directory {str(parent)!r}: {e.strerror or e}"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"{option}={path}: its directory {str(parent)!r} is not writable by this user"
    if target.exists() and not os.access(target, os.W_OK):
        return f"{option}={path}: the file exists and is not writable by this user"
    return None


def write_json(path: str, document: dict[str, Any]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(document, f, indent=1, sort_keys=False)
        f.write("\n")


def command_line(args: Sequence[str] | None = None) -> list[str]:
    """The command that ran this session, as it can be run again: ``pytest`` (or ``python -m pytest``)
    and its arguments (``args``: pytest's own record of them; else this process's)."""
    first = sys.argv[0] if sys.argv else ""
    runner = ["python", "-m", "pytest"] if first.endswith(("pytest/__main__.py", "-m")) else ["pytest"]
    return [*runner, *(sys.argv[1:] if args is None else args)]
