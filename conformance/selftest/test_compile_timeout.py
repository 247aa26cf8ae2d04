"""A compile for a TPU or GPU topology has a bound (``--compile-timeout``): past it the compile is
abandoned and its check fails naming the compiler, the devices and the time, the same program is not
compiled again in the run, the run goes on, and the process ends with pytest's exit status past the
abandoned compile (never Python's abort at finalization, exit status 134). A compile tier's check
runs in the worker process, which ends once it has answered, the abandoned compile and its memory
with it, before the next check."""

from __future__ import annotations

import importlib
import subprocess
import sys
import threading
from pathlib import Path

import pytest

import conformance
from conformance import checks, registry
from conformance.checks import tpu_memory
from conformance.fixtures.meshes import parse_mesh
from conformance.run import run_check
from conformance.run.outcomes import run_here
from conformance.runner import Case
from conformance.selftest import subprocess_env, suite_command
from conformance.session import Session, Settings
from conformance.targets import tpu_compiler

pytestmark = pytest.mark.selftest

IMPL = "ring_whose_tpu_compile_outruns_its_bound"
VERDICT = "a compile for a TPU or GPU topology did not finish within --compile-timeout"


def _ring(lhs, rhs, *, mesh, axis_name):
    """The built-in ring under its own name: a program no other test compiles."""
    return registry.get("allgather_matmul", "ring_allgather_matmul_unidirectional").fn(
        lhs, rhs, mesh=mesh, axis_name=axis_name
    )


def test_a_compile_past_its_bound_is_a_verdict_and_is_not_tried_again() -> None:
    if not tpu_compiler.available():
        pytest.skip(f"no TPU compiler here: {tpu_compiler.unavailable_reason()}")
    if IMPL not in conformance.implementations("allgather_matmul"):
        conformance.register("allgather_matmul", name=IMPL)(_ring)
    dims = {"rows_per_shard": 3, "K": 8, "cols_per_shard": 2}
    case = Case.make("allgather_matmul", IMPL, parse_mesh("4-x-auto"), dims, "bfloat16")
    session = Session(Settings(compile_timeout_s=0.001))  # no TPU compile is this quick
    # from one call site: the program's debug info, part of what is compiled, names its callers' lines
    first, again = (run_here(checks.CHECKS["tpu_bytes"], case, session) for _ in range(2))
    assert first.verdict == "failed" and first.what == VERDICT, first.message
    assert "did not finish within --compile-timeout=0.001s; abandoned" in first.message, first.message
    assert "by libtpu" in first.message and "for 4 TPU" in first.message, first.message
    assert session.abandoned_calls(), "the abandoned compile is not on the session"
    assert again.what == VERDICT and "not compiled again" in again.message, again.message
    for (
        thread
    ) in threading.enumerate():  # the abandoned compile, left running, would abort this process's exit
        if thread.name == "conformance-target-compile":
            thread.join()


def test_a_compile_tier_check_past_its_bound_ends_the_worker_it_ran_in() -> None:
    """The worker process is ended with the compile it gave up on (its memory freed, not left to grow
    beside the next test's); the next worker does not try that program again."""
    if not tpu_compiler.available():
        pytest.skip(f"no TPU compiler here: {tpu_compiler.unavailable_reason()}")
    dims = tpu_memory.memory_dims("all_gather", "xla_all_gather")[0]
    case = Case.make("all_gather", "xla_all_gather", parse_mesh("8-x-explicit"), dict(dims), "bfloat16")
    session = Session(Settings(compile_timeout_s=0.001))
    try:
        first = run_check("tpu_memory", case, session)
        ended = session.worker
        assert first.verdict == "failed" and first.what == VERDICT, first.message
        assert "did not finish within --compile-timeout=0.001s; abandoned" in first.message, first.message
        assert "the worker process it ran in was ended, its memory freed" in first.message, first.message
        assert ended is not None and ended.proc.poll() is not None, "the worker outlived its compile"
        again = run_check("tpu_memory", case, session)
        assert again.what == VERDICT and "not compiled again" in again.message, again.message
        assert session.worker is not ended and session.worker.proc.poll() is None  # nothing abandoned there
        assert not session.abandoned_calls(), "no compile thread is left in this process"
    finally:
        session.close()


SLOW_TRACE = """
import time

import conformance
from conformance import registry


@conformance.register("all_gather", name="gather_whose_trace_never_ends")
def gather(x, *, mesh, axis_name):
    time.sleep(600)  # at trace time: no compile is ever reached
    return registry.get("all_gather", "xla_all_gather").fn(x, mesh=mesh, axis_name=axis_name)
"""


def test_a_trace_past_the_check_bound_ends_the_worker_and_names_the_bound(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The trace before a compile has a bound too: the check's (``--check-timeout``)."""
    if not tpu_compiler.available():
        pytest.skip(f"no TPU compiler here: {tpu_compiler.unavailable_reason()}")
    (tmp_path / "slow_trace_kernels.py").write_text(SLOW_TRACE)
    monkeypatch.syspath_prepend(str(tmp_path))
    saved = {family: dict(impls) for family, impls in registry._REGISTRY.items()}
    session = Session(Settings(check_timeout_s=3))
    try:
        importlib.import_module("slow_trace_kernels")
        dims = tpu_memory.memory_dims("all_gather", "xla_all_gather")[0]
        mesh = parse_mesh("8-x-explicit")
        case = Case.make("all_gather", "gather_whose_trace_never_ends", mesh, dict(dims), "bfloat16")
        outcome = run_check("tpu_memory", case, session)
        assert outcome.verdict == "failed", outcome.message
        assert "gave no verdict within --check-timeout=3s (tracing or compiling)" in outcome.message
        assert "the worker process was stopped" in outcome.message, outcome.message
        assert "time.sleep(600)" in outcome.message, outcome.message  # where its threads were
        assert session.worker.proc.poll() is not None
    finally:
        session.close()
        registry._REGISTRY.clear()
        registry._REGISTRY.update(saved)
        sys.modules.pop("slow_trace_kernels", None)


KERNELS = f"""
import conformance
from conformance import registry


@conformance.register("allgather_matmul", name="{IMPL}")
def ring(lhs, rhs, *, mesh, axis_name):
    return registry.get("allgather_matmul", "ring_allgather_matmul_unidirectional").fn(
        lhs, rhs, mesh=mesh, axis_name=axis_name
    )
"""


@pytest.mark.integration
def test_the_run_goes_on_and_ends_with_pytests_exit_status(tmp_path: Path) -> None:
    if not tpu_compiler.available():
        pytest.skip(f"no TPU compiler here: {tpu_compiler.unavailable_reason()}")
    (tmp_path / "slow_compile_kernels.py").write_text(KERNELS)
    env = subprocess_env()
    env["PYTHONPATH"] = str(tmp_path)
    done = subprocess.run(
        [
            *suite_command(),
            *("--kernels=slow_compile_kernels", f"--impl={IMPL}", "--compile-timeout=0.001"),
            # in the pytest process (a compile tier's check runs in the worker process, which ends
            # with the compile it gave up on): the run goes on beside the abandoned compile
            *("--isolation=off", "--meshes=4-x-auto", "-k", "(test_tpu_bytes and bfloat16) or test_values"),
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 1, output[-4000:]
    assert VERDICT in done.stdout and " passed" in done.stdout, output[-4000:]  # the values tests ran on
    assert "ends with exit status 1 without waiting for" in done.stderr, output[-4000:]
