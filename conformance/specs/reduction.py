"""What the two reduction families share (:mod:`~conformance.specs.reduce_scatter`,
:mod:`~conformance.specs.all_reduce`): the operand, the reference, the tolerance, the bad inputs and
the source tags.

The operand is the per-device partials stacked on a leading mesh axis: ``x[n, M, cols]`` sharded
``P(axis_name, None, None)``, so device ``d`` holds ``x[d]`` (one ``[1, M, cols]`` block), its whole
``[M, cols]`` partial, with ``M = n * rows_per_shard``. This is what a kernel meets inside
``jax.shard_map`` (a full-size addend per device, as after a matmul whose contraction is sharded), and
the global array says so without a convention: its leading axis is the mesh axis, its sum over that
axis is the reduction. The reference is that sum in float64, exact for integers; the tolerance
allows a rounding per addition (:func:`conformance.tolerances.reduction_tolerance`; float8 partials,
whose per-hop rounding would excuse anything, are held to a float32 sum rounded once), and the
accuracy check holds a kernel to the baseline's own error (float32 sums, rounded once).
"""

from __future__ import annotations

import numpy as np
from jax.sharding import PartitionSpec as P

from conformance import tolerances
from conformance.specs.base import BadInput, Dims, Operand, RegistrationOption


def x_shape(d: Dims, n: int) -> tuple[int, int, int]:
    """The stacked partials: ``[n, M, cols]``, ``M = n * rows_per_shard``."""
    return (n, n * d["rows_per_shard"], d["cols"])


def block_shape(d: Dims, n: int) -> tuple[int, int]:
    """One partial, and the reduced result: ``[M, cols]``."""
    return (n * d["rows_per_shard"], d["cols"])


def reference(x: np.ndarray) -> np.ndarray:
    """The sum of the partials (float64)."""
    return x.sum(axis=-3)


def tolerance(x: np.ndarray, dtype: str) -> np.ndarray:
    """A rounding per addition of the n partials (exact for integers)."""
    return tolerances.reduction_tolerance(np.moveaxis(x, -3, 0), dtype)


def scattered_blocks_received(d: Dims, n: int, itemsize: int) -> int:
    """The n - 1 contributions to this device's ``rows_per_shard`` rows: the least a reduce-scatter
    receives."""
    return (n - 1) * d["rows_per_shard"] * d["cols"] * itemsize


def bad_inputs(n: int) -> tuple[BadInput, ...]:
    """A reduce-scatter's: partials whose rows do not divide by the ring (its result is cut into ``n``
    row blocks), and an axis the mesh lacks."""
    rows_bad = 2 * n + 1
    divisibility = (
        BadInput(
            f"partials of {rows_bad} rows, not divisible by the axis size {n}",
            ((n, rows_bad, 8),),
            None,
            (str(rows_bad), str(n)),
        ),
    )
    # every size is divisible by a ring of one: there the only forbidden input is the unknown axis
    return (divisibility if n > 1 else ()) + replicated_bad_inputs(n)


def replicated_bad_inputs(n: int) -> tuple[BadInput, ...]:
    """An all-reduce's: an axis the mesh lacks. Partials of any number of rows have a sum (``lax.psum``
    takes them), so rows that do not divide by the ring are not forbidden: a kernel may refuse them
    (it is never given them) or pad its blocks."""
    return (
        BadInput(
            "axis_name 'nonexistent_axis' is not a mesh axis",
            ((n, n, 8),),
            "nonexistent_axis",
            ("nonexistent_axis",),
        ),
    )


def block_tags(shapes: tuple[tuple[int, ...], ...], n: int, sources: tuple[int, ...]) -> tuple[np.ndarray]:
    """``x`` zero but the partials of the ring positions ``sources``, each row of which carries the tag
    of the result's row block it adds to (block ``r``: ``r + 1``): a position whose partial is dropped
    leaves its blocks short of the tags, one counted twice doubles them."""
    (shape,) = shapes
    x = np.zeros(shape)
    rows = shape[-2] // n
    tags = (np.arange(shape[-2]) // rows + 1)[:, None]
    for s in sources:
        x[..., s, :, :] = tags
    return (x,)


def replicated_vjp(x: np.ndarray, ct: np.ndarray) -> tuple[np.ndarray]:
    """Every partial adds to every element of the result: each one's gradient is the whole cotangent."""
    return (np.broadcast_to(ct, x.shape).copy(),)


def exact_vjp_tolerance(x: np.ndarray, ct: np.ndarray, dtype: str) -> tuple[np.ndarray]:
    """The cotangent is copied, never summed: exact."""
    return (tolerances.data_movement_tolerance(x.shape),)


#: The reductions a reduction kernel may declare beside the sum (``lax.psum_scatter``'s and
#: ``reduce_scatter_mgpu``'s ``reduction="min"|"max"``): the elementwise min or max of the partials,
#: exact in every dtype.
OTHER_REDUCTIONS = {
    "min": lambda x: x.min(axis=-3),
    "max": lambda x: x.max(axis=-3),
}

#: ``reductions``, the reduction families' registration option: the reductions a kernel computes,
#: ``"add"`` (the family's own) and any of :data:`OTHER_REDUCTIONS`, each called as ``reduction=NAME``.
REDUCTIONS_OPTION = RegistrationOption(
    default=("add",),
    accepts=lambda v: isinstance(v, tuple) and "add" in v and set(v) <= {"add", *OTHER_REDUCTIONS},
    expects=f"a tuple of reductions that includes 'add', of {('add', *OTHER_REDUCTIONS)}",
    doc="the reductions the kernel computes, called with reduction='min' or 'max' for those other than "
    "the sum (the default, ('add',), takes no such keyword)",
)


#: The spec fields the two reduction families share (each adds its result's sharding, its collectives
#: and bytes, its backward and its accuracy text): the operand, the dims and dtypes, the reference and
#: tolerance, the bad inputs, the gradient's reference, the accuracy and TPU-native dims, the block
#: tags and the reductions beside the sum.
SHARED_FIELDS = {
    "operands": (Operand("x", lambda a: P(a, None, None), x_shape),),
    "out_shape": block_shape,
    "dims": ("rows_per_shard", "cols"),
    "canonical_dims": {"rows_per_shard": 3, "cols": 8},
    # 20: several tiles of a pipeline's 8 and 16 rows with a remainder (10 a direction of a bidirectional
    # ring: one tile of 8 and 2 rows), where a kernel that tiles without dividing drops its last rows
    "dim_values": {"rows_per_shard": (1, 2, 3, 5, 8, 20), "cols": (1, 8, 128, 256)},
    "dtypes": ("float32", "bfloat16", "float16", "int32", "float8_e4m3fn", "float8_e5m2"),
    "reference": reference,
    "tolerance": tolerance,
    "bad_inputs": bad_inputs,
    "vjp_reference": replicated_vjp,
    "vjp_tolerance": exact_vjp_tolerance,
    "accuracy_dtypes": ("bfloat16", "float16"),
    "accuracy_dims": {"rows_per_shard": 16, "cols": 64},
    "tpu_native_dims": {"rows_per_shard": 32, "cols": 128},
    "block_tags": block_tags,
    "block_unit": "partial",
    "other_reductions": OTHER_REDUCTIONS,
    "registration_options": {"reductions": REDUCTIONS_OPTION},
}
