"""Autodiff: gradients against numpy float64 (the transpose math), and the collectives of the
backward pass (compiled here and lowered for each target) against what its math needs."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from conformance import compat, hlo, runner, tolerances
from conformance.checks.base import (
    Axes,
    Check,
    ConformanceFailure,
    NotJudged,
    call_kernel,
    check_byte_bound,
    compare_shards,
    fail,
    keeping,
)
from conformance.checks.block_map import ROUNDED_PREFIX
from conformance.checks.collectives import ByteRecord, byte_table, wider_transfers
from conformance.checks.ragged_bytes import as_the_op_moves_them
from conformance.runner import Case


def check_gradients(case: Case) -> None:
    """``jax.vjp`` with a random cotangent against numpy float64 gradients (the transpose math).

    Each gradient must also come back with its operand's sharding and dtype.
    """
    spec = case.spec
    if spec.vjp_reference is None or spec.vjp_tolerance is None:
        raise ValueError(f"family {case.family} defines no gradients")
    inputs64, ct64, grads = call_kernel(case, "gradients", lambda: runner.execute_pullback(case))
    expected = spec.vjp_reference(*inputs64, ct64)
    try:
        tolerance = spec.vjp_tolerance(*inputs64, ct64, case.dtype)
    except tolerances.Unbounded as unbounded:
        raise NotJudged(
            f"the gradients' worst-case bound says nothing here ({unbounded}); the backward_accuracy "
            "check holds them to the baseline's backward on the same inputs"
        ) from unbounded
    want_dtype = runner.np_dtype(case.dtype)
    data = [
        (op, sharding)
        for op, sharding in zip(spec.operands, runner.operand_shardings(case), strict=True)
        if op.is_data
    ]
    if len(grads) != len(data):
        raise fail(
            case, "gradients", f"the VJP returned {len(grads)} gradients for {len(data)} data operands"
        )
    for (operand, sharding), grad, exp, tol in zip(data, grads, expected, tolerance, strict=True):
        name = f"d_{operand.name}"
        if np.dtype(grad.dtype) != want_dtype:
            raise fail(case, "gradients", f"gradient {name} has dtype {grad.dtype}, operand has {want_dtype}")
        if not grad.sharding.is_equivalent_to(sharding, grad.ndim):
            got_spec = getattr(grad.sharding, "spec", grad.sharding)
            raise fail(
                case,
                "gradients",
                f"gradient {name} is not sharded like {operand.name}",
                [
                    f"expected       : {sharding.spec}",
                    f"got            : {got_spec}",
                ],
            )
        try:
            explain = functools.partial(rounded_where_exact, case, grad, exp) if spec.backward_exact else None
            compare_shards(case, "gradients", grad, exp, tol, what=name, explain=explain)
        except ConformanceFailure as failure:
            named = _known_vjp_mistake(case, inputs64, ct64, grads, tolerance)
            if named is None:
                raise
            if case.implementation.baseline:  # XLA's own op: a defect below every kernel of the family
                raise NotJudged(
                    f"{name} of XLA's own op is exactly what {named} gives; a kernel of the family that "
                    "gets it right does better than the op"
                ) from failure
            raise _naming(failure, f"the gradients are exactly what {named} gives") from failure


#: How JAX's own autodiff of a ring comes to compute where the exact gradient only moves the cotangent.
EXACT_BACKWARD_BY_AUTODIFF = (
    "A ring differentiated by JAX's own autodiff (no custom_vjp) transposes each step: a shard_map whose "
    "result is declared replicated (out_specs P(), check_vma=False) hands each device a share of the "
    "cotangent and sums the shares back over the ring, in the cotangent's dtype"
)


def rounded_where_exact(case: Case, grad: Any, exact: np.ndarray) -> list[str]:
    """A line naming the cause where the family's exact gradient needs no arithmetic
    (:attr:`~conformance.specs.base.FamilySpec.backward_exact`) and every wrong element of ``grad`` is
    within a rounding per ring step of it: the backward computes what it should only move. ``[]`` where
    an element is further off (a block in the wrong place, a missing term), or in a job, where a rank
    sees its own shards only."""
    if jax.process_count() > 1:
        return []
    got = runner.global_value(grad).astype(np.float64)
    error = np.abs(got - exact)
    wrong = error > 0
    np_dtype = runner.np_dtype(case.dtype)
    ulps = error[wrong] / (
        float(jnp.finfo(np_dtype).eps) * np.maximum(np.abs(exact[wrong]), jnp.finfo(np_dtype).tiny)
    )
    if not wrong.any() or not np.all(ulps <= case.mesh.axis_size):  # a rounding per ring step at most
        return []
    return [
        f"{ROUNDED_PREFIX} the backward computes in {case.dtype} what it should only move: each wrong "
        f"element is off by at most {int(np.ceil(ulps.max()))} roundings (|error| <= k x eps x |exact|) of "
        f"an exact gradient that needs no arithmetic ({case.spec.backward_exact})",
        f"points to      : {EXACT_BACKWARD_BY_AUTODIFF}; a custom_vjp that gives each device its gradient as "
        "the math has it moves it exactly",
    ]


def _naming(failure: ConformanceFailure, mistake: str) -> ConformanceFailure:
    """``failure`` with a ``known mistake`` line before its replay line, and the mistake as its why."""
    before, replay = str(failure).rsplit("\n  replay         : ", 1)
    named = ConformanceFailure(f"{before}\n  known mistake  : {mistake}\n  replay         : {replay}")
    named.case, named.check, named.what, named.why = failure.case, failure.check, failure.what, mistake
    return named


def _known_vjp_mistake(
    case: Case, inputs64: tuple, ct64: np.ndarray, grads: Sequence[Any], tolerance: Sequence[Any]
) -> str | None:
    """The description of the family's gradient mistake (``vjp_known_mistakes``) every gradient of the
    kernel matches, within its tolerance, or ``None``: read shard by shard, so that each rank of a job
    judges the shards it holds against the same global answer."""

    def matches(grad: Any, theirs: np.ndarray, tol: Any) -> bool:
        tol = np.broadcast_to(tol, theirs.shape)
        return all(
            np.all(np.abs(np.asarray(s.data).astype(np.float64) - theirs[s.index]) <= tol[s.index])
            for s in grad.addressable_shards
        )

    for mistake in case.spec.vjp_known_mistakes:
        theirs = mistake.reference(*inputs64, ct64, axis_size=case.mesh.axis_size)
        if all(matches(g, m, t) for g, m, t in zip(grads, theirs, tolerance, strict=True)):
            return mistake.description
    return None


def gradients_judged_at(case: Case) -> bool:
    """Whether the gradients' worst-case bound says something at ``case``'s dims and dtype (it turns
    on them alone: a contraction of 256 in bfloat16 is ``n * u >= 1``). A drawn gradient case where
    it does not is not drawn (hypothesis draws another); the backward_accuracy check judges those."""
    spec = case.spec
    if spec.vjp_tolerance is None:
        return True
    # data zero; the operands that are not data (a routing) as the case lays them out
    args = [
        np.zeros(a.shape) if op.is_data else a.astype(np.float64)
        for op, a in zip(spec.operands, runner.make_inputs(case), strict=True)
    ]
    try:
        spec.vjp_tolerance(*args, np.zeros(case.out_shape), case.dtype)
    except tolerances.Unbounded:
        return False
    return True


#: The usual cause of an unneeded all-reduce in a backward pass, for the failure message.
DEFENSIVE_ALL_REDUCE_HINT = (
    "an all-reduce here is typically the defensive psum shard_map adds in the backward of an output "
    "it cannot prove replicated (check_vma=False, or a pallas_call whose varying axes are undeclared): "
    "declare them (README: 'Backward passes without defensive all-reduces')"
)


@dataclasses.dataclass(frozen=True)
class BackwardAudit:
    """What a pullback's modules hold: the compiled host module and each cross-lowered one."""

    compiled: hlo.CollectiveSummary
    lowered: dict[str, hlo.CollectiveSummary]

    def forbidden(self, allowed: frozenset[str]) -> list[str]:
        """One line per module using a collective outside ``allowed`` (plus a hint for an all-reduce)."""
        lines, kinds = [], set()
        for where, summary in [
            ("compiled for the host (cpu)", self.compiled),
            *((f"lowered for {t}", s) for t, s in self.lowered.items()),
        ]:
            bad = hlo.disallowed(summary, allowed)
            if bad:
                lines.append(f"{where}: " + "; ".join(op.describe() for op in bad))
                kinds.update(op.kind for op in bad)
        if "all-reduce" in kinds:
            lines.append(DEFENSIVE_ALL_REDUCE_HINT)
        return lines


def audit_backward(
    fn: Callable[..., object],
    args: Sequence[jax.ShapeDtypeStruct],
    cotangent: jax.ShapeDtypeStruct,
    *,
    host_fn: Callable[..., object] | None = None,
    targets: Sequence[str] = ("tpu", "cuda"),
) -> BackwardAudit:
    """The collectives in ``fn``'s VJP, compiled for this host and lowered for each of ``targets``.

    ``host_fn`` is what runs on this host if it differs from what the targets
    see (a Pallas kernel in interpret mode). Usable on any function, not only
    registered kernels: the suite's seed-issue test calls it directly.
    """
    abstract = (*args, cotangent)
    traced = runner.pullback_of(fn).trace(*abstract)  # one trace, lowered for each target
    host = traced if host_fn is None else runner.pullback_of(host_fn).trace(*abstract)
    compiled = runner.compile_lowered(host.lower(), jax.default_backend())
    lowered = {t: hlo.parse_stablehlo(compat.lower_traced(traced, t).as_text()) for t in targets}
    return BackwardAudit(hlo.parse_hlo(compiled.as_text()), lowered)


def assert_backward_collectives(
    fn: Callable[..., object],
    args: Sequence[jax.ShapeDtypeStruct],
    cotangent: jax.ShapeDtypeStruct,
    *,
    name: str,
    allowed: frozenset[str] = frozenset(),
    host_fn: Callable[..., object] | None = None,
    targets: Sequence[str] = ("tpu",),
) -> BackwardAudit:
    """Raise :class:`ConformanceFailure` if ``fn``'s VJP uses a collective outside ``allowed``.

    For any function, registered or not: compiled for this host (``host_fn``,
    e.g. the Pallas kernel in interpret mode) and lowered for each of ``targets``.
    """
    audit = audit_backward(fn, args, cotangent, host_fn=host_fn, targets=targets)
    problems = audit.forbidden(allowed)
    if problems:
        shapes = ", ".join(f"{list(a.shape)} {a.dtype}" for a in args)
        lines = [
            f"[backward_collectives] {name}: the backward pass uses collectives its math does not need",
            f"  arguments      : {shapes}; cotangent {list(cotangent.shape)}",
            f"  allowed        : {hlo.allowed_text(allowed)}",
            *("  " + p for p in problems),
        ]
        raise ConformanceFailure("\n".join(lines))
    return audit


def check_backward_collectives(case: Case) -> ByteRecord:
    """The VJP uses only the collectives the family's gradient math needs, on every target.

    Audited twice: the module compiled for this host (with byte accounting) and
    the modules lowered for the implementation's targets, because a collective
    one backend's compiler removes can survive in another's (XLA CPU drops the
    defensive all-reduce that the TPU lowering keeps).
    """
    spec, impl = case.spec, case.implementation
    if spec.backward_max_received_bytes is None:
        raise ValueError(f"family {case.family} defines no backward byte bound")
    summary = hlo.parse_hlo(
        call_kernel(case, "backward_collectives", lambda: runner.compiled_pullback(case).as_text())
    )
    lowered = {}
    for target in impl.lowering_targets:
        text = call_kernel(
            case, "backward_collectives", lambda t=target: runner.lowered_pullback_for(case, t).as_text()
        )
        lowered[target] = hlo.parse_stablehlo(text)
    audit = BackwardAudit(summary, lowered)
    n, itemsize = case.mesh.axis_size, runner.np_dtype(case.dtype).itemsize
    bound = spec.backward_max_received_bytes(case.dims_map, n, itemsize)
    received, counted = as_the_op_moves_them(
        case, summary, backward=True, check="backward_collectives", bound=bound
    )
    record = ByteRecord.of(case, summary, bound, received=received)
    if impl.baseline:
        return record
    with keeping([record]):
        allowed = spec.backward_allowed_collectives
        ops = summary.byte_lines(summed=not counted) + counted
        problems = audit.forbidden(allowed)
        if problems:
            allowed_text = hlo.allowed_text(allowed)
            what = "the backward pass uses collectives its math does not need"
            raise fail(
                case,
                "backward_collectives",
                what,
                [
                    f"allowed        : {allowed_text} ({spec.backward_byte_bound_text})",
                    *problems,
                ],
            )
        check_byte_bound(
            case,
            "backward_collectives",
            "the backward pass receives more than its math needs",
            received,
            bound,
            spec.backward_byte_bound_text,
            ops + wider_transfers(case, audit.lowered.values(), backward=True),
        )
    return record


CHECKS = (
    # the backward's values at drawn cases on a mesh of each kind: a ring of one, rings of 2 to 6 and
    # 8 (odd ones and one that is no power of two among them), an axis of a 2-D and of a 3-D mesh, a
    # permuted order, Auto and Explicit; what a backward ring gets wrong at a ring length (a position
    # wrapped with a bit mask, a split that assumes an even ring, a ring that stops after a few hops)
    # shows on these. The forward's values keep every mesh.
    Check(
        "gradients",
        check_gradients,
        axes=Axes(case="drawn_gradients", meshes="covering", implementations=("differentiable",)),
        doc="``jax.vjp`` with random cotangents against numpy float64 gradients, on a mesh of each kind.",
    ),
    Check(
        "backward_collectives",
        check_backward_collectives,
        concern="program",
        tables=lambda records: byte_table(
            "backward (VJP): bytes received per device / the math's bound (compiled HLO)", records
        ),
        # a defensive all-reduce, a float32 copy: the backward's collectives turn on how it was
        # written, not on the ring; its bytes scale with the ring, as the 1-, 2- and 3-D rings show
        axes=Axes(meshes="dimensions", implementations=("differentiable",)),
        doc="The backward pass uses only the collectives its math needs: compiled here and lowered for "
        "targets.",
    ),
)
