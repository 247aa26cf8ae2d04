"""Benchmark helpers: the size ladder, the records of a run and their tables (see ``test_benchmarks``)."""

from __future__ import annotations

import dataclasses
from collections import defaultdict

from conformance import registry, runner
from conformance.runner import Case
from conformance.specs.base import BATCH_DIM

#: Where a run log keeps the benchmark rows of its run
#: (:meth:`conformance.reports.results.RunLog.add_records`).
SOURCE = "benchmark"


@dataclasses.dataclass(frozen=True)
class BenchRecord:
    family: str
    impl: str
    baseline: bool
    mesh: str
    ring: int
    shard_bytes: int
    dims: str
    median_s: float
    size_bytes: int
    received_bytes: int
    platform: str
    dtype: str = "float32"
    #: A transfer between two sets of devices (one link per pair), not a collective over a ring.
    point_to_point: bool = False

    @property
    def algbw(self) -> float:
        return self.size_bytes / self.median_s

    @property
    def busbw(self) -> float:
        """nccl-tests: ``algbw * (n - 1) / n`` for a ring of n; ``algbw`` for sendrecv (one link per pair)."""
        if self.point_to_point:
            return self.algbw
        return self.algbw * (self.ring - 1) / self.ring


def parse_size(text: str) -> int:
    """``64K``, ``1M``, ``4096`` (bytes; K and M are powers of 2)."""
    text = text.strip().upper().removesuffix("B").removesuffix("I")
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    number = text[:-1] if scale > 1 else text
    if not number.isdigit() or int(number) <= 0:
        raise ValueError(f"--bench-sizes: {text!r} is not a size in bytes (e.g. 4096, 64K, 1M)")
    return int(number) * scale


def size_ladder(spec: str) -> list[int]:
    """``BEGIN:END:FACTOR`` (or one size) as nccl-tests' -b/-e/-f ladder: BEGIN, BEGIN*FACTOR, ... <= END."""
    parts = spec.split(":")
    if len(parts) == 1:
        return [parse_size(parts[0])]
    if len(parts) != 3 or not parts[2].strip().isdigit() or int(parts[2]) < 2:
        raise ValueError(f"--bench-sizes={spec!r}: expected BEGIN:END:FACTOR with an integer FACTOR >= 2")
    begin, end, factor = parse_size(parts[0]), parse_size(parts[1]), int(parts[2])
    if end < begin:
        raise ValueError(f"--bench-sizes={spec!r}: END is below BEGIN")
    sizes = [begin]
    while sizes[-1] * factor <= end:
        sizes.append(sizes[-1] * factor)
    return sizes


def dims_for(family: str, impl: str, shard_bytes: int, itemsize: int = 4) -> dict[str, int]:
    """The family's dims for a device's input shard of about ``shard_bytes``: its first dim (the rows
    of the shard) filling what 128 of each other dim leaves (lanes 128 wide, a matmul's other dims
    128 too; a batched kernel's batch 1), or what the spec's ``bench_dims`` makes of those rows."""
    rows = max(1, shard_bytes // (128 * itemsize))
    spec = registry.spec_of(family, impl)
    if spec.bench_dims is not None:
        return dict(spec.bench_dims(rows))
    dims = [name for name in spec.dims if name != BATCH_DIM]
    return {
        **({BATCH_DIM: 1} if BATCH_DIM in spec.dims else {}),
        **{n: rows if i == 0 else 128 for i, n in enumerate(dims)},
    }


def size_bytes(case: Case) -> int:
    """What the collective delivers as a whole (module docstring)."""
    spec, n, d = case.spec, case.mesh.axis_size, case.dims_map
    itemsize = runner.np_dtype(case.dtype).itemsize
    # the lower bound is what n-1 of n devices' pieces weigh: scale it to all n
    return spec.min_received_bytes(d, n, itemsize) * n // max(n - 1, 1)


def preferred_platform() -> str:
    """The platform benchmarks run on: the first of TPU, GPU, CPU this host has."""
    from conformance.fixtures import devices as devices_lib

    return next(p for p in ("tpu", "gpu", "cpu") if devices_lib.has_platform(p))


def _rate(bytes_per_s: float) -> str:
    return f"{bytes_per_s / 1e9:10.4g}"


def tables(records: list[BenchRecord]) -> list[tuple[str, list[str]]]:
    """One (title, lines) per family: time, ratio to the baseline (same mesh and size), bytes, bandwidths."""
    out = []
    by_family: dict[str, list[BenchRecord]] = defaultdict(list)
    for r in records:
        by_family[r.family].append(r)
    for family, recs in sorted(by_family.items()):
        base = {(r.mesh, r.dtype, r.shard_bytes): r.median_s for r in recs if r.baseline}
        platforms = sorted({r.platform for r in recs})
        what = "copies between simulated devices" if recs[0].point_to_point else "Pallas in interpret mode"
        note = f"  (CPU figures: simulated devices, {what})" if platforms == ["cpu"] else ""
        title = f"benchmark {family} on {', '.join(platforms)}{note}"
        width = max(len(r.impl) for r in recs)
        lines = [
            f"{'implementation':<{width}}  {'mesh':<16} {'dtype':<9} {'shard':>8} {'time us':>10} "
            f"{'vs base':>8} {'recv B/dev':>11} {'size B':>10} {'algbw GB/s':>10} "
            f"{'busbw GB/s':>10}"
        ]
        for r in sorted(recs, key=lambda r: (r.mesh, r.dtype, r.shard_bytes, not r.baseline, r.impl)):
            ratio = base.get((r.mesh, r.dtype, r.shard_bytes))
            vs = f"{r.median_s / ratio:8.2f}" if ratio else f"{'n/a':>8}"
            head = (
                f"{r.impl:<{width}}  {r.mesh:<16} {r.dtype:<9} {r.shard_bytes:>8} "
                f"{r.median_s * 1e6:>10.1f} {vs} "
            )
            lines.append(
                head + f"{r.received_bytes:>11} {r.size_bytes:>10} {_rate(r.algbw)} {_rate(r.busbw)}"
            )
        out.append((title, lines))
    return out
