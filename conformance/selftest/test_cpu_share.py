"""The CPU a run gets under a cgroup quota (``conformance/jobs/cpu_share.py``): the quota read from cgroup v1
and v2 file trees as containers lay them out, ``-n auto``'s worker count from it, and each test
process given its own share of the cores, undone after."""

from __future__ import annotations

import types
from pathlib import Path

import pytest

from conformance.jobs import cpu_share
from conformance.plugin import xdist_workers

pytestmark = pytest.mark.selftest


def _tree(root: Path, proc: str, files: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    (root / "proc_self_cgroup").write_text(proc)
    monkeypatch.setattr(cpu_share, "CGROUP_ROOT", root / "sys")
    monkeypatch.setattr(cpu_share, "PROC_CGROUP", root / "proc_self_cgroup")


@pytest.mark.parametrize(
    "proc, files, quota",
    [
        (  # cgroup v2 in a container: its own root holds the limit, a child none
            "0::/job\n",
            {
                "sys/cgroup.controllers": "cpu",
                "sys/cpu.max": "150000 100000",
                "sys/job/cpu.max": "max 100000",
            },
            1.5,
        ),
        ("0::/\n", {"sys/cgroup.controllers": "cpu", "sys/cpu.max": "max 100000"}, None),
        (  # cgroup v1, the quota on a sub-cgroup (docker --cpus=0.5 on a v1 host)
            "3:cpuset:/\n2:cpu,cpuacct:/throttle\n0::/\n",
            {
                "sys/cpu,cpuacct/cpu.cfs_quota_us": "-1",
                "sys/cpu,cpuacct/cpu.cfs_period_us": "100000",
                "sys/cpu,cpuacct/throttle/cpu.cfs_quota_us": "50000",
                "sys/cpu,cpuacct/throttle/cpu.cfs_period_us": "100000",
            },
            0.5,
        ),
        (
            "1:cpu:/\n",
            {"sys/cpu/cpu.cfs_quota_us": "-1", "sys/cpu/cpu.cfs_period_us": "100000"},
            None,
        ),
    ],
    ids=["v2-container-quota", "v2-no-quota", "v1-sub-cgroup-quota", "v1-no-quota"],
)
def test_the_quota_is_read_from_the_process_s_cgroups(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, proc: str, files: dict[str, str], quota: float | None
) -> None:
    _tree(tmp_path, proc, files, monkeypatch)
    monkeypatch.setattr(cpu_share, "visible_cpus", lambda: tuple(range(64)))
    assert cpu_share.quota_cpus() == quota
    want = 64 if quota is None else max(1, -(-quota // 1))
    assert cpu_share.usable_cpus() == want
    monkeypatch.delenv("PYTEST_XDIST_AUTO_NUM_WORKERS", raising=False)
    assert xdist_workers.auto_num_workers() == want, "-n auto starts a worker per CPU the quota grants"
    assert bool(cpu_share.header_lines()) == (quota is not None)


def test_each_process_runs_on_its_own_share_and_is_given_its_cores_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[set[int]] = []
    monkeypatch.setattr(cpu_share.os, "sched_setaffinity", lambda pid, cores: calls.append(set(cores)))
    monkeypatch.setattr(cpu_share, "visible_cpus", lambda: tuple(range(16)))
    monkeypatch.setattr(cpu_share, "quota_cpus", lambda: 4.0)
    said, undo = cpu_share.fit_to_share(1, 2)
    assert calls == [{2, 3}], "worker 1 of 2 takes the second pair of the 4 CPUs' cores"
    assert said and "a CPU quota of 4 CPUs on 16 visible cores" in said, said
    undo()
    assert calls[-1] == set(range(16))
    calls.clear()
    monkeypatch.setattr(cpu_share, "quota_cpus", lambda: None)
    assert cpu_share.fit_to_share(0, 1)[0] is None and not calls, "a host without a quota is left alone"
    monkeypatch.setattr(cpu_share, "quota_cpus", lambda: 4.0)
    monkeypatch.setenv(cpu_share.OPT_OUT, "off")
    assert cpu_share.fit_to_share(0, 1)[0] is None and not calls, "CONFORMANCE_CPU_SHARE=off"


def _config(*args: str, pyargs: bool = False, cwd: Path) -> types.SimpleNamespace:
    return types.SimpleNamespace(
        args=list(args),
        option=types.SimpleNamespace(pyargs=pyargs),
        invocation_params=types.SimpleNamespace(dir=cwd),
    )


def test_one_cpu_runs_the_suite_in_its_own_process_and_leaves_other_suites_one_worker(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under a quota of one CPU or less a worker adds only its controller's cost to the suite's run;
    another suite in the environment keeps xdist's one worker."""
    monkeypatch.delenv("PYTEST_XDIST_AUTO_NUM_WORKERS", raising=False)
    monkeypatch.setattr(cpu_share, "visible_cpus", lambda: (0, 1, 2, 3))
    monkeypatch.setattr(cpu_share, "quota_cpus", lambda: 0.5)
    package = Path(xdist_workers.__file__).resolve().parent.parent
    assert xdist_workers.auto_num_workers(_config(str(package), cwd=tmp_path)) == 0
    assert xdist_workers.auto_num_workers(_config("conformance", cwd=package.parent)) == 0
    assert xdist_workers.auto_num_workers(_config(f"{package}/selftest::test_x", cwd=tmp_path)) == 0
    assert xdist_workers.auto_num_workers(_config("conformance", pyargs=True, cwd=tmp_path)) == 0
    assert xdist_workers.auto_num_workers(_config("tests", cwd=tmp_path)) == 1
    assert xdist_workers.auto_num_workers(_config(cwd=tmp_path)) == 1
    assert "-n auto runs the tests in this process" in cpu_share.header_lines(workers=0)[0]
    monkeypatch.setattr(cpu_share, "quota_cpus", lambda: 1.5)  # two CPUs: two workers, whatever runs
    assert xdist_workers.auto_num_workers(_config(str(package), cwd=tmp_path)) == 2
    assert "-n auto starts 2 worker(s)" in cpu_share.header_lines()[0]
