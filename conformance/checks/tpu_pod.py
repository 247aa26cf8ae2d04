"""Pod scale: every kernel compiles for a pod slice of 64 and of 256 chips, or refuses cleanly.

No CPU host simulates 256 devices, and the other checks run rings of at most 16. The real TPU
compiler (libtpu, :mod:`conformance.targets.tpu_compiler`) compiles for a whole v5e slice of 64 (``8x8``) and
256 (``16x16``) chips on any host, at the family's TPU-native dims in bfloat16 (in float32 or float16
where the kernel claims no bfloat16, and the table says which). A kernel passes when
the compiler compiles it, or when the kernel itself refuses the ring before any compiler sees it,
naming the limit (a :class:`~conformance.targets.mosaic.TpuConstraintError` raised while tracing, as
:func:`conformance.refuse_on_tpu` raises). Anything else that stops the compile (a
Pallas kernel out of semaphores, "Ran out of memory in memory space sflag", a program too large)
fails, quoting the compiler: on a pod the user would meet it first. Where the compiler refuses the
family's baseline, XLA's own op (libtpu's ragged-all-to-all "is currently not supported in limited ICI
routing settings", on v5e slices of 64 and 256 chips), that is what the platform lacks, not a kernel's
defect: not judged, quoting the compiler, and the table says REFUSED.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from conformance import compat
from conformance.checks.base import Check, NotJudged, call_kernel, compiled_for, fail, keeping
from conformance.checks.on_topology import compiled_on_topology
from conformance.checks.target_tables import judges_line
from conformance.runner import Case
from conformance.targets import cpu_ragged_all_to_all, mosaic, tpu_compiler

#: The pod meshes: 1-D rings over a whole v5e slice.
POD_MESHES = ("64-x-explicit", "256-x-explicit")


@dataclasses.dataclass(frozen=True)
class TpuPodRecord:
    """One kernel compiled (or refused) for one pod slice."""

    family: str
    impl: str
    topology: str
    chips: int
    seconds: float
    code: int | None  #: generated code bytes (``None``: not compiled)
    refusal: str | None  #: the kernel's own refusal, naming its limit
    baseline: bool
    judge: str
    #: The dtype it was compiled at (bfloat16, else the float the kernel claims).
    dtype: str = "bfloat16"


def check_tpu_pod(case: Case) -> TpuPodRecord:
    """Compiled by the real TPU compiler for the v5e slice of the case's chips, or refused by the
    kernel itself naming its limit; a compiler refusal fails, quoted."""
    reason = tpu_compiler.unavailable_reason()
    if reason is not None:
        raise compat.HostLimit(f"pod scale is judged by the real TPU compiler: {reason}")
    chips = case.mesh.num_devices
    if chips not in tpu_compiler.V5E_BY_CHIPS:
        raise NotJudged(f"no whole v5e slice of {chips} chips")
    topology = tpu_compiler.V5E_BY_CHIPS[chips]
    records: list[TpuPodRecord] = []
    started = time.monotonic()

    def record(code: int | None, refusal: str | None, seconds: float | None = None) -> TpuPodRecord:
        made = TpuPodRecord(
            case.family,
            case.impl,
            topology,
            chips,
            time.monotonic() - started if seconds is None else seconds,
            code,
            refusal,
            case.implementation.baseline,
            tpu_compiler.judge(topology),
            case.dtype,
        )
        records.append(made)
        return made

    with keeping(records), compiled_for(topology):
        op_refused = _ragged_all_to_all_refused(case, topology)
        if op_refused is not None:  # the op's limit on this slice, asked of the compiler once
            record(None, None)
            raise NotJudged(op_refused)
        try:
            compiled = call_kernel(
                case,
                "tpu_pod",
                lambda: compiled_on_topology(case, topology),
                passing=(mosaic.TpuConstraintError, tpu_compiler.CompilerRefusal),
            )
        except mosaic.TpuConstraintError as refusal:  # the kernel's own, while tracing
            return record(None, f"{type(refusal).__name__}: {refusal}")
        except tpu_compiler.CompilerRefusal as refusal:
            record(None, None)
            if case.implementation.baseline:  # XLA's own op: what the platform lacks, no kernel's defect
                raise NotJudged(
                    f"XLA's own op does not compile on {chips} chips ({topology}): {refusal} "
                    f"({tpu_compiler.judge(topology)}); a kernel of the family that compiles there does "
                    "what the compiler cannot"
                ) from refusal
            if _refuses_xla_ragged_all_to_all(case, topology, refusal):  # the op's limit, in a kernel
                raise NotJudged(
                    f"the kernel calls XLA's ragged all-to-all, which the TPU compiler does not compile on "
                    f"{chips} chips ({topology}): {refusal} ({tpu_compiler.judge(topology)}); the "
                    "platform's limit, as for the family's baseline, not the kernel's"
                ) from refusal
            raise fail(
                case,
                "tpu_pod",
                f"the TPU compiler refuses it on {chips} chips ({topology})",
                [f"compiler       : {refusal}", f"judge          : {tpu_compiler.judge(topology)}"],
            ) from refusal
        # the compile's own time, also where it was read back from an earlier one
        return record(compiled.memory_analysis().generated_code_size_in_bytes, None, compiled.seconds)


def tpu_pod_table(records: list[Any]) -> list[tuple[str, list[str]]]:
    """Per implementation: compiled (seconds, code) or refused, per pod slice."""
    if not records:
        return []
    rows: dict[tuple[str, str], list[Any]] = {}
    for r in records:
        rows.setdefault((r.family, r.impl), []).append(r)
    width = max(len(r.impl) for r in records)
    lines = []
    for (family, impl), recs in sorted(rows.items()):
        cells = []
        for r in sorted(recs, key=lambda r: r.chips):
            if r.code is not None:
                cells.append(
                    f"{r.chips} chips: compiled in {r.seconds:.1f} s, code {r.code / (1 << 20):.1f} MiB"
                )
            elif r.refusal:
                cells.append(f"{r.chips} chips: refused by the kernel ({r.refusal[:80]})")
            else:
                cells.append(f"{r.chips} chips: REFUSED by the compiler")
        dtypes = sorted({r.dtype for r in recs} - {"bfloat16"})
        said = f"  (in {', '.join(dtypes)})" if dtypes else ""
        lines.append(f"{family:<21} {impl:<{width}}  " + "  |  ".join(cells) + said)
    lines.append(judges_line(records))
    return [("TPU pod scale: compiled for whole v5e slices by the real TPU compiler", lines)]


def _ragged_all_to_all_refused(case: Case, topology: str) -> str | None:
    """Why ``case`` is not judged on ``topology`` without compiling it: the kernel calls XLA's ragged
    all-to-all, and libtpu refuses that op itself on the slice
    (:func:`~conformance.targets.tpu_compiler.ragged_all_to_all_refusal`, one one-op program a slice).
    ``None`` where either is not so: the kernel is compiled and judged as any other. What else the
    compiler would say of such a program on this slice is not reached there (the op stops it), as on a
    chip."""
    mesh = tpu_compiler.mesh_on(case.mesh, topology)
    if not cpu_ragged_all_to_all.implementation_calls_the_op(case, mesh=mesh):
        return None
    refusal = tpu_compiler.ragged_all_to_all_refusal(topology)
    if refusal is None:
        return None
    whose = (
        "XLA's own op" if case.implementation.baseline else "the kernel calls XLA's ragged all-to-all, which"
    )
    return (
        f"{whose} does not compile on {case.mesh.num_devices} chips ({topology}): libtpu refuses the op "
        f"itself there, in a one-op program compiled for the slice: {refusal} "
        f"({tpu_compiler.judge(topology)}); the platform's limit, not the kernel's"
    )


def _refuses_xla_ragged_all_to_all(case: Case, topology: str, refusal: Exception) -> bool:
    """Whether the compiler's refusal is of XLA's ragged all-to-all, and the kernel calls that op."""
    said = str(refusal).lower()
    if "ragged all-to-all" not in said and "ragged_all_to_all" not in said:
        return False
    mesh = tpu_compiler.mesh_on(case.mesh, topology)
    return cpu_ragged_all_to_all.implementation_calls_the_op(case, mesh=mesh)


CHECKS = (
    Check("tpu_pod", check_tpu_pod, concern="program", tables=tpu_pod_table, compile_tier="tpu_compile"),
)
