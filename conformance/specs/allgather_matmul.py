"""Family ``allgather_matmul``: all-gather the LHS rows, multiply by a column-sharded RHS.

``fn(lhs, rhs, *, mesh, axis_name)`` with ``lhs`` ``[M, K]`` sharded
``P(axis_name, None)`` and ``rhs`` ``[K, N]`` sharded ``P(None, axis_name)``
returns ``lhs @ rhs``, ``[M, N]``, sharded ``P(None, axis_name)``. On a 2-D
mesh the other axis is replicated.

Each device needs every row of ``lhs`` against its own columns of ``rhs``, so
it must receive the ``n - 1`` row blocks it does not hold: ``(n-1)/n`` of
``lhs``. That is both the lower bound and, for this family, the upper bound:
data may move only by collective-permutes (a ring), never by all-gather,
all-reduce, reduce-scatter or all-to-all.

Gradients (``ct``: the cotangent, sharded like the output, by columns):
``d_rhs = lhs.T @ ct`` needs the gathered ``lhs`` again (or a saved copy), and
``d_lhs = ct @ rhs.T`` is a sum over every device's columns scattered by rows:
a matmul + reduce-scatter. So the backward may receive ``(n-1)/n`` of ``lhs``
plus ``(n-1)/n`` of one ``[M, K]`` partial of ``d_lhs`` (float32 for 16-bit
floats), by collective-permutes only.
"""

from __future__ import annotations

import numpy as np
from jax.sharding import PartitionSpec as P

from conformance import tolerances
from conformance.specs.base import (
    BATCH_DIMS_OPTION,
    BadInput,
    Dims,
    FamilySpec,
    Operand,
    partial_itemsize,
)


def _lhs_shape(d: Dims, n: int) -> tuple[int, int]:
    return (d["rows_per_shard"] * n, d["K"])


def _rhs_shape(d: Dims, n: int) -> tuple[int, int]:
    return (d["K"], d["cols_per_shard"] * n)


def _out_shape(d: Dims, n: int) -> tuple[int, int]:
    return (d["rows_per_shard"] * n, d["cols_per_shard"] * n)


def _lhs_bytes_not_held(d: Dims, n: int, itemsize: int) -> int:
    """(n-1)/n of lhs: the row blocks a device does not hold."""
    return (n - 1) * d["rows_per_shard"] * d["K"] * itemsize


def _backward_bytes(d: Dims, n: int, itemsize: int) -> int:
    """lhs gathered again, plus the reduce-scatter of d_lhs's partials."""
    return (n - 1) * d["rows_per_shard"] * d["K"] * (itemsize + partial_itemsize(itemsize))


def _bad_inputs(n: int) -> tuple[BadInput, ...]:
    m_bad, n_bad, k = 2 * n + 1, 3 * n + 1, 4
    divisibility = (
        BadInput(
            f"M={m_bad} rows not divisible by the axis size {n}",
            ((m_bad, k), (k, n)),
            None,
            (str(m_bad), str(n)),
        ),
        BadInput(
            f"N={n_bad} columns not divisible by the axis size {n}",
            ((n, k), (k, n_bad)),
            None,
            (str(n_bad), str(n)),
        ),
    )
    unknown_axis = (
        BadInput(
            "axis_name 'nonexistent_axis' is not a mesh axis",
            ((n, k), (k, n)),
            "nonexistent_axis",
            ("nonexistent_axis",),
        ),
    )
    # every size is divisible by a ring of one: there the only forbidden input is the unknown axis
    return (divisibility if n > 1 else ()) + unknown_axis


def _block_tags(
    shapes: tuple[tuple[int, ...], ...], n: int, sources: tuple[int, ...]
) -> tuple[np.ndarray, np.ndarray]:
    """``lhs`` zero but column 0 of the rows of the ring positions ``sources`` (position ``s``'s carry
    ``s + 1``), and ``rhs`` zero but a row of ones: ``lhs @ rhs`` is each row's tag, in every column."""
    lhs_shape, rhs_shape = shapes
    lhs, rhs = np.zeros(lhs_shape), np.zeros(rhs_shape)
    rows = lhs_shape[-2] // n
    for s in sources:
        lhs[..., s * rows : (s + 1) * rows, 0] = s + 1
    rhs[0, :] = 1
    return lhs, rhs


ALLGATHER_MATMUL = FamilySpec(
    name="allgather_matmul",
    summary="lhs[M,K] P(axis,None) @ rhs[K,N] P(None,axis) -> [M,N] P(None,axis)",
    operands=(
        Operand("lhs", lambda a: P(a, None), _lhs_shape),
        Operand("rhs", lambda a: P(None, a), _rhs_shape),
    ),
    out_spec=lambda a: P(None, a),
    out_shape=_out_shape,
    dims=("rows_per_shard", "K", "cols_per_shard"),
    canonical_dims={"rows_per_shard": 3, "K": 8, "cols_per_shard": 2},
    #: K stays <= 32 so that gamma_{K+1} for bfloat16 (about K * 2**-8) stays well below 1 and the
    #: tolerance stays tight.
    dim_values={"rows_per_shard": (1, 2, 3, 5, 8), "K": (1, 3, 8, 16, 32), "cols_per_shard": (1, 2, 3, 8)},
    # and mixed precision (conformance.dtypes): float8 operands with a bfloat16 or float32 result, int8
    # with int32; a kernel claims a pair by naming it, and is told the result dtype with out_dtype=
    dtypes=(
        "float32",
        "bfloat16",
        "float16",
        "int32",
        "float8_e4m3fn_to_bfloat16",
        "float8_e5m2_to_float32",
        "int8_to_int32",
    ),
    reference=lambda lhs, rhs: lhs @ rhs,
    tolerance=tolerances.matmul_tolerance,
    allowed_collectives=frozenset({"collective-permute"}),
    max_received_bytes=_lhs_bytes_not_held,
    min_received_bytes=_lhs_bytes_not_held,
    bad_inputs=_bad_inputs,
    byte_bound_text="each device may receive at most (n-1)/n of lhs",
    vjp_reference=tolerances.matmul_vjp_reference,
    vjp_tolerance=tolerances.matmul_vjp_tolerance,
    backward_allowed_collectives=frozenset({"collective-permute"}),
    backward_max_received_bytes=_backward_bytes,
    backward_byte_bound_text="(n-1)/n of lhs plus (n-1)/n of one [M, K] partial of d_lhs",
    accuracy_dtypes=("bfloat16", "float16", "float8_e4m3fn_to_bfloat16"),
    accuracy_dims={"rows_per_shard": 16, "K": 32, "cols_per_shard": 16},
    accuracy_baseline_does="gathers lhs exactly (data movement), then one dot per output block that "
    "accumulates all K products in float32 and rounds once to the output dtype",
    accuracy_how_to_match="accumulate in float32 (jnp.dot(..., preferred_element_type=jnp.float32)) and "
    "cast to the output dtype once, after the last partial product, not per ring step",
    overlap=(
        "issue each ring step's transfer before the matmul of the block already in hand, and let that "
        "matmul read only the block in hand (not what the transfer delivers, nor a value computed after "
        "it)"
    ),
    pacing=(
        "make each step's transfer wait for the previous step's matmul: `held, _ = "
        "lax.optimization_barrier((held, previous_product))` just before the step's `ppermute` (free at "
        "run time; conformance.kernels._ring.after), so the scheduler cannot run the transfers first as "
        "a chain and the matmuls after"
    ),
    tpu_native_dims={"rows_per_shard": 32, "K": 128, "cols_per_shard": 128},
    # Per hop a device sends its [rows_per_shard, K] block: 256 KiB, 1 MiB, 4 MiB of bfloat16.
    schedule_ladder=(
        {"rows_per_shard": 256, "K": 512, "cols_per_shard": 1024},
        {"rows_per_shard": 512, "K": 1024, "cols_per_shard": 1024},
        {"rows_per_shard": 1024, "K": 2048, "cols_per_shard": 1024},
    ),
    # activations [batch, seq, emb] gathered or scattered along the sequence: lhs takes the batch
    batched_operands=("lhs",),
    batch_folds_into="rows_per_shard",
    registration_options={"batch_dims": BATCH_DIMS_OPTION},
    block_tags=_block_tags,
)

#: This module's family (:mod:`conformance.specs` collects it).
SPEC = ALLGATHER_MATMUL
