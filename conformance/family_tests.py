"""The checks every family gets, as pytest tests.

A family's test module imports these and sets ``FAMILY``; the plugin then parametrizes
``implementation``, ``platform``, ``mesh_config``, ``shape``, ``dtype`` and ``dma_mode`` as each
test's :class:`~conformance.checks.base.Axes` say. Each check declares its axes where it is
defined (:mod:`conformance.checks`); the test ``test_<check>`` is made here from them, a thin call
into :func:`conformance.run.run_check`. The compile tiers' tests are written out, each one verdict
gathered over several cases compiled for TPU (layout at the tile-edge shapes; schedule, memory and
pod scale over the family's sizes) or for GPUs (schedule, memory and bytes).

Value checks draw whole cases with hypothesis (dims, dtype, seed, DMA mode) on every mesh; the
fixed-shape checks run each implementation once per mesh at each of the family's two fixed shapes
(the canonical one, with odd rows per shard, and its even twin) and share that one compile and
run. A defect that needs an odd shape then fails the odd half only, and the run's summary says so
(see :mod:`conformance.reports.failure_summary`).
"""

from __future__ import annotations

import functools
import inspect
import re
from collections.abc import Callable, Mapping, Sequence

import hypothesis.errors
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from conformance import checks, claims, compat, registry, runner, specs, strategies
from conformance.checks import autodiff, gpu_compile, tpu_memory, tpu_pod, tpu_schedule
from conformance.checks.base import Axes, Check
from conformance.fixtures.meshes import MESH_SETS, MeshConfig, parse_mesh
from conformance.run import run_check
from conformance.runner import Case
from conformance.session import Session

#: TPU layout: the tiling depends on shard shapes, not on the mesh; one ring of 4 shows it.
TPU_LAYOUT_MESH = parse_mesh("4-x-explicit")
#: Hypothesis examples per mesh for the value and gradient checks, which are parametrized over every
#: standard mesh and over a mesh of each kind (a defect that needs a ring of 3, of 8 or of one is then
#: found by construction; hypothesis draws dims, dtype, seed and DMA mode, each mesh's lists starting at
#: their own entry, so the meshes meet different draws and every entry of every list:
#: :mod:`conformance.strategies`): a tenth of the profile's (1 in CI, 20 under conformance-thorough).
#: Each new shape is a compile.
EXAMPLES_PER_MESH = max(1, strategies.suite_settings().max_examples // 10)
#: The settings of the suite's hypothesis tests: the suite's profile, fewer examples per mesh.
PER_MESH = settings(parent=strategies.suite_settings(), max_examples=EXAMPLES_PER_MESH)


class CheckFailed(pytest.fail.Exception):
    """pytest's failure outcome (message only, no traceback), carrying the check's
    :class:`~conformance.checks.ConformanceFailure` for the run's summary of causes."""

    def __init__(self, failure: checks.ConformanceFailure, message: str | None = None) -> None:
        super().__init__(str(failure) if message is None else message, pytrace=False)
        self.failure = failure


def judged_if_flaky(test: Callable[..., None]) -> Callable[..., None]:
    """``test`` (a hypothesis test), whose result varying on one drawn case is a verdict of its own:
    hypothesis replays a failing case before it reports it, and a kernel that then passes, or fails
    otherwise, raises ``hypothesis.errors.Flaky``, which named no check's failure. It fails instead as
    :func:`nondeterministic`, the first run's failure quoted."""

    @functools.wraps(test)
    def judged(*args: object, **kwargs: object) -> None:
        try:
            test(*args, **kwargs)
        except hypothesis.errors.Flaky as flaky:
            first = _failure_inside(flaky)
            if first is None or first.case is None:
                raise
            raise CheckFailed(nondeterministic(first, flaky)) from None

    return judged


def _failure_inside(error: BaseException) -> checks.ConformanceFailure | None:
    """The first check failure inside ``error`` (hypothesis groups them, and wraps pytest's outcomes,
    which are BaseExceptions, in exceptions of its own whose cause is the outcome)."""
    stack, seen = [error], set()
    while stack:
        e = stack.pop(0)
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, checks.ConformanceFailure):
            return e
        stack += [getattr(e, "failure", None), *getattr(e, "exceptions", ()), e.__cause__, e.__context__]
    return None


def nondeterministic(first: checks.ConformanceFailure, flaky: BaseException) -> checks.ConformanceFailure:
    """The failure of a kernel whose result varies on one case: the first run's verdict and what it
    found wrong, and what hypothesis saw when it ran the same case again."""
    said = re.search(r"unreliable results: ([^\n(]*[^\n( ])", str(flaky))
    rerun = said.group(1) if said else "the same case did not fail the same way"
    header = {line.strip() for line in first.case.describe()}
    kept, in_block_map = [], False
    for line in str(first).splitlines()[1:]:
        stripped = line.strip()
        in_block_map = stripped.startswith("block map") or (in_block_map and line.startswith("    "))
        if stripped in header or stripped.startswith("replay") or in_block_map:
            continue  # the header is this failure's too; a block map is of another run
        kept.append(f"  {stripped}")
    failure = checks.fail(
        first.case,
        first.check,
        "nondeterministic on the same case: a failing case did not fail the same way when run again",
        [
            f"first run      : {first.what}",
            *kept,
            f"run again      : {rerun} (hypothesis ran the same drawn case again before reporting it)",
            "what varies    : what a run reads differs between two runs of one program: a race between "
            "transfers, a buffer read before it is written, a host callback, an accumulation in arrival "
            "order",
        ],
    )
    failure.why = f"the first run: {first.what}; run again: {rerun.lower()}"
    return failure


def run(check: checks.Check, case: Case, session: Session) -> None:
    """Run one check (:func:`conformance.run.run_check`); its outcome joins the session's run log, and
    a failure is reported as its message alone (no traceback into the suite).

    What this host cannot do (:class:`compat.HostLimit`) is a skip naming why, never a failure.
    """
    outcome = run_check(check, case, session)
    if session.log is not None:
        session.log.add(outcome)
    if outcome.verdict == "failed":
        raise CheckFailed(outcome.failure)
    if outcome.verdict in ("skipped", "not_judged"):
        pytest.skip(outcome.skip_reason)


def canonical_case(
    family: str,
    impl: str,
    platform: str,
    mesh: MeshConfig,
    dtype: str = "float32",
    dma_mode: str | None = None,
    shape: str = "odd",
    *,
    claimed_on: str | None = None,
) -> Case:
    """The family's fixed dims (``shape``: the canonical ``"odd"`` one or its ``"even"`` twin), as the
    kernel claims them on ``claimed_on`` (default: ``platform``, where the case is made).

    A Pallas kernel on CPU runs in the adversarial "on_wait" DMA mode; on TPU chips at the
    family's TPU-native dims, which both fixed shapes then name (the even one is skipped).
    """
    if dma_mode is None and platform == "cpu" and registry.get(family, impl).pallas:
        dma_mode = "on_wait"
    dims = strategies.fixed_dims(family, impl, claimed_on or platform, mesh, dtype, shape)
    if dims is None:
        pytest.skip(f"{impl}: on {platform} both fixed shapes come to the same dims; [odd] runs them")
    return Case.make(family, impl, mesh, dims, dtype, platform=platform, dma_mode=dma_mode)


def accuracy_case(family: str, impl: str, platform: str, mesh: MeshConfig, dtype: str) -> Case:
    case = canonical_case(family, impl, platform, mesh, dtype)
    dims = claims.adapt(
        family,
        impl,
        platform=platform,
        mesh=mesh,
        dtype=dtype,
        dims=registry.spec_of(family, impl).accuracy_dims or {},
    )
    return Case.make(family, impl, mesh, dims, dtype, platform=platform, dma_mode=case.dma_mode)


def tpu_native_case(family: str, impl: str, mesh: MeshConfig, dtype: str) -> Case:
    """The family's TPU-native dims, adapted to what ``impl`` claims, in the on_wait DMA order on CPU;
    a skip where interpret mode cannot hold the case on this host."""
    spec = registry.spec_of(family, impl)
    dims = claims.adapt(
        family, impl, platform="cpu", mesh=mesh, dims=spec.tpu_native_dims or spec.canonical_dims, dtype=dtype
    )
    case = Case.make(family, impl, mesh, dims, dtype, dma_mode="on_wait")
    limit = compat.interpret_mode_limit(
        devices=mesh.num_devices, bytes_per_device=runner.largest_shard_bytes(case)
    )
    if limit:
        pytest.skip(f"{impl}: {limit}")
    return case


def case_for(axes: Axes, family: str, implementation: str, params: dict) -> Case:
    """The case a test with ``axes`` checks, from its parameters (``data`` for a drawn case)."""
    platform, mesh = params.get("platform", "cpu"), params["mesh_config"]
    if axes.case in ("drawn", "drawn_gradients"):
        named = axes.meshes_for(registry.get(family, implementation))
        among = MESH_SETS[named] if isinstance(named, str) else named
        draw = strategies.draw_number(mesh.label, among=among)
        dtypes = specs.get(family).gradient_dtypes if axes.case == "drawn_gradients" else None
        case = strategies.draw_case(
            params["data"], family, implementation, platform, mesh=mesh, dtypes=dtypes, draw=draw
        )
        if axes.case == "drawn_gradients":
            assume(autodiff.gradients_judged_at(case))
        return case
    if axes.case == "accuracy":
        return accuracy_case(family, implementation, platform, mesh, params["dtype"])
    if axes.case == "tpu_native":
        return tpu_native_case(family, implementation, mesh, params.get("dtype", "float32"))
    return canonical_case(
        family,
        implementation,
        platform,
        mesh,
        params.get("dtype", "float32"),
        dma_mode=params.get("dma_mode"),
        shape=params.get("shape", "odd"),
        claimed_on=_claim_platform(axes, registry.get(family, implementation), platform),
    )


def _claim_platform(axes: Axes, implementation: registry.Implementation, host: str) -> str:
    """The platform ``implementation`` is asked to claim for a case on ``host`` (:attr:`Axes.claimed_for`)."""
    if axes.claimed_for == "host":
        return host
    if axes.claimed_for != "targets":
        return axes.claimed_for
    declared = implementation.platforms
    if declared is None or host in declared:
        return host
    return next((p for p in ("tpu", "gpu") if p in declared), host)


def test_for(check: Check) -> Callable[..., None]:
    """The pytest test of ``check``: its parameters are the fixtures its axes name, its mark the axes
    (which the plugin parametrizes it by)."""
    axes = check.axes
    if axes is None:
        raise ValueError(f"check {check.name!r} declares no axes; it has a test of its own")
    drawn = axes.case.startswith("drawn")
    names = ["family", "implementation", *(["platform"] if axes.platforms else []), "mesh_config"]
    names += [
        n for n, on in (("dma_mode", axes.dma_modes), ("dtype", axes.dtypes), ("shape", axes.shapes)) if on
    ]
    names += ["data"] * drawn + ["conformance_session"]

    def test(*args: object, **params: object) -> None:
        params.update(zip(names, args, strict=False))  # hypothesis: by position; pytest: by name
        session = params.pop("conformance_session")
        family, implementation = params.pop("family"), params.pop("implementation")
        run(check, case_for(axes, family, implementation, params), session)

    test.__name__ = test.__qualname__ = f"test_{check.name}"
    test.__doc__ = check.doc or (check.fn.__doc__ or "").split("\n\n")[0].strip()
    test.__signature__ = inspect.Signature(
        [inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD) for n in names],
        return_annotation=None,
    )
    if drawn:
        test = judged_if_flaky(PER_MESH(given(data=st.data())(test)))
    test = pytest.mark.conformance_axes(axes)(test)
    if check.compile_tier == "tpu_compile":  # as the tier's own tests below: a TPU VM's -m tpu runs it too
        test = pytest.mark.tpu_compile(pytest.mark.tpu(test))
    elif check.compile_tier:
        test = getattr(pytest.mark, check.compile_tier)(test)
    return test if axes.platforms else pytest.mark.cpu(test)


@pytest.mark.cpu
@pytest.mark.tpu
@pytest.mark.tpu_compile
@pytest.mark.conformance_axes(Axes(platforms=False, dtypes="dtypes", implementations=("pallas",)))
def test_tpu_layout(family: str, implementation: str, dtype: str, conformance_session: Session) -> None:
    """Lowered for TPU chips at every tile-edge shape: refused with the constraint named, or
    lowered to DMA windows and buffers a TPU compiler accepts; the TPU-native shape accepted."""
    shapes, not_claimed = [], []
    for dims in strategies.tpu_layout_dims(family, implementation):
        why = claims.reason(
            family, implementation, platform="tpu", mesh=TPU_LAYOUT_MESH, dims=dims, dtype=dtype
        )
        (shapes if why is None else not_claimed).append(dims if why is None else why)
    if not shapes:
        raise claims.NotClaimed(
            implementation, f"none of the {len(not_claimed)} TPU layout shapes: {not_claimed[0]}"
        )
    cases = [Case.make(family, implementation, TPU_LAYOUT_MESH, dims, dtype) for dims in shapes]
    run_gathered(checks.CHECKS["tpu_layout"], cases, conformance_session, what="shapes")


@pytest.mark.cpu
@pytest.mark.tpu
@pytest.mark.tpu_compile
@pytest.mark.conformance_axes(
    Axes(platforms=False, meshes=tpu_schedule.SCHEDULE_MESHES, families_with="overlap")
)
def test_tpu_schedule(
    family: str, implementation: str, mesh_config: MeshConfig, conformance_session: Session
) -> None:
    """Compiled by the real TPU compiler for a v5e and a v6e slice at each size of the family's ladder
    (bfloat16, else the float the kernel claims): every transfer but one per ring direction has a matmul
    scheduled inside it."""
    cases = claimed_tpu_cases(
        family, implementation, mesh_config, registry.spec_of(family, implementation).schedule_ladder
    )
    run_gathered(checks.CHECKS["tpu_schedule"], cases, conformance_session, what="sizes")


@pytest.mark.cpu
@pytest.mark.tpu
@pytest.mark.tpu_compile
@pytest.mark.conformance_axes(
    Axes(platforms=False, meshes=tpu_schedule.SCHEDULE_MESHES, families_with="tpu_native_dims")
)
def test_tpu_memory(
    family: str, implementation: str, mesh_config: MeshConfig, conformance_session: Session
) -> None:
    """Compiled by the real TPU compiler for a v5e and a v6e slice at each size of the family's ladder
    (bfloat16, else the float the kernel claims): peak memory per chip within a stated ratio of the
    baseline's."""
    cases = claimed_tpu_cases(
        family, implementation, mesh_config, tpu_memory.memory_dims(family, implementation)
    )
    run_gathered(checks.CHECKS["tpu_memory"], cases, conformance_session, what="sizes")


@pytest.mark.cpu
@pytest.mark.tpu
@pytest.mark.tpu_compile
@pytest.mark.conformance_axes(
    Axes(platforms=False, meshes=tpu_pod.POD_MESHES, families_with="tpu_native_dims")
)
def test_tpu_pod(
    family: str, implementation: str, mesh_config: MeshConfig, conformance_session: Session
) -> None:
    """Compiled by the real TPU compiler for a whole v5e slice of 64 and of 256 chips at the family's TPU-
    native dims (bfloat16, else the float the kernel claims), or refused by the kernel naming its
    limit."""
    cases = claimed_tpu_cases(
        family, implementation, mesh_config, [registry.spec_of(family, implementation).tpu_native_dims or {}]
    )
    run_gathered(checks.CHECKS["tpu_pod"], cases, conformance_session, what="pod slices")


@pytest.mark.gpu
@pytest.mark.gpu_compile
@pytest.mark.conformance_axes(Axes(platforms=False, meshes=gpu_compile.GPU_MESHES, families_with="overlap"))
def test_gpu_schedule(
    family: str, implementation: str, mesh_config: MeshConfig, conformance_session: Session
) -> None:
    """Compiled by XLA:GPU for 8 and 16 H100s at each size of the family's ladder (bfloat16, else the
    float the kernel claims): every transfer but one per ring direction has a matmul scheduled inside it."""
    sizes = registry.spec_of(family, implementation).schedule_ladder
    cases = claimed_tpu_cases(family, implementation, mesh_config, sizes, platform="gpu")
    run_gathered(checks.CHECKS["gpu_schedule"], cases, conformance_session, what="sizes")


@pytest.mark.gpu
@pytest.mark.gpu_compile
@pytest.mark.conformance_axes(
    Axes(platforms=False, meshes=gpu_compile.GPU_MESHES, families_with="tpu_native_dims")
)
def test_gpu_memory(
    family: str, implementation: str, mesh_config: MeshConfig, conformance_session: Session
) -> None:
    """Compiled by XLA:GPU for 8 and 16 H100s at each size of the family's ladder (bfloat16, else the
    float the kernel claims): peak memory per GPU within a stated ratio of the baseline's."""
    sizes = tpu_memory.memory_dims(family, implementation)
    cases = claimed_tpu_cases(family, implementation, mesh_config, sizes, platform="gpu")
    run_gathered(checks.CHECKS["gpu_memory"], cases, conformance_session, what="sizes")


@pytest.mark.gpu
@pytest.mark.gpu_compile
@pytest.mark.conformance_axes(
    Axes(platforms=False, meshes=gpu_compile.GPU_MESHES, families_with="tpu_native_dims")
)
def test_gpu_bytes(
    family: str, implementation: str, mesh_config: MeshConfig, conformance_session: Session
) -> None:
    """Compiled by XLA:GPU for 8 and 16 H100s at each size of the family's ladder (bfloat16, else the
    float the kernel claims): the forward and backward passes use only the family's collectives, within
    its byte bound."""
    sizes = tpu_memory.memory_dims(family, implementation)
    cases = claimed_tpu_cases(family, implementation, mesh_config, sizes, platform="gpu")
    run_gathered(checks.CHECKS["gpu_bytes"], cases, conformance_session, what="sizes")


#: The dtypes a compile tier's size is compiled at, the first the kernel claims: bfloat16, what these
#: kernels ship in; a kernel that claims no bfloat16 is compiled in its widest float it claims, so that
#: a float32-only kernel meets memory, pod scale and the schedule as every other does.
COMPILE_TIER_DTYPES = ("bfloat16", "float32", "float16")


def claimed_tpu_cases(
    family: str,
    implementation: str,
    mesh: MeshConfig,
    sizes: Sequence[Mapping[str, int]],
    *,
    platform: str = "tpu",
) -> list[Case]:
    """The cases at ``sizes`` that ``implementation`` claims for ``platform`` (TPU, or GPU for the GPU
    compile tier), each in the first of :data:`COMPILE_TIER_DTYPES` it claims there; not claimed (a
    skip naming why, the bfloat16 case's) if it claims none."""
    cases, not_claimed = [], []
    for dims in sizes:
        reasons = {
            dtype: claims.reason(
                family, implementation, platform=platform, mesh=mesh, dims=dict(dims), dtype=dtype
            )
            for dtype in COMPILE_TIER_DTYPES
        }
        claimed = [dtype for dtype, why in reasons.items() if why is None]
        if claimed:
            cases.append(Case.make(family, implementation, mesh, dict(dims), claimed[0]))
        else:
            not_claimed.append(reasons["bfloat16"])
    if not cases:
        raise claims.NotClaimed(implementation, f"none of the {len(sizes)} sizes: {not_claimed[0]}")
    return cases


def run_gathered(check: Check, cases: list[Case], session: Session, *, what: str) -> None:
    """One test's verdict over several cases of one check (each compiles for a TPU or GPU topology;
    nothing runs), each run where :func:`conformance.run.run_check` puts it (the worker process, where a
    compile past its bound ends with it) and logged: the failures together (the first three in full),
    else a skip for the cases this host could not try, else a skip for a check with nothing to judge."""
    failures: list[checks.ConformanceFailure] = []
    limited, not_judged = [], []
    for case in cases:
        outcome = run_check(check, case, session)
        if session.log is not None:
            session.log.add(outcome)
        if outcome.verdict == "failed":
            failures.append(outcome.failure)
        elif outcome.verdict == "skipped":
            limited.append(outcome.message)
        elif outcome.verdict == "not_judged":
            not_judged.append(outcome.skip_reason)
    if failures:
        more = [f"... and {len(failures) - 3} more {what}"] if len(failures) > 3 else []
        text = "\n".join([f"{len(failures)} of {len(cases)} {what} fail:", *map(str, failures[:3]), *more])
        raise CheckFailed(failures[0], text)
    if limited:  # the cases that were tried passed; the rest this host could not try
        pytest.skip(f"{cases[0].impl}: {len(limited)} of {len(cases)} {what}: {limited[0]}")
    if not_judged and len(not_judged) == len(cases):
        pytest.skip(not_judged[0])


for _check in checks.CHECKS.values():
    if _check.axes is not None:
        globals()[f"test_{_check.name}"] = test_for(_check)
del _check

__all__ = [name for name in dir() if name.startswith("test_") and name != "test_for"]
