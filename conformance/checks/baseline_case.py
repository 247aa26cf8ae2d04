"""The family baseline a kernel is compared with on the same inputs (the accuracy checks, and the
values check where the worst-case bound says nothing): its name, its case for a kernel's case, and
its result on a kernel's inputs."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np

from conformance import registry, runner
from conformance.runner import Case


def baseline_of(family: str) -> str:
    found = registry.reference_baseline(family)
    if found is None:
        raise ValueError(f"family {family} has no registered baseline to compare accuracy with")
    return found.name


def on_the_baseline(case: Case, baseline: str) -> tuple[Case, Any, Any]:
    """The baseline's case for ``case``, and how to fold ``case``'s arrays into it and its results back:
    the same case, or for a kernel of a derived form (a batched one's, a transposed one's:
    :class:`conformance.specs.base.FormChange`) the family form's case, e.g. a batched case's 2-D case
    with the batch folded into the rows, whose dot products are the batched case's, element for
    element."""
    base_case = dataclasses.replace(case, impl=baseline, dma_mode=None)
    form = case.spec.family_form
    if form is None or registry.spec_of(case.family, baseline) is case.spec:
        return base_case, lambda arrays: arrays, lambda value, like: value
    base_case = Case.make(
        case.family,
        baseline,
        case.mesh,
        form.dims(case.dims_map),
        case.dtype,
        platform=case.platform,
        seed=case.seed,
    )

    folded: list[tuple] = []  # the case's arrays of this baseline run, which unfolding may read

    def fold(arrays: tuple) -> tuple:
        folded[:] = [tuple(arrays)]
        return form.fold(arrays)

    def unfold(value: object, like: np.ndarray) -> np.ndarray:
        return form.unfold(runner.global_value(value), like, folded[0])

    return base_case, fold, unfold


def baseline_result(
    case: Case,
    baseline: str,
    inputs64: tuple[np.ndarray, ...],
    expected: np.ndarray,
    *,
    call: Callable[[Callable[[], Any]], Any],
) -> np.ndarray:
    """``baseline``'s result on ``case``'s inputs, in the case's form (a batched case folded into the
    2-D baseline and back), as float64; ``call`` runs the baseline (under ``call_kernel`` where its
    failure is a verdict)."""
    base_case, fold, unfold = on_the_baseline(case, baseline)
    inputs = runner.as_operands(case, inputs64)  # exact: they came from them
    _, base_out = call(lambda: runner.execute(base_case, inputs=fold(inputs)))
    folded = unfold(base_out, expected)
    base = folded if isinstance(folded, np.ndarray) else runner.global_value(folded)
    return np.asarray(base).astype(np.float64)
