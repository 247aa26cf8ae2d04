"""Benchmarks: every implementation beside its family's baseline, over a ladder of sizes.

Run with ``pytest conformance -m benchmark`` (``tox -e bench``); pytest-benchmark times each case
and ``--benchmark-json=FILE`` writes its figures with the suite's own in ``extra_info``. The
ladder is nccl-tests' ``-b/-e/-f``: ``--bench-sizes=BEGIN:END:FACTOR`` in bytes of one device's
input shard (``4K:256K:4`` by default), and ``--bench-meshes`` picks meshes by label (default:
one Auto mesh of each shape). After the run one table per family gives the median time, the ratio
to the baseline measured in the same run on the same mesh and size, the bytes a device receives
(the spec's lower bound), and algbw and busbw as nccl-tests defines them:

* ``size``: the bytes the collective delivers as a whole (all-gather and collective matmul: the
  gathered operand; matmul + reduce-scatter: one whole partial product, float32 for 16-bit);
* ``algbw = size / time``; ``busbw = algbw * (n - 1) / n`` for a ring of n devices (the rate a
  link must carry for the algorithm to take that time).

On a CPU host these are CPU figures (XLA CPU's collectives are memory copies between simulated
devices, and Pallas kernels run in interpret mode) and the table says so; the same command on a
GPU or TPU host measures the real ones.
"""

from __future__ import annotations

import math

import jax
import pytest

from conformance import bench, claims, compat, registry, runner, specs
from conformance.fixtures.meshes import MeshConfig, parse_mesh
from conformance.runner import Case

pytestmark = pytest.mark.benchmark


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    config = metafunc.config
    labels = [m.strip() for m in config.getoption("bench_meshes").split(",") if m.strip()]
    meshes = [parse_mesh(label) for label in labels]
    sizes = bench.size_ladder(config.getoption("bench_sizes"))
    impls = [
        (f, i.name)
        for f in specs.shard_map_families()
        for i in registry.registered(f, config.getoption("impl"))
    ]
    metafunc.parametrize("family,implementation", impls, ids=[name for _, name in impls])
    metafunc.parametrize("mesh_config", meshes, ids=[m.label for m in meshes])
    metafunc.parametrize("shard_bytes", sizes, ids=[f"{s}B" for s in sizes])


def test_benchmark(
    benchmark, family: str, implementation: str, mesh_config: MeshConfig, shard_bytes: int, request
) -> None:
    platform = bench.preferred_platform()
    dims = claims.adapt(
        family,
        implementation,
        platform=platform,
        mesh=mesh_config,
        dtype="float32",
        dims=bench.dims_for(family, shard_bytes),
    )  # fmt: skip  (what the kernel claims)
    record = registry.get(family, implementation)
    dma_mode = "on_wait" if platform == "cpu" and record.pallas else None
    case = Case.make(
        family, implementation, mesh_config, dims, "float32", platform=platform, dma_mode=dma_mode
    )
    if record.pallas and platform == "cpu":
        limit = compat.interpret_mode_limit(devices=mesh_config.num_devices,
                                            bytes_per_device=runner.largest_shard_bytes(case))  # fmt: skip
        if limit:
            pytest.skip(f"{implementation}: {limit}")
    fn = runner.compiled(case)
    args = runner.place(case, runner.make_inputs(case))
    jax.block_until_ready(fn(*args))  # compiled and run once before timing
    rounds = request.config.getoption("bench_rounds")
    benchmark.pedantic(lambda: jax.block_until_ready(fn(*args)), rounds=rounds, iterations=1, warmup_rounds=1)
    n = mesh_config.axis_size
    row = bench.BenchRecord(
        family=family,
        impl=implementation,
        baseline=record.baseline,
        mesh=mesh_config.label,
        ring=n,
        shard_bytes=shard_bytes,
        dims=", ".join(f"{k}={v}" for k, v in dims.items()),
        median_s=benchmark.stats.stats.median,
        size_bytes=bench.size_bytes(case),
        received_bytes=case.spec.min_received_bytes(case.dims_map, n, 4),
        platform=platform,
    )
    bench.RECORDS.append(row)
    benchmark.extra_info.update(
        family=family, mesh=row.mesh, platform=platform, dims=row.dims, size_bytes=row.size_bytes,
        received_bytes_per_device=row.received_bytes, algbw_bytes_per_s=row.algbw,
        busbw_bytes_per_s=row.busbw,
    )  # fmt: skip
    assert math.isfinite(row.median_s) and row.median_s > 0, row
