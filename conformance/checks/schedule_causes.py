"""Why a compiled schedule leaves a kernel's transfers exposed, and what would hide them, each measured
on the compiler that judged: the rule a schedule is held to (:func:`passes_rule`), the compiler
transformations known to serialize a ring (:data:`SERIALIZERS`, each turned off in turn), and pacing
(:func:`pacing_measured`: the family's paced built-in ring compiled with and without its pacing at
the same topology and size)."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

from conformance import compat, dtypes, hlo, registry, runner
from conformance import session as session_lib
from conformance.checks.on_topology import compiled_on_topology, compiler_of, schedule_of
from conformance.runner import Case
from conformance.targets import tpu_compiler


@dataclasses.dataclass(frozen=True)
class Serializer:
    """A compiler transformation known to serialize a ring's transfers behind its matmuls: what it
    does, the options that turn it off, and the change to a kernel that avoids it."""

    what: str
    options: tuple[tuple[str, object], ...]
    avoid: str


#: What the failing schedule check turns off, one at a time, to name why transfers are exposed (each
#: where the compiler knows its option). XLA:GPU's dot merger is the one found on the GPU tier's
#: kernels (``broken_agmm_steps_share_the_weight``: 0/14 hidden, 14/14 without it, jaxlib 0.10.2);
#: its collective-permute combiner and a latency-hiding scheduler left off by the user's flags are
#: the others XLA:GPU has flags for. XLA:TPU's async collective fusion and collective-permute
#: combiner are the TPU's (neither hides the fori_loop matmul + reduce-scatter ring, libtpu 0.0.42:
#: that one is its loop's own dataflow, and the verdict says none did).
SERIALIZERS: dict[str, tuple[Serializer, ...]] = {
    "GPU": (
        Serializer(
            "XLA:GPU's dot merger merged step matmuls that share an operand into fewer dots, each after "
            "several transfers",
            (("xla_gpu_dot_merger_threshold_mb", 0),),
            "give each step's matmul its own copy of the shared operand (an optimization_barrier per step, "
            "as conformance.kernels._ring.unmerged does), or run with that flag",
        ),
        Serializer(
            "XLA:GPU's collective-permute combiner merged the ring's transfers into fewer, larger ones",
            (("xla_gpu_collective_permute_combine_threshold_bytes", 0),),
            "make each step's transfer depend on the step before it (the built-ins pace the ring with an "
            "optimization_barrier), or run with that flag",
        ),
        Serializer(
            "XLA:GPU's latency-hiding scheduler is off under these flags",
            (("xla_gpu_enable_latency_hiding_scheduler", True),),
            "run with XLA_FLAGS=--xla_gpu_enable_latency_hiding_scheduler=true",
        ),
    ),
    "TPU": (
        Serializer(
            "XLA:TPU's async collective fusion fused a transfer's result into the computation after it",
            (("xla_tpu_enable_async_collective_fusion", False),),
            "keep what consumes a received block apart from the next step's matmul (an "
            "optimization_barrier), or run with that flag",
        ),
        Serializer(
            "XLA:TPU's collective-permute combiner merged the ring's transfers",
            (("xla_tpu_enable_collective_permute_combiner", False),),
            "make each step's transfer depend on the step before it, or run with that flag",
        ),
    ),
}


def passes_rule(scheduled: hlo.Schedule) -> bool:
    """Every transfer but one per ring direction has a matmul inside it, and at least one does."""
    return bool(scheduled.hidden) and scheduled.total - scheduled.hidden <= scheduled.rings


def why_exposed(case: Case, topology: str, *, compiler: Any) -> list[str]:
    """The verdict's lines on the cause: the first of :data:`SERIALIZERS` whose removal lets the
    case's transfers hide (recompiled with it off), or that none of them does."""
    tried = []
    for serializer in SERIALIZERS.get(compiler.NAME, ()):
        flags = ", ".join(f"{k}={v}" for k, v in serializer.options)
        try:
            _, scheduled = schedule_of(
                compiled_on_topology(case, topology, options=serializer.options), topology
            )
        except (tpu_compiler.CompilerRefusal, compat.HostLimit, hlo.HloParseError):
            continue  # a compiler without the option, or a module it cannot read: not this one
        tried.append(flags)
        if passes_rule(scheduled):
            return [
                f"cause          : {serializer.what} (with {flags}: {scheduled.fraction} hidden, run order "
                f"{scheduled.order_text()[:120]})",
                f"avoid          : {serializer.avoid}",
            ]
    if not tried:
        return []
    return [
        "cause          : none of the known serializing transformations, each turned off "
        f"({'; '.join(tried)}), lets its transfers hide: the kernel's own dataflow or the scheduler's "
        "cost model orders them so"
    ]


def how_to_hide(case: Case, topology: str, scheduled: hlo.Schedule) -> list[str]:
    """The change that would hide this kernel's transfers on this compiler: pacing, where the family's
    paced built-in ring with the same number of ring directions, compiled here at this size with
    and without its pacing, shows pacing is the lever; the family's general advice otherwise."""
    spec = case.spec
    measured = pacing_measured(case, topology, rings=scheduled.rings)
    if measured is None:
        return [f"how            : {spec.overlap}"]
    name, paced, unpaced = measured
    figures = (
        f"the built-in {name} hides {paced.fraction} paced ({paced.order_text()[:60]}) and "
        f"{unpaced.fraction} with its pacing taken out ({unpaced.order_text()[:60]})"
    )
    if passes_rule(paced) and not passes_rule(unpaced):
        return [
            f"how            : pace the ring: {spec.pacing}",
            f"measured       : pacing is the lever here ({topology}, this size): {figures}",
        ]
    return [
        f"how            : {spec.overlap}",
        f"measured       : pacing is not the lever here ({topology}, this size): {figures}",
    ]


def pacing_measured(
    case: Case, topology: str, *, rings: int
) -> tuple[str, hlo.Schedule, hlo.Schedule] | None:
    """The family's first registered ring with an ``unpaced`` twin and ``rings`` ring directions, and
    the schedules of it and of its twin compiled for ``topology`` at ``case``'s size; ``None`` where
    the family has none, or none compiles."""
    for impl in registry.registered(case.family):
        if impl.unpaced is None or impl.name == case.impl:
            continue
        reference = Case.make(case.family, impl.name, case.mesh, dict(case.dims), case.dtype)
        try:
            _, paced = schedule_of(compiled_on_topology(reference, topology), topology)
            if paced.rings != rings:
                continue
            unpaced = _compiled_unpaced(reference, topology, session_lib.current().settings.compiler_options)
            return impl.name, paced, schedule_of(unpaced, topology)[1]
        except (tpu_compiler.CompilerRefusal, compat.HostLimit, hlo.HloParseError):
            continue
    return None


@functools.lru_cache(maxsize=16)
def _compiled_unpaced(case: Case, topology: str, run_options: tuple) -> Any:
    # run_options (the run's --compiler-option pairs, which compile_on reads) only key the cache
    compiler = compiler_of(topology)
    mesh = compiler.mesh_on(case.mesh, topology)
    keywords = {"mesh": mesh, "axis_name": case.mesh.axis_name, **dtypes.kernel_keywords(case.dtype)}
    fn = functools.partial(case.implementation.unpaced, **keywords)
    return compiler.compile_on(fn, runner.abstract_args(case, mesh=mesh))
