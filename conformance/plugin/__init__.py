"""The pytest side: loads kernels, parametrizes the family tests, gates backends, reports results.

This module holds the hooks; beside it, :mod:`~conformance.plugin.command_options` (the options and
the usage errors a run is refused with), :mod:`~conformance.plugin.kernel_modules` (``--kernels``),
:mod:`~conformance.plugin.mesh_options` (``--meshes``), :mod:`~conformance.plugin.mark_expression`
(the platform values ``-m`` can select), :mod:`~conformance.plugin.known_failures`
(xfails and skips files), :mod:`~conformance.plugin.xdist_workers` (``-n``),
:mod:`~conformance.plugin.job_ranks` (one rank of a multi-process job) and
:mod:`~conformance.plugin.end_of_run` (each outcome into the run log; the tables, summary and
files at the end). It may import anything below it; nothing of the suite imports it but the
pytest fixtures it registers and the test modules.

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
    (:mod:`conformance.reports.results`) or pytest node ids. An xfail that passes fails the run
    (strict); a line that matches no collected test is reported as stale.
``--conformance-json=PATH``, ``--conformance-html=PATH``
    every outcome and table of the run as JSON (schema in :mod:`conformance.reports.results`) and
    as one self-contained HTML page.
``--require-backend=PLATFORM``
    fail (exit status 4) when this host has no ``PLATFORM`` backend, instead of skipping
    every test that needs it.
``--hang-timeout=SECONDS``, ``--check-timeout=SECONDS``, ``--isolation=process|off``
    the bounds on a Pallas kernel in interpret mode (see :mod:`conformance.run.check_worker`).
``--compiler-option=NAME=VALUE`` (repeatable), ``--behind-compiler=report|fail``
    an option for every compile for a TPU or GPU topology (recorded with each verdict); whether a
    kernel behind the compiler's own collective matmul fails (:mod:`conformance.checks.tpu_schedule`).
``--compilation-cache=DIR|off``
    where JAX's persistent compilation cache lives (:mod:`conformance.targets.compilation_cache`).
``-n auto`` (pytest-xdist)
    the tests over worker processes, reported as one run (:mod:`conformance.plugin.xdist_workers`).

Each family test module sets ``FAMILY = "<name>"``; tests that take
``implementation`` are parametrized over that family's registered
implementations (the test id contains the name), ``mesh_config`` over the
standard meshes, and ``platform`` over cpu/gpu/tpu, each value carrying the
marker of the same name; a value the ``-m`` expression cannot select is not built
(:mod:`~conformance.plugin.mark_expression`). A platform this host lacks is skipped with a reason,
so ``pytest -m tpu`` on a CPU host skips rather than errors (and says so in its
summary). Any test may take ``conformance_mesh`` (a ``jax.sharding.Mesh``) or
``conformance_mesh_config`` (its :class:`MeshConfig`, for a ``Case``): parametrized over
the standard meshes, or over those a ``@pytest.mark.conformance_meshes("2-x-auto", ...)``
marker names.
"""

from __future__ import annotations

import atexit
import datetime
import fnmatch
import gc
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from conformance import compat, registry, runner, specs, strategies
from conformance.checks.base import Axes
from conformance.fixtures import devices as devices_lib
from conformance.fixtures import pytest_fixtures
from conformance.jobs import distributed
from conformance.plugin import (
    command_options,
    end_of_run,
    job_ranks,
    kernel_modules,
    known_failures,
    mark_expression,
    mesh_options,
    working_directory,
    xdist_workers,
)
from conformance.plugin.end_of_run import (
    MISSING_BACKENDS,
    PLATFORMS,
    SESSION,
    STARTED,
    run_log,
)
from conformance.reports import results
from conformance.run import interpret_outcomes
from conformance.session import (
    TIME_BOUNDS,
    Session,
    Settings,
)
from conformance.specs.base import FIXED_SHAPES
from conformance.targets import (
    compilation_cache,
    cpu_ragged_all_to_all,
    gpu_compiler,
    target_compiles,
    tpu_compiler,
)

#: The markers the suite's tests carry, registered by the plugin (so ``--strict-markers`` works anywhere).
MARKERS = (
    "cpu: runs on the CPU backend with simulated devices",
    "gpu: needs a GPU backend (skips with a reason elsewhere)",
    "tpu: needs TPU chips (skips with a reason elsewhere), unless marked tpu_compile",
    "tpu_compile: compiles for TPU topologies with the real TPU compiler (libtpu) and needs no chip: runs "
    "under -m cpu and -m tpu alike (without libtpu it skips, naming the install command)",
    "gpu_compile: compiles for GPU topologies with the real GPU compiler (XLA:GPU, JAX's CUDA plugin) and "
    "needs no GPU: runs under -m gpu_compile and -m gpu (without the plugin it skips, naming the install)",
    "multiprocess: launches several JAX processes on 127.0.0.1",
    "slow: long-running; excluded from the default cpu run",
    "benchmark: timing runs (pytest-benchmark); excluded unless -m names benchmark",
    "selftest: the suite's own tests (broken kernels it must reject)",
    "integration: self-tests that install the suite or launch a multi-process job (selftest env)",
    "conformance_meshes(*labels): the meshes a test taking conformance_mesh(_config) runs on",
    "conformance_axes(axes): what a family test is parametrized over (conformance.checks.base.Axes)",
    "pallas_interpret: runs a Pallas TPU kernel under interpret mode on CPU (skipped, with the reason, in a "
    "multi-process job)",
)


def pytest_addoption(parser: pytest.Parser) -> None:
    command_options.add_options(parser)


def pytest_configure(config: pytest.Config) -> None:
    for line in MARKERS:
        config.addinivalue_line("markers", line)
    in_job = config.getoption("distributed") or distributed.launched()
    if in_job and (xdist_workers.is_controller(config) or xdist_workers.is_worker(config)):
        raise pytest.UsageError(
            "-n (pytest-xdist) in a multi-process JAX job: each rank is one process of the job; "
            "run the job without -n"
        )
    # --meshes is read here, before any worker starts (under -n a worker's usage error is a crash)
    config.stash[pytest_fixtures.WANTED_MESHES] = mesh_options.meshes_option(config)
    gpu_compiler.configure_from_environment()  # a mocked GPU topology, before any backend starts
    config.add_cleanup(xdist_workers.fit_to_cpu_share(config))  # before XLA sizes its thread pools
    config.add_cleanup(tpu_compiler.chipless_start())  # before libtpu loads
    config.add_cleanup(gpu_compiler.deviceless_start())  # before JAX's CUDA plugin loads
    if xdist_workers.is_controller(config) and not in_job:  # its report's host line: the workers' devices
        compat.cpu_devices_in_this_process(devices_lib.CPU_DEVICE_COUNT)
    # Registered before JAX's own shutdown handlers, so it runs after them (atexit runs in reverse).
    atexit.register(job_ranks.exit_past_abandoned_calls, config)
    if in_job:
        distributed.initialize()
    try:
        run_settings = Settings(
            **{field: config.getoption(field.removesuffix("_s")) for field in TIME_BOUNDS},
            isolation=config.getoption("isolation"),
            behind_compiler=config.getoption("behind_compiler"),
            schedule_verdict=config.getoption("schedule_verdict"),
            compiler_options=target_compiles.parse_options(config.getoption("compiler_option")),
        )
    except ValueError as e:
        raise pytest.UsageError(str(e)) from e
    if not xdist_workers.is_worker(config) and (problem := command_options.usage_problem(config)):
        raise pytest.UsageError(problem)
    compilers = [] if xdist_workers.is_worker(config) else [tpu_compiler, gpu_compiler]  # the controller's
    if problem := target_compiles.check_user_options(run_settings.compiler_options, compilers):
        raise pytest.UsageError(problem)
    session = Session(run_settings)
    session.log = results.RunLog(unsent=[] if xdist_workers.is_worker(config) else None)
    config.stash[SESSION] = session
    # Active for the whole pytest session (what runs outside a check, e.g. a benchmark's kernel
    # under the watchdog, reads its bounds); undone at unconfigure.
    undo_session = session.activate()
    cache_dir = compilation_cache.directory(
        config.getoption("compilation_cache"),
        in_job=bool(in_job),
        isolated=config.getoption("isolation") == "process",
        pytest_cache=getattr(config, "cache", None),
    )
    undo_cache = compilation_cache.use(cache_dir) if cache_dir else lambda: None
    # compiles for TPU and GPU topologies, which JAX's cache cannot hold, are kept beside it
    session.target_compile_dir = compilation_cache.target_compile_dir(cache_dir) if cache_dir else None
    # and so are the verdicts of the Pallas kernels' interpreted programs
    session.interpret_outcome_dir = compilation_cache.interpret_outcome_dir(cache_dir) if cache_dir else None

    # XLA's ragged all-to-all on CPU, where XLA:CPU lacks it: emulated while the suite runs
    undo_emulation = cpu_ragged_all_to_all.install()
    undo_folders = working_directory.folders_kept_elsewhere(config)

    def undo() -> None:
        undo_folders()
        undo_emulation()
        undo_cache()
        undo_session()

    config.stash[_UNDO] = undo
    # The suite's hypothesis tests use this profile; the session's default profile (the user's own
    # tests') is left alone. --hypothesis-profile=NAME picks another for the suite as well.
    strategies.use_profile(config.getoption("hypothesis_profile", None))
    config.stash[STARTED] = (datetime.datetime.now().astimezone(), time.monotonic())
    config.pluginmanager.register(_DevicesAfterCollection(), "conformance-devices")
    config.pluginmanager.register(_CollectionOutsideTheCycleCollector(), "conformance-collection-gc")
    from_workers = xdist_workers.is_controller(config)
    if from_workers:
        xdist_workers.let_workers_share_libtpu()
    config.pluginmanager.register(
        end_of_run.OutcomeRecorder(session.log, from_workers=from_workers), "conformance-outcomes"
    )
    if from_workers:
        config.stash[PLATFORMS] = set()
        config.stash[MISSING_BACKENDS] = {}
        controller = xdist_workers.Controller(
            session.log, config.stash[PLATFORMS], config.stash[MISSING_BACKENDS]
        )
        config.pluginmanager.register(controller, "conformance-xdist")
    config.pluginmanager.register(end_of_run, "conformance-report")  # its hooks: the end of the run
    config.pluginmanager.register(pytest_fixtures, "conformance-fixtures")
    try:
        kernel_modules.import_modules(["conformance.kernels", *kernel_modules.kernel_modules(config)])
    except kernel_modules.KernelsModuleError as e:
        raise pytest.UsageError(str(e)) from e
    pattern = config.getoption("impl")
    if pattern and not any(registry.registered(f, pattern) for f in specs.FAMILIES):
        names = sorted(n for f in specs.FAMILIES for n in registry.implementations(f))
        raise pytest.UsageError(f"--impl={pattern} matches no implementation; registered: {names}")


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config: pytest.Config) -> int | None:
    return xdist_workers.auto_num_workers(config)


def pytest_report_header(config: pytest.Config) -> list[str]:
    return xdist_workers.header_lines(config)


def pytest_unconfigure(config: pytest.Config) -> None:
    if SESSION in config.stash:
        config.stash[SESSION].close()
        config.stash[_UNDO]()


_UNDO = pytest.StashKey[Callable[[], None]]()


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if not hasattr(metafunc.module, "FAMILY"):
        return  # only family test modules take the suite's parameters
    names = metafunc.fixturenames
    marker = metafunc.definition.get_closest_marker("conformance_axes")
    axes = marker.args[0] if marker is not None else Axes()  # a family module's own test: no filter
    family = metafunc.module.FAMILY
    joint = False
    if "implementation" in names:
        impls = registry.registered(family, metafunc.config.getoption("impl"))
        if axes.families_with and not getattr(specs.get(family), axes.families_with):
            impls = []  # deselected: the family has nothing this test judges
        impls = [i for i in impls if axes.selects(i)]
        joint = bool("mesh_config" in names and (axes.interpreted_meshes or axes.fallback_meshes) and impls)
        if joint:  # each implementation on its own meshes
            mesh_options.parametrize_meshes(metafunc, axes, implementations=impls)
        else:
            metafunc.parametrize("implementation", [i.name for i in impls])
    if "mesh_config" in names:
        if not joint:  # (a joint parametrization took the meshes and their variants already)
            mesh_options.parametrize_meshes(metafunc, axes)
    else:
        if "dma_mode" in names:
            metafunc.parametrize("dma_mode", runner.DMA_MODES)
        if "shape" in names:
            metafunc.parametrize("shape", FIXED_SHAPES)
    if "dtype" in names:
        metafunc.parametrize("dtype", getattr(specs.get(family), axes.dtypes or "dtypes"))
    if "platform" in names:  # the values -m can select (mark_expression: the rest would be deselected)
        selectable = mark_expression.selectable_platforms(
            metafunc.config.getoption("markexpr"),
            {mark.name for mark in metafunc.definition.iter_markers()},
            devices_lib.PLATFORMS,
        )
        metafunc.parametrize(
            "platform",
            [pytest.param(p, marks=getattr(pytest.mark, p)) for p in devices_lib.PLATFORMS if selectable(p)],
        )


#: Per item: its uniform id and parameters (:mod:`conformance.reports.results`).
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
        parts = results.ID_PARTS.of(module)
        mesh = params.get(parts.mesh)
        meta.update(
            family=module.FAMILY,
            impl=params["implementation"],
            check=check,
            mesh=mesh.label if mesh is not None else None,
            platform=params.get("platform", "cpu"),
            dtype=params.get("dtype"),
            shape=params.get(parts.shape),
            dma_mode=params.get("dma_mode"),
        )
        meta["id"] = results.uniform_id(module.FAMILY, params["implementation"], check, params, parts)
    else:
        short = getattr(module, "__name__", "?").rsplit(".", 1)[-1]
        meta["id"] = f"suite/{short}/{item.name}" if _is_conformance_item(item) else item.nodeid
    item.stash[_META] = meta
    if SESSION in item.config.stash:
        run_log(item.config).item_meta[item.nodeid] = meta
    return meta


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Known failures and skips from files (before -m/-k deselect, so a line is stale only if it
    matches no collected test at all); then deselect (not skip) tests with nothing to run."""
    for option, mark in (("xfails_file", "xfail"), ("skips_file", "skip")):
        path = config.getoption(option)
        if not path:
            continue
        for number, pattern in known_failures.read_patterns(path):
            hits = [item for item in items if known_failures.matches(pattern, _meta(item))]
            if not hits:
                run_log(config).stale.append({"file": path, "line": number, "pattern": pattern, "kind": mark})
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
        return any(
            k in params and not isinstance(params[k], str) for k in ("implementation", "dtype", "platform")
        )

    empty = {id(i): i for i in items if has_empty_parameter(i)}  # pytest's NOTSET placeholder
    if "benchmark" not in (config.getoption("markexpr") or ""):  # timings run only when asked for
        empty.update((id(i), i) for i in items if i.get_closest_marker("benchmark"))
    empty.update((id(i), i) for i in mesh_options.outside_mesh_cover(config, items))
    pattern = config.getoption("impl")
    if pattern:  # the suite's own fixed tests run built-in kernels: they too answer to --impl
        globs = [g.strip() for g in pattern.split(",") if g.strip()]
        for item in items:
            names = getattr(getattr(item, "module", None), "IMPLEMENTATIONS", None)
            if names is not None and not any(fnmatch.fnmatchcase(n, g) for n in names for g in globs):
                empty[id(item)] = item
    if empty:
        config.hook.pytest_deselected(items=list(empty.values()))
        items[:] = [i for i in items if id(i) not in empty]


def _selected_platforms(items: list[pytest.Item]) -> set[str]:
    return {p for item in items for p in devices_lib.PLATFORMS if item.get_closest_marker(p)}


class _CollectionOutsideTheCycleCollector:
    """Python's cycle collector paused while pytest collects, and the collected tree kept out of its
    later passes.

    The suite's test modules parametrize into thousands of items (23,119 without ``-m``; 9,087 built and
    7,565 kept for ``-m cpu``), and the collector traversed every one of them on each pass that reached
    the oldest generation: during collection, at every such pass of the run, and twice at the end
    (pytest's unraisable-exception plugin collects "harder" as it unconfigures). That was 2.4 s of the
    4.9 s every pytest process of the suite spent before and after its tests (``--collect-only -m
    cpu``, JAX 0.10.2), and more during them (the cpu env's pytest: 124 s -> 86 s): each xdist
    worker, each rank of a job, each run a self-test starts. Here the collector is off while pytest
    collects, then collects once (the cycles collection left behind are freed) and freezes what
    remains (``gc.freeze``), which lives as long as the session anyway. Objects are still freed by
    their reference counts; only a cycle among the frozen ones waits for the process to end, so a
    process that runs the suite's session more than once keeps each earlier session's tree (tens of
    MB). A session without the suite's tests gets the collector back as it was, and nothing frozen.
    """

    @pytest.hookimpl(wrapper=True)
    def pytest_collection(self, session: pytest.Session):
        was_enabled = gc.isenabled()
        gc.disable()
        try:
            return (yield)
        finally:
            if any(_is_conformance_item(item) for item in getattr(session, "items", ())):
                gc.collect()
                gc.freeze()
            if was_enabled:
                gc.enable()


class _DevicesAfterCollection:
    """Sets the CPU device count once collection is final, if any conformance test is selected."""

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, config: pytest.Config, items: list[pytest.Item]) -> None:
        ours = [i for i in items if _is_conformance_item(i)]
        for item in ours:
            _meta(item)
        if not ours:
            return  # a session without the suite's tests: JAX is left exactly as the user set it
        items[:] = xdist_workers.in_groups(items, _is_conformance_item)
        # In a job, each process has the devices the job gave it (launch: --devices-per-process);
        # asking for 8 here would give every process 8 and keep every mesh inside process 0.
        problem = (
            distributed.job_layout_problem()
            if distributed.is_multi_process()
            else (compat.ensure_cpu_devices(devices_lib.CPU_DEVICE_COUNT))
        )
        if problem and distributed.is_multi_process():
            raise pytest.UsageError(problem)
        if problem:
            raise pytest.UsageError(
                f"{problem}. The rule: nothing may start a JAX backend while pytest collects (an array "
                "created when a test or kernel module is imported); start it inside a test or fixture."
            )
        compat.start_backends()
        required = config.getoption("require_backend")
        if required and not devices_lib.has_platform(required):
            raise pytest.UsageError(
                f"--require-backend={required}: this host has no {required} backend "
                f"({devices_lib.describe_host()}); nothing would run"
            )
        config.stash[PLATFORMS] = _selected_platforms(ours)
        if distributed.is_multi_process():
            job_ranks.same_tests_on_every_rank([i.nodeid for i in items])
            job_ranks.junit_file_per_rank(config)


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Skip, with a reason, what this host cannot run: a missing backend or too few devices."""
    log = run_log(item.config)
    log.current = item.nodeid
    log.last_check.pop(item.nodeid, None)
    item.config.stash[SESSION].agreement.begin(item.nodeid)
    if item.get_closest_marker("pallas_interpret") and distributed.is_multi_process():
        pytest.skip(distributed.PALLAS_INTERPRET)
    compile_only = {p for p in ("gpu", "tpu") if item.get_closest_marker(f"{p}_compile")}  # no device
    for platform in devices_lib.PLATFORMS:
        if platform in compile_only:
            continue
        if item.get_closest_marker(platform) and not devices_lib.has_platform(platform):
            pytest.skip(f"needs a {platform} backend; this host has {devices_lib.describe_host()}")
    params = getattr(item, "callspec", None)
    # the mesh of a family test, the route of a transfer's: the parameter that has a device count
    config = params and next((v for v in params.params.values() if hasattr(v, "num_devices")), None)
    platform = params and params.params.get("platform")
    if config and platform:
        found = len(devices_lib.devices_of(platform))
        if found < config.num_devices:
            pytest.skip(f"needs {config.num_devices} devices, found {found}")


def pytest_runtest_logstart(nodeid: str, location) -> None:
    distributed.note_current_test(nodeid)


def pytest_runtest_logfinish(nodeid: str, location) -> None:
    distributed.note_current_test("")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    outcome = yield
    rep = outcome.get_result()
    job_ranks.agree_on_outcome(rep)
    if not _is_conformance_item(item):
        return
    meta = _meta(item)

    def note(key: str, value: str) -> None:  # on the item too: JUnit reads the teardown report's
        for props in (item.user_properties, rep.user_properties):
            props[:] = [(k, v) for k, v in props if k != key] + [(key, value)]

    note("conformance_id", meta["id"])
    noted = run_log(item.config).last_check.get(item.nodeid)
    if noted is not None and rep.when == "call":
        note("case", noted.case.token)
        note("replay", noted.case.replay_command(noted.check))
        if getattr(noted, "read_back", False):
            note(end_of_run.READ_BACK, interpret_outcomes.READ_BACK_NOTE)
        if getattr(noted, "emulated", ""):
            note(end_of_run.EMULATED, noted.emulated)
    if rep.when == "call" and rep.failed:
        # the check's own failure: the outcome's verdict line, and its case for the failure summary
        failure = end_of_run.conformance_failure(call.excinfo.value if call.excinfo else None)
        cause = results.FailureCause.of(failure, check=meta.get("check"))
        rep.conformance_failure = cause.as_json() if cause is not None else None  # plain values: the
        # report may travel to another process (pytest-xdist)
        if failure is not None and failure.case is not None:
            note("case", failure.case.token)
            note("replay", failure.case.replay_command(failure.check))
    if xdist_workers.is_worker(item.config):  # what the controller's report needs of this test
        rep.conformance_payload = xdist_workers.report_payload(run_log(item.config), meta)
