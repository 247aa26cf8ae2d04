"""Reduce-scatter of partials too large for VMEM: the Pallas rings with every buffer in HBM.

Algorithm. The rings, their barrier, credits and drained sends are those of
:mod:`conformance.kernels.reduce_scatter.pallas_ring` (the top rows of each block leftwards, the rest
rightwards; the accumulators travel unrounded and the sum is rounded once on its owner). What changes
is where the data lives: the partial, the result and each direction's two send and two receive
accumulator buffers are HBM refs (``memory_space=ANY``; scratch ``pltpu.HBM``), so the remote DMA of a
step moves a whole accumulator HBM to HBM, and VMEM holds only tiles. Each addition (the accumulator
received plus this device's rows of that block, into the next send buffer or, at the last step, into
the result) is a pipeline over tiles of rows: the operands of tile ``t + 1`` are fetched from HBM while
tile ``t`` is added, and each sum is written back while the next is added (two VMEM slots per operand
and result, a DMA semaphore per slot). A step's credit goes upstream only once its whole pipeline has
written back, so the buffer it read is free for the DMA of two steps on.

JAX's Pallas TPU tutorial builds this kernel's additions with ``pltpu.emit_pipeline`` nested inside the
ring. Here the pipeline is written out (:func:`conformance.kernels._pallas.pipelined`), its slots and
their reuse in plain sight of the interpreter and of the self-test that breaks them; a kernel built on
``emit_pipeline`` is checked all the same (the suite traces it as for a TPU chip; a self-test holds
such a form of this kernel to values, eager and TPU layout).

Tiles. On a TPU a tile is the largest divisor of a direction's rows that is a whole number of packed
sublane tiles (8 rows of 32-bit data, 16 of 16-bit, 32 of 8-bit) and keeps one buffer within
:data:`TILE_BYTES` at the accumulators' width (two slots of four buffers, 4 MiB of VMEM a direction, of
three where the output has the accumulators' dtype); where no divisor is such, one tile of every row.
Under interpret mode a tile is the largest divisor of the rows no more than a third of them (one row
where none is), so a direction of three or more rows goes through three or more tiles and each VMEM slot
is reused: the pipeline's slots, their reuse and its races are what the interpreter runs.

Limits. As the VMEM kernel's (one mesh axis, unrolled steps, float16 widened outside the kernel on a
TPU, a ring of one runs no kernel), but HBM, not VMEM, bounds the partial. Each addition reads its
operands from HBM and writes back once: ``3 m cols`` bytes of HBM traffic a step for ``m cols`` of
transfer, against the VMEM kernel's none, which is the price of a partial of any size.

Gradient: the all-gather of the cotangent (the ring module's ``custom_vjp``).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

import conformance
from conformance.kernels._reduction import REDUCTIONS
from conformance.kernels.reduce_scatter.pallas_ring import reduce_scatter
from conformance.specs.reduce_scatter import REDUCE_SCATTER

#: The most bytes of one VMEM tile buffer (at the accumulators' width) on a TPU.
TILE_BYTES = 512 * 1024


def tile_rows(rows: int, row_bytes: int, *, dtype: jnp.dtype, interpret: bool) -> int:
    """The rows of one tile of a direction's ``rows`` (module docstring, "Tiles")."""
    divisors = [d for d in range(1, rows + 1) if rows % d == 0]
    if interpret:
        return max(d for d in divisors if d <= max(1, rows // 3))
    sublanes = 8 * max(1, 4 // jnp.dtype(dtype).itemsize)
    fitting = [d for d in divisors if d % sublanes == 0 and d * row_bytes <= TILE_BYTES]
    return max(fitting, default=rows)


@conformance.register(
    "reduce_scatter",
    name="pallas_hbm_ring_reduce_scatter_bidirectional",
    pallas=True,
    bidirectional=True,
    differentiable=True,
    dtypes=REDUCE_SCATTER.dtypes,
    reductions=REDUCTIONS,
    description="the Pallas rings with partials and accumulators in HBM, each addition pipelined "
    "through VMEM in tiles",
)
def pallas_hbm_ring_reduce_scatter_bidirectional(
    x: jax.Array, *, mesh: jax.sharding.Mesh, axis_name: str, interpret: Any = False, reduction: str = "add"
) -> jax.Array:
    return reduce_scatter(
        x,
        mesh=mesh,
        axis_name=axis_name,
        interpret=interpret,
        bidirectional=True,
        name="pallas_hbm_ring_reduce_scatter_bidirectional",
        reduction=reduction,
        tile=lambda rows, row_bytes: tile_rows(rows, row_bytes, dtype=x.dtype, interpret=bool(interpret)),
    )
