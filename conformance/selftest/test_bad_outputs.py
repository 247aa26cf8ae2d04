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


@pytest.mark.parametrize("dma_mode", ["on_wait"])
def test_a_race_verdict_quotes_the_racing_accesses(dma_mode: str) -> None:
    """The seed kernel's shared semaphores race under on_wait DMAs: the verdict is the race, with the
    racing accesses (buffer, index range, devices, the kernel's line), at every JAX end (printed up to
    0.10; logged by 0.12, which raised at the first race until it was told to log it)."""
    import dataclasses

    import conformance.selftest.broken_pallas_kernels  # noqa: F401  (registers it)

    dims = {"rows_per_shard": 8, "cols": 128}
    case = Case.make(
        "all_gather", "broken_pallas_seed_shared_semaphores", parse_mesh("4-x-auto"), dims, "float32"
    )
    outcome = run_here(checks.CHECKS["races"], dataclasses.replace(case, dma_mode=dma_mode), Session())
    assert outcome.verdict == "failed" and outcome.what == "TPU interpret mode detected a race", outcome
    message = str(outcome.failure)
    assert "racing accesses (" in message and "RACE DETECTED" in message, message
    assert "broken_pallas_kernels.py:" in message, message  # the kernel's own line
