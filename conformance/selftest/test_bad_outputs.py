"""A kernel that returns the wrong thing gets one failing verdict per check, naming what it returned,
never a check's own traceback (an accuracy check once raised numpy's broadcast error on it). The
determinism check passes it: two calls agree, and that defect is the other checks' to name."""

from __future__ import annotations

import pytest

import conformance
import conformance.kernels
from conformance import checks, registry
from conformance.fixtures.meshes import parse_mesh
from conformance.outcomes import run_here
from conformance.runner import Case
from conformance.session import Session

pytestmark = pytest.mark.selftest


def _square(lhs, rhs, *, mesh, axis_name):
    """The built-in ring's result, cut to a square: the right values, the wrong shape."""
    out = registry.get("allgather_matmul", "ring_allgather_matmul_unidirectional").fn(
        lhs, rhs, mesh=mesh, axis_name=axis_name
    )
    side = min(out.shape)
    return out[:side, :side]


def _register() -> None:
    if "broken_agmm_returns_a_square" not in conformance.implementations("allgather_matmul"):
        conformance.register("allgather_matmul", name="broken_agmm_returns_a_square")(_square)


@pytest.mark.parametrize("check", ["values", "accuracy", "output_sharding", "dtype"])
def test_a_result_of_the_wrong_shape_is_one_failing_verdict(check: str) -> None:
    _register()
    dims = {"rows_per_shard": 4, "K": 8, "cols_per_shard": 2}
    dtype = "bfloat16" if check == "accuracy" else "float32"
    case = Case.make("allgather_matmul", "broken_agmm_returns_a_square", parse_mesh("4-x-auto"), dims, dtype)
    outcome = run_here(checks.CHECKS[check], case, Session())
    assert outcome.verdict == "failed", outcome
    message = str(outcome.failure)
    assert "shape" in message and "(8, 8)" in message and "(16, 8)" in message, message
    assert "broadcast" not in message, message
