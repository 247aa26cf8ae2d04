"""The real TPU compiler on any host: libtpu's XLA:TPU and Mosaic, compiling for TPU topologies.

With libtpu installed (``pip install "jax[tpu]==<the installed JAX>"``, or this package's
``tpu`` extra: the libtpu that JAX pins), ``jax.experimental.topologies`` describes a TPU
slice (``v5e:2x4``: 8 v5e chips) whose devices a mesh can be built on; ``jit(f).lower(*abstract
arguments on that mesh).compile()`` then runs XLA:TPU and Mosaic for real, without a chip and
without executing. What the compiler refuses, a chip would refuse; what it compiles, it schedules
and lays out as on the chip. It is the suite's judge of TPU layout, schedule, memory and pod
scale; where no libtpu can be had, those checks skip, naming the install command.

On a host without chips libtpu logs errors about ``TPU_ACCELERATOR_TYPE`` and worker host names when
it loads (it looks for a TPU VM's metadata); they are harmless, and the pytest plugin keeps them
quiet (:func:`chipless_start`).
"""

from __future__ import annotations

import concurrent.futures
import contextvars
import dataclasses
import functools
import importlib.metadata
import math
import re
import sys
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from conformance import compat, targets
from conformance.fixtures.meshes import MeshConfig, mesh_over, mesh_over_axis_types
from conformance.targets import compilation_cache, target_compiles

#: How the suite's messages name this compiler's target.
NAME = "TPU"
#: What one device of the target is called.
DEVICE = "chip"

#: The topology a mesh of each standard size compiles for: the v5e slice of that many chips. (A v5e
#: program spans its whole slice: libtpu 0.0.42 refuses 65 chips of a 256-chip one, "device_count ==
#: target.Topology()->LogicalDeviceCount"; and the smallest slice is 2x2.)
V5E_BY_CHIPS = {
    4: "v5e:2x2",
    8: "v5e:2x4",
    16: "v5e:4x4",
    64: "v5e:8x8",
    256: "v5e:16x16",
}


class CompilerRefusal(Exception):
    """The compiler (libtpu's here, XLA:GPU's in :mod:`conformance.targets.gpu_compiler`) refused the program;
    the message is the compiler's, quoted."""


#: How libtpu is started on a host without TPU chips, where it only compiles: it would otherwise look
#: up a TPU VM's metadata and log errors when it finds none ("unexpected worker hostname 'WARNING:
#: could not determine TPU worker hostnames'", "Failed to find host bounds for accelerator type"),
#: and take a lock that leaves a second process (a pytest-xdist worker, a self-test's subprocess)
#: without it ("Run sudo rm /tmp/libtpu_lockfile"), though with no chips there is nothing to share.
#: Compiling for a topology reads none of these: the modules compiled are the same (libtpu 0.0.42).
CHIPLESS_START = {
    "TPU_WORKER_HOSTNAMES": "localhost",
    "TPU_ACCELERATOR_TYPE": "v5litepod-8",
    "ALLOW_MULTIPLE_LIBTPU_LOAD": "1",
}


def chipless_start() -> Callable[[], None]:
    """On a host without TPU chips, before libtpu loads: set :data:`CHIPLESS_START` where unset (this
    process and those it starts); a TPU VM is left as it is. Returns the closure that undoes it."""
    if compat.tpu_chips_here():
        return lambda: None
    return targets.environment_defaults(CHIPLESS_START)


def libtpu_version() -> str | None:
    """The installed libtpu's version, or ``None``."""
    for name in ("libtpu", "libtpu-nightly"):
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def pinned_libtpu_version() -> str | None:
    """The libtpu version the installed JAX pins in its ``tpu`` extra (``0.0.42`` for 0.10.2), read
    from JAX's own metadata; ``None`` where it names none."""
    for requirement in importlib.metadata.requires("jax") or ():
        found = re.match(r"libtpu(?:-nightly)?\s*==\s*([0-9.]+)", requirement)
        if found and "tpu" in requirement.split(";", 1)[-1]:
            return found.group(1).rstrip(".")
    return None


def version_tuple(version: str | None) -> tuple[int, ...]:
    """``"0.0.42.1"`` -> ``(0, 0, 42, 1)``; ``None`` -> ``()``."""
    return tuple(int(part) for part in re.findall(r"\d+", version or ""))


def libtpu_in_use() -> tuple[int, ...]:
    """The libtpu that compiles for TPU here: the installed one, else the one the installed JAX pins
    (what a TPU host with this JAX runs); ``()`` if neither is known."""
    return version_tuple(libtpu_version() or pinned_libtpu_version())


def install_command() -> str:
    """What installs the libtpu the installed JAX pins."""
    extra = 'pip install "jax-collective-conformance[tpu]"'
    return f'pip install "jax[tpu]=={jax.__version__}" (or {extra})'


@functools.cache
def unavailable_reason() -> str | None:
    """Why this host cannot compile for TPU (no libtpu, or no topology from it); ``None`` if it can."""
    if libtpu_version() is None:
        return f"the real TPU compiler needs libtpu, which is not installed: {install_command()}"
    try:
        topology_devices("v5e:2x2")
    except Exception as e:  # whatever libtpu says: quoted, never guessed at
        reason = f"libtpu {libtpu_version()} is installed but gives no TPU topology: {type(e).__name__}: {e}"
        if "lockfile" in str(e):
            reason += (
                " (another process of this host holds libtpu; on a host without TPU chips, "
                "ALLOW_MULTIPLE_LIBTPU_LOAD=1 lets several processes load it)"
            )
        return reason
    return None


def available() -> bool:
    return unavailable_reason() is None


@functools.cache
def topology_devices(name: str) -> tuple[Any, ...]:
    """The devices of the TPU topology ``name`` (``"v5e:2x4"``, ``"v6e:2x4"``, ``"v4:2x2x1"``)."""
    from jax.experimental import topologies

    return tuple(topologies.get_topology_desc(topology_name=name, platform="tpu").devices)


#: The slice whose chip a Pallas TPU kernel is traced for under interpret mode (:func:`traced_on_a_chip`).
INTERPRETED_AS = "v5e:2x2"


def traced_on_a_chip(fn: Callable[..., Any], chip: Any | None = None) -> Callable[..., Any]:
    """``fn`` traced as for a TPU chip: ``chip`` (a topology's), else the first of :data:`INTERPRETED_AS`
    where libtpu is installed (``fn`` as it is where not).

    Pallas TPU helpers read the chip's generation while a kernel is traced: ``pltpu.emit_pipeline``
    tiles its DMA windows by it, and on a CPU host raises "Unsupported TPU device kind: cpu" (JAX 0.6.2
    to 0.12), so the tutorial's HBM reduce-scatter could not be traced for interpret mode, nor for a
    topology's chips. Only what those helpers read changes (:func:`conformance.compat.cpu_traced_as`):
    every operand runs where it is, under interpret mode, as before."""
    if chip is None:
        if not available():
            return fn
        chip = topology_devices(INTERPRETED_AS)[0]

    @functools.wraps(fn)
    def on_a_chip(*args: Any, **kwargs: Any) -> Any:
        undo = compat.cpu_traced_as(chip)
        try:
            return fn(*args, **kwargs)
        finally:
            undo()

    return on_a_chip


#: The slice for a mesh of 1 or 2 chips: its first chips (a v6e program may span part of its slice).
SMALLEST_SLICE = "v6e:2x2"
#: The most chips a mesh of the suite compiles for.
MOST_CHIPS = 256


def topology_for(num_devices: int) -> str:
    """The topology a mesh of ``num_devices`` compiles for: the v5e slice of that many chips; for 1 or
    2 chips the first of :data:`SMALLEST_SLICE`; else the smallest v5p slice (2x2xk, hosts of 4 chips)
    whose chip count is a multiple of ``num_devices``, of which it takes the first chips.

    A program may span part of its slice only where each collective's group divides the slice's chip
    count: libtpu 0.0.42 compiles XLA's all-gather over 6 chips of ``v5p:2x2x3`` (12 chips) and refuses
    it over 6 of ``v6e:2x4`` ("RET_CHECK failure ... total_device_count % num_participants_per_group
    == 0"). No TPU slice has 3, 5, 6 or 7 chips, so a ring of that length runs on part of one."""
    if not 1 <= num_devices <= MOST_CHIPS:
        raise ValueError(f"no standard TPU topology of {num_devices} chips (1 to {MOST_CHIPS})")
    if num_devices in V5E_BY_CHIPS:
        return V5E_BY_CHIPS[num_devices]
    if num_devices <= 2:
        return SMALLEST_SLICE
    return f"v5p:2x2x{num_devices // math.gcd(num_devices, 4)}"


def mesh_on(config: MeshConfig, topology: str | None = None) -> jax.sharding.Mesh:
    """The mesh of ``config`` over ``topology`` (default: :func:`topology_for` its size). A whole
    slice is ordered by ``jax.make_mesh`` for the chips' torus; a mesh of fewer chips takes the
    slice's first ones in its order (``jax.make_mesh`` takes only whole slices of a TPU). A config's
    own device order (``8-x-explicit-reversed``) is applied to that order."""
    topology = topology or topology_for(config.num_devices)
    devices = topology_devices(topology)
    if config.num_devices > len(devices):
        raise ValueError(f"{config.label} needs {config.num_devices} devices; {topology} has {len(devices)}")
    if config.num_devices == len(devices):
        in_order = dataclasses.replace(config, device_order="ids")
        mesh = mesh_over(in_order, devices)
        if config.device_order == "ids":
            return mesh
        base = list(mesh.devices.flat)
    else:
        base = list(devices[: config.num_devices])
    ordered = np.array([base[i] for i in config.permutation]).reshape(config.shape)
    if not _has_memory(ordered.flat[0]):
        raise compat.HostLimit(
            f"libtpu {libtpu_version()}'s {topology} gives chip {ordered.flat[0].id} no memory "
            f"(DefaultMemory is not supported) and JAX {jax.__version__} takes a mesh's memory from its "
            f"first chip: {config.label} cannot be compiled for {topology} here (JAX 0.10 with libtpu "
            "0.0.42 can)"
        )
    return jax.sharding.Mesh(ordered, config.axis_names, axis_types=mesh_over_axis_types(config))


def _has_memory(device: Any) -> bool:
    """Whether a topology's chip has a default memory (libtpu 0.0.17 gives a second host's chips none)."""
    try:
        device.default_memory()
    except Exception:  # XlaRuntimeError: UNIMPLEMENTED
        return False
    return True


def judge(topology: str) -> str:
    """Who gives a verdict compiled for ``topology``: ``libtpu 0.0.42.1 (v5e:2x4)``."""
    return f"libtpu {libtpu_version()} ({topology})"


def compile_on(
    fn: Any, args: tuple[jax.ShapeDtypeStruct, ...], *, options: dict[str, str] | None = None
) -> target_compiles.TargetCompile:
    """``jit(fn)`` lowered and compiled for the devices ``args`` are sharded on, as on a TPU host,
    under ``LIBTPU_INIT_ARGS``, the run's ``--compiler-option`` pairs libtpu knows and ``options``:
    :class:`CompilerRefusal` quoting the toolchain where it refuses (JAX's side of Mosaic while
    lowering, XLA:TPU and Mosaic in libtpu while compiling). A kernel's own
    :class:`~conformance.targets.mosaic.TpuConstraintError` propagates as it is. A program compiled before
    (by another worker, an earlier run) is read back (:mod:`conformance.targets.target_compiles`)."""
    from conformance.targets.mosaic import TpuConstraintError

    chips = [a.sharding for a in jax.tree.leaves(args) if getattr(a, "sharding", None) is not None]
    chip = min(chips[0].device_set, key=lambda d: d.id) if chips else None
    # what raises here is the kernel's own, raised while tracing
    traced = jax.jit(traced_on_a_chip(fn, chip) if chip else fn).trace(*args)
    given = compile_options(options)
    try:
        with compilation_cache.bypassed():
            lowered = traced.lower()
            return target_compiles.compile_lowered(
                lowered,
                compiler=f"libtpu {libtpu_version()}",
                devices=target_compiles.device_ids(args),
                options=given or None,
            )
    except TpuConstraintError:
        raise
    except target_compiles.CompileTimeout as timeout:
        timeout.where = target_compiles.devices_text(args)
        raise
    except target_compiles.Refused as e:
        raise CompilerRefusal(first_lines(str(e))) from e
    except Exception as e:  # XlaRuntimeError, JaxRuntimeError, Mosaic's lowering errors: their own words
        raise CompilerRefusal(f"{type(e).__name__}: {first_lines(str(e))}") from e


@functools.cache
def ragged_all_to_all_refusal(topology: str) -> str | None:
    """libtpu's refusal of XLA's ``lax.ragged_all_to_all`` itself on ``topology`` (``None`` where it
    compiles): a one-op program over the whole slice, one row a peer, compiled as any kernel is (so kept,
    and read back by every worker and later run, :mod:`conformance.targets.target_compiles`).

    libtpu 0.0.17, 0.0.42 and 0.0.50 refuse the op on v5e slices of 64 and 256 chips, whatever the program
    ("Ragged all-to-all is currently not supported in limited ICI routing settings", a RET_CHECK on the
    target, not on the program), and at 256 chips that refusal alone takes 10-20 s of each kernel's
    compile. Asked once per slice, it answers for every kernel that calls the op there; a later libtpu
    that compiles it answers ``None``, and each kernel is compiled as before. Traced on a thread of its
    own: a program's locations (its call stack) are part of its key, and are then the same whichever check
    asks first."""
    context = contextvars.copy_context()  # the session, whose store keeps the compile
    with concurrent.futures.ThreadPoolExecutor(1) as thread:
        return thread.submit(context.run, _ragged_all_to_all_probe, topology).result()


def _ragged_all_to_all_probe(topology: str) -> str | None:
    import jax.numpy as jnp
    from jax import lax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    devices = topology_devices(topology)
    n = len(devices)
    mesh = jax.sharding.Mesh(np.array(devices), ("x",))

    def one_row_a_peer(x: jax.Array, ones: jax.Array) -> jax.Array:
        # row j to peer j, landing in row (this device's index) there
        me = jnp.full((n,), lax.axis_index("x"), jnp.int32)
        return lax.ragged_all_to_all(x, x, jnp.arange(n, dtype=jnp.int32), ones, me, ones, axis_name="x")

    fn = jax.shard_map(one_row_a_peer, mesh=mesh, in_specs=(P("x"), P("x")), out_specs=P("x"))
    sharded = NamedSharding(mesh, P("x"))
    args = (
        jax.ShapeDtypeStruct((n * n, 128), jnp.bfloat16, sharding=sharded),
        jax.ShapeDtypeStruct((n * n,), jnp.int32, sharding=sharded),
    )
    try:
        compile_on(fn, args)
    except CompilerRefusal as refusal:
        said = str(refusal)
        # a refusal that does not name the op (the probe's own program, on some JAX) answers nothing
        return said if "ragged all-to-all" in said.lower() or "ragged_all_to_all" in said.lower() else None
    return None


def compile_options(options: dict[str, Any] | None = None) -> dict[str, Any]:
    """What :func:`compile_on` gives libtpu besides ``LIBTPU_INIT_ARGS``: the run's
    ``--compiler-option`` pairs it knows, then ``options``."""
    return {**target_compiles.user_options(sys.modules[__name__]), **(options or {})}


def first_lines(message: str, limit: int = 600) -> str:
    """A compiler message without its trailing source-location trace, at most ``limit`` characters."""
    text = message.split("=== Source Location Trace", 1)[0].strip()
    return text if len(text) <= limit else text[: limit - 3] + "..."
