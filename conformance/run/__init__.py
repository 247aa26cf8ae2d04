"""The one run path: :func:`run_check` runs one check on one case and returns its
:class:`~conformance.run.outcomes.CheckOutcome` (verdict, message, records). The pytest tests,
absltest and the replay command call it, and each translates the outcome its own way (a pytest
failure or skip, ``self.fail``/``skipTest``, an exit status).

Where a check runs is decided here, once: in this process (:func:`~conformance.run.outcomes.run_here`),
in the worker process that checks Pallas kernels on CPU and runs the compile tiers' checks
(:mod:`conformance.run.check_worker`, which answers with the same outcome), and in a multi-process
job, agreed across the ranks (:func:`agreed`). Each module calls only lower ones: this one the
worker and the outcomes, the worker the outcomes, the outcomes the checks.

May import: the checks, the runner, the reports' record types, the jobs; not the pytest side.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from conformance import checks, compat
from conformance import session as session_lib
from conformance.checks.base import Check
from conformance.jobs import distributed
from conformance.run import check_worker
from conformance.run.outcomes import CheckOutcome, resolve, run_here
from conformance.runner import Case


def run_check(check: Check | str, case: Case, session: session_lib.Session | None = None) -> CheckOutcome:
    """Run one check on one case: in the worker process where isolation applies (a Pallas kernel in
    interpret mode on CPU, a compile tier's check), else here; in a multi-process job, the verdict
    every rank agrees on.

    ``session``: the run's (default: the active one, else a fresh one that ends with this call).
    """
    check = resolve(check)
    owned = session is None and session_lib.active_or_none() is None
    session = session or session_lib.current()
    try:
        outcome = _run(check, case, session)
    finally:
        if owned:
            session.close()
    if distributed.is_multi_process():
        with session.active():  # its agreement numbers the exchange
            outcome = agreed(outcome)
    return outcome


def _run(check: Check, case: Case, session: session_lib.Session) -> CheckOutcome:
    if not check_worker.applies(case, session.settings, check):
        return run_here(check, case, session)
    if distributed.is_multi_process():
        if session.settings.isolation != "process":
            raise compat.HostCannotRun(
                f"{case.impl}: a Pallas interpret check in a multi-process job runs "
                "only in the worker (process-local); --isolation=off cannot"
            )
        if distributed.rank_and_size()[0] != 0:
            # Interpret mode cannot run a kernel across processes, and a compile for a topology is the
            # same on every rank: rank 0's worker runs it on a process-local mesh, and this rank takes
            # that verdict (:func:`agreed`).
            return CheckOutcome(check.name, case, "passed")
    return check_worker.run_in_worker(check, case, session)


def agreed(outcome: CheckOutcome) -> CheckOutcome:
    """Agree across the ranks of a job: a failure on any rank fails the check on every rank, with
    every failing rank's own message (identical ones once, with their ranks); otherwise a skip (or
    not-judged) on any rank is every rank's. Each rank keeps its own records."""
    mine: dict[str, Any] = {"verdict": outcome.verdict, "message": outcome.message}
    if outcome.failure is not None:
        mine.update(
            what=outcome.failure.what,
            check=outcome.failure.check or outcome.check,
            why=getattr(outcome.failure, "why", None),
        )
    verdicts = [json.loads(v) for v in distributed.exchange("verdict", json.dumps(mine))]
    size = len(verdicts)
    failed = [(r, v) for r, v in enumerate(verdicts) if v["verdict"] == "failed"]
    if failed:
        _, first = failed[0]
        messages = distributed.by_message([(r, v["message"]) for r, v in failed], size)
        ranks = ", ".join(str(r) for r, _ in failed)
        failure = checks.ConformanceFailure("\n".join([*messages, f"  failed on ranks: {ranks} of {size}"]))
        failure.case, failure.check, failure.what = outcome.case, first["check"], first["what"]
        failure.why = first.get("why")
        return dataclasses.replace(
            outcome, verdict="failed", message=str(failure), what=first["what"], failure=failure
        )
    if outcome.verdict in ("skipped", "not_judged"):
        return outcome
    others = [v for v in verdicts if v["verdict"] in ("skipped", "not_judged")]
    if others:
        return dataclasses.replace(outcome, verdict=others[0]["verdict"], message=others[0]["message"])
    return outcome
