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
"""

from __future__ import annotations

from jax.sharding import PartitionSpec as P

from conformance import tolerances
from conformance.specs.base import BadInput, Dims, FamilySpec, Operand


def _lhs_shape(d: Dims, n: int) -> tuple[int, int]:
    return (d["rows_per_shard"] * n, d["K"])


def _rhs_shape(d: Dims, n: int) -> tuple[int, int]:
    return (d["K"], d["cols_per_shard"] * n)


def _out_shape(d: Dims, n: int) -> tuple[int, int]:
    return (d["rows_per_shard"] * n, d["cols_per_shard"] * n)


def _lhs_bytes_not_held(d: Dims, n: int, itemsize: int) -> int:
    """(n-1)/n of lhs: the row blocks a device does not hold."""
    return (n - 1) * d["rows_per_shard"] * d["K"] * itemsize


def _bad_inputs(n: int) -> tuple[BadInput, ...]:
    m_bad, n_bad, k = 2 * n + 1, 3 * n + 1, 4
    return (
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
        BadInput(
            "axis_name 'nonexistent_axis' is not a mesh axis",
            ((n, k), (k, n)),
            "nonexistent_axis",
            ("nonexistent_axis",),
        ),
    )


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
    dtypes=("float32", "bfloat16", "float16", "int32"),
    reference=lambda lhs, rhs: lhs @ rhs,
    tolerance=tolerances.matmul_tolerance,
    allowed_collectives=frozenset({"collective-permute"}),
    max_received_bytes=_lhs_bytes_not_held,
    min_received_bytes=_lhs_bytes_not_held,
    bad_inputs=_bad_inputs,
    byte_bound_text="each device may receive at most (n-1)/n of lhs",
)
