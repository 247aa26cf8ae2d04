"""Overlap: each transfer of a collective matmul can hide behind a matmul independent of it, read
from the dataflow of the compiled module and of the modules lowered for each target. Where libtpu
is installed, TPU is judged instead by the schedule the real TPU compiler gives
(:mod:`conformance.checks.tpu_schedule`): what its scheduler does, not what one could do."""

from __future__ import annotations

import dataclasses
import functools
import math
from collections import defaultdict
from typing import Any

from conformance import compat, hlo, runner
from conformance.checks.base import Axes, Check, NotJudged, call_kernel, fail, keeping, lower_or_note_limit
from conformance.runner import Case
from conformance.targets import tpu_compiler


@dataclasses.dataclass(frozen=True)
class OverlapRecord:
    """Transfers of one module that can hide behind a matmul, out of all its transfers."""

    family: str
    impl: str
    mesh: str
    ring: int  #: devices on the kernel's axis
    module: str  #: "compiled cpu", "lowered tpu", ...
    fraction: str  #: hideable/all transfers per call (:attr:`conformance.hlo.OverlapSummary.fraction`)
    baseline: bool
    #: Scheduled module: asynchronous start/done pairs whose span holds a matmul, out of all pairs.
    scheduled: tuple[int, int] | None = None


#: Why a Pallas kernel whose module holds no collective is not judged (the skip's reason). A Pallas
#: kernel that moves data by collectives around its kernels (a ppermute ring of pallas_call matmuls)
#: is judged as any kernel is: what it does decides, not how it registered.
PALLAS_OVERLAP = (
    "a Pallas kernel that moves data by DMAs inside the kernel, where HLO's dataflow cannot see them; "
    "its overlap is the kernel's own schedule (races and values check it runs)"
)


def _overlap_modules(case: Case) -> tuple[list[tuple[str, str]], list[str]]:
    """(module name, HLO text) of the compiled module and of those lowered for each target; and what
    this host could not lower."""
    compiled = call_kernel(case, "overlap", lambda: runner.compiled(case).as_text())
    modules = [(f"compiled {case.platform}", compiled)]
    limited = []
    for target in case.implementation.lowering_targets:
        if target == "tpu" and tpu_compiler.available():
            continue  # the real TPU schedule judges TPU (conformance.checks.tpu_schedule)
        lower = functools.partial(runner.lowered_for, case)
        lowered = lower_or_note_limit(case, "overlap", "the forward pass", lower, target, limited)
        if lowered is None:
            continue
        modules.append((f"lowered {target}", lowered.as_text(dialect="hlo")))
    return modules, limited


def check_overlap(case: Case) -> list[OverlapRecord]:
    """Transfers a scheduler can hide behind compute, read from the dataflow of each module.

    For a family whose point is overlap (the spec's ``overlap``): in the compiled module and in the
    modules lowered for the implementation's targets, each transfer needs a matmul that neither feeds
    it nor reads what it delivers (:func:`conformance.hlo.overlap`). A kernel passes with at least
    one such transfer and at most one exposed transfer per ring direction (a design may ship its
    finished result in a last hop with nothing left to multiply); the built-in rings hide every
    transfer. The baseline is recorded, not judged.
    """
    spec = case.spec
    if not spec.overlap:
        raise NotJudged(f"family {case.family} has no compute to hide its transfers behind")
    modules, limited = _overlap_modules(case)
    records: list[OverlapRecord] = []
    with keeping(records):
        _judge(case, modules, records)
        if limited:  # what did lower was judged; the rest this host could not try
            raise compat.HostCannotLower("; ".join(limited))
    return records


def _judge(case: Case, modules: list[tuple[str, str]], records: list[OverlapRecord]) -> None:
    spec, impl = case.spec, case.implementation
    for module_name, text in modules:
        summary = hlo.overlap(hlo.parse_module(text))
        record = OverlapRecord(
            case.family,
            case.impl,
            case.mesh.label,
            case.mesh.axis_size,
            module_name,
            summary.fraction,
            impl.baseline,
            summary.scheduled,
        )
        records.append(record)
        if impl.baseline:
            continue
        if not summary.transfers:
            raise NotJudged(
                PALLAS_OVERLAP
                if impl.pallas
                else f"the {module_name} module has no collective: no transfer to judge "
                "(data moved by a custom call is invisible to HLO's dataflow)"
            )
        # A transfer in a loop of unknown trip count (a module lowered, not compiled) counts as many.
        exposed = sum(math.inf if t.op.multiplicity is None else t.op.multiplicity for t in summary.exposed)
        if any(t.hideable for t in summary.transfers) and exposed <= summary.rings:
            continue
        shown = (summary.exposed + tuple(t for t in summary.transfers if t.hideable))[:8]
        rest = len(summary.transfers) > len(shown)
        raise fail(
            case,
            "overlap",
            "the transfers cannot hide behind matmuls",  # one cause whichever module showed it
            [
                f"module         : the {module_name} module",
                f"hideable       : {summary.fraction} transfers have a matmul independent of them",
                f"threshold      : every transfer but one per ring direction ({summary.rings} "
                f"direction{'s' if summary.rings > 1 else ''} here), and at least one",
                f"how            : {spec.overlap}",
                f"transfers in the {module_name} module (each with the matmuls around it):",
                *(f"  {t.describe()}" for t in shown),
                *([f"  ... and {len(summary.transfers) - len(shown)} more"] if rest else []),
            ],
        )


def overlap_table(records: list[Any]) -> list[tuple[str, list[str]]]:
    """Per implementation and module: transfers that can hide behind a matmul / all, per ring length."""
    if not records:
        return []
    title = (
        "overlap: transfers with a matmul independent of them / all transfers, by ring length "
        "(dataflow of each module)"
    )
    rows: dict[tuple[str, str, str], list] = defaultdict(list)
    for r in records:
        rows[(r.family, r.impl, r.module)].append(r)
    width = max(len(r.impl) for r in records)
    lines = []
    for (family, impl, module), recs in sorted(rows.items()):
        per_ring: dict[int, set[str]] = defaultdict(set)
        for r in recs:
            per_ring[r.ring].add(r.fraction)
        rings = "  ".join(f"n={n}: {', '.join(sorted(v))}" for n, v in sorted(per_ring.items()))
        scheduled = [r.scheduled for r in recs if r.scheduled is not None]
        line = f"{family:<21} {impl:<{width}}  {module:<12} {rings}"
        if scheduled:
            bracketing, pairs = sum(b for b, _ in scheduled), sum(p for _, p in scheduled)
            line += f"  scheduled: {bracketing}/{pairs} async pairs bracket a matmul"
        if recs[0].baseline:
            line += "  (baseline: reported, not judged)"
        lines.append(line)
    return [(title, lines)]


CHECKS = (
    Check(
        "overlap",
        check_overlap,
        concern="performance",
        tables=overlap_table,
        # the dataflow of a ring's steps: a ring of each kind (of 2 or more), the longest among them
        axes=Axes(meshes="covering", shapes=True, families_with="overlap", min_ring=2),
        doc="Each transfer can hide behind a matmul independent of it, in the dataflow of the compiled "
        "module and of the modules lowered for each target (families whose point is overlap).",
    ),
)
