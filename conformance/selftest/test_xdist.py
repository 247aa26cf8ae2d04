"""pytest-xdist: a run split over worker processes reports what the same run in one process
reports (outcomes, tables, failures by cause, stale known-failure lines), its scheduler keeps one
implementation's tests on one mesh together (and the runner holds one such group's programs at a
time), and a multi-process JAX job refuses ``-n``.

The sub-runs are separate pytest processes with the suite's plugin loaded as a user gets it, on a
correct kernel and one that adds one to every element (it fails its value checks on every mesh).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conformance.jobs import launch
from conformance.plugin import xdist_workers
from conformance.selftest.test_plugin_options import KERNELS, _pytest
from conformance.targets import tpu_compiler

pytestmark = [pytest.mark.selftest]

BROKEN = (
    KERNELS
    + '''

@conformance.register(
    "all_gather", name="opt_gather_plus_one", platforms=("cpu",), dtypes=("float32", "int32")
)
def opt_gather_plus_one(x, *, mesh, axis_name):
    """Adds one to every element it gathers."""
    return opt_gather(x, mesh=mesh, axis_name=axis_name) + 1
'''
)


@pytest.mark.parametrize(
    ("nodeid", "group"),
    [
        (
            "conformance/tests/test_all_gather.py::test_values[pallas_ring_all_gather_bidirectional-8-x-auto-cpu]",
            "conformance/tests/test_all_gather.py::pallas_ring_all_gather_bidirectional::8-x-auto",
        ),
        (
            "conformance/tests/test_all_gather.py::test_dtype[xla_all_gather-2x4-y-explicit-even-int8-cpu]",
            "conformance/tests/test_all_gather.py::xla_all_gather::2x4-y-explicit",
        ),
        (  # the TPU tier's slices are meshes too: schedule and memory share the topology's compiles
            "conformance/tests/test_allgather_matmul.py::test_tpu_memory[ring_allgather_matmul_bidirectional-16-x-explicit]",
            "conformance/tests/test_allgather_matmul.py::ring_allgather_matmul_bidirectional::16-x-explicit",
        ),
        (
            "conformance/tests/test_all_gather.py::test_tpu_layout[pallas_ring_all_gather_unidirectional-int8]",
            "conformance/tests/test_all_gather.py::pallas_ring_all_gather_unidirectional::",
        ),
        (
            "conformance/tests/test_tpu_refusals.py::test_timeout",
            "conformance/tests/test_tpu_refusals.py::test_timeout",
        ),
    ],
)
def test_a_group_is_one_implementation_on_one_mesh(nodeid: str, group: str) -> None:
    assert xdist_workers.group_of(nodeid) == group


def test_one_process_runs_a_group_at_a_time_and_leaves_other_tests_in_place() -> None:
    class Item:
        def __init__(self, nodeid: str) -> None:
            self.nodeid = nodeid

    ids = [
        "conformance/tests/test_all_gather.py::test_values[ring-8-x-auto-cpu]",
        "conformance/tests/test_all_gather.py::test_values[ring-1-x-explicit-cpu]",
        "tests/test_mine.py::test_first",
        "conformance/tests/test_all_gather.py::test_dtype[ring-8-x-auto-odd-int8-cpu]",
        "conformance/tests/test_all_gather.py::test_dtype[ring-1-x-explicit-odd-int8-cpu]",
        "tests/test_mine.py::test_second",
        "conformance/tests/test_all_gather.py::test_races[ring-8-x-auto-on_wait-odd]",
    ]
    items = [Item(i) for i in ids]
    ordered = xdist_workers.in_groups(items, lambda item: item.nodeid.startswith("conformance/"))
    assert [ids.index(i.nodeid) for i in ordered] == [0, 3, 6, 1, 4, 2, 5]


def test_the_runner_holds_one_group_at_a_time() -> None:
    """The checks of one implementation on one mesh share its run while they come one after another;
    a check on another mesh drops what the runner held, so a whole run holds one group's programs."""
    import conformance.kernels  # noqa: F401
    from conformance import checks, runner
    from conformance.family_tests import canonical_case
    from conformance.fixtures.meshes import parse_mesh
    from conformance.run.outcomes import run_here
    from conformance.session import Session

    session = Session()
    ring = {
        n: canonical_case("all_gather", "xla_all_gather", "cpu", parse_mesh(f"{n}-x-auto")) for n in (2, 4)
    }
    runner.release_cases()
    ran = []
    for check, n in (("output_sharding", 2), ("dtype", 2), ("output_sharding", 4)):
        assert run_here(checks.CHECKS[check], ring[n], session).verdict == "passed"
        ran.append(runner.execute_cached.cache_info())
    # one run of the ring of 2, shared by its two checks; then the ring of 4's alone
    assert [(i.hits, i.misses, i.currsize) for i in ran] == [(0, 1, 1), (1, 1, 1), (0, 1, 1)], ran
    assert session.held == runner.held_for(ring[4])


def _section(stdout: str, title: str) -> list[str]:
    """The lines of the terminal section ``title`` (to the next section or the final line)."""
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if title in line and line.startswith("="))
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("=")), len(lines))
    return lines[start + 1 : end]


@pytest.mark.integration
def test_a_run_split_over_workers_reports_what_one_process_reports(tmp_path: Path) -> None:
    pytest.importorskip("xdist")
    runs = {}
    for workers in ("0", "2"):
        where = tmp_path / f"n{workers}"
        where.mkdir()
        (where / "xfails.txt").write_text("all_gather/opt_gather/no_such_check/*\n")
        done = _pytest(
            where,
            "-m",
            "cpu",
            "--impl=opt_gather*",
            "-k",
            "test_values or test_dtype or test_collectives or test_lowered_bytes",
            "--meshes=2-x-auto,4-x-explicit,2x4-y-auto",
            "--xfails-file=xfails.txt",
            "--conformance-json=out.json",
            "-n",
            workers,
            kernels=BROKEN,
        )
        assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-2000:]
        runs[workers] = (done.stdout, json.loads((where / "out.json").read_text()))
    (one_out, one), (split_out, split) = runs["0"], runs["2"]
    assert "bringing up nodes" in split_out and "[gw0]" in split_out, split_out[:2000]  # workers ran
    assert one["counts"] == split["counts"] and one["counts"]["failed"] > 0, (one["counts"], split["counts"])
    assert {o["id"]: o["outcome"] for o in one["outcomes"]} == {
        o["id"]: o["outcome"] for o in split["outcomes"]
    }
    # the failures' verdict lines and cases, and every table, came back from the workers
    by_cause = "conformance failures by implementation"
    assert _section(one_out, by_cause) == _section(split_out, by_cause), split_out[-3000:]
    assert any("start here : python -m conformance replay" in line for line in _section(split_out, by_cause))
    tables = [(t["title"], t["lines"]) for t in split["tables"]]
    assert tables == [(t["title"], t["lines"]) for t in one["tables"]] and tables, split["tables"]
    assert split["known_failures"]["stale"] == one["known_failures"]["stale"] != []
    matrix = "conformance matrix: implementation x check"
    assert _section(one_out, matrix) == _section(split_out, matrix)
    # the report says what the workers had, and the command as it can be run again
    assert one["platform"]["host"] == split["platform"]["host"] == "cpu: 8 devices, gpu: none, tpu: none"
    assert split["command"][:5] == ["python", "-m", "pytest", "--pyargs", "conformance"], split["command"]
    assert split["command"][-2:] == ["-n", "2"], split["command"]
    messages = [o["message"] for o in split["outcomes"] if o["outcome"] == "failed"]
    assert messages and not any(m.startswith("[gw") for m in messages), messages[0][:300]


@pytest.mark.integration
def test_a_multi_process_job_refuses_workers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("xdist")
    monkeypatch.setenv(launch.PROCESS_ID, "0")
    done = _pytest(tmp_path, "-m", "cpu", "--impl=opt_gather", "-n", "2", "--collect-only")
    assert done.returncode == 4, done.stdout[-2000:] + done.stderr[-2000:]
    assert "-n (pytest-xdist) in a multi-process JAX job" in done.stderr, done.stderr[-2000:]


@pytest.mark.integration
def test_every_worker_loads_the_tpu_compiler(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """libtpu's lockfile would leave the TPU compile tier to the first worker that loaded it."""
    pytest.importorskip("xdist")
    if not tpu_compiler.available():
        pytest.skip("no libtpu here (the tpu extra) to load twice")
    monkeypatch.delenv("ALLOW_MULTIPLE_LIBTPU_LOAD", raising=False)
    done = _pytest(tmp_path, "-m", "cpu", "--impl=xla_all_gather", "-k", "test_tpu_pod", "-n", "2", "-rs")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    last = done.stdout.strip().splitlines()[-1]
    assert last.startswith("2 passed") and "skipped" not in last, done.stdout[-3000:]
