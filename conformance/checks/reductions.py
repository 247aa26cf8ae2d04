"""The reductions a kernel declares beside its family's own: a reduce-scatter or all-reduce of the
partials' elementwise min or max (``lax.psum_scatter``'s sum is the family's; JAX's
``reduce_scatter_mgpu`` also takes ``reduction="min"|"max"``).

A kernel registered with ``reductions=("add", "max")`` is called with ``reduction="max"`` at the odd
fixed shape on every covering mesh, under ``jax.jit``, and every shard of its result must equal the
numpy float64 min or max of the partials exactly (a min or max rounds nothing, in any dtype: a kernel
that starts its running max at zero, or carries it in a narrower type, is wrong somewhere) and sit
where the family's result does. Its sum is the other checks' business.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from conformance import runner, watchdog
from conformance.checks.base import Axes, Check, call_kernel, compare_shards, fail
from conformance.runner import Case


@dataclasses.dataclass(frozen=True)
class ReductionRecord:
    """One declared reduction, judged on one case."""

    family: str
    impl: str
    mesh: str
    reduction: str


def reduction_jitted(case: Case, reduction: str) -> Any:
    """``case``'s kernel called with ``reduction=``, jitted."""
    kernel = runner.bound(
        case.family, case.impl, case.mesh, case.platform, case.mesh.axis_name, case.dma_mode, dtype=case.dtype
    )
    return jax.jit(lambda *operands: kernel(*operands, reduction=reduction))


def reduction_program(case: Case, reduction: str) -> Any:
    """:func:`reduction_jitted` compiled as the case's own program is
    (:func:`conformance.runner.compile_lowered`): the program this check runs."""
    lowered = reduction_jitted(case, reduction).lower(*runner.abstract_args(case))
    return runner.compile_lowered(lowered, case.platform)


def _run(case: Case, reduction: str, inputs: tuple[np.ndarray, ...]) -> jax.Array:
    return watchdog.run_guarded(case, reduction_program(case, reduction), runner.place(case, inputs))


def check_other_reductions(case: Case) -> list[ReductionRecord]:
    """Each reduction the kernel declares beside the family's own (``reduction=NAME``): every shard
    equal to the float64 reference of that reduction, in the family's result sharding."""
    spec, impl = case.spec, case.implementation
    records = []
    inputs = runner.make_inputs(case)
    inputs64 = tuple(a.astype(np.float64) for a in inputs)
    for reduction in impl.other_reductions:
        check = f"other_reductions[{reduction}]"
        out = call_kernel(case, "other_reductions", lambda r=reduction: _run(case, r, inputs))
        if not isinstance(out, jax.Array):
            raise fail(case, "other_reductions", f"reduction={reduction!r} does not return a jax.Array")
        expected = spec.other_reductions[reduction](*inputs64)
        compare_shards(
            case,
            "other_reductions",
            out,
            expected,
            np.zeros_like(expected),
            subject=f"reduction={reduction!r}: values differ",
            rule=f"exact: a {reduction} rounds nothing ({check})",
        )
        wanted = runner.expected_out_sharding(case)
        if not out.sharding.is_equivalent_to(wanted, out.ndim):
            raise fail(
                case,
                "other_reductions",
                f"reduction={reduction!r}: the result is not in the family's sharding",
                [f"sharding       : {out.sharding.spec}, expected {wanted.spec}"],
            )
        records.append(ReductionRecord(case.family, case.impl, case.mesh.label, reduction))
    return records


CHECKS = (
    Check(
        "other_reductions",
        check_other_reductions,
        concern="result",
        # what a min or max gets wrong (a zero start, a combine left as an addition, a ring of one that
        # returns its input unreduced) turns on the reduction as a dtype does, and on the ring's loop: a
        # ring of one, an odd ring and the longest, at the odd fixed shape (both halves of a bidirectional
        # ring carry rows); where a neighbour's partial lands on a 2-D or 3-D mesh is the sum's, which the
        # values check draws on every mesh
        axes=Axes(
            meshes="loop_lengths",
            implementations=("other_reductions",),
            families_with="other_reductions",
        ),
    ),
)
