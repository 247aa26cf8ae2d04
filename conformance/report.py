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
import math
from collections import Counter, defaultdict
from collections.abc import Iterable

import numpy as np

from conformance import runner, specs
from conformance.runner import Case
from conformance.specs.base import FIXED_SHAPES

#: Causes listed per implementation before the rest are counted.
MAX_CAUSES = 8


@dataclasses.dataclass(frozen=True)
class Verdict:
    """One family test's outcome, as the summary needs it."""

    family: str
    impl: str
    check: str
    outcome: str  #: "passed" or "failed"
    #: Fixed-shape tests: "odd" or "even"; ``None`` for the others.
    shape: str | None = None
    #: Failures: the case and one-line verdict the check gave (``None`` if it gave none).
    case: Case | None = None
    what: str | None = None


def case_size(case: Case) -> tuple[int, int, int, str]:
    """Order of "smaller": fewer devices, then fewer elements, then narrower dtype."""
    itemsize = np.dtype(runner.np_dtype(case.dtype)).itemsize
    return case.mesh.num_devices, math.prod(v for _, v in case.dims), itemsize, case.token


def _dims_text(dims: dict[str, int]) -> str:
    return ", ".join(f"{k}={v}" for k, v in dims.items())


def _shape_line(family: str, verdicts: list[Verdict]) -> list[str]:
    fixed = [v for v in verdicts if v.shape is not None]
    if not fixed:
        return []
    spec, parts, failed = specs.get(family), [], {}
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


def summarize(verdicts: Iterable[Verdict]) -> list[str]:
    """Lines of the summary, one block per implementation with a failure; ``[]`` if none failed."""
    by_impl: dict[tuple[str, str], list[Verdict]] = defaultdict(list)
    for v in verdicts:
        by_impl[(v.family, v.impl)].append(v)
    lines: list[str] = []
    for (family, impl), group in sorted(by_impl.items()):
        failures = [v for v in group if v.outcome == "failed"]
        if not failures:
            continue
        passed = sum(v.outcome == "passed" for v in group)
        lines.append(f"{family}/{impl}: {len(failures)} failed, {passed} passed")
        lines += _shape_line(family, group)
        causes: dict[str, list[Verdict]] = defaultdict(list)
        for v in failures:  # one cause: one verdict line, whichever checks gave it
            causes[v.what or f"{v.check}: no verdict line (see the test's report)"].append(v)

        def smallest(vs: list[Verdict]) -> Verdict | None:
            return min((v for v in vs if v.case is not None), key=lambda v: case_size(v.case), default=None)

        def order(item: tuple[str, list[Verdict]]) -> tuple:
            first = smallest(item[1])
            return (first is None, case_size(first.case) if first else (), -len(item[1]), item[0])

        ordered = sorted(causes.items(), key=order)
        for what, vs in ordered[:MAX_CAUSES]:
            per_check = Counter(v.check for v in vs)
            where = ", ".join(f"{check} {n}" for check, n in per_check.most_common())
            lines.append(f"  {len(vs):>3}x {what}")
            first = smallest(vs)
            at = f"; smallest: {first.case.token} ({first.check})" if first else ""
            lines.append(f"       in {where}{at}")
        if len(ordered) > MAX_CAUSES:
            rest = ordered[MAX_CAUSES:]
            lines.append(f"  ... and {len(rest)} more causes ({sum(len(vs) for _, vs in rest)} failures)")
        first = next((f for _, vs in ordered if (f := smallest(vs)) is not None), None)
        if first:
            lines.append(f"  start here : {first.case.replay_command(first.check)}")
    return lines
