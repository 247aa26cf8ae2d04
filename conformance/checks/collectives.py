"""The collectives in the compiled module and in the modules lowered for each target, and the bytes
each device receives against the family's bound."""

from __future__ import annotations

import contextlib
import dataclasses
from collections import defaultdict
from collections.abc import Iterable, Sequence
from typing import Any

import jax.numpy as jnp

from conformance import compat, hlo, runner
from conformance.checks import on_topology
from conformance.checks.base import (
    Axes,
    Check,
    NotJudged,
    call_kernel,
    check_byte_bound,
    compiled_for,
    fail,
    keeping,
    lower_or_note_limit,
    records_of,
)
from conformance.checks.ragged_bytes import as_the_op_moves_them
from conformance.runner import Case
from conformance.targets import gpu_compiler, mosaic, tpu_compiler

#: The TPU bytes' mesh: the longest ring's 8 chips as one v5e slice.
TPU_BYTES_MESHES = ("8-x-explicit",)


@dataclasses.dataclass(frozen=True)
class ByteRecord:
    """Bytes one device receives per call, against the family's lower bound."""

    family: str
    impl: str
    mesh: str
    dtype: str
    received: int | None
    lower_bound: int
    collectives: tuple[str, ...]

    @classmethod
    def of(
        cls,
        case: Case,
        summary: hlo.CollectiveSummary,
        bound: int,
        *,
        where: str | None = None,
        received: int | str | None = "of the summary",
    ) -> ByteRecord:
        """The record of ``summary``, one module of ``case`` (``where``: its mesh, or what else
        names the module), against ``bound``; ``received`` where it is not the summary's own count
        (XLA's ragged all-to-all counted as it moves:
        :func:`~conformance.checks.ragged_bytes.as_the_op_moves_them`)."""
        ops = tuple(op.describe() for op in summary.ops)
        mesh = where or case.mesh.label
        got = summary.received_bytes_per_device() if received == "of the summary" else received
        return cls(case.family, case.impl, mesh, case.dtype, got, bound, ops)  # type: ignore[arg-type]

    @property
    def ratio(self) -> float | None:
        if self.received is None or not self.lower_bound:
            return None
        return self.received / self.lower_bound


def _kind_and_dtypes(op: hlo.CollectiveOp) -> str:
    return f"{op.kind} of {'/'.join(sorted({s.dtype for s in op.operand_shapes})) or '?'}"


def why_these_collectives(case: Case) -> list[str]:
    """The failure's line saying why the family allows what it does (none where its spec says nothing)."""
    said = case.spec.collectives_text
    return [f"why            : {said}"] if said else []


def allowed_collectives(case: Case) -> frozenset[str]:
    """The family's collectives, for every kernel: a Pallas kernel that moves data by DMA shows none,
    and one that rings ``ppermute`` around its ``pallas_call`` matmuls uses the family's own."""
    return case.spec.allowed_collectives


def compiled_collectives(case: Case) -> hlo.CollectiveSummary:
    text = call_kernel(case, "collectives", lambda: runner.compiled(case).as_text())
    return hlo.parse_hlo(text)


def check_collectives(case: Case) -> ByteRecord | None:
    """Compiled HLO uses only the family's collectives and stays within its byte bound.

    The baseline (XLA's own op) is exempt from both rules; its bytes are still
    recorded so the report can compare. A Pallas kernel is held to the same rule: one that
    moves data by DMAs inside the kernel shows no collective (and no bytes: HLO cannot see
    them), one that rings collectives around its kernels is audited as any kernel.
    """
    spec, impl = case.spec, case.implementation
    summary = compiled_collectives(case)
    n, itemsize = case.mesh.axis_size, runner.np_dtype(case.dtype).itemsize
    maximum = spec.max_received_bytes(case.dims_map, n, itemsize)
    received, counted = as_the_op_moves_them(
        case, summary, backward=False, check="collectives", bound=maximum
    )
    minimum = spec.min_received_bytes(case.dims_map, n, itemsize)
    record = ByteRecord.of(case, summary, minimum, received=received)
    kept = None if impl.pallas and not summary.ops else record  # a DMA-only kernel's bytes are invisible
    if impl.baseline:
        return kept
    ops = summary.byte_lines(summed=not counted)
    allowed = allowed_collectives(case)
    bad = hlo.disallowed(summary, allowed)
    with keeping(records_of(kept)):
        _judge(case, summary, ops + counted, allowed, bad, received)
    return kept


def _judge(
    case: Case,
    summary: hlo.CollectiveSummary,
    ops: list[str],
    allowed: frozenset[str],
    bad,
    received: int | None,
) -> None:
    spec, impl = case.spec, case.implementation
    n, itemsize = case.mesh.axis_size, runner.np_dtype(case.dtype).itemsize
    if bad:
        allowed_text = hlo.allowed_text(allowed)
        raise fail(
            case,
            "collectives",
            "compiled HLO uses collectives the family forbids",
            [
                f"allowed        : {allowed_text}",
                f"forbidden      : {', '.join(sorted({_kind_and_dtypes(op) for op in bad}))}",
                *why_these_collectives(case),
                "collectives in the compiled module:",
                *ops,
            ],
        )
    if impl.pallas and not summary.ops:
        return  # its transfers are DMAs inside the kernel: HLO shows no bytes to bound
    bound = spec.max_received_bytes(case.dims_map, n, itemsize)
    check_byte_bound(
        case,
        "collectives",
        "a device receives more than the family allows",
        received,
        bound,
        spec.byte_bound_text,
        ops,
    )


def check_lowered_bytes(case: Case) -> list[ByteRecord]:
    """The traffic of operands narrower than 32 bits (16-bit, float8, int8; plain or in a mixed-precision
    pair), forward and (at the gradient dtypes) backward, in the modules lowered for the
    implementation's targets (no target's compiler runs: the module the real TPU compiler compiles is
    :func:`check_tpu_bytes`'s, XLA:GPU's is ``gpu_bytes``'s, each in its compile tier).

    XLA CPU converts bfloat16 and float16 to float32 before every transfer, so the compiled
    module can audit float32 only; a module lowered for TPU or CUDA keeps the real types. The
    bounds are the spec's at the operands' itemsize (with float32 partials where the spec says
    partials travel as float32). The baseline is recorded, not bounded.
    """
    spec, impl = case.spec, case.implementation
    passes = [
        (
            "forward",
            lambda t: runner.lowered_for(case, t),
            lambda: runner.compiled(case),
            spec.max_received_bytes,
            spec.byte_bound_text,
        )
    ]
    backward = impl.differentiable and case.dtype in spec.gradient_dtypes
    if backward and spec.backward_max_received_bytes is not None:
        passes.append(
            (
                "backward",
                lambda t: runner.lowered_pullback_for(case, t),
                lambda: runner.compiled_pullback(case),
                spec.backward_max_received_bytes,
                spec.backward_byte_bound_text,
            )
        )
    traced_as_every_target_gets_it(case, "lowered_bytes")
    records, host_limited = [], []
    with keeping(records):
        _lower_each(case, passes, records, host_limited)
        if host_limited:  # what did lower was within bounds; the rest this host could not try
            raise compat.HostCannotLower("; ".join(host_limited))
    return records


def wider_transfers(case: Case, summaries: Iterable[hlo.CollectiveSummary], *, backward: bool) -> list[str]:
    """A line where ``summaries`` (modules in the program's own dtypes: lowered, or compiled for a TPU or
    GPU; XLA:CPU's compiled module may widen 16-bit transfers itself) move floats wider than the run's
    dtype, saying where such bytes come from; ``[]`` where none do."""
    bits = 8 * runner.np_dtype(case.dtype).itemsize
    wider = sorted(
        {
            shape.dtype
            for summary in summaries
            for op in summary.ops
            for shape in op.operand_shapes
            if shape.dtype.startswith(("f", "bf")) and shape.bits > bits
        }
    )
    if not wider or not jnp.issubdtype(runner.np_dtype(case.dtype), jnp.floating):
        return []
    moved = "/".join(wider)
    operand = runner.np_dtype(case.dtype).name  # a mixed pair's operands (float8_e4m3fn of float8_..._to_...)
    if backward:
        return [
            f"wider dtype    : the backward moves {moved} in a {case.dtype} run: the transpose of a forward "
            "that widens to float32 before its ring (float32 accumulators) carries the cotangent in "
            f"float32, twice the bytes; a custom_vjp can move the cotangent in {operand} and widen it "
            "where it adds"
        ]
    return [
        f"wider dtype    : the forward moves {moved} in a {case.dtype} run: values cross the ring in the "
        f"accumulators' dtype where the family's bound counts {operand}; move the {operand} operands, or "
        f"round to {operand} before a transfer the bound counts in it"
    ]


def _lower_each(case: Case, passes: list, records: list[ByteRecord], host_limited: list[str]) -> None:
    impl, itemsize, n = case.implementation, runner.np_dtype(case.dtype).itemsize, case.mesh.axis_size
    for target in impl.lowering_targets:
        for name, lower, compile_on_host, bound_of, bound_text in passes:
            lowered = lower_or_note_limit(
                case, "lowered_bytes", f"the {name} pass", lower, target, host_limited
            )
            if lowered is None:
                continue
            summary, removed = hlo.parse_stablehlo(lowered.as_text()), []
            # at the TPU-native dims where a Pallas kernel refuses the case's shape on a TPU
            bound = bound_of(runner.lowered_case(case, target).dims_map, n, itemsize)
            over = (summary.received_bytes_per_device() or 0) > bound
            # what XLA's passes for every target remove (a one-trip loop's dead transfer), as the host's
            # compile of the same program shows; only where the lowered text is over its bound
            if over and not impl.pallas:
                host = call_kernel(case, "lowered_bytes", lambda c=compile_on_host: c().as_text())
                summary, removed = hlo.less_what_compiling_removes(summary, hlo.parse_hlo(host))
            received, counted = as_the_op_moves_them(
                runner.lowered_case(case, target),
                summary,
                backward=name == "backward",
                check="lowered_bytes",
                bound=bound,
            )
            where = f"{case.mesh.label} {target} {name}"
            records.append(ByteRecord.of(case, summary, bound, where=where, received=received))
            if not impl.baseline:
                check_byte_bound(
                    case,
                    "lowered_bytes",
                    f"the {name} pass lowered for {target} moves more {case.dtype} bytes than its math needs",
                    received,
                    bound,
                    bound_text,
                    summary.byte_lines(summed=not counted)
                    + counted
                    + wider_transfers(case, [summary], backward=name == "backward")
                    + (
                        ["  not counted, as the host's compile of the same program removes them:", *removed]
                        if removed
                        else []
                    ),
                    module=f"module lowered for {target}: read from lowered text, {_compiled_is(target)}",
                )


def check_tpu_bytes(case: Case) -> list[ByteRecord]:
    """The forward and (at the gradient dtypes) backward passes of a 16- or 8-bit case compiled by the
    real TPU compiler for the slice of the case's chip count (``tpu_compiler.topology_for``): only the
    family's collectives, and at most the family's bound of bytes per device, read from the module
    XLA:TPU runs (what its passes moved or removed counted as they left it). A host without libtpu
    skips, naming the install command; :func:`check_lowered_bytes` reads the lowered text there."""
    reason = tpu_compiler.unavailable_reason()
    if reason is not None:
        raise compat.HostLimit(f"the TPU module's bytes are judged by the real TPU compiler: {reason}")
    impl, spec = case.implementation, case.spec
    if "tpu" not in impl.lowering_targets:
        raise NotJudged(
            f"{impl.name} is not registered for TPU (lowering_targets: {', '.join(impl.lowering_targets)})"
        )
    passes = ["forward"]
    if impl.differentiable and case.dtype in spec.gradient_dtypes and spec.backward_max_received_bytes:
        passes.append("backward")
    records: list[ByteRecord] = []
    with keeping(records):
        topology = tpu_compiler.topology_for(case.mesh.num_devices)
        compiled_module_bytes(case, passes, records, topology=topology, check="tpu_bytes")
    return records


def _compiled_is(target: str) -> str:
    """Where the target's compiled module is judged, or that no compiler for it is here."""
    tier = {"tpu": ("tpu_bytes", tpu_compiler), "cuda": ("gpu_bytes", gpu_compiler)}.get(target)
    if tier is None or not tier[1].available():
        return f"no {target} compiler here"
    return f"the module its compiler compiles is {tier[0]}'s (its compile tier)"


def compiled_module_bytes(
    case: Case, pass_names: Sequence[str], records: list[ByteRecord], *, topology: str, check: str
) -> None:
    """The forward (and backward) pass compiled by the real compiler of ``topology`` (libtpu's for a
    TPU slice, XLA:GPU's for GPUs: :func:`~conformance.checks.on_topology.compiler_of`): its
    collectives the family allows, its bytes within the bound, read from the module the target
    really runs (loops counted per trip, what a compiler removed gone)."""
    with compiled_for(topology):
        _compiled_module_bytes(case, pass_names, records, topology=topology, check=check)


def _compiled_module_bytes(
    case: Case, pass_names: Sequence[str], records: list[ByteRecord], *, topology: str, check: str
) -> None:
    spec, impl = case.spec, case.implementation
    itemsize, n = runner.np_dtype(case.dtype).itemsize, case.mesh.axis_size
    compiler = on_topology.compiler_of(topology)
    for name in pass_names:
        backward = name == "backward"
        compile_it = (
            on_topology.compiled_pullback_on_topology if backward else on_topology.compiled_on_topology
        )

        def compiled(compile_it=compile_it, name=name) -> Any:
            try:
                return compile_it(case, topology)
            except compiler.CompilerRefusal as refusal:
                what = f"the {compiler.NAME} compiler refuses its {name} pass ({topology})"
                raise fail(case, check, what, [f"compiler       : {refusal}"]) from refusal

        module = call_kernel(case, check, compiled)
        summary = hlo.parse_hlo(on_topology.module_text(module, topology))
        bound_of = spec.backward_max_received_bytes if backward else spec.max_received_bytes
        bound = bound_of(case.dims_map, n, itemsize)
        flags = getattr(module, "flags", "compiler defaults")
        under = "" if flags == "compiler defaults" else f"; {flags}"
        where = f"{case.mesh.label} {compiler.NAME.lower()} {name} compiled ({topology}{under})"
        received, counted = as_the_op_moves_them(case, summary, backward=backward, check=check, bound=bound)
        records.append(ByteRecord.of(case, summary, bound, where=where, received=received))
        if impl.baseline:
            continue
        ops = summary.byte_lines(summed=not counted)
        allowed = spec.backward_allowed_collectives if backward else allowed_collectives(case)
        bad = hlo.disallowed(summary, allowed)
        if bad:
            raise fail(
                case,
                check,
                f"the {name} pass compiled for {compiler.NAME} ({topology}) uses collectives the family "
                "forbids",
                [
                    f"allowed        : {hlo.allowed_text(allowed)}",
                    *why_these_collectives(case),
                    "collectives in the compiled module:",
                    *ops,
                ],
            )
        check_byte_bound(
            case,
            check,
            f"the {name} pass compiled for {compiler.NAME} ({topology}) moves more {case.dtype} bytes than "
            "its math needs",
            received,
            bound,
            spec.backward_byte_bound_text if backward else spec.byte_bound_text,
            ops + counted + wider_transfers(case, [summary], backward=backward),
            module=f"module the {compiler.NAME} compiler compiled for {topology}",
        )


def traced_as_every_target_gets_it(case: Case, check: str) -> None:
    """The kernel traced once, as every target's lowering gets it: what raises here is the kernel's own
    (one cause with the other checks' "raised ... on valid input"), not a target's lowering."""

    def trace() -> None:
        with contextlib.suppress(mosaic.TpuConstraintError):  # a shape a TPU refuses: the lowering's
            runner.traced_for_targets(case)

    call_kernel(case, check, trace)


def check_cross_lowering(case: Case, targets: Sequence[str] | None = None) -> None:
    """It lowers for each of its targets from the CPU host, using only allowed collectives there.

    Targets come from the registration: TPU and CUDA by default, TPU alone for a
    Pallas TPU kernel (lowered as the real kernel, not the interpreter).
    """
    impl = case.implementation

    traced_as_every_target_gets_it(case, "cross_lowering")
    problems, host_limited = [], []
    for target in targets or impl.lowering_targets:
        try:
            text = runner.lowered_for(case, target).as_text()
        except compat.HostCannotLower as limit:
            host_limited.append(f"{target}: {limit}")
            continue
        except Exception as e:
            problems.append(f"{target}: lowering raised {type(e).__name__}: {str(e)[:1500]}")
            continue
        bad = () if impl.baseline else hlo.disallowed(hlo.parse_stablehlo(text), allowed_collectives(case))
        if bad:
            problems.append(
                f"{target}: lowered module uses forbidden collectives: "
                + "; ".join(op.describe() for op in bad)
            )
    if problems:
        what = "does not lower cleanly for every target"
        raise fail(case, "cross_lowering", what, problems + why_these_collectives(case) + host_limited)
    if host_limited:  # what did lower was clean; the rest this host could not try
        raise compat.HostCannotLower("; ".join(host_limited))


def byte_table(title: str, records: list[Any]) -> list[tuple[str, list[str]]]:
    """Per implementation: received bytes / bound over the modules recorded, and the collectives used."""
    if not records:
        return []
    by_impl: dict[tuple[str, str], list] = defaultdict(list)
    for rec in records:
        by_impl[(rec.family, rec.impl)].append(rec)
    width = max(len(impl) for _, impl in by_impl)
    lines = []
    for (family, impl), recs in sorted(by_impl.items()):
        ratios = [r.ratio for r in recs if r.ratio is not None]
        unbounded = [r.mesh for r in recs if r.received is None]
        kinds = sorted({c.split("(")[0] for r in recs for c in r.collectives})
        span = f"{min(ratios):.2f}-{max(ratios):.2f}" if ratios else "n/a"
        if ratios and min(ratios) == max(ratios):
            span = f"{ratios[0]:.2f}"
        if not ratios and all(r.received == 0 for r in recs):
            span = "0 bytes"
        via = ", ".join(kinds) or "none"
        meshes_seen = len({r.mesh.split()[0] for r in recs})  # a lowered record's is "mesh target pass"
        where = f"{len(recs):>3} modules on {meshes_seen:>2} meshes"
        line = f"{family:<21} {impl:<{width}}  ratio {span:>9} in {where}  via {via}"
        if unbounded:
            line += f"  UNBOUNDED on {unbounded}"
        lines.append(line)
    return [(title, lines)]


CHECKS = (
    Check(
        "collectives",
        check_collectives,
        concern="program",
        tables=lambda records: byte_table(
            "forward: bytes received per device / lower bound (compiled HLO)", records
        ),
        # the collectives a kernel emits follow its code path, which turns on the ring's kind (one, odd,
        # even, several steps each way, an axis of a 2-D or 3-D mesh, a permuted order): a mesh of each
        # kind; the bytes grow with the ring, and the longest is among them. What turns on each length
        # (a position wrapped with a bit mask) is wrong values, the values check's on every mesh
        axes=Axes(meshes="covering", shapes=True),
    ),
    # the lowering follows the same code path: a mesh of each kind
    Check(
        "cross_lowering",
        check_cross_lowering,
        concern="program",
        axes=Axes(meshes="covering", shapes=True, claimed_for="targets"),
    ),
    Check(
        "lowered_bytes",
        check_lowered_bytes,
        concern="program",
        tables=lambda records: byte_table(
            "16- and 8-bit: bytes received per device / bound (modules lowered for each target)",
            records,
        ),
        # what a narrow pass moves turns on the dtype (a cast before a transfer) and grows with the hops:
        # the longest ring (fixtures.meshes.LONGEST_RING_MESHES); the float32 bytes and collective kinds
        # on a mesh of each kind are the collectives check's
        axes=Axes(meshes="longest_ring", dtypes="narrow_dtypes", claimed_for="targets"),
        doc="16- and 8-bit bytes per device, forward and backward, in the modules lowered for targets.",
    ),
    Check(
        "tpu_bytes",
        check_tpu_bytes,
        concern="program",
        tables=lambda records: byte_table(
            "TPU: 16- and 8-bit bytes received per device / bound, in the modules libtpu compiled", records
        ),
        # lowered_bytes's cases, compiled: what XLA:TPU moves past a transfer (a convert) or removes
        # turns on the dtype and the hops, on the slice of the longest ring's 8 chips
        axes=Axes(
            platforms=False,
            meshes=TPU_BYTES_MESHES,
            dtypes="narrow_dtypes",
            implementations=("not_pallas",),
            claimed_for="tpu",
        ),
        compile_tier="tpu_compile",
        doc="16- and 8-bit bytes per device, forward and backward, in the module libtpu compiles (8 chips).",
    ),
)
