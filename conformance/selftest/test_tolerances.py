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
