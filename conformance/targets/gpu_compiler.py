"""The real GPU compiler for a GPU target this host does not have: XLA:GPU compiling for 8 H100s.

Two routes reach XLA:GPU's compile for a multi-GPU target; both give the module XLA:GPU really
schedules (its latency-hiding scheduler, its asynchronous collectives) and its memory, and run
nothing:

1. **Deviceless, on any host.** With the CUDA plugin installed (``pip install
   "jax[cuda12-local]==<the installed JAX>"``, or this package's ``gpu-compile`` extra: the plugin
   without CUDA's libraries), ``jax.experimental.topologies.get_topology_desc(platform="cuda",
   topology="1x1x8", target_config=...)`` describes 8 GPUs of one host from a target config (a
   ``GpuTargetConfigProto`` in text form: :data:`TARGETS`, read off a real device), without a GPU.
   A host without CUDA's libraries needs ``JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1`` before JAX loads the
   plugin, or the plugin does not register: :func:`deviceless_start` sets it on a host with no
   NVIDIA GPU (the pytest plugin and ``python -m conformance`` call it at start).
2. **On one GPU** (:func:`use_mock_topology`, before the backend starts): ``jax_mock_gpu_topology``
   (``"1x8x1"``: 8 hosts of 1 GPU) makes the one GPU's client compile for 8 (the process then
   believes itself one of 8: run only the ``gpu_compile`` tests so). :func:`topologies_for` then
   names the mocked topology instead.

A topology is named ``<target>:<slices>x<hosts per slice>x<GPUs per host>``: ``h100:1x1x8`` (an
8-GPU NVLink host), ``h100:1x2x8`` (two of them). Where neither route is open here, the checks of
the GPU compile tier skip, naming the install command.
"""

from __future__ import annotations

import dataclasses
import functools
import glob
import importlib.metadata
import os
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np

from conformance import native_logs, targets
from conformance.fixtures.meshes import MeshConfig, mesh_over
from conformance.targets import compilation_cache, target_compiles
from conformance.targets.tpu_compiler import CompilerRefusal, first_lines

__all__ = ["CompilerRefusal"]

#: How the suite's messages name this compiler's target.
NAME = "GPU"
#: What one device of the target is called.
DEVICE = "GPU"

#: The variable that starts route 2 (the pytest plugin applies it before JAX's backends start).
MOCK_VARIABLE = "CONFORMANCE_GPU_MOCK_TOPOLOGY"


@dataclasses.dataclass(frozen=True)
class GpuTarget:
    """A GPU model XLA:GPU can compile for without one: its target config, read off the device."""

    name: str  #: ``"h100"``
    config_file: str  #: in ``conformance/targets/gpu_targets``
    device_kind: str  #: as JAX names the device

    def config_text(self) -> str:
        return (Path(__file__).parent / "gpu_targets" / self.config_file).read_text()


#: The GPUs whose target config was read off a real device. Route 1 compiles the standard rings for
#: H100s (:data:`TOPOLOGY_BY_GPUS`); route 2 runs on any GPU named here.
TARGETS = {
    "h100": GpuTarget("h100", "h100_sxm.txtpb", "NVIDIA H100 80GB HBM3"),
    "h200": GpuTarget("h200", "h200.txtpb", "NVIDIA H200"),
}

#: The topology a ring of each length compiles for (route 1): one NVLink host of 8 GPUs, two of them,
#: and three (a ring of 24, no power of two, two of its hops between hosts). GPU topologies are hosts
#: of GPUs, not tori: there is no 3-D slice to compile for.
TOPOLOGY_BY_GPUS = {8: "h100:1x1x8", 16: "h100:1x2x8", 24: "h100:1x3x8"}


def plugin_version() -> str | None:
    """``jax-cuda12-plugin 0.10.2`` (or the CUDA 13 one) where one is installed, else ``None``."""
    for name in ("jax-cuda12-plugin", "jax-cuda13-plugin"):
        try:
            return f"{name} {importlib.metadata.version(name)}"
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def install_command() -> str:
    """What installs the CUDA plugin the installed JAX pins, without CUDA's libraries."""
    return f'pip install "jax[cuda12-local]=={jax.__version__}" (or the suite\'s gpu-compile extra)'


def mock_topology() -> str | None:
    """The mocked topology this process's GPU client compiles for (route 2), or ``None``."""
    return jax.config.values.get("jax_mock_gpu_topology") or None


def use_mock_topology(topology: str) -> None:
    """Route 2: the one GPU's client compiles for ``topology`` (``"1x8x1"``). Call before JAX's
    backends start (the pytest plugin does, from :data:`MOCK_VARIABLE`)."""
    if not re.fullmatch(r"\d+x\d+x\d+", topology):
        raise ValueError(f"{MOCK_VARIABLE}={topology!r}: expected <slices>x<hosts per slice>x<GPUs per host>")
    jax.config.update("jax_mock_gpu_topology", topology)


#: Set where unset before JAX loads its CUDA plugin on a host with no NVIDIA GPU (route 1): the plugin
#: otherwise checks CUDA's libraries as it loads, and where they are absent (the ``gpu-compile`` extra
#: installs none) it does not register, so that JAX answers "topology not implemented for cuda".
DEVICELESS_START = {"JAX_SKIP_CUDA_CONSTRAINTS_CHECK": "1"}


def nvidia_gpus_here() -> bool:
    """Whether this host has an NVIDIA GPU its driver exposes (``/dev/nvidia0``...), read without
    starting any backend."""
    return bool(glob.glob("/dev/nvidia[0-9]*")) or os.path.exists("/proc/driver/nvidia/version")


def deviceless_start() -> Callable[[], None]:
    """On a host without an NVIDIA GPU where JAX's CUDA plugin is installed, before it loads: set
    :data:`DEVICELESS_START` where unset (this process and those it starts), so that route 1 opens
    with no step of the user's; a GPU host is left as it is (there the plugin's check of CUDA's
    libraries is worth its words). Returns the closure that undoes it."""
    if plugin_version() is None or nvidia_gpus_here():
        return lambda: None
    return targets.environment_defaults(DEVICELESS_START)


def configure_from_environment() -> None:
    """Route 2 where :data:`MOCK_VARIABLE` asks for it (the pytest plugin calls this at start)."""
    if os.environ.get(MOCK_VARIABLE):
        use_mock_topology(os.environ[MOCK_VARIABLE])


def topologies_for(num_devices: int) -> tuple[str, ...]:
    """The topologies a ring of ``num_devices`` compiles for: the mocked one where route 2 is in use
    (if it has that many GPUs), else :data:`TOPOLOGY_BY_GPUS`."""
    mocked = mock_topology()
    if mocked is not None:
        gpus = int(np.prod([int(k) for k in mocked.split("x")]))
        return (f"{_real_target()}:{mocked}",) if gpus == num_devices else ()
    found = TOPOLOGY_BY_GPUS.get(num_devices)
    return (found,) if found else ()


def topology_for(num_devices: int) -> str:
    """The topology a mesh of ``num_devices`` compiles for by default: the mocked one (route 2), else
    the smallest of :data:`TOPOLOGY_BY_GPUS` that holds it (its first GPUs)."""
    mocked = mock_topology()
    if mocked is not None:
        return f"{_real_target()}:{mocked}"
    for gpus, name in sorted(TOPOLOGY_BY_GPUS.items()):
        if gpus >= num_devices:
            return name
    raise ValueError(f"no standard GPU topology of {num_devices} GPUs (at most {max(TOPOLOGY_BY_GPUS)})")


@functools.cache
def unavailable_reason() -> str | None:
    """Why this host cannot compile for a GPU target (no CUDA plugin, or no topology from it);
    ``None`` if it can."""
    if mock_topology() is not None:
        return (
            None
            if _real_target()
            else "a mocked GPU topology is set but this host's GPU is not a known target"
        )
    if plugin_version() is None:
        return f"XLA:GPU without a GPU needs JAX's CUDA plugin, which is not installed: {install_command()}"
    try:
        topology_devices(TOPOLOGY_BY_GPUS[8])
    except Exception as e:  # whatever the plugin says: quoted, never guessed at
        said = f"{type(e).__name__}: {first_lines(str(e))}"
        return f"{plugin_version()} is installed but gives no GPU topology: {said}"
    return None


def available() -> bool:
    return unavailable_reason() is None


def _real_target() -> str | None:
    """The :data:`TARGETS` name of this host's GPU (route 2), or ``None``."""
    try:
        kind = jax.devices("gpu")[0].device_kind
    except RuntimeError:
        return None
    return next((t.name for t in TARGETS.values() if t.device_kind == kind), None)


@functools.cache
def topology_devices(topology: str) -> tuple[Any, ...]:
    """The devices of ``topology`` (``"h100:1x1x8"``): the mocked GPU client's (route 2) or a
    compile-only topology's from the target config (route 1)."""
    target, _, shape = topology.partition(":")
    if target not in TARGETS or not re.fullmatch(r"\d+x\d+x\d+", shape):
        raise ValueError(
            f"unknown GPU topology {topology!r}; e.g. {TOPOLOGY_BY_GPUS[8]!r} ({', '.join(TARGETS)})"
        )
    if mock_topology() is not None:
        return tuple(jax.devices("gpu"))
    config, _ = target_config_for_plugin(target)
    from jax.experimental import topologies

    return tuple(topologies.get_topology_desc(platform="cuda", topology=shape, target_config=config).devices)


@functools.cache
def target_config_for_plugin(target: str) -> tuple[str, tuple[str, ...]]:
    """``target``'s config as the installed CUDA plugin reads it, and the fields it is given without
    (:func:`readable_target_config`)."""
    return readable_target_config(TARGETS[target].config_text(), "1x1x8")


_UNKNOWN_FIELD = re.compile(r'(\d+):\d+: Message type "([\w.]+)" has no field named "(\w+)"')


def readable_target_config(text: str, shape: str) -> tuple[str, tuple[str, ...]]:
    """``text`` as the installed CUDA plugin reads it, and the fields dropped for it: a target config
    read off a device by a newer XLA names fields an older one's proto lacks, which the older
    compiler would not use; each such field (named in protobuf's parse error) is removed in turn. Any
    other parse error raises, quoting protobuf."""
    from jax.experimental import topologies

    lines, dropped = text.splitlines(), []
    for _ in range(64):
        said: list[str] = []
        with native_logs.stderr_captured(said):
            try:
                topologies.get_topology_desc(platform="cuda", topology=shape, target_config="\n".join(lines))
                return "\n".join(lines), tuple(dropped)
            except Exception as e:
                if "GpuTargetConfigProto" not in str(e):
                    raise
                error = e
        found = _UNKNOWN_FIELD.search(said[0])
        if found is None:
            raise RuntimeError(
                f"the CUDA plugin cannot read the target config: {error}; protobuf: {said[0]!r}"
            )
        start = int(found.group(1)) - 1
        end, depth = start, lines[start].count("{") - lines[start].count("}")
        while depth > 0:
            end += 1
            depth += lines[end].count("{") - lines[end].count("}")
        del lines[start : end + 1]
        dropped.append(f"{found.group(2).rsplit('.', 1)[-1]}.{found.group(3)}")
    raise RuntimeError(f"the CUDA plugin rejects more than 64 fields of the target config: {dropped}")


def mesh_on(config: MeshConfig, topology: str | None = None) -> jax.sharding.Mesh:
    """The mesh of ``config`` over the first GPUs of ``topology`` (default :func:`topology_for` its
    size), in device order (the config's own device order applied to them)."""
    topology = topology or topology_for(config.num_devices)
    devices = topology_devices(topology)
    if config.num_devices > len(devices):
        raise ValueError(f"{config.label} needs {config.num_devices} devices; {topology} has {len(devices)}")
    return mesh_over(config, tuple(devices[i] for i in config.permutation))


def judge(topology: str) -> str:
    """Who gives a verdict compiled for ``topology``: ``XLA:GPU, jax-cuda12-plugin 0.10.2 (h100:1x1x8,
    deviceless)``."""
    target = topology.split(":")[0]
    if mock_topology() is not None:
        jaxlib = importlib.metadata.version("jaxlib")
        return f"XLA:GPU, jaxlib {jaxlib} on one {TARGETS[target].device_kind} ({topology}, mocked)"
    dropped = target_config_for_plugin(target)[1]
    named = ", ".join(field.split(".")[-1] for field in dropped[:3]) + (", ..." if len(dropped) > 3 else "")
    without = f"; its proto lacks {len(dropped)} of the target's fields: {named}" if dropped else ""
    return f"XLA:GPU, {plugin_version()} ({topology}, deviceless{without})"


#: Both routes compile with GEMM autotuning off. Deviceless there is no GPU to time configs on (jaxlib
#: 0.6.2 refuses otherwise: "Expect autotune result cache hit for deviceless compilation"); under a
#: mocked topology, autotuning a ring kernel did not finish in 120 s (jaxlib 0.11.2, one H100), where
#: without it the compile took 1.2 s and scheduled as deviceless did. The schedule and memory judged
#: do not depend on which GEMM tiling is picked.
COMPILE_OPTIONS = {"xla_gpu_autotune_level": 0}


def compile_options(options: dict[str, Any] | None = None) -> dict[str, Any]:
    """What :func:`compile_on` gives XLA:GPU besides ``XLA_FLAGS``: :data:`COMPILE_OPTIONS`, the run's
    ``--compiler-option`` pairs it knows, then ``options``."""
    return {**COMPILE_OPTIONS, **target_compiles.user_options(sys.modules[__name__]), **(options or {})}


def compile_on(
    fn: Any, args: tuple[jax.ShapeDtypeStruct, ...], *, options: dict[str, Any] | None = None
) -> Any:
    """``jit(fn)`` lowered and compiled for the GPUs ``args`` are sharded on: :class:`CompilerRefusal`
    quoting XLA:GPU where it refuses. JAX's compilation cache is bypassed (a compile-only client's
    executable cannot be read back; :mod:`conformance.targets.target_compiles` keeps what the checks read
    instead); with :data:`COMPILE_OPTIONS`, then ``XLA_FLAGS``, the run's ``--compiler-option`` pairs
    XLA:GPU knows and ``options``."""
    compiler = f"XLA:GPU {plugin_version()} jaxlib {jax.__version__} mocked {mock_topology()}"
    traced = jax.jit(fn).trace(*args)  # what raises here is the kernel's own, raised while tracing
    given = compile_options(options)
    try:
        with compilation_cache.bypassed():
            lowered = traced.lower()
            return target_compiles.compile_lowered(
                lowered, compiler=compiler, devices=target_compiles.device_ids(args), options=given
            )
    except target_compiles.CompileTimeout as timeout:
        timeout.where = target_compiles.devices_text(args)
        raise
    except target_compiles.Refused as e:
        raise CompilerRefusal(first_lines(str(e))) from e
    except Exception as e:  # XlaRuntimeError, JaxRuntimeError, lowering errors: their own words
        raise CompilerRefusal(f"{type(e).__name__}: {first_lines(str(e))}") from e
