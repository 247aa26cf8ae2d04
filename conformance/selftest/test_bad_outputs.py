"""A kernel that returns the wrong thing gets one failing verdict per check, naming what it returned,
never a check's own traceback (an accuracy check once raised numpy's broadcast error on it). The
determinism check passes it: two calls agree, and that defect is the other checks' to name."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

import conformance
import conformance.kernels
from conformance import checks, registry, specs
from conformance.fixtures.meshes import parse_mesh
from conformance.run.outcomes import run_here
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


@pytest.mark.parametrize("check", ["values", "accuracy", "output_sharding", "dtype", "determinism", "eager"])
def test_a_result_that_is_not_one_array_is_one_failing_verdict(check: str) -> None:
    """A kernel that returns a tuple (its result twice) fails naming what it returned."""
    if "broken_agmm_returns_a_pair" not in conformance.implementations("allgather_matmul"):
        ring = registry.get("allgather_matmul", "ring_allgather_matmul_unidirectional").fn
        conformance.register("allgather_matmul", name="broken_agmm_returns_a_pair")(
            lambda lhs, rhs, *, mesh, axis_name: (ring(lhs, rhs, mesh=mesh, axis_name=axis_name),) * 2
        )
    dims = {"rows_per_shard": 3, "K": 8, "cols_per_shard": 2}
    dtype = "bfloat16" if check == "accuracy" else "float32"
    case = Case.make("allgather_matmul", "broken_agmm_returns_a_pair", parse_mesh("4-x-auto"), dims, dtype)
    outcome = run_here(checks.CHECKS[check], case, Session())
    assert outcome.verdict == "failed", outcome
    assert outcome.what == "out is not a jax.Array", outcome.what
    assert "returned       : tuple of 2" in str(outcome.failure), outcome.failure


def _fails_while_tracing(lhs, rhs, *, mesh, axis_name):
    """A loop whose carry changes type (the ppermute'd block is varying over the axis, the zeros it is
    added to are not: shard_map's check_vma trap): JAX raises a TypeError while tracing."""

    def body(a, b):
        n = lax.axis_size(axis_name)

        def step(i, acc):
            return acc + lax.ppermute(a, axis_name, [(j, (j + 1) % n) for j in range(n)]) @ b

        return lax.fori_loop(0, n, step, jnp.zeros((a.shape[0], b.shape[1]), a.dtype))

    return jax.shard_map(
        body, mesh=mesh, in_specs=(P(axis_name, None), P(None, axis_name)), out_specs=P(None, axis_name)
    )(lhs, rhs)


@pytest.mark.parametrize("check", ["values", "collectives", "cross_lowering", "overlap", "tpu_schedule"])
def test_a_kernel_that_fails_while_tracing_is_one_cause_in_every_check(check: str) -> None:
    """Every check gives the one verdict line "raised TypeError on valid input" (the summary shows one
    cause), never "does not lower cleanly" or a compiler's refusal per topology."""
    if "broken_agmm_fails_while_tracing" not in conformance.implementations("allgather_matmul"):
        conformance.register("allgather_matmul", name="broken_agmm_fails_while_tracing")(_fails_while_tracing)
    if check == "tpu_schedule":
        dims, mesh = dict(specs.get("allgather_matmul").schedule_ladder[0]), "8-x-explicit"
    else:
        dims, mesh = {"rows_per_shard": 3, "K": 8, "cols_per_shard": 2}, "4-x-auto"
    case = Case.make("allgather_matmul", "broken_agmm_fails_while_tracing", parse_mesh(mesh), dims, "float32")
    outcome = run_here(checks.CHECKS[check], case, Session())
    if outcome.verdict == "skipped":
        pytest.skip(outcome.message)  # no libtpu here: nothing compiles for a TPU topology
    assert outcome.verdict == "failed", outcome
    assert outcome.what == "raised TypeError on valid input", outcome.what
    assert "_fails_while_tracing" in str(outcome.failure) or "test_bad_outputs.py" in str(outcome.failure)


PRINTED_RACE = (  # JAX 0.10.2's interpreter prints this (0.6.2 the same without the clocks)
    "RACE DETECTED\n  read of ('hbm', 101, 2, 0)[(0, slice(4, 8, 1), slice(0, 128, 1))] from 127, 0, "
    "kernels.py:132:12 (_kernel)\n  clock: [29 29 29 30 12 14 14  5]\n  write of ('hbm', 101, 2, 0)"
    "[(0, slice(4, 8, 1), slice(0, 128, 1))] from 120, 0 kernels.py:132:12 (_kernel)\n"
    "  clock: [ 9  8 14 19]\n"
)


def test_race_reports_are_caught_from_the_interpreters_print_and_log() -> None:
    """Printed (JAX 0.6.2 to 0.10) or logged (0.12, told on_race="warn"), the racing accesses reach
    the race verdict (checks.pallas.check_races quotes the first); the stream and the log still get
    them. (The seed kernel's race itself shows or not by the interpreter's timing: the sweep holds
    that the races check rejects it.)"""
    import logging

    from conformance import compat

    with compat.race_reports() as reports:
        print(PRINTED_RACE)
        print("an unrelated line")
        logging.getLogger("jax._src.pallas").warning(
            "RACE DETECTED\n  write of ('hbm', 7)[0:4] from (1, 0), k.py:9"
        )
    assert len(reports) == 2, reports  # the log's as it comes, the print's at the end of the block
    printed = next(r for r in reports if "kernels.py:132" in r)
    assert printed.startswith("RACE DETECTED\n  read of ('hbm', 101, 2, 0)") and "clock:" in printed
    assert "unrelated" not in printed and any(r.endswith("k.py:9") for r in reports), reports
    params = compat.interpret_params(dma_execution_mode="on_wait", detect_races=True)
    assert getattr(params, "on_race", "warn") == "warn", params  # never "raise" where the field exists
