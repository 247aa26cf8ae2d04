"""MoE combine as a permute, one ragged all-to-all back and a weighted sum (:mod:`conformance.kernels._moe`),
with the exchange done by XLA's own ``lax.ragged_all_to_all`` (the baseline: TPU and GPU run it; on CPU,
where XLA:CPU cannot, the suite's exact emulation of it, labelled), or by a padded dense
``all_to_all`` (every backend runs it; the ragged all-to-all family's ring of ``ppermute`` shifts
would plug in the same way).

Each token's ``k`` rows are summed in float32, weighted, and rounded once to the rows' dtype, as the
baseline does.
"""

from __future__ import annotations

import functools

import jax

import conformance
from conformance.kernels import _moe
from conformance.kernels.ragged_all_to_all.dense import exchanged as dense_exchange


def _combine(name: str, exchange: _moe.Exchange):
    def combine(
        expert_rows: jax.Array,
        weights: jax.Array,
        expert_ids: jax.Array,
        placement: jax.Array,
        *,
        mesh: jax.sharding.Mesh,
        axis_name: str,
    ) -> jax.Array:
        n = _moe.validate(name, ("weights", weights), expert_ids, placement, mesh, axis_name)
        body = functools.partial(_moe.combined, n=n, axis_name=axis_name, exchange=exchange)
        return _moe.per_device(body, mesh, axis_name, (expert_rows, weights, expert_ids, placement))

    combine.__name__ = combine.__qualname__ = name
    return combine


xla_moe_combine = conformance.register(
    "moe_combine",
    name="xla_moe_combine",
    baseline=True,
    differentiable=True,
    description="permute to sender-major, lax.ragged_all_to_all back, weighted sum in float32",
)(_combine("xla_moe_combine", _moe.xla_exchange))

dense_moe_combine = conformance.register(
    "moe_combine",
    name="dense_moe_combine",
    differentiable=True,
    replicas=conformance.ExpertReplicas("sender"),
    description="permute, a padded dense lax.all_to_all of T*min(k,X) rows a peer back, weighted sum",
)(_combine("dense_moe_combine", dense_exchange))
