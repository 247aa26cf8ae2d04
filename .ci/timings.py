#!/usr/bin/env python3
"""Where CI's time goes: each env's wall time beside its budget, and its test time split by family,
check and implementation, read from the JUnit files the envs write.

    python3 .ci/timings.py --junit-dir .tox/junit [--tox-log tox.log] [--tables] [--top N]

Standard library only (it runs with the system Python after tox). Each tox env writes one JUnit file
per pytest command to ``.tox/junit/<env>-<n>.xml`` (tox.ini); the wall time of an env comes from
tox's own closing lines (``  cpu: OK (123.45=setup[..]+cmd[..] seconds)``) in ``--tox-log``. It
prints a benchmark, it never fails a run: an env past its budget is marked ``OVER``.
"""

from __future__ import annotations

import argparse
import re
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

#: Each env's budget in seconds (set-up included), which together make CI's 45 minutes (2700 s):
#: docs/timings.md says what each env runs and why that is its cover.
BUDGET_S = {
    "lint": 20,
    "cpu": 150,
    "cpu-wide": 250,
    "tpu-compile": 150,
    "selftest": 600,
    "cpu-oldest": 400,
    "cpu-newest": 400,
    "cpu-multiprocess": 300,
    "gpu-compile": 180,
    "gpu-compile-newest": 250,
}
CI_BUDGET_S = 2700
_TOX_LINE = re.compile(r"^\s+(?P<env>[\w.-]+): (?P<status>OK|FAIL[^(]*|SKIP\w*) \((?P<wall>[\d.]+)")
_PARAMS = re.compile(r"^(?P<test>test_\w+)(?:\[(?P<params>.*)\])?$")
_MESH = re.compile(r"^\d+(?:x\d+)*-[xyz]-(?:auto|explicit)(?:-(?:reversed|v5e|v5p))?$")


def tox_walls(log: Path) -> dict[str, tuple[str, float]]:
    """{env: (status, wall seconds)} from the summary tox prints at the end of a run."""
    walls: dict[str, tuple[str, float]] = {}
    for line in log.read_text(errors="replace").splitlines():
        m = _TOX_LINE.match(line)
        if m:
            walls[m["env"]] = (m["status"].strip(), float(m["wall"]))
    return walls


def _family(classname: str) -> str:
    module = classname.rsplit(".", 1)[-1]
    if ".selftest." in f".{classname}.":
        return f"selftest/{module.removeprefix('test_')}"
    return module.removeprefix("test_")


def _implementation(params: str | None) -> str:
    if not params:
        return "-"
    return params.split("-", 1)[0]


def _mesh(params: str | None) -> str:
    """The mesh label in a test's parameters (``impl-MESH-...``), or ``-``."""
    if not params:
        return "-"
    parts = params.split("-")
    for start in range(1, len(parts)):
        for end in range(len(parts), start, -1):
            label = "-".join(parts[start:end])
            if _MESH.match(label):
                return label
    return "-"


def read_junit(path: Path) -> list[dict[str, object]]:
    """One row per test case: family, check, implementation, mesh, outcome, seconds."""
    rows = []
    for case in ET.parse(path).getroot().iter("testcase"):
        m = _PARAMS.match(case.get("name", ""))
        test, params = (m["test"], m["params"]) if m else (case.get("name", "?"), None)
        outcome = "passed"
        for tag in ("failure", "error", "skipped"):
            if case.find(tag) is not None:
                outcome = tag
        rows.append(
            {
                "family": _family(case.get("classname", "")),
                "check": test.removeprefix("test_"),
                "implementation": _implementation(params),
                "mesh": _mesh(params),
                "outcome": outcome,
                "seconds": float(case.get("time", "0") or 0),
            }
        )
    return rows


def _table(rows: list[dict[str, object]], key: str, top: int) -> list[str]:
    seconds: dict[str, float] = defaultdict(float)
    count: dict[str, int] = defaultdict(int)
    for row in rows:
        seconds[str(row[key])] += float(row["seconds"])  # type: ignore[arg-type]
        count[str(row[key])] += 1
    total = sum(seconds.values()) or 1.0
    ranked = sorted(seconds, key=lambda k: -seconds[k])
    lines = [f"| {key} | tests | seconds | share |", "| --- | --- | --- | --- |"]
    for name in ranked[:top]:
        lines.append(
            f"| `{name}` | {count[name]} | {seconds[name]:.0f} | {100 * seconds[name] / total:.0f}% |"
        )
    if len(ranked) > top:
        rest = ranked[top:]
        lines.append(
            f"| {len(rest)} more | {sum(count[k] for k in rest)} | {sum(seconds[k] for k in rest):.0f} | "
            f"{100 * sum(seconds[k] for k in rest) / total:.0f}% |"
        )
    return lines


def env_of(path: Path) -> str:
    """``cpu-oldest-2.xml`` -> ``cpu-oldest``: the env a JUnit file came from."""
    return re.sub(r"-\d+$", "", path.stem)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--junit-dir", type=Path, default=Path(".tox/junit"))
    parser.add_argument("--tox-log", type=Path, help="tox's output, for each env's wall time")
    parser.add_argument(
        "--tables", action="store_true", help="each env's tables by family, check, implementation"
    )
    parser.add_argument(
        "--by", default="family,check,implementation,mesh", help="the tables' keys, comma-separated"
    )
    parser.add_argument("--top", type=int, default=12, help="rows of each table (the rest summed in one)")
    args = parser.parse_args(argv)

    by_env: dict[str, list[dict[str, object]]] = defaultdict(list)
    files = sorted(args.junit_dir.glob("*.xml")) if args.junit_dir.is_dir() else []
    for path in files:
        try:
            by_env[env_of(path)].extend(read_junit(path))
        except ET.ParseError as e:
            print(f"timings: {path}: not a JUnit file ({e}); left out", file=sys.stderr)
    walls = tox_walls(args.tox_log) if args.tox_log and args.tox_log.is_file() else {}

    envs = list(dict.fromkeys([*walls, *by_env]))
    print("| env | status | wall (s) | budget (s) | of budget | tests | test time (s) |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    wall_total = 0.0
    for env in envs:
        status, wall = walls.get(env, ("?", 0.0))
        wall_total += wall
        budget = BUDGET_S.get(env)
        rows = by_env.get(env, [])
        share = f"{100 * wall / budget:.0f}%" + (" OVER" if wall > budget else "") if budget and wall else "-"
        test_s = sum(float(r["seconds"]) for r in rows)  # type: ignore[arg-type]
        print(
            f"| {env} | {status} | {wall:.0f} | {budget or '-'} | {share} | {len(rows) or '-'} | "
            f"{test_s:.0f} |"
        )
    if walls:
        over = " OVER" if wall_total > CI_BUDGET_S else ""
        share = f"{100 * wall_total / CI_BUDGET_S:.0f}%{over}"
        print(f"| in all | | {wall_total:.0f} | {CI_BUDGET_S} | {share} | | |")
    counts = defaultdict(int)
    for rows in by_env.values():
        for row in rows:
            counts[str(row["outcome"])] += 1
    if args.tables:
        for env in by_env:
            rows = by_env[env]
            print(
                f"\n### {env}: {len(rows)} tests, {sum(float(r['seconds']) for r in rows):.0f} s of test time"
            )
            for key in args.by.split(","):
                print()
                print("\n".join(_table(rows, key, args.top)))
    if by_env:  # the JUnit files' tests in all, as one closing line
        failed = counts["failure"] + counts["error"]
        print(f"\ntimings: {counts['passed']} passed, {failed} failed, {counts['skipped']} skipped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
