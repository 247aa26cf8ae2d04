"""The end-of-run summary groups failures by cause and points at the smallest failing case."""

from __future__ import annotations

import re

import pytest

from conformance import report, results
from conformance.checks import ConformanceFailure
from conformance.fixtures.meshes import MESH_CONFIGS, parse_mesh
from conformance.runner import Case

pytestmark = pytest.mark.selftest

FAMILY, IMPL = "all_gather", "kernel_dropping_odd_rows"
WRONG = "values differ from the numpy float64 reference"


def _case(mesh: str, rows: int, dma: str | None = "on_wait") -> Case:
    return Case.make(
        FAMILY, IMPL, parse_mesh(mesh), {"rows_per_shard": rows, "cols": 128}, "float32", dma_mode=dma
    )


def _outcome(
    check: str,
    outcome: str,
    shape: str | None = None,
    case: Case | None = None,
    what: str | None = None,
    impl: str = IMPL,
) -> results.Outcome:
    """A test's outcome as the run log has it; a failure carries the check's failure, if it gave one."""
    failure = None
    if case is not None:
        failure = ConformanceFailure(what)
        failure.case, failure.check, failure.what = case, check, what
    return results.Outcome(
        id=f"{FAMILY}/{impl}/{check}",
        nodeid=f"test_{check}[{impl}]",
        outcome=outcome,
        family=FAMILY,
        impl=impl,
        check=check,
        shape=shape,
        what=what,
        failure=failure,
    )


def _fixed(check: str, shape: str, failed: bool, mesh: str = "8-x-explicit") -> results.Outcome:
    if not failed:
        return _outcome(check, "passed", shape)
    return _outcome(check, "failed", shape, _case(mesh, 3), WRONG)


def test_one_defect_in_many_checks_is_one_cause_at_its_smallest_case() -> None:
    verdicts = [
        _fixed(check, shape, shape == "odd", config.label)
        for config in MESH_CONFIGS
        for check in ("output_sharding", "races")
        for shape in ("odd", "even")
    ]
    hypothesis_minimal = _case("2-x-auto", 1, "eager")
    verdicts.append(_outcome("values", "failed", None, hypothesis_minimal, WRONG))
    lines = report.summarize(verdicts)
    text = "\n".join(lines)
    n = len(MESH_CONFIGS)
    assert lines[0] == f"{FAMILY}/{IMPL}: {2 * n + 1} failed, {2 * n} passed", text
    assert f"odd (rows_per_shard=3, cols=128) {2 * n} of {2 * n} failed" in text, text
    assert f"even (rows_per_shard=4, cols=128) 0 of {2 * n} failed" in text, text
    assert "needs the odd shape" in text, text
    assert text.count(WRONG) == 1, text  # one cause, not forty-odd failures
    assert f"in output_sharding {n}, races {n}, values 1" in text, text
    assert "smallest: 2-x-auto:rows_per_shard=1,cols=128:float32:seed=0:dma=eager (values)" in text, text
    assert lines[-1].startswith("  start here : python -m conformance replay values all_gather"), text


def test_distinct_causes_are_listed_smallest_first_and_passing_kernels_not_at_all() -> None:
    verdicts = [
        _outcome("races", "failed", "odd", _case("8-x-explicit", 3), "a race"),
        _outcome("determinism", "failed", "even", _case("2-x-explicit", 4), "differ"),
        _outcome("tpu_layout", "failed"),  # a failure that gave no verdict line
        _outcome("races", "passed", "odd", impl="fine_kernel"),
        _outcome("races", "skipped", "even"),  # neither passed nor failed: not counted
    ]
    lines = report.summarize(verdicts)
    text = "\n".join(lines)
    assert "fine_kernel" not in text
    causes = [m[1] for line in lines if (m := re.match(r"\s+\d+x (.*)$", line))]
    assert causes == ["differ", "a race", "tpu_layout: no verdict line (see the test's report)"], text
    assert "needs the" not in text  # both shapes fail: no hint that one shape is the cause


def test_no_failures_no_summary() -> None:
    assert report.summarize([_outcome("races", "passed", "odd")]) == []
