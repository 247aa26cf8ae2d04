"""The matmul tolerance holds where a result underflows, and stays tight there."""

from __future__ import annotations

import numpy as np
import pytest

from conformance import tolerances

pytestmark = pytest.mark.selftest


def _subnormal_products(n: int) -> tuple[np.ndarray, np.ndarray]:
    """float16 pairs whose product lies in float16's subnormal range (below 6.1e-5)."""
    rng = np.random.default_rng(0)
    lhs = rng.uniform(1e-3, 4e-3, size=(n, 1)).astype(np.float16)
    rhs = rng.uniform(1e-3, 1.5e-2, size=(1, n)).astype(np.float16)
    return lhs, rhs


def test_a_float16_product_rounded_into_the_subnormals_is_within_tolerance() -> None:
    """Every float16 product in the subnormal range, rounded as a kernel rounds it, is within the
    tolerance; the relative bound alone (no underflow term) rejects some of them."""
    lhs, rhs = _subnormal_products(256)
    exact = lhs.astype(np.float64) @ rhs.astype(np.float64)
    assert (np.abs(exact) < np.finfo(np.float16).tiny).mean() > 0.9
    rounded = (exact.astype(np.float16)).astype(np.float64)  # one rounding into float16
    error = np.abs(rounded - exact)
    tolerance = tolerances.matmul_tolerance(lhs.astype(np.float64), rhs.astype(np.float64), "float16")
    assert (error <= tolerance).all(), float((error - tolerance).max())
    relative_only = tolerances.gamma(2, "float16") * np.abs(exact)
    assert (error > relative_only).any(), "no product needed the underflow term: the test shows nothing"


def test_the_underflow_term_is_a_few_subnormal_spacings() -> None:
    """A value three subnormal spacings off is still wrong: the term excuses rounding, not errors."""
    lhs, rhs = _subnormal_products(16)
    tolerance = tolerances.matmul_tolerance(lhs.astype(np.float64), rhs.astype(np.float64), "float16")
    spacing = float(np.finfo(np.float16).smallest_subnormal)
    assert (3 * spacing > tolerance).all()
    assert tolerances.UNDERFLOW_ERROR["float16"] == spacing / 2


# ----------------------------------------------------------------------------- beyond the bound


def _values(impl: str, family: str, dims: dict[str, int]):
    import conformance.kernels
    import conformance.selftest.broken_matmul_reduce_scatter_kernels  # noqa: F401
    from conformance import checks
    from conformance.fixtures.meshes import parse_mesh
    from conformance.run.outcomes import run_here
    from conformance.runner import Case
    from conformance.session import Session

    case = Case.make(family, impl, parse_mesh("4-x-auto"), dims, "bfloat16")
    return run_here(checks.CHECKS["values"], case, Session())


def test_a_bfloat16_contraction_of_256_or_more_is_judged_against_the_baseline() -> None:
    """gamma_K says nothing for bfloat16 from K = 256 (K * u >= 1): the built-in ring passes on the
    baseline's error (the check raised "gamma_257 is unbounded"), and a ring that sends its partial
    sums the wrong way fails, naming the rule that judged. (Partial sums rounded to bfloat16 between
    steps are within it, as within the bound at small K: the accuracy check is theirs.)"""
    with pytest.raises(tolerances.Unbounded):
        tolerances.gamma(257, "bfloat16")
    dims = {"rows_per_shard": 8, "k_per_shard": 128, "cols": 64}  # K = 512 on a ring of 4
    passed = _values("ring_matmul_reduce_scatter_unidirectional", "matmul_reduce_scatter", dims)
    assert passed.verdict == "passed", passed
    failed = _values("broken_mrs_wrong_neighbour", "matmul_reduce_scatter", dims)
    assert failed.verdict == "failed", failed
    message = str(failed.failure)
    assert "tolerance rule : gamma_513 is unbounded for bfloat16" in message, message
    assert "2x the largest error of xla_matmul_reduce_scatter on the same inputs" in message, message


@pytest.mark.parametrize("dtype", ["float8_e4m3fn", "float8_e5m2"])
def test_a_float8_sum_is_held_to_one_rounding_of_a_float32_sum(dtype: str) -> None:
    """On a ring of 8 (where e5m2's recursive-summation bound is unbounded) the float8 tolerance admits
    the float32 sum rounded once to float8, and not the sum with one partial dropped."""
    import ml_dtypes

    rng = np.random.default_rng(0)
    f8 = np.dtype(getattr(ml_dtypes, dtype))
    parts = rng.standard_normal((8, 64, 16)).astype(f8).astype(np.float64)
    exact = parts.sum(0)
    tol = tolerances.reduction_tolerance(parts, dtype)
    assert np.isfinite(tol).all()
    rounded_once = parts.astype(np.float32).sum(0).astype(f8).astype(np.float64)
    assert (np.abs(rounded_once - exact) <= tol).all()
    dropped = parts[1:].sum(0)
    assert (np.abs(dropped - exact) > tol).mean() > 0.75  # a partial near zero hides in any bound
