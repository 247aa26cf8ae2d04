"""The CPU a run really gets: a container's CPU quota, not the cores it can see.

In a container limited by a cgroup CPU quota (Docker's ``--cpus=2``, Kubernetes' CPU limit, a CI
runner's share of a large host) every process still sees all the host's cores. pytest-xdist's
``-n auto`` then starts a worker per visible core (up to ``--maxprocesses``), and XLA:CPU sizes each
process's thread pools by the cores it may run on, so a run with 2 CPUs of quota on a 64-core host
has hundreds of threads taking turns at 2 CPUs. The kernel throttles the whole group each time the
quota of a period (100 ms) is spent, and every simulated device of a collective waits for the
slowest: the run grows faster than the CPU shrinks. Measured on a 2-core host (docs/timings.md): a
subset of the cpu run under a quota of a quarter CPU took 173 s with 2 workers, 152 s with one,
and 120 s with one worker pinned to one core, against 19 s unthrottled.

So the plugin asks (:func:`usable_cpus`) how many CPUs the quota grants, starts that many workers
for ``-n auto`` (for one CPU, the suite's own run stays in one process: a worker would add only its
controller's cost; :func:`conformance.plugin.xdist_workers.auto_num_workers`), and where the quota is below
the cores a process may run on, gives each process of the run its share of the cores
(:func:`fit_to_share`) before JAX's backend starts, so that XLA's pools are sized by it. A host
without a quota is left as it is, and ``CONFORMANCE_CPU_SHARE=off`` leaves every process where it
was (``PYTEST_XDIST_AUTO_NUM_WORKERS`` sets ``-n auto``'s count).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from pathlib import Path

#: Where the cgroup file systems are mounted, and where a process finds its own cgroups.
CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_CGROUP = Path("/proc/self/cgroup")
#: ``CONFORMANCE_CPU_SHARE=off`` leaves every process on the cores it was given.
OPT_OUT = "CONFORMANCE_CPU_SHARE"


def _v2_limit(relative: str) -> float | None:
    """The tightest ``cpu.max`` from the process's cgroup up to the root (cgroup v2)."""
    limits = []
    parts = [p for p in relative.strip("/").split("/") if p]
    for depth in range(len(parts), -1, -1):
        text = _read(CGROUP_ROOT.joinpath(*parts[:depth], "cpu.max"))
        if text:
            quota, _, period = text.partition(" ")
            if quota != "max" and period:
                limits.append(int(quota) / int(period))
    return min(limits) if limits else None


def _v1_limit(controllers: dict[str, str]) -> float | None:
    """The tightest ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us`` up to the root (cgroup v1)."""
    relative = controllers.get("cpu")
    if relative is None:
        return None
    limits = []
    for mount in ("cpu", "cpu,cpuacct", "cpuacct,cpu"):
        base = CGROUP_ROOT / mount
        if not base.is_dir():
            continue
        parts = [p for p in relative.strip("/").split("/") if p]
        for depth in range(len(parts), -1, -1):
            folder = base.joinpath(*parts[:depth])
            quota, period = _read(folder / "cpu.cfs_quota_us"), _read(folder / "cpu.cfs_period_us")
            if quota and period and int(quota) > 0:
                limits.append(int(quota) / int(period))
        break
    return min(limits) if limits else None


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def quota_cpus() -> float | None:
    """The CPUs this process's cgroup quota grants (``1.5``), or ``None`` where there is no quota or
    no cgroup file system (not Linux)."""
    text = _read(PROC_CGROUP)
    if text is None:
        return None
    controllers: dict[str, str] = {}
    for line in text.splitlines():
        _, names, relative = line.split(":", 2)
        for name in names.split(",") if names else ("",):
            controllers[name] = relative
    if "" in controllers and (CGROUP_ROOT / "cgroup.controllers").is_file():
        return _v2_limit(controllers[""])
    return _v1_limit(controllers)


def visible_cpus() -> tuple[int, ...]:
    """The cores this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return tuple(sorted(os.sched_getaffinity(0)))
    return tuple(range(os.cpu_count() or 1))


def usable_cpus() -> int:
    """The whole CPUs the run may use: the visible cores, or fewer where a quota grants fewer (at
    least 1)."""
    quota = quota_cpus()
    visible = len(visible_cpus())
    return max(1, min(visible, math.ceil(quota - 1e-9) if quota is not None else visible))


def fit_to_share(index: int, processes: int) -> tuple[str | None, Callable[[], None]]:
    """Where a quota grants fewer CPUs than this process may run on: run it (and the processes it
    starts) on its share of them, process ``index`` of ``processes`` taking its own slice of the
    visible cores. Returns what was done (``None`` where nothing was) and the closure that undoes it.
    Call before JAX's backend starts: XLA sizes its thread pools then."""
    visible = visible_cpus()
    usable = usable_cpus()
    if usable >= len(visible) or not hasattr(os, "sched_setaffinity") or os.environ.get(OPT_OUT) == "off":
        return None, lambda: None
    share = max(1, usable // max(1, processes))
    start = (index * share) % len(visible)
    cores = {visible[(start + i) % len(visible)] for i in range(share)}
    os.sched_setaffinity(0, cores)

    def undo() -> None:
        os.sched_setaffinity(0, visible)

    said = (
        f"a CPU quota of {quota_cpus():g} CPUs on {len(visible)} visible cores: this process runs on "
        f"{share} of them ({', '.join(map(str, sorted(cores)))}), its share of {usable} among {processes}"
    )
    return said, undo


def header_lines(*, workers: int | None = None) -> list[str]:
    """What the run's header says of the CPU share, where a quota grants fewer CPUs than are visible
    (``workers``: what ``-n auto`` gives, 0 for the tests in this process; default: one per CPU)."""
    quota, visible = quota_cpus(), len(visible_cpus())
    if quota is None or usable_cpus() >= visible:
        return []
    workers = usable_cpus() if workers is None else workers
    auto = "runs the tests in this process" if workers == 0 else f"starts {workers} worker(s)"
    return [
        f"conformance: a CPU quota of {quota:g} CPUs on {visible} visible cores: -n auto {auto}, and "
        "each test process runs on its share of the cores"
    ]
