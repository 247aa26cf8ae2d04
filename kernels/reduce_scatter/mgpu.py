"""JAX's own Mosaic GPU reduce-scatter (NVLink multimem), judged by the GPU compile tier:
:mod:`conformance.kernels._mosaic_gpu`."""

from __future__ import annotations

import jax

import conformance
from conformance.kernels import _mosaic_gpu


@conformance.register(
    "reduce_scatter",
    name="mgpu_reduce_scatter",
    platforms=("gpu",),
    lowering_targets=("cuda",),
    dtypes=_mosaic_gpu.DTYPES,
    supports=_mosaic_gpu.whole_tiles,
    requires=(_mosaic_gpu.MODULE,),
    description="JAX's Mosaic GPU kernel: NVLink multimem load-reduce of each tile, stored on its owner",
)
def mgpu_reduce_scatter(x: jax.Array, *, mesh: jax.sharding.Mesh, axis_name: str) -> jax.Array:
    return _mosaic_gpu.reduced(x, mesh=mesh, axis_name=axis_name, name="mgpu_reduce_scatter", scatter=True)
