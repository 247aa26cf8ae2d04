"""Per-dtype tolerances, in one place, derived from each dtype's precision.

Ground truth is numpy float64 on the inputs *as rounded to the dtype*, so input
rounding is not part of the error; only the kernel's own arithmetic is.

* Data movement (gathers, permutes) must be exact: tolerance 0 for every dtype.
* A dot product of length K computed in a precision with unit roundoff ``u``
  (any accumulation order, any accumulator at least that precise) then
  rounded once to the output dtype obeys Higham's bound (*Accuracy and Stability
  of Numerical Algorithms*, Thm 3.5)::

      |fl(a . b) - a . b|  <=  gamma_{K+1} * (|a| . |b|),   gamma_n = n u / (1 - n u)

  so the tolerance is elementwise, scaled by ``|lhs| @ |rhs|``: it tightens where
  the terms are small and never excuses a wrong row or column (whose error is of
  the order of ``|lhs| @ |rhs|`` itself, far above ``gamma_{K+1}`` for the K the
  strategies draw).
  Higham's bound is relative and assumes no underflow. A result (or a product) in the dtype's
  subnormal range is rounded to an absolute spacing instead: each such rounding errs by up to
  :data:`UNDERFLOW_ERROR` (half the subnormal spacing; Higham eq. 2.8, gradual underflow, where
  sums of subnormals are exact), so the bound adds ``(K + 1) * (1 + gamma_{K+1}) * eta``: one per
  product and one for the final rounding. It matters for float16 only (subnormals below 6.1e-5,
  spacing 6e-8), where a gradient of small terms lands there; for the other dtypes it is below
  1e-38.
* A sum of n partials (a reduce-scatter, an all-reduce) computed in ``dtype`` in any order, each
  addition rounded, is within ``gamma_n * sum |part|`` of the exact sum (:func:`reduction_tolerance`):
  the bound allows a rounding per ring hop; the accuracy check holds a kernel to the baseline's own
  error, which sums in float32 and rounds once. Partials in float8 are the exception: with 4 or 3
  significand bits a rounding per hop errs by 6% or 12% of each partial sum and ``gamma_n`` is
  unbounded from n = 16 (e4m3) or 8 (e5m2), a bound that would excuse a partial dropped whole. So
  their sum is held to what every float8 reduction does (XLA's own and the built-ins: summed in
  float32, the partial sums' dtype the byte bounds allow, rounded once): one float8 rounding of the
  exact sum plus float32's ``gamma_n * sum |part|`` and one float8 underflow.
* Integer dtypes are exact: the strategies keep values small enough that no
  partial sum can overflow (int8 operands in [-8, 8] summed into int32).
* A mixed-precision pair (:mod:`conformance.dtypes`: float8 operands with a bfloat16 or float32
  result, int8 with int32) is held to the bound at its *result* dtype: the products of two float8
  values (4 and 3 significand bits) are exact in float32 and in bfloat16's 8 bits, so the only
  rounding is the accumulation's and the final one, at least as precise as the result dtype; the
  inputs are already rounded to float8. A float8 dtype moved as it is (an all-gather) is exact.
"""

from __future__ import annotations

import numpy as np

from conformance import dtypes

#: Unit roundoff u = 2**-p for a p-bit significand (implicit bit included).
UNIT_ROUNDOFF: dict[str, float] = {
    "float64": 2.0**-53,
    "float32": 2.0**-24,
    "float16": 2.0**-11,
    "bfloat16": 2.0**-8,
    "float8_e4m3fn": 2.0**-4,
    "float8_e5m2": 2.0**-3,
}

#: Half the spacing of the dtype's subnormals, ``2**(emin - p)``: what one rounding into the
#: subnormal range may err by, whatever the magnitude (float64's underflows to 0 here, harmlessly).
UNDERFLOW_ERROR: dict[str, float] = {
    "float64": 0.0,
    "float32": 2.0**-150,
    "float16": 2.0**-25,
    "bfloat16": 2.0**-134,
    "float8_e4m3fn": 2.0**-10,
    "float8_e5m2": 2.0**-17,
}

#: The float8 dtypes, whose sums are carried in float32 (:func:`reduction_tolerance`).
FLOAT8 = ("float8_e4m3fn", "float8_e5m2")

#: Largest |value| the input generators produce for integer dtypes.
INTEGER_INPUT_BOUND = 8


def is_exact(dtype: str) -> bool:
    """Whether arithmetic whose result is in ``dtype`` (a pair's result dtype) is exact: integers."""
    return dtypes.result(dtype) not in UNIT_ROUNDOFF


class Unbounded(ValueError):
    """The worst-case bound says nothing at this size (``n * u >= 1``): judge another way
    (:data:`BASELINE_ERROR_FACTOR`)."""


def gamma(n: int, dtype: str) -> float:
    """Higham's gamma_n for ``dtype`` (a pair's result dtype); 0 for exact (integer) dtypes;
    :class:`Unbounded` where ``n * u >= 1`` (bfloat16 from n = 256)."""
    dtype = dtypes.result(dtype)
    if is_exact(dtype):
        return 0.0
    nu = n * UNIT_ROUNDOFF[dtype]
    if nu >= 1:
        raise Unbounded(f"gamma_{n} is unbounded for {dtype} (n * u = {nu:.3g} >= 1)")
    return nu / (1 - nu)


#: Where the worst-case bound is unbounded (a bfloat16 contraction of 256 or more: every real bfloat16
#: matmul), an element may be off by at most this many times the family baseline's largest error on
#: the same inputs, plus one unit in the last place of the result dtype at its value. Why 2: a kernel
#: that accumulates as the baseline does (float32 partials, one rounding at the end) has errors of the
#: same distribution, its largest within a factor of about 1.5 of the baseline's over the thousands of
#: elements the checks compare (summation order moves individual roundings, not their size); one
#: that rounds partial sums to bfloat16 between ring steps errs by many times more, and a misplaced
#: block by the size of the values themselves. The accuracy check holds the rms error to the
#: baseline's more tightly (:data:`ACCURACY_RATIO_LIMIT`).
BASELINE_ERROR_FACTOR = 2.0


def baseline_relative_tolerance(expected: np.ndarray, baseline_error: np.ndarray, dtype: str) -> np.ndarray:
    """The elementwise tolerance of :data:`BASELINE_ERROR_FACTOR`: ``expected``'s float64 values,
    ``baseline_error`` the baseline's ``|computed - expected|`` on the same inputs."""
    result = dtypes.result_np(dtype)
    ulp = np.spacing(np.abs(expected).astype(result)).astype(np.float64)
    return BASELINE_ERROR_FACTOR * float(np.max(baseline_error, initial=0.0)) + ulp


def data_movement_tolerance(shape: tuple[int, ...]) -> np.ndarray:
    """Gathers and permutes copy bits: zero tolerance."""
    return np.zeros(shape)


def matmul_tolerance(lhs: np.ndarray, rhs: np.ndarray, dtype: str) -> np.ndarray:
    """Elementwise bound on ``|computed - exact|`` for ``lhs @ rhs`` computed in ``dtype`` (a pair's
    result dtype)."""
    k = lhs.shape[-1]
    g = gamma(k + 1, dtype)
    underflow = 0.0 if is_exact(dtype) else (k + 1) * (1 + g) * UNDERFLOW_ERROR[dtypes.result(dtype)]
    return g * (np.abs(lhs) @ np.abs(rhs)) + underflow


def reduction_tolerance(parts: np.ndarray, dtype: str) -> np.ndarray:
    """Elementwise bound on ``|computed - exact|`` for ``parts.sum(0)`` (the n partials of a
    reduce-scatter or all-reduce, stacked on the leading axis) computed in ``dtype`` in any order, each
    of the n - 1 additions rounded and the result rounded once: Higham's recursive-summation bound
    ``gamma_n * sum |part|`` (Thm 4.3 with the final rounding), plus one underflow rounding per
    addition. Exact (0) for integers and for a ring of one, which adds nothing and may only cast.
    float8 partials are summed in float32 and rounded once (module doc): one float8 rounding of the
    sum, and float32's recursive-summation bound."""
    n = parts.shape[0]
    if n == 1:
        return np.zeros(parts.shape[1:])
    if dtype in FLOAT8:  # carried in float32, rounded once (module doc)
        u, wide = UNIT_ROUNDOFF[dtype], gamma(n, "float32") * np.abs(parts).sum(0)
        return u * np.abs(parts.sum(0)) + (1 + u) * wide + UNDERFLOW_ERROR[dtype]
    g = gamma(n, dtype)
    underflow = 0.0 if is_exact(dtype) else n * (1 + g) * UNDERFLOW_ERROR[dtypes.result(dtype)]
    return g * np.abs(parts).sum(0) + underflow


def matmul_vjp_reference(lhs: np.ndarray, rhs: np.ndarray, ct: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Gradients of ``lhs @ rhs`` for cotangent ``ct`` (float64): ``(ct @ rhs.T, lhs.T @ ct)``."""
    return ct @ rhs.T, lhs.T @ ct


def matmul_vjp_tolerance(lhs, rhs, ct, dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """Higham's bound for each gradient: contractions of length N (``d_lhs``) and M (``d_rhs``)."""
    return matmul_tolerance(ct, rhs.T, dtype), matmul_tolerance(lhs.T, ct, dtype)


#: An implementation fails the accuracy check when its rms error exceeds the
#: baseline's (same inputs, both against float64) by more than this factor.
ACCURACY_RATIO_LIMIT = 1.25
ACCURACY_RATIO_REASON = (
    "the rms error over the >= 4096 outputs the check compares has a sampling spread of about 1%, so an "
    "equally accurate kernel measures 1.00 +- 0.03; one extra rounding of comparable size "
    "per output already gives sqrt(2) = 1.41"
)
