"""All-reduce as two Pallas TPU ring kernels: the reduce-scatter ring, then the all-gather ring.

Algorithm. The reduce-scatter kernel (:mod:`conformance.kernels.reduce_scatter.pallas_ring`) leaves
device ``d`` with row block ``d`` of the sum, added in float32 VMEM accumulators and rounded once to
the partials' dtype; the all-gather kernel (:mod:`conformance.kernels.all_gather.pallas_ring`) copies
the n rounded blocks to every device by remote DMA. Every replica is then the same bits: each block is
summed once, on its owner, and only copied after. Each kernel has its own barrier and leaves no
semaphore with a count, so the second may follow the first on the same ``collective_id``. Bytes: the
reduce-scatter's ``(n-1)/n`` of a partial in float32, then ``(n-1)/n`` of the result in its dtype.

A ring of one runs neither kernel: the partial is the sum. The ``shard_map`` declares the result
replicated (``check_vma=False``: it cannot see inside the kernels).

Backward. Every partial adds to the whole replicated result, so each device's gradient is the
cotangent as it is: a ``custom_vjp`` around the ``shard_map`` hands it to each device, moving nothing.

Limits. The reduce-scatter kernel's (partials of a few MiB, in VMEM) and the all-gather kernel's: on a
TPU it refuses what Mosaic refuses of its DMA windows, naming the rule. float16 partials are summed in
float32 and their float16 blocks are gathered as bfloat16 bits (Mosaic takes no float16 arguments; a
DMA moves bits whatever their type).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

import conformance
from conformance.kernels._reduction import REDUCTIONS, all_reduced, combine, validate
from conformance.kernels.all_gather.pallas_ring import gathered_shards
from conformance.kernels.reduce_scatter.pallas_ring import scattered_partial
from conformance.specs.all_reduce import ALL_REDUCE

#: Element types gathered as the bits of another of their width (Mosaic takes no float16 arguments).
GATHERED_AS = {jnp.dtype(jnp.float16): jnp.dtype(jnp.bfloat16)}


def _all_reduce(
    x: jax.Array,
    *,
    mesh: jax.sharding.Mesh,
    axis_name: str,
    interpret: Any,
    bidirectional: bool,
    name: str,
    reduction: str = "add",
) -> jax.Array:
    validate(name, x, mesh, axis_name)
    combine(name, reduction)
    mesh_axes = tuple(mesh.axis_names)

    def per_device(block: jax.Array) -> jax.Array:
        mine = scattered_partial(
            block[0],
            axis_name=axis_name,
            mesh_axes=mesh_axes,
            interpret=interpret,
            bidirectional=bidirectional,
            name=name,
            reduction=reduction,
        )
        carrier = GATHERED_AS.get(mine.dtype) if not interpret else None
        moved = lax.bitcast_convert_type(mine, carrier) if carrier is not None else mine
        every = gathered_shards(
            moved,
            axis_name=axis_name,
            mesh_axes=mesh_axes,
            interpret=interpret,
            bidirectional=bidirectional,
            name=name,
        )
        return lax.bitcast_convert_type(every, mine.dtype) if carrier is not None else every

    return all_reduced(per_device, x, mesh=mesh, axis_name=axis_name)


@conformance.register(
    "all_reduce",
    name="pallas_ring_all_reduce_bidirectional",
    pallas=True,
    bidirectional=True,
    differentiable=True,
    dtypes=ALL_REDUCE.dtypes,
    reductions=REDUCTIONS,
    description="the Pallas reduce-scatter and all-gather rings, half of each block each way",
)
def pallas_ring_all_reduce_bidirectional(
    x: jax.Array, *, mesh: jax.sharding.Mesh, axis_name: str, interpret: Any = False, reduction: str = "add"
) -> jax.Array:
    return _all_reduce(
        x,
        mesh=mesh,
        axis_name=axis_name,
        interpret=interpret,
        bidirectional=True,
        name="pallas_ring_all_reduce_bidirectional",
        reduction=reduction,
    )
