"""Routes, layouts, bit-pattern values and one :class:`Transfer` (see :mod:`conformance.transfers`)."""

from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from conformance import registry
from conformance.blame import error_text
from conformance.checks import ConformanceFailure
from conformance.checks.base import NotJudged, fail
from conformance.specs.send_recv import np_dtype
from conformance.transfers.bounded import bounded_call

FAMILY = "send_recv"

# -- routes ---------------------------------------------------------------------------------------

ROUTE_KINDS = ("identical", "permuted", "disjoint", "disjoint_back", "overlapping")


@dataclasses.dataclass(frozen=True)
class Route:
    """A source mesh shape and the devices its shards go to (see the module docstring)."""

    mesh_shape: tuple[int, ...]
    kind: str

    def __post_init__(self) -> None:
        if self.kind not in ROUTE_KINDS:
            raise ValueError(f"route kind {self.kind!r} is not one of {ROUTE_KINDS}")

    @property
    def size(self) -> int:
        return math.prod(self.mesh_shape)

    @property
    def axis_names(self) -> tuple[str, ...]:
        return ("x", "y", "z")[: len(self.mesh_shape)]

    @property
    def num_devices(self) -> int:
        """Devices of the platform the route needs (the plugin skips it on a host with fewer)."""
        k = self.size
        return {
            "identical": k,
            "permuted": k,
            "disjoint": 2 * k,
            "disjoint_back": 2 * k,
            "overlapping": k + k // 2,
        }[self.kind]

    @property
    def label(self) -> str:
        return "x".join(map(str, self.mesh_shape)) + "-" + self.kind

    def device_lists(self, devices: tuple[jax.Device, ...]) -> tuple[list, list]:
        k = self.size
        if len(devices) < self.num_devices:
            raise ValueError(f"route {self.label} needs {self.num_devices} devices, got {len(devices)}")
        first, second = list(devices[:k]), list(devices[k : 2 * k])
        return {
            "identical": (first, first),
            "permuted": (first, first[::-1]),
            "disjoint": (first, second),
            "disjoint_back": (second, first),
            "overlapping": (first, list(devices[k // 2 : k // 2 + k])),
        }[self.kind]

    def meshes(self, devices: tuple[jax.Device, ...]) -> tuple[Mesh, Mesh]:
        src, dst = self.device_lists(devices)
        shape = self.mesh_shape
        return (
            Mesh(np.array(src).reshape(shape), self.axis_names),
            Mesh(np.array(dst).reshape(shape), self.axis_names),
        )


def standard_routes() -> tuple[Route, ...]:
    """One device (the only route of a one-GPU host is ``1-identical``), a ring of 4, a 2 x 2 mesh."""
    routes = [Route((1,), "identical"), Route((1,), "disjoint")]
    routes += [Route((4,), kind) for kind in ROUTE_KINDS]
    routes += [Route((2, 2), kind) for kind in ("identical", "permuted", "disjoint", "overlapping")]
    return tuple(routes)


ROUTES = standard_routes()

# -- layouts --------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Layout:
    """A global shape and ``PartitionSpec`` over a mesh of the route's shape."""

    name: str
    shape: tuple[int, ...]
    spec: P

    def describe(self) -> str:
        return f"{self.name}: shape {self.shape}, spec {self.spec}"


LAYOUT_NAMES = ("vector", "matrix", "replicated", "empty")


def layout(name: str, mesh_shape: tuple[int, ...]) -> Layout:
    """The layout ``name`` over a mesh of ``mesh_shape`` (axes ``x``, ``y``)."""
    names = ("x", "y", "z")[: len(mesh_shape)]
    k = math.prod(mesh_shape)
    if name == "vector":  # 1-D, split over every axis, 3 (odd) per shard
        return Layout(name, (3 * k,), P(names if len(names) > 1 else names[0]))
    if name == "matrix":  # 2-D; on one axis the rows stay whole
        if len(mesh_shape) == 1:
            return Layout(name, (5, mesh_shape[0]), P(None, names[0]))
        return Layout(name, (3 * mesh_shape[0], 5 * mesh_shape[1]), P(names[0], names[1]))
    if name == "replicated":  # 3-D, replicated over the first mesh axis (over all of a 1-D mesh)
        if len(mesh_shape) == 1:
            return Layout(name, (3, 2, 5), P())
        return Layout(name, (3, 2, 5 * mesh_shape[-1]), P(None, None, names[-1]))
    if name == "empty":  # zero elements, a split dimension beside the empty one
        return Layout(name, (0, 2 * k), P(None, names if len(names) > 1 else names[0]))
    raise ValueError(f"layout {name!r} is not one of {LAYOUT_NAMES}")


# -- values ---------------------------------------------------------------------------------------


def _uint(itemsize: int) -> np.dtype:
    return np.dtype(f"uint{8 * itemsize}")


def special_values(dtype: str) -> np.ndarray:
    """The bit patterns a transfer that converts, canonicalizes or flushes would change."""
    import ml_dtypes

    dt = np_dtype(dtype)
    if dt == np.bool_:
        return np.array([True, False])
    if dt.kind in "iu":
        info = np.iinfo(dt)
        return np.array([info.min, info.max, 0, 1, info.max // 3], dt)
    if dt.kind == "c":  # pairs of the real type's patterns
        return _complex_specials(special_values(f"float{dt.itemsize * 4}"), dt)
    info = ml_dtypes.finfo(dt)
    u = _uint(dt.itemsize)
    sign = u.type(1 << (8 * dt.itemsize - 1))
    with np.errstate(all="ignore"):
        values = [
            np.array(v).astype(dt).view(u) for v in (-0.0, np.inf, -np.inf, np.nan, info.max, -info.max)
        ]
    patterns = [int(v) for v in values]
    patterns.append(int(np.array(info.smallest_normal).astype(dt).view(u)))
    nmant = int(info.nmant)
    if nmant > 0:
        quiet = int(values[3])
        top = 1 << (nmant - 1)
        patterns += [
            quiet | 1,  # a quiet NaN with a payload
            (quiet & ~top) | 1,  # a signalling NaN (payload 1, quiet bit clear)
            1,  # the smallest subnormal
            (1 << nmant) - 1,  # the largest subnormal
            int(sign) | 1,  # the smallest negative subnormal
        ]
    mask = (1 << (8 * dt.itemsize)) - 1
    return np.array([p & mask for p in patterns], u).view(dt)


def _complex_specials(real: np.ndarray, dt: np.dtype) -> np.ndarray:
    n = len(real)
    pairs = np.empty(2 * n, real.dtype)
    pairs[0::2], pairs[1::2] = real, real[::-1]
    return pairs.view(dt)


def host_values(dtype: str, shape: tuple[int, ...], seed: int) -> np.ndarray:
    """Random bit patterns of ``dtype`` (booleans 0 or 1), the special values first."""
    dt = np_dtype(dtype)
    n = math.prod(shape)
    rng = np.random.default_rng(seed)
    if dt == np.bool_:
        flat = rng.integers(0, 2, n).astype(np.bool_)
    else:
        flat = rng.integers(0, 256, n * dt.itemsize, dtype=np.uint8).view(dt).copy()
    specials = special_values(dtype)
    m = min(len(specials), n)
    flat[:m] = specials[:m]
    return flat.reshape(shape)


def place(host: np.ndarray, sharding: NamedSharding) -> jax.Array:
    """``host`` as a global array under ``sharding``; each process puts only its own shards."""
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index], dtype=host.dtype)


# -- one transfer ----------------------------------------------------------------------------------


@dataclasses.dataclass
class Transfer:
    """One call of an implementation and what it was given."""

    impl: str
    platform: str
    route: Route
    layout: Layout
    dtype: str
    seed: int
    replay: str
    src: NamedSharding | None = None
    dst: NamedSharding | None = None
    host: np.ndarray | None = None
    x: jax.Array | None = None

    @property
    def implementation(self) -> registry.Implementation:
        return registry.get(FAMILY, self.impl)

    def prepare(self, devices: tuple[jax.Device, ...]) -> Transfer:
        src_mesh, dst_mesh = self.route.meshes(devices)
        self.src = NamedSharding(src_mesh, self.layout.spec)
        self.dst = NamedSharding(dst_mesh, self.layout.spec)
        self.host = host_values(self.dtype, self.layout.shape, self.seed)
        self.x = place(self.host, self.src)
        return self

    def call(self, check: str, **kwargs) -> jax.Array:
        """One call of the implementation, waited for (at most :func:`call_timeout_s`); an exception
        or a hang is the check's failure."""
        try:
            return bounded_call(self, check, lambda: self.implementation.fn(self.x, dst=self.dst, **kwargs))
        except (ConformanceFailure, NotJudged):
            raise
        except Exception as e:
            raise fail(
                self,
                check,
                f"raised {type(e).__name__} on a destination the contract allows",
                [f"error          : {error_text(e)}"],
            ) from None

    @property
    def family(self) -> str:
        return FAMILY

    @property
    def token(self) -> str:
        """``4-disjoint:vector:bfloat16:seed=0``: route, layout, dtype and seed."""
        return f"{self.route.label}:{self.layout.name}:{self.dtype}:seed={self.seed}"

    def size_key(self) -> tuple[int, int, int, str]:
        """Order of "smaller" (the failure summary's smallest case): devices, elements, item size."""
        return self.route.num_devices, math.prod(self.layout.shape), np_dtype(self.dtype).itemsize, self.token

    def replay_command(self, check: str) -> str:
        """The pytest line that re-runs this transfer's test (its parameters are the test id's)."""
        return self.replay

    def describe(self) -> list[str]:
        """The header every failure message starts with (:func:`conformance.checks.base.fail`)."""
        src_ids = [d.id for d in self.src.mesh.devices.flat] if self.src is not None else []
        dst_ids = [d.id for d in self.dst.mesh.devices.flat] if self.dst is not None else []
        return [
            f"route          : {self.route.label} ({self.platform}): devices {src_ids} -> {dst_ids}",
            f"layout         : {self.layout.describe()}",
            f"dtype          : {self.dtype}, seed {self.seed}",
        ]
