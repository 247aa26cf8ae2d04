"""What one check says about one case: a :class:`CheckOutcome` (verdict, message, records), and
:func:`run_here`, which runs a check in this process and catches what it raises into one.
:func:`conformance.run.run_check` is the run path every caller uses; the worker process of
:mod:`conformance.run.check_worker` calls :func:`run_here` itself.

Verdicts:

``passed``
    the check ran and found nothing wrong;
``failed``
    :class:`~conformance.checks.ConformanceFailure`: the kernel does not conform;
``skipped``
    :class:`~conformance.compat.HostLimit`: this host cannot run or lower the case;
``not_judged``
    :class:`~conformance.checks.NotJudged`: the check has nothing in this kernel to judge.

Anything else a check raises is a fault of the suite (or of the check's input), not a verdict, and
propagates. Records a check made travel in the outcome, also when it failed.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from conformance import checks, compat, runner, shared_runs
from conformance import session as session_lib
from conformance.checks.base import Check, compile_timeout_failure
from conformance.reports import bench
from conformance.runner import Case
from conformance.targets import cpu_ragged_all_to_all, target_compiles

#: What a check can say.
CHECK_VERDICTS = ("passed", "failed", "skipped", "not_judged")


@dataclasses.dataclass
class CheckOutcome:
    """What one check said about one case."""

    check: str
    #: The case checked: a :class:`~conformance.runner.Case`, or a send_recv transfer.
    case: Case | Any
    verdict: str
    #: The failure's message, or why it was skipped or not judged; ``""`` for a pass.
    message: str = ""
    #: A failure's one-line verdict (the summary groups failures by it).
    what: str | None = None
    #: The failure as the check raised it (its ``case`` may be a smaller one hypothesis found).
    failure: checks.ConformanceFailure | None = None
    #: The records the check made for the run's tables.
    records: list[Any] = dataclasses.field(default_factory=list)
    #: Read back from an earlier run of the same interpreted program
    #: (:mod:`conformance.run.interpret_outcomes`), not run again.
    read_back: bool = False
    #: What ran emulated for this verdict (:data:`conformance.targets.cpu_ragged_all_to_all.LABEL`), or "".
    emulated: str = ""

    @property
    def skip_reason(self) -> str:
        """A skip's or a not-judged outcome's reason as a test reports it, naming the implementation."""
        if self.verdict == "not_judged":
            return f"{self.case.impl}: not judged: {self.message}"
        return f"{self.case.impl}: {self.message}"


def _tuples(value: Any) -> Any:
    return tuple(_tuples(v) for v in value) if isinstance(value, list) else value


def record_to_json(record: Any) -> dict[str, Any]:
    """A check's (or benchmark's) record in plain values, for another process: its dataclass's
    module and name, and its fields."""
    kind = type(record)
    return {"type": f"{kind.__module__}:{kind.__qualname__}", "fields": dataclasses.asdict(record)}


def record_from_json(data: dict[str, Any]) -> Any:
    """A record another process of the run sent (the Pallas worker, a pytest-xdist worker), rebuilt
    as its dataclass: one defined in a check module or the benchmarks', no other."""
    module_name, _, qualname = data["type"].partition(":")
    module = {m.__name__: m for m in (*checks.MODULES, bench)}.get(module_name)
    kind = getattr(module, qualname, None) if module is not None else None
    if not (isinstance(kind, type) and dataclasses.is_dataclass(kind)):
        raise RuntimeError(f"a record of an unknown type came from another process: {data['type']!r}")
    return kind(**{k: _tuples(v) for k, v in data["fields"].items()})


def resolve(check: Check | str) -> Check:
    """A check by name (one of :data:`conformance.checks.CHECKS`), or the check itself."""
    if isinstance(check, Check):
        return check
    for known in checks.CHECKS.values():
        if check == known.name or check is known.fn:
            return known
    raise ValueError(f"unknown check {check!r}; one of {', '.join(checks.CHECKS)}")


def hold(case: Case | Any, session: session_lib.Session) -> None:
    """The runner's caches hold one implementation on one mesh at a time: those of another are
    dropped before ``case``'s (:func:`conformance.runner.release_cases`)."""
    if isinstance(case, Case):  # a send_recv transfer compiles nothing the runner holds
        held = runner.held_for(case)
        if session.held not in (None, held):
            runner.release_cases()
            shared_runs.release()
        session.held = held


#: Checks that run nothing on the host: they lower or compile for TPU and GPU alone.
_TARGETS_ONLY = frozenset({"cross_lowering", "tpu_layout", "barrier_protocol"})
#: Checks of a module lowered or compiled for a target that count XLA's ragged all-to-all's groups in a
#: run on the host (:func:`conformance.checks.ragged_bytes.as_the_op_moves_them`).
_COUNTED_ON_THE_HOST = frozenset({"lowered_bytes", "tpu_bytes", "gpu_bytes"})


def run_here(check: Check, case: Case, session: session_lib.Session) -> CheckOutcome:
    """Run ``check`` on ``case`` in this process, with ``session`` active (:func:`hold`); a verdict of
    a check that ran XLA's ragged all-to-all emulated on CPU says so (its ``emulated``, and a line of
    its failure's message)."""
    outcome = _run_here(check, case, session)
    with session.active():  # what it knows of the implementation's program is on the session
        emulated = isinstance(case, Case) and _ran_emulated(check, case)
    if emulated:
        outcome.emulated = cpu_ragged_all_to_all.LABEL
        if outcome.verdict == "failed":
            outcome.message += f"\n  emulated       : {cpu_ragged_all_to_all.LABEL}"
    return outcome


def _ran_emulated(check: Check, case: Case) -> bool:
    if check.name in _TARGETS_ONLY or case.platform != "cpu":
        return False
    if check.compile_tier and check.name not in _COUNTED_ON_THE_HOST:
        return False
    return cpu_ragged_all_to_all.emulating() and cpu_ragged_all_to_all.implementation_calls_the_op(case)


def _run_here(check: Check, case: Case, session: session_lib.Session) -> CheckOutcome:
    hold(case, session)
    with session.active():
        try:
            try:
                result = check(case)
            except target_compiles.CompileTimeout as timeout:  # a compile outside the check's own calls
                raise compile_timeout_failure(case, check.name, timeout) from timeout
        except checks.ConformanceFailure as failure:
            return CheckOutcome(
                check.name,
                case,
                "failed",
                str(failure),
                failure.what,
                failure,
                list(getattr(failure, "records", ())),
            )
        except compat.HostLimit as limit:
            return CheckOutcome(
                check.name, case, "skipped", str(limit), records=list(getattr(limit, "records", ()))
            )
        except checks.NotJudged as why:
            return CheckOutcome(
                check.name, case, "not_judged", str(why), records=list(getattr(why, "records", ()))
            )
    return CheckOutcome(check.name, case, "passed", records=checks.records_of(result))
