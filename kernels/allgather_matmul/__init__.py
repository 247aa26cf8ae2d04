"""All-gather collective matmul: ``lhs[M,K] P(axis,None) @ rhs[K,N] P(None,axis)``."""

from conformance.kernels.allgather_matmul.compiler import xla_jit_allgather_matmul
from conformance.kernels.allgather_matmul.ring import (
    ring_allgather_matmul_bidirectional,
    ring_allgather_matmul_unidirectional,
)
from conformance.kernels.allgather_matmul.xla import xla_allgather_matmul

__all__ = [
    "ring_allgather_matmul_bidirectional",
    "ring_allgather_matmul_unidirectional",
    "xla_allgather_matmul",
    "xla_jit_allgather_matmul",
]
