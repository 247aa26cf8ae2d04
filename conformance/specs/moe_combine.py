"""Family ``moe_combine``: the experts' rows go back to their tokens, each token the weighted sum of its
top-k experts' rows, as a mixture-of-experts layer gathers its experts' outputs.

``fn(expert_rows, weights, expert_ids, placement, *, mesh, axis_name)``, every operand sharded
``P(axis_name)`` along its first dim:

* ``expert_rows[n*C, H]``: the experts' outputs in the layout a dispatch returns
  (:mod:`conformance.specs.moe_routing`: device ``d``'s experts' groups, expert-major, in global token
  order; its rows after the last group hold whatever the experts left there, which a combine must not
  read);
* ``weights[n*T, k]``: each token's router weights, in the order of its ``expert_ids``;
* ``expert_ids[n*T, k]`` int32 and ``placement[n, X]`` int32: the routing the dispatch was given;

and the result is ``[n*T, H]`` sharded ``P(axis_name)``: token ``t``'s row is
``sum_j weights[t, j] * expert_rows[slot(t, j)]``, the slot where the dispatch put (token ``t``, choice
``j``), over the choices routed somewhere (a choice of expert id ``-1`` adds nothing, whatever its weight).
It is the dispatch's ``lax.ragged_all_to_all`` with the routing transposed (a combine's
``send_sizes`` are its dispatch's ``recv_sizes``, its ``input_offsets`` the slots the dispatch wrote,
its ``output_offsets`` the rows the tokens came from) and a weighted sum of each token's ``k`` rows.
A kernel that applies a token's weights in another order than its ``expert_ids`` (sorted by expert,
say) weighs each row by another expert's weight: a known mistake the values check names.

Ground truth is the float64 sum; the tolerance a rounding per product and addition of the ``k`` terms
(Higham's bound for a length-``k`` dot product) and one of the result. Gradients: a row's is its
token's cotangent times the row's weight (zero for rows no token reads); a weight's is the dot product
of the token's cotangent and its row. Bytes: the rows a token device gets back from the others,
exactly, is the least; the padded buffer and routing of the dispatch's bound is the most, and twice
that in the backward pass (the weights' gradient needs the rows at the tokens, the rows' gradient the
cotangents at the experts). The float dtypes only: the sum is arithmetic.
"""

from __future__ import annotations

import numpy as np
from jax.sharding import PartitionSpec as P

from conformance import tolerances
from conformance.specs import moe_forms, moe_routing
from conformance.specs.base import Dims, FamilySpec, KnownMistake, Operand


def _rows_shape(d: Dims, n: int) -> tuple[int, int]:
    return (n * moe_routing.capacity(d, n), d["hidden"])


def _choices_shape(d: Dims, n: int) -> tuple[int, int]:
    return (n * d["tokens_per_shard"], moe_routing.top_k(d, n))


def _tokens_shape(d: Dims, n: int) -> tuple[int, int]:
    return (n * d["tokens_per_shard"], d["hidden"])


def _chosen(expert_rows: np.ndarray, expert_ids: np.ndarray, placement: np.ndarray) -> np.ndarray:
    """``[n*T, k, H]``: each token's rows, in the order of its choices (zero for a choice routed nowhere)."""
    return moe_routing.at_slots(expert_rows, moe_routing.slots(expert_ids, placement))


def reference(expert_rows, weights, expert_ids, placement):
    """Each token's weighted sum of its rows (module doc)."""
    return np.einsum("tk,tkh->th", weights, _chosen(expert_rows, expert_ids, placement))


def tolerance(expert_rows, weights, expert_ids, placement, dtype):
    """Higham's bound for a dot product of length ``k`` per element, and a rounding of the result."""
    chosen = _chosen(expert_rows, expert_ids, placement)
    return tolerances.matmul_tolerance(weights[:, None, :], chosen, dtype)[:, 0, :]


def _weights_by_expert(expert_rows, weights, expert_ids, placement, *, axis_size):
    """Each token's weights applied to its rows in expert-id order rather than in the order of its
    choices."""
    order = np.argsort(expert_ids, axis=1, kind="stable")
    sorted_rows = np.take_along_axis(_chosen(expert_rows, expert_ids, placement), order[..., None], axis=1)
    return np.einsum("tk,tkh->th", weights, sorted_rows)


KNOWN_MISTAKES = (
    KnownMistake(
        "applying each token's weights to its rows in expert-id order (its rows arrive sorted by expert; "
        "weights[t, j] belongs to expert_ids[t, j], the router's order)",
        _weights_by_expert,
    ),
)


def vjp_reference(expert_rows, weights, expert_ids, placement, ct):
    """``d_rows[slot(t, j)] = weights[t, j] * ct[t]`` (zero for rows no token reads), ``d_weights[t, j] =
    ct[t] . expert_rows[slot(t, j)]``."""
    at = moe_routing.slots(expert_ids, placement)
    routed = at != moe_routing.UNROUTED
    d_rows = np.zeros(expert_rows.shape)
    d_rows[at[routed]] = (weights[..., None] * ct[:, None, :])[routed]
    d_weights = np.einsum("th,tkh->tk", ct, moe_routing.at_slots(expert_rows, at))
    return d_rows, d_weights


def vjp_tolerance(expert_rows, weights, expert_ids, placement, ct, dtype):
    """One rounding per product for the rows' gradient; Higham's bound of an ``H``-long dot product for the
    weights'."""
    at = moe_routing.slots(expert_ids, placement)
    routed = at != moe_routing.UNROUTED
    d_rows = np.zeros(expert_rows.shape)
    d_rows[at[routed]] = tolerances.matmul_tolerance(weights[..., None, None], ct[:, None, None, :], dtype)[
        :, :, 0, :
    ][routed]
    chosen = np.swapaxes(moe_routing.at_slots(expert_rows, at), 1, 2)
    d_weights = tolerances.matmul_tolerance(ct[:, None, :], chosen, dtype)[:, 0, :]
    return d_rows, d_weights


def _bad_inputs(n: int):
    return moe_routing.bad_inputs(
        "weights", n, shapes=lambda rows: ((n * rows, 8), (rows, 1), (rows, 1), (n, 1))
    )


def _most_back(d: Dims, n: int, itemsize: int) -> int:
    return moe_routing.most_received(d, n, back=True) * d["hidden"] * itemsize


MOE_COMBINE = FamilySpec(
    name="moe_combine",
    summary="expert_rows[n*C,H] (a dispatch's layout), weights[n*T,k], expert_ids[n*T,k], placement[n,X], "
    "all P(axis) -> each token's weighted sum of its k rows, [n*T,H] P(axis)",
    operands=(
        Operand("expert_rows", lambda a: P(a), _rows_shape),
        Operand("weights", lambda a: P(a), _choices_shape),
        moe_routing.EXPERT_IDS,
        moe_routing.PLACEMENT,
    ),
    out_spec=lambda a: P(a),
    out_shape=_tokens_shape,
    dims=moe_routing.DIMS,
    canonical_dims=moe_routing.CANONICAL_DIMS,
    dim_values=moe_routing.DIM_VALUES,
    tpu_native_dims=moe_routing.TPU_NATIVE_DIMS,
    dtypes=("float32", "bfloat16", "float16"),
    reference=reference,
    tolerance=tolerance,
    allowed_collectives=moe_routing.COLLECTIVES,
    max_received_bytes=moe_routing.padded_exchange_bytes,
    min_received_bytes=_most_back,
    byte_bound_text=moe_routing.PADDED_EXCHANGE_TEXT,
    bad_inputs=_bad_inputs,
    vjp_reference=vjp_reference,
    vjp_tolerance=vjp_tolerance,
    backward_allowed_collectives=moe_routing.COLLECTIVES,
    backward_max_received_bytes=lambda d, n, itemsize: 2 * moe_routing.padded_exchange_bytes(d, n, itemsize),
    backward_byte_bound_text="the rows back to their tokens and the cotangents out to their experts: twice "
    "the forward bound, " + moe_routing.PADDED_EXCHANGE_TEXT,
    known_mistakes=KNOWN_MISTAKES,
    bench_dims=moe_routing.bench_dims,
    registration_options={
        # the alignment first: a capacity's routing is then the one the aligned layout is laid out by
        "group_alignment": moe_forms.alignment_option(rows_operand="expert_rows"),
        "capacity": moe_forms.capacity_option(
            least_received=lambda ids, where: moe_routing.most_received_of(ids, where, back=True)
        ),
        # last, so that the forms before it meet each replica as an expert of its own
        "replicas": moe_forms.replicas_option(
            least_received=lambda ids, where: moe_routing.most_received_of(ids, where, back=True)
        ),
    },
)

#: This module's family (:mod:`conformance.specs` collects it).
SPEC = MOE_COMBINE
