"""Mixture-of-experts combine over one mesh axis: a permute, a ragged all-to-all back (XLA's own on TPU
and GPU, a padded dense all-to-all everywhere) and each token's weighted sum."""

from conformance.kernels.moe_combine.exchanged import dense_moe_combine, xla_moe_combine

__all__ = ["dense_moe_combine", "xla_moe_combine"]
