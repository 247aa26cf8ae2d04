"""MoE dispatch by gathering every token: each device all-gathers the tokens and their choices and
keeps the rows of its own experts, in expert-major, token order.

No sort and no offsets: a device's rows for its expert ``l`` are the tokens whose choices name it, in
global token order, so their slots are an exclusive cumulative count over (expert, token). It receives
every other device's ``T`` tokens whatever the routing (``(n - 1) * T`` rows), within the family's
bound (a padded exchange's ``T * min(k, X)`` rows a peer) and fewer than a padded exchange moves where
``k > 1``; more than the rows routed to it where few are. What it shows beside the sorted forms: a
dispatch that never computes an offset.

Forward only, as a serving stack's dispatch is: its transpose is a reduce-scatter of every token's
cotangent, which XLA:TPU compiles at the family's sizes as an all-reduce of the whole ``[n*T, H]``
array (on v5e:2x4 in float16, 10920 bytes a device where the family's backward bound is 1344), so it
declares no gradient rather than one no TPU would want.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

import conformance
from conformance.kernels import _moe


def kept(
    tokens: jax.Array, expert_ids: jax.Array, placement: jax.Array, *, n: int, axis_name: str
) -> jax.Array:
    """One device's part (the module doc's algorithm): ``[C, H]``."""
    t, k = expert_ids.shape
    hosted = placement.reshape(-1)
    rows = n * t * min(k, hosted.shape[0])
    everyone = lax.all_gather(tokens, axis_name, tiled=True)  # [n*T, H]
    chosen = lax.all_gather(expert_ids, axis_name, tiled=True)  # [n*T, k]
    routed = (chosen[None, :, :] == hosted[:, None, None]).any(-1)  # [X, n*T]: expert l takes token t
    flat = routed.reshape(-1)
    slot = jnp.where(flat, jnp.cumsum(flat) - 1, rows)  # dropped where not routed
    source = jnp.tile(jnp.arange(n * t), hosted.shape[0])
    return jnp.zeros((rows, tokens.shape[1]), tokens.dtype).at[slot].set(everyone[source], mode="drop")


@conformance.register(
    "moe_dispatch",
    name="allgather_moe_dispatch",
    description="all-gather every token and its choices, keep this device's experts' rows",
)
def allgather_moe_dispatch(
    tokens: jax.Array, expert_ids: jax.Array, placement: jax.Array, *, mesh: jax.sharding.Mesh, axis_name: str
) -> jax.Array:
    n = _moe.validate("allgather_moe_dispatch", ("tokens", tokens), expert_ids, placement, mesh, axis_name)
    return _moe.per_device(
        lambda *blocks: kept(*blocks, n=n, axis_name=axis_name),
        mesh,
        axis_name,
        (tokens, expert_ids, placement),
    )
