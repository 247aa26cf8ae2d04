"""The forms a MoE kernel may declare beside the families' own (:mod:`~conformance.specs.moe_dispatch`,
:mod:`~conformance.specs.moe_combine`, :mod:`~conformance.specs.moe_layer`):

* ``capacity``, of all three: a rule for dropping tokens past an expert capacity
  (:class:`~conformance.specs.moe_routing.ExpertCapacity`); every reference on the routing with the
  dropped choices routed nowhere;
* ``replicas``, of all three: a rule for which of an expert's replicas a row goes to, where the placement
  hosts an expert on several devices (:class:`~conformance.specs.moe_routing.ExpertReplicas`); the
  replicated placement is drawn for that kernel, and every reference takes each replica as an expert of
  its own;
* ``group_alignment``, of a dispatch and a combine: each expert's group of rows starting at a multiple
  of that many rows, the rows between zero (a grouped matmul's tiles: 8 rows a sublane tile, 128 an
  MXU's); every reference in the packed layout, its rows then moved to their aligned places. A whole
  layer's groups never show in its result, so it has nothing to declare.

Each derives the family's spec (:attr:`conformance.specs.base.RegistrationOption.derive`), with a
:class:`~conformance.specs.base.FormChange` onto the family's own form, in which the baseline runs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from conformance.specs import moe_routing
from conformance.specs.base import Dims, FamilySpec, FormChange, KnownMistake, RegistrationOption
from conformance.specs.moe_routing import (
    ONE_REPLICA_RULES,
    REPLICATED_EXPERTS,
    ExpertCapacity,
    ExpertReplicas,
    capped,
    expert_ids,
    physical,
    placement,
)


def _composed(spec: FamilySpec, fold: Callable, unfold: Callable) -> FormChange:
    """The form change of a form derived from ``spec`` by ``fold`` (its arrays into ``spec``'s form)
    and ``unfold`` (``spec``'s results back), through ``spec``'s own where it is itself derived."""
    inner = spec.family_form
    if inner is None:
        return FormChange(dims=dict, fold=fold, unfold=unfold)
    return FormChange(
        dims=inner.dims,
        fold=lambda arrays: inner.fold(fold(arrays)),
        unfold=lambda value, like, arrays: unfold(inner.unfold(value, like, fold(arrays)), like, arrays),
    )


def with_capacity(
    spec: FamilySpec, capacity: ExpertCapacity, *, least_received: Callable[..., int]
) -> FamilySpec:
    """A MoE family's form for a kernel declaring ``capacity``: every reference, tolerance and known
    mistake of ``spec`` on the case's ``expert_ids`` with the dropped choices :data:`UNROUTED`
    (:func:`capped`); the least a device receives ``least_received(expert_ids, placement)`` rows of the
    capped routing. The operands, the layout and the most a device may receive are the family's."""
    names = spec.operand_names
    at_ids, at_where = names.index("expert_ids"), names.index("placement")

    def cap(arrays: tuple[np.ndarray, ...]) -> tuple[np.ndarray, ...]:
        """The operands (and whatever follows them: a cotangent, a dtype) with the routing capped."""
        out = list(arrays)
        out[at_ids] = capped(np.asarray(arrays[at_ids]), np.asarray(arrays[at_where]), capacity)
        return tuple(out)

    def on_capped(fn: Callable[..., object] | None) -> Callable[..., object] | None:
        return None if fn is None else lambda *args, **kwargs: fn(*cap(args), **kwargs)

    def reference(*inputs: np.ndarray, axis_size: int) -> np.ndarray:
        return spec.expected(cap(inputs), axis_size=axis_size)

    def mistake(known: KnownMistake) -> KnownMistake:
        return KnownMistake(known.description, on_capped(known.reference))

    def least(d: Dims, n: int, itemsize: int) -> int:
        ids = capped(expert_ids(d, n), placement(d, n), capacity)
        return least_received(ids, placement(d, n)) * d["hidden"] * itemsize

    return dataclasses.replace(
        spec,
        summary=f"{spec.summary}; {capacity.describe()}, the rest dropped",
        reference=reference,
        tolerance=on_capped(spec.tolerance),
        vjp_reference=on_capped(spec.vjp_reference),
        vjp_tolerance=on_capped(spec.vjp_tolerance),
        known_mistakes=tuple(mistake(k) for k in spec.known_mistakes),
        vjp_known_mistakes=tuple(mistake(k) for k in spec.vjp_known_mistakes),
        explain_wrong=on_capped(spec.explain_wrong),
        min_received_bytes=least,
        family_form=_composed(spec, cap, lambda value, like, arrays: value),
    )


def capacity_option(*, least_received: Callable[..., int]) -> RegistrationOption:
    """The registration option ``capacity`` of a MoE family whose least received rows are
    ``least_received(expert_ids, placement)``."""
    return RegistrationOption(
        default=None,
        accepts=lambda v: v is None or isinstance(v, ExpertCapacity),
        expects="None or a conformance.ExpertCapacity",
        doc="the kernel's rule for dropping tokens past an expert capacity (conformance.ExpertCapacity: "
        "factor, group, order); the reference drops the same (token, choice) rows. None: it drops none",
        derive=lambda spec, capacity: with_capacity(spec, capacity, least_received=least_received),
    )


def with_replicas(
    spec: FamilySpec, replicas: ExpertReplicas, *, least_received: Callable[..., int]
) -> FamilySpec:
    """A MoE family's form for a kernel declaring ``replicas``: the routing :data:`REPLICATED_EXPERTS`
    drawn besides the family's, and every reference, tolerance, known mistake and bound of ``spec`` on
    the case's routing with each replica an expert of its own (:func:`physical`: each row's expert the
    slot the rule picks, the placement ``arange``). On a placement of distinct experts nothing changes."""
    names = spec.operand_names
    at_ids, at_where = names.index("expert_ids"), names.index("placement")

    def one_each(arrays: tuple, rule: str = replicas.rule) -> tuple:
        """The operands (and whatever follows them) with every replica an expert of its own, each row at
        the replica ``rule`` picks."""
        out = list(arrays)
        out[at_ids], out[at_where] = physical(np.asarray(arrays[at_ids]), np.asarray(arrays[at_where]), rule)
        return tuple(out)

    def on_replicas(fn: Callable[..., object] | None) -> Callable[..., object] | None:
        return None if fn is None else lambda *args, **kwargs: fn(*one_each(args), **kwargs)

    def reference(*inputs: np.ndarray, axis_size: int) -> np.ndarray:
        return spec.expected(one_each(inputs), axis_size=axis_size)

    def mistake(known: KnownMistake) -> KnownMistake:
        return KnownMistake(known.description, on_replicas(known.reference))

    def one_replica(which: str) -> KnownMistake:
        def result(*inputs: np.ndarray, axis_size: int) -> np.ndarray:
            return spec.expected(one_each(inputs, which), axis_size=axis_size)

        return KnownMistake(
            f"every row of an expert the placement hosts more than once sent to its {which} replica, "
            f"whichever device sends it ({replicas.describe()}; a placement inverted by a scatter keeps one "
            "slot an expert for every sender)",
            result,
        )

    def explain(*args: object, **kwargs: object) -> list[str]:
        """The family's explanation on each replica as an expert (named by its slot), after a line that
        says which slots are whose."""
        lines = spec.explain_wrong(*one_each(args), **kwargs)
        flat = np.asarray(args[at_where]).astype(np.int64).reshape(-1)
        x = np.asarray(args[at_where]).shape[-1]
        twice = [int(e) for e in np.unique(flat) if (flat == e).sum() > 1]
        if twice and lines:
            held = "; ".join(
                f"expert {e} at slots {', '.join(f'{p} (device {p // x})' for p in np.nonzero(flat == e)[0])}"
                for e in twice
            )
            lines.insert(0, f"replicas       : {held}; the lines below name each slot an expert of its own")
        return lines

    def least(d: Dims, n: int, itemsize: int) -> int:
        if d["routing"] != REPLICATED_EXPERTS:
            return spec.min_received_bytes(d, n, itemsize)
        ids, where = physical(expert_ids(d, n), placement(d, n), replicas.rule)
        return least_received(ids, where) * d["hidden"] * itemsize

    routings = (*spec.values_of("routing"), REPLICATED_EXPERTS)
    return dataclasses.replace(
        spec,
        summary=f"{spec.summary}; {replicas.describe()}",
        dim_values={**spec.dim_values, "routing": routings},
        reference=reference,
        tolerance=on_replicas(spec.tolerance),
        vjp_reference=on_replicas(spec.vjp_reference),
        vjp_tolerance=on_replicas(spec.vjp_tolerance),
        backward_exact="",  # a token on several experts' devices: its gradient is their sum
        known_mistakes=(
            *(mistake(k) for k in spec.known_mistakes),
            *(one_replica(which) for which in ONE_REPLICA_RULES),
        ),
        vjp_known_mistakes=tuple(mistake(k) for k in spec.vjp_known_mistakes),
        explain_wrong=None if spec.explain_wrong is None else explain,
        min_received_bytes=least,
        family_form=_composed(spec, one_each, lambda value, like, arrays: value),
    )


def replicas_option(*, least_received: Callable[..., int]) -> RegistrationOption:
    """The registration option ``replicas`` of a MoE family whose least received rows are
    ``least_received(expert_ids, placement)``."""
    return RegistrationOption(
        default=None,
        accepts=lambda v: v is None or isinstance(v, ExpertReplicas),
        expects="None or a conformance.ExpertReplicas",
        doc="the kernel's rule for which replica of an expert hosted on several devices a row goes to "
        "(conformance.ExpertReplicas: rule='sender' or 'token'); the replicated placement is then drawn. "
        "None: it is given a placement of distinct experts only",
        derive=lambda spec, replicas: with_replicas(spec, replicas, least_received=least_received),
    )


def aligned_rows(d: Dims, n: int, alignment: int) -> int:
    """A device's rows in the aligned layout: the family's ``C`` and room to round each of its ``X``
    groups up to a multiple of ``alignment``."""
    return moe_routing.capacity(d, n) + d["experts_per_device"] * (alignment - 1)


def aligned_places(ids: np.ndarray, where: np.ndarray, alignment: int) -> np.ndarray:
    """``[n * C]``: the global row of the aligned layout each row of the packed one moves to (device
    ``d``'s from ``d`` times its aligned rows), ``-1`` for the rows after a device's last group."""
    n, x = where.shape
    packed = moe_routing.rows_per_device(ids, where)
    rows = packed + x * (alignment - 1)
    out = np.full(n * packed, -1, dtype=np.int64)
    for d, hosted in enumerate(where.astype(np.int64)):
        at, to = 0, 0
        for e in hosted:
            size = int((ids.astype(np.int64) == e).any(axis=1).sum())
            out[d * packed + at : d * packed + at + size] = d * rows + to + np.arange(size)
            at, to = at + size, to + -(-size // alignment) * alignment
    return out


def with_alignment(spec: FamilySpec, alignment: int, *, rows_operand: str | None) -> FamilySpec:
    """A MoE family's form for a kernel whose experts' groups start at multiples of ``alignment``:
    the experts' rows (the result of a dispatch, ``rows_operand=None``; a combine's ``rows_operand``)
    in the aligned layout, each group at the first multiple of ``alignment`` after the one before, the
    rows between zero, ``X * (alignment - 1)`` rows a device more than the family's. Every reference is
    the family's in the packed layout, the rows moved to their aligned places (a combine's taken from
    them); the byte bounds are the family's (the padding is a device's own)."""
    names = spec.operand_names
    at_ids, at_where = names.index("expert_ids"), names.index("placement")
    at_rows = None if rows_operand is None else names.index(rows_operand)

    def places(arrays) -> np.ndarray:
        return aligned_places(np.asarray(arrays[at_ids]), np.asarray(arrays[at_where]), alignment)

    def expand(packed: np.ndarray, arrays) -> np.ndarray:
        where = np.asarray(arrays[at_where])
        to = places(arrays)
        out = np.zeros((to.size + where.shape[0] * where.shape[1] * (alignment - 1), *packed.shape[1:]))
        out[to[to >= 0]] = np.asarray(packed)[to >= 0]
        return out

    def compress(aligned: np.ndarray, arrays) -> np.ndarray:
        to = places(arrays)
        out = np.zeros((to.size, *np.asarray(aligned).shape[1:]), dtype=np.asarray(aligned).dtype)
        out[to >= 0] = np.asarray(aligned)[to[to >= 0]]
        return out

    def packed_inputs(arrays: tuple) -> tuple:
        """The operands (and whatever follows them) with the rows operand packed."""
        if at_rows is None:
            return tuple(arrays)
        out = list(arrays)
        out[at_rows] = compress(arrays[at_rows], arrays)
        return tuple(out)

    def on_results(fn: Callable[..., object] | None) -> Callable[..., object] | None:
        """``fn`` on the packed inputs, its result (a dispatch's rows) moved to the aligned places."""
        if fn is None:
            return None

        def aligned(*args: object, **kwargs: object) -> object:
            value = fn(*packed_inputs(args), **kwargs)
            return expand(value, args) if at_rows is None and isinstance(value, np.ndarray) else value

        return aligned

    def on_gradients(fn: Callable[..., tuple] | None) -> Callable[..., tuple] | None:
        """``fn`` (inputs..., ct[, dtype]) on the packed inputs and cotangent, a combine's rows' gradient
        moved back to the aligned places."""
        if fn is None:
            return None

        def aligned(*args: object) -> tuple:
            inputs, rest = args[: len(names)], list(args[len(names) :])
            if at_rows is None:
                rest[0] = compress(rest[0], inputs)
            grads = list(fn(*packed_inputs(inputs), *rest))
            if at_rows is not None:
                grads[0] = expand(grads[0], inputs)
            return tuple(grads)

        return aligned

    def mistake(known: KnownMistake) -> KnownMistake:
        return KnownMistake(known.description, on_results(known.reference))

    def explain(*args: object, rerun: Callable | None = None, **kwargs: object) -> list[str]:
        inputs, (got, tol) = args[: len(names)], args[len(names) :]
        again = None if rerun is None else lambda **replaced: compress(rerun(**replaced), inputs)
        packed_tol = compress(tol, inputs) if isinstance(tol, np.ndarray) and tol.ndim else tol
        lines = spec.explain_wrong(*inputs, compress(got, inputs), packed_tol, rerun=again, **kwargs)
        between = np.ones(got.shape[0], dtype=bool)
        between[places(inputs)[places(inputs) >= 0]] = False
        held = np.nonzero(between & np.asarray(got != 0).reshape(got.shape[0], -1).any(axis=1))[0]
        if held.size:
            per = got.shape[0] // np.asarray(inputs[at_where]).shape[0]
            lines.append(
                f"rows extra     : {held.size} row{'s' if held.size > 1 else ''} between the aligned groups "
                f"{'are' if held.size > 1 else 'is'} not zero (the first on device {held[0] // per}, its row "
                f"{held[0] % per}): the padding of a group a grouped matmul reads must be zero"
            )
        return lines

    def shape(d: Dims, n: int) -> tuple[int, int]:
        return (n * aligned_rows(d, n, alignment), d["hidden"])

    def unfold(value: object, like: np.ndarray, arrays: tuple) -> object:
        """A family-form result or gradient in the case's form: packed rows moved to their places."""
        value = np.asarray(value)
        return value if value.shape == like.shape else expand(value, arrays)

    def reference(*inputs: np.ndarray, axis_size: int) -> np.ndarray:
        value = spec.expected(packed_inputs(inputs), axis_size=axis_size)
        return expand(value, inputs) if at_rows is None else value

    operands = spec.operands
    if at_rows is not None:
        operands = tuple(
            dataclasses.replace(op, shape=shape) if i == at_rows else op for i, op in enumerate(operands)
        )
    return dataclasses.replace(
        spec,
        summary=f"{spec.summary}; each expert's group at a multiple of {alignment} rows, zero between",
        operands=operands,
        out_shape=shape if at_rows is None else spec.out_shape,
        reference=reference,
        tolerance=on_results(spec.tolerance),
        vjp_reference=on_gradients(spec.vjp_reference),
        vjp_tolerance=on_gradients(spec.vjp_tolerance),
        known_mistakes=tuple(mistake(k) for k in spec.known_mistakes),
        explain_wrong=None if spec.explain_wrong is None else explain,
        family_form=_composed(spec, packed_inputs, unfold),
    )


def alignment_option(*, rows_operand: str | None) -> RegistrationOption:
    """The registration option ``group_alignment`` of a MoE family whose experts' rows are its result
    (``rows_operand=None``) or that operand."""
    return RegistrationOption(
        default=1,
        accepts=lambda v: type(v) is int and 1 <= v <= 1024,
        expects="an int from 1 to 1024",
        doc="the rows each expert's group starts at a multiple of (8, a sublane tile; 128, an MXU tile), "
        "the rows between zero, X * (alignment - 1) rows a device more than the packed layout's; 1: packed",
        derive=lambda spec, alignment: with_alignment(spec, alignment, rows_operand=rows_operand),
    )
