"""All-gather over one mesh axis: XLA's ``lax.all_gather`` and Pallas TPU rings of remote DMAs."""

from conformance.kernels.all_gather.pallas_ring import (
    pallas_ring_all_gather_bidirectional,
    pallas_ring_all_gather_unidirectional,
)
from conformance.kernels.all_gather.xla import xla_all_gather

__all__ = [
    "pallas_ring_all_gather_bidirectional",
    "pallas_ring_all_gather_unidirectional",
    "xla_all_gather",
]
