"""JAX's own Mosaic GPU reduction kernel (``jax.experimental.pallas.ops.gpu.reduce_scatter_mgpu``), as a
built-in of the reduce-scatter and all-reduce families.

Algorithm (JAX's). Each device's partial is cut into tiles spread over the GPU's SMs; for each tile of
the block a device owns, one NVLink *multimem* load-reduce reads that tile from every device's partial
at once (the switch adds them) and one multimem store writes the sum to every device that wants it:
its owner (a reduce-scatter, ``scatter_dimension=0``) or all (an all-reduce, ``None``). No ring, no
per-hop rounding: the switch sums in the partials' dtype. The data moves inside the kernel, so the
compiled module shows no collective.

Limits. An H100-class GPU with NVLink multimem, every device of the axis in one NVLink domain; JAX's
kernel takes 128-element-aligned outputs and tiles rows by its own rules (it raises "Output size
must be divisible by 128" or "Major dimension size ... must be divisible by the inferred major tile
size" otherwise), so these built-ins claim blocks of whole 32-row, 128-column tiles. Nothing here runs
them: no CPU runs Mosaic GPU, and this suite's hosts have no GPU. The GPU compile tier compiles them
with XLA:GPU and Mosaic GPU for H100 topologies (``num_blocks`` given as the topology's SM count, which
JAX's kernel would otherwise ask of the default device); their values are JAX's own tests' to hold.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
from jax.sharding import PartitionSpec as P

from conformance import compat
from conformance.kernels._reduction import validate

#: JAX's module: imported where the kernel is traced (it needs jaxlib's Mosaic GPU).
MODULE = "jax.experimental.pallas.ops.gpu.reduce_scatter_mgpu"
#: The dtypes JAX's own tests run it at.
DTYPES = ("float32", "bfloat16", "float16", "int32")
#: The GPUs one NVLink domain joins (an H100 host).
NVLINK_DOMAIN = 8
#: The SMs of an H100 SXM, where a device does not say (a CPU device describing a mesh).
H100_SMS = 132


def whole_tiles(*, dims: Mapping[str, int], dtype: str, axis_size: int, mesh_shape: Any) -> str | None:
    """What JAX's kernel takes here: blocks of whole 32 x 128 tiles, a ring within one NVLink domain
    of :data:`NVLINK_DOMAIN` GPUs (a multimem address spans one; XLA:GPU compiles the kernel for two
    hosts all the same, and it could not run there), on a mesh of one axis (its collectives span every
    axis of the mesh: "Only collective_axes that include all JAX device mesh axes are supported")."""
    if len(mesh_shape) > 1:
        return f"JAX's Mosaic GPU kernel reduces over every axis of the mesh, not one of {len(mesh_shape)}"
    if axis_size > NVLINK_DOMAIN:
        return f"JAX's Mosaic GPU kernel reduces within an NVLink domain of {NVLINK_DOMAIN}, not {axis_size}"
    if dims["rows_per_shard"] % 32 or dims["cols"] % 128:
        return (
            f"JAX's Mosaic GPU kernel tiles a block by 32 rows and 128 columns; rows_per_shard="
            f"{dims['rows_per_shard']}, cols={dims['cols']}"
        )
    return None


def reduced(x: jax.Array, *, mesh: jax.sharding.Mesh, axis_name: str, name: str, scatter: bool) -> jax.Array:
    """The partials ``x[n, M, cols]`` summed by JAX's Mosaic GPU kernel: each device's row block
    (``scatter``) or the whole sum, replicated."""
    import importlib

    validate(name, x, mesh, axis_name)
    try:
        kernel = importlib.import_module(MODULE).reduce_scatter
    except ModuleNotFoundError as missing:  # JAX 0.6 has no such kernel: this JAX's limit, not the kernel's
        raise compat.HostLimit(f"JAX {jax.__version__} has no {MODULE} ({missing})") from missing
    sms = getattr(mesh.devices.flat[0], "core_count", None) or H100_SMS

    def per_device(block: jax.Array) -> jax.Array:
        return kernel(block[0], axis_name=axis_name, scatter_dimension=0 if scatter else None, num_blocks=sms)

    out = P(axis_name, None) if scatter else P()
    return jax.shard_map(
        per_device, mesh=mesh, in_specs=P(axis_name, None, None), out_specs=out, check_vma=False
    )(x)
