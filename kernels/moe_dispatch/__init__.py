"""Mixture-of-experts dispatch over one mesh axis: a sort, a ragged all-to-all (XLA's own on TPU and GPU,
a padded dense all-to-all everywhere) and a permute to expert-major order; and a form that gathers every
token."""

from conformance.kernels.moe_dispatch.allgather import allgather_moe_dispatch
from conformance.kernels.moe_dispatch.exchanged import dense_moe_dispatch, xla_moe_dispatch

__all__ = ["allgather_moe_dispatch", "dense_moe_dispatch", "xla_moe_dispatch"]
