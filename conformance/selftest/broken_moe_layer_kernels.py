"""MoE layer kernels broken in one way each, the ways a fused layer breaks, and a correct fused one.

Each broken one is the built-in layer (:mod:`conformance.kernels.moe_layer`) with one defect, or the
layer fused as serving stacks fuse it: its dispatch and combine as remote DMAs of a Pallas kernel (the
ragged all-to-all family's :mod:`~conformance.kernels.ragged_all_to_all.pallas_dma`), the experts'
grouped matmul between them. The check meant for each must reject it (``EXPECTED_REJECTION``), naming
what is wrong; the correct fused layer (``CORRECT``) must pass the checks ``EXPECTED_PASS`` names.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

import conformance
from conformance.kernels import _moe
from conformance.kernels.moe_layer import exchanged as layer
from conformance.kernels.ragged_all_to_all import pallas_dma
from conformance.kernels.ragged_all_to_all.dense import exchanged as dense_exchange

EXPECTED_REJECTION: dict[str, str] = {
    "broken_moe_layer_weights_applied_twice": "test_values",
    "broken_moe_layer_group_sizes_of_its_own_tokens": "test_values",
    "broken_moe_layer_gathers_the_expert_weights": "test_collectives",
    "broken_moe_layer_router_weights_get_no_gradient": "test_gradients",
    "broken_moe_layer_drops_past_an_undeclared_capacity": "test_values",
    "broken_pallas_moe_layer_matmul_before_the_rows_land": "test_races",
    "broken_pallas_moe_layer_without_the_barrier": "test_barrier_protocol",
}
EXPECTED_MESSAGE: dict[str, str] = {
    "broken_moe_layer_weights_applied_twice": "applying each router weight twice",
    "broken_moe_layer_group_sizes_of_its_own_tokens": "values differ from the numpy float64 reference",
    "broken_moe_layer_gathers_the_expert_weights": "bytes",
    "broken_moe_layer_router_weights_get_no_gradient": "d_weights",
    "broken_moe_layer_drops_past_an_undeclared_capacity": "kept its first choices in token order",
    "broken_pallas_moe_layer_without_the_barrier": "before the kernel waits on its barrier semaphore",
}
#: The correct fused layer's checks (its races on every routing it meets, its barrier read off it).
EXPECTED_PASS: dict[str, set[str]] = {
    "correct_pallas_moe_layer_fused_dma": {"test_values", "test_races", "test_barrier_protocol"},
}
CORRECT = tuple(EXPECTED_PASS)


def _registered(name: str, body, **options):
    def kernel(tokens, expert_ids, weights, placement, w_in, w_out, *, mesh, axis_name, **kw):
        n = _moe.validate(name, ("tokens", tokens), expert_ids, placement, mesh, axis_name)
        layer.validate_weights(name, tokens, placement, w_in, w_out)
        blocks = functools.partial(body, n=n, axis_name=axis_name, **kw)
        return _moe.per_device(blocks, mesh, axis_name, (tokens, expert_ids, weights, placement, w_in, w_out))

    kernel.__name__ = kernel.__qualname__ = name
    kernel.__doc__ = body.__doc__
    return conformance.register("moe_layer", name=name, **options)(kernel)


def _weights_twice(tokens, expert_ids, weights, placement, w_in, w_out, *, n, axis_name):
    """Weighs each expert row by its router weight in the grouped matmul's epilogue, as a fused kernel
    does, and then combines with the weights again: every choice weighed by its weight squared (here the
    two products as one, the combine's weights squared)."""
    tables = _moe.routing_tables(expert_ids, placement, n=n, axis_name=axis_name)
    common = dict(n=n, axis_name=axis_name, exchange=dense_exchange, tables=tables)
    rows = _moe.dispatched(tokens, expert_ids, placement, **common)
    sizes = tables[2][:, lax.axis_index(axis_name), :].sum(0)
    out = layer.expert_ffn(rows, sizes, w_in, w_out)
    return _moe.combined(out, weights * weights, expert_ids, placement, **common)


_registered("broken_moe_layer_weights_applied_twice", _weights_twice)


def _own_tokens(tokens, expert_ids, weights, placement, w_in, w_out, *, n, axis_name):
    """Sizes its grouped matmul's groups by the rows its own tokens send each of its experts, not by what
    every device sent them: each expert's group is short by the other devices' rows, which the matmul
    leaves zero (or reads as the next expert's)."""
    me = lax.axis_index(axis_name)
    tables = _moe.routing_tables(expert_ids, placement, n=n, axis_name=axis_name)
    common = dict(n=n, axis_name=axis_name, exchange=dense_exchange, tables=tables)
    rows = _moe.dispatched(tokens, expert_ids, placement, **common)
    sizes = tables[2][me, me, :]  # its own tokens' rows to its own experts
    return _moe.combined(layer.expert_ffn(rows, sizes, w_in, w_out), weights, expert_ids, placement, **common)


_registered("broken_moe_layer_group_sizes_of_its_own_tokens", _own_tokens)


def _gathered_weights(tokens, expert_ids, weights, placement, w_in, w_out, *, n, axis_name):
    """Moves the experts to the tokens: every device gathers every expert's ``w_in`` and ``w_out`` and
    runs its own tokens' FFNs. Right values, and ``n`` times the experts' weights moved, where expert
    parallelism moves the tokens' rows."""
    every_in, every_out = (lax.all_gather(w, axis_name, tiled=True) for w in (w_in, w_out))
    hosted = lax.all_gather(placement.reshape(-1).astype(jnp.int32), axis_name, tiled=True)
    row_of = (
        jnp.zeros(hosted.shape[0], jnp.int32).at[hosted].set(jnp.arange(hosted.shape[0], dtype=jnp.int32))
    )
    routed = expert_ids >= 0
    at = row_of[jnp.where(routed, expert_ids, 0)]  # [T, k]
    h = jnp.einsum("th,tkhf->tkf", tokens, every_in[at], preferred_element_type=jnp.float32)
    a = jax.nn.silu(h).astype(tokens.dtype)
    z = jnp.einsum("tkf,tkfh->tkh", a, every_out[at], preferred_element_type=jnp.float32)
    z = jnp.where(routed[..., None], z.astype(tokens.dtype), 0).astype(jnp.float32)
    return jnp.einsum("tk,tkh->th", weights.astype(jnp.float32), z).astype(tokens.dtype)


_registered("broken_moe_layer_gathers_the_expert_weights", _gathered_weights)


def _router_cut(tokens, expert_ids, weights, placement, w_in, w_out, *, n, axis_name):
    """Treats the router weights as constants (a ``stop_gradient`` on them, as a layer that detaches its
    routing does): right values, and the router learns nothing, its weights' gradient zero."""
    body = functools.partial(layer.layered, n=n, axis_name=axis_name, exchange=dense_exchange)
    return body(tokens, expert_ids, lax.stop_gradient(weights), placement, w_in, w_out)


_registered("broken_moe_layer_router_weights_get_no_gradient", _router_cut, differentiable=True)


def _undeclared_capacity(tokens, expert_ids, weights, placement, w_in, w_out, *, n, axis_name):
    """MaxText's capacity mask (a factor of 1 within each device's tokens, in token order) before the
    baseline's layer, registered without ``capacity=``: on a hot routing an expert's later choices are
    dropped, each of those tokens' rows short of that expert's weighted output."""
    rule = conformance.ExpertCapacity(1.0)
    kept = _moe.past_capacity_unrouted(expert_ids, experts=n * placement.shape[-1], capacity=rule)
    body = functools.partial(layer.layered, n=n, axis_name=axis_name, exchange=_moe.xla_exchange)
    return body(tokens, kept, weights, placement, w_in, w_out)


_registered("broken_moe_layer_drops_past_an_undeclared_capacity", _undeclared_capacity)


def _fused(name: str, doc: str, *, dispatch_protocol: pallas_dma.Protocol = pallas_dma.SAFE) -> None:
    """The layer with its dispatch and combine as the Pallas DMA kernel (``dispatch_protocol``: the
    dispatch's guards, one taken out for a self-test)."""

    @conformance.register("moe_layer", name=name, pallas=True, differentiable=False)
    def kernel(tokens, expert_ids, weights, placement, w_in, w_out, *, mesh, axis_name, interpret=False):
        n = _moe.validate(name, ("tokens", tokens), expert_ids, placement, mesh, axis_name)
        layer.validate_weights(name, tokens, placement, w_in, w_out)
        mesh_axes = tuple(mesh.axis_names)

        def dma(protocol):
            def exchange(*operands, axis_name, capacity):
                return pallas_dma.scattered(
                    *operands,
                    axis_name=axis_name,
                    mesh_axes=mesh_axes,
                    interpret=interpret,
                    protocol=protocol,
                )

            return exchange

        def body(tokens, expert_ids, weights, placement, w_in, w_out):
            tables = _moe.routing_tables(expert_ids, placement, n=n, axis_name=axis_name)
            rows = _moe.dispatched(
                tokens,
                expert_ids,
                placement,
                n=n,
                axis_name=axis_name,
                exchange=dma(dispatch_protocol),
                tables=tables,
            )
            sizes = tables[2][:, lax.axis_index(axis_name), :].sum(0)
            out = layer.expert_ffn(rows, sizes, w_in, w_out)
            return _moe.combined(
                out,
                weights,
                expert_ids,
                placement,
                n=n,
                axis_name=axis_name,
                exchange=dma(pallas_dma.SAFE),
                tables=tables,
            )

        spec = P(axis_name)
        return jax.shard_map(body, mesh=mesh, in_specs=(spec,) * 6, out_specs=spec, check_vma=False)(
            tokens, expert_ids, weights, placement, w_in, w_out
        )

    kernel.__name__ = kernel.__qualname__ = name
    kernel.__doc__ = doc


_fused(
    "correct_pallas_moe_layer_fused_dma",
    "The layer fused as a serving stack fuses it: the tokens out by remote DMAs (a barrier first, every "
    "receive waited for before the grouped matmul reads the rows), the experts' FFNs, the rows back by "
    "remote DMAs.",
)
_fused(
    "broken_pallas_moe_layer_matmul_before_the_rows_land",
    "Its dispatch returns once its own rows are sent, never waiting for the rows sent to it: the grouped "
    "matmul reads its expert rows while the other devices' DMAs are still writing them.",
    dispatch_protocol=pallas_dma.Protocol(wait_receives=False),
)
_fused(
    "broken_pallas_moe_layer_without_the_barrier",
    "No barrier before its dispatch DMAs (sglang-jax's fused EP-MoE kernel's removed barrier), while "
    "taking the barrier semaphore's collective_id: a row may reach a device that has not entered the "
    "kernel, which interpret mode, starting every device together, never shows.",
    dispatch_protocol=pallas_dma.Protocol(barrier=False),
)
