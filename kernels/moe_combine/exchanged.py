"""MoE combine as a permute, one ragged all-to-all back and a weighted sum (:mod:`conformance.kernels._moe`),
with the exchange done by XLA's own ``lax.ragged_all_to_all`` (the baseline: TPU and GPU run it, XLA:CPU
does not), by a padded dense ``all_to_all`` or by a ring of ``ppermute`` shifts (every backend runs both).

Each token's ``k`` rows are summed in float32, weighted, and rounded once to the rows' dtype, as the
baseline does.
"""

from __future__ import annotations

import functools

import jax

import conformance
from conformance.kernels import _moe
from conformance.kernels.ragged_all_to_all.dense import exchanged as dense_exchange
from conformance.kernels.ragged_all_to_all.ring import LONGEST_RING
from conformance.kernels.ragged_all_to_all.ring import shifted as ring_exchange


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
        if exchange is ring_exchange and n > LONGEST_RING:
            conformance.refuse_on_tpu(
                f"{name} unrolls its n-1 = {n - 1} ring steps: it takes rings of up to {LONGEST_RING} "
                "(on 256 v5e chips the unrolled ring compiles to 317 MiB of code in 48 s); "
                "the dense form takes any"
            )
        body = functools.partial(_moe.combined, n=n, axis_name=axis_name, exchange=exchange)
        return _moe.per_device(body, mesh, axis_name, (expert_rows, weights, expert_ids, placement))

    combine.__name__ = combine.__qualname__ = name
    return combine


xla_moe_combine = conformance.register(
    "moe_combine",
    name="xla_moe_combine",
    baseline=True,
    platforms=("tpu", "gpu"),
    differentiable=True,
    description="permute to sender-major, lax.ragged_all_to_all back, weighted sum in float32",
)(_combine("xla_moe_combine", _moe.xla_exchange))

dense_moe_combine = conformance.register(
    "moe_combine",
    name="dense_moe_combine",
    differentiable=True,
    description="permute, a padded dense lax.all_to_all of T*min(k,X) rows a peer back, weighted sum",
)(_combine("dense_moe_combine", dense_exchange))

ring_moe_combine = conformance.register(
    "moe_combine",
    name="ring_moe_combine",
    differentiable=True,
    description="permute, n-1 ppermute ring shifts back each carrying its slot, weighted sum",
)(_combine("ring_moe_combine", ring_exchange))
