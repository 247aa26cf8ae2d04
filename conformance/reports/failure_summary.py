"""The end-of-run summary of failures: each cause once, smallest failing case first.

One defect usually fails many tests: a kernel that drops the last row of an odd
shard fails ``output_sharding`` on every mesh and ``races`` in both DMA modes.
Listed test by test that is forty failures; grouped here it is one implementation,
one or two causes (a check and its one-line verdict), the smallest case each cause
fails on, whether the fixed-shape checks fail at the odd shape, the even one, or both, and
where a check's failing meshes (or dtypes) differ from its passing ones in one feature (rings of 3,
5, 6 and 7 against 1, 2, 4 and 8), that feature. Causes come in the order a kernel author should
look at them (a wrong result, then precision, then the program, then performance,
:data:`~conformance.checks.base.CONCERNS`); the replay line of the first one's smallest case is
where to start.
"""

from __future__ import annotations

import dataclasses
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable

from conformance import checks, registry
from conformance.checks.base import CONCERNS
from conformance.fixtures.meshes import MeshConfig, parse_mesh
from conformance.reports import results
from conformance.specs.base import FIXED_SHAPES

#: Causes listed per implementation before the rest are counted.
MAX_CAUSES = 8


#: The outcomes a kernel's summary counts: it ran and passed, or it failed.
PASSED, FAILED = ("passed", "xpassed"), "failed"


def _cause(o: results.Outcome) -> results.FailureCause:
    """One failed test as the summary needs it: the check that failed, its case, its verdict line."""
    f = o.failure
    if f is None:
        return results.FailureCause(o.check or "?", o.what)
    return dataclasses.replace(f, check=f.check or o.check or "?")


def _dims_text(dims: dict[str, int]) -> str:
    return ", ".join(f"{k}={v}" for k, v in dims.items())


def _token_dims(token: str | None) -> str | None:
    """The dims of a case token (``MESH:DIM=V,...:DTYPE:seed=S``) as :func:`_dims_text` writes them."""
    parts = (token or "").split(":")
    return parts[1].replace(",", ", ") if len(parts) >= 4 else None


def _shape_line(family: str, impl: str, outcomes: list[results.Outcome]) -> list[str]:
    fixed = [v for v in outcomes if v.shape in FIXED_SHAPES]
    if not fixed:
        return []
    spec, parts, failed = registry.spec_of(family, impl), [], {}
    for shape in FIXED_SHAPES:
        ran = [v for v in fixed if v.shape == shape]
        failed[shape] = sum(v.outcome == "failed" for v in ran)
        if ran:
            family_dims = _dims_text(spec.fixed_dims(shape))
            run_dims = sorted({d for v in ran if (d := _token_dims(v.case)) is not None} - {family_dims})
            dims = (
                f"{' or '.join(run_dims)}: the family's {family_dims}, moved to what the kernel claims"
                if run_dims
                else family_dims
            )
            parts.append(f"{shape} ({dims}) {failed[shape]} of {len(ran)} failed")
    line = "  fixed shapes: " + "; ".join(parts)
    ran_both = all(any(v.shape == s for v in fixed) for s in FIXED_SHAPES)
    if ran_both and failed["odd"] and not failed["even"]:
        line += "\n                -> every fixed-shape failure needs the odd shape: look at odd sizes first"
    elif ran_both and failed["even"] and not failed["odd"]:
        line += "\n                -> every fixed-shape failure needs the even shape"
    return [line]


#: What a mesh is, as the summary compares the meshes a check passed on with those it failed on: the
#: first of these that tells them apart (no value shared) is the pattern reported.
MESH_FEATURES: tuple[tuple[str, Callable[[MeshConfig], object]], ...] = (
    ("rings of", lambda m: m.axis_size),
    ("device order", lambda m: m.device_order),
    ("mesh axes", lambda m: len(m.shape)),
    ("axis type", lambda m: m.axis_type),
)


def _ring_hint(failing: set, passing: set) -> str:
    """What ring lengths that fail and pass (``failing``, ``passing``) have in common, in words."""

    def power_of_two(n: int) -> bool:
        return n & (n - 1) == 0

    if failing == {1}:
        return "only the ring of one fails: a shortcut for one device"
    if 1 in passing and 1 not in failing and passing == {1}:
        unrun = sorted(set(range(2, max(failing))) - failing)
        return "every ring longer than one that ran fails" + (
            f" (rings of {', '.join(map(str, unrun))} did not run)" if unrun else ""
        )
    if all(not power_of_two(n) for n in failing) and all(power_of_two(n) for n in passing):
        return (
            "every failing ring length is no power of two: a position wrapped with a bit mask, or a "
            "split or step count that assumes a power of two"
        )
    if all(n % 2 for n in failing) and not any(n % 2 for n in passing if n > 1):
        return (
            "every failing ring longer than one is odd: a split, a step count or an index that assumes "
            "an even ring"
        )
    return ""


_FEATURE_HINTS: dict[str, Callable[[set, set], str]] = {
    "rings of": _ring_hint,
    "device order": lambda f, p: (
        "a neighbour or position taken from device ids, not mesh positions" if "ids" in p else ""
    ),
    "mesh axes": lambda f, p: (
        "a ring position or neighbour computed from one mesh axis alone" if p == {1} else ""
    ),
    "axis type": lambda f, p: "the typed sharding of an Explicit axis" if f == {"explicit"} else "",
}


def _values_text(feature: str, values: set) -> str:
    shown = ", ".join(str(v) for v in sorted(values))
    return f"{shown}-D meshes" if feature == "mesh axes" else f"{feature} {shown}"


def _mesh_lines(outcomes: list[results.Outcome]) -> list[str]:
    """Per check, where the meshes it failed on and those it passed on differ in one feature (the
    ring's length, the device order, the mesh's axes, the axis type): that line, and what such a
    difference usually means. One line per pattern, naming every check that shows it."""
    by_check: dict[str, dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
    for o in outcomes:
        if o.mesh and o.check:
            by_check[o.check][o.mesh].append(o.outcome)
    found: dict[str, list[tuple[str, set, set]]] = defaultdict(list)  # feature -> (check, F, P)
    for check, meshes in by_check.items():
        try:
            configs = {label: parse_mesh(label) for label in meshes}
        except ValueError:
            continue  # a label of a target's topology, not a mesh of the run
        failing = [configs[m] for m, got in meshes.items() if FAILED in got]
        passing = [configs[m] for m, got in meshes.items() if all(g in PASSED for g in got)]
        if not failing or not passing:
            continue
        for feature, value_of in MESH_FEATURES:
            f, p = {value_of(m) for m in failing}, {value_of(m) for m in passing}
            if not f & p:
                found[feature].append((check, f, p))
                break
    lines = []
    for feature, _ in MESH_FEATURES:
        shown = found.get(feature, [])
        failing = set().union(*(f for _, f, _ in shown))
        passing = set().union(*(p for _, _, p in shown))
        # the checks agree (no value fails in one and passes in another): one line for all of them
        groups = [shown] if not failing & passing else [[one] for one in shown]
        for group in groups:
            if not group:
                continue
            names = ", ".join(sorted(check for check, _, _ in group))
            f, p = set().union(*(f for _, f, _ in group)), set().union(*(p for _, _, p in group))
            hint = _FEATURE_HINTS[feature](f, p)
            lines.append(
                f"  meshes: {names} failed on {_values_text(feature, f)} only and passed on "
                f"{_values_text(feature, p)}" + (f"\n                -> {hint}" if hint else "")
            )
    return lines


def _dtype_lines(outcomes: list[results.Outcome]) -> list[str]:
    """Per check run at several dtypes, where it failed at some and passed at all the others: which."""
    by_check: dict[str, dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
    for o in outcomes:
        if o.dtype and o.check:
            by_check[o.check][o.dtype].append(o.outcome)
    found: dict[tuple, list[str]] = defaultdict(list)
    for check, dtypes in by_check.items():
        failing = sorted(d for d, got in dtypes.items() if FAILED in got)
        passing = sorted(d for d, got in dtypes.items() if all(g in PASSED for g in got))
        if failing and passing:
            found[(tuple(failing), tuple(passing))].append(check)
    return [
        f"  dtypes: {', '.join(sorted(names))} failed at {', '.join(f)} only and passed at {', '.join(p)}"
        for (f, p), names in sorted(found.items())
    ]


def concern_rank(check: str) -> int:
    """Where a failure of ``check`` comes in the order to look at (:data:`~conformance.checks.base.CONCERNS`):
    a wrong result first; a check the run does not know (send_recv's) is a result."""
    known = checks.CHECKS.get(check)
    return CONCERNS.index(known.concern) if known is not None else 0


#: How the summary picks where to start, printed beside it.
START_HERE_RULE = (
    "the smallest failing case of the first cause, causes ordered a known mistake of the family first, "
    "then a wrong result, then precision, then what the program moves or holds, then what it leaves waiting"
)


def summarize(outcomes: Iterable[results.Outcome]) -> list[str]:
    """Lines of the summary, one block per implementation with a failure; ``[]`` if none failed.

    ``outcomes``: the run's (:class:`conformance.reports.results.Outcome`, their id parts filled in); a
    failure's case and verdict line come from the check's failure the outcome carries."""
    by_impl: dict[tuple[str, str], list[results.Outcome]] = defaultdict(list)
    for o in outcomes:
        if o.family and o.impl and (o.outcome in PASSED or o.outcome == FAILED):
            by_impl[(o.family, o.impl)].append(o)
    lines: list[str] = []
    for (family, impl), group in sorted(by_impl.items()):
        failures = [_cause(o) for o in group if o.outcome == FAILED]
        if not failures:
            continue
        passed = sum(o.outcome in PASSED for o in group)
        lines.append(f"{family}/{impl}: {len(failures)} failed, {passed} passed")
        lines += _shape_line(family, impl, group)
        lines += _mesh_lines(group)
        lines += _dtype_lines(group)
        causes: dict[str, list[results.FailureCause]] = defaultdict(list)
        for v in failures:  # one cause: one verdict line, whichever checks gave it
            causes[v.what or f"{v.check}: no verdict line (see the test's report)"].append(v)

        def smallest(vs: list[results.FailureCause]) -> results.FailureCause | None:
            """The smallest failing case of a cause, one that names a known mistake before any other:
            a cause's failures share a verdict line, and a known mistake matched in one says what the
            others are (a drawn case's may not match where the fixed shapes' does)."""
            sized = [v for v in vs if v.case_size is not None]
            return min(sized, key=lambda v: (not v.names_a_known_mistake, v.case_size), default=None)

        def order(item: tuple[str, list[results.FailureCause]]) -> tuple:
            first = smallest(item[1])
            rank = min(concern_rank(v.check) for v in item[1])
            named = first is not None and first.names_a_known_mistake
            return (not named, rank, first is None, first.case_size if first else (), -len(item[1]), item[0])

        ordered = sorted(causes.items(), key=order)
        for what, vs in ordered[:MAX_CAUSES]:
            per_check = Counter(v.check for v in vs)
            where = ", ".join(f"{check} {n}" for check, n in per_check.most_common())
            lines.append(f"  {len(vs):>3}x {what}")
            first = smallest(vs)
            at = f"; smallest: {first.case_token} ({first.check})" if first else ""
            lines.append(f"       in {where}{at}")
            if first and first.why:
                lines.append(f"       why: {first.why}")
        if len(ordered) > MAX_CAUSES:
            rest = ordered[MAX_CAUSES:]
            lines.append(f"  ... and {len(rest)} more causes ({sum(len(vs) for _, vs in rest)} failures)")
        first = next((f for _, vs in ordered if (f := smallest(vs)) is not None), None)
        if first and first.replay:
            lines.append(f"  start here : {first.replay}")
            lines.append(f"               ({START_HERE_RULE})")
    return lines
