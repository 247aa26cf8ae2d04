"""Scheduled overlap: in the run order XLA:TPU really gives a collective matmul, each transfer has a
matmul running inside it.

The dataflow check (:mod:`conformance.checks.overlap`) judges what a scheduler *could* overlap. What
a TPU user buys is what XLA:TPU's latency-hiding scheduler *does*: compiled for a TPU topology by the
real compiler (libtpu, :mod:`conformance.targets.tpu_compiler`), the module is scheduled (its text order is
its run order), and each asynchronous collective is a ``-start`` .. ``-done`` span. A transfer is
hidden when a matmul (or a fusion or kernel holding one) is scheduled inside its span; a synchronous
collective is never hidden. Loops count per trip (:func:`conformance.hlo.schedule`).

The scheduler decides by its cost model, so the check compiles a ladder of realistic bfloat16 sizes
(the family's ``schedule_ladder``: per-hop transfers of 256 KiB to 4 MiB) on a v5e and a v6e slice of
8 and of 16 chips, and on a 3-D v5p slice of 12. Where this verdict and the dataflow's disagree, this
one is the TPU verdict.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from conformance import compat, dtypes, hlo, registry
from conformance import session as session_lib
from conformance.checks import target_tables
from conformance.checks.base import (
    Check,
    ConformanceFailure,
    NotJudged,
    compiled_for,
    fail,
    keeping,
)
from conformance.checks.on_topology import compiled_on_topology, compiled_or_fail, compiler_of, schedule_of
from conformance.checks.overlap import PALLAS_OVERLAP
from conformance.checks.schedule_causes import how_to_hide, passes_rule, why_exposed
from conformance.checks.target_tables import size_text
from conformance.runner import Case
from conformance.targets import target_compiles, tpu_compiler

#: The slices each ring length compiles for: one TPU generation with 4 ICI links per chip (v5e) and
#: the next (v6e), whose schedulers' cost models differ, at 8 and 16 chips; and a ring of 12 over a
#: 3-D v5p slice (2x2x3; ``jax.make_mesh`` threads the ring through the torus), the ring length that
#: is no power of two and the topology that is 3-D.
SCHEDULE_TOPOLOGIES: dict[int, tuple[str, ...]] = {
    8: ("v5e:2x4", "v6e:2x4"),
    12: ("v5p:2x2x3",),
    16: ("v5e:4x4", "v6e:4x4"),
}
#: The mesh labels of the check's cases: a 1-D ring of each length in :data:`SCHEDULE_TOPOLOGIES`.
SCHEDULE_MESHES = tuple(f"{n}-x-explicit" for n in SCHEDULE_TOPOLOGIES)


@dataclasses.dataclass(frozen=True)
class TpuScheduleRecord:
    """One kernel compiled for one TPU topology at one size: transfers hidden in the real schedule."""

    family: str
    impl: str
    topology: str
    ring: int
    dims: tuple[tuple[str, int], ...]
    hop_bytes: int  #: bytes of the largest transfer
    hidden: int
    total: int
    order: str  #: the run order in letters (:meth:`conformance.hlo.Schedule.order_text`)
    baseline: bool
    judge: str  #: ``libtpu 0.0.42.1 (v5e:2x4)``
    #: Bytes a device receives per call in transfers with no matmul inside them.
    exposed_bytes: int = 0
    #: The compiler's own collective matmul (``compilers_own``), or one of its compile modes.
    compilers_own: bool = False
    #: The compiler's own collective matmul's exposed bytes at this topology and size (``None``: the
    #: family has none, or it did not compile), and where this kernel stands beside it: ``ahead``
    #: (fewer bytes exposed), ``level``, ``behind``, or ``""`` (not compared).
    compiler_exposed: int | None = None
    standing: str = ""
    #: The flags of the compile (:func:`conformance.targets.target_compiles.flags_in_effect`).
    flags: str = "compiler defaults"
    #: The check failed the kernel at this topology and size (its verdict, :func:`_fails`).
    failed: bool = False
    #: Bytes of the operands one device holds at this size: the same for every kernel of the family
    #: there (the plots' x axis; a kernel's own transfers differ in size).
    argument: int = 0


def _hop_bytes(module: hlo.HloModule) -> int:
    return max(
        (s.nbytes for op in hlo.collectives_of(module).ops if op.phase != "done" for s in op.operand_shapes),
        default=0,
    )


def check_tpu_schedule(case: Case) -> list[TpuScheduleRecord]:
    """Compiled by the real TPU compiler for a v5e and a v6e slice of the case's ring length, every
    transfer but one per ring direction (and at least one) has a matmul inside its span in the
    scheduled module. The baseline is recorded, not judged. A host without libtpu skips, naming the
    install command."""
    return check_schedule(
        case, tpu_compiler, SCHEDULE_TOPOLOGIES, check="tpu_schedule", record=TpuScheduleRecord
    )


def check_schedule(
    case: Case, compiler: Any, topologies: Mapping[int, tuple[str, ...]], *, check: str, record: type
) -> list[Any]:
    """The scheduled-overlap verdict of ``compiler`` (:mod:`~conformance.targets.tpu_compiler` or
    :mod:`~conformance.targets.gpu_compiler`) for each topology of the case's ring length, one ``record``
    each."""
    spec = case.spec
    if not spec.overlap:
        raise NotJudged(f"family {case.family} has no compute to hide its transfers behind")
    records: list[Any] = []
    failures: list[ConformanceFailure] = []
    with keeping(records):
        for topology in ring_topologies(case, compiler, topologies, what=f"the {compiler.NAME} schedule"):
            # every topology judged, so that the tables hold the whole ladder; the first failure says
            # why (the recompiles that name a cause are made for it alone)
            try:
                with compiled_for(topology):
                    _judge(
                        case,
                        topology,
                        records,
                        compiler=compiler,
                        check=check,
                        record=record,
                        why=not failures,
                    )
            except ConformanceFailure as failure:
                failures.append(failure)
        if failures:
            raise failures[0]
    return records


def ring_topologies(
    case: Case, compiler: Any, topologies: Mapping[int, tuple[str, ...]], *, what: str
) -> tuple[str, ...]:
    """The topologies of ``topologies`` for the case's ring length: a host limit where ``compiler``
    is not available here, not judged for a mesh that is no 1-D ring of one of those lengths."""
    reason = compiler.unavailable_reason()
    if reason is not None:
        raise compat.HostLimit(f"{what} is read from the real {compiler.NAME} compiler: {reason}")
    found = topologies.get(case.mesh.num_devices)
    if not found or len(case.mesh.shape) != 1:
        raise NotJudged(f"{what} is compiled for 1-D rings of {sorted(topologies)} {compiler.DEVICE}s")
    return found


#: The compile modes a compiler (by ``NAME``) has for its own collective matmul of a family besides
#: its default, each compiled for the compiler's own baseline where the compiler knows the option
#: (libtpu 0.0.17 does not): XLA:TPU's post-SPMD all-gather collective matmul, which libtpu says
#: replaces its "collective matmul V1" (it leaves a matmul + reduce-scatter as it was); XLA:GPU's
#: windowed einsum, off by default (deviceless, jaxlib 0.10.2 forms no loop with it; 0.12 forms one
#: for the all-gather and its verifier refuses the reduce-scatter's: the refusal is recorded).
COMPILER_MODES: dict[tuple[str, str], dict[str, dict[str, object]]] = {
    ("TPU", "allgather_matmul"): {"post_spmd": {"xla_tpu_all_gather_collective_matmul_mode": "post_spmd"}},
    **{
        ("GPU", family): {
            "windowed_einsum": {
                "xla_gpu_threshold_for_windowed_einsum_mib": 0,
                "xla_gpu_multi_streamed_windowed_einsum": True,
            }
        }
        for family in ("allgather_matmul", "matmul_reduce_scatter")
    },
}


def standing_of(exposed: int, compiler_exposed: int | None) -> str:
    """Where a kernel whose schedule leaves ``exposed`` bytes exposed stands beside the compiler's own
    collective matmul (``compiler_exposed``): ``ahead``, ``level``, ``behind``, or ``""``."""
    if compiler_exposed is None:
        return ""
    return "ahead" if exposed < compiler_exposed else "level" if exposed == compiler_exposed else "behind"


def compilers_own_case(case: Case) -> Case | None:
    """The case of the family's own op left to the compiler (:func:`conformance.registry.compilers_own`)
    at ``case``'s mesh, sizes and dtype; ``None`` where the family has none or it does not take the
    case's form (a batched kernel's dims)."""
    own = registry.compilers_own(case.family)
    if own is None or own.name == case.impl:
        return None
    if set(dict(case.dims)) != set(registry.spec_of(case.family, own.name).dims):
        return None
    return Case.make(case.family, own.name, case.mesh, dict(case.dims), case.dtype)


def _compiler_exposed(case: Case, topology: str) -> tuple[int | None, str]:
    """The compiler's own collective matmul at ``case``'s topology and size, in its best mode (its
    default under the run's flags, or one of :data:`COMPILER_MODES` that compiles): its exposed
    bytes and its run order, naming the mode; ``(None, "")`` where there is none to compare with."""
    own = compilers_own_case(case)
    if own is None:
        return None, ""
    modes = {"": (), **{m: tuple(sorted(o.items())) for m, o in _modes(case, topology).items()}}
    best: tuple[int, str] | None = None
    for mode, options in modes.items():
        try:
            _, scheduled = schedule_of(compiled_on_topology(own, topology, options=options), topology)
        except (tpu_compiler.CompilerRefusal, compat.HostLimit, hlo.HloParseError):
            continue  # a mode this compiler does not know or refuses at this size
        found = (scheduled.exposed_bytes, scheduled.order_text() + (f" (in its {mode} mode)" if mode else ""))
        if best is None or found[0] < best[0]:
            best = found
    return best if best is not None else (None, "")


def _modes(case: Case, topology: str) -> dict[str, dict[str, object]]:
    return COMPILER_MODES.get((compiler_of(topology).NAME, case.family), {})


def _judge(
    case: Case,
    topology: str,
    records: list[Any],
    *,
    compiler: Any,
    check: str,
    record: type,
    why: bool = True,
) -> None:
    impl = case.implementation
    judge = compiler.judge(topology)
    compiled = compiled_or_fail(case, topology, check)
    module, scheduled = schedule_of(compiled, topology)
    compiler_exposed, compiler_order = (None, "") if impl.baseline else _compiler_exposed(case, topology)
    standing = standing_of(scheduled.exposed_bytes, compiler_exposed)
    hidden = passes_rule(scheduled)
    fails = not impl.baseline and bool(scheduled.transfers) and _fails(case, hidden=hidden, standing=standing)
    records.append(
        record(
            case.family,
            case.impl,
            topology,
            case.mesh.axis_size,
            case.dims,
            _hop_bytes(module),
            scheduled.hidden,
            scheduled.total,
            scheduled.order_text(),
            impl.baseline,
            judge,
            exposed_bytes=scheduled.exposed_bytes,
            compilers_own=impl.compilers_own,
            compiler_exposed=compiler_exposed,
            standing=standing,
            flags=getattr(compiled, "flags", "compiler defaults"),
            failed=fails,
            argument=_argument_bytes(case),
        )
    )
    if impl.compilers_own:
        _record_modes(case, topology, records, compiler=compiler, record=record)
    if impl.baseline:
        return
    if not scheduled.transfers:
        raise NotJudged(
            PALLAS_OVERLAP
            if impl.pallas
            else f"the module compiled for {topology} has no collective: no transfer"
        )
    if not fails:
        return
    flags = getattr(compiled, "flags", "compiler defaults")
    compared = (
        [
            f"compiler's own : {compiler_order} ({size_text(compiler_exposed)} exposed; this kernel "
            f"{size_text(scheduled.exposed_bytes)})"
        ]
        if compiler_exposed is not None
        else []
    )
    if hidden:  # behind the compiler's own, where the kernel or the run says that fails
        raise fail(
            case,
            check,
            "its transfers leave more bytes exposed than the compiler's own collective matmul",
            [
                f"topology       : {topology}",
                f"exposed        : {size_text(scheduled.exposed_bytes)} per call received in transfers "
                f"with no matmul inside them; the compiler's own (jit of the family's math): "
                f"{size_text(compiler_exposed or 0)}",
                f"run order      : {scheduled.order_text()}",
                f"compiler's own : {compiler_order}",
                f"rule           : {_behind_rule(case)}",
                f"judge          : {judge}, under {flags}",
            ],
        )
    shown = [t for t in scheduled.transfers if not t.hidden][:6]
    raise fail(
        case,
        check,
        f"in the real {compiler.NAME} schedule its transfers do not run beside matmuls",  # any topology
        [
            f"topology       : {topology}",
            f"hidden         : {scheduled.fraction} transfers have a matmul scheduled inside them",
            f"threshold      : every transfer but one per ring direction ({scheduled.rings} here), and at "
            "least one",
            f"run order      : {scheduled.order_text()}  (S/D a transfer's start/done, C a synchronous "
            "collective, M a matmul)",
            *compared,
            f"verdict        : {_verdict_line(standing, scheduled, compiler_exposed)}",
            *(
                [
                    f"ran ahead      : {scheduled.run_ahead} transfers done before the first matmul runs: "
                    "each waits only for the one before it, so the scheduler ran them first, as a chain"
                ]
                if scheduled.run_ahead > scheduled.rings
                else []
            ),
            f"judge          : {judge}, the scheduled module of jit(...).lower(...).compile(), under {flags}",
            *(why_exposed(case, topology, compiler=compiler) if why else []),
            *(how_to_hide(case, topology, scheduled) if why else [f"how            : {case.spec.overlap}"]),
            "exposed transfers:",
            *(
                f"  {t.kind} {t.name} in {t.computation}" + (f" (x{t.times})" if t.times != 1 else "")
                for t in shown
            ),
        ],
    )


def _argument_bytes(case: Case) -> int:
    """The bytes of ``case``'s operands one device holds (every operand sharded over the ring)."""
    itemsize = np.dtype(dtypes.operand_np(case.dtype)).itemsize
    return sum(math.prod(shape) for shape in case.operand_shapes) * itemsize // case.mesh.num_devices


def _fails(case: Case, *, hidden: bool, standing: str) -> bool:
    """The schedule verdict (docs/checks.md, "What a schedule verdict is"). A kernel that hides its
    transfers (:func:`passes_rule`) fails only behind the compiler's own where that fails
    (:func:`behind_fails`). One that leaves them exposed fails where it is also behind the compiler's
    own, or where there is none to compare with: level with it or ahead, it is no worse than not
    writing the kernel, and passes, its table cell saying so; ``--schedule-verdict=hidden`` fails it
    there too."""
    if hidden:
        return standing == "behind" and behind_fails(case)
    if session_lib.current().settings.schedule_verdict == "hidden":
        return True
    return standing not in ("ahead", "level")


def _verdict_line(standing: str, scheduled: hlo.Schedule, compiler_exposed: int | None) -> str:
    if session_lib.current().settings.schedule_verdict == "hidden":
        return (
            "--schedule-verdict=hidden: every transfer it could hide must be hidden, whatever the compiler's "
            "own does"
        )
    if standing == "behind":
        return (
            f"behind the compiler's own: {size_text(scheduled.exposed_bytes)} exposed where jit of the "
            f"family's math leaves {size_text(compiler_exposed or 0)}, so not writing this kernel would wait "
            "less here (level or ahead would pass)"
        )
    return (
        "the compiler's own collective matmul does not compile at this form and size, so nothing says that "
        "not writing this kernel would wait less: the rule alone judges"
    )


def behind_fails(case: Case) -> bool:
    """Whether being behind the compiler's own collective matmul fails ``case``: its kernel declares
    it is not (``ahead_of_compiler=True``), or the run says so (``--behind-compiler=fail``)."""
    return case.implementation.ahead_of_compiler or session_lib.current().settings.behind_compiler == "fail"


def _behind_rule(case: Case) -> str:
    if case.implementation.ahead_of_compiler:
        return f"{case.impl} is registered ahead_of_compiler=True: it may leave no more bytes exposed"
    return "--behind-compiler=fail: a kernel may leave no more bytes exposed than the compiler's own"


def _record_modes(case: Case, topology: str, records: list[Any], *, compiler: Any, record: type) -> None:
    """The compiler's own collective matmul under each of :data:`COMPILER_MODES` its compiler knows,
    one more record each (``impl[mode]``); a mode the compiler refuses is left out."""
    for mode, options in _modes(case, topology).items():
        try:
            compiled = compiled_on_topology(case, topology, options=tuple(sorted(options.items())))
            module, scheduled = schedule_of(compiled, topology)
        except tpu_compiler.CompilerRefusal as refusal:
            if "No such compile option" in str(refusal):
                continue  # this compiler has no such mode
            flags = target_compiles.flags_in_effect(compiler.compile_options(options))
            found = (0, 0, 0, f"refused: {' '.join(str(refusal).split())[:200]}", 0, flags)
        else:
            flags = getattr(compiled, "flags", "compiler defaults")
            found = (_hop_bytes(module), scheduled.hidden, scheduled.total, scheduled.order_text(),
                     scheduled.exposed_bytes, flags)  # fmt: skip
        hop, hidden, total, order, exposed, flags = found
        records.append(
            record(
                case.family,
                f"{case.impl}[{mode}]",
                topology,
                case.mesh.axis_size,
                case.dims,
                hop,
                hidden,
                total,
                order,
                True,
                compiler.judge(topology),
                exposed_bytes=exposed,
                compilers_own=True,
                flags=flags,
            )
        )


def tpu_schedule_table(records: list[Any]) -> list[tuple[str, list[str]]]:
    """Per implementation and topology: transfers hidden / all in the real TPU schedule, per size."""
    return target_tables.schedule_table(records, "TPU")


CHECKS = (
    Check(
        "tpu_schedule",
        check_tpu_schedule,
        concern="performance",
        tables=tpu_schedule_table,
        compile_tier="tpu_compile",
    ),
)
