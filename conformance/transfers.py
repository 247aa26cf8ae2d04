"""The ``send_recv`` family's cases and checks: routes, layouts, bit patterns, verdicts.

A *route* is a source mesh shape and where its devices send: to themselves (``identical``), to
the same devices in reverse order (``permuted``), to as many other devices (``disjoint``, and
``disjoint_back`` the other way), or to a window half over the source (``overlapping``). Devices
are taken in JAX's order, process by process, so in a job of 2 processes x 4 devices
``4-disjoint`` sends from process 0 to process 1 and ``4-disjoint_back`` from 1 to 0; with one
device per process every pair crosses.

A *layout* is a global shape and a ``PartitionSpec`` over the source mesh: a vector split over
every axis (3 elements per shard, odd), a matrix split over both dimensions, a 3-D array
replicated over (some) mesh axes, and an array of zero elements.

Values are the dtype's bit patterns: random bytes (every NaN payload a dtype has shows up), with
-0.0, infinities, quiet and signalling NaNs with payloads, subnormals and the extremes first.
The checks compare raw bytes, shard by shard, against the numpy source: nothing is converted.
"""

from __future__ import annotations

import dataclasses
import math
import os
import pickle
import pickletools
import threading
import time
from collections.abc import Callable, Mapping

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from conformance import registry, runner
from conformance.checks import ConformanceFailure, error_text
from conformance.specs.send_recv import np_dtype

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
        return {"identical": k, "permuted": k, "disjoint": 2 * k, "disjoint_back": 2 * k,
                "overlapping": k + k // 2}[self.kind]  # fmt: skip

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
        return (Mesh(np.array(src).reshape(shape), self.axis_names),
                Mesh(np.array(dst).reshape(shape), self.axis_names))  # fmt: skip


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
        except ConformanceFailure:
            raise
        except Exception as e:
            raise self.fail(check, f"raised {type(e).__name__} on a destination the contract allows",
                            [f"error          : {error_text(e)}"]) from None  # fmt: skip

    def header(self) -> list[str]:
        src_ids = [d.id for d in self.src.mesh.devices.flat] if self.src is not None else []
        dst_ids = [d.id for d in self.dst.mesh.devices.flat] if self.dst is not None else []
        return [
            f"route          : {self.route.label} ({self.platform}): devices {src_ids} -> {dst_ids}",
            f"layout         : {self.layout.describe()}",
            f"dtype          : {self.dtype}, seed {self.seed}",
        ]

    def fail(self, check: str, what: str, details: list[str] = ()) -> ConformanceFailure:
        lines = [f"[{check}] {FAMILY}/{self.impl}: {what}", *("  " + h for h in self.header())]
        lines += ["  " + d for d in details]
        lines.append(f"  replay         : {self.replay}")
        failure = ConformanceFailure("\n".join(lines))
        failure.check, failure.what = check, what
        return failure


# -- bounded calls ---------------------------------------------------------------------------------

#: One call of an implementation, its first compile included, may take this many times
#: ``--hang-timeout`` (60 s by default) before the check fails it as hung. A transfer whose peer
#: never comes waits forever in most implementations (a blocking NCCL receive, a pull whose offer
#: never comes); the run must still end.
CALL_TIMEOUT_HANG_TIMEOUTS = 3


def call_timeout_s() -> float:
    return CALL_TIMEOUT_HANG_TIMEOUTS * runner.HANG_TIMEOUT_S


class _Caller:
    """One daemon thread that runs calls for the checks, so that a call that never returns leaves
    the check able to fail (the thread is abandoned; being a daemon it does not hold the exit)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._todo: list = []
        self._ready = threading.Condition(self._lock)
        #: implementation -> where a call of it hung; later calls fail at once
        self.hung: dict[str, str] = {}

    def _loop(self) -> None:
        while True:
            with self._ready:
                while not self._todo:
                    self._ready.wait()
                fn, box, done = self._todo.pop(0)
            try:
                out = fn()
                if isinstance(out, jax.Array):
                    out.block_until_ready()
                box.append(("returned", out))
            except BaseException as e:  # handed to the waiting check, which re-raises it
                box.append(("raised", e))
            done.set()

    def run(self, fn: Callable[[], object], timeout: float) -> tuple[str, object] | None:
        """``("returned", value)`` or ``("raised", exception)``; ``None`` if ``fn`` did not end within
        ``timeout`` seconds (its thread is then given up and the next call gets a new one)."""
        box: list = []
        done = threading.Event()
        with self._ready:
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="conformance-transfer-call",
                                                daemon=True)  # fmt: skip
                self._thread.start()
            self._todo.append((fn, box, done))
            self._ready.notify()
        if not done.wait(timeout):
            with self._lock:
                self._thread, self._todo = None, []
            return None
        return box[0]


_CALLER = _Caller()


def abandoned_calls() -> list[str]:
    """Where each call this process gave up on as hung was (its thread may still be blocked)."""
    return [f"{impl}: {where}" for impl, where in _CALLER.hung.items()]


def bounded_call(t: Transfer, check: str, fn: Callable[[], object], *, timeout: float | None = None):
    """``fn()`` (its result waited for) run on the caller thread; an exception propagates, a call
    that does not return within ``timeout`` (default :func:`call_timeout_s`) fails the check, and
    every later call of that implementation in this process fails at once, naming where it hung."""
    limit = call_timeout_s() if timeout is None else timeout
    if t.impl in _CALLER.hung:
        raise t.fail(check, "not run: an earlier call of this implementation never returned",
                     [f"hung in         : {_CALLER.hung[t.impl]}"])  # fmt: skip
    outcome = _CALLER.run(fn, limit)
    if outcome is None:
        _CALLER.hung[t.impl] = f"{check}, {t.route.label}, {t.layout.describe()}, {t.dtype}"
        raise t.fail(check, f"did not return within {limit:g} s (hung); its later checks in this process "
                     "fail at once", ["a transfer must end, or raise, when its peer takes part"])  # fmt: skip
    kind, value = outcome
    if kind == "raised":
        raise value
    return value


def _bytes_view(a: np.ndarray) -> np.ndarray:
    a = np.ascontiguousarray(a)
    return a.reshape(-1).view(np.uint8).reshape(a.size, a.dtype.itemsize) if a.size else a.reshape(0, 1)


def first_difference(got: np.ndarray, want: np.ndarray) -> tuple[tuple[int, ...], str, str] | None:
    """The first element whose bytes differ, as (index, got hex, want hex); ``None`` if none."""
    g, w = _bytes_view(got), _bytes_view(want)
    rows = np.flatnonzero((g != w).any(axis=1))
    if not len(rows):
        return None
    flat = int(rows[0])
    return (
        tuple(int(i) for i in np.unravel_index(flat, want.shape)),
        g[flat].tobytes().hex(),
        w[flat].tobytes().hex(),
    )


def _start(index: tuple[slice, ...], shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(s.indices(n)[0] for s, n in zip(index, shape, strict=True))


def compare_shards(
    t: Transfer,
    out: jax.Array,
    check: str,
    against: str = "the result",
    placement: NamedSharding | None = None,
    details: tuple[str, ...] = (),
) -> None:
    """Every addressable shard of ``out`` has, bit for bit, the source's bytes at the index
    ``placement`` (default: ``out``'s own sharding) gives its device; ``details`` go in a failure."""
    want_map = (placement or out.sharding).devices_indices_map(t.host.shape)
    for shard in sorted(out.addressable_shards, key=lambda s: s.device.id):
        got = np.asarray(shard.data)
        want = t.host[want_map[shard.device]]
        if got.shape != want.shape or got.dtype != want.dtype:
            raise t.fail(check, f"{against}'s shard on device {shard.device.id} has shape {got.shape} "
                         f"{got.dtype}, not {want.shape} {want.dtype}", details)  # fmt: skip
        diff = first_difference(got, want)
        if diff is not None:
            local, got_hex, want_hex = diff
            start = _start(want_map[shard.device], t.host.shape)
            at = tuple(a + b for a, b in zip(start, local, strict=True))
            count = int((_bytes_view(got) != _bytes_view(want)).any(axis=1).sum())
            raise t.fail(check, f"{against}'s bytes differ from the source's on device {shard.device.id}",
                         [f"first wrong     : global index {at} (index {local} of the shard at {start}): "
                          f"bytes {got_hex}, source has {want_hex}",
                          f"wrong elements  : {count} of {want.size} in that shard", *details])  # fmt: skip


# -- the checks -----------------------------------------------------------------------------------


def check_values(t: Transfer) -> None:
    """The result's shards hold the source's bytes at their indices, and the result its dtype and shape."""
    out = t.call("values")
    if not isinstance(out, jax.Array):
        raise t.fail("values", f"returned {type(out).__name__}, not a jax.Array")
    if out.shape != t.host.shape or out.dtype != t.host.dtype:
        raise t.fail("values", f"returned shape {out.shape} {out.dtype}, not {t.host.shape} {t.host.dtype}")
    compare_shards(t, out, "values")


def check_sharding(t: Transfer) -> None:
    """The result lies on ``dst``: the same devices in the same order, the same spec and memory kind."""
    out = t.call("sharding")
    got = out.sharding
    same_devices = getattr(got, "mesh", None) is not None and np.array_equal(
        np.vectorize(lambda d: d.id)(got.mesh.devices), np.vectorize(lambda d: d.id)(t.dst.mesh.devices)
    )
    if not (got.is_equivalent_to(t.dst, len(t.host.shape)) and same_devices):
        raise t.fail("sharding", "the result does not lie on the destination sharding",
                     [f"result         : {got!r}", f"destination    : {t.dst!r}"])  # fmt: skip
    want_map = t.dst.devices_indices_map(t.host.shape)
    for shard in out.addressable_shards:
        if shard.index != want_map.get(shard.device):
            raise t.fail("sharding", f"the shard on device {shard.device.id} holds index {shard.index}, "
                         f"not {want_map.get(shard.device)}")  # fmt: skip


def check_source_intact(t: Transfer) -> None:
    """After the call (and 2 more), ``x`` is not deleted and still holds its bytes."""
    for _ in range(3):
        if t.x.is_deleted():
            break
        t.call("source_intact")
    if t.x.is_deleted():
        raise t.fail("source_intact", "x was deleted (donated or consumed) by the transfer")
    compare_shards(t, t.x, "source_intact", against="the source")


def blocks(sharding: NamedSharding, shape: tuple[int, ...]) -> list[tuple[tuple[int, int], ...]]:
    """The block of ``shape`` each device of the sharding's mesh holds, in the mesh's device order."""
    index = sharding.devices_indices_map(shape)
    return [
        tuple(s.indices(n)[:2] for s, n in zip(index[d], shape, strict=True))
        for d in sharding.mesh.devices.flat
    ]


def same_placement(t: Transfer, dst: NamedSharding) -> bool:
    """Whether ``dst`` puts on the device at each position of its mesh the block that ``t.dst`` puts
    on the device at the same position, in the same memory kind: the same destination, however its
    spec and mesh shape are spelled (``P()`` and ``P('x')`` on one device; ``P(('x', 'y'))`` on 2 x 2
    and ``P('x')`` on the same 4 devices in a row)."""
    shape = t.host.shape
    return (
        list(dst.mesh.devices.flat) == list(t.dst.mesh.devices.flat)
        and blocks(dst, shape) == blocks(t.dst, shape)
        and dst.memory_kind == t.dst.memory_kind
    )


#: The destinations the contract forbids, by name (see :func:`bad_destination`).
BAD_DESTINATIONS = ("spec", "mesh_shape", "fewer_devices", "memory_kind")


def bad_destination(t: Transfer, name: str) -> tuple[str, NamedSharding | None, list[str]]:
    """``(what is wrong, dst, texts the error must contain)`` for the bad destination ``name``;
    ``dst`` is ``None`` where this route or host cannot make one (``what`` then says why).

    Some spellings are the source's placement after all (:func:`same_placement`: another spec on a
    one-device mesh, a 2 x 2 mesh flattened under a spec that splits over both axes); the test then
    asks for the bytes, not a refusal."""
    src = t.src
    dst_devices = list(t.dst.mesh.devices.flat)
    names = src.mesh.axis_names
    if name == "spec":
        other = P() if any(p is not None for p in src.spec) else P(names[0])
        return (
            "another PartitionSpec",
            NamedSharding(t.dst.mesh, other),
            [_spec_text(src.spec), _spec_text(other)],
        )
    if name == "mesh_shape":
        if len(dst_devices) < 2 or len(dst_devices) % 2:
            return f"no mesh of another shape has {len(dst_devices)} device(s)", None, []
        if len(names) == 1:
            mesh = Mesh(np.array(dst_devices).reshape(2, -1), ("x", "y"))
        else:
            mesh = Mesh(np.array(dst_devices).reshape(-1), ("x",))
        return "a mesh of another shape", NamedSharding(mesh, P("x")), []
    if name == "fewer_devices":
        if len(dst_devices) < 2:
            return "a one-device mesh has no smaller one", None, []
        mesh = Mesh(
            np.array(dst_devices[: len(dst_devices) // 2]).reshape(-1, *([1] * (len(names) - 1))), names
        )
        return "a mesh of fewer devices", NamedSharding(mesh, src.spec), []
    if name == "memory_kind":
        kinds = [m.kind for m in dst_devices[0].addressable_memories() if m.kind != src.memory_kind]
        if not kinds:
            return f"this platform's devices have one memory kind ({src.memory_kind})", None, []
        return ("another memory kind", NamedSharding(t.dst.mesh, src.spec, memory_kind=kinds[0]),
                [str(src.memory_kind), kinds[0]])  # fmt: skip
    raise ValueError(f"bad destination {name!r} is not one of {BAD_DESTINATIONS}")


#: Destinations whose shards have the source's shapes but another block-to-device map, on 2-D
#: routes: the layout each needs and the spec it maps with (see :func:`other_block_map`).
BLOCK_MAPS = {
    "transposed": ("matrix", P("y", "x")),  # P('x', 'y') -> P('y', 'x'): off-diagonal blocks swap
    "axis_order": ("vector", P(("y", "x"))),  # P(('x', 'y')) -> P(('y', 'x')): the same, flattened
}


def other_block_map(t: Transfer, name: str) -> tuple[str, NamedSharding, list[str]]:
    """``(what it is, dst, texts a refusal must contain)``: the destination mesh under the spec
    :data:`BLOCK_MAPS` names; every shard keeps its shape, but blocks land on other devices."""
    _, spec = BLOCK_MAPS[name]
    dst = NamedSharding(t.dst.mesh, spec)
    if dst.shard_shape(t.host.shape) != t.dst.shard_shape(t.host.shape):
        raise ValueError(f"block map {name!r} changes the shard shape of {t.layout.describe()}")
    return (
        f"{_spec_text(spec)} for {_spec_text(t.src.spec)} (same shard shapes, another block map)",
        dst,
        [
            _spec_text(t.src.spec),
            _spec_text(spec),
        ],
    )


def _spec_text(spec: P) -> str:
    return str(spec).replace("PartitionSpec(", "P(")


def _places(t: Transfer, check: str, what: str, dst: NamedSharding, out: object) -> None:
    """``out`` lies on ``dst`` (its devices in its order, its blocks) and holds the source's bytes there."""
    if not isinstance(out, jax.Array):
        raise t.fail(check, f"returned {type(out).__name__} for {what}, not a jax.Array")
    got = out.sharding
    same_devices = getattr(got, "mesh", None) is not None and list(got.mesh.devices.flat) == list(
        dst.mesh.devices.flat
    )
    if not (same_devices and got.is_equivalent_to(dst, len(t.host.shape))):
        raise t.fail(check, f"accepted {what} but the result does not lie on it",
                     [f"result         : {got!r}", f"destination    : {dst!r}"])  # fmt: skip
    compare_shards(t, out, check, placement=dst, details=(f"destination    : {what}: {dst!r}",))


def _call_to(t: Transfer, check: str, dst: NamedSharding) -> tuple[object | None, Exception | None]:
    """One bounded call of the implementation to ``dst``: ``(result, None)`` or ``(None, its error)``."""
    try:
        return bounded_call(t, check, lambda: t.implementation.fn(t.x, dst=dst)), None
    except ConformanceFailure:
        raise
    except Exception as e:
        return None, e


def _named_in_refusal(
    t: Transfer, check: str, what: str, dst: NamedSharding, must: list[str], error: Exception
) -> None:
    text = str(error).replace("PartitionSpec(", "P(")
    missing = [m for m in must if m not in text]
    if missing:
        raise t.fail(
            check,
            f"refused {what} without naming {missing}",
            [f"destination    : {dst!r}", f"error          : {type(error).__name__}: {error}"],
        ) from None


def check_bad_destination(t: Transfer, what: str, dst: NamedSharding, must: list[str]) -> None:
    """A destination the contract forbids is refused with an error naming both shardings."""
    out, error = _call_to(t, "bad_destination", dst)
    if error is not None:
        _named_in_refusal(t, "bad_destination", what, dst, must, error)
        return
    raise t.fail(
        "bad_destination",
        f"accepted {what} instead of refusing it",
        [f"destination    : {dst!r}", f"returned       : {getattr(out, 'sharding', type(out))!r}"],
    )


def check_same_placement(t: Transfer, what: str, dst: NamedSharding) -> None:
    """A destination spelled otherwise that is the source's placement after all (see
    :func:`same_placement`) is a valid one: the bytes, bit for bit, where it says; no refusal."""
    out, error = _call_to(t, "bad_destination", dst)
    if error is not None:
        details = [f"destination    : {dst!r}", f"error          : {error_text(error)}"]
        raise t.fail("bad_destination", f"refused {what}, which places every block where dst does "
                     "(an equivalent destination: move it)", details)  # fmt: skip
    _places(t, "bad_destination", what, dst, out)


def check_block_map(t: Transfer, what: str, dst: NamedSharding, must: list[str]) -> None:
    """A destination with the source's shard shapes and another block-to-device map: refused,
    naming both specs, or moved with every block bit-exact where ``dst`` says."""
    out, error = _call_to(t, "block_map", dst)
    if error is not None:
        _named_in_refusal(t, "block_map", what, dst, must, error)
        return
    _places(t, "block_map", what, dst, out)


#: The timeout check: the receiving ranks alone call with ``timeout=TIMEOUT_GIVEN_S`` and must raise
#: ``TimeoutError`` within ``TIMEOUT_RAISE_WITHIN_S`` ("within a few seconds": the peer's absence is
#: known after the timeout; the rest is the implementation giving up and unwinding).
TIMEOUT_GIVEN_S, TIMEOUT_RAISE_WITHIN_S = 1.0, 10.0


def _names_a_peer(text: str, peers: list[jax.Device]) -> bool:
    """Whether ``text`` names one of ``peers``: its process (``process 3``, ``rank 3``) or the device."""
    names = {f"{word} {d.process_index}" for d in peers for word in ("process", "rank")}
    names |= {str(d) for d in peers} | {f"device {d.id}" for d in peers}
    return any(name in text for name in names)


def check_timeout(t: Transfer) -> None:
    """In a job of 2 or more processes, the ranks that only receive call with ``timeout=1`` while the
    senders stay away: ``TimeoutError`` naming a peer within 10 s. Then every rank transfers, and
    that transfer is bit-exact (a timed-out call must not leave the implementation out of step)."""
    from conformance import distributed

    me = jax.process_index()
    senders = [d for d in t.src.mesh.devices.flat if d.process_index != me]
    receives_only = any(d.process_index == me for d in t.dst.mesh.devices.flat) and not any(
        d.process_index == me for d in t.src.mesh.devices.flat
    )
    failure: ConformanceFailure | None = None
    if receives_only:
        start = time.monotonic()
        try:
            bounded_call(t, "timeout", lambda: t.implementation.fn(t.x, dst=t.dst, timeout=TIMEOUT_GIVEN_S),
                         timeout=TIMEOUT_RAISE_WITHIN_S)  # fmt: skip
            failure = t.fail("timeout", f"returned although no sender called (timeout={TIMEOUT_GIVEN_S:g})")
        except TimeoutError as e:
            took = time.monotonic() - start
            if not _names_a_peer(str(e), senders):
                failure = t.fail("timeout", "raised TimeoutError without naming the peer that never came",
                                 [f"error          : TimeoutError: {e}",
                                  f"peers          : {sorted({d.process_index for d in senders})} "
                                  "(name the process, rank or device)"])  # fmt: skip
            elif took > TIMEOUT_RAISE_WITHIN_S:
                failure = t.fail("timeout", f"raised TimeoutError {took:.1f} s after a {TIMEOUT_GIVEN_S:g} s "
                                 f"timeout (at most {TIMEOUT_RAISE_WITHIN_S:g} s)")  # fmt: skip
        except ConformanceFailure as e:  # hung: it never raised
            failure = e
        except Exception as e:
            failure = t.fail("timeout", f"raised {type(e).__name__}, not TimeoutError, when the peer never "
                             "came", [f"error          : {error_text(e)}"])  # fmt: skip
    # Every rank waits here until the receivers are done, then all transfer together.
    distributed.exchange("timeout", "failed" if failure else "ok")
    try:
        check_values(t)
    except ConformanceFailure as e:
        if failure is None:
            failure = t.fail("timeout", "the transfer after a timed-out call is wrong",
                             [line.strip() for line in str(e).splitlines()[:3]])  # fmt: skip
    if failure is not None:
        raise failure


def open_resources() -> dict[str, int]:
    """Threads and file descriptors (sockets among them) this process holds now."""
    counts = {"threads": threading.active_count()}
    for name, path in (("native threads", "/proc/self/task"), ("file descriptors", "/proc/self/fd")):
        if os.path.isdir(path):
            counts[name] = len(os.listdir(path))
    return counts


#: Calls before the resources are counted (caches fill), and calls after which none may have grown.
WARMUP_CALLS, COUNTED_CALLS = 3, 50


def check_resources(t: Transfer) -> None:
    """After warm-up, 50 more calls open no new threads, descriptors, streams or communicators."""
    declared: Callable[[], Mapping[str, int]] = t.implementation.resources or dict
    for _ in range(WARMUP_CALLS):
        t.call("resources")
    before = {**open_resources(), **declared()}
    for _ in range(COUNTED_CALLS):
        t.call("resources")
    after = {**open_resources(), **declared()}
    grown = {k: (before.get(k, 0), v) for k, v in after.items() if v > before.get(k, 0)}
    if grown:
        text = ", ".join(f"{k} {a} -> {b}" for k, (a, b) in grown.items())
        raise t.fail("resources", f"{COUNTED_CALLS} calls after warm-up grew {text}",
                     ["each call must reuse what the first calls made (streams, communicators, "
                      "threads, sockets)"])  # fmt: skip


def is_pickle_stream(value: bytes | str) -> bool:
    """Whether ``value`` parses, to its last byte, as a pickle stream (protocol 2 or later)."""
    raw = value.encode("latin-1") if isinstance(value, str) else bytes(value)
    if len(raw) < 3 or raw[0] != 0x80 or raw[-1:] != b".":
        return False
    try:
        ops = list(pickletools.genops(raw))
    except Exception:
        return False
    return bool(ops) and ops[-1][0].name == "STOP" and ops[-1][2] == len(raw) - 1


class _WatchedClient:
    """Stands in for the ``jax.distributed`` client while a transfer runs: forwards everything,
    and notes every value written that is a pickle stream (``isinstance`` still sees the client)."""

    def __init__(self, client, events: list[str]) -> None:
        object.__setattr__(self, "_client", client)
        object.__setattr__(self, "_events", events)

    @property
    def __class__(self):
        return type(self._client)

    def __getattr__(self, name: str):
        attr = getattr(self._client, name)
        if name not in ("key_value_set", "key_value_set_bytes"):
            return attr

        def write(key, value, *args, **kwargs):
            if is_pickle_stream(value):
                self._events.append(f"{name}({key!r}, <a pickle stream of {len(value)} bytes>)")
            return attr(key, value, *args, **kwargs)

        return write


class _PickleWatch:
    """Records pickle loads, and pickle streams written to the key-value store, while active."""

    LOADERS = ("loads", "load", "Unpickler")

    def __init__(self) -> None:
        self.events: list[str] = []
        self._saved: list[tuple[object, str, object]] = []

    def __enter__(self) -> _PickleWatch:
        from jax._src import distributed as jax_distributed

        for name in self.LOADERS:
            self._swap(pickle, name, self._loader(getattr(pickle, name), f"pickle.{name}"))
        state = jax_distributed.global_state
        if state.client is not None:
            self._swap(state, "client", _WatchedClient(state.client, self.events))
        return self

    def _swap(self, owner, name: str, new) -> None:
        self._saved.append((owner, name, getattr(owner, name)))
        setattr(owner, name, new)

    def _loader(self, orig, what: str):
        def load(*args, **kwargs):
            self.events.append(f"{what} called")
            return orig(*args, **kwargs)

        return load

    def __exit__(self, *exc) -> None:
        for owner, name, orig in reversed(self._saved):
            setattr(owner, name, orig)


def check_no_pickle(t: Transfer) -> None:
    """No pickle is loaded during a transfer, and nothing written to the key-value store is one."""
    with _PickleWatch() as watch:
        t.call("no_pickle")
        t.call("no_pickle")
    if watch.events:
        raise t.fail("no_pickle", "the transfer unpickles or publishes a pickle",
                     [*watch.events[:5], "a pickle read from the network runs code; send raw bytes "
                      "or text (an NCCL unique id is 128 raw bytes)"])  # fmt: skip
