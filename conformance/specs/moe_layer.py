"""Family ``moe_layer``: a whole mixture-of-experts layer in one kernel (dispatch, the experts' FFNs,
combine), as serving stacks fuse it (one Pallas kernel that sends the tokens out, runs each expert's
grouped matmul on the rows it received and sends the results back) and cannot register as two halves.

``fn(tokens, expert_ids, weights, placement, w_in, w_out, *, mesh, axis_name)``, every operand sharded
``P(axis_name)`` along its first dim:

* ``tokens[n*T, H]``, ``expert_ids[n*T, k]`` int32, ``placement[n, X]`` int32: as
  :mod:`~conformance.specs.moe_dispatch` takes them (:mod:`conformance.specs.moe_routing`: the routing,
  ``-1`` for a choice routed nowhere, the placement not always ``arange``);
* ``weights[n*T, k]``: each token's router weights, in the order of its ``expert_ids``;
* ``w_in[n*X, H, F]`` and ``w_out[n*X, F, H]``: the experts' weights where they live, device ``d``'s
  block its ``X`` experts' in placement order (row ``d*X + i`` is expert ``placement[d, i]``'s), so
  that the tokens travel and the weights stay;

and the result is ``[n*T, H]`` sharded ``P(axis_name)``: token ``t``'s row is
``sum_j weights[t, j] * FFN_e(tokens[t])`` over its choices routed somewhere (``e = expert_ids[t, j]``),
with ``FFN_e(x) = silu(x @ w_in[e]) @ w_out[e]`` and ``silu(h) = h * sigmoid(h)``, the activation of
the FFNs of Mixtral, DeepSeek and Qwen's experts (without their gate, which a second ``w_in`` would
add and which moves nothing more).

Ground truth is numpy float64. The tolerance composes Higham's bound stage by stage, each stage's
error carried into the next through its magnitudes: the first matmul (a dot product of length ``H``),
the activation (its slope at most 1.1, a few roundings of its own), the second (length ``F``) and the
weighted sum (length ``k``); each stage may round to the dtype (a kernel that keeps float32 between
them is well inside). Where that says nothing (:func:`informative`: bfloat16 everywhere, float16 from
a few dozen lanes), the values are held to the baseline's own error
(:data:`conformance.tolerances.BASELINE_ERROR_FACTOR`), and the accuracy checks hold the rms error of
the result and of the gradients to the baseline's in bfloat16 and float16. Gradients of
the tokens, the router weights and both expert weights, bounded the same way through the backward
chain (an expert weight's gradient a sum over the rows its expert received, at most ``n * T``).
Bytes: the rows out and back, as a dispatch and a combine move them, twice that in the backward pass;
the experts' weights never move (a kernel that gathers them in place of the tokens moves ``n`` times
the expert weights and fails the bound). The float dtypes only.

A layer that drops tokens past an expert capacity declares its rule, ``capacity=`` as a dispatch does
(:mod:`~conformance.specs.moe_forms`): the reference then routes the dropped choices nowhere, so that
a dropped choice adds nothing to its token's row. One that drops without declaring it fails values
with each short expert named and the capacity's pattern said (:func:`choices_missing`).
"""

from __future__ import annotations

import numpy as np
from jax.sharding import PartitionSpec as P

from conformance import dtypes, tolerances
from conformance.specs import moe_forms, moe_routing
from conformance.specs.base import Dims, FamilySpec, KnownMistake, Operand

#: The largest slope of silu (at h = 2.4) and of its derivative (at h = 0), what carries an error through.
SILU_SLOPE = 1.1
SILU_CURVATURE = 0.5
#: Roundings in evaluating silu and its derivative (an exp, a division, a product or two, the result's).
SILU_ROUNDINGS = 6


def _tokens_shape(d: Dims, n: int) -> tuple[int, int]:
    return (n * d["tokens_per_shard"], d["hidden"])


def _choices_shape(d: Dims, n: int) -> tuple[int, int]:
    return (n * d["tokens_per_shard"], moe_routing.top_k(d, n))


def _w_in_shape(d: Dims, n: int) -> tuple[int, int, int]:
    return (n * d["experts_per_device"], d["hidden"], d["ffn"])


def _w_out_shape(d: Dims, n: int) -> tuple[int, int, int]:
    return (n * d["experts_per_device"], d["ffn"], d["hidden"])


def silu(h: np.ndarray) -> np.ndarray:
    return h / (1.0 + np.exp(-h))


def silu_slope(h: np.ndarray) -> np.ndarray:
    s = 1.0 / (1.0 + np.exp(-h))
    return s * (1.0 + h * (1.0 - s))


def _per_choice(expert_ids: np.ndarray, placement: np.ndarray, *weights: np.ndarray):
    """Whether each (token, choice) is routed, its expert's row of the weight operands, and each weight
    operand's row gathered per choice (``[n*T, k, ...]``; a choice routed nowhere gets row 0, masked)."""
    ids = expert_ids.astype(np.int64)
    row_of = np.empty(placement.size, dtype=np.int64)
    row_of[placement.astype(np.int64).reshape(-1)] = np.arange(placement.size)
    routed = ids != moe_routing.UNROUTED
    rows = np.where(routed, row_of[np.where(routed, ids, 0)], 0)
    return routed, rows, tuple(w[rows] for w in weights)


def _forward(tokens, expert_ids, placement, w_in, w_out):
    """``(routed, rows, h, a, z)``: each choice's pre-activation, activation and expert output, zero for a
    choice routed nowhere."""
    routed, rows, (w1, w2) = _per_choice(expert_ids, placement, w_in, w_out)
    h = np.einsum("th,tkhf->tkf", tokens, w1) * routed[..., None]
    a = silu(h)
    z = np.einsum("tkf,tkfh->tkh", a, w2) * routed[..., None]
    return routed, rows, h, a, z


def reference(tokens, expert_ids, weights, placement, w_in, w_out):
    """Each token's weighted sum of its experts' FFN outputs (module doc)."""
    *_, z = _forward(tokens, expert_ids, placement, w_in, w_out)
    return np.einsum("tk,tkh->th", weights, z)


def _g(n: int, dtype: str) -> float:
    return tolerances.gamma(n, dtype)


def _underflow(terms: int, dtype: str) -> float:
    return 0.0 if tolerances.is_exact(dtype) else 2 * terms * tolerances.UNDERFLOW_ERROR[dtypes.result(dtype)]


def _forward_errors(tokens, expert_ids, placement, w_in, w_out, dtype):
    """Bounds on the errors of ``h``, ``a``, ``z`` per choice, with the magnitudes that carry them
    (module doc): ``(routed, rows, h, a, z, e_h, e_a, e_z, |a|+e_a, |z|+e_z)``."""
    routed, rows, h, a, z = _forward(tokens, expert_ids, placement, w_in, w_out)
    _, _, (w1, w2) = _per_choice(expert_ids, placement, np.abs(w_in), np.abs(w_out))
    hidden, ffn = w_in.shape[1], w_in.shape[2]
    mask = routed[..., None]
    e_h = (
        _g(hidden + 1, dtype) * np.einsum("th,tkhf->tkf", np.abs(tokens), w1) + _underflow(hidden, dtype)
    ) * mask
    e_a = SILU_SLOPE * e_h + _g(SILU_ROUNDINGS, dtype) * (np.abs(a) + SILU_SLOPE * e_h)
    a_hat = np.abs(a) + e_a
    e_z = np.einsum("tkf,tkfh->tkh", e_a, w2) + _g(ffn + 1, dtype) * np.einsum("tkf,tkfh->tkh", a_hat, w2)
    e_z = (e_z + _underflow(ffn, dtype)) * mask
    return routed, rows, h, a, z, e_h, e_a, e_z, a_hat, np.abs(z) + e_z


#: Where a composed bound reaches this fraction of its result's rms, it cannot tell a wrong row (an error
#: of the result's own size) from rounding: the check holds the kernel to the baseline's error instead.
MOST_INFORMATIVE_BOUND = 0.25


def informative(bound, lengths: tuple[int, ...], dtype: str, what: str) -> np.ndarray:
    """``bound``, or :class:`~conformance.tolerances.Unbounded` where ``u * prod(K + 1)`` over the chain's
    contraction lengths ``lengths`` reaches :data:`MOST_INFORMATIVE_BOUND`. Each stage's worst case
    ``gamma_K |a| @ |b|`` is about ``K u`` times its own result on values of random sign, and the next
    stage carries it on, so the composed bound relative to the result's rms grows as that product (it
    tracked the bound computed here within a factor of 3 on standard-normal inputs at ``H, F`` from 1
    to 128): in bfloat16 everywhere, and in float16 from a few dozen lanes, it says nothing a wrong row
    would exceed. The rule turns on the dims and dtype alone, as a drawn gradient case's is asked
    before its data exist (:func:`conformance.checks.autodiff.gradients_judged_at`)."""
    growth = float(np.prod([k + 1 for k in lengths]))
    unit = 0.0 if tolerances.is_exact(dtype) else tolerances.UNIT_ROUNDOFF[dtypes.result(dtype)]
    if unit * growth >= MOST_INFORMATIVE_BOUND:
        raise tolerances.Unbounded(
            f"the composed worst-case bound of {what} ({dtype}: u * prod(K + 1) over its contractions "
            f"{list(lengths)} is {unit * growth:.3g}) reaches a quarter of the result's size"
        )
    return bound


def tolerance(tokens, expert_ids, weights, placement, w_in, w_out, dtype):
    """Higham's bound stage by stage (module doc), where it is :func:`informative`."""
    *_, e_z, _, z_hat = _forward_errors(tokens, expert_ids, placement, w_in, w_out, dtype)
    k, (hidden, ffn) = expert_ids.shape[1], w_in.shape[1:]
    w = np.abs(weights)
    bound = (
        np.einsum("tk,tkh->th", w, e_z)
        + _g(k + 1, dtype) * np.einsum("tk,tkh->th", w, z_hat)
        + _underflow(k, dtype)
    )
    return informative(bound, (hidden, ffn, k), dtype, "the layer's result")


def _weights_applied_twice(tokens, expert_ids, weights, placement, w_in, w_out, *, axis_size):
    """Each expert output weighed by its router weight before the combine, and again in it."""
    *_, z = _forward(tokens, expert_ids, placement, w_in, w_out)
    return np.einsum("tk,tkh->th", weights**2, z)


def _weights_unapplied(tokens, expert_ids, weights, placement, w_in, w_out, *, axis_size):
    """The expert outputs summed without the router weights."""
    *_, z = _forward(tokens, expert_ids, placement, w_in, w_out)
    return z.sum(1)


KNOWN_MISTAKES = (
    KnownMistake(
        "applying each router weight twice (to the expert's output before the exchange back, and again "
        "in the combine's sum): a fused kernel that scales its rows in the grouped matmul's epilogue must "
        "combine them unweighted",
        _weights_applied_twice,
    ),
    KnownMistake("summing each token's expert outputs without its router weights", _weights_unapplied),
)


def choices_missing(
    tokens, expert_ids, weights, placement, w_in, w_out, got, tol, *, axis_size: int, **_
) -> list[str]:
    """Each token whose result is the reference's less some of its choices' weighted expert outputs (the
    fewest that account for it within ``tol``), grouped by the experts that lost them, and whether every
    such expert kept the first of its rows in token order, as a capacity drops them; ``[]`` where some
    wrong token is not short of whole choices (a wrong row, a wrong weight: another defect)."""
    *_, z = _forward(tokens, expert_ids, placement, w_in, w_out)
    share = weights[..., None] * z  # [n*T, k, H]: what each choice adds to its token's row
    want = np.einsum("tkh->th", share)
    bound = np.broadcast_to(np.asarray(tol, dtype=np.float64), want.shape)
    ids = expert_ids.astype(np.int64)
    lost_by_expert: dict[int, list[int]] = {}
    for t in np.nonzero((np.abs(got - want) > bound).any(axis=1))[0]:
        routed = [j for j in range(ids.shape[1]) if ids[t, j] != moe_routing.UNROUTED]
        subsets = sorted(
            (tuple(j for b, j in enumerate(routed) if mask >> b & 1) for mask in range(1, 1 << len(routed))),
            key=len,
        )
        residual = {s: np.abs(got[t] - want[t] + share[t, list(s)].sum(0)) for s in subsets}
        # the fewest choices that account for the row, and of those the closest (a choice of a small
        # share may fit alone where another one was lost)
        fits = min(
            (s for s in subsets if np.all(residual[s] <= bound[t])),
            key=lambda s: (len(s), float(np.max(residual[s] / np.maximum(bound[t], 1e-300)))),
            default=None,
        )
        if fits is None:
            return []
        for j in fits:
            lost_by_expert.setdefault(int(ids[t, j]), []).append(int(t))
    if not lost_by_expert:
        return []
    owner = moe_routing.owners(placement)
    experts, seen, t_per = [], [], tokens.shape[0] // axis_size
    for e, lost in sorted(lost_by_expert.items()):
        routed_to_e = sorted(set(np.nonzero(ids == e)[0].tolist()))
        experts.append((e, routed_to_e, sorted(lost)))
        # a choice whose share is within the tolerance may have been lost unseen (the fewest choices
        # that account for a row leave it out): it tells nothing of the order kept, unless it comes
        # before every choice seen lost of its sender's tokens
        first_lost: dict[int, int] = {}
        for t in sorted(lost):
            first_lost.setdefault(t // t_per, t)
        seen.append(
            (
                [
                    t
                    for t in routed_to_e
                    if t in lost
                    or t < first_lost.get(t // t_per, t + 1)
                    or np.any(np.abs(share[t, list(ids[t]).index(e)]) > bound[t])
                ],
                sorted(lost),
            )
        )
    said = [
        f"expert {e} (on device {owner[e]}) lost {len(lost)} of the {len(routed)} choices routed to it, of "
        f"token{'s' if len(lost) > 1 else ''} {moe_routing.spans(lost)}"
        for e, routed, lost in experts
    ]
    listed = "; ".join(said[:4]) + (f"; and {len(said) - 4} more experts" if len(said) > 4 else "")
    kept = moe_routing.kept_first(seen, t_per)
    if kept is None:
        return [f"choices missing: each wrong token's row lacks whole choices' expert outputs: {listed}"]
    return [
        f"choices missing: every short expert kept its first choices in token order {kept} and lost the "
        f"rest, as dropping past an expert capacity does: {listed}",
        "               : a kernel that drops declares its rule, conformance.register(..., capacity="
        "conformance.ExpertCapacity(factor, group=, order=)), and the reference drops the same choices",
    ]


def vjp_reference(tokens, expert_ids, weights, placement, w_in, w_out, ct):
    """The gradients of ``tokens``, ``weights``, ``w_in`` and ``w_out`` (an expert weight's: the sum over
    the rows its expert received)."""
    routed, rows, h, a, z = _forward(tokens, expert_ids, placement, w_in, w_out)
    _, _, (w1, w2) = _per_choice(expert_ids, placement, w_in, w_out)
    mask = routed[..., None]
    dz = weights[..., None] * ct[:, None, :] * mask
    dh = np.einsum("tkh,tkfh->tkf", dz, w2) * silu_slope(h) * mask
    d_tokens = np.einsum("tkf,tkhf->th", dh, w1)
    d_weights = np.einsum("th,tkh->tk", ct, z)
    d_w_in, d_w_out = np.zeros(w_in.shape), np.zeros(w_out.shape)
    np.add.at(d_w_in, rows[routed], np.einsum("th,tkf->tkhf", tokens, dh)[routed])
    np.add.at(d_w_out, rows[routed], np.einsum("tkf,tkh->tkfh", a, dz)[routed])
    return d_tokens, d_weights, d_w_in, d_w_out


def vjp_tolerance(tokens, expert_ids, weights, placement, w_in, w_out, ct, dtype):
    """Higham's bound through the backward chain, the forward's errors carried in (module doc)."""
    routed, rows, h, _a, _z, e_h, e_a, e_z, a_hat, z_hat = _forward_errors(
        tokens, expert_ids, placement, w_in, w_out, dtype
    )
    _, _, (w1, w2) = _per_choice(expert_ids, placement, np.abs(w_in), np.abs(w_out))
    hidden, ffn, (total, k) = w_in.shape[1], w_in.shape[2], expert_ids.shape
    mask = routed[..., None]
    dz_abs = np.abs(weights)[..., None] * np.abs(ct)[:, None, :] * mask
    e_dz = _g(2, dtype) * dz_abs
    dz_hat = dz_abs + e_dz
    da_abs = np.einsum("tkh,tkfh->tkf", dz_abs, w2)
    e_da = np.einsum("tkh,tkfh->tkf", e_dz, w2) + _g(hidden + 1, dtype) * np.einsum(
        "tkh,tkfh->tkf", dz_hat, w2
    )
    slope = np.abs(silu_slope(h))
    e_slope = SILU_CURVATURE * e_h + _g(SILU_ROUNDINGS, dtype) * SILU_SLOPE
    slope_hat = slope + e_slope
    e_dh = (e_da * slope_hat + da_abs * e_slope + _g(2, dtype) * (da_abs + e_da) * slope_hat) * mask
    dh_hat = da_abs * slope + e_dh
    d_tokens = np.einsum("tkf,tkhf->th", e_dh, w1) + _g(k * ffn + 1, dtype) * np.einsum(
        "tkf,tkhf->th", dh_hat, w1
    )
    d_weights = np.einsum("th,tkh->tk", np.abs(ct), e_z) + _g(hidden + 1, dtype) * np.einsum(
        "th,tkh->tk", np.abs(ct), z_hat
    )
    g_rows = _g(total + 1, dtype)  # an expert's rows: at most one per token
    d_w_in, d_w_out = np.zeros(w_in.shape), np.zeros(w_out.shape)
    x_abs = np.abs(tokens)
    np.add.at(
        d_w_in,
        rows[routed],
        (np.einsum("th,tkf->tkhf", x_abs, e_dh) + g_rows * np.einsum("th,tkf->tkhf", x_abs, dh_hat))[routed],
    )
    np.add.at(
        d_w_out,
        rows[routed],
        (
            np.einsum("tkf,tkh->tkfh", e_a, dz_hat)
            + np.einsum("tkf,tkh->tkfh", a_hat, e_dz)
            + g_rows * np.einsum("tkf,tkh->tkfh", a_hat, dz_hat)
        )[routed],
    )
    eta = _underflow(hidden + ffn + k * ffn + total, dtype)
    bounds = (d_tokens + eta, d_weights + eta, d_w_in + eta * (d_w_in > 0), d_w_out + eta * (d_w_out > 0))
    return informative(bounds, (hidden, ffn, k * ffn), dtype, "the gradients")


def _bad_inputs(n: int):
    return moe_routing.bad_inputs(
        "tokens", n, shapes=lambda rows: ((rows, 8), (rows, 1), (rows, 1), (n, 1), (n, 8, 4), (n, 4, 8))
    )


def _least(d: Dims, n: int, itemsize: int) -> int:
    return _least_rows(moe_routing.expert_ids(d, n), moe_routing.placement(d, n)) * d["hidden"] * itemsize


def _least_rows(ids: np.ndarray, where: np.ndarray) -> int:
    """The most rows one device receives on either trip of the routing ``ids`` and placement ``where``."""
    return max(moe_routing.most_received_of(ids, where, back=back) for back in (False, True))


def _most(d: Dims, n: int, itemsize: int) -> int:
    return 2 * moe_routing.padded_exchange_bytes(d, n, itemsize)


DIMS = (*moe_routing.DIMS, "ffn")
CANONICAL_DIMS = {**moe_routing.CANONICAL_DIMS, "ffn": 8}
DIM_VALUES = {**moe_routing.DIM_VALUES, "ffn": (1, 8, 128)}
TPU_NATIVE_DIMS = {**moe_routing.TPU_NATIVE_DIMS, "ffn": 128}

MOE_LAYER = FamilySpec(
    name="moe_layer",
    summary="tokens[n*T,H], expert_ids[n*T,k], weights[n*T,k], placement[n,X], w_in[n*X,H,F], "
    "w_out[n*X,F,H], all P(axis) -> each token's weighted sum of its experts' silu FFNs, [n*T,H] P(axis)",
    operands=(
        Operand("tokens", lambda a: P(a), _tokens_shape),
        moe_routing.EXPERT_IDS,
        Operand("weights", lambda a: P(a), _choices_shape),
        moe_routing.PLACEMENT,
        Operand("w_in", lambda a: P(a), _w_in_shape),
        Operand("w_out", lambda a: P(a), _w_out_shape),
    ),
    out_spec=lambda a: P(a),
    out_shape=_tokens_shape,
    dims=DIMS,
    canonical_dims=CANONICAL_DIMS,
    dim_values=DIM_VALUES,
    tpu_native_dims=TPU_NATIVE_DIMS,
    dtypes=("float32", "bfloat16", "float16"),
    reference=reference,
    tolerance=tolerance,
    allowed_collectives=moe_routing.COLLECTIVES,
    max_received_bytes=_most,
    min_received_bytes=_least,
    byte_bound_text="the rows out and back, each trip as a dispatch or a combine may move them ("
    + moe_routing.PADDED_EXCHANGE_TEXT
    + "); the experts' weights stay where they are",
    bad_inputs=_bad_inputs,
    vjp_reference=vjp_reference,
    vjp_tolerance=vjp_tolerance,
    backward_allowed_collectives=moe_routing.COLLECTIVES,
    backward_max_received_bytes=lambda d, n, itemsize: 2 * _most(d, n, itemsize),
    backward_byte_bound_text="the forward's two trips again and the cotangents' two: four times a "
    "trip's bound, " + moe_routing.PADDED_EXCHANGE_TEXT,
    known_mistakes=KNOWN_MISTAKES,
    explain_wrong=choices_missing,
    accuracy_dtypes=("bfloat16", "float16"),
    accuracy_dims={**TPU_NATIVE_DIMS, "tokens_per_shard": 8, "hidden": 64, "ffn": 64},
    accuracy_baseline_does="moves the rows exactly (data movement), accumulates each expert matmul in "
    "float32 and rounds it once (the activation's input and the expert's output), and sums each token's k "
    "weighted rows in float32, rounded once",
    accuracy_how_to_match="accumulate the grouped matmuls in float32 (lax.ragged_dot(..., "
    "preferred_element_type=jnp.float32)), round to the dtype once per matmul, and sum a token's weighted "
    "rows in float32",
    bench_dims=lambda rows: {**moe_routing.bench_dims(rows), "ffn": 128},
    # group_alignment is not an option here: where a layer's groups start is its own, invisible in its
    # result (each token's row), so nothing is held to it
    registration_options={
        "capacity": moe_forms.capacity_option(least_received=_least_rows),
        "replicas": moe_forms.replicas_option(least_received=_least_rows),
    },
)

#: This module's family (:mod:`conformance.specs` collects it).
SPEC = MOE_LAYER
