"""The GPU compile tier: what XLA:GPU really compiles for 8 and 16 H100s, judged like the TPU tier.

Compiled by the real GPU compiler (:mod:`conformance.targets.gpu_compiler`: deviceless from an H100's target
config on any host with JAX's CUDA plugin, or on one GPU with a mocked topology), the module is the
one XLA:GPU would run: its latency-hiding scheduler's order, its asynchronous collectives
(``collective-permute-start`` .. ``-done``), its buffer assignment. Three verdicts, each the TPU
tier's rule read off the GPU module:

``gpu_schedule``
    every transfer but one per ring direction has a matmul (a GEMM fusion or cuBLAS call) scheduled
    inside its span (:func:`~conformance.checks.tpu_schedule.check_schedule`). XLA:GPU runs
    collectives on their own streams; a ring whose hops it serializes behind its matmuls fails here
    with the run order printed.
``gpu_memory``
    peak device memory within :data:`~conformance.checks.tpu_memory.PEAK_RATIO` times the family
    baseline's at the same shapes.
``gpu_bytes``
    the forward and backward passes' collectives are the ones the family allows and their bytes
    within the family's bound, in the compiled module (what XLA:GPU added or removed included).

Only what is registered for CUDA is judged (``lowering_targets``: a Pallas TPU kernel is not).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from conformance.checks.base import Check, NotJudged, keeping
from conformance.checks.collectives import ByteRecord, byte_table, compiled_module_bytes
from conformance.checks.target_tables import schedule_table
from conformance.checks.tpu_memory import TpuMemoryRecord, check_memory, memory_table
from conformance.checks.tpu_schedule import TpuScheduleRecord, check_schedule, ring_topologies
from conformance.runner import Case
from conformance.targets import gpu_compiler

#: The ring lengths the tier compiles for, the mesh labels of its cases.
GPU_RINGS = (8, 16, 24)
GPU_MESHES = tuple(f"{n}-x-explicit" for n in GPU_RINGS)


@dataclasses.dataclass(frozen=True)
class GpuScheduleRecord(TpuScheduleRecord):
    """One kernel compiled by XLA:GPU for one GPU topology at one size: transfers hidden."""


@dataclasses.dataclass(frozen=True)
class GpuMemoryRecord(TpuMemoryRecord):
    """One kernel compiled by XLA:GPU for one GPU topology at one size: memory beside the baseline's."""


def gpu_topologies() -> dict[int, tuple[str, ...]]:
    """Ring length -> the GPU topologies it compiles for here (route 1, or the mocked one)."""
    return {n: found for n in GPU_RINGS if (found := gpu_compiler.topologies_for(n))}


def _registered_for_cuda(case: Case) -> None:
    impl = case.implementation
    if "cuda" not in impl.lowering_targets:
        raise NotJudged(
            f"{impl.name} is not registered for CUDA (lowering_targets: {', '.join(impl.lowering_targets)})"
        )


def check_gpu_schedule(case: Case) -> list[GpuScheduleRecord]:
    """Compiled by XLA:GPU for 8 (one NVLink host) or 16 H100s (two), every transfer but one per ring
    direction (and at least one) has a matmul inside its span in the scheduled module. The baseline
    is recorded, not judged; a host without JAX's CUDA plugin skips, naming the install command."""
    _registered_for_cuda(case)
    return check_schedule(
        case, gpu_compiler, gpu_topologies(), check="gpu_schedule", record=GpuScheduleRecord
    )


def check_gpu_memory(case: Case) -> list[GpuMemoryRecord]:
    """Compiled by XLA:GPU for the case's ring of H100s, peak device memory at most
    :data:`~conformance.checks.tpu_memory.PEAK_RATIO` times the family baseline's at the same shapes."""
    _registered_for_cuda(case)
    return check_memory(case, gpu_compiler, gpu_topologies(), check="gpu_memory", record=GpuMemoryRecord)


def check_gpu_bytes(case: Case) -> list[ByteRecord]:
    """Compiled by XLA:GPU for the case's ring of H100s, the forward (and backward) pass uses only the
    collectives the family allows and receives at most the family's bound of bytes per device."""
    _registered_for_cuda(case)
    topologies = ring_topologies(case, gpu_compiler, gpu_topologies(), what="the GPU module")
    impl, spec = case.implementation, case.spec
    passes = ["forward"]
    if impl.differentiable and spec.backward_max_received_bytes is not None:
        passes.append("backward")
    records: list[ByteRecord] = []
    with keeping(records):
        for topology in topologies:
            compiled_module_bytes(case, passes, records, topology=topology, check="gpu_bytes")
    return records


def _bytes_table(records: list[Any]) -> list[tuple[str, list[str]]]:
    return byte_table("GPU: bytes received per device / bound, in the modules XLA:GPU compiled", records)


CHECKS = (
    Check(
        "gpu_schedule",
        check_gpu_schedule,
        concern="performance",
        tables=lambda records: schedule_table(records, "GPU"),
        compile_tier="gpu_compile",
    ),
    Check(
        "gpu_memory",
        check_gpu_memory,
        concern="performance",
        tables=lambda records: memory_table(records, "GPU", device="GPU"),
        compile_tier="gpu_compile",
    ),
    Check("gpu_bytes", check_gpu_bytes, concern="program", tables=_bytes_table, compile_tier="gpu_compile"),
)
