"""The meshes the suite checks on: every kind of mesh the standard set claims is in it, labels read
back, device orders are applied on CPU and on TPU slices, and the TPU orders are ``jax.make_mesh``'s.

The meshes' verdicts on kernels (a kernel broken only on a ring of 3, of one, on a 3-D mesh, on a
permuted order) are in the broken-kernel sweep (:mod:`conformance.selftest.broken_mesh_kernels`).
"""

from __future__ import annotations

import jax
import pytest

from conformance import compat
from conformance.fixtures import meshes
from conformance.fixtures.meshes import COVERING_MESHES, STANDARD_MESHES, MeshConfig, parse_mesh
from conformance.targets import tpu_compiler

pytestmark = pytest.mark.selftest

STANDARD = [parse_mesh(label) for label in STANDARD_MESHES]
COVERING = [parse_mesh(label) for label in COVERING_MESHES]


def _kinds(configs: list[MeshConfig]) -> dict[str, set]:
    """What a set of meshes covers: ring lengths of 1-D meshes, (dims, ring axis) of the others,
    axis types beside a ring of one, an odd ring and a 3-D mesh, and device orders."""
    one_d = {c.axis_size for c in configs if len(c.shape) == 1}
    rings = {(len(c.shape), c.axis_names.index(c.axis_name)) for c in configs if len(c.shape) > 1}
    types = {
        (kind, c.axis_type)
        for c in configs
        for kind, hit in (("one", c.axis_size == 1), ("odd", c.axis_size % 2), ("3-D", len(c.shape) == 3))
        if hit
    }
    return {"1-D rings": one_d, "rings": rings, "types": types, "orders": {c.device_order for c in configs}}


def test_the_standard_meshes_hold_every_kind_of_mesh() -> None:
    kinds = _kinds(STANDARD)
    assert kinds["1-D rings"] == set(range(1, 9))
    assert kinds["rings"] == {(2, 0), (2, 1), (3, 0), (3, 1), (3, 2)}  # 2-D on either axis, 3-D on each
    assert {c.shape for c in STANDARD} >= {(2, 3), (3, 2), (1, 8), (8, 1), (2, 4), (4, 2), (2, 2, 2)}
    assert kinds["types"] == {(k, t) for k in ("one", "odd", "3-D") for t in ("auto", "explicit")}
    assert kinds["orders"] == set(meshes.DEVICE_ORDERS)
    assert all(c.num_devices <= 8 for c in STANDARD)  # the suite's simulated CPU devices hold each


def test_the_covering_meshes_are_standard_and_hold_one_of_each_kind() -> None:
    assert set(COVERING_MESHES) <= set(STANDARD_MESHES)
    assert len(COVERING) < len(STANDARD)
    sizes = {c.axis_size for c in COVERING}
    assert min(sizes) == 1  # a ring of one
    assert max(sizes) == max(c.axis_size for c in STANDARD)  # and the longest standard ring
    assert any(n % 2 and n >= 5 for n in sizes)  # odd, several steps each way
    assert any(n % 2 == 0 and n & (n - 1) for n in sizes)  # even, no power of two
    assert any(len(c.shape) == 2 for c in COVERING) and any(len(c.shape) == 3 for c in COVERING)
    assert {c.axis_type for c in COVERING} == {"auto", "explicit"}
    assert any(c.device_order != "ids" for c in COVERING)


def test_the_dimension_meshes_are_covering_and_a_ring_of_each_dimensionality() -> None:
    dims = [parse_mesh(label) for label in meshes.DIMENSION_MESHES]
    assert set(meshes.DIMENSION_MESHES) <= set(COVERING_MESHES)
    assert sorted(len(c.shape) for c in dims) == [1, 2, 3]
    assert all(c.axis_size >= 2 for c in dims)  # each ring has a step to show a cast or a rounding
    assert max(c.axis_size for c in dims) == max(c.axis_size for c in STANDARD)  # roundings add up
    assert {c.axis_type for c in dims} == {"auto", "explicit"}
    assert any(c.device_order != "ids" for c in dims)


def test_the_loop_length_meshes_are_covering_a_ring_of_one_an_odd_ring_and_the_longest() -> None:
    rings = [parse_mesh(label) for label in meshes.LOOP_LENGTH_MESHES]
    assert set(meshes.LOOP_LENGTH_MESHES) <= set(COVERING_MESHES)
    sizes = {c.axis_size for c in rings}
    assert min(sizes) == 1  # the loop does not run: a ring of one's shortcut
    assert any(n % 2 and n >= 5 for n in sizes)  # an odd ring, several steps each way
    assert max(sizes) == max(c.axis_size for c in STANDARD)  # the most hops to round or overflow over
    assert {c.axis_type for c in rings} == {"auto", "explicit"}


@pytest.mark.parametrize(
    "label", [*STANDARD_MESHES, "6-x-auto", "2x2x2-z-auto", "4-x-auto-v5e", "2x2-y-explicit-v5p"]
)
def test_a_label_reads_back(label: str) -> None:
    assert parse_mesh(label).label == label


def test_a_mesh_takes_its_devices_in_its_order() -> None:
    devices = jax.devices("cpu")
    if len(devices) < 8:
        pytest.skip(f"needs 8 CPU devices, found {len(devices)} (the suite's run has 8)")
    for label, ids in [
        ("8-x-auto", [0, 1, 2, 3, 4, 5, 6, 7]),
        ("8-x-explicit-reversed", [7, 6, 5, 4, 3, 2, 1, 0]),
        ("2x4-y-auto-v5e", [0, 1, 2, 3, 7, 6, 5, 4]),
        ("8-x-explicit-v5p", [0, 4, 2, 6, 1, 5, 3, 7]),
        ("3-x-explicit", [0, 1, 2]),
    ]:
        mesh = meshes.build_mesh(parse_mesh(label), "cpu")
        assert [d.id for d in mesh.devices.flat] == ids, label


needs_libtpu = pytest.mark.skipif(
    not tpu_compiler.available(), reason=f"no TPU compiler here: {tpu_compiler.unavailable_reason()}"
)


@needs_libtpu
@pytest.mark.parametrize(
    "order, shape", [(o, s) for o, table in meshes.TPU_DEVICE_ORDERS.items() for s in table]
)
def test_the_tpu_device_orders_are_jax_make_mesh_s_on_that_slice(order: str, shape: tuple[int, ...]) -> None:
    """The table is what ``jax.make_mesh`` gives the named slice's chips on the JAX it was read with;
    another JAX that orders them otherwise is named in a skip (the table stays, a fixed permutation)."""
    table = meshes.TPU_DEVICE_ORDERS[order][shape]
    assert sorted(table) == list(range(len(table)))  # a permutation of the slice's chips, on any JAX
    chips = tpu_compiler.topology_devices(meshes.TPU_ORDER_SLICES[order][len(table)])
    mesh = jax.make_mesh(shape, meshes.AXIS_NAMES[: len(shape)], devices=chips)
    found = tuple(d.id for d in mesh.devices.flat)
    read_with, _ = meshes.TPU_ORDERS_READ_WITH
    if found != table and jax.__version__ != read_with:
        pytest.skip(
            f"jax.make_mesh of JAX {jax.__version__} orders {shape} as {found}; the table keeps {read_with}'s"
        )
    assert found == table


@needs_libtpu
def test_a_device_order_applies_to_a_tpu_slice_s_own_order() -> None:
    """Compiled for a TPU slice, ``ids`` is the slice's own order (``jax.make_mesh``'s) and another
    order permutes that one."""
    own = [d.id for d in tpu_compiler.mesh_on(parse_mesh("8-x-explicit")).devices.flat]
    assert own == list(meshes.TPU_DEVICE_ORDERS["v5e"][(8,)])  # v5e:2x4's snake
    try:
        reversed_ = [d.id for d in tpu_compiler.mesh_on(parse_mesh("8-x-explicit-reversed")).devices.flat]
    except compat.HostLimit as limit:  # libtpu 0.0.17 and 0.0.50 give chips 4 to 7 no memory
        pytest.skip(str(limit))
    assert reversed_ == own[::-1]
    partial = [d.id for d in tpu_compiler.mesh_on(parse_mesh("6-x-explicit")).devices.flat]
    assert tpu_compiler.topology_for(6) == "v5p:2x2x3" and partial == [0, 1, 2, 3, 4, 5]


@pytest.mark.parametrize(
    "label, says",
    [
        ("6-q-auto", "axis 'q' is not one of ('x',)"),
        ("2x2x2x2-x-auto", "has 4 axes; at most 3"),
        ("3-x-auto-v5e", "no v5e device order is known for the mesh shape 3"),
        ("0-x-auto", "every dimension must be a positive integer"),
        ("8-x-sideways", "expected SHAPE-AXIS-TYPE[-ORDER]"),
    ],
)
def test_a_label_that_names_no_mesh_says_why(label: str, says: str) -> None:
    with pytest.raises(ValueError, match=r".*") as error:
        parse_mesh(label)
    assert says in str(error.value), error.value
