"""Baseline: XLA's own ``lax.ragged_all_to_all`` under ``shard_map``.

XLA:TPU and XLA:GPU run the op; XLA:CPU does not ("HLO opcode ragged-all-to-all is not supported by
XLA:CPU ThunkEmitter"), so on CPU the suite runs its exact emulation of the op
(:mod:`conformance.targets.cpu_ragged_all_to_all`), and every verdict there says so; the compile
tiers judge the real op.
"""

from __future__ import annotations

import jax
from jax import lax

import conformance
from conformance.kernels.ragged_all_to_all._common import per_device, validate


@conformance.register(
    "ragged_all_to_all",
    name="xla_ragged_all_to_all",
    baseline=True,
    differentiable=True,
    description="lax.ragged_all_to_all under shard_map (on CPU: the suite's exact emulation of the op)",
)
def xla_ragged_all_to_all(*operands: jax.Array, mesh: jax.sharding.Mesh, axis_name: str) -> jax.Array:
    validate("xla_ragged_all_to_all", operands, mesh, axis_name)
    return per_device(
        lambda *blocks: lax.ragged_all_to_all(*blocks, axis_name=axis_name), mesh, axis_name, operands
    )
