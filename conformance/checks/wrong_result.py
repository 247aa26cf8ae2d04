"""What names a wrong result's cause beyond where its blocks landed: a known mistake of the family
that the result matches, and the family's own account of what the result lacks or holds
(:attr:`conformance.specs.base.FamilySpec.explain_wrong`). The values checks' explanations
(:func:`conformance.checks.base.compare_with_reference`) end with these lines."""

from __future__ import annotations

import jax
import numpy as np

from conformance import runner
from conformance.runner import Case


def known_mistakes(
    case: Case, inputs64: tuple[np.ndarray, ...], out: jax.Array, tol: np.ndarray | float
) -> list[str]:
    """A line per mistake of the family's spec (:attr:`~conformance.specs.base.FamilySpec.known_mistakes`)
    whose result the kernel's matches, within the tolerance: the defect named by what it is."""
    if not case.spec.known_mistakes or jax.process_count() > 1:  # a rank sees its own shards only
        return []
    got = runner.global_value(out).astype(np.float64)
    return [
        f"known mistake  : the result is exactly what {mistake.description} gives"
        for mistake in case.spec.known_mistakes
        if np.all(np.abs(got - mistake.result(inputs64, axis_size=case.mesh.axis_size)) <= tol)
    ]


def family_explains(
    case: Case, inputs64: tuple[np.ndarray, ...], out: jax.Array, tol: np.ndarray | float
) -> list[str]:
    """What the family says a wrong result lacks or holds
    (:attr:`~conformance.specs.base.FamilySpec.explain_wrong`); not in a multi-process job, where a rank
    sees its own shards only."""
    if case.spec.explain_wrong is None or jax.process_count() > 1:
        return []
    got = runner.global_value(out).astype(np.float64)
    names = case.spec.operand_names

    def rerun(**replaced: np.ndarray) -> np.ndarray:
        """The kernel's result on the case's inputs with the operands named replaced (float64)."""
        arrays = tuple(replaced.get(name, a) for name, a in zip(names, inputs64, strict=True))
        ran = runner.execute(case, inputs=runner.as_operands(case, arrays))[1]
        return runner.global_value(ran).astype(np.float64)

    return case.spec.explain_wrong(
        *inputs64, got, tol, axis_size=case.mesh.axis_size, dtype=case.dtype, rerun=rerun
    )
