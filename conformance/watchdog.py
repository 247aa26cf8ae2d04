"""The two bounds on a kernel that never returns, both remembered on the run's session.

* :func:`run_guarded`: a Pallas kernel in TPU interpret mode on CPU runs under a timer that aborts
  it at the session's ``hang_timeout_s`` (interpret mode's failure flag: every simulated device
  unwinds), and ends the process if it has not unwound ``abort_grace_s`` later.
* :func:`call_bounded`: any other call (a send_recv transfer whose peer never comes blocks in
  NCCL or in the key-value store, where no flag reaches) runs on the session's caller thread and
  is abandoned after its limit; the thread stays blocked, a daemon that does not hold the exit.

Either way the kernel's key goes into :attr:`conformance.session.Session.hung`: its later checks in
this run are not judged instead of hanging again.
"""

from __future__ import annotations

import os
import sys
import threading
import traceback
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax

from conformance import compat, interpreter_callbacks
from conformance import session as session_lib
from conformance.blame import stuck_locations

if TYPE_CHECKING:  # for annotations only: runner imports this module
    from conformance.runner import Case


class KernelHang(RuntimeError):
    """A Pallas kernel did not finish in interpret mode within the session's hang timeout."""


class NotRunAgain(KernelHang):
    """A Pallas kernel that hung earlier this run, not run again (its check is not judged)."""


def stuck_stacks() -> list[traceback.StackSummary]:
    """The Python stack of every thread but this one; of the main one, which called the kernel, what
    runs inside that call (:func:`inside_the_call`)."""
    main = threading.main_thread().ident
    stacks = []
    for ident, frame in sys._current_frames().items():
        if ident == threading.get_ident():
            continue
        stack = traceback.extract_stack(frame)
        if ident == main:
            stack = inside_the_call(stack)
        if stack:
            stacks.append(stack)
    return stacks


def inside_the_call(stack: traceback.StackSummary) -> traceback.StackSummary:
    """The frames ``stack`` runs inside :func:`run_guarded`'s call of the kernel, from the first of
    JAX's inward: a program of one device runs on the calling thread (XLA:CPU executes it inline),
    so a host callback of the kernel blocks there, in JAX's callback machinery; the kernel's own
    Python around the call (an eager call's wrapper) is not where it is stuck."""
    from conformance.blame import is_library_frame

    frames = list(stack)
    guarded = [i for i, f in enumerate(frames) if f.name == "run_guarded" and f.filename == __file__]
    inner = frames[guarded[-1] + 1 :] if guarded else []
    first_library = next((i for i, f in enumerate(inner) if is_library_frame(f)), None)
    return traceback.StackSummary.from_list(inner[first_library:] if first_library is not None else [])


def end_process(case: Case, stacks: list[traceback.StackSummary]) -> None:
    """What a session without its own ``on_unstoppable`` does: say what hung and where, then end this
    process.

    Checks of Pallas kernels on CPU run in a worker process (:mod:`conformance.run.check_worker`),
    which reports instead; with isolation off this ends the run, which beats no bound.
    """
    lines = [
        f"{case.impl} ({case.family}, {case.token}) hung in TPU interpret mode and did not stop "
        "when the watchdog aborted it; ending the process. Its threads are stuck at"
    ]
    lines += ["  " + place for place in stuck_locations(stacks)[1]]
    os.write(2, ("\n".join(lines) + "\n").encode())
    os._exit(70)


def run_guarded(case: Case, fn: Any, args: tuple[jax.Array, ...]) -> jax.Array:
    """Call ``fn``; for a Pallas kernel on CPU, under a watchdog that stops a hung kernel.

    At the active session's ``hang_timeout_s`` the watchdog aborts the kernel (interpret mode's
    failure flag; every device unwinds). A kernel still running ``abort_grace_s`` later is beyond
    any abort: the session's ``on_unstoppable`` (default :func:`end_process`) ends the process,
    naming where it hangs.
    """
    if not (case.implementation.pallas and case.platform == "cpu"):
        return fn(*args)
    run = session_lib.current()
    hang_timeout_s, key = run.settings.hang_timeout_s, (case.family, case.impl)
    on_unstoppable = run.on_unstoppable or end_process
    if key in run.hung:
        if run.hung[key].same_test(
            run.current_test(), case.token
        ):  # hypothesis shrinking the example that hung
            raise KernelHang(run.hung[key].what)
        raise NotRunAgain(run.hung[key].what)
    # Isolation: a DMA an earlier kernel left in flight must not land in this run.
    compat.reset_interpret_state()
    fired, done = threading.Event(), threading.Event()

    def unstoppable() -> None:
        if not done.is_set():
            on_unstoppable(case, stuck_stacks())

    grace = threading.Timer(run.settings.abort_grace_s, unstoppable)
    grace.daemon = True

    def stop() -> None:
        fired.set()
        grace.start()
        compat.abort_interpreted_kernel(f"{case.impl} exceeded {hang_timeout_s:g}s (watchdog)")

    timer = threading.Timer(hang_timeout_s, stop)
    timer.daemon = True
    timer.start()
    try:
        with interpreter_callbacks.on_host() as raised_at:
            out = fn(*args)
            jax.block_until_ready(out)
    except Exception as error:
        # where in the kernel: the first op whose callback raised (the pallas_call's own callbacks,
        # which raise the failure again on the other devices, have no line)
        located = [raised for raised in raised_at if raised[0]]
        if located:
            error.raised_in_interpreted_op = located[0]  # type: ignore[attr-defined]
        if not fired.is_set():
            compat.reset_interpret_state(after_failure=True)  # else later kernels inherit the failure
            raise
    finally:
        done.set()
        timer.cancel()
        grace.cancel()
    if fired.is_set():
        compat.reset_interpret_state(after_failure=True)
        where = f"{case.mesh.label}, dma_mode={case.dma_mode}"
        what = (
            f"{case.impl} did not finish within {hang_timeout_s:g}s in TPU interpret mode on "
            f"{where}: a semaphore or DMA wait that nothing signals (the watchdog stopped it "
            "and reset the interpreter)"
        )
        run.hung[key] = session_lib.Hang(what, case.token, test=run.current_test())
        raise KernelHang(what)
    return out


class CallHang(RuntimeError):
    """A bounded call did not return within its limit; or it was not made, its kernel having hung
    earlier this run (``earlier``: that hang)."""

    def __init__(self, what: str, *, earlier: session_lib.Hang | None = None) -> None:
        super().__init__(what)
        self.earlier = earlier


class BoundedCaller:
    """One daemon thread that runs calls for the checks, so that a call that never returns leaves
    the check able to fail (the thread is abandoned; being a daemon it does not hold the exit)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._todo: list = []
        self._ready = threading.Condition(self._lock)

    def _loop(self) -> None:
        while True:
            with self._ready:
                while not self._todo:
                    self._ready.wait()
                fn, box, done = self._todo.pop(0)
            try:
                out = fn()
                if isinstance(out, jax.Array):
                    out.block_until_ready()
                box.append(("returned", out))
            except BaseException as e:  # handed to the waiting check, which re-raises it
                box.append(("raised", e))
            done.set()

    def run(self, fn: Callable[[], object], timeout: float) -> tuple[str, object] | None:
        """``("returned", value)`` or ``("raised", exception)``; ``None`` if ``fn`` did not end within
        ``timeout`` seconds (its thread is then given up and the next call gets a new one)."""
        box: list = []
        done = threading.Event()
        with self._ready:
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._loop, name="conformance-bounded-call", daemon=True
                )
                self._thread.start()
            self._todo.append((fn, box, done))
            self._ready.notify()
        if not done.wait(timeout):
            with self._lock:
                self._thread, self._todo = None, []
            return None
        return box[0]


def call_bounded(key: tuple[str, str], where: str, fn: Callable[[], Any], *, limit: float) -> Any:
    """``fn()`` (its result waited for) on the active session's caller thread. An exception
    propagates; a call that does not return within ``limit`` seconds raises :class:`CallHang`, and
    so does every later call of ``key`` (family, implementation) this session, naming ``where`` the
    first one hung."""
    run = session_lib.current()
    if key in run.hung:
        raise CallHang(
            "not run: an earlier call of this implementation never returned", earlier=run.hung[key]
        )
    if run.caller is None:
        run.caller = BoundedCaller()
    outcome = run.caller.run(fn, limit)
    if outcome is None:
        what = f"did not return within {limit:g} s (hung); its later checks in this process are not judged"
        run.hung[key] = session_lib.Hang(what, where, abandoned=True)
        raise CallHang(what)
    kind, value = outcome
    if kind == "raised":
        raise value
    return value
