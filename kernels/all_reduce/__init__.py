"""All-reduce: ``x[n, M, cols] P(axis)`` (each device's partial) ``-> x.sum(0)``, replicated."""

from conformance.kernels.all_reduce.compiler import xla_jit_all_reduce
from conformance.kernels.all_reduce.mgpu import mgpu_all_reduce
from conformance.kernels.all_reduce.pallas_ring import (
    pallas_ring_all_reduce_bidirectional,
)
from conformance.kernels.all_reduce.ring import ring_all_reduce_bidirectional, ring_all_reduce_unidirectional
from conformance.kernels.all_reduce.xla import xla_all_reduce

__all__ = [
    "mgpu_all_reduce",
    "pallas_ring_all_reduce_bidirectional",
    "ring_all_reduce_bidirectional",
    "ring_all_reduce_unidirectional",
    "xla_all_reduce",
    "xla_jit_all_reduce",
]
