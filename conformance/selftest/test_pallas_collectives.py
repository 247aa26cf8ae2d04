"""A Pallas kernel that rings collectives around its kernels is judged by what it does: the family's
collectives are allowed to it, and its overlap is judged (``pallas_collective_kernels.py``)."""

from __future__ import annotations

import pytest

import conformance.kernels  # the families' baselines
import conformance.selftest.pallas_collective_kernels  # noqa: F401  (registers the kernel)
from conformance import checks, specs
from conformance.fixtures.meshes import parse_mesh
from conformance.run.outcomes import run_here
from conformance.runner import Case
from conformance.session import Session
from conformance.targets import tpu_compiler

pytestmark = pytest.mark.selftest

IMPL = "correct_ppermute_ring_of_pallas_matmuls"
EVEN = {"rows_per_shard": 4, "K": 8, "cols_per_shard": 2}


def _outcome(check: str, mesh: str = "4-x-auto", dims: dict | None = None, dtype: str = "float32"):
    case = Case.make("allgather_matmul", IMPL, parse_mesh(mesh), dims or EVEN, dtype)
    return run_here(checks.CHECKS[check], case, Session())


@pytest.mark.parametrize("check", ["values", "collectives", "overlap"])
def test_a_pallas_ring_of_collectives_passes_and_is_judged(check: str) -> None:
    outcome = _outcome(check)
    assert outcome.verdict == "passed", outcome


def test_its_overlap_is_judged_not_skipped() -> None:
    outcome = _outcome("overlap")
    assert outcome.verdict == "passed" and outcome.records, outcome
    for record in outcome.records:  # e.g. "3/3": every transfer has a matmul independent of it
        hideable, total = (int(n) for n in record.fraction.split("/"))
        assert total == 3 and hideable >= total - 1, record


@pytest.mark.skipif(not tpu_compiler.available(), reason="no TPU compiler here")
def test_the_real_tpu_schedule_judges_it() -> None:
    dims = dict(specs.get("allgather_matmul").schedule_ladder[1])
    outcome = _outcome("tpu_schedule", mesh="8-x-explicit", dims=dims, dtype="bfloat16")
    assert outcome.verdict in ("passed", "failed"), outcome  # judged, whatever the verdict
    assert outcome.records and all(r.total > 0 for r in outcome.records), outcome
