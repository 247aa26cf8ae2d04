"""XLA's ``ragged-all-to-all`` on CPU, where XLA:CPU cannot run it: an exact emulation, labelled.

XLA:TPU and XLA:GPU run ``lax.ragged_all_to_all``; XLA:CPU answers "UNIMPLEMENTED: HLO opcode
`ragged-all-to-all` is not supported by XLA:CPU ThunkEmitter" (JAX 0.6.2 to 0.12 alike). A kernel
that moves its tokens with XLA's own op, as MoE layers do, would get no verdict on the machine the
suite runs on. So while the suite runs (:func:`install`, undone at its end), and only where the probe
(:func:`cpu_lacks_the_op`) finds XLA:CPU without the op, the op's primitive gets a CPU lowering of
its own: :func:`emulated`, built from collectives XLA:CPU runs. A later XLA:CPU that runs the op
is used as it is, and the lowering for TPU and GPU is never touched: the compile tiers judge the
real op.

The emulation, per device ``i`` of an axis of ``n``, for ``G = len(input_offsets)`` groups (``K = G
// n`` to each peer; peer ``j`` gets groups ``j*K .. j*K + K - 1``, the layout XLA's GPU kernel
reads):

1. each group is cut from ``operand`` into a block of ``W = min(R, S)`` rows (``R`` the operand's
   rows, ``S`` the output's), the rows past its size zero;
2. one ``all_to_all`` moves the blocks, and two more the senders' ``output_offsets`` and
   ``send_sizes`` (where each group lands on its receiver is the sender's to say: the op's rule);
3. each received block's first ``size`` rows are scattered into ``output`` at the sender's offset,
   every other row dropped, so the rows no group writes keep the caller's values.

No arithmetic: the result is the op's bit for bit on every routing the op defines (groups that
overlap, or run past a buffer, are the caller's error for the op and here alike). Its transpose is
JAX's own (the op again, with the routing transposed), so gradients go through the same lowering.
What it moves is not what the op moves (a padded block of ``min(R, S)`` rows per peer, not the
groups): the modules lowered and compiled for TPU and GPU hold the op itself, and what the op moves
is counted in a run (:func:`delivered_by`: each call hands its groups' bytes to a callback), which
the bytes checks put in place of the op's buffers, and of the emulation's all-to-alls (their
``op_name`` is :data:`FUNCTION_NAME`'s) in the module compiled for the host.
"""

from __future__ import annotations

import collections
import contextvars
import dataclasses
import functools
import math
import threading
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from conformance import compat

#: The name of the emulation's function in the modules lowered and compiled for CPU: the ``op_name``
#: of each collective it holds (:func:`is_the_emulations`).
FUNCTION_NAME = "conformance_emulated_ragged_all_to_all"

#: What every verdict of a check that ran the op on CPU says.
LABEL = (
    "XLA's ragged-all-to-all ran emulated on CPU (all-to-alls of padded groups and a masked scatter, "
    "exact: conformance.targets.cpu_ragged_all_to_all), as XLA:CPU cannot run it"
)


def _primitive() -> Any:
    from jax._src.lax import parallel

    return parallel.ragged_all_to_all_p


def emulated(
    operand: jax.Array,
    output: jax.Array,
    input_offsets: jax.Array,
    send_sizes: jax.Array,
    output_offsets: jax.Array,
    recv_sizes: jax.Array,
    *,
    axis_name: Any,
    axis_size: int,
    counted: Callable[[jax.Array], jax.Array] | None = None,
) -> jax.Array:
    """``lax.ragged_all_to_all(operand, output, ...)`` on one device of an axis of ``axis_size``, from
    ``all_to_all`` and a scatter (the module's docstring). ``recv_sizes`` is not read: the senders'
    ``send_sizes`` travel with their groups, as the op writes what is sent. ``counted`` is handed the
    bytes the op itself delivers to this device from the others (its groups' rows, as their senders
    size them), where a run counts them (:func:`delivered_by`)."""
    del recv_sizes
    n, groups = axis_size, input_offsets.shape[0]
    if groups % n:
        raise ValueError(f"ragged_all_to_all: {groups} offsets do not split over an axis of {n} devices")
    per_peer, rows, slots = groups // n, operand.shape[0], output.shape[0]
    width, trailing = max(min(rows, slots), 1), operand.shape[1:]
    step = jnp.arange(width, dtype=input_offsets.dtype)
    source = input_offsets[:, None] + step  # [G, W]
    sent = step < send_sizes[:, None]
    blocks = jnp.take(operand, jnp.clip(source, 0, rows - 1), axis=0)  # [G, W, ...]
    blocks = jnp.where(sent.reshape(sent.shape + (1,) * len(trailing)), blocks, jnp.zeros_like(blocks))

    def exchanged(x: jax.Array) -> jax.Array:  # [G, ...] -> [n, K, ...], peer j's groups for me
        return lax.all_to_all(x.reshape(n, per_peer, *x.shape[1:]), axis_name, 0, 0)

    received, at, sizes = exchanged(blocks), exchanged(output_offsets), exchanged(send_sizes)
    target = at[..., None].astype(jnp.int32) + step.astype(jnp.int32)  # [n, K, W]
    target = jnp.where(step < sizes[..., None], target, slots)  # past the buffer: dropped
    if counted is not None:
        rows = sizes.sum() - sizes[lax.axis_index(axis_name)].sum()  # from the others
        # the count (a zero) is read where the rows land: where XLA removes an op nothing reads, its
        # count goes with it, as the op goes from the module compiled for a target
        target = target + counted(rows * math.prod(trailing) * operand.dtype.itemsize)
    return output.at[target.reshape(-1)].set(received.reshape(-1, *trailing), mode="drop")


def _axis_size(ctx: Any, axis_name: Any) -> int:
    """The size of ``axis_name`` (a name or a tuple of names) in the lowering's mesh."""
    names = axis_name if isinstance(axis_name, tuple) else (axis_name,)
    context = ctx.module_context.axis_context
    mesh = getattr(context, "mesh", None)
    shape = dict(mesh.shape) if mesh is not None else {}
    if not all(name in shape for name in names):
        raise NotImplementedError(
            f"ragged_all_to_all emulated on CPU: axis {axis_name!r} is not an axis of the lowering's "
            f"mesh ({type(context).__name__})"
        )
    return math.prod(int(shape[name]) for name in names)


def _lowering(ctx: Any, *args: Any, axis_name: Any, axis_index_groups: Any) -> Any:
    from jax.interpreters import mlir

    tally = _COUNTING.get()
    if tally is None and (_PROBING.get() or cpu_lacks_the_op() is None):  # XLA:CPU's own op, as JAX lowers it
        return _generic_rule()(ctx, *args, axis_name=axis_name, axis_index_groups=axis_index_groups)
    if axis_index_groups is not None:
        raise NotImplementedError("ragged_all_to_all emulated on CPU: axis_index_groups is not supported")
    size, devices = _axis_size(ctx, axis_name), _device_axes(ctx)

    def counted(nbytes: jax.Array) -> jax.Array:
        where = tuple(lax.axis_index(name) for name in devices)
        said, add = jax.ShapeDtypeStruct((), np.int32), functools.partial(tally.add, devices)
        return jax.pure_callback(add, said, where, nbytes, vmap_method="sequential")

    # a function of its own, by name: the module lowered for CPU calls it, and the compiled module's
    # metadata names it at each collective it holds (for a reader of the HLO)
    def conformance_emulated_ragged_all_to_all(*operands: jax.Array) -> jax.Array:
        return emulated(
            *operands, axis_name=axis_name, axis_size=size, counted=None if tally is None else counted
        )

    called = jax.jit(conformance_emulated_ragged_all_to_all, inline=False)
    return mlir.lower_fun(called, multiple_results=False)(ctx, *args)


def _device_axes(ctx: Any) -> tuple[str, ...]:
    """The lowering's manual mesh axes: a device's indices along them name it in a count."""
    context = ctx.module_context.axis_context
    manual = getattr(context, "manual_axes", None)
    mesh = getattr(context, "mesh", None)
    names = tuple(getattr(mesh, "axis_names", ()))
    return tuple(name for name in names if manual is None or name in manual)


@dataclasses.dataclass
class Delivered:
    """What XLA's ragged all-to-all delivered in one counted run (:func:`delivered_by`): bytes from
    the other devices, summed over the op's calls, by device (``x=1, y=0``: its indices along the
    mesh's manual axes)."""

    by_device: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    calls: int = 0
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock, repr=False)

    def add(self, axes: tuple[str, ...], where: tuple[Any, ...], nbytes: Any) -> np.ndarray:
        """One device's call (a callback from the run): returns the zero the emulation reads."""
        device = ", ".join(f"{axis}={int(i)}" for axis, i in zip(axes, where, strict=True))
        with self.lock:
            self.by_device[device] += int(nbytes)
            self.calls += 1
        return np.zeros((), np.int32)

    @property
    def most_received(self) -> tuple[str, int]:
        """The device the op delivered most to, and its bytes."""
        return max(self.by_device.items(), key=lambda item: (item[1], item[0]), default=("none", 0))


#: The count a run of :func:`delivered_by` fills, while it lowers its program.
_COUNTING: contextvars.ContextVar[Delivered | None] = contextvars.ContextVar(
    "conformance_counting_ragged_all_to_all", default=None
)


def delivered_by(fn: Callable[..., Any], *args: Any) -> Delivered:
    """Run ``fn(*args)`` once on CPU, in a program of its own, with the bytes every call of XLA's
    ragged all-to-all in it delivers counted: the op moves its groups, as their senders size them,
    and nothing else, which a module's text cannot say (its sizes are data). Every call runs
    :func:`emulated` here, where XLA:CPU has the op or not."""
    tally = Delivered()
    reset = _COUNTING.set(tally)
    try:
        # lowered in this context, cached nowhere else; compiled as every CPU program of the suite is
        # (compat.cpu_compiler_options: 0.1-0.13 s on 8 devices, where XLA:CPU's defaults took 0.35-0.5 s)
        lowered = jax.jit(lambda *operands: fn(*operands)).lower(*args)
        jax.block_until_ready(lowered.compile(compiler_options=compat.cpu_compiler_options())(*args))
    finally:
        _COUNTING.reset(reset)
    return tally


def _generic_rule() -> Any:
    _, generic, rule_of = compat.cpu_lowering_rules()
    return rule_of(generic[_primitive()])


#: Set while :func:`cpu_lacks_the_op` compiles the op with JAX's own lowering.
_PROBING = contextvars.ContextVar("conformance_probing_ragged_all_to_all", default=False)


@functools.cache
def cpu_lacks_the_op() -> str | None:
    """XLA:CPU's refusal of the op (its first line), probed once per process on a one-device mesh
    (at the first lowering of the op for CPU: the backend is up by then); ``None`` where XLA:CPU
    compiles it. The probe runs in a thread of its own: JAX's context (the mesh of the lowering that
    asked, among the rest) is the thread's, and the probe's program is a program of its own."""
    said: list[str | None] = []
    failed: list[BaseException] = []

    def probe_in_thread() -> None:
        try:
            said.append(_probe())
        except BaseException as error:  # handed to the caller's thread
            failed.append(error)

    thread = threading.Thread(target=probe_in_thread, name="conformance-probe-ragged-all-to-all")
    thread.start()
    thread.join()
    if failed:
        raise failed[0]
    return said[0]


def _probe() -> str | None:
    mesh = jax.sharding.Mesh(np.array(jax.devices("cpu")[:1]), ("probe",))
    spec = jax.sharding.PartitionSpec("probe")

    def probe(x: jax.Array, sizes: jax.Array) -> jax.Array:
        return lax.ragged_all_to_all(x, x, sizes, sizes, sizes, sizes, axis_name="probe")

    program = jax.jit(jax.shard_map(probe, mesh=mesh, in_specs=(spec, spec), out_specs=spec))
    _PROBING.set(True)  # this thread's own
    try:
        # run, not only compiled: XLA:CPU of jaxlib 0.6 compiles the op and refuses it when it runs
        jax.block_until_ready(program(jnp.zeros((1, 1), jnp.float32), jnp.zeros((1,), jnp.int32)))
    except Exception as refusal:  # XLA's words, quoted
        if "ragged" not in str(refusal).lower():
            raise
        return str(refusal).strip().splitlines()[0]
    return None


def install() -> Callable[[], None]:
    """Gives the op's primitive a CPU lowering of its own: :func:`emulated` where XLA:CPU lacks the op
    (probed at the first lowering, so installing starts no backend), JAX's own lowering where it has
    it. Returns the undo, which restores what was there and drops JAX's caches of programs lowered
    with it, so a process that goes on after the suite is untouched."""
    from jax.interpreters import mlir

    (rules, _, rule_of), primitive = compat.cpu_lowering_rules(), _primitive()
    before = rules.get(primitive)
    if rule_of(before) is _lowering:
        return lambda: None  # installed already (a nested run of the suite in one process)
    mlir.register_lowering(primitive, _lowering, platform="cpu")
    jax.clear_caches()  # a program lowered before keeps the lowering it had

    def undo() -> None:
        if before is None:
            rules.pop(primitive, None)
        else:
            rules[primitive] = before
        jax.clear_caches()

    return undo


def is_the_emulations(op_name: str) -> bool:
    """Whether a collective of a module compiled for CPU (its ``op_name``) is one of the emulation's."""
    return f"jit({FUNCTION_NAME})/" in op_name


def refusal_without_the_emulation(case: Any, error: Exception) -> str:
    """Where XLA:CPU refused the op (this module's lowering not installed in the process), the
    platform's limit in words, as for a family's baseline; else ``""``."""
    said = str(error)
    if getattr(case, "platform", "") != "cpu" or "ragged-all-to-all" not in said or "XLA:CPU" not in said:
        return ""
    return (
        f"{case.impl} calls XLA's ragged all-to-all, which XLA:CPU cannot run "
        f"({said.strip().splitlines()[0]}), "
        "and the suite's CPU emulation of it is not installed in this process (conformance.targets."
        "cpu_ragged_all_to_all.install(), as the suite's own entry points do): the platform's limit, not "
        "the kernel's"
    )


def installed() -> bool:
    """Whether the op's primitive has this module's CPU lowering (:func:`install`)."""
    rules, _, rule_of = compat.cpu_lowering_rules()
    return rule_of(rules.get(_primitive())) is _lowering


def emulating() -> bool:
    """Whether this process runs the op on CPU by :func:`emulated`: installed, and XLA:CPU lacks it."""
    return installed() and cpu_lacks_the_op() is not None


def calls_the_op(jaxpr: Any) -> bool:
    """Whether a (closed) jaxpr binds the op, in any sub-jaxpr (shard_map, jit, loops, custom_vjp)."""
    inner = getattr(jaxpr, "jaxpr", jaxpr)
    return any(
        eqn.primitive is _primitive() or any(calls_the_op(sub) for sub in _subjaxprs(eqn.params))
        for eqn in inner.eqns
    )


def implementation_calls_the_op(case: Any, *, mesh: Any = None) -> bool:
    """Whether ``case``'s implementation binds the op (its program traced once per session, at the
    first case asked about, on ``mesh`` where given (a topology's): one implementation's code path
    calls the op for every case or none). A kernel that does not trace is not known to (its checks
    say why), and is asked again next time."""
    from conformance import runner, session

    key, known = (case.family, case.impl), session.current().calls_ragged_all_to_all
    if key not in known:
        try:  # a mesh larger than the host's (a compile tier's) builds nothing here
            fn = runner.jitted_for(case) if mesh is None else runner.kernel_on(case, mesh)
            traced = jax.make_jaxpr(fn)(*runner.abstract_args(case, mesh=mesh))
        except Exception:
            return False
        known[key] = calls_the_op(traced)
    return known[key]


def _subjaxprs(params: dict[str, Any]) -> Iterator[Any]:
    for value in params.values():
        for item in value if isinstance(value, (tuple, list)) else (value,):
            if hasattr(item, "eqns") or hasattr(getattr(item, "jaxpr", None), "eqns"):
                yield item
