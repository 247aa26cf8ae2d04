"""pytest plugin: loads kernels, parametrizes the family tests, gates backends, reports bytes.

Options:

``--kernels=MODULE[,MODULE...]``
    import these modules before collection; their ``conformance.register``
    calls join the run next to the built-ins (``kernels``).
``--impl=GLOB[,GLOB...]``
    run only implementations whose names match one of the globs.
``--hang-timeout=SECONDS``, ``--check-timeout=SECONDS``, ``--isolation=process|off``
    the bounds on a Pallas kernel in interpret mode (see :mod:`conformance.isolation`).

Each family test module sets ``FAMILY = "<name>"``; tests that take
``implementation`` are parametrized over that family's registered
implementations (the test id contains the name), ``mesh_config`` over the
standard meshes, and ``platform`` over cpu/gpu/tpu, each value carrying the
marker of the same name. A platform this host lacks is skipped with a reason,
so ``pytest -m tpu`` on a CPU host skips rather than errors.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections import defaultdict

import pytest
from hypothesis import HealthCheck, Phase, settings

from conformance import bench, compat, isolation, registry, report, runner, specs
from conformance.specs.base import FIXED_SHAPES
from fixtures import devices as devices_lib
from fixtures import meshes

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
    group.addoption("--impl", default=None, metavar="GLOB[,GLOB...]",
                    help="run only implementations whose names match one of these globs")  # fmt: skip


def kernel_modules(config: pytest.Config) -> list[str]:
    return [m.strip() for opt in config.getoption("kernels") for m in opt.split(",") if m.strip()]


def pytest_configure(config: pytest.Config) -> None:
    compat.configure_cpu_devices(devices_lib.CPU_DEVICE_COUNT)
    runner.HANG_TIMEOUT_S = config.getoption("hang_timeout")
    isolation.CHECK_TIMEOUT_S = config.getoption("check_timeout")
    isolation.MODE = config.getoption("isolation")
    if not config.getoption("hypothesis_profile", None):
        settings.load_profile("conformance-ci")
    for module in ["kernels", *kernel_modules(config)]:
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


@pytest.fixture(scope="module")
def family(request: pytest.FixtureRequest) -> str:
    return request.module.FAMILY


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
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


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Deselect (not skip) tests with nothing to run, e.g. Pallas checks of a family with no Pallas kernel."""

    def has_empty_parameter(item: pytest.Item) -> bool:
        if not hasattr(getattr(item, "module", None), "FAMILY"):
            return False
        params = getattr(getattr(item, "callspec", None), "params", {})
        return any(k in params and not isinstance(params[k], str) for k in ("implementation", "dtype"))

    empty = [i for i in items if has_empty_parameter(i)]  # pytest's NOTSET placeholder
    if "benchmark" not in (config.getoption("markexpr") or ""):  # timings run only when asked for
        empty += [i for i in items if i.get_closest_marker("benchmark") and i not in empty]
    if empty:
        config.hook.pytest_deselected(items=empty)
        items[:] = [i for i in items if i not in empty]


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Skip, with a reason, what this host cannot run: a missing backend or too few devices."""
    for platform in devices_lib.PLATFORMS:
        if item.get_closest_marker(platform) and not devices_lib.has_platform(platform):
            pytest.skip(f"needs a {platform} backend; this host has {devices_lib.describe_host()}")
    params = getattr(item, "callspec", None)
    config = params and params.params.get("mesh_config")
    platform = params and params.params.get("platform")
    if config and platform:
        found = len(devices_lib.devices_of(platform))
        if found < config.num_devices:
            pytest.skip(f"needs {config.num_devices} devices, found {found}")


#: Every family test's outcome this run, for the summary of failures by cause.
VERDICTS: list[report.Verdict] = []


def _conformance_failure(error: BaseException | None):
    """The check's failure inside a test's exception (hypothesis may group several: take the smallest)."""
    from conformance.checks import ConformanceFailure

    found, stack = [], [error]
    while stack:
        e = stack.pop()
        if e is None:
            continue
        if isinstance(e, ConformanceFailure) and e.case is not None:
            found.append(e)
        stack += [getattr(e, "failure", None), *getattr(e, "exceptions", ())]
    return min(found, key=lambda f: report.case_size(f.case), default=None)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    outcome = yield
    rep = outcome.get_result()
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
    if not rep.skipped:
        VERDICTS.append(verdict)


def _byte_table(tr, title: str, records: list) -> None:
    if not records:
        return
    tr.section(title)
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
        tr.write_line(line)


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    from conformance.checks import (
        ACCURACY_RECORDS,
        BACKWARD_ACCURACY_RECORDS,
        BACKWARD_BYTE_RECORDS,
        BYTE_RECORDS,
        LOWERED_BYTE_RECORDS,
        OVERLAP_RECORDS,
        TPU_LAYOUT_RECORDS,
    )

    tr = terminalreporter
    _byte_table(tr, "forward: bytes received per device / lower bound (compiled HLO)", BYTE_RECORDS)
    _byte_table(tr, "backward (VJP): bytes received per device / the math's bound (compiled HLO)",
                BACKWARD_BYTE_RECORDS)  # fmt: skip
    _byte_table(tr, "16-bit: bytes received per device / bound (modules lowered for each target)",
                LOWERED_BYTE_RECORDS)  # fmt: skip
    _accuracy_table(tr, "accuracy: rms error vs float64, implementation / baseline (same inputs)",
                    ACCURACY_RECORDS)  # fmt: skip
    _accuracy_table(tr, "backward accuracy: each gradient's rms error vs float64, implementation / baseline",
                    BACKWARD_ACCURACY_RECORDS)  # fmt: skip
    _overlap_table(tr, OVERLAP_RECORDS)
    for title, lines in bench.tables(bench.RECORDS):
        tr.section(title)
        for line in lines:
            tr.write_line(line)
    _tpu_layout_table(tr, TPU_LAYOUT_RECORDS)
    lines = report.summarize(VERDICTS)
    if lines:
        tr.section("conformance failures by implementation: each cause once, smallest failing case first")
        for line in lines:
            tr.write_line(line)


def _accuracy_table(tr, title: str, records: list) -> None:
    if not records:
        return
    tr.section(title)
    width = max(len(r.impl) for r in records)
    rows: dict[tuple[str, str, str, str], list] = defaultdict(list)
    for r in records:
        rows[(r.family, r.impl, r.dtype, r.gradient)].append(r)
    for (family, impl, dtype, gradient), recs in sorted(rows.items()):
        worst = max(recs, key=lambda r: r.ratio)  # one line per dtype: the range over meshes, the worst case
        low = min(r.ratio for r in recs)
        span = f"{low:.2f}-{worst.ratio:.2f}" if f"{low:.2f}" != f"{worst.ratio:.2f}" else f"{low:.2f}"
        rms = f"{worst.rms:.3e} / {worst.baseline_rms:.3e}"
        tr.write_line(f"{family:<21} {impl:<{width}}  {dtype:<9} {gradient:<6} ratio {span:>9} on "
                      f"{len(recs):>2} meshes; worst {worst.mesh}: {rms}")  # fmt: skip


def _tpu_layout_table(tr, records: list) -> None:
    """Per Pallas kernel and dtype: tile-edge shapes lowered to windows a TPU accepts, and refused."""
    if not records:
        return
    tr.section(
        "TPU layout (lowered for TPU from this host): shapes accepted / refused with the constraint named"
    )
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
        tr.write_line(f"{family:<21} {impl:<{width}}  {dtype:<9} accepted {len(accepted)}: "
                      f"{'; '.join(accepted)}  refused {refused}"
                      + (f"  not lowerable on this host {limited}" if limited else ""))  # fmt: skip


def _overlap_table(tr, records: list) -> None:
    """Per implementation and module: transfers that can hide behind a matmul / all, per ring length."""
    if not records:
        return
    tr.section("overlap: transfers with a matmul independent of them / all transfers, by ring length "
               "(dataflow of each module)")  # fmt: skip
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
        tr.write_line(line)
