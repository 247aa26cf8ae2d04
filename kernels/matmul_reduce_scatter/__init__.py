"""Matmul + reduce-scatter: ``lhs[M,K] P(None,axis) @ rhs[K,N] P(axis,None) -> P(axis,None)``."""

from conformance.kernels.matmul_reduce_scatter.compiler import xla_jit_matmul_reduce_scatter
from conformance.kernels.matmul_reduce_scatter.ring import (
    ring_matmul_reduce_scatter_bidirectional,
    ring_matmul_reduce_scatter_unidirectional,
)
from conformance.kernels.matmul_reduce_scatter.xla import xla_matmul_reduce_scatter

__all__ = [
    "ring_matmul_reduce_scatter_bidirectional",
    "ring_matmul_reduce_scatter_unidirectional",
    "xla_jit_matmul_reduce_scatter",
    "xla_matmul_reduce_scatter",
]
