"""What every check shares: its failure, the kernel call that names where an error came from, the
shard-by-shard comparison with the float64 reference, and the :class:`Check` a check registers as.

A check is a plain function of a :class:`~conformance.runner.Case`. It returns the records it made
for the run's tables (or nothing) and raises :class:`ConformanceFailure` for a kernel that does not
conform, :class:`NotJudged` when there is nothing in the kernel it can judge, and
:class:`conformance.compat.HostLimit` for what this host cannot do. Records made before it raised
travel on the exception (:func:`keeping`), so a failing kernel still shows in the tables.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

import jax
import numpy as np

from conformance import compat, dtypes, runner, shared_runs, tolerances, watchdog
from conformance.blame import error_locations, error_text
from conformance.checks import block_map, wrong_result
from conformance.checks.baseline_case import baseline_of, baseline_result
from conformance.runner import Case
from conformance.targets import cpu_ragged_all_to_all, target_compiles


class CheckedCase(Protocol):
    """What a failure message and the run's reports need of a case: a family check's
    :class:`~conformance.runner.Case`, a send_recv :class:`~conformance.transfers.Transfer`."""

    family: str
    impl: str

    @property
    def token(self) -> str: ...

    def describe(self) -> list[str]: ...

    def replay_command(self, check: str) -> str: ...

    def size_key(self) -> tuple[int, int, int, str]: ...


class ConformanceFailure(AssertionError):
    """A check found the implementation does not conform.

    ``case``, ``check`` and ``what`` (the one-line verdict) are set when :func:`fail` made it,
    so a report can group failures by cause; ``None`` otherwise.
    """

    case: CheckedCase | None = None
    check: str | None = None
    what: str | None = None
    #: Why, in one line, where a check can say more than its verdict (which block landed where).
    why: str | None = None


class NotJudged(Exception):
    """The check has nothing it can judge in this implementation (a skip naming why, never a pass)."""


#: The topology a compile tier's check is judging a case on (:func:`compiled_for`), if any.
_COMPILED_FOR: contextvars.ContextVar[str | None] = contextvars.ContextVar("compiled_for", default=None)


@contextlib.contextmanager
def compiled_for(topology: str) -> Iterator[None]:
    """Inside the block, a failure's header says the case's mesh was compiled for the chips of
    ``topology`` (nothing ran on this host's devices)."""
    token = _COMPILED_FOR.set(topology)
    try:
        yield
    finally:
        _COMPILED_FOR.reset(token)


def fail(case: CheckedCase, check: str, what: str, details: Sequence[str] = ()) -> ConformanceFailure:
    """The failure of ``check`` on ``case``: the one-line verdict, the case's header, ``details``
    and the replay line. Inside :func:`compiled_for`, the header's mesh is that topology's."""
    header = case.describe()
    topology = _COMPILED_FOR.get()
    if topology is not None and isinstance(case, Case):
        mesh = f"mesh           : {case.mesh.describe()}, on the chips of {topology} (compiled; nothing ran)"
        header = [mesh if h.startswith("mesh           : ") else h for h in header]
    lines = [f"[{check}] {case.family}/{case.impl}: {what}", *("  " + h for h in header)]
    lines += ["  " + d for d in details]
    lines.append(f"  replay         : {case.replay_command(check)}")
    failure = ConformanceFailure("\n".join(lines))
    failure.case, failure.check, failure.what = case, check, what
    return failure


def _device_coords(mesh: jax.sharding.Mesh, device: jax.Device) -> str:
    pos = np.argwhere(mesh.devices == device)
    if not len(pos):
        return "not in mesh"
    return ", ".join(f"{n}={i}" for n, i in zip(mesh.axis_names, pos[0], strict=True))


def slice_text(index: tuple[slice, ...], shape: tuple[int, ...]) -> str:
    parts = []
    for s, dim in zip(index, shape, strict=True):
        start, stop, _ = s.indices(dim)
        parts.append(f"{start}:{stop}")
    return "[" + ", ".join(parts) + "]"


@contextlib.contextmanager
def keeping(records: list[Any]) -> Iterator[list[Any]]:
    """Whatever the block raises carries ``records`` (the ones made so far) as ``.records``: a
    failing or host-limited check's records still reach the run's tables."""
    try:
        yield records
    except BaseException as error:
        error.records = [*getattr(error, "records", ()), *records]  # type: ignore[attr-defined]
        raise


def records_of(result: object) -> list[Any]:
    """A check's return value as a list of records (``None``: none; one record; a list)."""
    if result is None:
        return []
    return list(result) if isinstance(result, (list, tuple)) else [result]


#: How a check's test makes its case: the family's fixed dims, dims hypothesis draws (at the spec's
#: dtypes, or at its gradient dtypes), the spec's accuracy dims, or its TPU-native dims (the DMA
#: windows a chip runs, on CPU in interpret mode's on_wait DMA order).
CASE_KINDS = ("fixed", "drawn", "drawn_gradients", "accuracy", "tpu_native")
#: What a test may ask of an implementation.
IMPLEMENTATION_PREDICATES = (
    "pallas",
    "differentiable",
    "bidirectional",
    "other_reductions",
    "not_baseline",
    "not_pallas",
)


@dataclasses.dataclass(frozen=True)
class Axes:
    """What a check's pytest test is parametrized over. :mod:`conformance.family_tests` makes the
    test ``test_<name>`` from it, and the plugin parametrizes the test by it (the test carries it as
    its ``conformance_axes`` mark), so a check declares its test where it is defined."""

    #: :data:`CASE_KINDS`.
    case: str = "fixed"
    #: The meshes it runs on: a named set of standard meshes (``"standard"``: every one;
    #: ``"covering"``: one of each kind, :data:`conformance.fixtures.meshes.MESH_SETS`), which
    #: ``--meshes`` replaces; or labels of its own (the compile tiers' rings, on TPU and GPU
    #: topologies), which ``--meshes`` leaves alone.
    meshes: str | tuple[str, ...] = "standard"
    #: Both fixed shapes ("odd" and its "even" twin), or the odd one alone.
    shapes: bool = False
    #: The spec field whose dtypes the test runs at (``"dtypes"``, ``"accuracy_dtypes"``, ...);
    #: ``None``: float32 (or what hypothesis draws).
    dtypes: str | None = None
    #: Both DMA execution modes of TPU interpret mode.
    dma_modes: bool = False
    #: On every platform (cpu, gpu, tpu), or on CPU alone (Pallas interpret mode).
    platforms: bool = True
    #: :data:`IMPLEMENTATION_PREDICATES` an implementation must meet to be tested.
    implementations: tuple[str, ...] = ()
    #: A spec field a family must set for the test to run there (e.g. ``"overlap"``).
    families_with: str | None = None

    #: Where a test runs several variants of each mesh's case (both fixed shapes, both DMA modes),
    #: the first (the odd shape, the ``on_wait`` DMA order) runs on every mesh of the test and the
    #: others on this set's meshes only: what the other variants can find (a defect that needs an
    #: even shape, the eager DMA order) does not turn on the mesh's kind, and each is a compile and
    #: a run per mesh.
    variants_on: str = "covering"
    #: A Pallas TPU kernel's named set instead of :attr:`meshes` (interpreted on CPU at 1-3 s a case).
    interpreted_meshes: str | None = None
    #: Where :attr:`meshes` are a check's own and a kernel claims none of them (its ``supports=`` refuses
    #: their shape at the odd fixed shape: a kernel of one mesh axis, a 2-D mesh), the first of these it
    #: claims instead, so that the check still meets it.
    fallback_meshes: tuple[str, ...] = ()
    #: The shortest ring the check judges: a check of transfers has none to judge on a ring of one,
    #: so its test is not parametrized there.
    min_ring: int = 1
    #: The platform a kernel must claim for the check's case: ``"host"``, the one it runs on; ``"targets"``,
    #: any it lowers for (a kernel registered for TPU and GPU gets a check that only lowers on a CPU
    #: host); or one named (``"tpu"``: the TPU compile tier). :func:`conformance.family_tests.case_for`.
    claimed_for: str = "host"

    def __post_init__(self) -> None:
        from conformance.fixtures.meshes import MESH_SETS

        for name in (self.meshes, self.variants_on, self.interpreted_meshes):
            if isinstance(name, str) and name not in MESH_SETS:
                raise ValueError(f"Axes: mesh set {name!r} is not one of {sorted(MESH_SETS)}")
        if self.case not in CASE_KINDS:
            raise ValueError(f"Axes.case {self.case!r} is not one of {CASE_KINDS}")
        unknown = set(self.implementations) - set(IMPLEMENTATION_PREDICATES)
        if unknown:
            raise ValueError(f"Axes.implementations: {sorted(unknown)} not in {IMPLEMENTATION_PREDICATES}")

    def meshes_for(self, implementation: Any) -> str | tuple[str, ...]:
        """The meshes :attr:`meshes` names, or :attr:`interpreted_meshes` for a Pallas kernel, or the
        first of :attr:`fallback_meshes` it claims where it claims none of its own."""
        from conformance.strategies import claims_mesh as _claims  # strategies imports what imports this

        own = self.meshes
        if (
            self.fallback_meshes
            and isinstance(own, tuple)
            and implementation is not None
            and not any(_claims(implementation, label) for label in own)
        ):
            return next(((m,) for m in self.fallback_meshes if _claims(implementation, m)), own)
        return (getattr(implementation, "pallas", False) and self.interpreted_meshes) or self.meshes

    def selects(self, implementation: Any) -> bool:
        """Whether ``implementation`` (a registry record) meets :attr:`implementations`."""
        return all(
            (not getattr(implementation, p.removeprefix("not_")))
            if p.startswith("not_")
            else getattr(implementation, p)
            for p in self.implementations
        )


#: What a check's failure means, in the order a kernel author should look at them: the kernel gives a
#: wrong result (values, sharding, dtype, gradients, races, a hang...), a less precise one than XLA's
#: own (accuracy), a program that moves or holds what it should not (collectives, bytes, lowering,
#: layout), or one that waits where it could overlap (overlap, schedule, memory).
CONCERNS = ("result", "precision", "program", "performance")
COMPILE_TIERS = ("tpu_compile", "gpu_compile")  #: pytest markers: what :attr:`Check.compile_tier` names


@dataclasses.dataclass(frozen=True)
class Check:
    """A check as the run knows it: its name (test ids, replay lines), its function, how its
    records become the run's tables, and what its test is parametrized over. Calling it calls
    the function."""

    name: str
    fn: Callable[[Case], object]
    #: ``records -> [(title, lines)]``: this check's tables, from its records of the run.
    tables: Callable[[list[Any]], list[tuple[str, list[str]]]] | None = None
    #: Its pytest test's axes; ``None``: the check has a test of its own in ``family_tests``.
    axes: Axes | None = None
    #: The test's docstring (default: the first paragraph of the check's).
    doc: str = ""
    #: What a failure of it means to a user, one of :data:`CONCERNS`: the run's summary starts from
    #: a wrong result before a precision, a program or a performance defect.
    concern: str = "result"
    #: The compile tier (:data:`COMPILE_TIERS`) whose marker its test carries, or ``None``: such a check
    #: runs in the worker process (:mod:`conformance.run.check_worker`), ended by a compile past its bound.
    compile_tier: str | None = None

    def __post_init__(self) -> None:
        if self.compile_tier not in (None, *COMPILE_TIERS):
            raise ValueError(f"Check {self.name!r}: compile_tier {self.compile_tier!r} is not a compile tier")
        if self.concern not in CONCERNS:
            raise ValueError(f"Check {self.name!r}: concern {self.concern!r} is not one of {CONCERNS}")

    def __call__(self, case: Case) -> object:
        return self.fn(case)


def call_kernel(
    case: Case, check: str, thunk: Callable[[], object], *, passing: tuple[type[BaseException], ...] = ()
) -> object:
    """Run the implementation; an exception on valid input is a conformance failure naming where
    (``passing``: exceptions the caller judges itself, a compiler's refusal, re-raised as they are)."""
    try:
        with compat.unfiltered_tracebacks():
            return thunk()
    except (ConformanceFailure, compat.HostLimit, *passing):  # a verdict, this host's limit, the caller's
        raise
    except target_compiles.CompileTimeout as timeout:  # not the kernel's error: a compile past its bound
        raise compile_timeout_failure(case, check, timeout) from timeout
    except watchdog.NotRunAgain as again:  # the hang earlier was the kernel's failure; this is not judged
        raise NotJudged(
            f"{case.impl} hung earlier in this run ({again}); its later checks do not run, each would "
            f"wait out the hang again. To judge this one: {case.replay_command(check)}"
        ) from again
    except Exception as e:  # the kernel's own error, re-raised with the case attached
        refusal = cpu_ragged_all_to_all.refusal_without_the_emulation(case, e)
        if refusal:
            raise NotJudged(refusal) from e
        details = [*error_locations(e), error_text(e)]
        raise fail(case, check, f"raised {type(e).__name__} on valid input", details) from e


def compile_timeout_failure(
    case: CheckedCase, check: str, timeout: target_compiles.CompileTimeout
) -> ConformanceFailure:
    """The verdict on a compile for a TPU or GPU topology that outran ``--compile-timeout``: one cause
    whatever the topology and size (both named in the details, the size in the case's dims)."""
    return fail(
        case,
        check,
        "a compile for a TPU or GPU topology did not finish within --compile-timeout",
        [
            f"compile        : {timeout}",
            "the run goes on; a larger --compile-timeout gives this compile longer (a kernel that unrolls "
            "into thousands of tiles at these sizes compiles for minutes)",
        ],
    )


def run_case(case: Case, check: str, *, cached: bool = True) -> tuple[tuple[np.ndarray, ...], jax.Array]:
    """``case`` run (:func:`call_kernel`), in the run the checks of the case share
    (:func:`conformance.shared_runs.shared_run`) where ``cached``; its result must be one ``jax.Array``."""
    inputs64, out = call_kernel(
        case, check, lambda: (shared_runs.shared_run if cached else runner.execute)(case)
    )
    require_array(case, check, out)
    return inputs64, out


def require_array(case: Case, check: str, value: Any, *, what: str = "out") -> None:
    """``value`` (what the kernel returned) is one ``jax.Array``; else the check fails naming what it
    was (a tuple, None, a numpy array), before anything reads its shards."""
    if not isinstance(value, jax.Array):
        kind = type(value).__name__ + (f" of {len(value)}" if isinstance(value, (tuple, list)) else "")
        raise fail(
            case,
            check,
            f"{what} is not a jax.Array",  # one verdict line whatever it was
            [f"returned       : {kind}; the family's result is one jax.Array"],
        )


def require_shape(case: Case, check: str, value: Any, shape: tuple[int, ...], *, what: str = "out") -> None:
    """``value`` (a kernel's result, or a gradient) has ``shape``; else the check fails naming both,
    before anything compares elements."""
    got = tuple(getattr(value, "shape", ()))
    if got != tuple(shape):  # one verdict line whatever the shapes: one cause across sizes
        raise fail(
            case,
            check,
            f"{what} has the wrong shape",
            [f"{what + ' shape':<15}: {got}, expected {tuple(shape)}"],
        )


def compare_shards(
    case: Case,
    check: str,
    out: jax.Array,
    expected: np.ndarray,
    tol: np.ndarray,
    *,
    what: str = "out",
    subject: str | None = None,
    rule: str | None = None,
    explain: Callable[[], list[str]] | None = None,
) -> None:
    """Every addressable shard of ``what`` against its block of ``expected``; reports the first wrong one
    (and the ``rule`` the tolerance came from, where it is not the worst-case bound, and the lines
    ``explain`` gives: which block landed where)."""
    require_shape(case, check, out, expected.shape, what=what)
    mesh = runner.mesh_of(case)
    wrong = []
    for shard in sorted(out.addressable_shards, key=lambda s: s.device.id):
        got = np.asarray(shard.data).astype(np.float64)
        exp, t = expected[shard.index], tol[shard.index]
        if got.shape != exp.shape:
            wrong.append((shard, f"shard shape {got.shape} != block shape {exp.shape}", None))
            continue
        bad = ~(np.abs(got - exp) <= t)  # NaN counts as wrong
        if bad.any():
            wrong.append((shard, bad, (got, exp, t)))
    if not wrong:
        return
    shard, bad, data = wrong[0]
    details = [
        f"first wrong shard: device {shard.device.id} (mesh coords {_device_coords(mesh, shard.device)}), "
        f"block {slice_text(shard.index, expected.shape)}",
    ]
    if data is None:
        details.append(str(bad))
    else:
        got, exp, t = data
        local = tuple(int(i) for i in np.argwhere(bad)[0])
        offsets = [s.indices(d)[0] for s, d in zip(shard.index, expected.shape, strict=True)]
        glob = tuple(o + i for o, i in zip(offsets, local, strict=True))
        details.append(
            f"first wrong index: {what}{list(glob)} = {float(got[local]):.7g}, "
            f"expected {float(exp[local]):.7g} "
            f"(tolerance {t[local]:.3g}, |error| {abs(got[local] - exp[local]):.3g})"
        )
        details.append(f"wrong elements in that shard: {int(bad.sum())} of {bad.size}")
    details.append(
        f"wrong shards: {len(wrong)} of {len(out.addressable_shards)} "
        f"(devices {[s.device.id for s, _, _ in wrong]})"
    )
    if rule:
        details.append(f"tolerance rule : {rule}")
    why = _explained(explain) if explain else []
    subject = subject or ("values differ" if what == "out" else f"gradient {what} differs")
    failure = fail(case, check, f"{subject} from the numpy float64 reference", [*details, *why])
    failure.why = block_map.summary_line(why)
    raise failure


def _explained(explain: Callable[[], list[str]]) -> list[str]:
    with compat.unfiltered_tracebacks():
        return explain()


def assert_dtype(case: Case, check: str, out: jax.Array) -> None:
    want = dtypes.result_np(case.dtype)
    got = {np.dtype(out.dtype)} | {np.dtype(s.data.dtype) for s in out.addressable_shards}
    if got != {want}:  # one verdict line whatever the dtypes: one cause across dtypes in the summary
        raise fail(
            case,
            check,
            "the result's dtype is not the spec's",
            [f"result dtype   : {', '.join(sorted(map(str, got)))}; for {case.dtype} the spec's is {want}"],
        )


def check_byte_bound(
    case: Case,
    check: str,
    what: str,
    received: int | None,
    bound: int,
    bound_text: str,
    ops: list[str],
    module: str = "compiled module",
) -> None:
    """Fail ``check`` if a device receives more than ``bound`` bytes per call (or an unknown amount)."""
    if received is not None and received <= bound:
        return
    got = (
        "unbounded (a collective runs in a loop of unknown trip count)"
        if received is None
        else f"{received} bytes"
    )
    raise fail(
        case,
        check,
        what,
        [
            f"bound          : {bound} bytes ({bound_text})",
            f"received       : {got} per device per call",
            f"collectives in the {module}:",
            *ops,
        ],
    )


def lower_or_note_limit(case: Case, check: str, what: str, lower, target: str, limited: list[str]):
    """``lower(target)``; what this host cannot lower is noted in ``limited`` (``None`` returned), and any
    other error is ``check``'s failure (cross_lowering fails it too)."""
    try:
        return lower(target)
    except compat.HostCannotLower as limit:
        limited.append(f"{target}: {limit}")
        return None
    except Exception as e:
        raise fail(
            case, check, f"{what} does not lower for {target}", [*error_locations(e), error_text(e)]
        ) from e


def compare_with_reference(
    case: Case,
    check: str,
    out: jax.Array,
    inputs64: tuple[np.ndarray, ...],
    *,
    subject: str | None = None,
    blocks: bool = True,
) -> None:
    """Every shard of the result against the family's float64 reference, within the dtype's tolerance:
    its worst-case bound, or where that says nothing (:class:`conformance.tolerances.Unbounded`: a
    bfloat16 contraction of 256 or more) the family baseline's error on the same inputs
    (:func:`conformance.tolerances.baseline_relative_tolerance`), the rule named in a failure; a wrong
    result is traced on source-tagged inputs (``blocks``: the kernel run again under jit,
    :mod:`conformance.checks.block_map`)."""
    spec = case.spec
    expected = spec.expected(inputs64, axis_size=case.mesh.axis_size)
    try:
        tol, rule = spec.tolerance(*inputs64, case.dtype), None
    except tolerances.Unbounded as unbounded:
        tol, rule = _baseline_tolerance(case, check, inputs64, expected, str(unbounded))

    def explain() -> list[str]:
        placed = block_map.where_blocks_landed(case, lambda inputs: runner.execute(case, inputs=inputs)[1])
        return [
            *placed,
            *wrong_result.known_mistakes(case, inputs64, out, tol),
            *wrong_result.family_explains(case, inputs64, out, tol),
            *_baseline_wrong_too(case, inputs64, expected, tol),
        ]

    compare_shards(
        case, check, out, expected, tol, subject=subject, rule=rule, explain=explain if blocks else None
    )


def _baseline_wrong_too(
    case: Case, inputs64: tuple[np.ndarray, ...], expected: np.ndarray, tol: np.ndarray | float
) -> list[str]:
    """The line saying that the family's baseline (XLA's own op) gets the same inputs wrong as well,
    where it does: then the defect lies below the kernel, in the compiler or the platform (XLA:GPU's
    doubled int8 dots), and the kernel's author can stop looking at the kernel. ``[]`` where the
    baseline is right, is the kernel itself, or cannot run the case (a dtype or shape it lacks); not
    run in a multi-process job, where a rank whose own shards are right would not join the run."""
    if jax.process_count() > 1:
        return []
    try:
        baseline = baseline_of(case.family)
        if baseline == case.impl:
            return []
        base = baseline_result(case, baseline, inputs64, expected, call=lambda run: run())
    except Exception:  # the baseline not running this case says nothing about the kernel's result
        return []
    bad = np.abs(base - expected) > tol
    if not bad.any():
        return []
    first = tuple(int(i) for i in np.argwhere(bad)[0])
    return [
        f"{block_map.BASELINE_PREFIX} {baseline} (the family's baseline, XLA's own op) gets the same "
        f"inputs wrong too: out{list(first)} = {base[first]:.7g}, expected {expected[first]:.7g} "
        f"({int(bad.sum())} of {bad.size} elements wrong): the defect is below the kernel, in the "
        "compiler or the platform"
    ]


def _baseline_tolerance(
    case: Case, check: str, inputs64: tuple[np.ndarray, ...], expected: np.ndarray, why: str
) -> tuple[np.ndarray, str]:
    baseline = baseline_of(case.family)
    base = baseline_result(case, baseline, inputs64, expected, call=lambda run: call_kernel(case, check, run))
    error = np.abs(base - expected)
    tol = tolerances.baseline_relative_tolerance(expected, error, case.dtype)
    rule = (
        f"{why}: each element within {tolerances.BASELINE_ERROR_FACTOR:g}x the largest error of "
        f"{baseline} on the same inputs ({float(error.max(initial=0.0)):.3g}) plus one ulp"
    )
    return tol, rule
