"""Bounded calls: an implementation's call in a daemon thread, so a transfer whose peer never comes
fails its check instead of hanging the run."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

import jax

from conformance import session as session_lib

if TYPE_CHECKING:  # for annotations only: cases imports this module
    from conformance.transfers.cases import Transfer

# -- bounded calls ---------------------------------------------------------------------------------

#: One call of an implementation, its first compile included, may take this many times
#: ``--hang-timeout`` (60 s by default) before the check fails it as hung. A transfer whose peer
#: never comes waits forever in most implementations (a blocking NCCL receive, a pull whose offer
#: never comes); the run must still end.
CALL_TIMEOUT_HANG_TIMEOUTS = 3


def call_timeout_s() -> float:
    return CALL_TIMEOUT_HANG_TIMEOUTS * session_lib.current().settings.hang_timeout_s


class _Caller:
    """One daemon thread that runs calls for the checks, so that a call that never returns leaves
    the check able to fail (the thread is abandoned; being a daemon it does not hold the exit)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._todo: list = []
        self._ready = threading.Condition(self._lock)
        #: implementation -> where a call of it hung; later calls fail at once
        self.hung: dict[str, str] = {}

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
                    target=self._loop, name="conformance-transfer-call", daemon=True
                )
                self._thread.start()
            self._todo.append((fn, box, done))
            self._ready.notify()
        if not done.wait(timeout):
            with self._lock:
                self._thread, self._todo = None, []
            return None
        return box[0]


_CALLER = _Caller()


def abandoned_calls() -> list[str]:
    """Where each call this process gave up on as hung was (its thread may still be blocked)."""
    return [f"{impl}: {where}" for impl, where in _CALLER.hung.items()]


def bounded_call(t: Transfer, check: str, fn: Callable[[], object], *, timeout: float | None = None):
    """``fn()`` (its result waited for) run on the caller thread; an exception propagates, a call
    that does not return within ``timeout`` (default :func:`call_timeout_s`) fails the check, and
    every later call of that implementation in this process fails at once, naming where it hung."""
    limit = call_timeout_s() if timeout is None else timeout
    if t.impl in _CALLER.hung:
        raise t.fail(
            check,
            "not run: an earlier call of this implementation never returned",
            [f"hung in         : {_CALLER.hung[t.impl]}"],
        )
    outcome = _CALLER.run(fn, limit)
    if outcome is None:
        _CALLER.hung[t.impl] = f"{check}, {t.route.label}, {t.layout.describe()}, {t.dtype}"
        raise t.fail(
            check,
            f"did not return within {limit:g} s (hung); its later checks in this process fail at once",
            ["a transfer must end, or raise, when its peer takes part"],
        )
    kind, value = outcome
    if kind == "raised":
        raise value
    return value
