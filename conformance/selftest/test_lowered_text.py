"""A byte verdict read from lowered text (no compiler for the target here) does not count what the
compiler provably removes: the runs of a collective that the host's compile of the same program no
longer has (XLA's loop simplification and dead-code elimination run for every target), and says it
was read from lowered text. The defect it would hide is still seen where the compiler keeps it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

import conformance
from conformance import checks, hlo, registry
from conformance.fixtures.meshes import parse_mesh
from conformance.run.outcomes import run_here
from conformance.runner import Case
from conformance.session import Session

pytestmark = pytest.mark.selftest

IMPL = "ring_permutes_once_more_after_its_last_use"


def _ring_permutes_once_more(lhs, rhs, *, mesh, axis_name):
    """A ring that sends its block before the loop and again at the end of every trip, the last send
    read by nothing: n transfers where n - 1 are needed. On a ring of 2 the loop has one trip, which XLA
    inlines, and the dead send goes; on longer rings the loop stays and so does the extra block."""

    def body(a, b):
        n, me, m = lax.axis_size(axis_name), lax.axis_index(axis_name), a.shape[0]
        perm = [(j, (j + 1) % n) for j in range(n)]
        out = jnp.zeros((m * n, b.shape[1]), jnp.float32)
        out = lax.dynamic_update_slice(out, jnp.dot(a, b, preferred_element_type=jnp.float32), (me * m, 0))

        def step(i, carry):
            out, block = carry
            product = jnp.dot(block, b, preferred_element_type=jnp.float32)
            out = lax.dynamic_update_slice(out, product, (((me - i - 1) % n) * m, 0))
            return out, lax.ppermute(block, axis_name, perm)

        out, _ = lax.fori_loop(0, n - 1, step, (out, lax.ppermute(a, axis_name, perm)))
        return out.astype(a.dtype)

    return jax.shard_map(
        body, mesh=mesh, in_specs=(P(axis_name, None), P(None, axis_name)), out_specs=P(None, axis_name)
    )(lhs, rhs)


def _lowered_bytes(mesh: str):
    """The lowered_bytes check of the ring above, registered for this call only (a registration left
    behind would be a kernel the later tests of the same process see)."""
    conformance.register("allgather_matmul", name=IMPL, lowering_targets=("cuda",))(_ring_permutes_once_more)
    try:
        dims = {"rows_per_shard": 3, "K": 8, "cols_per_shard": 2}
        case = Case.make("allgather_matmul", IMPL, parse_mesh(mesh), dims, "bfloat16")
        return run_here(checks.CHECKS["lowered_bytes"], case, Session())
    finally:
        registry._REGISTRY["allgather_matmul"].pop(IMPL, None)


def test_a_dead_transfer_in_a_one_trip_loop_is_not_counted() -> None:
    """Ring of 2: the lowered text holds two sends of 48 bytes against a bound of 48; the compiled
    module one."""
    outcome = _lowered_bytes("2-x-auto")
    assert outcome.verdict == "passed", outcome.message


def test_the_extra_transfer_the_compiler_keeps_is_still_counted() -> None:
    """Ring of 4: the loop has 3 trips and keeps its last, dead send: 4 blocks where 3 are needed."""
    outcome = _lowered_bytes("4-x-auto")
    assert outcome.verdict == "failed", outcome.message
    assert "received       : 192 bytes per device per call" in outcome.message, outcome.message
    assert "read from lowered text, " in outcome.message, outcome.message


def _op(name: str, dims: tuple[int, ...], times: int, dtype: str = "bf16") -> hlo.CollectiveOp:
    shape = hlo.Shape(dtype, dims)
    pairs = ((0, 1), (1, 0))
    return hlo.CollectiveOp(
        "collective-permute", "sync", name, "main", (shape,), (shape,), pairs, None, times
    )


def test_runs_are_taken_off_only_where_the_compiled_module_keeps_the_same_collective() -> None:
    lowered = hlo.CollectiveSummary((_op("%6", (3, 8), 1), _op("%11", (3, 8), 1)))
    fewer, lines = hlo.less_what_compiling_removes(
        lowered, hlo.CollectiveSummary((_op("p", (3, 8), 1, "f32"),))
    )
    assert [op.name for op in fewer.ops] == ["%6"] and len(lines) == 1 and "%11" in lines[0], (fewer, lines)
    # combined into one of other dims, or removed altogether: nothing is taken off
    for compiled in ((_op("p", (6, 8), 1, "f32"),), ()):
        same, lines = hlo.less_what_compiling_removes(lowered, hlo.CollectiveSummary(compiled))
        assert same == lowered and not lines
