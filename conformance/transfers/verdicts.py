"""The send_recv checks: bytes shard by shard against the numpy source, placement, the source left
intact, bad destinations and block maps, and what a missing peer does."""

from __future__ import annotations

import time

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from conformance.blame import error_text
from conformance.checks import ConformanceFailure
from conformance.checks.base import NotJudged, fail
from conformance.transfers.bounded import bounded_call
from conformance.transfers.cases import Transfer


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
            raise fail(
                t,
                check,
                f"{against}'s shard on device {shard.device.id} has shape {got.shape} "
                f"{got.dtype}, not {want.shape} {want.dtype}",
                details,
            )
        diff = first_difference(got, want)
        if diff is not None:
            local, got_hex, want_hex = diff
            start = _start(want_map[shard.device], t.host.shape)
            at = tuple(a + b for a, b in zip(start, local, strict=True))
            count = int((_bytes_view(got) != _bytes_view(want)).any(axis=1).sum())
            raise fail(
                t,
                check,
                f"{against}'s bytes differ from the source's on device {shard.device.id}",
                [
                    f"first wrong     : global index {at} (index {local} of the shard at {start}): "
                    f"bytes {got_hex}, source has {want_hex}",
                    f"wrong elements  : {count} of {want.size} in that shard",
                    *details,
                ],
            )


# -- the checks -----------------------------------------------------------------------------------


def check_values(t: Transfer) -> None:
    """The result's shards hold the source's bytes at their indices, and the result its dtype and shape."""
    out = t.call("values")
    if not isinstance(out, jax.Array):
        raise fail(t, "values", f"returned {type(out).__name__}, not a jax.Array")
    if out.shape != t.host.shape or out.dtype != t.host.dtype:
        raise fail(t, "values", f"returned shape {out.shape} {out.dtype}, not {t.host.shape} {t.host.dtype}")
    compare_shards(t, out, "values")


def check_sharding(t: Transfer) -> None:
    """The result lies on ``dst``: the same devices in the same order, the same spec and memory kind."""
    out = t.call("sharding")
    got = out.sharding
    same_devices = getattr(got, "mesh", None) is not None and np.array_equal(
        np.vectorize(lambda d: d.id)(got.mesh.devices), np.vectorize(lambda d: d.id)(t.dst.mesh.devices)
    )
    if not (got.is_equivalent_to(t.dst, len(t.host.shape)) and same_devices):
        raise fail(
            t,
            "sharding",
            "the result does not lie on the destination sharding",
            [f"result         : {got!r}", f"destination    : {t.dst!r}"],
        )
    want_map = t.dst.devices_indices_map(t.host.shape)
    for shard in out.addressable_shards:
        if shard.index != want_map.get(shard.device):
            raise fail(
                t,
                "sharding",
                f"the shard on device {shard.device.id} holds index {shard.index}, "
                f"not {want_map.get(shard.device)}",
            )


def check_source_intact(t: Transfer) -> None:
    """After the call (and 2 more), ``x`` is not deleted and still holds its bytes."""
    for _ in range(3):
        if t.x.is_deleted():
            break
        t.call("source_intact")
    if t.x.is_deleted():
        raise fail(t, "source_intact", "x was deleted (donated or consumed) by the transfer")
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
        return (
            "another memory kind",
            NamedSharding(t.dst.mesh, src.spec, memory_kind=kinds[0]),
            [str(src.memory_kind), kinds[0]],
        )
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
        raise fail(t, check, f"returned {type(out).__name__} for {what}, not a jax.Array")
    got = out.sharding
    same_devices = getattr(got, "mesh", None) is not None and list(got.mesh.devices.flat) == list(
        dst.mesh.devices.flat
    )
    if not (same_devices and got.is_equivalent_to(dst, len(t.host.shape))):
        raise fail(
            t,
            check,
            f"accepted {what} but the result does not lie on it",
            [f"result         : {got!r}", f"destination    : {dst!r}"],
        )
    compare_shards(t, out, check, placement=dst, details=(f"destination    : {what}: {dst!r}",))


def _call_to(t: Transfer, check: str, dst: NamedSharding) -> tuple[object | None, Exception | None]:
    """One bounded call of the implementation to ``dst``: ``(result, None)`` or ``(None, its error)``."""
    try:
        return bounded_call(t, check, lambda: t.implementation.fn(t.x, dst=dst)), None
    except (ConformanceFailure, NotJudged):
        raise
    except Exception as e:
        return None, e


def _named_in_refusal(
    t: Transfer, check: str, what: str, dst: NamedSharding, must: list[str], error: Exception
) -> None:
    text = str(error).replace("PartitionSpec(", "P(")
    missing = [m for m in must if m not in text]
    if missing:
        raise fail(
            t,
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
    raise fail(
        t,
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
        raise fail(
            t,
            "bad_destination",
            f"refused {what}, which places every block where dst does (an equivalent destination: move it)",
            details,
        )
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
    from conformance.jobs import distributed

    me = jax.process_index()
    senders = [d for d in t.src.mesh.devices.flat if d.process_index != me]
    receives_only = any(d.process_index == me for d in t.dst.mesh.devices.flat) and not any(
        d.process_index == me for d in t.src.mesh.devices.flat
    )
    failure: ConformanceFailure | None = None
    if receives_only:
        start = time.monotonic()
        try:
            bounded_call(
                t,
                "timeout",
                lambda: t.implementation.fn(t.x, dst=t.dst, timeout=TIMEOUT_GIVEN_S),
                timeout=TIMEOUT_RAISE_WITHIN_S,
            )
            failure = fail(t, "timeout", f"returned although no sender called (timeout={TIMEOUT_GIVEN_S:g})")
        except TimeoutError as e:
            took = time.monotonic() - start
            if not _names_a_peer(str(e), senders):
                failure = fail(
                    t,
                    "timeout",
                    "raised TimeoutError without naming the peer that never came",
                    [
                        f"error          : TimeoutError: {e}",
                        f"peers          : {sorted({d.process_index for d in senders})} "
                        "(name the process, rank or device)",
                    ],
                )
            elif took > TIMEOUT_RAISE_WITHIN_S:
                failure = fail(
                    t,
                    "timeout",
                    f"raised TimeoutError {took:.1f} s after a {TIMEOUT_GIVEN_S:g} s "
                    f"timeout (at most {TIMEOUT_RAISE_WITHIN_S:g} s)",
                )
        except ConformanceFailure as e:  # hung: it never raised
            failure = e
        except NotJudged:  # it hung earlier in this run: so does the transfer after the exchange, not judged
            pass
        except Exception as e:
            failure = fail(
                t,
                "timeout",
                f"raised {type(e).__name__}, not TimeoutError, when the peer never came",
                [f"error          : {error_text(e)}"],
            )
    # Every rank waits here until the receivers are done, then all transfer together.
    distributed.exchange("timeout", "failed" if failure else "ok")
    try:
        check_values(t)
    except NotJudged:
        if failure is None:
            raise
        # the receiver's call above hung: that is the verdict, and the transfer after it cannot run
    except ConformanceFailure as e:
        if failure is None:
            failure = fail(
                t,
                "timeout",
                "the transfer after a timed-out call is wrong",
                [line.strip() for line in str(e).splitlines()[:3]],
            )
    if failure is not None:
        raise failure
