"""All-reduce over a ring of ``ppermute`` s, uni- and bidirectional: a reduce-scatter ring, then a
gather ring of the reduced blocks.

Problem. Each of n devices holds an ``[M, cols]`` partial; every device must end with the whole sum,
bitwise the same on each. The reduce-scatter ring (:mod:`conformance.kernels.reduce_scatter.ring`)
leaves device ``d`` with row block ``d`` of the sum in float32 accumulators for 16-bit floats; it is
rounded once to the input dtype, and the gather ring copies the n rounded blocks to every device.
Every replica is the same bits: each block is summed once, on its owner, and then only copied (a
device that summed its own copy in its own order would hold a different rounding).

Bytes: ``(n-1)/n`` of one partial twice per device, the first half in the accumulator dtype: within
the family's bound, which is the least a ring needs in the partial sums' dtype.

Backward. The result is replicated and every partial adds to all of it, so each device's gradient is
the cotangent as it is: a ``jax.custom_vjp`` around the whole ``shard_map`` whose backward hands each
device the replicated cotangent, moving nothing. The ring's result is typed varying over the axis, so
its ``shard_map`` runs with ``check_vma=False`` to return it as ``P()``; JAX's own transpose of that
would scale the cotangent and add the defensive all-reduce over the mesh's other axes (the suite's
gradient and backward-collectives checks reject both), which the custom backward keeps out.
"""

from __future__ import annotations

import functools

import jax

import conformance
from conformance.kernels._reduction import REDUCTIONS, all_reduced, combine, validate
from conformance.kernels.reduce_scatter.ring import gathered_rows, scattered_sum
from conformance.specs.all_reduce import ALL_REDUCE


def _per_device(block: jax.Array, *, axis_name: str, bidirectional: bool, reduction: str) -> jax.Array:
    mine = scattered_sum(block[0], axis_name, bidirectional=bidirectional, reduction=reduction).astype(
        block.dtype
    )
    return gathered_rows(mine, axis_name, bidirectional=bidirectional)


def _shard_mapped(
    x: jax.Array, mesh: jax.sharding.Mesh, axis_name: str, *, bidirectional: bool, reduction: str = "add"
) -> jax.Array:
    per_device = functools.partial(
        _per_device, axis_name=axis_name, bidirectional=bidirectional, reduction=reduction
    )
    return all_reduced(per_device, x, mesh=mesh, axis_name=axis_name)


@conformance.register(
    "all_reduce",
    name="ring_all_reduce_unidirectional",
    differentiable=True,
    dtypes=ALL_REDUCE.dtypes,
    reductions=REDUCTIONS,
    description="a reduce-scatter ring in float32, then a gather ring of the rounded blocks, one way",
)
def ring_all_reduce_unidirectional(
    x: jax.Array, *, mesh: jax.sharding.Mesh, axis_name: str, reduction: str = "add"
) -> jax.Array:
    validate("ring_all_reduce_unidirectional", x, mesh, axis_name)
    combine("ring_all_reduce_unidirectional", reduction)
    return _shard_mapped(x, mesh, axis_name, bidirectional=False, reduction=reduction)


@conformance.register(
    "all_reduce",
    name="ring_all_reduce_bidirectional",
    bidirectional=True,
    differentiable=True,
    dtypes=ALL_REDUCE.dtypes,
    reductions=REDUCTIONS,
    description="both rings with half of each block going each way",
)
def ring_all_reduce_bidirectional(
    x: jax.Array, *, mesh: jax.sharding.Mesh, axis_name: str, reduction: str = "add"
) -> jax.Array:
    validate("ring_all_reduce_bidirectional", x, mesh, axis_name)
    combine("ring_all_reduce_bidirectional", reduction)
    return _shard_mapped(x, mesh, axis_name, bidirectional=True, reduction=reduction)
