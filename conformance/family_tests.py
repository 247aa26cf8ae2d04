"""The checks every family gets, as pytest tests.

A family's test module imports these and sets ``FAMILY``; the plugin then
parametrizes ``implementation``, ``platform`` and ``mesh_config``. Each test is
a thin call into :mod:`conformance.checks`, which holds the logic and the
failure messages.

Value checks draw whole cases with hypothesis (mesh, dims, dtype, seed); the
fixed-shape checks run each implementation once per mesh at each of the family's two
fixed shapes (the canonical one, with odd rows per shard, and its even twin) and
share that one compile and run. A defect that needs an odd shape then fails the
odd half only, and the run's summary says so (see :mod:`conformance.report`).
"""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conformance import (
    checks,
    claims,
    compat,
    distributed,
    isolation,
    registry,
    results,
    runner,
    specs,
    strategies,
)
from conformance.fixtures.meshes import MESH_CONFIGS, MeshConfig, parse_mesh
from conformance.runner import Case

#: TPU layout: the tiling depends on shard shapes, not on the mesh; one ring of 4 shows it.
TPU_LAYOUT_MESH = parse_mesh("4-x-explicit")
#: Hypothesis examples per mesh for the value and gradient checks, which are parametrized over every
#: standard mesh (a defect that needs a ring longer than 4 is then found by construction; hypothesis
#: draws dims, dtype, seed and DMA mode): a fifth of the profile's (2 in CI, 40 under
#: conformance-thorough). Each new shape is a compile.
EXAMPLES_PER_MESH = max(1, strategies.PROFILE.max_examples // 5)
#: The settings of the suite's hypothesis tests: the suite's profile, fewer examples per mesh.
PER_MESH = settings(parent=strategies.PROFILE, max_examples=EXAMPLES_PER_MESH)


def meshes(configs: tuple[MeshConfig, ...]):
    """Decorator: parametrize ``mesh_config`` over ``configs`` instead of every standard mesh."""

    def mark(fn):
        fn.mesh_configs = configs
        return fn

    return mark


class CheckFailed(pytest.fail.Exception):
    """pytest's failure outcome (message only, no traceback), carrying the check's
    :class:`~conformance.checks.ConformanceFailure` for the run's summary of causes."""

    def __init__(self, failure: checks.ConformanceFailure, message: str | None = None) -> None:
        super().__init__(str(failure) if message is None else message, pytrace=False)
        self.failure = failure


def run(check, case: Case) -> None:
    """Run one check; report a failure as its message alone (no traceback into the suite).

    What this host cannot do (:class:`compat.HostLimit`) is a skip naming why, never a failure.
    """
    name = check.__name__.removeprefix("check_")
    results.note_case(case, name)
    multi = distributed.is_multi_process()
    # In a job, interpret mode cannot run a kernel across processes: rank 0's standalone worker
    # runs it on a process-local mesh, and the other ranks take that verdict below.
    elsewhere = multi and isolation.applies(case) and distributed.rank_and_size()[0] != 0
    caught, skipped = None, None
    try:
        if not elsewhere:
            isolation.call(check, case)  # a Pallas kernel on CPU: in the worker process
    except checks.ConformanceFailure as failure:
        caught = failure
    except compat.HostLimit as limit:
        skipped = f"{case.impl}: {limit}"
    except checks.NotJudged as why:
        skipped = f"{case.impl}: not judged: {why}"
    if multi:  # every rank's verdict, before pytest or hypothesis sees this one's
        caught, skipped = _agreed_verdict(case, name, caught, skipped)
    if caught is not None:
        raise CheckFailed(caught)  # outside the except: no chained duplicate
    if skipped is not None:
        pytest.skip(skipped)


def _agreed_verdict(case: Case, name: str, caught, skipped):
    """Agree across the ranks of a job: a failure on any rank fails the check on every rank, with
    every failing rank's own message (identical ones once, with their ranks); otherwise a skip on
    any rank skips it everywhere."""
    mine = {"failed": None, "skipped": skipped}
    if caught is not None:
        mine["failed"] = {"message": str(caught), "what": caught.what, "check": caught.check or name}
    verdicts = [json.loads(v) for v in distributed.exchange("verdict", json.dumps(mine))]
    size = len(verdicts)
    failed = [(r, v["failed"]) for r, v in enumerate(verdicts) if v["failed"]]
    if failed:
        _, first = failed[0]
        messages = distributed.by_message([(r, v["message"]) for r, v in failed], size)
        ranks = ", ".join(str(r) for r, _ in failed)
        caught = checks.ConformanceFailure("\n".join([*messages, f"  failed on ranks: {ranks} of {size}"]))
        caught.case, caught.check, caught.what = case, first["check"], first["what"]
        return caught, None
    skips = [v["skipped"] for v in verdicts if v["skipped"]]
    return None, (skipped or (skips[0] if skips else None))


def only(*predicates: str):
    """Decorator: parametrize ``implementation`` over those whose record has every predicate true.

    ``"pallas"``, ``"differentiable"``, or ``"not_baseline"``.
    """

    def mark(fn):
        fn.implementation_filter = predicates
        return fn

    return mark


pallas_only = only("pallas")


def for_families_with(field: str):
    """Decorator: run only for families whose spec has ``field`` set (others deselect the test)."""

    def mark(fn):
        fn.family_filter = field
        return fn

    return mark


def dtypes_from(field: str):
    """Decorator: parametrize ``dtype`` over the spec's ``field`` (default: ``dtypes``)."""

    def mark(fn):
        fn.dtypes_field = field
        return fn

    return mark


def canonical_case(
    family: str,
    impl: str,
    platform: str,
    mesh: MeshConfig,
    dtype: str = "float32",
    dma_mode: str | None = None,
    shape: str = "odd",
) -> Case:
    """The family's fixed dims (``shape``: the canonical ``"odd"`` one or its ``"even"`` twin).

    A Pallas kernel on CPU runs in the adversarial "on_wait" DMA mode; on TPU chips at the
    family's TPU-native dims, which both fixed shapes then name (the even one is skipped).
    """
    if dma_mode is None and platform == "cpu" and registry.get(family, impl).pallas:
        dma_mode = "on_wait"
    dims = strategies.fixed_dims(family, impl, platform, mesh, dtype, shape)
    if dims is None:
        pytest.skip(f"{impl}: on {platform} both fixed shapes come to the same dims; [odd] runs them")
    return Case.make(family, impl, mesh, dims, dtype, platform=platform, dma_mode=dma_mode)


def accuracy_case(family: str, impl: str, platform: str, mesh: MeshConfig, dtype: str) -> Case:
    case = canonical_case(family, impl, platform, mesh, dtype)
    dims = claims.adapt(family, impl, platform=platform, mesh=mesh, dtype=dtype,
                        dims=specs.get(family).accuracy_dims or {})  # fmt: skip
    return Case.make(family, impl, mesh, dims, dtype, platform=platform, dma_mode=case.dma_mode)


@meshes(MESH_CONFIGS)
@PER_MESH
@given(data=st.data())
def test_values(
    family: str, implementation: str, platform: str, mesh_config: MeshConfig, data: st.DataObject
) -> None:
    """Values and dtype on every shard against numpy float64, on every mesh; drawn dims, dtypes, seeds."""
    run(checks.check_values, strategies.draw_case(data, family, implementation, platform, mesh=mesh_config))


@meshes(MESH_CONFIGS)
def test_output_sharding(
    family: str, implementation: str, platform: str, mesh_config: MeshConfig, shape: str
) -> None:
    run(
        checks.check_output_sharding,
        canonical_case(family, implementation, platform, mesh_config, shape=shape),
    )


@meshes(MESH_CONFIGS)
def test_dtype(
    family: str, implementation: str, platform: str, mesh_config: MeshConfig, dtype: str, shape: str
) -> None:
    """Every dtype of the spec on every mesh at both fixed shapes: the result and each shard keep it."""
    run(checks.check_dtype, canonical_case(family, implementation, platform, mesh_config, dtype, shape=shape))


@meshes(MESH_CONFIGS)
def test_determinism(
    family: str, implementation: str, platform: str, mesh_config: MeshConfig, shape: str
) -> None:
    run(checks.check_determinism, canonical_case(family, implementation, platform, mesh_config, shape=shape))


#: The eager check's meshes: a ring of 2 on an Auto mesh and a ring of 4 on an Explicit 2-D one (in a
#: job each spans the processes). What it catches is the kernel's Python on concrete arrays, which no
#: longer ring shows more of; outside jit a shard_map body runs op by op (15 s for a bidirectional ring
#: of 8 here), so not every mesh.
EAGER_MESHES = (parse_mesh("2-x-auto"), parse_mesh("4x2-x-explicit"))


@meshes(EAGER_MESHES)
def test_eager(family: str, implementation: str, platform: str, mesh_config: MeshConfig) -> None:
    """Called outside ``jax.jit``: the values it gives under jit (odd fixed shape), on every device."""
    run(checks.check_eager, canonical_case(family, implementation, platform, mesh_config))


@meshes(MESH_CONFIGS)
def test_collectives(
    family: str, implementation: str, platform: str, mesh_config: MeshConfig, shape: str
) -> None:
    run(checks.check_collectives, canonical_case(family, implementation, platform, mesh_config, shape=shape))


@for_families_with("overlap")
@meshes(MESH_CONFIGS)
def test_overlap(
    family: str, implementation: str, platform: str, mesh_config: MeshConfig, shape: str
) -> None:
    """Each transfer can hide behind a matmul independent of it, in the dataflow of the compiled
    module and of the modules lowered for each target (families whose point is overlap)."""
    if registry.get(family, implementation).pallas:
        pytest.skip(f"{implementation}: not judged: {checks.PALLAS_OVERLAP}")
    run(checks.check_overlap, canonical_case(family, implementation, platform, mesh_config, shape=shape))


@meshes(MESH_CONFIGS)
def test_cross_lowering(
    family: str, implementation: str, platform: str, mesh_config: MeshConfig, shape: str
) -> None:
    run(
        checks.check_cross_lowering,
        canonical_case(family, implementation, platform, mesh_config, shape=shape),
    )


@meshes(MESH_CONFIGS)
def test_bad_inputs(family: str, implementation: str, platform: str, mesh_config: MeshConfig) -> None:
    run(checks.check_bad_inputs, canonical_case(family, implementation, platform, mesh_config))


@pytest.mark.cpu
@pallas_only
@meshes(MESH_CONFIGS)
def test_races(family: str, implementation: str, mesh_config: MeshConfig, dma_mode: str, shape: str) -> None:
    """Pallas kernels under TPU interpret mode with race detection, in both DMA modes."""
    case = canonical_case(family, implementation, "cpu", mesh_config, dma_mode=dma_mode, shape=shape)
    run(checks.check_races, case)


@pytest.mark.cpu
@pallas_only
@meshes(MESH_CONFIGS)
def test_barrier_protocol(family: str, implementation: str, mesh_config: MeshConfig) -> None:
    """Pallas kernels: no remote DMA before the barrier (static; interpret mode cannot see it)."""
    run(checks.check_barrier_protocol, canonical_case(family, implementation, "cpu", mesh_config))


@pytest.mark.cpu
@pallas_only
def test_tpu_layout(family: str, implementation: str, dtype: str) -> None:
    """Lowered for TPU chips at every tile-edge shape: refused with the constraint named, or
    lowered to DMA windows and buffers a TPU compiler accepts; the TPU-native shape accepted."""
    failures: list[checks.ConformanceFailure] = []
    limited = []
    shapes, not_claimed = [], []
    for dims in strategies.tpu_layout_dims(family):
        why = claims.reason(
            family, implementation, platform="tpu", mesh=TPU_LAYOUT_MESH, dims=dims, dtype=dtype
        )
        (shapes if why is None else not_claimed).append(dims if why is None else why)
    if not shapes:
        raise claims.NotClaimed(
            implementation, f"none of the {len(not_claimed)} TPU layout shapes: {not_claimed[0]}"
        )
    for dims in shapes:
        try:
            checks.check_tpu_layout(Case.make(family, implementation, TPU_LAYOUT_MESH, dims, dtype))
        except checks.ConformanceFailure as failure:
            failures.append(failure)
        except compat.HostLimit as limit:
            limited.append(str(limit))
    if failures:
        more = [f"... and {len(failures) - 3} more shapes"] if len(failures) > 3 else []
        text = "\n".join([f"{len(failures)} shape(s) fail:", *map(str, failures[:3]), *more])
        raise CheckFailed(failures[0], text)
    if limited:  # the shapes that were tried passed; the rest this host could not try
        pytest.skip(f"{implementation}: {len(limited)} of {len(shapes)} shapes: {limited[0]}")


@pytest.mark.cpu
@pallas_only
@meshes(MESH_CONFIGS)
def test_tpu_native_values(family: str, implementation: str, mesh_config: MeshConfig, dtype: str) -> None:
    """At the TPU-native dims (the DMA windows a chip runs), exact under interpret mode's on_wait DMAs."""
    dims = specs.get(family).tpu_native_dims or specs.get(family).canonical_dims
    dims = claims.adapt(family, implementation, platform="cpu", mesh=mesh_config, dims=dims, dtype=dtype)
    case = Case.make(family, implementation, mesh_config, dims, dtype, dma_mode="on_wait")
    limit = compat.interpret_mode_limit(
        devices=mesh_config.num_devices, bytes_per_device=runner.largest_shard_bytes(case)
    )
    if limit:
        pytest.skip(f"{implementation}: {limit}")
    run(checks.check_values, case)


@only("differentiable")
@meshes(MESH_CONFIGS)
@PER_MESH
@given(data=st.data())
def test_gradients(
    family: str, implementation: str, platform: str, mesh_config: MeshConfig, data: st.DataObject
) -> None:
    """``jax.vjp`` with random cotangents against numpy float64 gradients, on every mesh."""
    dtypes = specs.get(family).gradient_dtypes
    case = strategies.draw_case(data, family, implementation, platform, mesh=mesh_config, dtypes=dtypes)
    run(checks.check_gradients, case)


@only("differentiable")
@meshes(MESH_CONFIGS)
def test_backward_collectives(
    family: str, implementation: str, platform: str, mesh_config: MeshConfig
) -> None:
    """The backward pass uses only the collectives its math needs: compiled here and lowered for targets."""
    run(checks.check_backward_collectives, canonical_case(family, implementation, platform, mesh_config))


@only("not_baseline")
@meshes(MESH_CONFIGS)
@dtypes_from("accuracy_dtypes")
def test_accuracy(
    family: str, implementation: str, platform: str, mesh_config: MeshConfig, dtype: str
) -> None:
    """rms error against float64, side by side with the baseline's on the same inputs."""
    run(checks.check_accuracy, accuracy_case(family, implementation, platform, mesh_config, dtype))


@meshes(MESH_CONFIGS)
@dtypes_from("sixteen_bit_dtypes")
def test_lowered_bytes(
    family: str, implementation: str, platform: str, mesh_config: MeshConfig, dtype: str
) -> None:
    """bfloat16/float16 bytes per device, forward and backward, in the modules lowered for targets."""
    run(checks.check_lowered_bytes, canonical_case(family, implementation, platform, mesh_config, dtype))


@only("differentiable", "not_baseline")
@meshes(MESH_CONFIGS)
@dtypes_from("accuracy_dtypes")
def test_backward_accuracy(
    family: str, implementation: str, platform: str, mesh_config: MeshConfig, dtype: str
) -> None:
    """Each gradient's rms error against float64, side by side with the baseline's backward
    on the same inputs and cotangent."""
    run(checks.check_backward_accuracy, accuracy_case(family, implementation, platform, mesh_config, dtype))


__all__ = [name for name in dir() if name.startswith("test_")]
