"""Accuracy: an implementation's rms error against float64, forward and per gradient, no worse than
the baseline's (XLA's own op) on the same inputs, within :data:`tolerances.ACCURACY_RATIO_LIMIT`."""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from typing import Any

import numpy as np

from conformance import runner, tolerances
from conformance.checks.autodiff import EXACT_BACKWARD_BY_AUTODIFF
from conformance.checks.base import Axes, Check, call_kernel, fail, keeping, require_array, require_shape
from conformance.checks.baseline_case import baseline_of, on_the_baseline
from conformance.runner import Case
from conformance.specs.base import FamilySpec


@dataclasses.dataclass(frozen=True)
class AccuracyRecord:
    """An implementation's error next to the baseline's, on the same inputs."""

    family: str
    impl: str
    baseline: str
    mesh: str
    dtype: str
    rms: float
    baseline_rms: float
    max_abs: float
    baseline_max_abs: float
    #: The backward check's records: which gradient (``d_lhs``); ``""`` for the forward result.
    gradient: str = ""

    @property
    def ratio(self) -> float:
        return self.rms / self.baseline_rms if self.baseline_rms else (0.0 if not self.rms else np.inf)

    def table(self) -> list[str]:
        width = max(len(self.impl), len(self.baseline) + 11)
        base = f"{self.baseline} (baseline)"
        return [
            f"{'error vs float64':<{width}}  {'rms':>10}  {'max |err|':>10}",
            f"{self.impl:<{width}}  {self.rms:>10.3e}  {self.max_abs:>10.3e}",
            f"{base:<{width}}  {self.baseline_rms:>10.3e}  {self.baseline_max_abs:>10.3e}",
        ]


#: What a backward less accurate than the baseline's points to, and the cure (failure message).
BACKWARD_ACCURACY_HINT = (
    "a gradient that is a sum over the ring (d_lhs of an all-gather matmul, a reduce-scatter of "
    "ct @ rhs.T) rounded to the 16-bit dtype at every hop; a ring differentiated by JAX's own autodiff "
    "(no custom_vjp) does exactly that, since the transpose of each ppermute step carries the "
    "cotangent's dtype"
)
BACKWARD_ACCURACY_CURE = (
    "write the backward as a custom_vjp whose ring carries float32 accumulators "
    "(jnp.dot(..., preferred_element_type=jnp.float32)) and casts to the operand's dtype once, at the end"
)


def backward_accuracy_advice(spec: FamilySpec) -> list[str]:
    """What a backward less accurate than the baseline's points to, and the cure, as the family's
    backward is: a sum over the ring (its accumulators), or the cotangent moved as it is
    (:attr:`~conformance.specs.base.FamilySpec.backward_exact`), where any error is the backward's own."""
    if not spec.backward_exact:
        return [f"points to      : {BACKWARD_ACCURACY_HINT}", f"to match it    : {BACKWARD_ACCURACY_CURE}"]
    return [
        f"points to      : arithmetic where the exact gradient needs none ({spec.backward_exact}; the "
        "baseline's backward is exact): the backward adds or rounds in the 16-bit dtype what it should only "
        f"move. {EXACT_BACKWARD_BY_AUTODIFF}",
        f"to match it    : write the backward as a custom_vjp that gives each device its gradient as the "
        f"math has it ({spec.backward_exact}), moving only that ({spec.backward_byte_bound_text})",
    ]


def _measured(
    case: Case, baseline: str, out: object, base_out: object, exact: np.ndarray, gradient: str = ""
) -> AccuracyRecord:
    """The rms and largest errors of ``out`` and of the baseline's ``base_out`` against ``exact``."""

    def value(result: object) -> np.ndarray:  # a result of the kernel, or one unfolded already
        return result if isinstance(result, np.ndarray) else runner.global_value(result)

    err = value(out).astype(np.float64) - exact
    base_err = value(base_out).astype(np.float64) - exact
    return AccuracyRecord(
        case.family,
        case.impl,
        baseline,
        case.mesh.label,
        case.dtype,
        float(np.sqrt(np.mean(err**2))),
        float(np.sqrt(np.mean(base_err**2))),
        float(np.max(np.abs(err))),
        float(np.max(np.abs(base_err))),
        gradient=gradient,
    )


def check_accuracy(case: Case) -> AccuracyRecord:
    """The implementation's rms error is no worse than the baseline's on the same inputs.

    Both are measured against numpy float64; the limit is
    :data:`tolerances.ACCURACY_RATIO_LIMIT` times the baseline's rms error (see
    there for why). This catches what the elementwise bound cannot: partial
    sums rounded to a 16-bit dtype between ring steps.
    """
    baseline = baseline_of(case.family)
    if case.impl == baseline:
        raise ValueError(f"{case.impl} is the baseline of {case.family}: nothing to compare with")
    inputs = runner.make_inputs(case)
    inputs64, out = call_kernel(case, "accuracy", lambda: runner.execute(case, inputs=inputs))
    require_array(case, "accuracy", out)
    base_case, fold, unfold = on_the_baseline(case, baseline)
    _, base_out = call_kernel(case, "accuracy", lambda: runner.execute(base_case, inputs=fold(inputs)))
    exact = case.spec.expected(inputs64, axis_size=case.mesh.axis_size)
    require_shape(case, "accuracy", out, exact.shape)
    record = _measured(case, baseline, out, unfold(base_out, exact), exact)
    with keeping([record]):
        limit = tolerances.ACCURACY_RATIO_LIMIT
        if not record.ratio <= limit:
            spec = case.spec
            why = [f"the baseline   : {spec.accuracy_baseline_does}"] if spec.accuracy_baseline_does else []
            why += [f"to match it    : {spec.accuracy_how_to_match}"] if spec.accuracy_how_to_match else []
            raise fail(
                case,
                "accuracy",
                f"clearly less accurate than the baseline {baseline}",
                [
                    *record.table(),
                    f"rms ratio      : {record.ratio:.2f} "
                    f"(limit {limit}: {tolerances.ACCURACY_RATIO_REASON})",
                    *why,
                ],
            )
    return record


def check_backward_accuracy(case: Case) -> list[AccuracyRecord]:
    """Each gradient's rms error is no worse than the baseline's backward on the same inputs and
    cotangent (both against the float64 transpose math), within the forward check's limit."""
    spec, baseline = case.spec, baseline_of(case.family)
    if spec.vjp_reference is None:
        raise ValueError(f"family {case.family} defines no gradients")
    inputs, ct = runner.make_inputs(case), runner.make_cotangent(case)
    base_case, fold, unfold = on_the_baseline(case, baseline)
    *base_inputs, base_ct = fold((*inputs, ct))

    def pullback(of: Case, inputs: tuple, ct: np.ndarray) -> tuple:
        return call_kernel(
            case, "backward_accuracy", lambda: runner.execute_pullback(of, inputs=inputs, cotangent=ct)
        )

    inputs64, ct64, grads = pullback(case, inputs, ct)
    _, _, base_grads = pullback(base_case, tuple(base_inputs), base_ct)
    records = []
    data = [op for op in spec.operands if op.is_data]  # a routing has no gradient
    for operand, grad, base_grad, exact in zip(
        data, grads, base_grads, spec.vjp_reference(*inputs64, ct64), strict=True
    ):
        require_shape(case, "backward_accuracy", grad, exact.shape, what=f"d_{operand.name}")
        base = unfold(base_grad, exact)
        records.append(_measured(case, baseline, grad, base, exact, gradient=f"d_{operand.name}"))
    with keeping(records):
        limit = tolerances.ACCURACY_RATIO_LIMIT
        worse = [r for r in records if not r.ratio <= limit]
        if worse:
            lines = []
            for r in worse:
                lines += [f"{r.gradient}:", *("  " + t for t in r.table()), f"  rms ratio    : {r.ratio:.2f}"]
            raise fail(
                case,
                "backward_accuracy",
                f"{', '.join(r.gradient for r in worse)} clearly less accurate than the baseline "
                f"{baseline}'s backward",
                [
                    *lines,
                    f"limit          : {limit} ({tolerances.ACCURACY_RATIO_REASON})",
                    *backward_accuracy_advice(spec),
                ],
            )
    return records


def accuracy_table(title: str, records: list[Any]) -> list[tuple[str, list[str]]]:
    """One line per implementation, dtype and gradient: the ratio's range over meshes, the worst case."""
    if not records:
        return []
    width = max(len(r.impl) for r in records)
    rows: dict[tuple[str, str, str, str], list] = defaultdict(list)
    for r in records:
        rows[(r.family, r.impl, r.dtype, r.gradient)].append(r)
    lines = []
    for (family, impl, dtype, gradient), recs in sorted(rows.items()):
        worst = max(recs, key=lambda r: (r.ratio, r.rms, r.mesh))  # ties: the larger error, by name after
        low = min(r.ratio for r in recs)
        span = f"{low:.2f}-{worst.ratio:.2f}" if f"{low:.2f}" != f"{worst.ratio:.2f}" else f"{low:.2f}"
        rms = f"{worst.rms:.3e} / {worst.baseline_rms:.3e}"
        lines.append(
            f"{family:<21} {impl:<{width}}  {dtype:<9} {gradient:<6} ratio {span:>9} on "
            f"{len(recs):>2} meshes; worst {worst.mesh}: {rms}"
        )
    return [(title, lines)]


CHECKS = (
    Check(
        "accuracy",
        check_accuracy,
        concern="precision",
        tables=lambda records: accuracy_table(
            "accuracy: rms error vs float64, implementation / baseline (same inputs)", records
        ),
        # the error a rounding per ring step adds grows with the steps: on a ring of 4 a kernel that rounds
        # its partial sums at every hop is 1.1x the baseline's error, inside the 1.25x limit, on the ring
        # of 8 1.5x; so the longest ring (fixtures.meshes.LONGEST_RING_MESHES), where it shows most
        axes=Axes(
            case="accuracy",
            meshes="longest_ring",
            dtypes="accuracy_dtypes",
            implementations=("not_baseline",),
        ),
        doc="rms error against float64, side by side with the baseline's on the same inputs.",
    ),
    Check(
        "backward_accuracy",
        check_backward_accuracy,
        concern="precision",
        tables=lambda records: accuracy_table(
            "backward accuracy: each gradient's rms error vs float64, implementation / baseline", records
        ),
        # as the forward: the longest ring, where a rounding per hop shows most
        axes=Axes(
            case="accuracy",
            meshes="longest_ring",
            dtypes="accuracy_dtypes",
            implementations=("differentiable", "not_baseline"),
        ),
        doc="Each gradient's rms error against float64, side by side with the baseline's backward on the "
        "same inputs and cotangent.",
    ),
)
