"""No check runs without bound: hangs the watchdog cannot abort still end, with a verdict.

The kernels' verdicts inside the full suite run are in ``test_rejects_broken_kernels``;
here the replay command runs single cases in subprocesses, with short timeouts.
"""

from __future__ import annotations

import faulthandler
import re
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import jax
import pytest

from conformance import blame, runner
from conformance.selftest import STARTUP_ON_A_LOADED_HOST_S
from conformance.session import Settings

pytestmark = pytest.mark.selftest

ROOT = Path(__file__).resolve().parents[2]
HANG_S = 3
#: Interpreter start, JAX import, one compile, on a loaded host: generous, but far below "no bound".
OVERHEAD_S = STARTUP_ON_A_LOADED_HOST_S


def _replay(*args: str, timeout: float) -> tuple[subprocess.CompletedProcess, float]:
    cmd = [sys.executable, "-m", "conformance", "replay", *args, f"--hang-timeout={HANG_S}"]
    started = time.monotonic()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    return proc, time.monotonic() - started


def _frame(path: str, line: int, name: str) -> traceback.FrameSummary:
    return traceback.FrameSummary(path, line, name, line=None)


def test_stuck_threads_are_placed_in_the_kernel_or_in_jax() -> None:
    jax_file = str(Path(jax.__file__).parent / "_src" / "pallas" / "interpret.py")
    kernel_file = str(ROOT / "my_kernels" / "ring.py")
    in_jax = traceback.StackSummary.from_list([_frame(jax_file, 383, "_allocate_buffer")])
    in_kernel = traceback.StackSummary.from_list(
        [_frame(jax_file, 10, "_callback"), _frame(kernel_file, 7, "wait_forever")]
    )
    idle = traceback.StackSummary.from_list([_frame(runner.__file__, 1, "timer")])  # the suite's own
    assert blame.stuck_locations([in_jax, in_jax, idle]) == (
        False,
        ["inside JAX     : jax/_src/pallas/interpret.py:383 in _allocate_buffer  (2 threads)"],
    )
    found, places = blame.stuck_locations([in_jax, in_kernel])
    assert found and places[1] == "kernel's code  : my_kernels/ring.py:7 in wait_forever  (1 thread)", places


def _dumped_here() -> str:
    with tempfile.TemporaryFile("w+") as out:
        faulthandler.dump_traceback(out, all_threads=True)
        out.seek(0)
        return "worker started\n" + out.read() + "ResourceWarning: something after the dump\n"


def test_a_faulthandler_dump_is_read_back_into_stacks() -> None:
    """How a stopped worker says where it was: its threads' stacks, read from faulthandler's text."""
    stacks = blame.stacks_from_dump(_dumped_here())
    assert stacks and all(stacks), stacks
    innermost = [s[-1].name for s in stacks]
    assert "_dumped_here" in innermost, innermost  # this thread's innermost frame, outermost first
    here = next(s for s in stacks if s[-1].name == "_dumped_here")
    assert here[-2].name == "test_a_faulthandler_dump_is_read_back_into_stacks"
    assert here[-1].lineno and "dump_traceback" in here[-1].line


def test_a_stack_dump_in_an_unknown_form_raises_naming_the_line() -> None:
    text = 'Thread 0x00007f01 (most recent call first):\n  File "a.py", line 3 in f\n  frame: a.py:4 g\n'
    with pytest.raises(ValueError, match=re.escape("frame: a.py:4 g")):
        blame.stacks_from_dump(text)


def test_a_deadlock_inside_jax_is_a_bounded_skip_never_a_failure() -> None:
    """128 KiB per device on 8 devices: JAX 0.6.2 and 0.10.2 deadlock in ``_allocate_buffer`` on a
    2-core host (newer JAX and bigger hosts run it). Either way: an answer, in bounded time."""
    bound = HANG_S + Settings().abort_grace_s + OVERHEAD_S
    case = "8-x-explicit:rows_per_shard=256,cols=128:float32:seed=0:dma=on_wait"
    proc, took = _replay(
        "values", "all_gather", "pallas_ring_all_gather_unidirectional", case, timeout=bound * 3
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    if "SKIPPED values" in proc.stdout:
        assert "deadlocked inside JAX" in proc.stdout and "in no frame of the kernel's code" in proc.stdout
    else:
        assert "PASSED values" in proc.stdout, proc.stdout
    assert took < bound, f"{took:.0f}s: {proc.stdout[-2000:]}"


def test_without_isolation_an_unstoppable_hang_still_ends_the_process_with_a_verdict() -> None:
    bound = HANG_S + Settings().abort_grace_s + OVERHEAD_S
    proc, took = _replay(
        "output_sharding",
        "all_gather",
        "broken_pallas_blocks_beyond_the_watchdog",
        "2-x-explicit:rows_per_shard=3,cols=128:float32:seed=0:dma=on_wait",
        "--kernels",
        "conformance.selftest.broken_pallas_kernels",
        "--isolation",
        "off",
        timeout=bound * 3,
    )
    assert proc.returncode == 70, proc.stdout + proc.stderr
    assert "broken_pallas_blocks_beyond_the_watchdog (all_gather, 2-x-explicit:" in proc.stderr, proc.stderr
    assert "broken_pallas_kernels.py" in proc.stderr, proc.stderr  # where it hangs
    assert took < bound, f"{took:.0f}s"


def test_a_check_that_never_reaches_the_kernel_ends_at_the_check_timeout() -> None:
    """Blocked while tracing (no kernel runs, so no watchdog): the parent stops the worker."""
    check_timeout = 5
    proc, took = _replay(
        "output_sharding",
        "all_gather",
        "broken_pallas_blocks_while_tracing",
        "2-x-explicit:rows_per_shard=3,cols=128:float32:seed=0:dma=on_wait",
        "--kernels",
        "conformance.selftest.broken_pallas_kernels",
        f"--check-timeout={check_timeout}",
        timeout=(check_timeout + OVERHEAD_S) * 3,
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert f"gave no verdict within --check-timeout={check_timeout}s" in proc.stdout, proc.stdout
    # where it blocked comes first, however deep JAX's stack below it is (JAX 0.6.2's is deeper)
    where = r"kernel's code  : \S*broken_pallas_kernels.py:\d+ in _wait_forever"
    assert re.search(where, proc.stdout), proc.stdout
    assert took < check_timeout + OVERHEAD_S, f"{took:.0f}s"
