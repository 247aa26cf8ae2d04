"""What a failing backward is told, as its family's backward is: a gradient off by roundings alone
where the math needs no arithmetic (an all-reduce's is the replicated cotangent) is named so; a
backward less accurate than the baseline's gets the advice of its family (move the cotangent as it
is, or carry float32 accumulators where the gradient is a sum); a bytes failure whose transfers are
wider than the run's dtype says where the float32 comes from."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from conformance import hlo, specs
from conformance.checks import accuracy, autodiff, block_map
from conformance.fixtures.meshes import parse_mesh
from conformance.runner import Case

pytestmark = pytest.mark.selftest


def _case(family: str, dtype: str, impl: str = "xla") -> Case:
    dims = {"rows_per_shard": 3, "cols": 8}
    return Case.make(family, impl, parse_mesh("4-x-auto"), dims, dtype)


def test_a_gradient_off_by_roundings_where_none_are_needed_is_named() -> None:
    case = _case("all_reduce", "bfloat16", "xla_all_reduce")
    exact = np.linspace(-2.0, 2.0, 48).reshape(4, 12)
    exact = exact.astype(jax.numpy.bfloat16).astype(np.float64)  # representable: the math moves it
    rounded = exact.copy()
    rounded[0, 1] *= 1 + 2.0**-7  # a bfloat16 rounding or two, as a sum of the cotangent's shares gives
    lines = autodiff.rounded_where_exact(case, jax.numpy.asarray(rounded), exact)
    assert lines and lines[0].startswith(block_map.ROUNDED_PREFIX), lines
    assert "needs no arithmetic (each device's gradient is the replicated cotangent" in lines[0], lines
    assert "custom_vjp" in lines[1], lines
    assert block_map.summary_line(["block map      : x", *lines]).startswith("the backward computes"), lines

    moved = exact.copy()
    moved[0] = exact[1]  # a block in another's place: no rounding explains it
    assert autodiff.rounded_where_exact(case, jax.numpy.asarray(moved), exact) == []


def test_backward_accuracy_advice_follows_the_family() -> None:
    moved = " ".join(accuracy.backward_accuracy_advice(specs.get("all_reduce")))
    assert "needs none (each device's gradient is the replicated cotangent" in moved, moved
    assert "float32 accumulators" not in moved, moved
    summed = " ".join(accuracy.backward_accuracy_advice(specs.get("allgather_matmul")))
    assert "float32 accumulators" in summed, summed


def _permutes(dtype: str) -> hlo.CollectiveSummary:
    """A module of one collective-permute of ``dtype`` rows, as a compiler prints it."""
    shape = f"{dtype}[3,8]"
    return hlo.parse_hlo(
        f"HloModule m, num_partitions=2\n\nENTRY %e (p: {shape}) -> {shape} {{\n"
        f"  %p = {shape}{{1,0}} parameter(0)\n"
        f"  ROOT %cp = {shape}{{1,0}} collective-permute(%p), channel_id=1, "
        "source_target_pairs={{0,1},{1,0}}\n}\n"
    )


def test_transfers_wider_than_the_run_say_where_they_come_from() -> None:
    from conformance.checks.collectives import wider_transfers

    bf16 = _case("reduce_scatter", "bfloat16", "xla_reduce_scatter")
    backward = wider_transfers(bf16, [_permutes("f32")], backward=True)
    assert backward and "the backward moves f32 in a bfloat16 run" in backward[0], backward
    assert "forward moves f32" in wider_transfers(bf16, [_permutes("f32")], backward=False)[0]
    assert wider_transfers(bf16, [_permutes("bf16")], backward=True) == []
    assert (
        wider_transfers(
            _case("reduce_scatter", "float32", "xla_reduce_scatter"), [_permutes("f32")], backward=True
        )
        == []
    )
