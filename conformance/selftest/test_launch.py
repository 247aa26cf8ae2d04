"""``python -m conformance launch``: a job of several local processes, with JAX's own runtime;
each fault ends it in bounded time, naming the rank and test, and leaves no process behind."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from conformance.selftest import STARTUP_ON_A_LOADED_HOST_S, subprocess_env

pytestmark = pytest.mark.selftest

RING = """
import os, jax, numpy as np
from conformance.jobs import distributed
distributed.initialize()
from jax.sharding import NamedSharding, PartitionSpec as P
n = jax.device_count()
mesh = jax.make_mesh((n,), ("x",), devices=jax.devices())
x = np.arange(2.0 * n).reshape(n, 2)
a = jax.make_array_from_callback(x.shape, NamedSharding(mesh, P("x")), lambda idx: x[idx])
shift = jax.shard_map(lambda b: jax.lax.ppermute(b, "x", [(i, (i + 1) % n) for i in range(n)]),
                      mesh=mesh, in_specs=P("x"), out_specs=P("x"))
out = jax.jit(shift)(a)
where = {d: i for i, d in enumerate(mesh.devices.flat)}
for s in out.addressable_shards:  # mesh device i holds the row of device i - 1, across processes too
    i = where[s.device]
    assert np.asarray(s.data).tolist() == [x[(i - 1) % n].tolist()], (i, s.data)
print(f"rank {jax.process_index()} of {jax.process_count()}: {len(out.addressable_shards)} shards ok")
"""


def _launch(
    tmp_path: Path, script: str, *args: str, timeout: float = 120
) -> tuple[subprocess.CompletedProcess, float]:
    (tmp_path / "job.py").write_text(textwrap.dedent(script))
    env = subprocess_env()
    start = time.monotonic()
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "conformance",
            "launch",
            *args,
            "--log-dir",
            str(tmp_path / "logs"),
            "--",
            sys.executable,
            str(tmp_path / "job.py"),
        ],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=tmp_path,
    )
    return done, time.monotonic() - start


def _left_behind(tmp_path: Path) -> list[str]:
    # -ww: full command lines (ps cuts them at 80 columns when its output is not a terminal)
    ps = subprocess.run(["ps", "-ww", "-eo", "pid,args"], capture_output=True, text=True).stdout
    return [line for line in ps.splitlines() if str(tmp_path / "job.py") in line and " launch " not in line]


def test_a_ring_crosses_the_process_boundary(tmp_path: Path) -> None:
    done, _ = _launch(tmp_path, RING, "--processes", "2", "--devices-per-process", "4", "--timeout", "100")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "rank 0 of 2: 4 shards ok" in done.stdout, done.stdout  # rank 0's output is shown
    assert "rank 1 of 2: 4 shards ok" in (tmp_path / "logs" / "rank-1.log").read_text()
    assert "all 2 ranks exited 0" in done.stdout


def test_a_dead_rank_ends_the_job_naming_it(tmp_path: Path) -> None:
    script = """
    import os, signal, subprocess, sys, time
    if os.environ["CONFORMANCE_PROCESS_ID"] == "1":
        print("rank 1 about to die", flush=True)
        time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGKILL)
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)  # a child of rank 0"])
    time.sleep(600)
    """
    done, took = _launch(tmp_path, script, "--processes", "3", "--timeout", "100")
    assert done.returncode == 1, done.stdout + done.stderr
    assert "rank 1 of 3 ended with killed by SIGKILL" in done.stdout and "rank 1 about to die" in done.stdout
    assert took < STARTUP_ON_A_LOADED_HOST_S, took
    assert not _left_behind(tmp_path), _left_behind(tmp_path)


def test_a_hung_job_is_stopped_by_the_timeout(tmp_path: Path) -> None:
    script = """
    import os, time
    rank = os.environ["CONFORMANCE_PROCESS_ID"]
    with open(os.path.join(os.environ["CONFORMANCE_LAUNCH_DIR"], f"rank-{rank}.test"), "w") as f:
        f.write("test_module.py::test_that_hangs")
    time.sleep(600)
    """
    done, took = _launch(tmp_path, script, "--processes", "2", "--timeout", "3")
    assert done.returncode == 124, done.stdout + done.stderr
    assert (
        "ran past --timeout 3 s" in done.stdout and "rank 0 in test_module.py::test_that_hangs" in done.stdout
    )
    assert took < 3 + STARTUP_ON_A_LOADED_HOST_S, took  # the --timeout, and the ranks' start
    assert not _left_behind(tmp_path), _left_behind(tmp_path)


@pytest.mark.parametrize("how", ["SIGTERM", "SIGKILL"])
def test_a_stopped_launcher_leaves_no_rank_behind(tmp_path: Path, how: str) -> None:
    """A CI timeout's SIGTERM stops every rank; after a SIGKILL, which nothing can catch, each rank
    dies with its launcher (Linux: PR_SET_PDEATHSIG)."""
    import signal

    (tmp_path / "job.py").write_text("import time\nprint('started', flush=True)\ntime.sleep(600)\n")
    env = subprocess_env()
    launcher = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "conformance",
            "launch",
            "--processes",
            "2",
            "--log-dir",
            str(tmp_path / "logs"),
            "--",
            sys.executable,
            str(tmp_path / "job.py"),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        cwd=tmp_path,
    )
    deadline = time.monotonic() + 60
    while len(_left_behind(tmp_path)) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert len(_left_behind(tmp_path)) == 2, "the ranks did not start"
    launcher.send_signal(getattr(signal, how))
    out, _ = launcher.communicate(timeout=30)
    if how == "SIGTERM":
        assert launcher.returncode == 128 + signal.SIGTERM and "got SIGTERM; every rank stopped" in out, out
    deadline = time.monotonic() + 10
    while _left_behind(tmp_path) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _left_behind(tmp_path), _left_behind(tmp_path)
