"""The suite under pytest-xdist: ``pytest conformance -m cpu -n auto`` runs its tests in worker
processes and reports them as one run.

Each worker is a run of its own (its session, its compiled executables, its Pallas worker
process). What the report needs of a test travels back with the test's report, in plain values:
its uniform id and parts, its failure's cause (:class:`conformance.reports.results.FailureCause`) and the
records its checks made for the run's tables (:func:`conformance.run.outcomes.record_to_json`). When a
worker finishes it sends the stale lines of the known-failures files (each worker collects every
test, so each finds the same) and the platforms its tests needed. The controller, the process
that prints, writes the JSON, HTML and JUnit files, rebuilds its run log from these alone.

Scheduling: under ``--dist load`` (what ``-n`` alone gives) the plugin sends every test of one
implementation on one mesh to the same worker (:func:`group_of`), so the fixed-shape checks of a
mesh share one compile and one run as they do in one process, and a TPU-tier test shares the
topology's compiles with the other checks of its slice. Any other ``--dist`` is left as asked.

A multi-process JAX job (``python -m conformance launch``) is already one process per rank; the
plugin refuses ``-n`` there.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from conformance.fixtures.meshes import DEVICE_ORDERS
from conformance.jobs import cpu_share
from conformance.reports import results
from conformance.run import outcomes

#: The key of a worker's end-of-run message in xdist's ``workeroutput``.
WORKER_OUTPUT_KEY = "conformance"
#: The run's header lines on its CPU share, read before the process is given its share.
_HEADER = pytest.StashKey[list[str]]()

#: A mesh label inside a test id's parameters (``8-x-explicit``, ``2x2x2-z-auto``,
#: ``8-x-explicit-reversed``, ``256-x-explicit``).
_MESH_LABEL = re.compile(
    rf"(?:^|-)(\d+(?:x\d+)*-[a-z_]+-(?:auto|explicit)(?:-(?:{'|'.join(DEVICE_ORDERS[1:])}))?)(?=-|$)"
)


def is_worker(config: pytest.Config) -> bool:
    """Whether this process is a pytest-xdist worker (its reports go to a controller)."""
    return hasattr(config, "workerinput")


def is_controller(config: pytest.Config) -> bool:
    """Whether this process hands its tests to pytest-xdist workers (it runs none itself)."""
    return (
        not is_worker(config)
        and bool(getattr(config.option, "numprocesses", None))
        and (getattr(config.option, "dist", "no") != "no")
    )


def let_workers_share_libtpu() -> None:
    """Let every worker load libtpu (the TPU compile tier's compiler): libtpu takes a lockfile per
    host, and the second worker to load it would skip the tier ("Internal error when accessing
    libtpu multi-process lockfile"). Set, unless the user set it, before the workers start. Only the
    compiler is shared: on a TPU VM, whose chips one process holds, run ``-m tpu`` without ``-n``."""
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")


def auto_num_workers(config: pytest.Config | None = None) -> int | None:
    """``-n auto``'s worker count: the CPUs a quota grants (:func:`conformance.jobs.cpu_share.usable_cpus`),
    not the cores a container sees; ``None`` (xdist's own rule) where the user set
    ``PYTEST_XDIST_AUTO_NUM_WORKERS``.

    Where that is one CPU and the run is the suite's own (:func:`runs_the_suite`), none: the tests run
    in this process, as without ``-n``. One worker runs them one at a time too, and its controller
    costs CPU besides (receiving and printing each report, importing JAX): under a quota of half a
    CPU, ``tox -e cpu``'s pytest took 413 s in one process against 463 s with one worker
    (docs/timings.md). Another suite in the same environment keeps its one worker."""
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return None
    usable = cpu_share.usable_cpus()
    return 0 if usable == 1 and config is not None and runs_the_suite(config) else usable


def runs_the_suite(config: pytest.Config) -> bool:
    """Whether the command line names the suite's own tests: a path inside the installed
    ``conformance`` package (``pytest conformance``), or ``--pyargs conformance``."""
    package = Path(__file__).resolve().parents[1]  # the conformance package
    for arg in config.args:
        target = arg.split("::")[0]
        if getattr(config.option, "pyargs", False) and target.split(".")[0] == "conformance":
            return True
        path = (Path(config.invocation_params.dir) / target).resolve()
        if path == package or package in path.parents:
            return True
    return False


def fit_to_cpu_share(config: pytest.Config) -> Callable[[], None]:
    """Run this test process on its share of the CPUs a quota grants (:func:`conformance.jobs.cpu_share.
    fit_to_share`): a worker by its index among the workers, a job's rank by its process id, one
    process alone as the only one. The controller runs no test, and its workers inherit its cores:
    it is left as it is. Returns the closure that undoes it. What the run's header says of the share
    (:func:`header_lines`) is read first, from the cores the process was given."""
    config.stash[_HEADER] = cpu_share.header_lines(workers=auto_num_workers(config))
    if is_controller(config):
        return lambda: None
    if is_worker(config):
        index = int(str(config.workerinput["workerid"]).removeprefix("gw"))
        count = int(config.workerinput["workercount"])
    else:  # a rank of `python -m conformance launch`, or one process
        index = int(os.environ.get("CONFORMANCE_PROCESS_ID", "0"))
        count = int(os.environ.get("CONFORMANCE_NUM_PROCESSES", "1"))
    return cpu_share.fit_to_share(index, count)[1]


def header_lines(config: pytest.Config) -> list[str]:
    """What the run's header says of the CPU share (:func:`conformance.jobs.cpu_share.header_lines`), as it
    stood before this process was given its share."""
    return config.stash.get(_HEADER, [])


def group_of(nodeid: str) -> str:
    """The scheduling group of a test: its module, implementation and mesh (or its module and
    function, for a test parametrized otherwise).

    ``conformance/tests/test_all_gather.py::test_values[pallas_ring_all_gather_bidirectional-8-x-auto-cpu]``
    is in ``conformance/tests/test_all_gather.py::pallas_ring_all_gather_bidirectional::8-x-auto``.
    """
    path, _, rest = nodeid.partition("::")
    function, _, params = rest.partition("[")
    params = params.removesuffix("]")
    if not params:
        return f"{path}::{function}"
    impl = params.split("-", 1)[0]
    mesh = _MESH_LABEL.search(params)
    return f"{path}::{impl}::{mesh.group(1) if mesh else ''}"


def in_groups(items: list[pytest.Item], ours: Callable[[pytest.Item], bool]) -> list[pytest.Item]:
    """``items`` with the suite's tests of one scheduling group (:func:`group_of`) together, groups in
    the order they first appear and tests in a group in their own order; any other test keeps its
    place among the groups. One process then runs a group as an xdist worker does, so what one
    implementation on one mesh shares (its trace, its lowerings for TPU and CUDA, the fixed shapes'
    run) is used while it is held: the runner's bounded caches held it for one check's tests only."""
    first: dict[str, int] = {}
    keys = [group_of(item.nodeid) if ours(item) else item.nodeid for item in items]
    for key in keys:
        first.setdefault(key, len(first))
    order = sorted(range(len(items)), key=lambda i: first[keys[i]])
    return [items[i] for i in order]


def report_payload(log: results.RunLog, meta: dict[str, Any]) -> dict[str, Any]:
    """What a worker's test report carries for the controller: the test's id parts and the records
    made since the last report."""
    return {
        "meta": meta,
        "records": [[source, outcomes.record_to_json(r)] for source, r in log.take_unsent()],
    }


def take_report_payload(log: results.RunLog, report: pytest.TestReport) -> None:
    """On the controller: a worker's report's id parts and records into this run's log."""
    payload = getattr(report, "conformance_payload", None)
    if not payload:
        return
    log.item_meta.setdefault(report.nodeid, payload["meta"])
    for source, record in payload["records"]:
        log.add_records(source, [outcomes.record_from_json(record)])


def worker_output(log: results.RunLog, platforms: set[str], missing: dict[str, str]) -> str:
    """A worker's end-of-run message (JSON text): the stale known-failure lines, the platforms its
    tests needed, and those this host lacks (with the host's description)."""
    return json.dumps({"stale": log.stale, "platforms": sorted(platforms), "missing": missing})


class Controller:
    """The controller's side: the scheduler, and each worker's end-of-run message into this run's
    log and the platform sets the report reads."""

    def __init__(self, log: results.RunLog, platforms: set[str], missing: dict[str, str]) -> None:
        self.log = log
        self.platforms = platforms
        self.missing = missing

    @pytest.hookimpl(optionalhook=True)
    def pytest_xdist_make_scheduler(self, config: pytest.Config, log: Any) -> Any:
        if config.getoption("dist") != "load":
            return None
        from xdist.scheduler import LoadScopeScheduling

        class ByImplementationAndMesh(LoadScopeScheduling):
            """xdist's scope scheduling, a scope being one implementation on one mesh."""

            def _split_scope(self, nodeid: str) -> str:
                return group_of(nodeid)

        return ByImplementationAndMesh(config, log)

    @pytest.hookimpl(optionalhook=True)
    def pytest_testnodedown(self, node: Any, error: Any) -> None:
        text = getattr(node, "workeroutput", {}).get(WORKER_OUTPUT_KEY)
        if not text:
            return
        sent = json.loads(text)
        for line in sent["stale"]:
            if line not in self.log.stale:
                self.log.stale.append(line)
        self.platforms.update(sent["platforms"])
        self.missing.update(sent["missing"])
