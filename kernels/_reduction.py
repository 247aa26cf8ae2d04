"""What the reduction families' built-ins share (``reduce_scatter``, ``all_reduce``): argument validation,
the reductions they compute, the compiler's own form."""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from conformance import compat
from conformance.kernels._ring import accumulator_dtype
from conformance.kernels._validation import axis_size, require_divisible


def validate(
    name: str, x: jax.Array, mesh: jax.sharding.Mesh, axis_name: str, *, scatter_dimension: int = 0
) -> int:
    """Raise ``ValueError`` naming the offending values; return the axis size. ``x`` is the stacked
    partials ``[n, M, cols]``: one ``[M, cols]`` partial per device of the axis (``[n, cols, M]`` for
    a reduce-scatter along the partials' last dim, ``scatter_dimension=1``)."""
    n = axis_size(name, mesh, axis_name)
    if x.ndim != 3 or x.shape[0] != n:
        form = "x[{n}, cols, M]" if scatter_dimension else "x[{n}, M, cols]"
        raise ValueError(
            f"{name}: expected the partials stacked on the mesh axis, {form.format(n=n)}, got {x.shape}"
        )
    what = "columns" if scatter_dimension else "rows"
    require_divisible(
        name, f"M ({what} of each partial, scattered)", x.shape[1 + scatter_dimension], n, axis_name
    )
    return n


def summed_by_the_compiler(
    x: jax.Array, *, out: jax.sharding.NamedSharding, reduction: str = "add"
) -> jax.Array:
    """``x.sum(0)`` of the stacked partials in their accumulator dtype, rounded once, its result sharded
    as ``out``, left to XLA's partitioner (no ``shard_map``): the compiler picks the collective (a
    reduce-scatter or an all-reduce of the partials). On a mesh whose axes are ``Explicit`` the sum's
    own type is replicated and is resharded to ``out``; on ``Auto`` axes ``out`` is a sharding
    constraint on the result."""
    if reduction == "add":
        total = jnp.sum(x, axis=0, dtype=accumulator_dtype(x.dtype)).astype(x.dtype)
    else:
        total = ALONG_AXIS[reduction](x, axis=0)
    kinds = dict(zip(out.mesh.axis_names, out.mesh.axis_types, strict=True))
    if any("Explicit" in str(kind) for kind in kinds.values()):
        return compat.reshard(total, out)
    return jax.lax.with_sharding_constraint(total, out)


#: The reductions the built-ins compute (``reduction=``), each as the elementwise operation that
#: combines two partials.
COMBINE = {"add": jnp.add, "min": jnp.minimum, "max": jnp.maximum}
#: What every built-in reduction kernel declares (``register(..., reductions=REDUCTIONS)``).
REDUCTIONS = tuple(COMBINE)
#: The min and max over an array axis, and over a mesh axis (XLA's own collective of each: JAX has
#: no min or max ``psum_scatter``, so a reduce-scatter of them is this and a slice).
ALONG_AXIS = {"min": jnp.min, "max": jnp.max}
OVER_MESH_AXIS = {"min": lax.pmin, "max": lax.pmax}


def combine(name: str, reduction: str) -> Callable[[jax.Array, jax.Array], jax.Array]:
    """The elementwise operation of ``reduction``; ``ValueError`` naming it for one the kernel lacks."""
    try:
        return COMBINE[reduction]
    except KeyError:
        raise ValueError(f"{name}: reduction={reduction!r} is not one of {REDUCTIONS}") from None


def all_reduced(
    per_device: Callable[[jax.Array], jax.Array], x: jax.Array, *, mesh: jax.sharding.Mesh, axis_name: str
) -> jax.Array:
    """``per_device`` (a device's ``[1, M, cols]`` partial -> the whole reduction, the same on every
    device) over ``x`` in a ``shard_map`` whose result is declared replicated, ``P()``
    (``check_vma=False``: a ring's result is typed varying), with its gradient: every partial adds to the
    whole replicated result, so each device's is the replicated cotangent as it is, handed over by a
    ``custom_vjp`` that moves nothing (JAX's own transpose would scale it and add a defensive
    all-reduce over the mesh's other axes)."""
    ring = jax.shard_map(
        per_device, mesh=mesh, in_specs=P(axis_name, None, None), out_specs=P(), check_vma=False
    )
    spread = jax.shard_map(lambda ct: ct[None], mesh=mesh, in_specs=P(), out_specs=P(axis_name, None, None))

    @jax.custom_vjp
    def all_reduce(x: jax.Array) -> jax.Array:
        return ring(x)

    def forward(x: jax.Array) -> tuple[jax.Array, None]:
        return ring(x), None

    def backward(_: None, ct: jax.Array) -> tuple[jax.Array]:
        return (spread(ct),)

    all_reduce.defvjp(forward, backward)
    return all_reduce(x)
