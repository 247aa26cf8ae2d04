"""Family ``matmul_reduce_scatter``: a K-sharded matmul whose result is reduce-scattered by rows.

``fn(lhs, rhs, *, mesh, axis_name)`` with ``lhs`` ``[M, K]`` sharded
``P(None, axis_name)`` (the contraction is sharded) and ``rhs`` ``[K, N]``
sharded ``P(axis_name, None)`` returns ``lhs @ rhs``, ``[M, N]``, sharded
``P(axis_name, None)``. On a 2-D mesh the other axis is replicated.

Every device holds a partial product, an ``[M, N]`` addend of the result, and
must end up with the sum of all n partials' row block. It must receive
contributions to its ``m = M/n`` rows from the n - 1 others: at least
``(n-1) m N`` elements. Data may move only by collective-permutes (a ring),
and each device may receive at most ``(n-1)/n`` of one ``[M, N]`` partial
product, in the partials' dtype (float32 for 16-bit floats, which are summed
in float32 and rounded once at the end).

Gradients (``ct``: the cotangent, sharded like the output): ``d_lhs = ct @
rhs.T`` and ``d_rhs = lhs.T @ ct``. Both need every row block of ``ct`` on
every device, and nothing else moves: the backward may receive one gather of
the cotangent, ``(n-1)/n`` of it, by collective-permutes.
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
    return (d["rows_per_shard"] * n, d["k_per_shard"] * n)


def _rhs_shape(d: Dims, n: int) -> tuple[int, int]:
    return (d["k_per_shard"] * n, d["cols"])


def _out_shape(d: Dims, n: int) -> tuple[int, int]:
    return (d["rows_per_shard"] * n, d["cols"])


def _contributions_received(d: Dims, n: int, itemsize: int) -> int:
    """The lower bound: n - 1 contributions to this device's rows, in the output dtype."""
    return (n - 1) * d["rows_per_shard"] * d["cols"] * itemsize


def _partials_not_held(d: Dims, n: int, itemsize: int) -> int:
    """The cap: (n-1)/n of one [M, N] partial product, in the partials' dtype."""
    return _contributions_received(d, n, partial_itemsize(itemsize))


def _bad_inputs(n: int) -> tuple[BadInput, ...]:
    m_bad, k_bad, cols = 2 * n + 1, 3 * n + 1, 4
    divisibility = (
        BadInput(
            f"M={m_bad} rows not divisible by the axis size {n}",
            ((m_bad, n), (n, cols)),
            None,
            (str(m_bad), str(n)),
        ),
        BadInput(
            f"K={k_bad} (the sharded contraction) not divisible by the axis size {n}",
            ((n, k_bad), (k_bad, cols)),
            None,
            (str(k_bad), str(n)),
        ),
    )
    unknown_axis = (
        BadInput(
            "axis_name 'nonexistent_axis' is not a mesh axis",
            ((n, n), (n, cols)),
            "nonexistent_axis",
            ("nonexistent_axis",),
        ),
    )
    # every size is divisible by a ring of one: there the only forbidden input is the unknown axis
    return (divisibility if n > 1 else ()) + unknown_axis


def _block_tags(
    shapes: tuple[tuple[int, ...], ...], n: int, sources: tuple[int, ...]
) -> tuple[np.ndarray, np.ndarray]:
    """``lhs`` zero but the first column of the contraction block of each ring position in
    ``sources``, where each row carries its row block's tag (block ``r``: ``r + 1``), and ``rhs`` zero
    but the matching rows of ones: those positions' partials are the tags, every other partial zero
    (so the partials of several positions sum: :mod:`conformance.checks.block_map` runs one at a time)."""
    lhs_shape, rhs_shape = shapes
    lhs, rhs = np.zeros(lhs_shape), np.zeros(rhs_shape)
    for s in sources:
        column = s * (lhs_shape[-1] // n)
        lhs[..., :, column] = np.arange(lhs_shape[-2]) // (lhs_shape[-2] // n) + 1
        rhs[column, :] = 1
    return lhs, rhs


MATMUL_REDUCE_SCATTER = FamilySpec(
    name="matmul_reduce_scatter",
    summary="lhs[M,K] P(None,axis) @ rhs[K,N] P(axis,None) -> [M,N] P(axis,None)",
    operands=(
        Operand("lhs", lambda a: P(None, a), _lhs_shape),
        Operand("rhs", lambda a: P(a, None), _rhs_shape),
    ),
    out_spec=lambda a: P(a, None),
    out_shape=_out_shape,
    dims=("rows_per_shard", "k_per_shard", "cols"),
    canonical_dims={"rows_per_shard": 3, "k_per_shard": 2, "cols": 8},
    #: The contraction per shard keeps K = k_per_shard * n <= 32 on 8 devices (so gamma_{K+1} for
    #: bfloat16 stays well below 1); trailing width: lane-dense and narrow ones.
    dim_values={"rows_per_shard": (1, 2, 3, 5, 8), "k_per_shard": (1, 2, 4), "cols": (1, 8, 128, 256)},
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
    max_received_bytes=_partials_not_held,
    min_received_bytes=_contributions_received,
    bad_inputs=_bad_inputs,
    byte_bound_text="each device may receive at most (n-1)/n of one [M, N] partial product",
    vjp_reference=tolerances.matmul_vjp_reference,
    vjp_tolerance=tolerances.matmul_vjp_tolerance,
    backward_allowed_collectives=frozenset({"collective-permute"}),
    backward_max_received_bytes=_contributions_received,
    backward_byte_bound_text="one gather of the cotangent: (n-1)/n of it per device",
    accuracy_dtypes=("bfloat16", "float16", "float8_e4m3fn_to_bfloat16"),
    accuracy_dims={"rows_per_shard": 16, "k_per_shard": 4, "cols": 64},
    accuracy_baseline_does="computes each device's partial product in float32 and reduce-scatters the "
    "float32 partials (lax.psum_scatter), rounding to the output dtype once, after the sum",
    accuracy_how_to_match="keep the partial sums in float32 while they travel the ring (they cost 2x the "
    "bytes of a 16-bit partial, which the byte bound allows) and cast once at the end; a reduce-scatter "
    "of 16-bit partials, XLA's own psum_scatter included, rounds at every addition",
    overlap=(
        "multiply the next partial while the previous one travels: each step's matmul reads only the "
        "local operands, and only the running sum waits for the transfer"
    ),
    pacing=(
        "compute each step's contribution only once the running sum it follows is ready to leave (an "
        "`optimization_barrier` over the contribution's block index and that sum), and fence the "
        "contribution (`lax.optimization_barrier(contribution)`) so that the addition of what arrives is "
        "not fused into the matmul, which would make the matmul wait for the transfer "
        "(conformance.kernels._ring.ring_reduce_scatter)"
    ),
    tpu_native_dims={"rows_per_shard": 32, "k_per_shard": 128, "cols": 128},
    # Per hop a device sends a [rows_per_shard, cols] partial sum, float32 for bfloat16 inputs:
    # 256 KiB, 1 MiB, 4 MiB.
    schedule_ladder=(
        {"rows_per_shard": 256, "k_per_shard": 512, "cols": 256},
        {"rows_per_shard": 512, "k_per_shard": 512, "cols": 512},
        {"rows_per_shard": 1024, "k_per_shard": 1024, "cols": 1024},
    ),
    # activations [batch, seq, emb] gathered or scattered along the sequence: lhs takes the batch
    batched_operands=("lhs",),
    batch_folds_into="rows_per_shard",
    registration_options={"batch_dims": BATCH_DIMS_OPTION},
    block_tags=_block_tags,
    block_unit="partial",
)

#: This module's family (:mod:`conformance.specs` collects it).
SPEC = MATMUL_REDUCE_SCATTER
