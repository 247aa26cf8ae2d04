"""The suite run as a job of 2 processes x 4 CPU devices (``python -m conformance launch``):
checks pass across process boundaries, and each multi-process fault of
``broken_multiprocess_kernels`` ends the job cleanly, naming the rank and the test."""

from __future__ import annotations

import re
import subprocess
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from conformance.checks.values import EAGER_MESHES
from conformance.selftest import STARTUP_ON_A_LOADED_HOST_S, job_command, subprocess_env, suite_command

pytestmark = [pytest.mark.selftest, pytest.mark.integration]

KERNELS = "conformance.selftest.broken_multiprocess_kernels"


def _launch(
    tmp_path: Path, *pytest_args: str, timeout: float = 120
) -> tuple[subprocess.CompletedProcess, float]:
    env = subprocess_env()
    logs = str(tmp_path / "logs")
    command = [
        *job_command(timeout=timeout, log_dir=logs),
        *suite_command(f"--kernels={KERNELS}", *pytest_args),
    ]
    start = time.monotonic()
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=timeout + 60, env=env, cwd=tmp_path
    )
    return done, time.monotonic() - start


def _left_behind() -> list[str]:
    # -ww: full command lines (ps cuts them at 80 columns when its output is not a terminal)
    ps = subprocess.run(["ps", "-ww", "-eo", "pid,stat,args"], capture_output=True, text=True).stdout
    return [line for line in ps.splitlines() if KERNELS in line and " Z" not in line]


def test_checks_pass_across_process_boundaries(tmp_path: Path) -> None:
    """A ring of 8 crossing the boundary twice, 2-D meshes with one axis crossing, and smaller
    meshes whose devices alternate between the processes; values, sharding, HLO, gradients."""
    checks = "test_values or test_output_sharding or test_collectives or test_gradients"
    junit = tmp_path / "results.xml"
    impl = "--impl=ring_allgather_matmul_bidirectional"
    done, _ = _launch(tmp_path, impl, "-k", checks, f"--junitxml={junit}", timeout=400)
    assert done.returncode == 0, done.stdout[-5000:]
    assert "all 2 ranks exited 0" in done.stdout
    rank1 = (tmp_path / "logs" / "rank-1.log").read_text()
    assert "the tables, matrix and failure summary are printed by rank 0" in rank1, rank1[-2000:]
    assert "conformance matrix" not in rank1 and "conformance matrix" in done.stdout
    # each rank's JUnit file of its own: rank 0 the one named, rank 1 beside it
    tests = [ET.parse(path).getroot().iter("testcase") for path in (junit, tmp_path / "results.xml.rank-1")]
    names = [sorted(case.get("name") for case in cases) for cases in tests]
    assert names[0] and names[0] == names[1], names


def test_a_kernel_that_traces_per_rank_fails_on_every_rank(tmp_path: Path) -> None:
    done, _ = _launch(tmp_path, "--impl=broken_mp_traces_per_rank", "-k", "test_values and 4-x-auto")
    assert done.returncode == 1, done.stdout[-5000:]
    assert (
        "rank 0 of 2 ended with exit status 1" in done.stdout
        or "rank 1 of 2 ended with exit status 1" in done.stdout
    )
    assert "the ranks traced different programs" in done.stdout and "jax.process_index()" in done.stdout
    assert "failed on ranks: 0, 1 of 2" in done.stdout, done.stdout[-5000:]
    assert not _left_behind()


def test_a_rank_that_dies_in_a_kernel_ends_the_job(tmp_path: Path) -> None:
    done, took = _launch(tmp_path, "--impl=broken_mp_dies_in_kernel", "-k", "test_values and 4-x-auto")
    assert done.returncode == 17, done.stdout[-5000:]  # the rank's own exit status
    assert (
        "rank 1 of 2 ended with exit status 17 in tests/test_allgather_matmul.py::test_values[" in done.stdout
    )
    assert took < STARTUP_ON_A_LOADED_HOST_S + 30, took
    assert not _left_behind()


def test_a_rank_that_hangs_in_a_collective_is_stopped_naming_the_test(tmp_path: Path) -> None:
    done, took = _launch(
        tmp_path, "--impl=broken_mp_hangs_in_kernel", "-k", "test_values and 4-x-auto", timeout=20
    )
    assert done.returncode == 124, done.stdout[-5000:]
    assert "ran past --timeout 20 s" in done.stdout
    assert "in tests/test_allgather_matmul.py::test_values[broken_mp_hangs_in_kernel-" in done.stdout
    assert took < 20 + STARTUP_ON_A_LOADED_HOST_S, took  # the --timeout, and the ranks' start
    assert not _left_behind()


def test_a_kernel_reading_other_ranks_data_fails_naming_the_call(tmp_path: Path) -> None:
    done, _ = _launch(tmp_path, "--impl=broken_mp_reads_nonaddressable", "-k", "test_values and 4-x-auto")
    assert done.returncode == 1, done.stdout[-5000:]
    assert "broken_multiprocess_kernels.py" in done.stdout and "np.asarray(lhs)" in done.stdout, done.stdout[
        -4000:
    ]
    assert not _left_behind()


def test_a_kernel_reading_its_global_input_when_called_eagerly_fails_the_eager_check(tmp_path: Path) -> None:
    """Called outside jit, the kernel logs a checksum of its input (``np.asarray``): right in one
    process and under jit in a job, an error outside jit in a job; the built-in ring passes."""
    done, _ = _launch(
        tmp_path,
        "--impl=broken_mp_logs_checksum_eagerly,ring_allgather_matmul_bidirectional",
        "-k",
        "test_eager or (test_values and 2-x-auto)",
        timeout=300,
    )
    out = done.stdout
    assert done.returncode == 1, out[-5000:]
    failed = {line.split("::", 1)[1] for line in out.splitlines() if line.startswith("FAILED ")}
    assert failed == {f"test_eager[broken_mp_logs_checksum_eagerly-{m}-cpu]" for m in EAGER_MESHES}, (
        failed,
        out[-4000:],
    )
    assert "raised" in out and "when called outside jax.jit" in out and "np.asarray(lhs" in out, out[-4000:]
    assert "failed on ranks: 0, 1 of 2" in out
    assert re.search(r"allgather_matmul/ring_allgather_matmul_bidirectional +ok +\d+P", out), out[-3000:]
    assert not _left_behind()


def test_a_rank_that_leaves_a_test_early_fails_it_on_every_rank_at_once(tmp_path: Path) -> None:
    """Rank 1 does not claim the case (a ``supports`` that reads the process index): it posts the
    test's outcome, never a verdict of the check, which rank 0 (whose transfer passed) waits for:
    rank 0 must see that outcome and stop, and the test fails on both ranks."""
    done, took = _launch(
        tmp_path,
        "--impl=broken_mp_claims_per_rank",
        "-k",
        "test_send_recv and test_values and float32 and vector-4-permuted",
    )
    assert done.returncode == 1, done.stdout[-5000:]
    assert "rank 1 stopped before this step of the test" in done.stdout, done.stdout[-5000:]
    assert "not on this process" in done.stdout
    test = "test_values[broken_mp_claims_per_rank-float32-cpu-vector-4-permuted]"
    assert f"FAILED tests/test_send_recv.py::{test}" in done.stdout
    rank1 = (tmp_path / "logs" / "rank-1.log").read_text()
    assert "failed on rank 0 of 2" in rank1, rank1[-3000:]
    assert took < STARTUP_ON_A_LOADED_HOST_S + 30, took
    assert not _left_behind()


def test_send_recv_across_processes(tmp_path: Path) -> None:
    """The send_recv family in a 2 x 4 job: the baseline moves shards from process 0 to 1 and back
    bit for bit (a ppermute between processes); a kernel that pairs the wrong devices and one that
    publishes a pickle in the job's key-value store are rejected on every rank."""
    broken = "conformance.selftest.broken_send_recv_kernels"
    impls = "xla_device_put,broken_sr_pairs_reversed,broken_sr_publishes_pickle"
    done, _ = _launch(
        tmp_path,
        f"--kernels={broken}",
        f"--impl={impls}",
        "-k",
        "test_send_recv and (test_no_pickle or (test_values and float32 and disjoint))",
        timeout=300,
    )
    out = done.stdout
    assert done.returncode == 1, out[-5000:]
    failed = {line.split("::", 1)[1] for line in out.splitlines() if line.startswith("FAILED ")}
    assert not [t for t in failed if "xla_device_put" in t], failed
    for route in ("4-disjoint", "4-disjoint_back", "2x2-disjoint"):  # process 0 -> 1, 1 -> 0, both
        for layout in ("vector", "matrix"):  # (a replicated array is the same on every device)
            assert f"test_values[broken_sr_pairs_reversed-float32-cpu-{layout}-{route}]" in failed, failed
    assert "[values] send_recv/broken_sr_pairs_reversed: the result's bytes differ" in out
    assert {
        f"test_no_pickle[broken_sr_publishes_pickle-cpu-{r}]" for r in ("4-disjoint", "1-identical")
    } <= failed
    assert "key_value_set_bytes(" in out and "failed on ranks: 0, 1 of 2" in out
    assert re.search(r"send_recv/xla_device_put +ok +20P", out), out[-3000:]
    # the job's devices are 4 per process: the 4-disjoint route goes to process 1, whose CPU device
    # ids start at a stride (2048; 131072 on JAX 0.6.2), not at 4 (the plugin once gave every process
    # 8, and every route stayed inside process 0)
    moved = re.search(r"devices \[0, 1, 2, 3\] -> \[(\d+), (\d+), (\d+), (\d+)\]", out)
    assert moved is not None, out[-3000:]
    first = int(moved[1])
    assert first >= 2048 and [int(d) for d in moved.groups()] == list(range(first, first + 4)), moved[0]


def test_timeout_is_checked_where_one_side_stays_away(tmp_path: Path) -> None:
    """Receivers alone call with ``timeout=1``: the key-value kernel raises TimeoutError naming the
    sender and its next transfer works; one that ignores the timeout, one that raises JAX's own
    error and one that loses its place after a timeout are each rejected by the timeout check."""
    from conformance.selftest import broken_send_recv_kernels as kernels

    impls = ",".join([kernels.TIMEOUT_CORRECT, *kernels.EXPECTED_REJECTION_TIMEOUT])
    done, took = _launch(
        tmp_path,
        f"--kernels={kernels.__name__}",
        f"--impl={impls}",
        "-k",
        "test_timeout",
        "--hang-timeout=20",
        timeout=300,
    )
    out = done.stdout
    assert done.returncode == 1, out[-5000:]
    failed = {line.split("::", 1)[1] for line in out.splitlines() if line.startswith("FAILED ")}
    assert not [t for t in failed if kernels.TIMEOUT_CORRECT in t], failed
    assert re.search(rf"send_recv/{kernels.TIMEOUT_CORRECT} +ok +2P", out), out[-3000:]
    for impl, message in kernels.EXPECTED_REJECTION_TIMEOUT.items():
        assert any(impl in t for t in failed), (impl, failed)
        assert re.search(rf"\[timeout\] send_recv/{impl}: .*{re.escape(message)}", out), (impl, out[-4000:])
    # each route's receiver's own message: its call hung (rank 1 receives on the route out of rank 0,
    # rank 0 on the way back); the sender's transfer after it is not judged on a rank whose own call
    # hung earlier, never a wrong transfer it did not make
    for rank in (0, 1):
        hung = f"[rank {rank} of 2] [timeout] send_recv/broken_sr_timeout_ignored: did not return"
        assert hung in out, out[-6000:]
    # a rank holding a call it abandoned ends itself, naming the call, instead of aborting at exit
    assert "terminate called" not in out and "SIGABRT" not in out, out[-4000:]
    ended = re.search(r"ending past abandoned call\(s\): .*broken_sr_timeout_ignored: timeout", out)
    assert ended, out[-4000:]
    assert took < 120, took
