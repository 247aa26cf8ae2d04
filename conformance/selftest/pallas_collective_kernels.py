"""A Pallas kernel that moves data by the family's collectives: a ``ppermute`` ring of small
``pallas_call`` matmuls, registered ``pallas=True`` (its matmuls take the ``interpret`` keyword).

What a kernel may use, and which checks judge it, follows from what its module does: its transfers
are ordinary collective-permutes, which the family allows and whose overlap the dataflow and the
real TPU schedule judge, as for any ring. (The suite once allowed a Pallas kernel no collective at
all and judged neither overlap: a correct kernel failed ``collectives`` and ``cross_lowering``.)
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.sharding import PartitionSpec as P

import conformance
from conformance import compat


def _matmul_kernel(a_ref, b_ref, o_ref):
    o_ref[...] = jnp.dot(a_ref[...], b_ref[...], preferred_element_type=jnp.float32).astype(o_ref.dtype)


def _pallas_matmul(a: jax.Array, b: jax.Array, *, axis_name: str, interpret) -> jax.Array:
    # under shard_map's check_vma the out_shape says the product varies over the ring's axis
    out = compat.varying_shape_dtype_struct(
        (a.shape[0], b.shape[1]), a.dtype, varying_axes=frozenset({axis_name})
    )
    return pl.pallas_call(_matmul_kernel, out_shape=out, interpret=interpret)(a, b)


@conformance.register(
    "allgather_matmul",
    name="correct_ppermute_ring_of_pallas_matmuls",
    pallas=True,
    dtypes=("float32", "bfloat16"),
    description="a ppermute ring whose step matmuls are pallas_calls",
)
def correct_ppermute_ring_of_pallas_matmuls(lhs, rhs, *, mesh, axis_name, interpret=False):
    n = mesh.shape[axis_name]
    matmul = functools.partial(_pallas_matmul, axis_name=axis_name, interpret=interpret)

    def body(block, w):
        m, me = block.shape[0], lax.axis_index(axis_name)
        to_left = [(j, (j - 1) % n) for j in range(n)]
        pieces = []
        for s in range(n):  # at step s this device holds the block of device me + s
            incoming = lax.ppermute(block, axis_name, to_left) if s < n - 1 else None
            pieces.append(matmul(block, w))
            block = incoming
        products = jnp.stack(pieces)  # [n, m, cols], by step
        rows = jnp.roll(products, me, axis=0)  # by owner
        return rows.reshape(n * m, -1)

    return jax.shard_map(
        body, mesh=mesh, in_specs=(P(axis_name, None), P(None, axis_name)), out_specs=P(None, axis_name)
    )(lhs, rhs)
