"""Benchmarks: every implementation beside its family's baseline, over a ladder of sizes.

Run with ``pytest conformance -m benchmark`` (``tox -e bench``); pytest-benchmark times each case
and ``--benchmark-json=FILE`` writes its figures with the suite's own in ``extra_info``. The
ladder is nccl-tests' ``-b/-e/-f``: ``--bench-sizes=BEGIN:END:FACTOR`` in bytes of one device's
input shard (``4K:256K:4`` by default), and ``--bench-meshes`` picks meshes by label (default:
one Auto mesh of each shape). ``--impl`` picks the implementations; each family's baselines are timed
beside them whatever it says. After the run one table per family gives the median time, the ratio
to the baseline measured in the same run on the same mesh and size, the bytes a device receives
(the spec's lower bound), and algbw and busbw as nccl-tests defines them:

* ``size``: the bytes the collective delivers as a whole (all-gather and collective matmul: the
  gathered operand; matmul + reduce-scatter: one whole partial product, float32 for 16-bit);
* ``algbw = size / time``; ``busbw = algbw * (n - 1) / n`` for a ring of n devices (the rate a
  link must carry for the algorithm to take that time).

On a CPU host these are CPU figures (XLA CPU's collectives are memory copies between simulated
devices, and Pallas kernels run in interpret mode) and the table says so; the same command on a
GPU or TPU host measures the real ones.

The ``send_recv`` family is timed per route (``4-disjoint``: four pairs of distinct devices, across
processes in a job; ``4-permuted``: the same devices in reverse order) and dtype, one shard of
``shard`` bytes per device pair, nccl-tests' ``sendrecv`` figures: ``size`` is the bytes one pair
moves, ``busbw = algbw``.
"""

from __future__ import annotations

import math

import jax
import pytest

from conformance import claims, compat, plugin, registry, runner, specs, transfers
from conformance.fixtures.meshes import MeshConfig, parse_mesh
from conformance.reports import bench
from conformance.runner import Case

pytestmark = pytest.mark.benchmark


def _with_baselines(family: str, pattern: str | None) -> list[registry.Implementation]:
    """The implementations ``--impl`` selects, and beside them the family's baselines, which it may
    leave out: a kernel's time is read against its baseline's on the same mesh and size."""
    selected = registry.registered(family, pattern)
    if not selected:
        return []
    names = {i.name for i in selected}
    return [i for i in registry.registered(family) if i.name in names or i.baseline]


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    config = metafunc.config
    if metafunc.function is test_benchmark_send_recv:
        sizes = bench.size_ladder(config.getoption("bench_sizes"))
        impls = [i.name for i in _with_baselines("send_recv", config.getoption("impl"))]
        metafunc.parametrize("implementation", impls)
        metafunc.parametrize("route", SEND_RECV_ROUTES, ids=[r.label for r in SEND_RECV_ROUTES])
        metafunc.parametrize("dtype", SEND_RECV_DTYPES)
        metafunc.parametrize("shard_bytes", sizes, ids=[f"{s}B" for s in sizes])
        return
    labels = [m.strip() for m in config.getoption("bench_meshes").split(",") if m.strip()]
    meshes = [parse_mesh(label) for label in labels]
    sizes = bench.size_ladder(config.getoption("bench_sizes"))
    impls = [
        (f, i.name) for f in specs.shard_map_families() for i in _with_baselines(f, config.getoption("impl"))
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
        dims=bench.dims_for(family, implementation, shard_bytes),
    )
    record = registry.get(family, implementation)
    dma_mode = "on_wait" if platform == "cpu" and record.pallas else None
    case = Case.make(
        family, implementation, mesh_config, dims, "float32", platform=platform, dma_mode=dma_mode
    )
    if record.pallas and platform == "cpu":
        limit = compat.interpret_mode_limit(
            devices=mesh_config.num_devices, bytes_per_device=runner.largest_shard_bytes(case)
        )
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
    plugin.run_log(request.config).add_records(bench.SOURCE, [row])
    benchmark.extra_info.update(
        family=family,
        mesh=row.mesh,
        platform=platform,
        dims=row.dims,
        size_bytes=row.size_bytes,
        received_bytes_per_device=row.received_bytes,
        algbw_bytes_per_s=row.algbw,
        busbw_bytes_per_s=row.busbw,
    )
    assert math.isfinite(row.median_s) and row.median_s > 0, row


#: send_recv: where the shards go (see :mod:`conformance.transfers`) and in which dtypes.
SEND_RECV_ROUTES = tuple(r for r in transfers.ROUTES if r.label in ("4-disjoint", "4-permuted"))
SEND_RECV_DTYPES = ("float32", "bfloat16")


def test_benchmark_send_recv(
    benchmark, implementation: str, route: transfers.Route, dtype: str, shard_bytes: int, request
) -> None:
    platform = bench.preferred_platform()
    record = registry.get("send_recv", implementation)
    why = record.claims(
        platform=platform, dtype=dtype, dims={}, mesh_shape={"x": route.size}, axis_size=route.size
    )
    if why is not None:
        raise claims.NotClaimed(implementation, why)
    missing = record.missing_requirement()
    if missing is not None:
        pytest.skip(f"{implementation}: {missing}")
    devices = jax.devices(platform)
    if len(devices) < route.num_devices:
        pytest.skip(
            f"{implementation}: route {route.label} needs {route.num_devices} devices, found {len(devices)}"
        )
    itemsize = transfers.np_dtype(dtype).itemsize
    layout = transfers.Layout("bench", (route.size * (shard_bytes // itemsize),), transfers.P("x"))
    t = transfers.Transfer(implementation, platform, route, layout, dtype, 0, "").prepare(tuple(devices))
    jax.block_until_ready(record.fn(t.x, dst=t.dst))  # compiled, connected and run once before timing
    rounds = request.config.getoption("bench_rounds")
    benchmark.pedantic(
        lambda: jax.block_until_ready(record.fn(t.x, dst=t.dst)), rounds=rounds, iterations=1, warmup_rounds=1
    )
    row = bench.BenchRecord(
        family="send_recv",
        impl=implementation,
        baseline=record.baseline,
        mesh=route.label,
        ring=route.size,
        shard_bytes=shard_bytes,
        dims=f"{route.size} pairs",
        median_s=benchmark.stats.stats.median,
        size_bytes=shard_bytes,
        received_bytes=shard_bytes,
        platform=platform,
        dtype=dtype,
        point_to_point=True,
    )
    plugin.run_log(request.config).add_records(bench.SOURCE, [row])
    benchmark.extra_info.update(
        family="send_recv",
        mesh=row.mesh,
        platform=platform,
        dtype=dtype,
        size_bytes=row.size_bytes,
        received_bytes_per_device=row.received_bytes,
        algbw_bytes_per_s=row.algbw,
        busbw_bytes_per_s=row.busbw,
    )
    assert math.isfinite(row.median_s) and row.median_s > 0, row
