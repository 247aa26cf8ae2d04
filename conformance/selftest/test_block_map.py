"""Which block landed where: a wrong result is traced on source-tagged inputs, and its failure names,
per wrong row block, whose block it holds, the ring step that brings it and what is missing
(``conformance/checks/block_map.py``), in the message and in the one line the failure summary shows."""

from __future__ import annotations

import pytest

import conformance.selftest.broken_kernels
import conformance.selftest.broken_matmul_reduce_scatter_kernels
import conformance.selftest.broken_mesh_kernels
import conformance.selftest.broken_pallas_kernels  # noqa: F401  (registers the kernels below)
from conformance import checks, specs
from conformance.checks import base
from conformance.fixtures.meshes import parse_mesh
from conformance.run.outcomes import run_here
from conformance.runner import Case
from conformance.session import Session

pytestmark = pytest.mark.selftest


def _failure(
    family: str, impl: str, mesh: str, *, check: str = "output_sharding", dma_mode: str | None = None
):
    dims = specs.get(family).fixed_dims("odd")
    case = Case.make(family, impl, parse_mesh(mesh), dims, "float32", dma_mode=dma_mode)
    outcome = run_here(checks.CHECKS[check], case, Session())
    assert outcome.verdict == "failed", outcome
    return outcome.failure


#: kernel, family, mesh -> what its failure message must say, and what the summary's line must say
CASES = {
    "wrong slot": (
        ("broken_ring_wrong_slot", "allgather_matmul", "4-x-auto"),
        "out rows 3:6 on device 0 holds device 3's block (expected device 1's): what a ring going right "
        "brings at step 1 (going left: step 3)",
        # every wrong block the same two positions off: one sentence, at any ring length
        "each of the 8 wrong blocks, on 4 devices, holds the block of the ring position 2 before its own",
    ),
    "a position's block dropped": (
        ("broken_ring_drops_position_zeros_block", "allgather_matmul", "3-x-auto"),
        "ring position 0's block (device 0) is missing everywhere",
        "ring position 0's block (device 0) is missing everywhere",
    ),
    "an odd ring split as if even": (
        ("broken_bidirectional_split_assumes_even_ring", "allgather_matmul", "3-x-auto"),
        "out rows 6:9 on device 0 lacks device 2's block (holds zeros): what a ring going right brings at "
        "step 1 (going left: step 2)",
        "lacks device 2's block",
    ),
    "neighbours by device id on a reversed ring": (
        ("broken_ring_in_device_id_order", "allgather_matmul", "8-x-auto-reversed"),
        "out rows 0:3 on device 0 holds device 1's block (expected device 7's)",
        "holds device 1's block (expected device 7's)",
    ),
    "a partial sent to the wrong neighbour": (
        ("broken_mrs_wrong_neighbour", "matmul_reduce_scatter", "4-x-auto"),
        "out rows 0:3 on device 0 holds devices 1, 3's partials of rows 6:9 where its rows 0:3 belong",
        "holds devices 1, 3's partials of rows 6:9",
    ),
    "a partial counted twice": (
        ("broken_mrs_counts_own_partial_twice", "matmul_reduce_scatter", "4-x-auto"),
        "every block lands where the spec puts it, but its values come out 2 times what they are (out rows"
        " 0:3 on device 0; out rows 3:6 on device 1; ",
        "its values come out 2 times what they are",
    ),
    "the whole result doubled on a ring of one": (
        ("broken_mrs_counts_own_partial_twice", "matmul_reduce_scatter", "1-x-auto"),
        "every block lands where the spec puts it, but its values come out 2 times what they are (out rows"
        " 0:3 on device 0): the arithmetic scales them, not where blocks go",
        "its values come out 2 times what they are",
    ),
    "arithmetic, not placement": (
        ("broken_bfloat16_compute", "allgather_matmul", "4-x-auto"),
        "every block lands where the spec puts it: the wrong values come from the arithmetic",
        "every block lands where the spec puts it",
    ),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_wrong_result_names_the_block_that_landed_there(name: str) -> None:
    (impl, family, mesh), says, summary = CASES[name]
    check = "values" if impl == "broken_bfloat16_compute" else "output_sharding"
    if check == "values":  # drawn cases: the float32 fixed shape on this mesh, as the values check runs it
        failure = _failure(family, impl, mesh, check="dtype")
    else:
        failure = _failure(family, impl, mesh)
    assert says in str(failure), str(failure)
    assert failure.why and summary in failure.why, failure.why


def test_the_pallas_ring_that_never_sends_an_odd_blocks_last_row() -> None:
    failure = _failure(
        "all_gather", "broken_pallas_drops_last_row_of_odd_shards", "3-x-auto", dma_mode="on_wait"
    )
    assert "row 2 of device 1's block never arrived" in str(failure), str(failure)
    assert failure.why == "in each of the 6 wrong blocks only row 2 is wrong", failure.why


def test_a_baseline_wrong_on_the_same_inputs_is_named_as_the_cause(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where XLA's own op gets the case wrong too (XLA:GPU's doubled int8 dots), the failure says so and
    the summary's line is that; with a right baseline no such line."""
    right = _failure("matmul_reduce_scatter", "broken_mrs_wrong_neighbour", "4-x-auto")
    assert "baseline       :" not in str(right), str(right)
    monkeypatch.setattr(base, "baseline_of", lambda family: "broken_mrs_counts_own_partial_twice")
    wrong = _failure("matmul_reduce_scatter", "broken_mrs_wrong_neighbour", "4-x-auto")
    says = (
        "broken_mrs_counts_own_partial_twice (the family's baseline, XLA's own op) gets the same inputs wrong"
    )
    assert says in str(wrong), str(wrong)
    assert "the defect is below the kernel" in (wrong.why or ""), wrong.why


def _rs_counted_off(x, *, mesh, axis_name, split_columns: bool):
    """A reduce-scatter ring that starts two blocks ahead, so every sum is the next ring position's: one
    way, or with the left columns going left and the rest right (a column-split bidirectional ring)."""
    import jax
    import jax.numpy as jnp
    from jax import lax
    from jax.sharding import PartitionSpec as P

    n = mesh.shape[axis_name]

    def body(block):
        partial = block[0]
        m, me = partial.shape[0] // n, lax.axis_index(axis_name)
        half = -(-partial.shape[1] // 2) if split_columns else partial.shape[1]

        def rows(owner):
            return lax.dynamic_slice_in_dim(partial, owner * m, m)

        left, right = rows((me + 2) % n)[:, :half], rows((me - 2) % n)[:, half:]
        for s in range(1, n):
            left = (
                lax.ppermute(left, axis_name, [(j, (j - 1) % n) for j in range(n)])
                + rows((me + s + 2) % n)[:, :half]
            )
            right = (
                lax.ppermute(right, axis_name, [(j, (j + 1) % n) for j in range(n)])
                + rows((me - s - 2) % n)[:, half:]
            )
        return jnp.concatenate([left, right], axis=1)

    return jax.shard_map(body, mesh=mesh, in_specs=P(axis_name), out_specs=P(axis_name))(x)


#: What the pattern line says, one way and with the columns split (the fixed shape's 8 columns).
COUNTED_OFF = "a ring whose steps are counted off by 1"
ONE_WAY = "holds, from every device's partial, the rows of the ring position 1 after its own: " + COUNTED_OFF
BY_COLUMNS = (
    "holds, from every device's partial, in columns 0:4 the rows of the ring position 1 after its own "
    "and in columns 4:8 the rows of the ring position 1 before its own: " + COUNTED_OFF
)


@pytest.mark.parametrize("split_columns, says", [(False, ONE_WAY), (True, BY_COLUMNS)])
def test_partials_a_ring_step_off_are_one_sentence(split_columns: bool, says: str) -> None:
    """At n=8 a reduce-scatter ring counted one step off is one line, not a clause per device per block,
    one-way or with its columns split between directions, and it is the summary's why."""
    import functools

    from conformance import registry

    name = f"selftest_rs_counted_off{'_by_columns' * split_columns}"
    registry.register("reduce_scatter", name=name, dtypes=("float32",), bidirectional=split_columns)(
        functools.partial(_rs_counted_off, split_columns=split_columns)
    )
    try:
        failure = _failure("reduce_scatter", name, "8-x-auto")
    finally:
        registry._REGISTRY["reduce_scatter"].pop(name, None)
    text = str(failure)
    assert "on device 0 holds every device's partials of" in text, text
    assert says in text, text
    assert failure.why and says in failure.why, failure.why


def test_the_block_map_draws_a_picture_the_report_reads_back() -> None:
    """The wrong slots as a grid of devices by row blocks, each cell whose row block it holds: on a
    reversed ring of 8 whose neighbours are taken by device id, rows in ring order (device 7 first) and
    every wrong block a number; a dropped position's block a column of zeros down the diagonal."""
    from conformance.checks import block_picture

    picture = block_picture.parse(
        str(_failure("allgather_matmul", "broken_ring_in_device_id_order", "8-x-auto-reversed"))
    )
    assert picture is not None and picture.blocks == tuple(str(b) for b in range(8)), picture
    assert [label for label, _ in picture.rows] == [f"device {7 - p} (p{p})" for p in range(8)], picture
    assert picture.rows[0][1] == (".", "7", "6", "5", ".", "3", "2", "1"), picture
    assert sum(cells.count(".") for _, cells in picture.rows) == 16, "16 of 64 blocks right"
    dropped = block_picture.parse(
        str(_failure("allgather_matmul", "broken_bidirectional_split_assumes_even_ring", "3-x-auto"))
    )
    assert dropped is not None and [cells for _, cells in dropped.rows] == [
        (".", ".", "-"),
        ("-", ".", "."),
        (".", "-", "."),
    ], dropped
