"""A whole mixture-of-experts layer over one mesh axis: dispatch, each expert's grouped FFN on the rows it
received (``lax.ragged_dot``), combine; the exchange XLA's own ragged all-to-all or a padded dense one."""

from conformance.kernels.moe_layer.exchanged import dense_moe_layer, layered, xla_moe_layer

__all__ = ["dense_moe_layer", "layered", "xla_moe_layer"]
