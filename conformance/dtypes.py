"""The dtypes a case runs at, by name: one dtype for operands and result, or a mixed-precision pair.

A plain name (``float32``, ``bfloat16``, ``float8_e4m3fn``, ``int8``) is the dtype of every operand
and of the result. A pair ``OPERAND_to_RESULT`` (``float8_e4m3fn_to_bfloat16``,
``float8_e5m2_to_float32``, ``int8_to_int32``) is a matmul on narrow operands whose result is wider:
how collective matmuls run on float8 in training and serving stacks (TransformerEngine's collective
GEMMs, PyTorch's fused all-gather scaled matmul) and on int8 with int32 accumulation. The kernel is
told the result's dtype with the keyword ``out_dtype`` (as ``jnp.dot``'s ``preferred_element_type``);
only a kernel that names the pair in ``conformance.register(dtypes=...)`` is checked on it, so no
kernel is called with a keyword it does not take.

What a pair is held to comes from its two dtypes: inputs drawn in the operand dtype, bytes moved at
the operand's itemsize (where operands travel; partial sums at the family's partial itemsize), and
the result's dtype and tolerance (:mod:`conformance.tolerances`) at the result dtype.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np

#: Between a pair's operand dtype and its result dtype.
SEPARATOR = "_to_"
#: One dtype of each width libtpu's layouts tell apart (32-, 16- and 8-bit floats, 8-bit integers):
#: what the JAX-end envs run the TPU layout and the TPU bytes at, in tox.ini's ``version_checks``, and the
#: broken-kernel sweep's scope ``versions`` the layout (tox.ini cannot import it: a house self-test
#: holds the two equal).
LAYOUT_WIDTHS = ("float32", "bfloat16", "float8_e4m3fn", "int8")


def is_mixed(name: str) -> bool:
    """Whether ``name`` is a mixed-precision pair."""
    return SEPARATOR in name


def operand(name: str) -> str:
    """The operands' dtype name: ``float8_e4m3fn`` of ``float8_e4m3fn_to_bfloat16``."""
    return name.split(SEPARATOR, 1)[0]


def result(name: str) -> str:
    """The result's dtype name: ``bfloat16`` of ``float8_e4m3fn_to_bfloat16``; a plain name's own."""
    return name.split(SEPARATOR, 1)[-1]


def operand_np(name: str) -> np.dtype:
    """The operands' numpy dtype (ml_dtypes for bfloat16 and float8)."""
    return np.dtype(jnp.dtype(operand(name)))


def result_np(name: str) -> np.dtype:
    """The result's numpy dtype."""
    return np.dtype(jnp.dtype(result(name)))


def kernel_keywords(name: str) -> dict[str, Any]:
    """What a kernel is called with beyond its operands for a case at ``name``: the result's dtype as
    ``out_dtype`` for a pair, nothing for a plain dtype."""
    return {"out_dtype": jnp.dtype(result(name))} if is_mixed(name) else {}


def describe(name: str) -> str:
    """``float8_e4m3fn operands, bfloat16 result`` for a pair; a plain name as it is."""
    return f"{operand(name)} operands, {result(name)} result" if is_mixed(name) else name
