"""The checks, as plain functions of a :class:`~conformance.runner.Case`.

Each check raises :class:`ConformanceFailure` (an ``AssertionError``) whose
message names the implementation, family, mesh, dtype and shapes, pinpoints the
first wrong shard or index, and ends with a one-line replay command. pytest
tests, the ``python -m conformance replay`` command and downstream code all call
these same functions.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import re
import sysconfig
import traceback
from collections.abc import Callable, Sequence

import jax
import jaxlib
import numpy as np

import conformance
from conformance import compat, fixtures, hlo, mosaic, pallas_protocol, runner
from conformance.runner import Case


class ConformanceFailure(AssertionError):
    """A check found the implementation does not conform.

    ``case``, ``check`` and ``what`` (the one-line verdict) are set when :func:`fail` made it,
    so a report can group failures by cause; ``None`` otherwise.
    """

    case: Case | None = None
    check: str | None = None
    what: str | None = None


class NotJudged(Exception):
    """The check has nothing it can judge in this implementation (a skip naming why, never a pass)."""


def fail(case: Case, check: str, what: str, details: Sequence[str] = ()) -> ConformanceFailure:
    lines = [f"[{check}] {case.family}/{case.impl}: {what}", *("  " + h for h in case.describe())]
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


def _slice_text(index: tuple[slice, ...], shape: tuple[int, ...]) -> str:
    parts = []
    for s, dim in zip(index, shape, strict=True):
        start, stop, _ = s.indices(dim)
        parts.append(f"{start}:{stop}")
    return "[" + ", ".join(parts) + "]"


def error_text(error: BaseException, head: int = 4, tail: int = 16) -> str:
    """An exception's message, long tracebacks cut to their first and last lines (the cause)."""
    lines = [line for line in str(error).splitlines() if line.strip()]
    if len(lines) > head + tail:
        lines = [*lines[:head], f"... ({len(lines) - head - tail} lines omitted) ...", *lines[-tail:]]
    return f"{type(error).__name__}: " + "\n    ".join(lines)


def _roots(*modules: object) -> tuple[str, ...]:
    return tuple(os.path.dirname(os.path.abspath(m.__file__)) + os.sep for m in modules)


#: Where a frame's file lies decides whose code it is.
_LIBRARY_ROOTS = _roots(jax, jaxlib, np)
_SUITE_ROOTS = _roots(conformance, fixtures)
#: The suite's own test kernels (broken and other-style ones) are kernel code, not the suite's.
_KERNEL_ROOTS_IN_SUITE = (os.path.join(_SUITE_ROOTS[0], "selftest") + os.sep,)
#: Python's own library (not the site-packages inside it, where a user's kernels may be installed).
_STDLIB_ROOT = sysconfig.get_paths()["stdlib"] + os.sep
_SITE_ROOTS = tuple({sysconfig.get_paths()[k] + os.sep for k in ("purelib", "platlib")})


def _whose(filename: str) -> str:
    path = os.path.abspath(filename)
    if path.startswith(_LIBRARY_ROOTS):
        return "library"
    if path.startswith(_SUITE_ROOTS) and not path.startswith(_KERNEL_ROOTS_IN_SUITE):
        return "suite"
    if path.startswith(_STDLIB_ROOT) and not path.startswith(_SITE_ROOTS):
        return "suite"  # threading, functools, ...: neither the kernel's code nor the raiser's
    return "kernel"


def error_locations(error: BaseException) -> list[str]:
    """Where ``error`` was raised: the innermost frame of the kernel's own code and, if a library
    (JAX, jaxlib, numpy) raised it, the innermost frame of that library."""
    frames = traceback.extract_tb(error.__traceback__)
    lines = []
    kernel = [f for f in frames if _whose(f.filename) == "kernel"]
    if frames and _whose(frames[-1].filename) == "library":
        raiser = frames[-1]
        lines.append(f"raised in      : {_frame_text(raiser)} (inside {raiser.filename.split(os.sep)[-1]!r}, "
                     "a library the kernel called)")  # fmt: skip
    if kernel:
        lines.append(f"kernel's code  : {_frame_text(kernel[-1])}")
    else:  # raised while JAX ran the traced kernel (e.g. Pallas interpret mode): the op's own line
        interpreted = compat.interpreted_op_source(error)
        if interpreted:
            lines.append(f"kernel's code  : {interpreted} (the traced op being run when it raised)")
    return lines


def stuck_locations(stacks: Sequence[traceback.StackSummary]) -> tuple[bool, list[str]]:
    """Where hung threads are: each one's innermost frame of kernel code, else of JAX (threads in
    neither, e.g. idle timers, are left out); identical places are counted, not repeated.

    Returns whether any thread is stuck in the kernel's own code, and the lines.
    """
    places: dict[str, int] = {}
    in_kernel = False
    for stack in stacks:
        kernel = [f for f in stack if _whose(f.filename) == "kernel"]
        library = [f for f in stack if _whose(f.filename) == "library"]
        if kernel:
            in_kernel = True
            place = f"kernel's code  : {_frame_text(kernel[-1])}"
        elif library:
            place = f"inside JAX     : {_frame_text(library[-1])}"
        else:
            continue
        places[place] = places.get(place, 0) + 1
    return in_kernel, [f"{p}  ({n} thread{'s' * (n > 1)})" for p, n in places.items()]


#: faulthandler's dump of one thread: a header, then its frames, innermost first.
_DUMP_HEADER = re.compile(r"^(?:Current thread|Thread) 0x[0-9a-fA-F]+.*\(most recent call first\):$")
_DUMP_FRAME = re.compile(r'^  File "(?P<file>.*)", line (?P<line>\d+|\?\?\?) in (?P<name>.+)$')
_DUMP_OTHER = ("  <no Python frame>", "  ...")


def stacks_from_dump(text: str) -> list[traceback.StackSummary]:
    """The threads' stacks in a ``faulthandler`` dump inside ``text`` (other lines around it are
    left alone), outermost frame first like :func:`traceback.extract_stack`.

    A line inside a thread's block that is not a frame raises, naming it: a dump in a form this
    parser does not know is never read as "no frames".
    """
    stacks: list[traceback.StackSummary] = []
    frames: list[traceback.FrameSummary] | None = None
    for line in text.splitlines():
        if _DUMP_HEADER.match(line.strip()):
            frames = []
            stacks.append(traceback.StackSummary())
            continue
        if frames is None:
            continue
        if not line.startswith("  "):  # the block ended
            stacks[-1] = traceback.StackSummary.from_list(frames[::-1])
            frames = None
            continue
        match = _DUMP_FRAME.match(line.rstrip())
        if match:
            lineno = int(match["line"]) if match["line"].isdigit() else None
            frames.append(traceback.FrameSummary(match["file"], lineno, match["name"]))
        elif line.rstrip() not in _DUMP_OTHER:
            raise ValueError(f"a faulthandler stack dump line in a form this suite does not know: {line!r}")
    if frames is not None:
        stacks[-1] = traceback.StackSummary.from_list(frames[::-1])
    return stacks


def _frame_text(frame: traceback.FrameSummary) -> str:
    path = os.path.abspath(frame.filename)
    # JAX's files as jax/..., the user's relative to where they run (a library's parent, the cwd itself)
    for root in (*(os.path.dirname(r.rstrip(os.sep)) + os.sep for r in _LIBRARY_ROOTS), os.getcwd() + os.sep):
        if path.startswith(root):
            path = path[len(root) :]
            break
    code = f": {frame.line.strip()}" if frame.line else ""
    return f"{path}:{frame.lineno} in {frame.name}{code}"


def _call(case: Case, check: str, thunk: Callable[[], object]) -> object:
    """Run the implementation; an exception on valid input is a conformance failure naming where."""
    try:
        with compat.unfiltered_tracebacks():
            return thunk()
    except ConformanceFailure:
        raise
    except Exception as e:  # the kernel's own error, re-raised with the case attached
        details = [*error_locations(e), error_text(e)]
        raise fail(case, check, f"raised {type(e).__name__} on valid input", details) from e


def _run(case: Case, check: str, *, cached: bool = True) -> tuple[tuple[np.ndarray, ...], jax.Array]:
    return _call(case, check, lambda: (runner.execute_cached if cached else runner.execute)(case))


def _compare_shards(
    case: Case,
    check: str,
    out: jax.Array,
    expected: np.ndarray,
    tol: np.ndarray,
    *,
    what: str = "out",
    subject: str | None = None,
) -> None:
    """Every addressable shard of ``what`` against its block of ``expected``; reports the first wrong one."""
    if tuple(out.shape) != tuple(expected.shape):
        raise fail(case, check, f"{what} shape {tuple(out.shape)} != expected {expected.shape}")
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
        f"block {_slice_text(shard.index, expected.shape)}",
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
    details.append(f"wrong shards: {len(wrong)} of {len(out.addressable_shards)} "
                   f"(devices {[s.device.id for s, _, _ in wrong]})")  # fmt: skip
    subject = subject or ("values differ" if what == "out" else f"gradient {what} differs")
    raise fail(case, check, f"{subject} from the numpy float64 reference", details)


def check_values(case: Case) -> None:
    """Every shard of the result equals the float64 reference within the dtype's tolerance."""
    inputs64, out = _run(case, "values", cached=False)
    spec = case.spec
    expected = spec.expected(inputs64, axis_size=case.mesh.axis_size)
    _compare_shards(case, "values", out, expected, spec.tolerance(*inputs64, case.dtype))
    _assert_dtype(case, "values", out)  # so the drawn dtypes meet every mesh, not only dtype's two


def check_output_sharding(case: Case) -> None:
    """The result's sharding is the spec's, and every device holds exactly its block.

    A ``with_sharding_constraint`` is not trusted (it is a no-op on Explicit
    meshes): the sharding is read off the result, and each addressable shard's
    index and data are compared with what the spec's sharding implies.
    """
    inputs64, out = _run(case, "output_sharding")
    expected_sharding = runner.expected_out_sharding(case)
    ndim = len(case.out_shape)
    if not out.sharding.is_equivalent_to(expected_sharding, ndim):
        got_spec = getattr(out.sharding, "spec", out.sharding)
        raise fail(case, "output_sharding", "output sharding differs from the spec", [
            f"expected       : {expected_sharding.spec}",
            f"got            : {got_spec}  ({type(out.sharding).__name__})",
        ])  # fmt: skip
    index_map = expected_sharding.devices_indices_map(tuple(case.out_shape))
    holders = {s.device for s in out.addressable_shards}
    mine = jax.process_index()  # in a multi-process job, each rank judges the devices it addresses
    missing = [d.id for d in index_map if d.process_index == mine and d not in holders]
    if missing:
        raise fail(case, "output_sharding", f"devices {missing} hold no shard of the output")
    for shard in out.addressable_shards:
        want = index_map[shard.device]
        if _slice_text(shard.index, case.out_shape) != _slice_text(want, case.out_shape):
            raise fail(case, "output_sharding", "a device holds the wrong block", [
                f"device {shard.device.id}: holds {_slice_text(shard.index, case.out_shape)}, "
                f"spec says {_slice_text(want, case.out_shape)}",
            ])  # fmt: skip
    spec = case.spec
    _compare_shards(case, "output_sharding", out, spec.expected(inputs64, axis_size=case.mesh.axis_size),
                    spec.tolerance(*inputs64, case.dtype))  # fmt: skip


def _assert_dtype(case: Case, check: str, out: jax.Array) -> None:
    want = runner.np_dtype(case.dtype)
    got = {np.dtype(out.dtype)} | {np.dtype(s.data.dtype) for s in out.addressable_shards}
    if got != {want}:
        raise fail(case, check, f"result dtype {sorted(map(str, got))} != input dtype {want}")


def check_dtype(case: Case) -> None:
    """The result (and every shard of it) has the inputs' dtype; and, since the kernel ran at this
    dtype, every shard's values against the float64 reference (the fixed shapes at every dtype on
    every mesh: the value check's drawn dtypes meet each mesh by chance, these by construction)."""
    inputs64, out = _run(case, "dtype")
    _assert_dtype(case, "dtype", out)
    spec = case.spec
    _compare_shards(
        case,
        "dtype",
        out,
        spec.expected(inputs64, axis_size=case.mesh.axis_size),
        spec.tolerance(*inputs64, case.dtype),
    )


def check_determinism(case: Case) -> None:
    """Two calls on the same inputs give bitwise-equal shards (the first may be the call the other
    fixed-shape checks of this case share)."""
    _, first = _run(case, "determinism")
    _, second = _run(case, "determinism", cached=False)
    a = {s.device.id: np.asarray(s.data) for s in first.addressable_shards}
    b = {s.device.id: np.asarray(s.data) for s in second.addressable_shards}
    for dev in sorted(a):
        if a[dev].tobytes() != b.get(dev, np.empty(0)).tobytes():
            diff = np.argwhere(a[dev].view(np.uint8).reshape(-1) != b[dev].view(np.uint8).reshape(-1))
            raise fail(case, "determinism", "two calls on the same inputs differ bitwise", [
                f"first differing shard: device {dev}, first differing byte {int(diff[0][0])}",
            ])  # fmt: skip


def check_eager(case: Case) -> None:
    """Called outside ``jax.jit``, as users call kernels too, on the inputs of the jitted run: the
    result's shape and dtype, and every shard against the float64 reference within the dtype's
    tolerance, as under jit (so bitwise for data movement, whose tolerance is zero). A kernel whose
    Python takes another path on concrete arrays (a host read of its global input to log a
    checksum: fine in one process, an error in a job where the input is not fully addressable; a
    shortcut for small inputs) is caught here.

    Not bitwise for arithmetic: outside jit a ``shard_map`` body runs op by op, and XLA fuses the
    jitted program, so a matmul split into partial sums may round differently in its last bit
    (measured on the bidirectional rings: 1 ulp on a few elements); JAX promises no more.
    """
    inputs64, jitted_out = _run(case, "eager")
    try:
        with compat.unfiltered_tracebacks():
            eager_out = runner.execute_eagerly(case)
            jax.block_until_ready(eager_out)
    except Exception as e:
        details = [*error_locations(e), error_text(e)]
        raise fail(case, "eager", f"raised {type(e).__name__} when called outside jax.jit (under jit it "
                   "returns)", details) from e  # fmt: skip
    if not isinstance(eager_out, jax.Array):
        raise fail(case, "eager", f"returned {type(eager_out).__name__} outside jax.jit, not a jax.Array")
    if tuple(eager_out.shape) != tuple(jitted_out.shape) or eager_out.dtype != jitted_out.dtype:
        raise fail(case, "eager", f"outside jax.jit the result is {eager_out.dtype}{list(eager_out.shape)}, "
                   f"under jit {jitted_out.dtype}{list(jitted_out.shape)}")  # fmt: skip
    spec = case.spec
    _compare_shards(case, "eager", eager_out, spec.expected(inputs64, axis_size=case.mesh.axis_size),
                    spec.tolerance(*inputs64, case.dtype),
                    subject="outside jax.jit the values differ")  # fmt: skip


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

    @property
    def ratio(self) -> float | None:
        if self.received is None or not self.lower_bound:
            return None
        return self.received / self.lower_bound


#: Filled by :func:`check_collectives`; the pytest plugin prints it as a table.
BYTE_RECORDS: list[ByteRecord] = []


def allowed_collectives(case: Case) -> frozenset[str]:
    """A Pallas kernel moves data by DMA inside the kernel: no collective may surround it."""
    return frozenset() if case.implementation.pallas else case.spec.allowed_collectives


def compiled_collectives(case: Case) -> hlo.CollectiveSummary:
    text = _call(case, "collectives", lambda: runner.compiled(case).as_text())
    return hlo.parse_hlo(text)


def check_collectives(case: Case) -> ByteRecord:
    """Compiled HLO uses only the family's collectives and stays within its byte bound.

    The baseline (XLA's own op) is exempt from both rules; its bytes are still
    recorded so the report can compare. A Pallas kernel's transfers are DMAs
    inside the kernel, invisible to HLO: what is audited is that its module holds
    no collective at all around the kernel call.
    """
    spec, impl = case.spec, case.implementation
    summary = compiled_collectives(case)
    n, itemsize = case.mesh.axis_size, runner.np_dtype(case.dtype).itemsize
    received = summary.received_bytes_per_device()
    record = ByteRecord(case.family, case.impl, case.mesh.label, case.dtype, received,
                        spec.min_received_bytes(case.dims_map, n, itemsize),
                        tuple(op.describe() for op in summary.ops))  # fmt: skip
    if not impl.pallas:
        BYTE_RECORDS.append(record)
    if impl.baseline:
        return record
    ops = [f"  {op.describe()}" for op in summary.ops] or ["  (none)"]
    allowed = allowed_collectives(case)
    bad = hlo.disallowed(summary, allowed)
    if bad:
        allowed_text = ", ".join(sorted(allowed)) or "none (a Pallas kernel moves data by DMA)"
        raise fail(case, "collectives", "compiled HLO uses collectives the family forbids", [
            f"allowed        : {allowed_text}",
            f"forbidden      : {', '.join(sorted({op.kind for op in bad}))}",
            "collectives in the compiled module:", *ops,
        ])  # fmt: skip
    if impl.pallas:
        return record
    bound = spec.max_received_bytes(case.dims_map, n, itemsize)
    _check_byte_bound(case, "collectives", "a device receives more than the family allows",
                      received, bound, spec.byte_bound_text, ops)  # fmt: skip
    return record


def _check_byte_bound(
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
    got = "unbounded (a collective runs in a loop of unknown trip count)" if received is None \
        else f"{received} bytes"  # fmt: skip
    raise fail(case, check, what, [
        f"bound          : {bound} bytes ({bound_text})",
        f"received       : {got} per device per call",
        f"collectives in the {module}:", *ops,
    ])  # fmt: skip


#: Filled by :func:`check_lowered_bytes`: 16-bit traffic in the modules lowered for each target.
LOWERED_BYTE_RECORDS: list[ByteRecord] = []


def check_lowered_bytes(case: Case) -> list[ByteRecord]:
    """16-bit traffic, forward and backward, in the modules lowered for the implementation's targets.

    XLA CPU converts bfloat16 and float16 to float32 before every transfer, so the compiled
    module can audit float32 only; a module lowered for TPU or CUDA keeps the real types. The
    bounds are the spec's at the dtype's itemsize (with float32 partials where the spec says
    partials travel as float32). The baseline is recorded, not bounded.
    """
    spec, impl = case.spec, case.implementation
    itemsize, n = runner.np_dtype(case.dtype).itemsize, case.mesh.axis_size
    passes = [
        ("forward", lambda t: runner.lowered_for(case, t), spec.max_received_bytes, spec.byte_bound_text)
    ]
    if impl.differentiable and spec.backward_max_received_bytes is not None:
        passes.append(("backward", lambda t: runner.lowered_pullback_for(case, t),
                       spec.backward_max_received_bytes, spec.backward_byte_bound_text))  # fmt: skip
    records, host_limited = [], []
    for target in impl.lowering_targets:
        for name, lower, bound_of, bound_text in passes:
            lowered = _lower_or_note_limit(case, "lowered_bytes", f"the {name} pass", lower, target,
                                           host_limited)  # fmt: skip
            if lowered is None:
                continue
            summary = hlo.parse_stablehlo(lowered.as_text())
            received, bound = summary.received_bytes_per_device(), bound_of(case.dims_map, n, itemsize)
            record = ByteRecord(case.family, case.impl, f"{case.mesh.label} {target} {name}", case.dtype,
                                received, bound, tuple(op.describe() for op in summary.ops))  # fmt: skip
            records.append(record)
            LOWERED_BYTE_RECORDS.append(record)
            if not impl.baseline:
                _check_byte_bound(case, "lowered_bytes",
                                  f"the {name} pass lowered for {target} moves more {case.dtype} bytes than "
                                  "its math needs", received, bound, bound_text,
                                  [f"  {op.describe()}" for op in summary.ops],
                                  module=f"module lowered for {target}")  # fmt: skip
    if host_limited:  # what did lower was within bounds; the rest this host could not try
        raise compat.HostCannotLower("; ".join(host_limited))
    return records


@dataclasses.dataclass(frozen=True)
class OverlapRecord:
    """Transfers of one module that can hide behind a matmul, out of all its transfers."""

    family: str
    impl: str
    mesh: str
    ring: int  #: devices on the kernel's axis
    module: str  #: "compiled cpu", "lowered tpu", ...
    fraction: str  #: hideable/all transfers per call (:attr:`conformance.hlo.OverlapSummary.fraction`)
    baseline: bool
    #: Scheduled module: asynchronous start/done pairs whose span holds a matmul, out of all pairs.
    scheduled: tuple[int, int] | None = None


#: Filled by :func:`check_overlap`; the pytest plugin prints it as a table.
OVERLAP_RECORDS: list[OverlapRecord] = []
#: Why a Pallas kernel's overlap is not judged (the skip's reason).
PALLAS_OVERLAP = (
    "a Pallas kernel moves data by DMAs inside the kernel, where HLO's dataflow cannot see them; its "
    "overlap is the kernel's own schedule (races and values check it runs)"
)


def _lower_or_note_limit(case: Case, check: str, what: str, lower, target: str, limited: list[str]):
    """``lower(target)``; what this host cannot lower is noted in ``limited`` (``None`` returned), and any
    other error is ``check``'s failure (cross_lowering fails it too)."""
    try:
        return lower(target)
    except compat.HostCannotLower as limit:
        limited.append(f"{target}: {limit}")
        return None
    except Exception as e:
        raise fail(case, check, f"{what} does not lower for {target}",
                   [*error_locations(e), error_text(e)]) from e  # fmt: skip


def _overlap_modules(case: Case) -> tuple[list[tuple[str, str]], list[str]]:
    """(module name, HLO text) of the compiled module and of those lowered for each target; and what
    this host could not lower."""
    modules = [(f"compiled {case.platform}", _call(case, "overlap", lambda: runner.compiled(case).as_text()))]
    limited = []
    for target in case.implementation.lowering_targets:
        lower = functools.partial(runner.lowered_for, case)
        lowered = _lower_or_note_limit(case, "overlap", "the forward pass", lower, target, limited)
        if lowered is None:
            continue
        modules.append((f"lowered {target}", lowered.as_text(dialect="hlo")))
    return modules, limited


def check_overlap(case: Case) -> list[OverlapRecord]:
    """Transfers a scheduler can hide behind compute, read from the dataflow of each module.

    For a family whose point is overlap (the spec's ``overlap``): in the compiled module and in the
    modules lowered for the implementation's targets, each transfer needs a matmul that neither feeds
    it nor reads what it delivers (:func:`conformance.hlo.overlap`). A kernel passes with at least
    one such transfer and at most one exposed transfer per ring direction (a design may ship its
    finished result in a last hop with nothing left to multiply); the built-in rings hide every
    transfer. The baseline is recorded, not judged.
    """
    spec, impl = case.spec, case.implementation
    if impl.pallas:
        raise NotJudged(PALLAS_OVERLAP)
    if not spec.overlap:
        raise NotJudged(f"family {case.family} has no compute to hide its transfers behind")
    modules, limited = _overlap_modules(case)
    records = []
    for module_name, text in modules:
        summary = hlo.overlap(hlo.parse_module(text))
        record = OverlapRecord(case.family, case.impl, case.mesh.label, case.mesh.axis_size, module_name,
                               summary.fraction, impl.baseline, summary.scheduled)  # fmt: skip
        records.append(record)
        OVERLAP_RECORDS.append(record)
        if impl.baseline:
            continue
        if not summary.transfers:
            raise NotJudged(f"the {module_name} module has no collective: no transfer to judge "
                            "(data moved by a custom call is invisible to HLO's dataflow)")  # fmt: skip
        # A transfer in a loop of unknown trip count (a module lowered, not compiled) counts as many.
        exposed = sum(math.inf if t.op.multiplicity is None else t.op.multiplicity for t in summary.exposed)
        if any(t.hideable for t in summary.transfers) and exposed <= summary.rings:
            continue
        shown = (summary.exposed + tuple(t for t in summary.transfers if t.hideable))[:8]
        rest = len(summary.transfers) > len(shown)
        raise fail(case, "overlap", f"the transfers cannot hide behind matmuls (the {module_name} module)", [
                       f"hideable       : {summary.fraction} transfers have a matmul independent of them",
                       f"threshold      : every transfer but one per ring direction ({summary.rings} "
                       f"direction{'s' if summary.rings > 1 else ''} here), and at least one",
                       f"how            : {spec.overlap}",
                       f"transfers in the {module_name} module (each with the matmuls around it):",
                       *(f"  {t.describe()}" for t in shown),
                       *([f"  ... and {len(summary.transfers) - len(shown)} more"] if rest else []),
                   ])  # fmt: skip
    if limited:  # what did lower was judged; the rest this host could not try
        raise compat.HostCannotLower("; ".join(limited))
    return records


def check_cross_lowering(case: Case, targets: Sequence[str] | None = None) -> None:
    """It lowers for each of its targets from the CPU host, using only allowed collectives there.

    Targets come from the registration: TPU and CUDA by default, TPU alone for a
    Pallas TPU kernel (lowered as the real kernel, not the interpreter).
    """
    impl = case.implementation
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
            problems.append(f"{target}: lowered module uses forbidden collectives: "
                            + "; ".join(op.describe() for op in bad))  # fmt: skip
    if problems:
        raise fail(case, "cross_lowering", "does not lower cleanly for every target", problems + host_limited)
    if host_limited:  # what did lower was clean; the rest this host could not try
        raise compat.HostCannotLower("; ".join(host_limited))


@dataclasses.dataclass(frozen=True)
class TpuLayoutRecord:
    """What ``tpu_layout`` found for one (implementation, dtype, dims): accepted, or refused and why."""

    family: str
    impl: str
    dtype: str
    dims: tuple[tuple[str, int], ...]
    refusal: str | None
    #: Why this host could not lower the shape for TPU at all (neither accepted nor refused).
    host_limited: str | None = None


TPU_LAYOUT_RECORDS: list[TpuLayoutRecord] = []


def check_tpu_layout(case: Case) -> None:
    """Compiled for a TPU, the kernel refuses the shape naming the constraint, or lowers to DMA
    windows and buffers a TPU's compiler accepts (:mod:`conformance.mosaic`); at the family's
    TPU-native dims it must lower."""
    try:
        text = runner.lower_exactly(case, "tpu").as_text()
    except compat.HostCannotLower as limit:
        TPU_LAYOUT_RECORDS.append(
            TpuLayoutRecord(case.family, case.impl, case.dtype, case.dims, None, str(limit))
        )
        raise
    except mosaic.TpuConstraintError as refusal:
        if case.at_tpu_native_dims:
            raise fail(case, "tpu_layout", "refuses the family's TPU-native shape, which every buffer "
                       "fills in whole tiles", [f"refusal: {refusal}"]) from None  # fmt: skip
        TPU_LAYOUT_RECORDS.append(
            TpuLayoutRecord(case.family, case.impl, case.dtype, case.dims, str(refusal))
        )
        return
    except Exception as e:
        raise fail(case, "tpu_layout", "lowering for TPU raised instead of refusing with "
                   "conformance.TpuConstraintError",
                   [f"{type(e).__name__}: {str(e)[:1500]}"]) from None  # fmt: skip
    violations = list(dict.fromkeys(v.what for v in mosaic.audit_lowered(text)))
    if violations:
        shown = violations[:4] + ([f"... and {len(violations) - 4} more"] if len(violations) > 4 else [])
        raise fail(case, "tpu_layout", "lowers for TPU to something a TPU compiler refuses (interpret mode "
                   "cannot see this); refuse such shapes with conformance.TpuConstraintError, or "
                   "align the windows", shown)  # fmt: skip
    TPU_LAYOUT_RECORDS.append(TpuLayoutRecord(case.family, case.impl, case.dtype, case.dims, None))


def check_races(case: Case) -> None:
    """Under TPU interpret mode with race detection: no race, no semaphore left with a count, and
    exact values.

    Run once per DMA execution mode: "eager" starts every DMA at once, "on_wait"
    defers each until something waits on it, as late and out of order as the
    waits allow. A kernel whose semaphores can be satisfied by the wrong
    transfer passes the first and fails the second.

    Every semaphore must be back at zero once every device has left the kernel: on a chip a
    barrier semaphore left with a count lets the next call's barrier pass at once, and a DMA
    semaphore left with one means the kernel returned while its DMA could still read its buffers.
    Races and leftover counts are read at the end of every ``pallas_call`` the check runs
    (:func:`compat.watch_interpreted_calls`), not only the last.
    """
    if not case.implementation.pallas or not case.dma_mode:
        raise ValueError(f"check_races needs a Pallas implementation and a dma_mode: {case}")
    with compat.watch_interpreted_calls() as ends:
        inputs64, out = _call(case, "races", lambda: runner.execute(case, detect_races=True))
    where = f"kernel {case.impl} on {case.mesh.describe()}, dma_execution_mode={case.dma_mode!r}"
    unread = [end.unreadable for end in ends if end.unreadable]
    if unread:
        raise RuntimeError(f"the races check cannot read JAX {jax.__version__}'s interpreter state at kernel "
                           f"exit: {unread[0]}")  # fmt: skip
    raced = [i for i, end in enumerate(ends, 1) if end.races_found]
    if raced or (not ends and compat.races_found()):
        calls = f"in pallas_call {raced} of {len(ends)}" if ends else "in the last pallas_call"
        raise fail(case, "races", "TPU interpret mode detected a race", [
            f"{where}, {calls}",
            "the interpreter printed the racing accesses (buffer, range, device, source line) "
            "to stderr above",
        ])  # fmt: skip
    left = [(i, sem) for i, end in enumerate(ends, 1) for sem in end.leftover]
    if left:
        raise fail(case, "races", "a semaphore has a nonzero count at kernel exit", [
            where,
            *(f"pallas_call {i} of {len(ends)}: {sem.describe()}" for i, sem in left[:6]),
            *([f"... and {len(left) - 6} more"] if len(left) > 6 else []),
            "read once every device had left the kernel; on a chip the next call's barrier passes "
            "at once (a barrier signal nobody waited for) or the kernel returned while a DMA could "
            "still read its buffers (a send never waited for): wait for every signal and every DMA",
        ])  # fmt: skip
    spec = case.spec
    _compare_shards(
        case,
        "races",
        out,
        spec.expected(inputs64, axis_size=case.mesh.axis_size),
        spec.tolerance(*inputs64, case.dtype),
    )


def _replicated_call(case: Case, shapes: Sequence[tuple[int, ...]], axis_name: str) -> object:
    """Call the implementation on arrays of ``shapes``, replicated over the case's mesh."""
    mesh = runner.mesh_of(case)
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    dt = runner.np_dtype(case.dtype)
    args = [jax.device_put(np.ones(shape, dt), replicated) for shape in shapes]
    return jax.block_until_ready(runner.jitted_for(case, axis_name=axis_name)(*args))


def check_bad_inputs(case: Case) -> None:
    """Each forbidden input raises an error, from the kernel, that names the offending values.

    Bad inputs are replicated arrays (an indivisible dim cannot be sharded). On an
    Explicit mesh JAX's shard_map refuses a replicated input whose sharding differs
    from its ``in_specs`` before the kernel sees it, and that refusal names the
    array's shape, so it would pass for the kernel's own check. The check first
    calls the kernel with *valid* shapes placed the same way: if JAX refuses those
    too, the bad inputs go to the same kernel on the Auto twin of the mesh (same
    devices and axes), where they reach the kernel.
    """
    spec = case.spec
    problems = []
    probe_case, note = case, ""
    if case.mesh.axis_type == "explicit":
        try:
            _replicated_call(case, case.operand_shapes, case.mesh.axis_name)
        except Exception:
            probe_case = dataclasses.replace(case, mesh=dataclasses.replace(case.mesh, axis_type="auto"))
            note = (" (on the Auto twin of this mesh: on an Explicit mesh JAX's shard_map refuses "
                    "replicated inputs, even valid ones, before the kernel sees them)")  # fmt: skip
    for bad in spec.bad_inputs(case.mesh.axis_size):
        try:
            result = _replicated_call(probe_case, bad.shapes, bad.axis_name or case.mesh.axis_name)
        except Exception as e:
            message = str(e)
            missing = [m for m in bad.must_mention if m not in message]
            if missing:
                problems.append(f"{bad.description}{note}: raised {type(e).__name__} without naming "
                                f"{missing}: {message[:300]!r}")  # fmt: skip
            continue
        shape = getattr(result, "shape", "?")
        problems.append(f"{bad.description}{note}: returned a result of shape {shape} instead of raising")
    if problems:
        raise fail(case, "bad_inputs", "forbidden input is not rejected with a clear error", problems)


def check_barrier_protocol(case: Case) -> None:
    """No remote DMA starts unprotected by a barrier (``conformance/pallas_protocol.py`` says which).

    Static (read off the traced kernel): TPU interpret mode starts all devices'
    kernels together, so no run on CPU can show this defect. A kernel with no
    barrier of its own passes: JAX inserts a device barrier before it.
    """
    fn = runner.jitted_for(case)
    found = _call(
        case, "barrier_protocol", lambda: pallas_protocol.violations(fn, runner.abstract_args(case))
    )
    if found:
        raise fail(case, "barrier_protocol", found[0].rule, [
            f"at {found[0].where}",
            "either wait for the neighbours' signals on the barrier semaphore before the first "
            "remote DMA (pltpu.get_barrier_semaphore, pl.semaphore_signal/semaphore_wait, "
            "CompilerParams(collective_id=...)), or take no barrier of your own and keep the "
            "device barrier JAX inserts before the kernel (no collective_id, no skip_device_barrier)",
        ])  # fmt: skip


# ----------------------------------------------------------------------------- autodiff


def check_gradients(case: Case) -> None:
    """``jax.vjp`` with a random cotangent against numpy float64 gradients (the transpose math).

    Each gradient must also come back with its operand's sharding and dtype.
    """
    spec = case.spec
    if spec.vjp_reference is None or spec.vjp_tolerance is None:
        raise ValueError(f"family {case.family} defines no gradients")
    inputs64, ct64, grads = _call(case, "gradients", lambda: runner.execute_pullback(case))
    expected = spec.vjp_reference(*inputs64, ct64)
    tolerance = spec.vjp_tolerance(*inputs64, ct64, case.dtype)
    want_dtype = runner.np_dtype(case.dtype)
    if len(grads) != len(spec.operands):
        raise fail(
            case, "gradients", f"the VJP returned {len(grads)} gradients for {len(spec.operands)} operands"
        )
    for operand, grad, sharding, exp, tol in zip(spec.operands, grads, runner.operand_shardings(case),
                                                 expected, tolerance, strict=True):  # fmt: skip
        name = f"d_{operand.name}"
        if np.dtype(grad.dtype) != want_dtype:
            raise fail(case, "gradients", f"gradient {name} has dtype {grad.dtype}, operand has {want_dtype}")
        if not grad.sharding.is_equivalent_to(sharding, grad.ndim):
            got_spec = getattr(grad.sharding, "spec", grad.sharding)
            raise fail(case, "gradients", f"gradient {name} is not sharded like {operand.name}", [
                f"expected       : {sharding.spec}", f"got            : {got_spec}",
            ])  # fmt: skip
        _compare_shards(case, "gradients", grad, exp, tol, what=name)


#: The usual cause of an unneeded all-reduce in a backward pass, for the failure message.
DEFENSIVE_ALL_REDUCE_HINT = (
    "an all-reduce here is typically the defensive psum shard_map adds in the backward of an output "
    "it cannot prove replicated (check_vma=False, or a pallas_call whose varying axes are undeclared): "
    "declare them (README: 'Backward passes without defensive all-reduces')"
)


@dataclasses.dataclass(frozen=True)
class BackwardAudit:
    """What a pullback's modules hold: the compiled host module and each cross-lowered one."""

    compiled: hlo.CollectiveSummary
    lowered: dict[str, hlo.CollectiveSummary]

    def forbidden(self, allowed: frozenset[str]) -> list[str]:
        """One line per module using a collective outside ``allowed`` (plus a hint for an all-reduce)."""
        lines, kinds = [], set()
        for where, summary in [("compiled for the host (cpu)", self.compiled),
                               *((f"lowered for {t}", s) for t, s in self.lowered.items())]:  # fmt: skip
            bad = hlo.disallowed(summary, allowed)
            if bad:
                lines.append(f"{where}: " + "; ".join(op.describe() for op in bad))
                kinds.update(op.kind for op in bad)
        if "all-reduce" in kinds:
            lines.append(DEFENSIVE_ALL_REDUCE_HINT)
        return lines


def audit_backward(
    fn: Callable[..., object],
    args: Sequence[jax.ShapeDtypeStruct],
    cotangent: jax.ShapeDtypeStruct,
    *,
    host_fn: Callable[..., object] | None = None,
    targets: Sequence[str] = ("tpu", "cuda"),
) -> BackwardAudit:
    """The collectives in ``fn``'s VJP, compiled for this host and lowered for each of ``targets``.

    ``host_fn`` is what runs on this host if it differs from what the targets
    see (a Pallas kernel in interpret mode). Usable on any function, not only
    registered kernels: the suite's seed-issue test calls it directly.
    """
    abstract = (*args, cotangent)
    traced = runner.pullback_of(fn).trace(*abstract)  # one trace, lowered for each target
    host = traced if host_fn is None else runner.pullback_of(host_fn).trace(*abstract)
    compiled = runner.compile_lowered(host.lower(), jax.default_backend())
    lowered = {t: hlo.parse_stablehlo(compat.lower_traced(traced, t).as_text()) for t in targets}
    return BackwardAudit(hlo.parse_hlo(compiled.as_text()), lowered)


def assert_backward_collectives(
    fn: Callable[..., object],
    args: Sequence[jax.ShapeDtypeStruct],
    cotangent: jax.ShapeDtypeStruct,
    *,
    name: str,
    allowed: frozenset[str] = frozenset(),
    host_fn: Callable[..., object] | None = None,
    targets: Sequence[str] = ("tpu",),
) -> BackwardAudit:
    """Raise :class:`ConformanceFailure` if ``fn``'s VJP uses a collective outside ``allowed``.

    For any function, registered or not: compiled for this host (``host_fn``,
    e.g. the Pallas kernel in interpret mode) and lowered for each of ``targets``.
    """
    audit = audit_backward(fn, args, cotangent, host_fn=host_fn, targets=targets)
    problems = audit.forbidden(allowed)
    if problems:
        shapes = ", ".join(f"{list(a.shape)} {a.dtype}" for a in args)
        lines = [f"[backward_collectives] {name}: the backward pass uses collectives its math does not need",
                 f"  arguments      : {shapes}; cotangent {list(cotangent.shape)}",
                 f"  allowed        : {', '.join(sorted(allowed)) or 'none'}",
                 *("  " + p for p in problems)]  # fmt: skip
        raise ConformanceFailure("\n".join(lines))
    return audit


#: Filled by :func:`check_backward_collectives`, printed by the plugin next to the forward bytes.
BACKWARD_BYTE_RECORDS: list[ByteRecord] = []


def check_backward_collectives(case: Case) -> ByteRecord:
    """The VJP uses only the collectives the family's gradient math needs, on every target.

    Audited twice: the module compiled for this host (with byte accounting) and
    the modules lowered for the implementation's targets, because a collective
    one backend's compiler removes can survive in another's (XLA CPU drops the
    defensive all-reduce that the TPU lowering keeps).
    """
    spec, impl = case.spec, case.implementation
    if spec.backward_max_received_bytes is None:
        raise ValueError(f"family {case.family} defines no backward byte bound")
    summary = hlo.parse_hlo(
        _call(case, "backward_collectives", lambda: runner.compiled_pullback(case).as_text())
    )
    lowered = {}
    for target in impl.lowering_targets:
        text = _call(
            case, "backward_collectives", lambda t=target: runner.lowered_pullback_for(case, t).as_text()
        )
        lowered[target] = hlo.parse_stablehlo(text)
    audit = BackwardAudit(summary, lowered)
    n, itemsize = case.mesh.axis_size, runner.np_dtype(case.dtype).itemsize
    received = summary.received_bytes_per_device()
    bound = spec.backward_max_received_bytes(case.dims_map, n, itemsize)
    record = ByteRecord(case.family, case.impl, case.mesh.label, case.dtype, received, bound,
                        tuple(op.describe() for op in summary.ops))  # fmt: skip
    BACKWARD_BYTE_RECORDS.append(record)
    if impl.baseline:
        return record
    allowed = spec.backward_allowed_collectives
    ops = [f"  {op.describe()}" for op in summary.ops] or ["  (none)"]
    problems = audit.forbidden(allowed)
    if problems:
        allowed_text = ", ".join(sorted(allowed)) or "none"
        what = "the backward pass uses collectives its math does not need"
        raise fail(case, "backward_collectives", what, [
            f"allowed        : {allowed_text} ({spec.backward_byte_bound_text})", *problems,
        ])  # fmt: skip
    _check_byte_bound(case, "backward_collectives", "the backward pass receives more than its math needs",
                      received, bound, spec.backward_byte_bound_text, ops)  # fmt: skip
    return record


# ----------------------------------------------------------------------------- accuracy


@dataclasses.dataclass(frozen=True)
class AccuracyRecord:
    """An implementation's error next to the baseline's, on the same inputs."""

    family: str
    impl: str
    baseline: str
    mesh: str
    dtype: str
    rms: float
    baseline_rms: float
    max_abs: float
    baseline_max_abs: float
    #: The backward check's records: which gradient (``d_lhs``); ``""`` for the forward result.
    gradient: str = ""

    @property
    def ratio(self) -> float:
        return self.rms / self.baseline_rms if self.baseline_rms else (0.0 if not self.rms else np.inf)

    def table(self) -> list[str]:
        width = max(len(self.impl), len(self.baseline) + 11)
        base = f"{self.baseline} (baseline)"
        return [
            f"{'error vs float64':<{width}}  {'rms':>10}  {'max |err|':>10}",
            f"{self.impl:<{width}}  {self.rms:>10.3e}  {self.max_abs:>10.3e}",
            f"{base:<{width}}  {self.baseline_rms:>10.3e}  {self.baseline_max_abs:>10.3e}",
        ]


ACCURACY_RECORDS: list[AccuracyRecord] = []
#: Filled by :func:`check_backward_accuracy`: one record per gradient.
BACKWARD_ACCURACY_RECORDS: list[AccuracyRecord] = []

#: What a backward less accurate than the baseline's points to, and the cure (failure message).
BACKWARD_ACCURACY_HINT = (
    "a gradient that is a sum over the ring (d_lhs of an all-gather matmul, a reduce-scatter of "
    "ct @ rhs.T) rounded to the 16-bit dtype at every hop; a ring differentiated by JAX's own autodiff "
    "(no custom_vjp) does exactly that, since the transpose of each ppermute step carries the "
    "cotangent's dtype"
)
BACKWARD_ACCURACY_CURE = (
    "write the backward as a custom_vjp whose ring carries float32 accumulators "
    "(jnp.dot(..., preferred_element_type=jnp.float32)) and casts to the operand's dtype once, at the end"
)


def baseline_of(family: str) -> str:
    from conformance import registry

    found = [i.name for i in registry.registered(family) if i.baseline]
    if not found:
        raise ValueError(f"family {family} has no registered baseline to compare accuracy with")
    return found[0]


def check_accuracy(case: Case) -> AccuracyRecord:
    """The implementation's rms error is no worse than the baseline's on the same inputs.

    Both are measured against numpy float64; the limit is
    :data:`tolerances.ACCURACY_RATIO_LIMIT` times the baseline's rms error (see
    there for why). This catches what the elementwise bound cannot: partial
    sums rounded to a 16-bit dtype between ring steps.
    """
    from conformance import tolerances

    baseline = baseline_of(case.family)
    if case.impl == baseline:
        raise ValueError(f"{case.impl} is the baseline of {case.family}: nothing to compare with")
    inputs = runner.make_inputs(case)
    inputs64, out = _call(case, "accuracy", lambda: runner.execute(case, inputs=inputs))
    base_case = dataclasses.replace(case, impl=baseline, dma_mode=None)
    _, base_out = _call(case, "accuracy", lambda: runner.execute(base_case, inputs=inputs))
    exact = case.spec.expected(inputs64, axis_size=case.mesh.axis_size)
    err = runner.global_value(out).astype(np.float64) - exact
    base_err = runner.global_value(base_out).astype(np.float64) - exact
    record = AccuracyRecord(case.family, case.impl, baseline, case.mesh.label, case.dtype,
                            float(np.sqrt(np.mean(err**2))), float(np.sqrt(np.mean(base_err**2))),
                            float(np.max(np.abs(err))), float(np.max(np.abs(base_err))))  # fmt: skip
    ACCURACY_RECORDS.append(record)
    limit = tolerances.ACCURACY_RATIO_LIMIT
    if not record.ratio <= limit:
        spec = case.spec
        why = [f"the baseline   : {spec.accuracy_baseline_does}"] if spec.accuracy_baseline_does else []
        why += [f"to match it    : {spec.accuracy_how_to_match}"] if spec.accuracy_how_to_match else []
        raise fail(case, "accuracy", f"clearly less accurate than the baseline {baseline}", [
            *record.table(),
            f"rms ratio      : {record.ratio:.2f} (limit {limit}: {tolerances.ACCURACY_RATIO_REASON})",
            *why,
        ])  # fmt: skip
    return record


def check_backward_accuracy(case: Case) -> list[AccuracyRecord]:
    """Each gradient's rms error is no worse than the baseline's backward on the same inputs and
    cotangent (both against the float64 transpose math), within the forward check's limit."""
    from conformance import tolerances

    spec, baseline = case.spec, baseline_of(case.family)
    if spec.vjp_reference is None:
        raise ValueError(f"family {case.family} defines no gradients")
    inputs, ct = runner.make_inputs(case), runner.make_cotangent(case)
    base_case = dataclasses.replace(case, impl=baseline, dma_mode=None)

    def pullback(of: Case) -> tuple:
        return _call(
            case, "backward_accuracy", lambda: runner.execute_pullback(of, inputs=inputs, cotangent=ct)
        )

    inputs64, ct64, grads = pullback(case)
    _, _, base_grads = pullback(base_case)
    records = []
    for operand, grad, base_grad, exact in zip(spec.operands, grads, base_grads,
                                               spec.vjp_reference(*inputs64, ct64), strict=True):  # fmt: skip
        err = runner.global_value(grad).astype(np.float64) - exact
        base_err = runner.global_value(base_grad).astype(np.float64) - exact
        records.append(AccuracyRecord(case.family, case.impl, baseline, case.mesh.label, case.dtype,
                                      float(np.sqrt(np.mean(err**2))), float(np.sqrt(np.mean(base_err**2))),
                                      float(np.max(np.abs(err))), float(np.max(np.abs(base_err))),
                                      gradient=f"d_{operand.name}"))  # fmt: skip
    BACKWARD_ACCURACY_RECORDS.extend(records)
    limit = tolerances.ACCURACY_RATIO_LIMIT
    worse = [r for r in records if not r.ratio <= limit]
    if worse:
        lines = []
        for r in worse:
            lines += [f"{r.gradient}:", *("  " + t for t in r.table()), f"  rms ratio    : {r.ratio:.2f}"]
        raise fail(case, "backward_accuracy",
                   f"{', '.join(r.gradient for r in worse)} clearly less accurate than the baseline "
                   f"{baseline}'s backward", [
                       *lines,
                       f"limit          : {limit} ({tolerances.ACCURACY_RATIO_REASON})",
                       f"points to      : {BACKWARD_ACCURACY_HINT}",
                       f"to match it    : {BACKWARD_ACCURACY_CURE}",
                   ])  # fmt: skip
    return records


#: Name -> check, for the replay command.
CHECKS: dict[str, Callable[[Case], object]] = {
    "values": check_values,
    "output_sharding": check_output_sharding,
    "tpu_layout": check_tpu_layout,
    "dtype": check_dtype,
    "determinism": check_determinism,
    "eager": check_eager,
    "collectives": check_collectives,
    "overlap": check_overlap,
    "cross_lowering": check_cross_lowering,
    "bad_inputs": check_bad_inputs,
    "races": check_races,
    "barrier_protocol": check_barrier_protocol,
    "gradients": check_gradients,
    "backward_collectives": check_backward_collectives,
    "accuracy": check_accuracy,
    "backward_accuracy": check_backward_accuracy,
    "lowered_bytes": check_lowered_bytes,
}
