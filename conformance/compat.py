"""The few spellings that differ between JAX 0.6.2 and the newest release.

Everything else in the project uses current JAX spellings directly. When the oldest supported JAX
moves forward, entries here are deleted, not rewritten. The ``cpu-oldest`` tox environment runs the
whole suite on JAX 0.6.2 to prove this module is all the difference there is."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import importlib.util
import inspect
import io
import logging
import os
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import jax
import numpy as np

JAX_VERSION: tuple[int, ...] = tuple(int(part) for part in jax.__version__.split(".")[:3] if part.isdigit())


def configure_cpu_devices(count: int) -> None:
    """Ask for ``count`` simulated CPU devices before any backend starts (``jax_num_cpu_devices``, in
    every supported JAX; the XLA flag too, so that subprocesses started without this module agree)."""
    flag = f"--xla_force_host_platform_device_count={count}"
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} {flag}".strip()
    jax.config.update("jax_num_cpu_devices", count)


def cpu_devices_in_this_process(count: int) -> None:
    """``count`` simulated CPU devices for this process alone (no ``XLA_FLAGS``, which the processes it
    starts would inherit), if no backend has started here: a pytest-xdist controller, which runs no
    test, describes the host as its workers see it."""
    from jax._src import xla_bridge

    if not xla_bridge.backends_are_initialized():
        jax.config.update("jax_num_cpu_devices", count)


def allow_arrays_without_local_shards() -> None:
    """In a job, a process may hold no shard of an array (a send_recv destination on other processes,
    which every process still calls ``fn`` for). JAX 0.6.2 builds such an array only with
    ``jax_enable_empty_arrays`` set (``make_array_from_callback`` raises otherwise); later JAX has no
    flag and always does."""
    if "jax_enable_empty_arrays" in jax.config.values:
        jax.config.update("jax_enable_empty_arrays", True)


def start_backends() -> None:
    """Start JAX's backends now (once the device count is set), keeping what native libraries log as
    they load on a host without their hardware out of the run's output (:mod:`conformance.native_logs`)."""
    from conformance import native_logs

    with native_logs.filtered():
        jax.devices()


def ensure_cpu_devices(count: int) -> str | None:
    """Ask for ``count`` simulated CPU devices if no backend has started; ``None`` if the host
    then has (or already had) at least ``count``, else what went wrong, in words."""
    from jax._src import xla_bridge

    if not xla_bridge.backends_are_initialized():
        configure_cpu_devices(count)
        return None
    found = len(jax.devices("cpu"))
    if found >= count:
        return None
    return (
        f"JAX's CPU backend had already started with {found} device(s) before the conformance suite "
        f"could ask for {count}"
    )


#: XLA:CPU options for the suite's own compiles on the CPU host, each taken where this jaxlib has
#: it. None changes an HLO pass that decides the collectives, bytes or schedule the checks read;
#: each only makes the host's code generation cheaper:
#:
#: - ``xla_backend_optimization_level=0``: LLVM at -O0;
#: - ``xla_cpu_use_fusion_emitters=False``: the elemental emitters, not the fusion emitters (which
#:   jaxlib 0.10.2 uses by default and 0.6.2 does not; jaxlib 0.12 has no other and no option). The
#:   module then keeps a lone slice or broadcast as itself where the fusion emitters wrap it in a
#:   one-op fusion;
#: - ``xla_cpu_parallel_codegen_split_count=1``: one LLVM module per program, not split for threads
#:   that a 2-core host running two pytest workers does not have.
#:
#: Measured on 28 ring and all-gather programs (forward and VJP, float32 and bfloat16, 8 devices),
#: against -O0 alone: the same collectives and every result bitwise the same; compile time 2.2 s
#: -> 0.9 s (JAX 0.10.2) and 1.0 s -> 0.7 s (0.6.2). Against JAX's defaults a float32 matmul may
#: round differently in its last bit (-O0 alone does too); ``test_cpu_compile_options`` holds
#: the collectives and the verdicts to the defaults' on each env's JAX.
CPU_COMPILE_OPTION_CANDIDATES: tuple[tuple[str, Any], ...] = (
    ("xla_backend_optimization_level", 0),
    ("xla_cpu_use_fusion_emitters", False),
    ("xla_cpu_parallel_codegen_split_count", 1),
)


@functools.cache
def cpu_compiler_options() -> dict[str, Any]:
    """The options of :data:`CPU_COMPILE_OPTION_CANDIDATES` this jaxlib's CPU compiler knows (each
    tried once on a one-element program; "No such compile option" leaves it out, any other error
    propagates)."""
    cpu = jax.sharding.SingleDeviceSharding(jax.local_devices(backend="cpu")[0])
    lowered = jax.jit(lambda x: x + 1).lower(jax.ShapeDtypeStruct((1,), np.float32, sharding=cpu))
    known: dict[str, Any] = {}
    for name, value in CPU_COMPILE_OPTION_CANDIDATES:
        try:
            lowered.compile(compiler_options={name: value})
        except Exception as e:  # XlaRuntimeError or JaxRuntimeError, by version
            if "No such compile option" not in str(e):
                raise
            continue
        known[name] = value
    return known


def make_mesh(
    shape: Sequence[int], axis_names: Sequence[str], *, axis_types: tuple[Any, ...], devices: Sequence[Any]
) -> jax.sharding.Mesh:
    """``jax.make_mesh`` took ``axis_types`` as keyword-only in 0.6.2; keyword works everywhere."""
    return jax.make_mesh(tuple(shape), tuple(axis_names), axis_types=axis_types, devices=devices)


def reshard(x: Any, sharding: Any) -> Any:
    """``x`` resharded to ``sharding`` on a mesh of ``Explicit`` axes: ``jax.sharding.reshard`` from
    JAX 0.7, ``jax.experimental.shard.reshard`` in 0.6."""
    if hasattr(jax.sharding, "reshard"):
        return jax.sharding.reshard(x, sharding)
    from jax.experimental import shard

    return shard.reshard(x, sharding)


def all_gather_invariant(x: Any, axis_name: str, *, axis: int = 0, tiled: bool = False) -> Any:
    """An all-gather whose result is typed invariant over ``axis_name`` (so ``out_specs=P()`` checks):
    ``lax.all_gather(..., to="invarying")`` in new JAX, ``lax.all_gather_invariant`` in 0.6."""
    if hasattr(jax.lax, "all_gather_invariant"):
        return jax.lax.all_gather_invariant(x, axis_name, axis=axis, tiled=tiled)
    return jax.lax.all_gather(x, axis_name, axis=axis, tiled=tiled, to="invarying")


def varying(x: Any, axis_name: str) -> Any:
    """``x`` typed varying over ``axis_name`` (a loop carry): ``lax.pvary`` in 0.6, ``lax.pcast`` now."""
    if hasattr(jax.lax, "pvary"):
        return jax.lax.pvary(x, (axis_name,))
    return jax.lax.pcast(x, (axis_name,), to="varying")


def varying_shape_dtype_struct(
    shape: Sequence[int], dtype: Any, *, varying_axes: frozenset[str]
) -> jax.ShapeDtypeStruct:
    """A ``pallas_call`` ``out_shape`` that declares which manual mesh axes its value varies over: under
    ``shard_map(check_vma=True)`` how a kernel tells JAX its output is replicated over every other axis,
    so autodiff needs no defensive all-reduce. ``ShapeDtypeStruct(..., vma=axes)`` in JAX 0.6,
    ``ShapeDtypeStruct(..., manual_axis_type=ManualAxisType(varying=axes))`` now."""
    parameters = inspect.signature(jax.ShapeDtypeStruct.__init__).parameters
    if "manual_axis_type" in parameters:
        mat = jax.sharding.ManualAxisType(varying=frozenset(varying_axes))
        return jax.ShapeDtypeStruct(tuple(shape), dtype, manual_axis_type=mat)
    return jax.ShapeDtypeStruct(tuple(shape), dtype, vma=frozenset(varying_axes))


class HostLimit(RuntimeError):
    """This host (or this JAX on it) cannot do what a check needs; not the kernel's failure.

    Reported as a skip naming the reason, never as a failure or a pass.
    """


class HostCannotLower(HostLimit):
    """Lowering for another backend failed because of this host, not the kernel."""


class HostCannotRun(HostLimit):
    """TPU interpret mode could not run the kernel on this host (e.g. JAX's interpreter deadlocked)."""


#: Measured on a 2-core host: TPU interpret mode of JAX 0.6.2 and 0.10.2 deadlocks on 8 simulated
#: devices in ``_allocate_buffer`` (``np.array`` of a buffer waits on XLA's CPU thread pool, which the
#: kernel's blocked callbacks hold) once a device's largest buffer reaches 128 KiB; 96 KiB runs, and
#: so does 192 KiB on 4 devices. JAX 0.12.0.1 on the same host runs all of these, and so does
#: JAX 0.11.2 on 16 cores. The watchdog turns such a deadlock into a reasoned skip after 30 s; this
#: predicts it, so a case known to deadlock is skipped at once, for the same reason.
INTERPRET_MODE_RUNS_BYTES = 96 * 1024


def interpret_mode_limit(*, devices: int, bytes_per_device: int) -> str | None:
    """Why this JAX on this host cannot run a TPU-interpret-mode case of this size; ``None`` if it can."""
    cores = os.cpu_count() or 1
    if JAX_VERSION >= (0, 12) or devices < 4 * cores or bytes_per_device <= INTERPRET_MODE_RUNS_BYTES:
        return None
    return (
        f"TPU interpret mode of JAX {jax.__version__} deadlocks inside JAX (in _allocate_buffer) on "
        f"{devices} simulated devices of a {cores}-core host with {bytes_per_device // 1024} KiB per "
        f"device (measured: it runs {INTERPRET_MODE_RUNS_BYTES // 1024} KiB here, and all of it on "
        "JAX 0.12 or with more cores); a TPU, more cores or a newer JAX can run the case"
    )


#: Errors JAX raises when a lowering asks the *local* device what it is (message prefix -> reason).
_HOST_LIMITS = {
    "Unsupported TPU device kind:": (
        "this host cannot lower this kernel for TPU: JAX's TPU lowering of an op it uses (e.g. `//` on "
        "a traced integer, via lax.sign) asks the local device which TPU it is, and this host's is {kind}"
    ),
}


def lower_for_platform(jitted: Any, args: Sequence[Any], platform: str) -> Any:
    """Lower a jitted function for another backend than the host's (no compile): :class:`HostCannotLower`
    where JAX's lowering needs the target's hardware to answer (JAX 0.10 on, Pallas TPU kernels)."""
    return lower_traced(jitted.trace(*args), platform)


def lower_traced(traced: Any, platform: str) -> Any:
    """:func:`lower_for_platform` of a function already traced (``jax.jit(f).trace(...)``): one
    trace serves every target."""
    try:
        return traced.lower(lowering_platforms=(platform,))
    except ValueError as e:
        for prefix, reason in _HOST_LIMITS.items():
            if str(e).startswith(prefix):
                kind = str(e)[len(prefix) :].split(".")[0].strip()
                raise HostCannotLower(reason.format(kind=kind) + f" ({prefix} {kind})") from e
        raise


# ----------------------------------------------------------------------------- Pallas TPU interpret mode


def interpret_params(*, dma_execution_mode: str, detect_races: bool) -> Any:
    """``pltpu.InterpretParams`` with the fields the suite sets (named alike in 0.6.2 and now)."""
    from jax.experimental.pallas import tpu as pltpu

    fields = {"dma_execution_mode": dma_execution_mode, "detect_races": detect_races}
    if "on_race" in {f.name for f in dataclasses.fields(pltpu.InterpretParams)}:
        # JAX 0.12 raises RuntimeError("RACE DETECTED") at the first race by default, before it sets
        # the race flag; "warn" logs it and sets the flag, as older JAX prints it and sets it
        fields["on_race"] = "warn"
    return pltpu.InterpretParams(**fields)


NO_FORCED_INTERPRET = "has no pltpu.force_tpu_interpret_mode"  # in a skip, where JAX cannot force it


def forced_interpret_mode(params: Any) -> Any:
    """``pltpu.force_tpu_interpret_mode(params)``; :class:`HostLimit` on a JAX without it (0.6)."""
    from jax.experimental.pallas import tpu as pltpu

    if not hasattr(pltpu, "force_tpu_interpret_mode"):
        why = f"the kernel takes no interpret=, and JAX {jax.__version__} {NO_FORCED_INTERPRET}"
        raise HostLimit(f"{why}: a newer JAX runs it, or the kernel can pass interpret= to pallas_call")
    return pltpu.force_tpu_interpret_mode(params)


@contextlib.contextmanager
def race_reports() -> Iterator[list[str]]:
    """The interpreter's race reports made inside the block ("RACE DETECTED\n  read of ... from ...,
    <source line>\n ..."): printed to stdout up to JAX 0.10, logged from 0.12; caught from both and
    passed on (the stream and the log still get them)."""
    found: list[str] = []

    class Catch(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            text = record.getMessage()
            if "RACE DETECTED" in text:
                found.append(text)

    class Tee(io.TextIOBase):
        def __init__(self, out: Any) -> None:
            self.out, self.seen = out, ""

        def write(self, text: str) -> int:
            if "RACE DETECTED" in self.seen + text or self.seen:
                self.seen = (self.seen + text)[:65536]  # from the first report on, bounded
            return self.out.write(text)

        def flush(self) -> None:
            self.out.flush()

    handler = Catch()
    root = logging.getLogger()
    root.addHandler(handler)
    original = sys.stdout
    sys.stdout = tee = Tee(original)
    try:
        yield found
    finally:
        sys.stdout = original
        root.removeHandler(handler)
        printed = tee.seen[tee.seen.find("RACE DETECTED") :] if "RACE DETECTED" in tee.seen else ""
        for chunk in printed.split("RACE DETECTED")[1:]:  # a report runs to a blank line or the next
            found.append("RACE DETECTED" + chunk.split("\n\n", 1)[0].rstrip())


def _interpret_module() -> Any:
    """The module holding interpret mode's global state: it moved into a package after 0.6."""
    try:  # by module path: in 0.6 the same name is a function in the parent module
        return importlib.import_module("jax._src.pallas.mosaic.interpret.interpret_pallas_call")
    except ImportError:  # JAX 0.6: a single module
        return importlib.import_module("jax._src.pallas.mosaic.interpret")


def cpu_traced_as(chip: Any) -> Callable[[], None]:
    """Pallas TPU helpers traced for CPU devices (``pltpu.emit_pipeline``'s tiling) take a TPU ``chip``'s
    info, not "Unsupported TPU device kind: cpu": from JAX 0.10 by JAX's own registry of kinds
    (``tpu_info.registry``), in 0.6 by its cached generation, read once with ``chip`` the default device.
    The undo closure."""
    for path in ("jax._src.tpu_info", "jax._src.pallas.mosaic.tpu_info"):
        info = sys.modules.get(path) or (importlib.util.find_spec(path) and importlib.import_module(path))
        if info and "cpu" not in getattr(info, "registry", {"cpu": None}):
            kind = info.chip_version_from_device_kind(chip.device_kind)
            info.registry["cpu"] = functools.partial(info.get_tpu_info_for_chip, kind, 1)
            return lambda: info.registry.pop("cpu", None)
    pipeline = importlib.import_module("jax._src.pallas.mosaic.pipeline")
    if (generation := getattr(pipeline, "_get_tpu_generation", None)) is None:
        return lambda: None
    with jax.default_device(chip):
        generation()
    return generation.cache_clear


def races_found() -> bool:
    """Whether the last interpreted kernel run with ``detect_races=True`` reported a race."""
    races = getattr(_interpret_module(), "races", None)
    return bool(races is not None and races.races_found)


@dataclasses.dataclass(frozen=True)
class LeftoverSemaphore:
    """A semaphore with a nonzero count when every device had left an interpreted kernel."""

    semaphore_id: int
    barrier: bool  # the kernel's barrier semaphore (``pltpu.get_barrier_semaphore``)
    count: int
    devices: tuple[int, ...]

    def describe(self) -> str:
        kind = "barrier semaphore" if self.barrier else "semaphore"
        return f"{kind} {self.semaphore_id}: count {self.count} on device(s) {list(self.devices)}"


@dataclasses.dataclass(frozen=True)
class InterpretedCallEnd:
    """What the interpreter held at the end of one interpreted ``pallas_call``, read once every
    device had finished it (in the action of its end-of-call barrier, before memory is dropped)."""

    races_found: bool
    leftover: tuple[LeftoverSemaphore, ...]
    #: the interpreter's state in a form this module does not know (quoted); never guessed around
    unreadable: str | None = None


def _semaphores_at_exit(shared: Any) -> tuple[LeftoverSemaphore, ...]:
    per_device = max(1, int(getattr(shared, "num_cores_per_device", 1)))
    fixed = dict(getattr(shared, "fixed_id_sem", {}) or {})  # barrier semaphores (JAX 0.7 and later)
    found = []
    with shared.lock:  # JAX 0.6 keeps barrier semaphores with the others, under an id of None
        semaphores = [(k, s, s.id is None) for k, s in getattr(shared, "sem", {}).items()]
        semaphores += [(k, s, True) for k, s in fixed.items()]
    for key, sem, barrier in semaphores:
        with sem.cv:  # JAX 0.6 names the per-core counts ``counts``; later ``count_by_core``
            counts = np.array(getattr(sem, "count_by_core", getattr(sem, "counts", ())), dtype=np.int64)
        by_count: dict[int, list[int]] = {}
        for core in np.flatnonzero(counts):
            by_count.setdefault(int(counts[core]), []).append(int(core) // per_device)
        for count, devices in sorted(by_count.items()):
            found.append(LeftoverSemaphore(int(key), barrier, count, tuple(sorted(set(devices)))))
    return tuple(found)


@contextlib.contextmanager
def watch_interpreted_calls() -> Iterator[list[InterpretedCallEnd]]:
    """Within the block, note each interpreted ``pallas_call``'s end (:class:`InterpretedCallEnd`).

    JAX's interpreter looks at semaphores as each device leaves the kernel, before the end-of-call
    barrier, so an early device misses a slower neighbour's late signal; and it prints what it
    finds and does not raise. Its race flag, too, is reset for every call, so after a check that
    ran several calls it tells of the last one. Every device has finished once the barrier's
    action (``_clear_shared_memory``, bound when a call's shared memory is made) runs: the
    wrapper put there reads every semaphore's count and the race flag, then drops the memory.
    """
    module = _interpret_module()
    original = getattr(module, "_clear_shared_memory", None)
    if original is None:
        raise HostLimit(f"this JAX ({jax.__version__}) has no end-of-call hook in its TPU interpreter")
    ends: list[InterpretedCallEnd] = []

    def note_and_clear() -> None:
        shared = getattr(module, "_shared_memory", None)
        races = getattr(module, "races", None)
        if shared is not None:
            raced = bool(races is not None and races.races_found)
            try:
                ends.append(InterpretedCallEnd(raced, _semaphores_at_exit(shared)))
            except Exception as e:  # raising here would break the barrier every device waits at
                ends.append(InterpretedCallEnd(raced, (), f"{type(e).__name__}: {e}"))
        original()

    module._clear_shared_memory = note_and_clear
    try:
        yield ends
    finally:
        module._clear_shared_memory = original


@contextlib.contextmanager
def note_interpreted_copies() -> Iterator[list[tuple[int, int, tuple[int, ...], int]]]:
    """Within the block, note every DMA an interpreted kernel makes, as it reads its source: (source,
    target, shape, bytes), the devices as the interpreter's logical ids (the row-major index of a
    device's mesh coordinates). The interpreter (0.6 and later) makes each DMA an instance of its class
    ``DMA`` and sets its ``data`` once, at the read: a subclass put in its place notes that."""
    module = _interpret_module()
    original = getattr(module, "DMA", None)
    fields = {f.name for f in dataclasses.fields(original)} if dataclasses.is_dataclass(original) else set()
    if not {"data", "src_device_id", "dst_device_id"} <= fields:
        raise HostLimit(
            f"this JAX ({jax.__version__}) keeps its TPU interpreter's DMAs in a form not known here"
        )
    copies: list[tuple[int, int, tuple[int, ...], int]] = []

    class NotedDMA(original):  # type: ignore[misc, valid-type]
        def __setattr__(self, name: str, value: Any) -> None:
            if name == "data" and value is not None:
                shape = tuple(int(d) for d in np.shape(value))
                copies.append((int(self.src_device_id), int(self.dst_device_id), shape, int(value.nbytes)))
            super().__setattr__(name, value)

    module.DMA = NotedDMA
    try:
        yield copies
    finally:
        module.DMA = original


def reset_interpret_state(*, after_failure: bool = False) -> None:
    """Drop interpret mode's simulated memory, semaphores and race state. ``after_failure``: also JAX's
    ordered-effect runtime tokens (interpret mode runs a kernel through ordered io_callbacks, each
    computation taking the previous one's token: a failed or stopped kernel leaves an error-valued token
    that every later kernel would inherit)."""
    from jax._src import dispatch
    from jax.experimental.pallas import tpu as pltpu

    if after_failure:
        dispatch.runtime_tokens.clear()
    if hasattr(pltpu, "reset_tpu_interpret_mode_state"):
        pltpu.reset_tpu_interpret_mode_state()
        return
    module = _interpret_module()  # JAX 0.6: no public reset
    with module._shared_memory_init_lock:
        module._shared_memory = None
        module.races = None


def abort_interpreted_kernel(reason: str) -> None:
    """Make a kernel stuck in interpret mode (a wait nobody signals) stop, from another thread. Newer
    JAX polls a failure flag in every wait: set it, and every device raises and unwinds. JAX 0.6 waits
    on condition variables with no such flag: signal every semaphore far past any wait and break the
    global barrier, so the kernel runs to its end; the caller discards its result."""
    module = _interpret_module()
    shared = getattr(module, "_shared_memory", None)
    if shared is None:
        return
    if hasattr(shared, "set_failed"):
        shared.set_failed(TimeoutError(reason), top_level=False)
        return
    with shared.lock:  # pragma: no cover - JAX 0.6
        semaphores = list(getattr(shared, "sem", {}).values())
    for sem in semaphores:
        with sem.cv:
            sem.counts += 1 << 30
            sem.cv.notify_all()
    shared.barrier.abort()


def pallas_tpu_compiler_params(eqn_params: Any) -> Any | None:
    """The ``pltpu.CompilerParams`` of a traced ``pallas_call`` equation, or None if it set none.

    JAX 0.7 and later keep the object itself; 0.6 a dict ``{"mosaic_tpu": params}``.
    """
    params = eqn_params.get("compiler_params")
    if isinstance(params, Mapping):
        return params.get("mosaic_tpu") or params.get("mosaic")
    return params


def has_skip_device_barrier() -> bool:
    """``pltpu.CompilerParams(skip_device_barrier=...)`` exists (JAX 0.7.1 and later)."""
    from jax.experimental.pallas import tpu as pltpu

    return "skip_device_barrier" in inspect.signature(pltpu.CompilerParams).parameters


def unfiltered_tracebacks() -> Any:
    """Context in which JAX keeps its own frames in tracebacks (so a failure can say where JAX raised)."""
    from jax._src import config as jax_config

    return jax_config.traceback_filtering("off")


def interpreted_op_source(error: BaseException) -> str | None:
    """The source line of the traced op JAX was evaluating when ``error`` was raised, if any.

    An interpreter (Pallas' TPU interpret mode, ``jax.core.eval_jaxpr``) runs a
    kernel long after the kernel's Python has returned, so no frame of the
    kernel is on the stack; the innermost interpreter frame holding an ``eqn``
    knows which op of the kernel it was running, and where that op was written.
    """
    from jax._src import source_info_util

    found = None
    tb = error.__traceback__
    while tb is not None:
        eqn = tb.tb_frame.f_locals.get("eqn")
        if getattr(eqn, "source_info", None) is not None:
            found = eqn
        tb = tb.tb_next
    return source_info_util.summarize(found.source_info) if found is not None else None


def mlir_isa(kind: Any, thing: Any) -> bool:
    """``isinstance`` for MLIR types and attributes.

    A static ``kind.isinstance(thing)`` in the MLIR bindings of JAX 0.6; Python's
    ``isinstance`` in newer ones, which downcast types themselves.
    """
    static = getattr(kind, "isinstance", None)
    return static(thing) if static is not None else isinstance(thing, kind)


def cpu_lowering_rules() -> Any:
    """JAX's table of CPU-specific lowering rules (private: primitive -> entry), and the rule of an
    entry of it: the rule itself in JAX 0.6, a ``LoweringRuleEntry`` holding it from 0.7."""
    from jax._src.interpreters import mlir

    rules = mlir._platform_specific_lowerings["cpu"]
    return rules, mlir._lowerings, lambda entry: getattr(entry, "rule", entry)


def tpu_chips_here() -> int:
    """How many TPU chips this host has (JAX's own count; ``/dev/accel*`` and ``/dev/vfio`` devices
    where JAX's private helper is not there)."""
    try:
        from jax._src import hardware_utils

        return int(hardware_utils.num_available_tpu_chips_and_device_id()[0])
    except Exception:  # moved or renamed in another JAX
        import glob

        return len(glob.glob("/dev/accel*")) + len(glob.glob("/dev/vfio/[0-9]*"))
