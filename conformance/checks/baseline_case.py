"""The family baseline a kernel is compared with on the same inputs (the accuracy checks, and the
values check where the worst-case bound says nothing): its name, and its case for a kernel's case."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from conformance import registry, runner, specs
from conformance.runner import Case
from conformance.specs.base import BATCH_DIM


def baseline_of(family: str) -> str:
    found = registry.reference_baseline(family)
    if found is None:
        raise ValueError(f"family {family} has no registered baseline to compare accuracy with")
    return found.name


def on_the_baseline(case: Case, baseline: str) -> tuple[Case, Any, Any]:
    """The baseline's case for ``case``, and how to fold ``case``'s arrays into it and its results back:
    the same case, or for a batched kernel's (the baseline takes the 2-D form) the 2-D case with the
    batch folded into the rows, whose dot products are the batched case's, element for element."""
    base_case = dataclasses.replace(case, impl=baseline, dma_mode=None)
    spec, family = case.spec, specs.get(case.family)
    if BATCH_DIM not in spec.dims or BATCH_DIM in registry.spec_of(case.family, baseline).dims:
        return base_case, lambda arrays: arrays, lambda value, like: value
    dims = family.unbatched(case.dims_map)
    base_case = Case.make(
        case.family, baseline, case.mesh, dims, case.dtype, platform=case.platform, seed=case.seed
    )
    batched = [op.name in family.batched_operands for op in family.operands]

    def fold(arrays: tuple[np.ndarray, ...]) -> tuple[np.ndarray, ...]:
        """The operands (and a trailing cotangent, batched like the result) in the 2-D form."""
        flags = [*batched, True][: len(arrays)]
        return tuple(a.reshape(-1, *a.shape[2:]) if on else a for a, on in zip(arrays, flags, strict=True))

    def unfold(value: object, like: np.ndarray) -> np.ndarray:
        return runner.global_value(value).reshape(like.shape)

    return base_case, fold, unfold
