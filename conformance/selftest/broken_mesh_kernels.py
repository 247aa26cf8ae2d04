"""Kernels right on every ring of 2, 4 and 8 in id order, and wrong on the meshes kernels also meet:
a ring of 3, 5, 6 or 7, a ring of one, a 3-D mesh, devices in another order.

Each is a defect found in the field or one step from it, and each is exact on the meshes a suite of
power-of-two rings in id order builds. ``EXPECTED_REJECTION`` names the check that must reject each,
``EXPECTED_MESSAGE`` a phrase of its failure (the mesh it needs).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

import conformance
from conformance.kernels._ring import ring_perm
from conformance.kernels.all_gather.pallas_ring import pallas_ring_all_gather_bidirectional
from conformance.kernels.allgather_matmul._common import local_matmul, validate

EXPECTED_REJECTION: dict[str, str] = {
    "broken_ring_wraps_with_bit_mask": "test_values",
    "broken_bidirectional_split_assumes_even_ring": "test_values",
    "broken_ring_of_one_skips_cast": "test_dtype",
    "broken_pallas_ring_of_one_returns_input": "test_output_sharding",
    "broken_ring_position_from_the_next_axis_only": "test_values",
    "broken_ring_in_device_id_order": "test_values",
}
EXPECTED_MESSAGE: dict[str, str] = {
    # (i + 1) & (n - 1) is i + 1 mod n for a power of two only
    "broken_ring_wraps_with_bit_mask": "values differ",
    "broken_bidirectional_split_assumes_even_ring": "values differ",
    "broken_ring_of_one_skips_cast": "mesh(x=1",
    "broken_pallas_ring_of_one_returns_input": "only because axis 'x' has size 1",
    "broken_ring_position_from_the_next_axis_only": "mesh(x=2, y=2, z=2",
    "broken_ring_in_device_id_order": "devices in",
}


def _gather_ring(lhs, rhs, *, mesh, axis_name, slot=None, position=None, perm=None, check_vma=True):
    """A unidirectional gather ring (blocks travel left, j -> j-1): at step s device p holds the block
    of device p + s and writes its product to that block's rows. Hooks, each right by default:
    ``slot(owner, n)``, the block index a product lands in; ``position(n)``, this device's place
    on the ring; ``perm(n)``, the ppermute pairs of one hop."""
    slot = slot or (lambda owner, n: lax.rem(owner, n))
    position = position or (lambda n: lax.axis_index(axis_name))
    perm = perm or (lambda n: ring_perm(n, -1))

    def body(lhs_block, rhs_block):
        n, m = lax.axis_size(axis_name), lhs_block.shape[0]
        me = position(n)
        out = jnp.zeros((m * n, rhs_block.shape[1]), local_matmul(lhs_block, rhs_block).dtype)
        block = lhs_block
        for step in range(n):
            if step < n - 1:
                arriving = lax.ppermute(block, axis_name, perm(n))
            out = lax.dynamic_update_slice(out, local_matmul(block, rhs_block), (slot(me + step, n) * m, 0))
            if step < n - 1:
                block = arriving
        return out

    return jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(P(axis_name, None), P(None, axis_name)),
        out_specs=P(None, axis_name),
        check_vma=check_vma,
    )(lhs, rhs)


@conformance.register("allgather_matmul", name="broken_ring_wraps_with_bit_mask")
def broken_ring_wraps_with_bit_mask(lhs, rhs, *, mesh, axis_name):
    """Wraps the slot of block ``me + s`` with ``& (n - 1)``, as code written for power-of-two rings
    does: ``mod n`` for n = 1, 2, 4, 8; on a ring of 3 block 3 lands in slot 3 & 2 = 2, not 0."""
    validate("broken_ring_wraps_with_bit_mask", lhs, rhs, mesh, axis_name)
    return _gather_ring(
        lhs, rhs, mesh=mesh, axis_name=axis_name, slot=lambda owner, n: lax.bitwise_and(owner, n - 1)
    )


@conformance.register("allgather_matmul", name="broken_bidirectional_split_assumes_even_ring")
def broken_bidirectional_split_assumes_even_ring(lhs, rhs, *, mesh, axis_name):
    """A bidirectional ring that sends whole blocks both ways, ``n // 2`` hops left and ``n // 2 - 1``
    right: the n - 1 other blocks where n is even, one short where n is odd (the block half a ring
    away is never visited, and its rows stay zero)."""
    validate("broken_bidirectional_split_assumes_even_ring", lhs, rhs, mesh, axis_name)

    def body(lhs_block, rhs_block):
        n, me, m = lax.axis_size(axis_name), lax.axis_index(axis_name), lhs_block.shape[0]
        out = jnp.zeros((m * n, rhs_block.shape[1]), local_matmul(lhs_block, rhs_block).dtype)
        out = lax.dynamic_update_slice(out, local_matmul(lhs_block, rhs_block), (me * m, 0))
        for direction, hops in ((-1, n // 2), (+1, n // 2 - 1)):
            block = lhs_block
            for hop in range(1, hops + 1):
                block = lax.ppermute(block, axis_name, ring_perm(n, direction))
                owner = lax.rem(me - direction * hop + n * hop, n)
                out = lax.dynamic_update_slice(out, local_matmul(block, rhs_block), (owner * m, 0))
        return out

    return jax.shard_map(
        body, mesh=mesh, in_specs=(P(axis_name, None), P(None, axis_name)), out_specs=P(None, axis_name)
    )(lhs, rhs)


@conformance.register("allgather_matmul", name="broken_ring_of_one_skips_cast")
def broken_ring_of_one_skips_cast(lhs, rhs, *, mesh, axis_name):
    """A ring-of-one short cut (``if n == 1``: a local matmul, nothing to move) that returns the
    float32 accumulator of a 16-bit matmul instead of casting it back, which the ring path does."""
    n = validate("broken_ring_of_one_skips_cast", lhs, rhs, mesh, axis_name)
    if n == 1:
        accumulator = jnp.float32 if jnp.issubdtype(lhs.dtype, jnp.floating) else lhs.dtype
        return jax.shard_map(
            lambda a, b: jnp.dot(a, b, preferred_element_type=accumulator),
            mesh=mesh,
            in_specs=(P(axis_name, None), P(None, axis_name)),
            out_specs=P(None, axis_name),
        )(lhs, rhs)
    return _gather_ring(lhs, rhs, mesh=mesh, axis_name=axis_name)


@conformance.register("all_gather", name="broken_pallas_ring_of_one_returns_input", pallas=True)
def broken_pallas_ring_of_one_returns_input(x, *, mesh, axis_name, interpret=False):
    """The seed kernel's ``if axis size == 1: return x``: the right values, in ``x``'s sharding. On an
    Explicit mesh that types the result as sharded over the axis, where the family's is replicated."""
    if mesh.shape[axis_name] == 1:
        return x
    return pallas_ring_all_gather_bidirectional(x, mesh=mesh, axis_name=axis_name, interpret=interpret)


@conformance.register("allgather_matmul", name="broken_ring_position_from_the_next_axis_only")
def broken_ring_position_from_the_next_axis_only(lhs, rhs, *, mesh, axis_name):
    """Finds its place on the ring from its linear index over every mesh axis, dividing by the size of
    the next axis alone where the product of every later axis is meant: right on 1-D and 2-D meshes
    (there the next axis is every later one), wrong with the ring on the first axis of a 3-D mesh."""
    validate("broken_ring_position_from_the_next_axis_only", lhs, rhs, mesh, axis_name)
    names = tuple(mesh.axis_names)
    later = names[names.index(axis_name) + 1 :]
    stride = mesh.shape[later[0]] if later else 1  # the defect: prod(mesh.shape[a] for a in later)

    def position(n):
        return lax.rem(lax.div(lax.axis_index(names), stride), n)

    # an index over every axis varies over every axis: shard_map's replication check must be off
    return _gather_ring(lhs, rhs, mesh=mesh, axis_name=axis_name, position=position, check_vma=False)


@conformance.register("allgather_matmul", name="broken_ring_in_device_id_order")
def broken_ring_in_device_id_order(lhs, rhs, *, mesh, axis_name):
    """Sends each block to the device of the next lower id along the ring, as NCCL-style code that
    ranks devices by id does, while placing products by mesh position: the same ring where a mesh
    takes its devices in id order, another ring (a reversed one, a TPU slice's snake) elsewhere."""
    validate("broken_ring_in_device_id_order", lhs, rhs, mesh, axis_name)
    along = np.moveaxis(mesh.devices, list(mesh.axis_names).index(axis_name), 0).reshape(
        mesh.shape[axis_name], -1
    )[:, 0]
    by_id = [int(p) for p in np.argsort([d.id for d in along])]  # ring positions in device-id order
    n = len(by_id)
    id_perm = [(by_id[k], by_id[(k - 1) % n]) for k in range(n)]
    return _gather_ring(lhs, rhs, mesh=mesh, axis_name=axis_name, perm=lambda n: id_perm)
