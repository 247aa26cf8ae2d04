"""A mixture-of-experts layer as a dispatch, the experts' FFNs as two grouped matmuls, and a combine
(:mod:`conformance.kernels._moe`), per device under ``shard_map``:

1. the routing tables once (the placement and every device's per-expert counts gathered: a few ints);
2. the dispatch: each (token, choice) row to its expert's device, expert-major there, each expert's
   rows contiguous (``C = n*T*min(k, X)`` rows, zero after the last group);
3. the FFNs: ``lax.ragged_dot`` of the rows with the device's ``X`` experts' ``w_in`` (group sizes: the
   rows each expert received), silu, ``lax.ragged_dot`` with their ``w_out``, each accumulated in
   float32 and rounded once to the dtype;
4. the combine: the rows back to their tokens, each token's ``k`` rows weighted and summed in float32.

The exchange is XLA's own ``lax.ragged_all_to_all`` (the baseline: TPU and GPU run it; on CPU the
suite's exact emulation of it, labelled) or a padded dense ``all_to_all``. The experts' weights never
move: the tokens go to them. What a fused Pallas kernel does in one launch (the same steps, its DMAs
in place of the exchange and its barrier and semaphores in place of XLA's dependencies) is held to the
same result.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

import conformance
from conformance.kernels import _moe
from conformance.kernels.ragged_all_to_all.dense import exchanged as dense_exchange


def expert_ffn(rows: jax.Array, sizes: jax.Array, w_in: jax.Array, w_out: jax.Array) -> jax.Array:
    """``silu(rows @ w_in[g]) @ w_out[g]`` for each group ``g`` of ``sizes[g]`` rows (zero past the last),
    each matmul accumulated in float32 and rounded once to the rows' dtype."""
    h = lax.ragged_dot(rows, w_in, sizes, preferred_element_type=jnp.float32)
    a = jax.nn.silu(h).astype(rows.dtype)
    return lax.ragged_dot(a, w_out, sizes, preferred_element_type=jnp.float32).astype(rows.dtype)


def layered(
    tokens: jax.Array,
    expert_ids: jax.Array,
    weights: jax.Array,
    placement: jax.Array,
    w_in: jax.Array,
    w_out: jax.Array,
    *,
    n: int,
    axis_name: str,
    exchange: _moe.Exchange,
    ffn=expert_ffn,
) -> jax.Array:
    """One device's part of the layer (the module doc's steps): ``[T, H]``. ``ffn``: the experts' step (a
    self-test's defect)."""
    tables = _moe.routing_tables(expert_ids, placement, n=n, axis_name=axis_name)
    common = dict(n=n, axis_name=axis_name, exchange=exchange, tables=tables)
    rows = _moe.dispatched(tokens, expert_ids, placement, **common)
    sizes = tables[2][:, lax.axis_index(axis_name), :].sum(0)  # [X]: the rows each local expert received
    return _moe.combined(ffn(rows, sizes, w_in, w_out), weights, expert_ids, placement, **common)


def validate_weights(name: str, tokens: jax.Array, placement: jax.Array, w_in: jax.Array, w_out: jax.Array):
    """Raise ``ValueError`` unless ``w_in`` is ``[n*X, H, F]`` and ``w_out`` ``[n*X, F, H]``."""
    experts, hidden = placement.size, tokens.shape[-1]
    ffn = w_in.shape[-1] if w_in.ndim == 3 else None
    for what, array, want in (
        ("w_in", w_in, (experts, hidden, ffn)),
        ("w_out", w_out, (experts, ffn, hidden)),
    ):
        if array.ndim != 3 or tuple(array.shape) != want:
            raise ValueError(
                f"{name}: {what} must be [n*X, {'H, F' if what == 'w_in' else 'F, H'}] = {list(want)} (an "
                f"expert's weights per row, {experts} experts, H = {hidden}), got {list(array.shape)}"
            )


def moe_layer(name: str, exchange: _moe.Exchange, *, ffn=expert_ffn):
    """The layer's wrapper over ``exchange`` (and ``ffn``, a self-test's knob)."""

    def layer(
        tokens: jax.Array,
        expert_ids: jax.Array,
        weights: jax.Array,
        placement: jax.Array,
        w_in: jax.Array,
        w_out: jax.Array,
        *,
        mesh: jax.sharding.Mesh,
        axis_name: str,
    ) -> jax.Array:
        n = _moe.validate(name, ("tokens", tokens), expert_ids, placement, mesh, axis_name)
        validate_weights(name, tokens, placement, w_in, w_out)
        body = functools.partial(layered, n=n, axis_name=axis_name, exchange=exchange, ffn=ffn)
        return _moe.per_device(body, mesh, axis_name, (tokens, expert_ids, weights, placement, w_in, w_out))

    layer.__name__ = layer.__qualname__ = name
    return layer


xla_moe_layer = conformance.register(
    "moe_layer",
    name="xla_moe_layer",
    baseline=True,
    differentiable=True,
    description="dispatch and combine on lax.ragged_all_to_all, the experts' FFNs as two lax.ragged_dot",
)(moe_layer("xla_moe_layer", _moe.xla_exchange))

dense_moe_layer = conformance.register(
    "moe_layer",
    name="dense_moe_layer",
    differentiable=True,
    replicas=conformance.ExpertReplicas("sender"),
    description="dispatch and combine on a padded dense lax.all_to_all, the FFNs as two lax.ragged_dot",
)(moe_layer("dense_moe_layer", dense_exchange))
