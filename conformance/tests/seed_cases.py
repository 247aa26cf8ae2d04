"""The case of JAX issue #21855 (``../shared/seeds/issue_unexpected_allreduce_in_backward.txt``).

A Pallas kernel (here a copy) inside ``shard_map``, with a ``jax.custom_vjp``,
on a 2-D mesh ``(x, y)``; its result is sharded ``P(x, None)``, so it is
replicated over ``y``. Differentiating it:

* **undeclared** (``check_vma=False``, a plain ``out_shape``): shard_map cannot
  see through the ``pallas_call`` that the result is replicated over ``y``, so
  its transpose divides the cotangent over ``y`` and all-reduces the input's
  cotangent over ``y``: a defensive all-reduce the math does not need. It is in
  the module lowered for TPU; the CPU-compiled module of the same function
  drops it with JAX's own interpreter but keeps it under TPU interpret mode.
* **declared** (``check_vma=True`` and the kernel's ``out_shape`` typed as
  varying over ``x`` only, via :func:`conformance.compat.varying_shape_dtype_struct`):
  JAX knows the value is invariant over ``y``; the backward has no collective.

The suite's test (``test_seed_backward_allreduce.py``) requires the declared
form to pass the backward audit, and its self-test requires the audit to
report the undeclared one.
"""

from __future__ import annotations

from typing import Any

import jax
from jax.experimental import pallas as pl
from jax.sharding import PartitionSpec as P

from conformance import compat

#: The mesh axes: rows are sharded over ROW_AXIS; the result is replicated over the other one.
ROW_AXIS = "x"


def _copy_kernel(x_ref: Any, o_ref: Any) -> None:
    o_ref[...] = x_ref[...]


def interpreted() -> Any:
    """The ``interpret`` value that runs the kernel on CPU (TPU interpret mode)."""
    return compat.interpret_params(dma_execution_mode="eager", detect_races=False)


def pallas_copy_in_shard_map(mesh: jax.sharding.Mesh, *, declared: bool, interpret: Any = False) -> Any:
    """The seed's function: ``x -> copy(x)``, ``P(x, None) -> P(x, None)``, custom_vjp inside shard_map."""

    def copy(block: jax.Array) -> jax.Array:
        if declared:  # varying over the row axis only: invariant over the other axis
            out = compat.varying_shape_dtype_struct(
                block.shape, block.dtype, varying_axes=frozenset({ROW_AXIS})
            )
        else:
            out = jax.ShapeDtypeStruct(block.shape, block.dtype)
        return pl.pallas_call(_copy_kernel, out_shape=out, interpret=interpret)(block)

    @jax.custom_vjp
    def copy_with_vjp(block: jax.Array) -> jax.Array:
        return copy(block)

    copy_with_vjp.defvjp(lambda block: (copy(block), None), lambda _, ct: (copy(ct),))
    spec = P(ROW_AXIS, None)
    return jax.shard_map(copy_with_vjp, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=declared)
