"""pytest plugin: loads kernels, parametrizes the family tests, gates backends, reports results.

Installed, the suite's package registers this module as a pytest plugin (entry point
``pytest11``: ``conformance``), so ``pytest --pyargs conformance`` works from any
directory; ``-p no:conformance`` turns it off. It registers its markers and options
and does nothing else to a session that collects none of its tests: the CPU device
count (8 simulated devices) is set only once conformance tests are collected, just
before the first one runs. The one rule: nothing may start a JAX backend while
pytest collects (no arrays created at import time of a test or kernel module).

Options:

``--kernels=MODULE[,MODULE...]``
    import these modules before collection; their ``conformance.register``
    calls join the run next to the built-ins (``conformance.kernels``).
``--impl=GLOB[,GLOB...]``
    run only implementations whose names match one of the globs (every test that
    runs a kernel, the suite's own fixed tests too).
``--xfails-file=F``, ``--skips-file=F``
    known failures / tests not to run: one test id or glob per line, ``#`` comments
    (array-api-tests' convention). Ids are the uniform ``family/impl/check/mesh/...`` ones
    (:mod:`conformance.results`) or pytest node ids. An xfail that passes fails the run
    (strict); a line that matches no collected test is reported as stale.
``--conformance-json=PATH``, ``--conformance-html=PATH``
    every outcome and table of the run as JSON (schema in :mod:`conformance.results`) and
    as one self-contained HTML page.
``--require-backend=PLATFORM``
    fail (exit status 4) when this host has no ``PLATFORM`` backend, instead of skipping
    every test that needs it.
``--hang-timeout=SECONDS``, ``--check-timeout=SECONDS``, ``--isolation=process|off``
    the bounds on a Pallas kernel in interpret mode (see :mod:`conformance.isolation`).

Each family test module sets ``FAMILY = "<name>"``; tests that take
``implementation`` are parametrized over that family's registered
implementations (the test id contains the name), ``mesh_config`` over the
standard meshes, and ``platform`` over cpu/gpu/tpu, each value carrying the
marker of the same name. A platform this host lacks is skipped with a reason,
so ``pytest -m tpu`` on a CPU host skips rather than errors (and says so in its
summary). Any test may take ``conformance_mesh`` (a ``jax.sharding.Mesh``) or
``conformance_mesh_config`` (its :class:`MeshConfig`, for a ``Case``): parametrized over
the standard meshes, or over those a ``@pytest.mark.conformance_meshes("2-x-auto", ...)``
marker names.
"""

from __future__ import annotations

import atexit
import dataclasses
import datetime
import fnmatch
import importlib
import json
import os
import re
import sys
import time
from collections import defaultdict
from pathlib import Path

import pytest
from hypothesis import HealthCheck, Phase, settings

from conformance import (
    bench,
    claims,
    compat,
    distributed,
    isolation,
    registry,
    report,
    results,
    runner,
    specs,
    strategies,
    transfers,
)
from conformance.fixtures import devices as devices_lib
from conformance.fixtures import meshes
from conformance.specs.base import FIXED_SHAPES

settings.register_profile(
    "conformance-ci",
    derandomize=True,
    database=None,
    deadline=None,
    max_examples=10,
    print_blob=True,
    # No "explain" phase: its line-coverage report is noise next to the failure message.
    phases=(Phase.explicit, Phase.reuse, Phase.generate, Phase.shrink),
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "conformance-thorough",
    parent=settings.get_profile("conformance-ci"),
    derandomize=False,
    max_examples=200,
)

#: The markers the suite's tests carry, registered by the plugin (so ``--strict-markers`` works anywhere).
MARKERS = (
    "cpu: runs on the CPU backend with simulated devices",
    "gpu: needs a GPU backend (skips with a reason elsewhere)",
    "tpu: needs TPU chips (skips with a reason elsewhere)",
    "multiprocess: launches several JAX processes on 127.0.0.1",
    "slow: long-running; excluded from the default cpu run",
    "benchmark: timing runs (pytest-benchmark); excluded unless -m names benchmark",
    "selftest: the suite's own tests (broken kernels it must reject)",
    "integration: self-tests that install the suite or launch a multi-process job (selftest env)",
    "conformance_meshes(*labels): the meshes a test taking conformance_mesh(_config) runs on",
    "pallas_interpret: runs a Pallas TPU kernel under interpret mode on CPU (skipped, with the reason, in a "
    "multi-process job)",
)


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("conformance", "collective-kernel conformance")
    group.addoption("--kernels", action="append", default=[], metavar="MODULE[,MODULE...]",
                    help="import these modules so their conformance.register calls join the run")  # fmt: skip
    group.addoption("--hang-timeout", type=float, default=runner.HANG_TIMEOUT_S, metavar="SECONDS",
                    help="stop a Pallas kernel running longer than this in interpret mode")  # fmt: skip
    group.addoption("--check-timeout", type=float, default=isolation.CHECK_TIMEOUT_S, metavar="SECONDS",
                    help="stop the worker process when a check of a Pallas kernel takes longer")  # fmt: skip
    group.addoption("--isolation", choices=("process", "off"), default=isolation.MODE,
                    help="process (default): check Pallas kernels on CPU in a worker process that can "
                         "be stopped whatever hangs; off: in this process")  # fmt: skip
    group.addoption("--bench-sizes", default="4K:256K:4", metavar="BEGIN:END:FACTOR",
                    help="-m benchmark: the ladder of one device's input shard sizes in bytes, as "
                         "nccl-tests' -b/-e/-f (K, M suffixes)")  # fmt: skip
    group.addoption("--bench-meshes", default="2-x-auto,4-x-auto,8-x-auto,2x4-y-auto,4x2-y-auto",
                    metavar="LABEL[,LABEL...]", help="-m benchmark: the meshes to time on")  # fmt: skip
    group.addoption("--bench-rounds", type=int, default=5, metavar="N",
                    help="-m benchmark: timed calls per case after a warm-up (median reported)")  # fmt: skip
    group.addoption("--meshes", default=None, metavar="LABEL[,LABEL...]",
                    help="run the tests that take a standard mesh on these meshes only (labels as in the "
                         "test ids, e.g. 4-x-explicit,2x4-y-auto); tests without a mesh all run")  # fmt: skip
    group.addoption("--impl", default=None, metavar="GLOB[,GLOB...]",
                    help="run only implementations whose names match one of these globs")  # fmt: skip
    group.addoption("--xfails-file", default=None, metavar="FILE",
                    help="known failures: a test id or glob per line (# comments); strict")  # fmt: skip
    group.addoption("--skips-file", default=None, metavar="FILE",
                    help="tests not to run: a test id or glob per line (# comments)")  # fmt: skip
    group.addoption("--conformance-json", default=None, metavar="PATH",
                    help="write every outcome and table of the run as JSON")  # fmt: skip
    group.addoption("--conformance-html", default=None, metavar="PATH",
                    help="write the matrix, failures and tables as one self-contained HTML page")  # fmt: skip
    group.addoption("--distributed", action="store_true", default=False,
                    help="this process is one rank of a multi-process JAX job (mpirun, srun, "
                         "a TPU pod's --worker=all, conformance launch): join it first")  # fmt: skip
    group.addoption("--require-backend", choices=devices_lib.PLATFORMS, default=None, metavar="PLATFORM",
                    help="fail, instead of skipping, when this host has no PLATFORM backend")  # fmt: skip


def kernel_modules(config: pytest.Config) -> list[str]:
    return [m.strip() for opt in config.getoption("kernels") for m in opt.split(",") if m.strip()]


def pytest_configure(config: pytest.Config) -> None:
    for line in MARKERS:
        config.addinivalue_line("markers", line)
    if config.getoption("distributed") or distributed.launched():
        # Registered before JAX's own shutdown handler, so it runs after it (atexit runs in reverse).
        atexit.register(_exit_past_abandoned_calls, config)
        distributed.initialize()
    runner.HANG_TIMEOUT_S = config.getoption("hang_timeout")
    isolation.CHECK_TIMEOUT_S = config.getoption("check_timeout")
    isolation.MODE = config.getoption("isolation")
    # The suite's hypothesis tests use this profile; the session's default profile (the user's own
    # tests') is left alone. --hypothesis-profile=NAME picks another for the suite as well.
    chosen = config.getoption("hypothesis_profile", None)
    strategies.PROFILE = settings.get_profile(chosen or "conformance-ci")
    config.stash[_STARTED] = (datetime.datetime.now().astimezone(), time.monotonic())
    config.pluginmanager.register(_DevicesAfterCollection(), "conformance-devices")
    for module in ["conformance.kernels", *kernel_modules(config)]:
        try:
            importlib.import_module(module)
        except ImportError as e:
            raise pytest.UsageError(f"--kernels: cannot import {module!r}: {e}") from e
    pattern = config.getoption("impl")
    if pattern and not any(registry.registered(f, pattern) for f in specs.FAMILIES):
        names = sorted(n for f in specs.FAMILIES for n in registry.implementations(f))
        raise pytest.UsageError(f"--impl={pattern} matches no implementation; registered: {names}")


def pytest_unconfigure(config: pytest.Config) -> None:
    isolation.Worker.stop_shared()


_EXIT_STATUS = pytest.StashKey[int]()


def _exit_past_abandoned_calls(config: pytest.Config) -> None:
    """Last at exit of a rank of a job: if a call the suite abandoned after it hung still has its
    thread blocked (in the job's key-value store, say), end the process now, with pytest's exit
    status, naming the calls. Left to Python's finalization, such a thread makes the process abort
    ("terminate called after throwing ..."), which a launcher can only report as a crash."""
    abandoned = transfers.abandoned_calls()
    if not abandoned:
        return
    status = config.stash.get(_EXIT_STATUS, 1)
    where = "; ".join(abandoned)
    distributed.note_current_test(f"(after its tests, ending past abandoned call(s): {where})")
    sys.stdout.flush()
    sys.stderr.write(f"conformance: this rank ends with exit status {status} without waiting for "
                     f"{len(abandoned)} call(s) it abandoned after they hung: {where}\n")  # fmt: skip
    sys.stderr.flush()
    os._exit(status)


@pytest.fixture(scope="module")
def family(request: pytest.FixtureRequest) -> str:
    return request.module.FAMILY


@pytest.fixture
def conformance_mesh(conformance_mesh_config: meshes.MeshConfig):
    """A ``jax.sharding.Mesh`` over this host's CPU devices, one per standard mesh (or per label of
    the test's ``conformance_meshes`` marker). ``conformance_mesh_config`` (a parameter a test may
    take too) is its :class:`~conformance.fixtures.meshes.MeshConfig`, what a ``Case`` needs."""
    return meshes.build_mesh(conformance_mesh_config, "cpu")


def _mesh_configs_for(metafunc: pytest.Metafunc) -> tuple[meshes.MeshConfig, ...]:
    marker = metafunc.definition.get_closest_marker("conformance_meshes")
    if marker is None:
        return meshes.MESH_CONFIGS
    if not marker.args:
        raise pytest.UsageError(f"{metafunc.definition.nodeid}: conformance_meshes() names no mesh label")
    return tuple(meshes.parse_mesh(label) for label in marker.args)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "conformance_mesh_config" in metafunc.fixturenames:
        configs = _mesh_configs_for(metafunc)
        metafunc.parametrize(
            "conformance_mesh_config",
            [pytest.param(c, marks=pytest.mark.cpu) for c in configs],
            ids=[c.label for c in configs],
        )  # fmt: skip  (the meshes are CPU meshes)
    if not hasattr(metafunc.module, "FAMILY"):
        return  # only family test modules take the suite's parameters
    names = metafunc.fixturenames
    if "implementation" in names:
        family = metafunc.module.FAMILY
        impls = registry.registered(family, metafunc.config.getoption("impl"))
        field = getattr(metafunc.function, "family_filter", None)
        if field and not getattr(specs.get(family), field):
            impls = []  # deselected: the family has nothing this test judges
        for keep in getattr(metafunc.function, "implementation_filter", ()):
            impls = [i for i in impls if (not i.baseline if keep == "not_baseline" else getattr(i, keep))]
        metafunc.parametrize("implementation", [i.name for i in impls])
    if "mesh_config" in names:
        configs = getattr(metafunc.function, "mesh_configs", meshes.MESH_CONFIGS)
        metafunc.parametrize("mesh_config", configs, ids=[c.label for c in configs])
    if "dma_mode" in names:
        metafunc.parametrize("dma_mode", runner.DMA_MODES)
    if "shape" in names:
        metafunc.parametrize("shape", FIXED_SHAPES)
    if "dtype" in names:
        field = getattr(metafunc.function, "dtypes_field", "dtypes")
        metafunc.parametrize("dtype", getattr(specs.get(metafunc.module.FAMILY), field))
    if "platform" in names:
        metafunc.parametrize(
            "platform",
            [pytest.param(p, marks=getattr(pytest.mark, p)) for p in devices_lib.PLATFORMS],
        )


_STARTED = pytest.StashKey[tuple]()
#: Per item: its uniform id and parameters (:mod:`conformance.results`).
_META = pytest.StashKey[dict]()


def _is_conformance_item(item: pytest.Item) -> bool:
    """A test of the suite's (its package's, or a family module's anywhere), or one taking its mesh."""
    module = getattr(item, "module", None)
    name = getattr(module, "__name__", "") or ""
    return (
        hasattr(module, "FAMILY")
        or name == "conformance"
        or name.startswith("conformance.")
        or "conformance_mesh_config" in getattr(item, "fixturenames", ())
    )


def _meta(item: pytest.Item) -> dict:
    """The item's uniform id and the parts of it, computed once."""
    if _META in item.stash:
        return item.stash[_META]
    params = dict(getattr(getattr(item, "callspec", None), "params", {}))
    module = getattr(item, "module", None)
    check = getattr(item, "originalname", item.name).removeprefix("test_")
    meta: dict = {"nodeid": item.nodeid}
    if hasattr(module, "FAMILY") and isinstance(params.get("implementation"), str):
        mesh = params.get("mesh_config") or params.get("route")
        meta.update(
            family=module.FAMILY, impl=params["implementation"], check=check,
            mesh=mesh.label if mesh is not None else None, platform=params.get("platform", "cpu"),
            dtype=params.get("dtype"), shape=params.get("shape") or params.get("layout"),
            dma_mode=params.get("dma_mode"),
        )  # fmt: skip
        meta["id"] = results.uniform_id(module.FAMILY, params["implementation"], check, params)
    else:
        short = getattr(module, "__name__", "?").rsplit(".", 1)[-1]
        meta["id"] = f"suite/{short}/{item.name}" if _is_conformance_item(item) else item.nodeid
    item.stash[_META] = meta
    ITEM_META[item.nodeid] = meta
    return meta


#: Every collected test's uniform id and its parts, by node id.
ITEM_META: dict[str, dict] = {}


def _read_patterns(path: str) -> list[tuple[int, str]]:
    """``(line number, pattern)`` of a known-failures file: one id or glob per line, ``#`` comments."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise pytest.UsageError(f"cannot read {path}: {e}") from e
    out = []
    for number, line in enumerate(text.splitlines(), 1):
        pattern = line.split("#", 1)[0].strip()
        if pattern:
            out.append((number, pattern))
    return out


def _matches(pattern: str, meta: dict) -> bool:
    return any(fnmatch.fnmatchcase(meta[k], pattern) for k in ("id", "nodeid")) or meta["nodeid"] == pattern


#: Lines of --xfails-file / --skips-file that matched no collected test.
STALE: list[dict] = []


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Known failures and skips from files (before -m/-k deselect, so a line is stale only if it
    matches no collected test at all); then deselect (not skip) tests with nothing to run."""
    for option, mark in (("xfails_file", "xfail"), ("skips_file", "skip")):
        path = config.getoption(option)
        if not path:
            continue
        for number, pattern in _read_patterns(path):
            hits = [item for item in items if _matches(pattern, _meta(item))]
            if not hits:
                STALE.append({"file": path, "line": number, "pattern": pattern, "kind": mark})
            reason = f"{Path(path).name}:{number}: {pattern}"
            for item in hits:
                if mark == "xfail":
                    item.add_marker(pytest.mark.xfail(reason=f"known failure ({reason})", strict=True))
                else:
                    item.add_marker(pytest.mark.skip(reason=f"listed in the skips file ({reason})"))

    def has_empty_parameter(item: pytest.Item) -> bool:
        if not hasattr(getattr(item, "module", None), "FAMILY"):
            return False
        params = getattr(getattr(item, "callspec", None), "params", {})
        return any(k in params and not isinstance(params[k], str) for k in ("implementation", "dtype"))

    empty = {id(i): i for i in items if has_empty_parameter(i)}  # pytest's NOTSET placeholder
    if "benchmark" not in (config.getoption("markexpr") or ""):  # timings run only when asked for
        empty.update((id(i), i) for i in items if i.get_closest_marker("benchmark"))
    pattern = config.getoption("impl")
    if pattern:  # the suite's own fixed tests run built-in kernels: they too answer to --impl
        globs = [g.strip() for g in pattern.split(",") if g.strip()]
        for item in items:
            names = getattr(getattr(item, "module", None), "IMPLEMENTATIONS", None)
            if names is not None and not any(fnmatch.fnmatchcase(n, g) for n in names for g in globs):
                empty[id(item)] = item
    wanted = _meshes_option(config)
    if wanted is not None:  # --meshes: tests on other standard meshes
        for item in items:
            params = getattr(getattr(item, "callspec", None), "params", {})
            mesh = params.get("mesh_config", params.get("conformance_mesh_config"))
            if mesh is not None and getattr(mesh, "label", None) not in wanted:
                empty[id(item)] = item
    if empty:
        config.hook.pytest_deselected(items=list(empty.values()))
        items[:] = [i for i in items if id(i) not in empty]


def _meshes_option(config: pytest.Config) -> set[str] | None:
    """``--meshes`` as a set of labels (``None``: every mesh); an unknown label is a usage error."""
    text = config.getoption("meshes")
    if text is None:
        return None
    labels = {label.strip() for label in text.split(",") if label.strip()}
    known = [c.label for c in meshes.MESH_CONFIGS]
    unknown = sorted(labels - set(known))
    if unknown or not labels:
        what = ", ".join(unknown) or "no label"
        raise pytest.UsageError(f"--meshes={text}: {what} is not a standard mesh; "
                                f"the standard meshes are {', '.join(known)}")  # fmt: skip
    return labels


def _selected_platforms(items: list[pytest.Item]) -> set[str]:
    return {p for item in items for p in devices_lib.PLATFORMS if item.get_closest_marker(p)}


class _DevicesAfterCollection:
    """Sets the CPU device count once collection is final, if any conformance test is selected."""

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, config: pytest.Config, items: list[pytest.Item]) -> None:
        ours = [i for i in items if _is_conformance_item(i)]
        for item in ours:
            _meta(item)
        if not ours:
            return  # a session without the suite's tests: JAX is left exactly as the user set it
        # In a job, each process has the devices the job gave it (launch: --devices-per-process);
        # asking for 8 here would give every process 8 and keep every mesh inside process 0.
        problem = distributed.job_layout_problem() if distributed.is_multi_process() else (
            compat.ensure_cpu_devices(devices_lib.CPU_DEVICE_COUNT))  # fmt: skip
        if problem and distributed.is_multi_process():
            raise pytest.UsageError(problem)
        if problem:
            raise pytest.UsageError(
                f"{problem}. The rule: nothing may start a JAX backend while pytest collects (an array "
                "created when a test or kernel module is imported); start it inside a test or fixture."
            )
        required = config.getoption("require_backend")
        if required and not devices_lib.has_platform(required):
            raise pytest.UsageError(f"--require-backend={required}: this host has no {required} backend "
                                    f"({devices_lib.describe_host()}); nothing would run")  # fmt: skip
        config.stash[_PLATFORMS] = _selected_platforms(ours)
        if distributed.is_multi_process():
            _same_tests_on_every_rank([i.nodeid for i in items])


def _same_tests_on_every_rank(nodeids: list[str]) -> None:
    """Stop the job, with the difference, if the ranks collected different tests (else they would
    wait for each other at different tests until a timeout)."""
    import hashlib

    digest = f"{len(nodeids)}:{hashlib.sha256(chr(10).join(nodeids).encode()).hexdigest()[:16]}"
    digests = distributed.exchange("collection", digest)
    if len(set(digests)) == 1:
        return
    lists = [text.split("\n") for text in distributed.exchange("collection-lists", "\n".join(nodeids))]
    first = next((k for k in range(max(map(len, lists))) if len({tuple(x[k : k + 1]) for x in lists}) > 1), 0)
    at = "; ".join(
        f"rank {r}: {x[first] if first < len(x) else '(end)'} ({len(x)} tests)" for r, x in enumerate(lists)
    )
    raise pytest.UsageError(f"the ranks of this job collected different tests; the first difference, at test "
                            f"{first + 1}: {at}. Every rank must run the same command and see the same "
                            "kernels (--kernels, --impl, -k, -m).")  # fmt: skip


_PLATFORMS = pytest.StashKey[set]()


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Skip, with a reason, what this host cannot run: a missing backend or too few devices."""
    results.LAST_CASE.clear()
    distributed.begin_test(item.nodeid)
    if item.get_closest_marker("pallas_interpret") and distributed.is_multi_process():
        pytest.skip(distributed.PALLAS_INTERPRET)
    for platform in devices_lib.PLATFORMS:
        if item.get_closest_marker(platform) and not devices_lib.has_platform(platform):
            pytest.skip(f"needs a {platform} backend; this host has {devices_lib.describe_host()}")
    params = getattr(item, "callspec", None)
    config = params and (params.params.get("mesh_config") or params.params.get("route"))
    platform = params and params.params.get("platform")
    if config and platform:
        found = len(devices_lib.devices_of(platform))
        if found < config.num_devices:
            pytest.skip(f"needs {config.num_devices} devices, found {found}")


def pytest_runtest_logstart(nodeid: str, location) -> None:
    distributed.note_current_test(nodeid)


def pytest_runtest_logfinish(nodeid: str, location) -> None:
    distributed.note_current_test("")


#: Every family test's outcome this run, for the summary of failures by cause.
VERDICTS: list[report.Verdict] = []
#: Every outcome of a test of the suite this run, by node id (:mod:`conformance.results`).
OUTCOMES: dict[str, results.Outcome] = {}


def _conformance_failure(error: BaseException | None):
    """The check's failure inside a test's exception (hypothesis may group several: take the smallest)."""
    from conformance.checks import ConformanceFailure

    found, caseless, stack = [], [], [error]
    while stack:
        e = stack.pop()
        if e is None:
            continue
        if isinstance(e, ConformanceFailure):  # a send_recv check's failure has no family Case
            (found if e.case is not None else caseless).append(e)
        stack += [getattr(e, "failure", None), *getattr(e, "exceptions", ())]
    smallest = min(found, key=lambda f: report.case_size(f.case), default=None)
    return smallest or next((f for f in caseless if getattr(f, "what", None)), None)


def _skip_reason(rep: pytest.TestReport) -> str:
    text = (
        str(rep.longrepr[2])
        if isinstance(rep.longrepr, tuple) and len(rep.longrepr) == 3
        else str(rep.longrepr or "")
    )
    # pytest prefixes "Skipped: " (or the class of a skip subclass, e.g. claims.NotClaimed)
    return re.sub(r"^(Skipped|[\w.]*NotClaimed): ", "", text)


def _is_not_claimed(rep: pytest.TestReport) -> bool:
    return rep.skipped and not hasattr(rep, "wasxfail") and _skip_reason(rep).startswith(claims.NOT_CLAIMED)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    outcome = yield
    rep = outcome.get_result()
    _agree_on_outcome(rep)
    if not _is_conformance_item(item):
        return
    meta = _meta(item)

    def note(key: str, value: str) -> None:  # on the item too: JUnit reads the teardown report's
        for props in (item.user_properties, rep.user_properties):
            props[:] = [(k, v) for k, v in props if k != key] + [(key, value)]

    note("conformance_id", meta["id"])
    noted = results.LAST_CASE.get("case")
    if noted is not None and rep.when == "call":
        case, check = noted
        note("case", case.token)
        note("replay", case.replay_command(check))
    params = getattr(getattr(item, "callspec", None), "params", {})
    if rep.when != "call" or "implementation" not in params or not hasattr(item.module, "FAMILY"):
        return
    check = getattr(item, "originalname", item.name).removeprefix("test_")
    verdict = report.Verdict(item.module.FAMILY, params["implementation"], check,
                             "passed" if rep.passed else "failed", params.get("shape"))  # fmt: skip
    if rep.failed:
        failure = _conformance_failure(call.excinfo.value if call.excinfo else None)
        if failure is not None:
            verdict = dataclasses.replace(verdict, check=failure.check, case=failure.case, what=failure.what)
            if failure.case is not None:
                note("case", failure.case.token)
                note("replay", failure.case.replay_command(failure.check))
    if not rep.skipped:
        VERDICTS.append(verdict)


def _agree_on_outcome(rep: pytest.TestReport) -> None:
    """In a multi-process job, a test that failed on any rank fails on every rank, naming the rank.

    Each rank posts one outcome per test: its call's, or its setup's where the setup did not pass
    (no call follows). Whatever a rank raised outside a check's own agreement (an error while
    placing inputs, say) then still fails the test everywhere, and ``-x`` stops every rank at
    the same test instead of leaving the others waiting for one that has left.
    """
    if not (rep.when == "call" or (rep.when == "setup" and not rep.passed)):
        return
    if not distributed.is_multi_process() or hasattr(rep, "wasxfail"):
        return
    mine = {"outcome": rep.outcome, "line": _skip_reason(rep)[:500] if rep.skipped else _first_line(rep)}
    try:
        texts = distributed.exchange("outcome", json.dumps(mine))
    except Exception as e:  # a rank gave up or the store failed: say so, do not crash the session
        rep.outcome, rep.longrepr = "failed", f"could not agree on this test's outcome across ranks: {e}"
        return
    failed = [(r, json.loads(t)) for r, t in enumerate(texts) if json.loads(t)["outcome"] == "failed"]
    me = distributed.rank_and_size()[0]
    others = [(r, v["line"]) for r, v in failed if r != me]
    if others and not rep.failed:
        rank, line = others[0]
        ranks = ", ".join(str(r) for r, _ in failed)
        lines = distributed.by_message(others, len(texts))
        rep.outcome = "failed"
        rep.longrepr = f"failed on rank {rank} of {len(texts)} (ranks {ranks}): {line}"
        if len(lines) > 1:  # every other rank's own message, identical ones once
            rep.longrepr += "\n" + "\n".join(lines)
    elif others and rep.failed and any(line != mine["line"] for _, line in others):
        lines = distributed.by_message(others, len(texts))
        rep.longrepr = f"{rep.longrepr}\n--- the other failing ranks' messages ---\n" + "\n".join(lines)


def _first_line(rep: pytest.TestReport) -> str:
    if not rep.failed:
        return ""
    crash = getattr(rep.longrepr, "reprcrash", None)
    text = crash.message if crash is not None else str(rep.longrepr or "")
    return text.strip().splitlines()[0][:500] if text.strip() else "(no message)"


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


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    props = dict(report.user_properties)
    if "conformance_id" not in props:
        return
    got = _outcome_of(report)
    if got is None:
        return
    prior = OUTCOMES.get(report.nodeid)
    if prior is not None and prior.outcome in ("failed", "xpassed"):
        return  # a teardown does not undo a failure
    if report.failed or report.skipped:
        message = _skip_reason(report) if report.skipped and got != "xfailed" else str(report.longreprtext)
    else:
        message = ""
    OUTCOMES[report.nodeid] = results.Outcome(
        id=props["conformance_id"], nodeid=report.nodeid, outcome=got, message=message[:8000],
        case=props.get("case"), replay=props.get("replay"),
        duration_s=round(report.duration + (prior.duration_s if prior else 0.0), 4),
        xfail_reason=getattr(report, "wasxfail", None) or None,
    )  # fmt: skip


def pytest_report_teststatus(report: pytest.TestReport, config: pytest.Config):
    """A case the kernel does not claim is its own category: ``n`` / NOT CLAIMED, counted apart."""
    if _is_not_claimed(report):
        return "not claimed", "n", ("NOT CLAIMED", {"yellow": True})
    return None


def outcomes() -> list[results.Outcome]:
    """Every outcome of this run, with the parts of its id filled in."""
    out = []
    for nodeid, o in OUTCOMES.items():
        meta = ITEM_META.get(nodeid, {})
        for key in ("family", "impl", "check", "mesh", "platform", "dtype", "shape", "dma_mode"):
            setattr(o, key, meta.get(key))
        out.append(o)
    return out


def _byte_table(title: str, records: list) -> results.Table | None:
    if not records:
        return None
    table = results.Table(title, [], records)
    by_impl: dict[tuple[str, str], list] = defaultdict(list)
    for rec in records:
        by_impl[(rec.family, rec.impl)].append(rec)
    width = max(len(impl) for _, impl in by_impl)
    for (family, impl), recs in sorted(by_impl.items()):
        ratios = [r.ratio for r in recs if r.ratio is not None]
        unbounded = [r.mesh for r in recs if r.received is None]
        kinds = sorted({c.split("(")[0] for r in recs for c in r.collectives})
        span = f"{min(ratios):.2f}-{max(ratios):.2f}" if ratios else "n/a"
        if ratios and min(ratios) == max(ratios):
            span = f"{ratios[0]:.2f}"
        if not ratios and all(r.received == 0 for r in recs):
            span = "0 bytes"
        via = ", ".join(kinds) or "none"
        meshes_seen = len({r.mesh.split()[0] for r in recs})  # a lowered record's is "mesh target pass"
        where = f"{len(recs):>3} modules on {meshes_seen:>2} meshes"
        line = f"{family:<21} {impl:<{width}}  ratio {span:>9} in {where}  via {via}"
        if unbounded:
            line += f"  UNBOUNDED on {unbounded}"
        table.lines.append(line)
    return table


def _accuracy_table(title: str, records: list) -> results.Table | None:
    if not records:
        return None
    table = results.Table(title, [], records)
    width = max(len(r.impl) for r in records)
    rows: dict[tuple[str, str, str, str], list] = defaultdict(list)
    for r in records:
        rows[(r.family, r.impl, r.dtype, r.gradient)].append(r)
    for (family, impl, dtype, gradient), recs in sorted(rows.items()):
        worst = max(recs, key=lambda r: r.ratio)  # one line per dtype: the range over meshes, the worst case
        low = min(r.ratio for r in recs)
        span = f"{low:.2f}-{worst.ratio:.2f}" if f"{low:.2f}" != f"{worst.ratio:.2f}" else f"{low:.2f}"
        rms = f"{worst.rms:.3e} / {worst.baseline_rms:.3e}"
        table.lines.append(f"{family:<21} {impl:<{width}}  {dtype:<9} {gradient:<6} ratio {span:>9} on "
                           f"{len(recs):>2} meshes; worst {worst.mesh}: {rms}")  # fmt: skip
    return table


def _tpu_layout_table(records: list) -> results.Table | None:
    """Per Pallas kernel and dtype: tile-edge shapes lowered to windows a TPU accepts, and refused."""
    if not records:
        return None
    table = results.Table(
        "TPU layout (lowered for TPU from this host): shapes accepted / refused with the constraint named",
        [], records,
    )  # fmt: skip
    by_impl: dict[tuple[str, str, str], list] = defaultdict(list)
    for rec in records:
        by_impl[(rec.family, rec.impl, rec.dtype)].append(rec)
    width = max(len(impl) for _, impl, _ in by_impl)
    for (family, impl, dtype), recs in sorted(by_impl.items()):
        accepted = [
            "x".join(str(v) for _, v in r.dims) for r in recs if r.refusal is None and not r.host_limited
        ]
        refused = sum(r.refusal is not None for r in recs)
        limited = sum(r.host_limited is not None for r in recs)
        table.lines.append(f"{family:<21} {impl:<{width}}  {dtype:<9} accepted {len(accepted)}: "
                           f"{'; '.join(accepted)}  refused {refused}"
                           + (f"  not lowerable on this host {limited}" if limited else ""))  # fmt: skip
    return table


def _overlap_table(records: list) -> results.Table | None:
    """Per implementation and module: transfers that can hide behind a matmul / all, per ring length."""
    if not records:
        return None
    table = results.Table("overlap: transfers with a matmul independent of them / all transfers, by ring "
                          "length (dataflow of each module)", [], records)  # fmt: skip
    rows: dict[tuple[str, str, str], list] = defaultdict(list)
    for r in records:
        rows[(r.family, r.impl, r.module)].append(r)
    width = max(len(r.impl) for r in records)
    for (family, impl, module), recs in sorted(rows.items()):
        per_ring: dict[int, set[str]] = defaultdict(set)
        for r in recs:
            per_ring[r.ring].add(r.fraction)
        rings = "  ".join(f"n={n}: {', '.join(sorted(v))}" for n, v in sorted(per_ring.items()))
        scheduled = [r.scheduled for r in recs if r.scheduled is not None]
        line = f"{family:<21} {impl:<{width}}  {module:<12} {rings}"
        if scheduled:
            bracketing, pairs = sum(b for b, _ in scheduled), sum(p for _, p in scheduled)
            line += f"  scheduled: {bracketing}/{pairs} async pairs bracket a matmul"
        if recs[0].baseline:
            line += "  (baseline: reported, not judged)"
        table.lines.append(line)
    return table


def tables() -> list[results.Table]:
    """Every table of this run, in the order the terminal shows them."""
    from conformance.checks import (
        ACCURACY_RECORDS,
        BACKWARD_ACCURACY_RECORDS,
        BACKWARD_BYTE_RECORDS,
        BYTE_RECORDS,
        LOWERED_BYTE_RECORDS,
        OVERLAP_RECORDS,
        TPU_LAYOUT_RECORDS,
    )

    made = [
        _byte_table("forward: bytes received per device / lower bound (compiled HLO)", BYTE_RECORDS),
        _byte_table(
            "backward (VJP): bytes received per device / the math's bound (compiled HLO)",
            BACKWARD_BYTE_RECORDS,
        ),
        _byte_table(
            "16-bit: bytes received per device / bound (modules lowered for each target)",
            LOWERED_BYTE_RECORDS,
        ),
        _accuracy_table(
            "accuracy: rms error vs float64, implementation / baseline (same inputs)", ACCURACY_RECORDS
        ),
        _accuracy_table(
            "backward accuracy: each gradient's rms error vs float64, implementation / baseline",
            BACKWARD_ACCURACY_RECORDS,
        ),
        _overlap_table(OVERLAP_RECORDS),
    ]
    made += [results.Table(title, lines, [r for r in bench.RECORDS if r.family in title])
             for title, lines in bench.tables(bench.RECORDS)]  # fmt: skip
    made.append(_tpu_layout_table(TPU_LAYOUT_RECORDS))
    return [t for t in made if t is not None]


def _missing_backends(config: pytest.Config) -> list[str]:
    """Lines for each platform whose tests were selected but whose backend this host lacks."""
    lines = []
    for platform in sorted(config.stash.get(_PLATFORMS, set())):
        if devices_lib.has_platform(platform):
            continue
        ran = [o for o in outcomes() if o.platform == platform and o.outcome in ("passed", "failed")]
        skipped = sum(o.platform == platform and o.outcome == "skipped" for o in outcomes())
        host = devices_lib.describe_host()
        lines.append(f"no {platform} backend on this host ({host}): {skipped} {platform} tests skipped, "
                     f"{len(ran)} ran; --require-backend={platform} makes this a failure")  # fmt: skip
    return lines


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    tr = terminalreporter
    if distributed.is_multi_process() and distributed.rank_and_size()[0] != 0:
        rank, size = distributed.rank_and_size()
        tr.write_line(f"rank {rank} of {size}: the tables, matrix and failure summary are printed by rank 0")
        return
    for table in tables():
        tr.section(table.title)
        for line in table.lines:
            tr.write_line(line)
    lines = results.matrix_lines(outcomes())
    if lines:
        tr.section("conformance matrix: implementation x check")
        for line in lines:
            tr.write_line(line)
    lines = report.summarize(VERDICTS)
    if lines:
        tr.section("conformance failures by implementation: each cause once, smallest failing case first")
        for line in lines:
            tr.write_line(line)
    if STALE:
        tr.section("stale known-failure lines: they match no collected test")
        for s in STALE:
            tr.write_line(f"{s['file']}:{s['line']}: {s['pattern']}  ({s['kind']})")
    for line in _missing_backends(config):
        tr.write_line(line, yellow=True, bold=True)
    for option in ("conformance_json", "conformance_html"):
        path = config.getoption(option)
        if path and OUTCOMES:
            tr.write_line(f"conformance: wrote {path}")


@pytest.hookimpl(tryfirst=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus) -> None:
    config = session.config
    config.stash[_EXIT_STATUS] = int(exitstatus)
    if not OUTCOMES:
        return
    made = tables()
    xml = _junit_xml(config)
    if xml is not None:  # the tables reach JUnit as testsuite properties
        for table in made:
            xml.add_global_property(f"conformance: {table.title}", "\n".join(table.lines))
    json_path, html_path = config.getoption("conformance_json"), config.getoption("conformance_html")
    if not (json_path or html_path) or (distributed.is_multi_process() and distributed.rank_and_size()[0]):
        return  # in a multi-process job rank 0 writes them
    started, t0 = config.stash[_STARTED]
    document = results.to_json(outcomes(), made, started=started, duration_s=time.monotonic() - t0,
                               stale=STALE, command=results.command_line())  # fmt: skip
    if json_path:
        results.write_json(json_path, document)
    if html_path:
        results.write_html(html_path, document)


def _junit_xml(config: pytest.Config):
    try:
        from _pytest.junitxml import xml_key
    except ImportError:  # pragma: no cover - pytest moved it
        return None
    return config.stash.get(xml_key, None)
