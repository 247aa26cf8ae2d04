"""The few spellings that differ between JAX 0.6.2 and the newest release.

Everything else in the project uses current JAX spellings directly. When the
oldest supported JAX moves forward, entries here are deleted, not rewritten.
The ``cpu-oldest`` tox environment runs the whole suite on JAX 0.6.2 to prove
this module is all the difference there is.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import jax

JAX_VERSION: tuple[int, ...] = tuple(int(part) for part in jax.__version__.split(".")[:3] if part.isdigit())


def configure_cpu_devices(count: int) -> None:
    """Ask for ``count`` simulated CPU devices; must run before any backend starts.

    ``jax_num_cpu_devices`` exists in every supported JAX; the XLA flag is set
    as well so that subprocesses started without this module agree.
    """
    flag = f"--xla_force_host_platform_device_count={count}"
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} {flag}".strip()
    jax.config.update("jax_num_cpu_devices", count)


def make_mesh(
    shape: Sequence[int],
    axis_names: Sequence[str],
    *,
    axis_types: tuple[jax.sharding.AxisType, ...],
    devices: Sequence[Any],
) -> jax.sharding.Mesh:
    """``jax.make_mesh`` took ``axis_types`` as keyword-only in 0.6.2; keyword works everywhere."""
    return jax.make_mesh(tuple(shape), tuple(axis_names), axis_types=axis_types, devices=devices)


def lower_for_platform(jitted: Any, args: Sequence[Any], platform: str) -> Any:
    """Lower a jitted function for another backend than the host's (no compile)."""
    return jitted.trace(*args).lower(lowering_platforms=(platform,))
