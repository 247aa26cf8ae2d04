"""The real TPU compiler on any host: libtpu's XLA:TPU and Mosaic, compiling for TPU topologies.

With libtpu installed (``pip install "jax[tpu]==<the installed JAX>"``, or this package's
``tpu`` extra: the libtpu that JAX pins), ``jax.experimental.topologies`` describes a TPU
slice (``v5e:2x4``: 8 v5e chips) whose devices a mesh can be built on; ``jit(f).lower(*abstract
arguments on that mesh).compile()`` then runs XLA:TPU and Mosaic for real, without a chip and
without executing. What the compiler refuses, a chip would refuse; what it compiles, it schedules
and lays out as on the chip. It is the suite's judge of TPU layout, schedule, memory and pod
scale; where no libtpu can be had, those checks skip, naming the install command.

libtpu prints warnings about ``TPU_ACCELERATOR_TYPE`` and worker host names on a host without
chips; they are harmless.
"""

from __future__ import annotations

import functools
import importlib.metadata
import re
from typing import Any

import jax
import numpy as np

from conformance import compilation_cache, target_compiles
from conformance.fixtures.meshes import MeshConfig, mesh_over, mesh_over_axis_types

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
    """The compiler (libtpu's here, XLA:GPU's in :mod:`conformance.gpu_compiler`) refused the program;
    the message is the compiler's, quoted."""


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


#: Slices for a mesh of another size: the smallest v6e slice that holds it, of which it takes the
#: first chips (a v6e program may span part of its slice: rings of 2 to 110 chips of a 256-chip
#: one compile, libtpu 0.0.42).
V6E_SLICES = ("v6e:2x2", "v6e:2x4", "v6e:4x4", "v6e:8x8", "v6e:16x16")


def topology_for(num_devices: int) -> str:
    """The topology a mesh of ``num_devices`` compiles for: the v5e slice of that many chips, or the
    smallest v6e slice holding them."""
    if num_devices in V5E_BY_CHIPS:
        return V5E_BY_CHIPS[num_devices]
    for name in V6E_SLICES:
        chips = int(np.prod([int(k) for k in name.split(":")[1].split("x")]))
        if chips >= num_devices:
            return name
    raise ValueError(f"no standard TPU topology of {num_devices} chips (at most 256)")


def mesh_on(config: MeshConfig, topology: str | None = None) -> jax.sharding.Mesh:
    """The mesh of ``config`` over ``topology`` (default: :func:`topology_for` its size). A whole
    slice is ordered by ``jax.make_mesh`` for the chips' torus; a mesh of fewer chips takes the
    slice's first ones in its order (``jax.make_mesh`` takes only whole slices of a TPU)."""
    topology = topology or topology_for(config.num_devices)
    devices = topology_devices(topology)
    if config.num_devices > len(devices):
        raise ValueError(f"{config.label} needs {config.num_devices} devices; {topology} has {len(devices)}")
    if config.num_devices == len(devices):
        return mesh_over(config, devices)
    first = np.array(devices[: config.num_devices]).reshape(config.shape)
    return jax.sharding.Mesh(first, config.axis_names, axis_types=mesh_over_axis_types(config))


def judge(topology: str) -> str:
    """Who gives a verdict compiled for ``topology``: ``libtpu 0.0.42.1 (v5e:2x4)``."""
    return f"libtpu {libtpu_version()} ({topology})"


def compile_on(fn: Any, args: tuple[jax.ShapeDtypeStruct, ...]) -> target_compiles.TargetCompile:
    """``jit(fn)`` lowered and compiled for the devices ``args`` are sharded on, as on a TPU host:
    :class:`CompilerRefusal` quoting the toolchain where it refuses (JAX's side of Mosaic while
    lowering, XLA:TPU and Mosaic in libtpu while compiling). A kernel's own
    :class:`~conformance.mosaic.TpuConstraintError` propagates as it is. A program compiled before
    (by another worker, an earlier run) is read back (:mod:`conformance.target_compiles`)."""
    from conformance.mosaic import TpuConstraintError

    try:
        with compilation_cache.bypassed():
            lowered = jax.jit(fn).lower(*args)
            return target_compiles.compile_lowered(
                lowered, compiler=f"libtpu {libtpu_version()}", devices=target_compiles.device_ids(args)
            )
    except TpuConstraintError:
        raise
    except target_compiles.Refused as e:
        raise CompilerRefusal(first_lines(str(e))) from e
    except Exception as e:  # XlaRuntimeError, JaxRuntimeError, Mosaic's lowering errors: their own words
        raise CompilerRefusal(f"{type(e).__name__}: {first_lines(str(e))}") from e


def first_lines(message: str, limit: int = 600) -> str:
    """A compiler message without its trailing source-location trace, at most ``limit`` characters."""
    text = message.split("=== Source Location Trace", 1)[0].strip()
    return text if len(text) <= limit else text[: limit - 3] + "..."
