"""Checks of Pallas kernels on CPU run in a worker process, so that no hang outlives its bound.

TPU interpret mode runs a Pallas kernel as Python callbacks on XLA's CPU threads.
The watchdog in :mod:`conformance.runner` stops a kernel whose wait nothing
signals: it sets interpret mode's failure flag and every simulated device
unwinds. It cannot stop a thread stuck below Python. On a 2-core host with 8
simulated devices, JAX 0.10.2's interpreter deadlocks in ``_allocate_buffer``
(``np.array`` of a buffer, waiting on XLA's CPU thread pool, which the blocked
callbacks hold) for a copy kernel with 128 KiB per device; nothing in the process
can end that wait, only ending the process can.

So each check of a Pallas kernel on CPU is sent to a worker process (started once,
kept warm with its compile caches) and the verdict comes back. The bounds:

* one kernel execution: ``--hang-timeout`` seconds (default 20), then the watchdog
  aborts it; a kernel that has not unwound ``runner.ABORT_GRACE_S`` (10 s) later
  makes the worker report the frames the threads are stuck in, and exit;
* one check, compiles included: ``--check-timeout`` seconds (default 300); past
  it the worker is stopped (its threads' stacks are dumped first).

Either way the test fails with a verdict that names the kernel and the case, later
checks of that kernel fail at once ("not run again"), and the next kernel gets a
fresh worker. A worker that crashes is a failure naming the case, too.

The protocol is one JSON object per line over the worker's stdin and stdout (never
pickle). Records the checks keep for the run's report (bytes, accuracy) come back
with the verdict. Isolation is off inside the worker itself and with ``--isolation=off``. In a
multi-process JAX job the worker stands alone (it does not join the job): rank 0's worker runs
the check on its own simulated devices, a process-local mesh, and the other ranks take its
verdict (:func:`conformance.family_tests.run`).
"""

from __future__ import annotations

import argparse
import dataclasses
import faulthandler
import importlib
import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any, TextIO

from conformance import checks, compat, registry, runner
from conformance.runner import Case

#: "process": Pallas kernels on CPU are checked in the worker; "off": in this process.
MODE: str = "process"
#: Seconds one check (compiles and runs) may take in the worker before it is stopped.
CHECK_TIMEOUT_S: float = 300.0
#: Seconds the worker may take to start (import JAX and the kernel modules).
START_TIMEOUT_S: float = 120.0
#: Lines of the worker's stderr quoted when it dies or is stopped.
STDERR_TAIL = 25

#: (family, implementation) -> (verdict, case token) of a hang the worker could not survive.
HUNG: dict[tuple[str, str], tuple[str, str]] = {}

#: The lists of records the checks fill for the run's report, and their types.
RECORDS: dict[str, type] = {
    "BYTE_RECORDS": checks.ByteRecord,
    "BACKWARD_BYTE_RECORDS": checks.ByteRecord,
    "LOWERED_BYTE_RECORDS": checks.ByteRecord,
    "ACCURACY_RECORDS": checks.AccuracyRecord,
    "BACKWARD_ACCURACY_RECORDS": checks.AccuracyRecord,
    "TPU_LAYOUT_RECORDS": checks.TpuLayoutRecord,
}


def _check_name(check: Callable[[Case], object]) -> str:
    for name, fn in checks.CHECKS.items():
        if fn is check:
            return name
    raise ValueError(f"{check!r} is not one of conformance.checks.CHECKS")


def _multi_process_job() -> bool:
    import jax

    return jax.process_count() > 1


def applies(case: Case) -> bool:
    """Whether ``case`` is checked in the worker: a Pallas kernel in interpret mode on CPU."""
    return MODE == "process" and case.platform == "cpu" and case.implementation.pallas


def call(check: Callable[[Case], object], case: Case) -> None:
    """Run ``check`` on ``case``: in the worker where :func:`applies`, else here.

    Raises what the check raises (:class:`checks.ConformanceFailure`,
    :class:`compat.HostLimit`), rebuilt from the worker's answer.
    """
    if not applies(case):
        check(case)
        return
    if _multi_process_job() and MODE != "process":
        raise compat.HostCannotRun(f"{case.impl}: a Pallas interpret check in a multi-process job runs only "
                                   "in the worker (process-local); --isolation=off cannot")  # fmt: skip
    worker = Worker.shared()
    if case.impl not in worker.registered.get(case.family, ()):
        check(case)  # its module cannot be imported by name (e.g. defined in a test file)
        return
    worker.check(_check_name(check), case)


def _tuples(value: Any) -> Any:
    return tuple(_tuples(v) for v in value) if isinstance(value, list) else value


class Worker:
    """The parent's handle on one worker process."""

    _shared: Worker | None = None

    @classmethod
    def shared(cls) -> Worker:
        """The running worker, or a fresh one (after a hang or crash, or at first use)."""
        if cls._shared is None or cls._shared.proc.poll() is not None:
            cls._shared = cls()
        return cls._shared

    @classmethod
    def stop_shared(cls) -> None:
        if cls._shared is not None:
            cls._shared.close()
            cls._shared = None

    def __init__(self) -> None:
        from conformance import specs

        modules = sorted({i.module for f in specs.FAMILIES for i in registry.registered(f)})
        paths = [os.path.abspath(p or os.curdir) for p in sys.path]
        # Standalone, also in a rank of a job: it must not join the job (its meshes are its own).
        job = {"JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID", "JAX_LOCAL_DEVICE_IDS"}
        env = {k: v for k, v in os.environ.items() if k not in job and not k.startswith("CONFORMANCE_")}
        env.update(PYTHONPATH=os.pathsep.join(paths), JAX_PLATFORMS="cpu")
        self.stderr = tempfile.TemporaryFile(mode="w+", prefix="conformance-worker-")  # noqa: SIM115 (outlives this call)
        argv = [sys.executable, "-m", "conformance.isolation",
                f"--hang-timeout={runner.HANG_TIMEOUT_S}", f"--abort-grace={runner.ABORT_GRACE_S}",
                f"--kernels={','.join(modules)}"]  # fmt: skip
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.stderr, text=True, env=env)  # fmt: skip
        self.lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        ready = self._answer(START_TIMEOUT_S)
        if ready is None or "registered" not in ready:
            tail = self.stderr_tail()
            self.close()
            raise RuntimeError(f"the conformance worker process did not start:\n{tail}")
        self.registered: dict[str, list[str]] = ready["registered"]

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)  # end of stream: the worker exited

    def _answer(self, timeout: float) -> dict[str, Any] | None:
        """The worker's next message; ``None`` if it exited or timed out (then it is stopped)."""
        try:
            line = self.lines.get(timeout=timeout)
        except queue.Empty:
            self.stop(dump_stacks=True)
            return None
        if line is None:
            self.proc.wait()
            return None
        return json.loads(line)

    def where_stuck(self) -> list[str]:
        """Each thread's innermost frame of kernel code (else of JAX) in the stack dump the
        worker wrote when it was stopped; first in the message, as a deep stack's tail may not
        reach the kernel's frames."""
        self.stderr.seek(0)
        _, places = checks.stuck_locations(checks.stacks_from_dump(self.stderr.read()))
        return ["where its threads were:", *places] if places else []

    def stderr_tail(self) -> str:
        self.stderr.seek(0)
        lines = [line.rstrip() for line in self.stderr.read().splitlines() if line.strip()]
        return "\n".join(lines[-STDERR_TAIL:])

    def stop(self, *, dump_stacks: bool) -> None:
        if self.proc.poll() is None and dump_stacks and hasattr(signal, "SIGUSR1"):
            self.proc.send_signal(signal.SIGUSR1)  # faulthandler: every thread's stack to stderr
            time.sleep(1.0)
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.stop(dump_stacks=False)
        self.stderr.close()

    def check(self, name: str, case: Case) -> None:
        key = (case.family, case.impl)
        if key in HUNG:  # the worker that saw it is gone; so is its memory of the hang
            what, where = HUNG[key]
            raise checks.fail(case, name, what, [f"not run again: it hung on {where} earlier in this run"])
        request = {"check": name, "family": case.family, "impl": case.impl, "token": case.token,
                   "platform": case.platform}  # fmt: skip
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        started = time.monotonic()
        answer = self._answer(CHECK_TIMEOUT_S)
        if answer is None:
            timed_out = time.monotonic() - started >= CHECK_TIMEOUT_S
            code = self.proc.returncode
            what = (
                f"gave no verdict within --check-timeout={CHECK_TIMEOUT_S:g}s (compiling or running); "
                "the worker process was stopped"
                if timed_out
                else f"the worker process died (exit status {code}) while running this check"
            )
            runner.HUNG[key] = f"{case.impl} {what} on {case.token}"
            tail = ["worker stderr (last lines):", *self.stderr_tail().splitlines()]
            raise checks.fail(case, name, what, [*self.where_stuck(), *tail])
        for list_name, records in answer.get("records", {}).items():
            kind = RECORDS[list_name]
            getattr(checks, list_name).extend(kind(**{k: _tuples(v) for k, v in r.items()}) for r in records)
        outcome = answer["outcome"]
        if outcome == "passed":
            return
        if outcome == "not_judged":
            raise checks.NotJudged(answer["message"])
        if outcome == "skipped":
            if answer.get("hung"):
                self.proc.wait()  # it ended itself; the next check starts a fresh worker
            raise compat.HostLimit(answer["message"])
        if outcome == "failed":
            failure = checks.ConformanceFailure(answer["message"])
            if answer.get("token"):
                failure.case = Case.from_token(answer["family"], answer["impl"], answer["token"],
                                               platform=case.platform)  # fmt: skip
                failure.check, failure.what = answer["check"], answer["what"]
            if answer.get("hung"):
                HUNG[key] = (answer["what"], case.token)
                self.proc.wait()
            raise failure
        raise RuntimeError(f"the conformance worker raised while running {name} on {case.token}:\n"
                           f"{answer['message']}")  # fmt: skip


# -- the worker process -------------------------------------------------------------------------------


def _send(out: TextIO, message: dict[str, Any]) -> None:
    out.write(json.dumps(message) + "\n")
    out.flush()


def _failure_message(failure: checks.ConformanceFailure) -> dict[str, Any]:
    message: dict[str, Any] = {"outcome": "failed", "message": str(failure)}
    if failure.case is not None:
        c = failure.case
        message.update(family=c.family, impl=c.impl, token=c.token, check=failure.check, what=failure.what)
    return message


def _serve(out: TextIO) -> None:
    current: dict[str, str] = {}

    def unstoppable(case: Case, stacks: list) -> None:
        in_kernel, places = checks.stuck_locations(stacks)
        late = f"aborted after {runner.HANG_TIMEOUT_S:g}s, still running {runner.ABORT_GRACE_S:g}s later"
        if in_kernel:
            what = f"hung in TPU interpret mode beyond the watchdog's reach, in the kernel's own code: {late}"
            details = ["the worker process running it was ended; its threads were stuck at", *places]
            failure = checks.fail(case, current.get("check", "?"), what, details)
            _send(out, {**_failure_message(failure), "hung": True, "records": {}})
        else:  # every stuck thread is inside JAX: its interpreter deadlocked, the kernel is not judged
            reason = (f"TPU interpret mode deadlocked inside JAX on {case.token} ({late}), in no frame "
                      f"of the kernel's code: {'; '.join(p.split(': ', 1)[1] for p in places)}. This JAX "
                      f"on this host ({os.cpu_count()} cores, {case.mesh.num_devices} simulated devices) "
                      "cannot run the case; a TPU, more cores or a newer JAX can")  # fmt: skip
            _send(out, {"outcome": "skipped", "message": reason, "hung": True, "records": {}})
        os._exit(3)

    runner.on_unstoppable = unstoppable
    for line in sys.stdin:
        request = json.loads(line)
        current["check"] = request["check"]
        before = {name: len(getattr(checks, name)) for name in RECORDS}
        answer: dict[str, Any]
        try:
            case = Case.from_token(request["family"], request["impl"], request["token"],
                                   platform=request["platform"])  # fmt: skip
            checks.CHECKS[request["check"]](case)
            answer = {"outcome": "passed"}
        except checks.ConformanceFailure as failure:
            answer = _failure_message(failure)
        except compat.HostLimit as limit:
            answer = {"outcome": "skipped", "message": str(limit)}
        except checks.NotJudged as why:
            answer = {"outcome": "not_judged", "message": str(why)}
        except Exception as error:  # a fault of the suite, not a verdict: the parent raises it
            import traceback

            answer = {"outcome": "error", "message": "".join(traceback.format_exception(error))}
        answer["records"] = {
            name: [dataclasses.asdict(r) for r in getattr(checks, name)[before[name] :]] for name in RECORDS
        }
        _send(out, answer)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m conformance.isolation")
    parser.add_argument("--hang-timeout", type=float, required=True)
    parser.add_argument("--abort-grace", type=float, required=True)
    parser.add_argument("--kernels", default="")
    args = parser.parse_args(argv)
    # The protocol owns the real stdout; anything else printed goes to stderr.
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    if hasattr(signal, "SIGUSR1"):  # not on Windows
        faulthandler.register(signal.SIGUSR1, all_threads=True)
    from conformance.fixtures.devices import CPU_DEVICE_COUNT

    compat.configure_cpu_devices(CPU_DEVICE_COUNT)
    runner.HANG_TIMEOUT_S, runner.ABORT_GRACE_S = args.hang_timeout, args.abort_grace
    for module in ["conformance.kernels", *filter(None, args.kernels.split(","))]:
        try:
            importlib.import_module(module)
        except Exception as error:  # its kernels are checked in the parent instead
            print(f"conformance worker: cannot import {module}: {error}", file=sys.stderr)
    from conformance import specs

    _send(out, {"registered": {f: sorted(registry.implementations(f)) for f in specs.FAMILIES}})
    _serve(out)


if __name__ == "__main__":
    main()
