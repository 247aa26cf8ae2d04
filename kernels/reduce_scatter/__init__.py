"""Reduce-scatter: ``x[n, M, cols] P(axis)`` (each device's partial) ``-> x.sum(0)``, ``P(axis)``."""

from conformance.kernels.reduce_scatter.compiler import xla_jit_reduce_scatter
from conformance.kernels.reduce_scatter.mgpu import mgpu_reduce_scatter
from conformance.kernels.reduce_scatter.pallas_hbm_ring import (
    pallas_hbm_ring_reduce_scatter_bidirectional,
)
from conformance.kernels.reduce_scatter.pallas_ring import (
    pallas_ring_reduce_scatter_bidirectional,
)
from conformance.kernels.reduce_scatter.ring import (
    ring_reduce_scatter_bidirectional,
    ring_reduce_scatter_columns_bidirectional,
    ring_reduce_scatter_unidirectional,
)
from conformance.kernels.reduce_scatter.xla import xla_reduce_scatter, xla_reduce_scatter_columns

__all__ = [
    "mgpu_reduce_scatter",
    "pallas_hbm_ring_reduce_scatter_bidirectional",
    "pallas_ring_reduce_scatter_bidirectional",
    "ring_reduce_scatter_bidirectional",
    "ring_reduce_scatter_columns_bidirectional",
    "ring_reduce_scatter_unidirectional",
    "xla_jit_reduce_scatter",
    "xla_reduce_scatter",
    "xla_reduce_scatter_columns",
]
