"""Collective matmuls that are right in every way but the one that is their point: overlap.

Each is written the way a third party might (its own ring, its own helpers), moves exactly the
bytes its family allows, only by collective-permutes, and returns exact values in the right
sharding and dtype. None can hide a transfer behind a matmul: the data all arrives before the
one matmul starts, the one matmul ends before any data leaves, or each transfer and matmul
waits for the one before. The overlap check must reject each, and nothing else may.

One more is right even in its dataflow (every transfer could hide) but not in the schedule XLA:TPU
gives it: the real TPU schedule (``tpu_schedule``) must reject it with the others.

``EXPECTED_REJECTION`` names that check; ``EXPECTED_PASS`` the checks each must pass (its values,
collectives and bytes are right), which the self-test runs too.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

import conformance
from conformance.kernels.allgather_matmul._common import validate as validate_allgather_matmul
from conformance.kernels.matmul_reduce_scatter._common import validate as validate_matmul_reduce_scatter

EXPECTED_REJECTION: dict[str, str] = {
    "broken_agmm_gathers_then_multiplies": "test_overlap",
    "broken_agmm_gathers_in_a_loop_then_multiplies": "test_overlap",
    "broken_agmm_each_transfer_waits_for_its_matmul": "test_overlap",
    "broken_mrs_multiplies_then_reduce_scatters": "test_overlap",
    "broken_mrs_multiplies_then_reduce_scatters_in_a_loop": "test_overlap",
    "broken_mrs_each_matmul_waits_for_the_transfer": "test_overlap",
}
EXPECTED_MESSAGE: dict[str, str] = {impl: "no matmul is independent of it" for impl in EXPECTED_REJECTION}
#: What the real TPU schedule's rule rejects (``tpu_schedule`` under ``--schedule-verdict=hidden``):
#: every kernel above, and a ring whose dataflow lets every transfer hide but whose schedule XLA:TPU
#: clusters (its transfers back to back, then its matmuls), with the transfers left to the
#: scheduler's cost model. Compiled for a v5e slice of 8 chips at the family's 1 MiB ladder size (the
#: unpaced ring hides 2-3 of 7 there, libtpu 0.0.17 to 0.0.50). By default each fails only where it is
#: also behind the compiler's own collective matmul (selftest/test_tpu_schedule.py).
EXPECTED_TPU_SCHEDULE_REJECTION: tuple[str, ...] = (
    *EXPECTED_REJECTION,
    "broken_agmm_ring_left_to_the_scheduler",
)
#: What each must pass: the defect is invisible to every other check.
EXPECTED_PASS: dict[str, set[str]] = {
    impl: {"test_values", "test_collectives", "test_output_sharding", "test_lowered_bytes"}
    for impl in EXPECTED_REJECTION
}


def _left(n: int) -> list[tuple[int, int]]:
    """Every device sends to the one before it: device d receives from d + 1."""
    return [(j, (j - 1) % n) for j in range(n)]


def _right(n: int) -> list[tuple[int, int]]:
    return [(j, (j + 1) % n) for j in range(n)]


def _dot(a: jax.Array, b: jax.Array) -> jax.Array:
    return jnp.dot(a, b, preferred_element_type=jnp.float32)


# ----------------------------------------------------------------------------- allgather_matmul


def _allgather_matmul(per_device, lhs, rhs, mesh, axis_name):
    return jax.shard_map(
        per_device, mesh=mesh, in_specs=(P(axis_name, None), P(None, axis_name)), out_specs=P(None, axis_name)
    )(lhs, rhs)


@conformance.register("allgather_matmul", name="broken_agmm_gathers_then_multiplies")
def broken_agmm_gathers_then_multiplies(lhs, rhs, *, mesh, axis_name):
    """A ring of ppermutes gathers every row block of lhs, then one matmul: nothing to overlap."""
    n = validate_allgather_matmul("broken_agmm_gathers_then_multiplies", lhs, rhs, mesh, axis_name)

    def per_device(lhs_block, rhs_block):
        m, me = lhs_block.shape[0], lax.axis_index(axis_name)
        gathered = jnp.zeros((m * n, lhs_block.shape[1]), lhs_block.dtype)
        block = lhs_block
        for step in range(n):
            gathered = lax.dynamic_update_slice(gathered, block, (((me + step) % n) * m, 0))
            if step < n - 1:
                block = lax.ppermute(block, axis_name, _left(n))
        return _dot(gathered, rhs_block).astype(lhs_block.dtype)

    return _allgather_matmul(per_device, lhs, rhs, mesh, axis_name)


@conformance.register("allgather_matmul", name="broken_agmm_gathers_in_a_loop_then_multiplies")
def broken_agmm_gathers_in_a_loop_then_multiplies(lhs, rhs, *, mesh, axis_name):
    """The same gather-then-multiply, its ring a ``fori_loop`` (a while loop in HLO)."""
    n = validate_allgather_matmul("broken_agmm_gathers_in_a_loop_then_multiplies", lhs, rhs, mesh, axis_name)

    def per_device(lhs_block, rhs_block):
        m, me = lhs_block.shape[0], lax.axis_index(axis_name)
        gathered = jnp.zeros((m * n, lhs_block.shape[1]), lhs_block.dtype)
        gathered = lax.dynamic_update_slice(gathered, lhs_block, (me * m, 0))

        def step(s, carry):
            block, gathered = carry
            block = lax.ppermute(block, axis_name, _left(n))
            return block, lax.dynamic_update_slice(gathered, block, (((me + s) % n) * m, 0))

        _, gathered = lax.fori_loop(1, n, step, (lhs_block, gathered))
        return _dot(gathered, rhs_block).astype(lhs_block.dtype)

    return _allgather_matmul(per_device, lhs, rhs, mesh, axis_name)


@conformance.register("allgather_matmul", name="broken_agmm_each_transfer_waits_for_its_matmul")
def broken_agmm_each_transfer_waits_for_its_matmul(lhs, rhs, *, mesh, axis_name):
    """A ring that sends each block only after multiplying it (an optimization barrier ties the
    block to the product): transfer and matmul take turns."""
    n = validate_allgather_matmul("broken_agmm_each_transfer_waits_for_its_matmul", lhs, rhs, mesh, axis_name)

    def per_device(lhs_block, rhs_block):
        m, me = lhs_block.shape[0], lax.axis_index(axis_name)
        out = jnp.zeros((m * n, rhs_block.shape[1]), lhs_block.dtype)
        block = lhs_block
        for step in range(n):
            product = _dot(block, rhs_block).astype(lhs_block.dtype)
            out = lax.dynamic_update_slice(out, product, (((me + step) % n) * m, 0))
            if step < n - 1:
                block, _ = lax.optimization_barrier((block, product))
                block = lax.ppermute(block, axis_name, _left(n))
        return out

    return _allgather_matmul(per_device, lhs, rhs, mesh, axis_name)


@conformance.register("allgather_matmul", name="broken_agmm_ring_left_to_the_scheduler")
def broken_agmm_ring_left_to_the_scheduler(lhs, rhs, *, mesh, axis_name):
    """The textbook ring: each step's transfer issued before the matmul of the block in hand, every
    transfer independent of that matmul (the dataflow check passes it). Nothing paces it, and XLA:TPU's
    scheduler runs the first transfers back to back and several matmuls inside the last ones."""
    n = validate_allgather_matmul("broken_agmm_ring_left_to_the_scheduler", lhs, rhs, mesh, axis_name)

    def per_device(lhs_block, rhs_block):
        m, me = lhs_block.shape[0], lax.axis_index(axis_name)
        out = jnp.zeros((m * n, rhs_block.shape[1]), lhs_block.dtype)
        block = lhs_block
        for step in range(n):
            incoming = lax.ppermute(block, axis_name, _left(n)) if step < n - 1 else None
            product = _dot(block, rhs_block).astype(lhs_block.dtype)
            out = lax.dynamic_update_slice(out, product, (((me + step) % n) * m, 0))
            block = incoming
        return out

    return _allgather_matmul(per_device, lhs, rhs, mesh, axis_name)


# ----------------------------------------------------------------------------- matmul_reduce_scatter


def _matmul_reduce_scatter(per_device, lhs, rhs, mesh, axis_name):
    return jax.shard_map(
        per_device, mesh=mesh, in_specs=(P(None, axis_name), P(axis_name, None)), out_specs=P(axis_name, None)
    )(lhs, rhs)


def _owner(me: jax.Array, step: int | jax.Array, n: int) -> jax.Array:
    """The row block a device adds at ``step`` of a rightward ring, so that the sum of block d ends on d."""
    return (me + n - 1 - step) % n


@conformance.register("matmul_reduce_scatter", name="broken_mrs_multiplies_then_reduce_scatters")
def broken_mrs_multiplies_then_reduce_scatters(lhs, rhs, *, mesh, axis_name):
    """One matmul of the whole partial product, then a ring reduce-scatter of its row blocks."""
    name = "broken_mrs_multiplies_then_reduce_scatters"
    n = validate_matmul_reduce_scatter(name, lhs, rhs, mesh, axis_name)

    def per_device(lhs_block, rhs_block):
        m, me = lhs_block.shape[0] // n, lax.axis_index(axis_name)
        partial = _dot(lhs_block, rhs_block)
        acc = lax.dynamic_slice_in_dim(partial, _owner(me, 0, n) * m, m)
        for step in range(1, n):
            acc = lax.ppermute(acc, axis_name, _right(n)) + lax.dynamic_slice_in_dim(
                partial, _owner(me, step, n) * m, m
            )
        return acc.astype(lhs_block.dtype)

    return _matmul_reduce_scatter(per_device, lhs, rhs, mesh, axis_name)


@conformance.register("matmul_reduce_scatter", name="broken_mrs_multiplies_then_reduce_scatters_in_a_loop")
def broken_mrs_multiplies_then_reduce_scatters_in_a_loop(lhs, rhs, *, mesh, axis_name):
    """The same, its ring a ``fori_loop``."""
    name = "broken_mrs_multiplies_then_reduce_scatters_in_a_loop"
    n = validate_matmul_reduce_scatter(name, lhs, rhs, mesh, axis_name)

    def per_device(lhs_block, rhs_block):
        m, me = lhs_block.shape[0] // n, lax.axis_index(axis_name)
        partial = _dot(lhs_block, rhs_block)

        def step(s, acc):
            return lax.ppermute(acc, axis_name, _right(n)) + lax.dynamic_slice_in_dim(
                partial, _owner(me, s, n) * m, m
            )

        acc = lax.fori_loop(1, n, step, lax.dynamic_slice_in_dim(partial, _owner(me, 0, n) * m, m))
        return acc.astype(lhs_block.dtype)

    return _matmul_reduce_scatter(per_device, lhs, rhs, mesh, axis_name)


@conformance.register("matmul_reduce_scatter", name="broken_mrs_each_matmul_waits_for_the_transfer")
def broken_mrs_each_matmul_waits_for_the_transfer(lhs, rhs, *, mesh, axis_name):
    """A ring whose next partial is multiplied only once the running sum has arrived (an
    optimization barrier ties the operands to it): matmul and transfer take turns."""
    name = "broken_mrs_each_matmul_waits_for_the_transfer"
    n = validate_matmul_reduce_scatter(name, lhs, rhs, mesh, axis_name)

    def per_device(lhs_block, rhs_block):
        m, me = lhs_block.shape[0] // n, lax.axis_index(axis_name)
        acc = _dot(lax.dynamic_slice_in_dim(lhs_block, _owner(me, 0, n) * m, m), rhs_block)
        for step in range(1, n):
            arrived = lax.ppermute(acc, axis_name, _right(n))
            rows, arrived = lax.optimization_barrier((lhs_block, arrived))
            acc = arrived + _dot(lax.dynamic_slice_in_dim(rows, _owner(me, step, n) * m, m), rhs_block)
        return acc.astype(lhs_block.dtype)

    return _matmul_reduce_scatter(per_device, lhs, rhs, mesh, axis_name)
