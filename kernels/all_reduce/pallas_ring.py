"""All-reduce as one Pallas TPU ring kernel: the reduce-scatter ring, then the sums round the same ring.

Algorithm (JAX's Pallas TPU tutorial's all-reduce, bidirectional). The reduce-scatter kernel's rings
(:mod:`conformance.kernels.reduce_scatter.pallas_ring`: half of each block each way, float32 VMEM
accumulators, two buffers a direction, a barrier first, a credit before a buffer is written again) leave
device ``d`` with row block ``d`` of the sum; it rounds that once to the partials' dtype, writes it to
its output, and for ``n - 1`` more steps of the same rings forwards the block it received last straight
into the next device's output (remote DMA to the same block there). Every replica is the same bits:
each block is summed once, on its owner, and only copied after. One kernel, one barrier: the gather
steps continue the reduce steps' semaphores and credits (a device waits for a credit before the third
step on a link and for its send of two steps back, so no wait can be satisfied by another step's bytes),
and every send is waited and every credit consumed before it returns. Bytes: ``(n-1)/n`` of a partial
in the accumulators' dtype, then ``(n-1)/n`` of the result in its own.

A ring of one runs no kernel: the partial is the sum. The ``shard_map`` declares the result
replicated (``check_vma=False``: it cannot see inside the kernel).

Backward. Every partial adds to the whole replicated result, so each device's gradient is the
cotangent as it is: a ``custom_vjp`` around the ``shard_map`` hands it to each device, moving nothing.

Limits. The reduce-scatter kernel's: the partial, its result and the accumulator buffers in VMEM
(partials of a few MiB); on a TPU it refuses what Mosaic refuses of its DMA windows, naming the rule.
float16 partials enter a compiled kernel widened to float32 (Mosaic takes no float16 arguments, nor
a cast to float16 inside a kernel): each block's float32 sum is gathered as it is and rounded after the
kernel, the same bits on every device, so the replicas still agree; the gather then moves float32. So
do every narrower float's on a libtpu older than 0.0.42, which refuses their windows of fewer rows than
a sublane tile ("Slice shape along dimension 1 must be aligned to tiling (2), but is 1", libtpu 0.0.17).
"""

from __future__ import annotations

from typing import Any

import jax

import conformance
from conformance.kernels._reduction import REDUCTIONS, all_reduced, combine, validate
from conformance.kernels.reduce_scatter.pallas_ring import scattered_partial
from conformance.specs.all_reduce import ALL_REDUCE


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
        return scattered_partial(
            block[0],
            axis_name=axis_name,
            mesh_axes=mesh_axes,
            interpret=interpret,
            bidirectional=bidirectional,
            name=name,
            reduction=reduction,
            gather=True,
        )

    return all_reduced(per_device, x, mesh=mesh, axis_name=axis_name)


@conformance.register(
    "all_reduce",
    name="pallas_ring_all_reduce_bidirectional",
    pallas=True,
    bidirectional=True,
    differentiable=True,
    dtypes=ALL_REDUCE.dtypes,
    reductions=REDUCTIONS,
    description="one Pallas kernel: the reduce-scatter rings, then the rounded sums round the same rings",
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
