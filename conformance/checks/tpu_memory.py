"""TPU memory: what the real TPU compiler reserves for a kernel, beside XLA's own op at the same shapes.

Compiled for a TPU topology by libtpu (:mod:`conformance.targets.tpu_compiler`; the same compile the
scheduled-overlap check reads), ``Compiled.memory_analysis()`` gives the program's peak HBM bytes per
chip (``peak_memory_in_bytes``: arguments, outputs and every temporary live at the worst moment of
the schedule), its temporaries and its generated code. A kernel is held against the family's
baseline compiled for the same topology at the same shapes: a peak above :data:`PEAK_RATIO` times
the baseline's fails, naming both.

Why 3: a ring keeps its whole output, its products and the blocks in flight, where the baseline
keeps the gathered operand and one product; the built-in rings measure 0.6x to 2.4x the baseline's
peak across the ladder (the largest at the smallest rung on 16 chips, where the output dominates;
libtpu 0.0.42), so 3 leaves them room and still fails a kernel that keeps a float32 copy of its
output per ring step (``broken_agmm_keeps_every_step`` in the self-tests).

jaxlib 0.6.2 reports no peak (its ``CompiledMemoryStats`` lacks ``peak_memory_in_bytes``; for these
TPU programs its temporaries read 0 and its serialized buffer assignment is empty, on 0.10.2 too).
Nothing there stands in for the peak: the check records the bytes it has (arguments, outputs,
generated code) and does not judge.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from conformance import compat, registry
from conformance.checks.base import Check, NotJudged, compiled_for, fail, keeping
from conformance.checks.on_topology import compiled_on_topology, compiled_or_fail
from conformance.checks.target_tables import size_legend, topology_rows
from conformance.checks.tpu_schedule import SCHEDULE_TOPOLOGIES, compilers_own_case, ring_topologies
from conformance.runner import Case
from conformance.targets import tpu_compiler

#: A kernel's peak HBM bytes per chip may be at most this many times the baseline's (module doc).
PEAK_RATIO = 3.0


@dataclasses.dataclass(frozen=True)
class TpuMemoryRecord:
    """One kernel compiled for one TPU topology at one size: its memory beside the baseline's."""

    family: str
    impl: str
    topology: str
    dims: tuple[tuple[str, int], ...]
    peak: int | None  #: ``peak_memory_in_bytes`` (``None``: this jaxlib reports none)
    temp: int
    code: int  #: generated code bytes
    argument: int
    output: int
    baseline_impl: str
    baseline_peak: int | None
    baseline_code: int
    baseline: bool
    judge: str
    #: The compiler's own collective matmul's peak at the same topology and shapes (``None``: the
    #: family has none, this jaxlib reports no peak, or this is it).
    compiler_peak: int | None = None
    compilers_own: bool = False
    #: The flags of the compile (:func:`conformance.targets.target_compiles.flags_in_effect`).
    flags: str = "compiler defaults"
    #: The dtype it was compiled at (bfloat16, else the float the kernel claims).
    dtype: str = "bfloat16"

    @property
    def ratio(self) -> float | None:
        if self.peak is None or not self.baseline_peak:
            return None
        return self.peak / self.baseline_peak

    @property
    def compiler_ratio(self) -> float | None:
        if self.peak is None or not self.compiler_peak:
            return None
        return self.peak / self.compiler_peak


def memory_dims(family: str, impl: str) -> tuple[dict[str, int], ...]:
    """The sizes the memory check compiles: the family's schedule ladder, else its TPU-native dims
    (of its batched form for a batched kernel)."""
    spec = registry.spec_of(family, impl)
    ladder = tuple(dict(d) for d in spec.schedule_ladder)
    return ladder or ((dict(spec.tpu_native_dims),) if spec.tpu_native_dims else ())


def _baseline(family: str) -> str:
    found = registry.reference_baseline(family)
    if found is None:
        raise NotJudged(f"family {family} has no registered baseline to hold its memory against")
    return found.name


def check_tpu_memory(case: Case) -> list[TpuMemoryRecord]:
    """Compiled by the real TPU compiler for a v5e and a v6e slice of the case's ring length, the
    kernel's peak HBM bytes per chip are at most :data:`PEAK_RATIO` times the family baseline's at the
    same shapes. The baseline is recorded, not judged; a host without libtpu skips, naming the install
    command."""
    return check_memory(case, tpu_compiler, SCHEDULE_TOPOLOGIES, check="tpu_memory", record=TpuMemoryRecord)


def check_memory(
    case: Case, compiler: Any, topologies: Mapping[int, tuple[str, ...]], *, check: str, record: type
) -> list[Any]:
    """The memory verdict of ``compiler`` (:mod:`~conformance.targets.tpu_compiler` or
    :mod:`~conformance.targets.gpu_compiler`) for each topology of the case's ring length, one ``record``
    each."""
    found = ring_topologies(case, compiler, topologies, what=f"{compiler.NAME} memory")
    baseline = _baseline(case.family)
    base_case = Case.make(case.family, baseline, case.mesh, dict(case.dims), case.dtype)
    records: list[Any] = []
    with keeping(records):
        for topology in found:
            with compiled_for(topology):
                _judge(case, base_case, topology, records, compiler=compiler, check=check, record=record)
    return records


def _judge(
    case: Case, base_case: Case, topology: str, records: list[Any], *, compiler: Any, check: str, record: type
) -> None:
    compiled = compiled_or_fail(case, topology, check)
    stats = compiled.memory_analysis()
    try:
        base = compiled_on_topology(base_case, topology).memory_analysis()
    except compiler.CompilerRefusal as refusal:
        raise NotJudged(
            f"the baseline {base_case.impl} does not compile for {topology}: {refusal}"
        ) from refusal
    own = compilers_own_case(case)
    own_stats = None
    if own is not None and not case.implementation.baseline:
        try:
            own_stats = compiled_on_topology(own, topology).memory_analysis()
        except (compiler.CompilerRefusal, compat.HostLimit):
            own_stats = None  # reported without the comparison
    made = record(
        case.family,
        case.impl,
        topology,
        case.dims,
        getattr(stats, "peak_memory_in_bytes", None),
        stats.temp_size_in_bytes,
        stats.generated_code_size_in_bytes,
        stats.argument_size_in_bytes,
        stats.output_size_in_bytes,
        base_case.impl,
        getattr(base, "peak_memory_in_bytes", None),
        base.generated_code_size_in_bytes,
        case.implementation.baseline,
        compiler.judge(topology),
        compiler_peak=getattr(own_stats, "peak_memory_in_bytes", None),
        compilers_own=case.implementation.compilers_own,
        flags=getattr(compiled, "flags", "compiler defaults"),
        dtype=case.dtype,
    )
    records.append(made)
    if made.baseline:
        return
    if made.peak is None:
        raise NotJudged(
            "this jaxlib reports no peak memory for a compiled program (jaxlib 0.6.2's "
            "CompiledMemoryStats has no peak_memory_in_bytes); arguments, outputs and code are "
            "recorded, not judged"
        )
    ratio = made.ratio
    if ratio is not None and ratio > PEAK_RATIO:
        raise fail(
            case,
            check,
            f"its peak memory is {ratio:.1f}x the baseline's ({topology})",
            [
                f"peak           : {_mib(made.peak)} per {compiler.DEVICE} ({case.impl}) vs "
                f"{_mib(made.baseline_peak)} ({made.baseline_impl}, the baseline, same shapes)",
                f"threshold      : at most {PEAK_RATIO}x the baseline's peak",
                f"temporaries    : {_mib(made.temp)}; arguments {_mib(made.argument)}, output "
                f"{_mib(made.output)}",
                f"judge          : {made.judge}, Compiled.memory_analysis(), under {made.flags}",
            ],
        )


def tpu_memory_table(records: list[Any]) -> list[tuple[str, list[str]]]:
    """Per implementation and topology: peak bytes per chip and its ratio to the baseline, per size;
    generated code beside the baseline's."""
    return memory_table(records, "TPU", device="chip")


def memory_table(records: list[Any], name: str, *, device: str) -> list[tuple[str, list[str]]]:
    """:func:`tpu_memory_table` for the ``name`` (``"TPU"``, ``"GPU"``) compiler's records."""
    if not records:
        return []
    title = (
        f"{name} memory: peak HBM per {device} (x the baseline's, fails above {PEAK_RATIO}x; x the "
        f"compiler's own form's, jit of the family's math) and generated code, per size, compiled by the "
        f"real {name} compiler"
    )

    number, legend = size_legend(records)

    def cells(recs: list[Any]) -> str:
        out = []
        for r in sorted(recs, key=lambda r: number[(r.family, r.dims)]):
            peak = "peak n/a" if r.peak is None else _mib(r.peak)
            ratios = []
            if not r.baseline and r.ratio is not None:
                ratios.append(f"{r.ratio:.2f}x")
            if getattr(r, "compiler_ratio", None) is not None:
                ratios.append(f"{r.compiler_ratio:.2f}x the compiler's own")
            ratio = f" ({', '.join(ratios)})" if ratios else ""
            dtype = "" if r.dtype == "bfloat16" else f" in {r.dtype}"
            out.append(f"#{number[(r.family, r.dims)]}{dtype}: {peak}{ratio}, code {_mib(r.code)}")
        return "  |  ".join(out)

    return [(title, [*legend, *topology_rows(records, cells, baseline_note="shard_map baseline")])]


def _mib(nbytes: int | None) -> str:
    return "n/a" if nbytes is None else f"{nbytes / (1 << 20):.1f} MiB"


CHECKS = (
    Check(
        "tpu_memory",
        check_tpu_memory,
        concern="performance",
        tables=tpu_memory_table,
        compile_tier="tpu_compile",
    ),
)
