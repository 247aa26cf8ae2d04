"""Bounded transfers: a call whose peer never comes fails its check instead of hanging the run
(:func:`conformance.watchdog.call_bounded`, remembered on the run's session like a hung kernel)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from conformance import session as session_lib
from conformance import watchdog
from conformance.checks.base import NotJudged, fail

if TYPE_CHECKING:  # for annotations only: cases imports this module
    from conformance.transfers.cases import Transfer

#: One call of an implementation, its first compile included, may take this many times
#: ``--hang-timeout`` (20 s by default) before the check fails it as hung. A transfer whose peer
#: never comes waits forever in most implementations (a blocking NCCL receive, a pull whose offer
#: never comes); the run must still end.
CALL_TIMEOUT_HANG_TIMEOUTS = 3


def call_timeout_s() -> float:
    return CALL_TIMEOUT_HANG_TIMEOUTS * session_lib.current().settings.hang_timeout_s


def bounded_call(t: Transfer, check: str, fn: Callable[[], object], *, timeout: float | None = None):
    """``fn()`` (its result waited for) on the session's caller thread; an exception propagates, a
    call that does not return within ``timeout`` (default :func:`call_timeout_s`) fails the check,
    and every later call of that implementation in this session is not judged, naming where it hung
    (its thread is still blocked: a later call could only wait behind it)."""
    limit = call_timeout_s() if timeout is None else timeout
    where = f"{check}, {t.route.label}, {t.layout.describe()}, {t.dtype}"
    try:
        return watchdog.call_bounded((t.family, t.impl), where, fn, limit=limit)
    except watchdog.CallHang as hang:
        if hang.earlier is not None:  # the verdict was the hang's; this check could not run
            raise NotJudged(
                f"{t.impl} hung earlier in this run ({hang.earlier.where}), and its call is "
                "still blocked in this process, so its later checks do not run here; the hang is its "
                "failure. "
                f"To judge this one: {t.replay_command(check)}"
            ) from None
        details = ["a transfer must end, or raise, when its peer takes part"]
        raise fail(t, check, str(hang), details) from None
