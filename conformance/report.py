"""The end-of-run summary of failures: each cause once, smallest failing case first.

One defect usually fails many tests: a kernel that drops the last row of an odd
shard fails ``output_sharding`` on every mesh and ``races`` in both DMA modes.
Listed test by test that is forty failures; grouped here it is one implementation,
one or two causes (a check and its one-line verdict), the smallest case each cause
fails on, and whether the fixed-shape checks fail at the odd shape, the even one,
or both. The replay line of the smallest failing case is where to start.
"""

from __future__ import annotations

import dataclasses
from collections import Counter, defaultdict
from collections.abc import Iterable

from conformance import registry, results
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


def _shape_line(family: str, impl: str, outcomes: list[results.Outcome]) -> list[str]:
    fixed = [v for v in outcomes if v.shape in FIXED_SHAPES]
    if not fixed:
        return []
    spec, parts, failed = registry.spec_of(family, impl), [], {}
    for shape in FIXED_SHAPES:
        ran = [v for v in fixed if v.shape == shape]
        failed[shape] = sum(v.outcome == "failed" for v in ran)
        if ran:
            parts.append(
                f"{shape} ({_dims_text(spec.fixed_dims(shape))}) {failed[shape]} of {len(ran)} failed"
            )
    line = "  fixed shapes: " + "; ".join(parts)
    ran_both = all(any(v.shape == s for v in fixed) for s in FIXED_SHAPES)
    if ran_both and failed["odd"] and not failed["even"]:
        line += "\n                -> every fixed-shape failure needs the odd shape: look at odd sizes first"
    elif ran_both and failed["even"] and not failed["odd"]:
        line += "\n                -> every fixed-shape failure needs the even shape"
    return [line]


def summarize(outcomes: Iterable[results.Outcome]) -> list[str]:
    """Lines of the summary, one block per implementation with a failure; ``[]`` if none failed.

    ``outcomes``: the run's (:class:`conformance.results.Outcome`, their id parts filled in); a
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
        causes: dict[str, list[results.FailureCause]] = defaultdict(list)
        for v in failures:  # one cause: one verdict line, whichever checks gave it
            causes[v.what or f"{v.check}: no verdict line (see the test's report)"].append(v)

        def smallest(vs: list[results.FailureCause]) -> results.FailureCause | None:
            return min((v for v in vs if v.case_size is not None), key=lambda v: v.case_size, default=None)

        def order(item: tuple[str, list[results.FailureCause]]) -> tuple:
            first = smallest(item[1])
            return (first is None, first.case_size if first else (), -len(item[1]), item[0])

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
    return lines
