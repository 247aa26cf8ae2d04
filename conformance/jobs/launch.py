"""``python -m conformance launch``: run a command as N local processes of one JAX job.

    python -m conformance launch --processes 2 --devices-per-process 4 -- pytest conformance -m cpu

Each rank is the same command in a process of its own, with JAX's own distributed runtime:
the coordinator listens on 127.0.0.1 on a free port, collectives between CPU processes go
through gloo, and each process has ``K`` simulated CPU devices. The ranks learn their place
from the environment (``JAX_COORDINATOR_ADDRESS``, and :data:`PROCESS_ID`,
:data:`NUM_PROCESSES`, :data:`DEVICES_PER_PROCESS`); the suite's pytest plugin reads them and
calls ``jax.distributed.initialize`` exactly as ``pytest --distributed`` does under another
launcher (mpirun, srun, a TPU pod's ``--worker=all``), where JAX detects the cluster itself.

Rank 0's output is shown as it runs; every rank's full log is kept in a directory named at
the start. The job's exit status is 0 only if every rank exits 0; otherwise it is the status of the
first rank to fail (pytest's: 1 for failed tests, 4 for a usage error), or 1 where a signal ended
that rank. When a rank fails, dies or
the job outlives ``--timeout``, the others are stopped (their whole process groups: nothing
is left behind), and the launcher prints which rank, the test it was in (each rank's plugin
writes its current test to the log directory) and the tail of that rank's log.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from conformance import command_line

#: Environment the launcher gives each rank (read by :mod:`conformance.jobs.distributed`).
PROCESS_ID = "CONFORMANCE_PROCESS_ID"
NUM_PROCESSES = "CONFORMANCE_NUM_PROCESSES"
DEVICES_PER_PROCESS = "CONFORMANCE_DEVICES_PER_PROCESS"
#: Where each rank writes the test it is in (``rank-<i>.test``), for the launcher's messages.
LOG_DIR = "CONFORMANCE_LAUNCH_DIR"
#: Seconds a stopped rank gets after SIGTERM before SIGKILL.
GRACE_S = 5.0
#: Lines of a failed rank's log printed.
TAIL_LINES = 40


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def current_test(log_dir: Path, rank: int) -> str:
    path = log_dir / f"rank-{rank}.test"
    try:
        text = path.read_text().strip()
    except OSError:
        return "(no test started)"
    return text or "(between tests)"


def _tail(path: Path, lines: int = TAIL_LINES) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    return "\n".join(text[-lines:])


def _stop(procs: list[subprocess.Popen]) -> None:
    """SIGTERM every rank's process group, then SIGKILL what is left after :data:`GRACE_S`."""
    for p in procs:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGTERM)
    deadline = time.monotonic() + GRACE_S
    for p in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
    for p in procs:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)  # the group: children such as the Pallas worker too
        p.wait()


class _Stopped(Exception):
    """The launcher itself was sent SIGTERM or SIGHUP (a CI timeout, a closed terminal)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _raise_stopped(signum: int, frame) -> None:
    raise _Stopped(signum)


def _die_with_launcher() -> None:
    """In a rank, before it runs: on Linux, be killed when the launcher dies, even by SIGKILL
    (``PR_SET_PDEATHSIG``), so no rank outlives a launcher nobody could clean up after."""
    if sys.platform.startswith("linux"):
        import ctypes

        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG = 1


def _status(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit status {code}"


def launch(
    command: list[str],
    *,
    processes: int,
    devices_per_process: int,
    timeout: float | None,
    log_dir: Path | None = None,
    out=sys.stdout,
) -> int:
    """Run ``command`` as ``processes`` ranks; return the job's exit status (see module docstring)."""
    if processes < 1 or devices_per_process < 1:
        raise command_line.UsageError("--processes and --devices-per-process must be at least 1")
    log_dir = Path(log_dir or tempfile.mkdtemp(prefix="conformance-launch-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    print(
        f"conformance launch: {processes} processes x {devices_per_process} CPU devices, coordinator "
        f"127.0.0.1:{port}; logs in {log_dir}",
        file=out,
        flush=True,
    )
    procs: list[subprocess.Popen] = []
    logs = []
    start = time.monotonic()
    previous = {}
    if threading.current_thread() is threading.main_thread():
        for signum in (signal.SIGTERM, signal.SIGHUP):
            previous[signum] = signal.signal(signum, _raise_stopped)
    try:
        for rank in range(processes):
            env = {
                **os.environ,
                "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}",
                PROCESS_ID: str(rank),
                NUM_PROCESSES: str(processes),
                DEVICES_PER_PROCESS: str(devices_per_process),
                LOG_DIR: str(log_dir),
                "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu"),
                "PYTHONUNBUFFERED": "1",
            }
            log = open(log_dir / f"rank-{rank}.log", "wb")  # noqa: SIM115 (closed below)
            logs.append(log)
            procs.append(
                subprocess.Popen(
                    command,
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    start_new_session=True,
                    preexec_fn=_die_with_launcher,
                )
            )
        shown = 0
        rank0 = log_dir / "rank-0.log"
        while True:
            shown = _follow(rank0, shown, out)
            codes = [p.poll() for p in procs]
            failed = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                rank, code = failed[0]
                test = current_test(log_dir, rank)
                _stop(procs)
                shown = _follow(rank0, shown, out)
                log = log_dir / f"rank-{rank}.log"
                took = time.monotonic() - start
                # rank 0's log was shown as it ran: its tail again would say everything twice
                tail = (
                    ""
                    if rank == 0
                    else f"\n--- last lines of rank {rank}'s log ({log}) ---\n{_tail(log)}\n--- end ---"
                )
                print(
                    f"\nconformance launch: rank {rank} of {processes} ended with {_status(code)} "
                    f"in {test} after {took:.1f} s; the other ranks were stopped.{tail}",
                    file=out,
                    flush=True,
                )
                return code if code > 0 else 1
            if all(c == 0 for c in codes):
                _follow(rank0, shown, out)
                took = time.monotonic() - start
                print(
                    f"conformance launch: all {processes} ranks exited 0 in {took:.1f} s",
                    file=out,
                    flush=True,
                )
                return 0
            if timeout is not None and time.monotonic() - start > timeout:
                running = [r for r, c in enumerate(codes) if c is None]
                where = "; ".join(f"rank {r} in {current_test(log_dir, r)}" for r in running)
                _stop(procs)
                _follow(rank0, shown, out)
                first = log_dir / f"rank-{running[0]}.log"
                print(
                    f"\nconformance launch: the job ran past --timeout {timeout:g} s and was stopped; "
                    f"still running: {where}.\n--- last lines of rank {running[0]}'s log ---\n"
                    f"{_tail(first)}\n--- end ---",
                    file=out,
                    flush=True,
                )
                return 124
            time.sleep(0.1)
    except KeyboardInterrupt:
        _stop(procs)
        print("\nconformance launch: interrupted; every rank stopped", file=out, flush=True)
        return 130
    except _Stopped as stopped:
        _stop(procs)
        print(f"\nconformance launch: got {stopped}; every rank stopped", file=out, flush=True)
        return 128 + stopped.signum
    finally:
        _stop(procs)
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        for log in logs:
            log.close()


def _follow(path: Path, offset: int, out) -> int:
    """Copy what ``path`` gained since ``offset`` to ``out``; the new offset."""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            data = f.read()
    except OSError:
        return offset
    if data:
        out.write(data.decode(errors="replace"))
        out.flush()
    return offset + len(data)


def main(argv: list[str]) -> int:
    parser = command_line.Parser(
        prog="python -m conformance launch",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--processes", type=int, required=True, metavar="N")
    parser.add_argument("--devices-per-process", type=int, default=1, metavar="K")
    parser.add_argument("--timeout", type=float, default=None, metavar="SECONDS")
    parser.add_argument("--log-dir", type=Path, default=None, metavar="DIR")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command: put it after --, e.g. -- pytest conformance -m cpu")
    try:
        return launch(
            command,
            processes=args.processes,
            devices_per_process=args.devices_per_process,
            timeout=args.timeout,
            log_dir=args.log_dir,
        )
    except command_line.UsageError as e:
        return command_line.report(e)
