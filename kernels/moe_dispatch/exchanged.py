"""MoE dispatch as a sort, one ragged all-to-all and a permute (:mod:`conformance.kernels._moe`), with
the exchange done by XLA's own ``lax.ragged_all_to_all`` (the baseline: TPU and GPU run it, XLA:CPU does
not), by a padded dense ``all_to_all`` or by a ring of ``ppermute`` shifts (every backend runs both).

The baseline is what an MoE layer in JAX writes without a kernel (MaxText's and Levanter's ragged
paths): the op and two local permutes. The other two are the same steps around the ragged all-to-all
family's built-ins, so that the CPU runs what the baseline does everywhere but the exchange.
"""

from __future__ import annotations

import functools

import jax

import conformance
from conformance.kernels import _moe
from conformance.kernels.ragged_all_to_all.dense import exchanged as dense_exchange
from conformance.kernels.ragged_all_to_all.ring import LONGEST_RING
from conformance.kernels.ragged_all_to_all.ring import shifted as ring_exchange


def _dispatch(name: str, exchange: _moe.Exchange):
    def dispatch(
        tokens: jax.Array,
        expert_ids: jax.Array,
        placement: jax.Array,
        *,
        mesh: jax.sharding.Mesh,
        axis_name: str,
    ) -> jax.Array:
        n = _moe.validate(name, ("tokens", tokens), expert_ids, placement, mesh, axis_name)
        if exchange is ring_exchange and n > LONGEST_RING:
            conformance.refuse_on_tpu(
                f"{name} unrolls its n-1 = {n - 1} ring steps: it takes rings of up to {LONGEST_RING} "
                "(on 256 v5e chips the unrolled ring compiles to 317 MiB of code in 48 s); "
                "the dense form takes any"
            )
        body = functools.partial(_moe.dispatched, n=n, axis_name=axis_name, exchange=exchange)
        return _moe.per_device(body, mesh, axis_name, (tokens, expert_ids, placement))

    dispatch.__name__ = dispatch.__qualname__ = name
    return dispatch


xla_moe_dispatch = conformance.register(
    "moe_dispatch",
    name="xla_moe_dispatch",
    baseline=True,
    platforms=("tpu", "gpu"),
    differentiable=True,
    description="sort, lax.ragged_all_to_all, permute to expert-major (XLA:CPU does not run the op)",
)(_dispatch("xla_moe_dispatch", _moe.xla_exchange))

dense_moe_dispatch = conformance.register(
    "moe_dispatch",
    name="dense_moe_dispatch",
    differentiable=True,
    description="sort, a padded dense lax.all_to_all of T*min(k,X) rows a peer, permute to expert-major",
)(_dispatch("dense_moe_dispatch", dense_exchange))

ring_moe_dispatch = conformance.register(
    "moe_dispatch",
    name="ring_moe_dispatch",
    differentiable=True,
    description="sort, n-1 ppermute ring shifts each carrying its slot, permute to expert-major",
)(_dispatch("ring_moe_dispatch", ring_exchange))
