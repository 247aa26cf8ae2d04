"""The send_recv family: every implementation on every route, layout and dtype, bit for bit.

Discrete axes are parametrized so every implementation meets every one: routes (where the
shards go, :data:`conformance.transfers.ROUTES`), layouts (vector, matrix, replicated, empty)
and every dtype of the spec; hypothesis draws only shapes and seeds (``test_values_drawn``).
The checks live in :mod:`conformance.transfers`; a route needing more devices than the
platform has skips, naming both counts.
"""

from __future__ import annotations

import shlex
from collections.abc import Callable

import pytest
from hypothesis import given
from hypothesis import strategies as st

from conformance import claims, family_tests, kernel_paths, registry, strategies, transfers
from conformance.checks.base import Check
from conformance.fixtures import devices as devices_lib
from conformance.jobs import distributed
from conformance.plugin import end_of_run
from conformance.reports import results
from conformance.run import run_check
from conformance.specs.send_recv import SEND_RECV
from conformance.transfers import LAYOUT_NAMES, ROUTES, Layout, Route, Transfer

FAMILY = transfers.FAMILY
#: The uniform ids of these tests: the route stands for the mesh, the layout for the shape, and the
#: bad destination follows it.
ID_PARTS = results.IdParts(mesh="route", shape="layout", extra=("bad",))

#: The routes of the resources, no-pickle and bad-destination checks: one per kind of pair
#: (a device to itself, a permutation, other devices), the smallest that shows it.
FEW_ROUTES = tuple(
    r for r in ROUTES if r.label in ("1-identical", "4-permuted", "4-disjoint", "2x2-overlapping")
)

routes = pytest.mark.parametrize("route", ROUTES, ids=[r.label for r in ROUTES])
few_routes = pytest.mark.parametrize("route", FEW_ROUTES, ids=[r.label for r in FEW_ROUTES])


def _replay(request: pytest.FixtureRequest, impl: registry.Implementation) -> str:
    parts = ["pytest", f"{request.node.path}::{request.node.name}", "-p", "no:cacheprovider"]
    if not impl.is_builtin:
        parts += ["--kernels", kernel_paths.kernels_argument(impl.module)]
    return shlex.join(parts)


def transfer(
    request: pytest.FixtureRequest,
    implementation: str,
    platform: str,
    route: Route,
    layout: Layout | str = "vector",
    dtype: str = "float32",
    seed: int = 0,
) -> Transfer:
    """The case, placed on this platform's devices; not claimed or missing a module: a skip."""
    impl = registry.get(FAMILY, implementation)
    mesh_shape = dict(zip(route.axis_names, route.mesh_shape, strict=True))
    why = impl.claims(platform=platform, dtype=dtype, dims={}, mesh_shape=mesh_shape, axis_size=route.size)
    if why is not None:
        raise claims.NotClaimed(implementation, why)
    missing = impl.missing_requirement()
    if missing is not None:
        pytest.skip(f"{implementation}: {missing}")
    if isinstance(layout, str):
        layout = transfers.layout(layout, route.mesh_shape)
    t = Transfer(implementation, platform, route, layout, dtype, seed, _replay(request, impl))
    return t.prepare(devices_lib.devices_of(platform))


def run(request: pytest.FixtureRequest, check: Callable[..., None], t: Transfer, *args: object) -> None:
    """Run one check on the run path every check takes (:func:`conformance.run.run_check`: in a
    multi-process job the verdict is agreed across ranks); its outcome joins the session's log."""
    name = check.__name__.removeprefix("check_")
    session = request.config.stash[end_of_run.SESSION]
    outcome = run_check(Check(name, lambda case: check(case, *args)), t, session)
    if session.log is not None:
        session.log.add(outcome)
    if outcome.verdict == "failed":
        raise family_tests.CheckFailed(outcome.failure)
    if outcome.verdict in ("skipped", "not_judged"):
        pytest.skip(outcome.skip_reason)


@routes
@pytest.mark.parametrize("layout", LAYOUT_NAMES)
def test_values(request, implementation: str, platform: str, route: Route, layout: str, dtype: str) -> None:
    """Bitwise, shard by shard: random bit patterns with -0.0, infinities, NaN payloads, subnormals."""
    run(request, transfers.check_values, transfer(request, implementation, platform, route, layout, dtype))


@routes
@family_tests.PER_MESH
@given(data=st.data())
def test_values_drawn(request, implementation: str, platform: str, route: Route, data: st.DataObject) -> None:
    """Drawn shapes (rank 1 to 3, 0 to 5 rows per shard), dtypes and seeds; each route starts every
    list at its own entry (:mod:`conformance.strategies`), so the routes meet different draws."""
    draw = strategies.draw_number(route.label, among=[r.label for r in ROUTES])
    rank = data.draw(strategies.integers(1, 3, draw=draw), label="rank")
    per_shard = data.draw(strategies.integers(0, 5, draw=draw, position=1), label="rows per shard")
    other = strategies.integers(1, 5, draw=draw, position=2)
    rest = tuple(data.draw(st.lists(other, min_size=rank - 1, max_size=rank - 1), label="other dims"))
    declared = registry.get(FAMILY, implementation).dtypes
    dtype = data.draw(strategies.sampled(declared or SEND_RECV.dtypes, draw=draw, position=3), label="dtype")
    seed = data.draw(strategies.integers(0, 2**31 - 1, draw=draw), label="seed")
    axes = route.axis_names
    layout = Layout("drawn", (per_shard * route.size, *rest), transfers.P(axes if len(axes) > 1 else axes[0]))
    run(
        request,
        transfers.check_values,
        transfer(request, implementation, platform, route, layout, dtype, seed),
    )


@routes
@pytest.mark.parametrize("layout", LAYOUT_NAMES)
def test_sharding(request, implementation: str, platform: str, route: Route, layout: str) -> None:
    """The result lies on ``dst``: its devices in its order, spec and memory kind; each shard at its index."""
    run(request, transfers.check_sharding, transfer(request, implementation, platform, route, layout))


@routes
def test_source_intact(request, implementation: str, platform: str, route: Route) -> None:
    """``x`` is neither deleted nor changed by three transfers."""
    run(
        request,
        transfers.check_source_intact,
        transfer(request, implementation, platform, route, "matrix", "bfloat16"),
    )


@few_routes
@pytest.mark.parametrize("bad", transfers.BAD_DESTINATIONS)
def test_bad_destination(request, implementation: str, platform: str, route: Route, bad: str) -> None:
    """Another spec, mesh shape, device count or memory kind: refused naming both, and the next
    transfer still works. A spelling that is the source's placement after all (another spec on one
    device, a 2 x 2 mesh flattened) is a valid destination: its bytes are checked instead."""
    t = transfer(request, implementation, platform, route)
    what, dst, must = transfers.bad_destination(t, bad)
    if dst is None:
        pytest.skip(f"{implementation}: {what}")
    if transfers.same_placement(t, dst):
        run(request, transfers.check_same_placement, t, f"{what} (the same placement)", dst)
    else:
        run(request, transfers.check_bad_destination, t, what, dst, must)
    run(request, transfers.check_values, t)


#: The 2-D routes: only there can a destination keep every shard's shape and map blocks otherwise.
ROUTES_2D = tuple(r for r in ROUTES if len(r.mesh_shape) == 2)


@pytest.mark.parametrize("route", ROUTES_2D, ids=[r.label for r in ROUTES_2D])
@pytest.mark.parametrize("block_map", sorted(transfers.BLOCK_MAPS))
def test_block_map(request, implementation: str, platform: str, route: Route, block_map: str) -> None:
    """A destination with the source's shard shapes and another block-to-device map (transposed
    spec, permuted axis order): refused naming both specs, or every block bit-exact where ``dst``
    says; then the next transfer still works."""
    layout, _ = transfers.BLOCK_MAPS[block_map]
    t = transfer(request, implementation, platform, route, layout)
    what, dst, must = transfers.other_block_map(t, block_map)
    run(request, transfers.check_block_map, t, what, dst, must)
    run(request, transfers.check_values, t)


@few_routes
def test_resources(request, implementation: str, platform: str, route: Route) -> None:
    """50 calls after warm-up open no threads, file descriptors, streams or communicators."""
    run(request, transfers.check_resources, transfer(request, implementation, platform, route))


@few_routes
def test_no_pickle(request, implementation: str, platform: str, route: Route) -> None:
    """No pickle load during a transfer; no pickle stream written to the key-value store."""
    run(request, transfers.check_no_pickle, transfer(request, implementation, platform, route))


#: The timeout check's routes: out of process 0 and back into it (in 2 x 4 every rank is one or
#: the other; in 8 x 1 four ranks receive from four others).
TIMEOUT_ROUTES = tuple(r for r in ROUTES if r.label in ("4-disjoint", "4-disjoint_back"))


@pytest.mark.parametrize("route", TIMEOUT_ROUTES, ids=[r.label for r in TIMEOUT_ROUTES])
def test_timeout(request, implementation: str, platform: str, route: Route) -> None:
    """Where claimed (``accepts_timeout``), in a job: receivers alone call with ``timeout=1`` and get
    ``TimeoutError`` naming the peer within seconds; a transfer by every rank then works."""
    impl = registry.get(FAMILY, implementation)
    if not impl.options["accepts_timeout"]:
        raise claims.NotClaimed(implementation, "does not accept timeout= (not declared at registration)")
    if not distributed.is_multi_process():
        pytest.skip(
            f"{implementation}: the timeout check needs a job of 2 or more processes, where one "
            "side can stay away (python -m conformance launch --processes 2 ...)"
        )
    run(request, transfers.check_timeout, transfer(request, implementation, platform, route))
