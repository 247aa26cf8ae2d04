"""Checks that a thread cannot bound run in a worker process, so that none outlives its bound: the
checks of Pallas kernels on CPU, and the compile tiers' checks.

TPU interpret mode runs a Pallas kernel as Python callbacks on XLA's CPU threads.
The watchdog in :mod:`conformance.runner` stops a kernel whose wait nothing
signals: it sets interpret mode's failure flag and every simulated device
unwinds. It cannot stop a thread stuck below Python. On a 2-core host with 8
simulated devices, JAX 0.10.2's interpreter deadlocks in ``_allocate_buffer``
(``np.array`` of a buffer, waiting on XLA's CPU thread pool, which the blocked
callbacks hold) for a copy kernel with 128 KiB per device; nothing in the process
can end that wait, only ending the process can. A compile for a TPU or GPU topology is the same:
a compile given up past ``--compile-timeout`` goes on in its thread (a 256-chip compile of a MoE
dispatch left that way grew to 13 GB and stalled the next test for 15 minutes), and so may the
trace before it, which nothing in the process can stop.

So each such check (:func:`applies`) is sent to a worker process (started once,
kept warm with its compile caches) and the verdict comes back. The bounds:

* one kernel execution: ``--hang-timeout`` seconds (default 20), then the watchdog
  aborts it; a kernel that has not unwound 10 s later (the session's ``abort_grace_s``)
  makes the worker report the frames the threads are stuck in, and exit;
* one compile for a TPU or GPU topology: ``--compile-timeout`` seconds (default 300); past it the
  check fails naming that bound and the worker exits once it has answered, its memory and the
  compile's thread with it, before the next check starts in a fresh worker (which does not try
  that program again);
* one check, traces and compiles included: ``--check-timeout`` seconds (default 300); past
  it the worker is stopped (its threads' stacks are dumped first).

Either way the test fails with a verdict that names the kernel, the case and the bound, later
checks of a kernel that hung are not judged (each would wait out the hang again), and the next
check gets a fresh worker. A worker that crashes is a failure naming the case, too.

The protocol is one JSON object per line over the worker's stdin and stdout (never
pickle). The run's settings go to the worker as JSON (:func:`settings_to_json`); records the checks
keep for the run's report (bytes, accuracy, memory, schedules) come back with the verdict. Isolation
is off inside the worker itself and with ``--isolation=off``. In a
multi-process JAX job the worker stands alone (it does not join the job): rank 0's worker runs
the check on its own simulated devices, a process-local mesh, and the other ranks take its
verdict (:func:`conformance.run.run_check`).
"""

from __future__ import annotations

import argparse
import contextlib
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
from typing import Any, TextIO

from conformance import blame, checks, compat, kernel_paths, registry
from conformance import session as session_lib
from conformance.checks.base import Check
from conformance.run import interpret_outcomes, outcomes
from conformance.run.outcomes import CheckOutcome
from conformance.runner import Case
from conformance.targets import target_compiles

#: Seconds the worker may take to start (import JAX and the kernel modules).
START_TIMEOUT_S: float = 120.0
#: Lines of the worker's stderr quoted when it dies or is stopped.
STDERR_TAIL = 25


def applies(case: Case, settings: session_lib.Settings, check: Check | None = None) -> bool:
    """Whether ``check`` of ``case`` runs in the worker: any check of a Pallas kernel in interpret mode
    on CPU, and a compile tier's check (:attr:`~conformance.checks.base.Check.compile_tier`) of any
    kernel, under ``--isolation=process``."""
    if settings.isolation != "process":
        return False
    if case.platform == "cpu" and case.implementation.pallas:
        return True
    return check is not None and check.compile_tier is not None


def settings_to_json(settings: session_lib.Settings) -> str:
    """The run's settings as the worker takes them (``--settings``): plain JSON."""
    return json.dumps(dataclasses.asdict(settings))


def settings_from_json(text: str) -> session_lib.Settings:
    fields = json.loads(text)
    fields["compiler_options"] = tuple(tuple(pair) for pair in fields.get("compiler_options", ()))
    return session_lib.Settings(**fields)


def run_in_worker(check: Check, case: Case, session: session_lib.Session) -> CheckOutcome:
    """Run ``check`` on ``case`` in the session's worker process (started, or restarted after a hang
    or crash, as needed); here if the worker cannot import the kernel's module by name."""
    if session.worker is None or session.worker.proc.poll() is not None:
        if session.worker is not None:  # it ended itself (a hang, a compile past its bound) or died
            session.worker.close()
        session.worker = Worker(
            session.settings,
            outcome_dir=session.interpret_outcome_dir,
            target_compile_dir=session.target_compile_dir,
        )
    worker = session.worker
    if case.impl not in worker.registered.get(case.family, ()):
        return outcomes.run_here(check, case, session)  # e.g. a kernel defined in a test file
    return worker.check(check.name, case, session)


class Worker:
    """The parent's handle on one worker process."""

    def __init__(
        self,
        settings: session_lib.Settings,
        *,
        outcome_dir: str | None = None,
        target_compile_dir: str | None = None,
    ) -> None:
        from conformance import specs
        from conformance.targets import gpu_compiler

        # a module imported from a path (--kernels=./my_rings.py) goes to the worker as that path
        modules = sorted(
            {kernel_paths.kernels_argument(i.module) for f in specs.FAMILIES for i in registry.registered(f)}
        )
        paths = [os.path.abspath(p or os.curdir) for p in sys.path]
        # Standalone, also in a rank of a job: it must not join the job (its meshes are its own).
        job = {"JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID", "JAX_LOCAL_DEVICE_IDS"}
        # The run's own variables stay the parent's, but the GPU topology the parent mocks (route 2).
        kept = {gpu_compiler.MOCK_VARIABLE}
        env = {
            k: v
            for k, v in os.environ.items()
            if k not in job and (k in kept or not k.startswith("CONFORMANCE_"))
        }
        env.update(PYTHONPATH=os.pathsep.join(paths), JAX_PLATFORMS="cpu")
        self.stderr = tempfile.TemporaryFile(mode="w+", prefix="conformance-worker-")  # noqa: SIM115 (outlives this call)
        argv = [
            sys.executable,
            "-c",
            WORKER_MAIN,
            f"--settings={settings_to_json(settings)}",
            f"--kernels={','.join(modules)}",
            *([f"--outcome-dir={outcome_dir}"] if outcome_dir else []),
            *([f"--target-compile-dir={target_compile_dir}"] if target_compile_dir else []),
        ]
        self.proc = subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.stderr, text=True, env=env
        )
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()
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
        _, places = blame.stuck_locations(blame.stacks_from_dump(self.stderr.read()))
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
        self.reader.join(timeout=5)  # it reads to the end of the stream the exited worker closed
        if not self.reader.is_alive():
            self.proc.stdout.close()
        if not self.proc.stdin.closed:
            with contextlib.suppress(BrokenPipeError):  # a request written that the ended worker never read
                self.proc.stdin.close()
        self.stderr.close()

    def check(self, name: str, case: Case, session: session_lib.Session) -> CheckOutcome:
        key = (case.family, case.impl)
        if key in session.hung:  # the worker that saw it is gone; so is its memory of the hang
            hang = session.hung[key]
            if hang.same_test(
                session.current_test(), case.token
            ):  # hypothesis shrinking the example that hung
                failure = checks.fail(
                    case, name, hang.what, [f"not run again: it hung on {hang.where} in this test"]
                )
                return CheckOutcome(name, case, "failed", str(failure), failure.what, failure)
            return CheckOutcome(name, case, "not_judged", not_run_again(case, name, hang))
        request = {
            "check": name,
            "family": case.family,
            "impl": case.impl,
            "token": case.token,
            "platform": case.platform,
            # the compiles this run gave up on (in an earlier worker): not tried again
            "abandoned": abandoned_compiles(session),
        }
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        started, timeout_s = time.monotonic(), session.settings.check_timeout_s
        answer = self._answer(timeout_s)
        if answer is None:
            timed_out = time.monotonic() - started >= timeout_s
            code = self.proc.returncode
            doing = "tracing or compiling" if outcomes.resolve(name).compile_tier else "compiling or running"
            what = (
                f"gave no verdict within --check-timeout={timeout_s:g}s ({doing}); "
                "the worker process was stopped"
                if timed_out
                else f"the worker process died (exit status {code}) while running this check"
            )
            session.hung[key] = session_lib.Hang(what, case.token, test=session.current_test())
            tail = ["worker stderr (last lines):", *self.stderr_tail().splitlines()]
            failure = checks.fail(case, name, what, [*self.where_stuck(), *tail])
            return CheckOutcome(name, case, "failed", str(failure), failure.what, failure)
        records = [outcomes.record_from_json(r) for r in answer.get("records", ())]
        verdict, message = answer["outcome"], answer.get("message", "")
        for given_up in answer.get("abandoned", ()):
            session.target_compiles[given_up["key"]] = target_compiles.CompileTimeout(
                given_up["seconds"], given_up["compiler"]
            )
        if answer.get("hung") or answer.get("abandoned"):
            self.proc.wait()  # it ended itself; the next check starts a fresh worker
        kept, emulated = bool(answer.get("read_back")), answer.get("emulated", "")
        if verdict in ("passed", "skipped", "not_judged"):
            return CheckOutcome(
                name, case, verdict, message, records=records, read_back=kept, emulated=emulated
            )
        if verdict == "failed":
            failure = checks.ConformanceFailure(message)
            if answer.get("token"):
                failure.case = Case.from_token(
                    answer["family"], answer["impl"], answer["token"], platform=case.platform
                )
                failure.check, failure.what = answer["check"], answer["what"]
                failure.why = answer.get("why")
            if answer.get("hung"):
                session.hung[key] = session_lib.Hang(answer["what"], case.token, test=session.current_test())
            return CheckOutcome(name, case, "failed", message, failure.what, failure, records, kept, emulated)
        raise RuntimeError(f"the conformance worker raised while running {name} on {case.token}:\n{message}")


def abandoned_compiles(session: session_lib.Session) -> list[dict[str, Any]]:
    """The compiles ``session`` gave up on past ``--compile-timeout``, as the worker takes them."""
    return [
        {"key": key, "seconds": kept.seconds, "compiler": kept.compiler}
        for key, kept in session.target_compiles.items()
        if isinstance(kept, target_compiles.CompileTimeout)
    ]


def not_run_again(case: Case, check: str, hang: session_lib.Hang) -> str:
    """Why a check of a kernel that hung earlier in the run is not judged: each later run would hang
    again for ``--hang-timeout``; the hang is the kernel's failure, and one check replays alone."""
    return (
        f"{case.impl} hung on {hang.where} earlier in this run ({hang.what}); its later "
        "checks do not run, each would wait out the hang again. "
        f"To judge this one: {case.replay_command(check)}"
    )


# -- the worker process -------------------------------------------------------------------------------


def _send(out: TextIO, message: dict[str, Any]) -> None:
    out.write(json.dumps(message) + "\n")
    out.flush()


def _failure_message(failure: checks.ConformanceFailure) -> dict[str, Any]:
    message: dict[str, Any] = {"outcome": "failed", "message": str(failure)}
    if failure.case is not None:
        c = failure.case
        message.update(
            family=c.family,
            impl=c.impl,
            token=c.token,
            check=failure.check,
            what=failure.what,
            why=failure.why,
        )
    return message


def _serve(
    out: TextIO,
    settings: session_lib.Settings,
    store: interpret_outcomes.Store | None,
    *,
    target_compile_dir: str | None = None,
) -> None:
    current: dict[str, str] = {}

    def unstoppable(case: Case, stacks: list) -> None:
        in_kernel, places = blame.stuck_locations(stacks)
        late = f"aborted after {settings.hang_timeout_s:g}s, still running {settings.abort_grace_s:g}s later"
        if in_kernel:
            what = f"hung in TPU interpret mode beyond the watchdog's reach, in the kernel's own code: {late}"
            details = ["the worker process running it was ended; its threads were stuck at", *places]
            failure = checks.fail(case, current.get("check", "?"), what, details)
            _send(out, {**_failure_message(failure), "hung": True, "records": []})
        else:  # every stuck thread is inside JAX: its interpreter deadlocked, the kernel is not judged
            reason = (
                f"TPU interpret mode deadlocked inside JAX on {case.token} ({late}), in no frame "
                f"of the kernel's code: {'; '.join(p.split(': ', 1)[1] for p in places)}. This JAX "
                f"on this host ({os.cpu_count()} cores, {case.mesh.num_devices} simulated devices) "
                "cannot run the case; a TPU, more cores or a newer JAX can"
            )
            _send(out, {"outcome": "skipped", "message": reason, "hung": True, "records": []})
        os._exit(3)

    # In the worker, checks run here (isolation off), under the watchdog with the parent's bounds.
    session = session_lib.Session(dataclasses.replace(settings, isolation="off"), on_unstoppable=unstoppable)
    session.target_compile_dir = target_compile_dir
    for line in sys.stdin:
        request = json.loads(line)
        current["check"] = request["check"]
        for given_up in request.get("abandoned", ()):
            session.target_compiles.setdefault(
                given_up["key"], target_compiles.CompileTimeout(given_up["seconds"], given_up["compiler"])
            )
        answer: dict[str, Any]
        try:
            case = Case.from_token(
                request["family"], request["impl"], request["token"], platform=request["platform"]
            )
            check = outcomes.resolve(request["check"])
            outcomes.hold(case, session)
            key = interpret_outcomes.key_of(check.name, case, settings) if store is not None else None
            kept = store.read(key) if store is not None and key is not None else None
            if kept is not None:  # an earlier run of this very program said it
                _send(out, {**kept, "read_back": True})
                continue
            outcome = outcomes.run_here(check, case, session)
        except Exception as error:  # a fault of the suite, not a verdict: the parent raises it
            import traceback

            _send(
                out,
                {"outcome": "error", "message": "".join(traceback.format_exception(error)), "records": []},
            )
            continue
        if outcome.failure is not None:
            answer = _failure_message(outcome.failure)
        else:
            answer = {"outcome": outcome.verdict, "message": outcome.message}
        answer["records"] = [outcomes.record_to_json(r) for r in outcome.records]
        answer["emulated"] = outcome.emulated
        if store is not None and key is not None and not session.abandoned_compiles:
            store.write(key, answer)  # (a verdict of a bound passed is this run's, not the program's)
        if session.abandoned_compiles:
            # A compile given up past its bound still runs in its thread: this process ends once it has
            # answered, and that compile's memory with it; the parent starts a fresh worker.
            answer["abandoned"] = abandoned_compiles(session)
            answer["message"] = (answer.get("message") or "") + (
                "\n  (the worker process it ran in was ended, its memory freed, before the next check)"
            )
            _send(out, answer)
            out.flush()
            sys.stderr.flush()
            os._exit(4)
        _send(out, answer)


#: What the worker process runs: :func:`main` of this module, imported as itself (``python -m`` of a
#: module of a package whose ``__init__`` imports it would run a second copy of it).
WORKER_MAIN = "import sys; from conformance.run.check_worker import main; main(sys.argv[1:])"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="conformance's Pallas worker")
    parser.add_argument("--settings", required=True, help="the run's settings, as JSON")
    parser.add_argument("--kernels", default="")
    parser.add_argument("--outcome-dir", default="", help="where verdicts of interpreted programs are kept")
    parser.add_argument("--target-compile-dir", default="", help="where compiles for topologies are kept")
    args = parser.parse_args(argv)
    # The protocol owns the real stdout; anything else printed goes to stderr.
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    if hasattr(signal, "SIGUSR1"):  # not on Windows
        faulthandler.register(signal.SIGUSR1, all_threads=True)
    from conformance.fixtures.devices import CPU_DEVICE_COUNT

    compat.configure_cpu_devices(CPU_DEVICE_COUNT)
    from conformance.targets import gpu_compiler

    gpu_compiler.configure_from_environment()  # the parent's mocked GPU topology, before any backend
    from conformance.targets import cpu_ragged_all_to_all

    cpu_ragged_all_to_all.install()  # as in the parent: the op emulated where XLA:CPU lacks it
    for module in ["conformance.kernels", *filter(None, args.kernels.split(","))]:
        try:
            (kernel_paths.import_path if kernel_paths.is_path(module) else importlib.import_module)(module)
        except Exception as error:  # its kernels are checked in the parent instead
            print(f"conformance worker: cannot import {module}: {error}", file=sys.stderr)
    from conformance import specs

    _send(out, {"registered": {f: sorted(registry.implementations(f)) for f in specs.FAMILIES}})
    store = interpret_outcomes.Store(args.outcome_dir) if args.outcome_dir else None
    _serve(out, settings_from_json(args.settings), store, target_compile_dir=args.target_compile_dir or None)
    # The parent closed the protocol and nothing here outlives it (compiles are in the persistent cache
    # as they are made): leave without Python's and JAX's teardown of every executable, array and
    # cache the run built, which at the end of `tox -e cpu` held the parent waiting 1.2 s of CPU.
    out.flush()
    sys.stderr.flush()
    os._exit(0)
