"""MoE dispatch as a sort, one ragged all-to-all and a permute (:mod:`conformance.kernels._moe`), with
the exchange done by XLA's own ``lax.ragged_all_to_all`` (the baseline: TPU and GPU run it; on CPU,
where XLA:CPU cannot, the suite's exact emulation of it, labelled), or by a padded dense
``all_to_all`` (every backend runs it; the ragged all-to-all family's ring of ``ppermute`` shifts
would plug in the same way).

The baseline is what an MoE layer in JAX writes without a kernel (MaxText's and Levanter's ragged
paths): the op and two local permutes. The dense form is the same steps around the ragged all-to-all
family's dense built-in, so that the CPU runs what the baseline does everywhere but the exchange.
"""

from __future__ import annotations

import functools

import jax

import conformance
from conformance.kernels import _moe
from conformance.kernels.ragged_all_to_all.dense import exchanged as dense_exchange


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
        body = functools.partial(_moe.dispatched, n=n, axis_name=axis_name, exchange=exchange)
        return _moe.per_device(body, mesh, axis_name, (tokens, expert_ids, placement))

    dispatch.__name__ = dispatch.__qualname__ = name
    return dispatch


xla_moe_dispatch = conformance.register(
    "moe_dispatch",
    name="xla_moe_dispatch",
    baseline=True,
    differentiable=True,
    description="sort, lax.ragged_all_to_all, permute to expert-major (on CPU: the op emulated, exact)",
)(_dispatch("xla_moe_dispatch", _moe.xla_exchange))

dense_moe_dispatch = conformance.register(
    "moe_dispatch",
    name="dense_moe_dispatch",
    differentiable=True,
    replicas=conformance.ExpertReplicas("sender"),
    description="sort, a padded dense lax.all_to_all of T*min(k,X) rows a peer, permute to expert-major",
)(_dispatch("dense_moe_dispatch", dense_exchange))
