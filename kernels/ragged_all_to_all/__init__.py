"""Ragged all-to-all over one mesh axis: XLA's ``lax.ragged_all_to_all`` (TPU and GPU), forms that
every backend runs (a padded dense ``all_to_all`` and a ring of ``ppermute`` steps) and a Pallas TPU
kernel of remote DMAs."""

from conformance.kernels.ragged_all_to_all.dense import dense_ragged_all_to_all
from conformance.kernels.ragged_all_to_all.pallas_dma import pallas_dma_ragged_all_to_all
from conformance.kernels.ragged_all_to_all.ring import ring_ragged_all_to_all
from conformance.kernels.ragged_all_to_all.xla import xla_ragged_all_to_all

__all__ = [
    "dense_ragged_all_to_all",
    "pallas_dma_ragged_all_to_all",
    "ring_ragged_all_to_all",
    "xla_ragged_all_to_all",
]
