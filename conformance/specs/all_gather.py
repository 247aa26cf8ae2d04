"""Family ``all_gather``: gather row shards so every device holds the whole array.

``fn(x, *, mesh, axis_name)``: ``x`` is a global ``[rows, cols]`` array sharded
along dim 0 over ``axis_name`` (``P(axis_name)``); the result holds the same
values, replicated over ``axis_name``. On a 2-D mesh the other axis is
replicated on input and output, so the result's spec is ``P()``.

Pure data movement: the result must be bitwise equal to the input. Each device
must receive the ``n - 1`` shards it does not hold, ``(n-1)/n`` of ``x``, which
is both the lower bound and the allowed maximum. XLA-level implementations may
move data by all-gather or collective-permute; a Pallas kernel moves it with
remote DMAs inside the kernel, so its compiled module may hold no collective at
all around the kernel call.

Gradient: the result is the input, replicated, so ``d_x`` is the cotangent's
rows this device holds: a slice, exact, with no collective at all (an all-reduce
in the backward is the defensive one shard_map adds when it cannot tell that
the output is replicated).
"""

from __future__ import annotations

import numpy as np
from jax.sharding import PartitionSpec as P

from conformance import tolerances
from conformance.specs.base import BadInput, Dims, FamilySpec, Operand, rows_tagged_by_position


def _x_shape(d: Dims, n: int) -> tuple[int, int]:
    return (d["rows_per_shard"] * n, d["cols"])


def _shards_not_held(d: Dims, n: int, itemsize: int) -> int:
    return (n - 1) * d["rows_per_shard"] * d["cols"] * itemsize


def _bad_inputs(n: int) -> tuple[BadInput, ...]:
    rows_bad = 2 * n + 1
    divisibility = (
        BadInput(
            f"{rows_bad} rows not divisible by the axis size {n}",
            ((rows_bad, 128),),
            None,
            (str(rows_bad), str(n)),
        ),
    )
    unknown_axis = (
        BadInput(
            "axis_name 'nonexistent_axis' is not a mesh axis",
            ((n, 128),),
            "nonexistent_axis",
            ("nonexistent_axis",),
        ),
    )
    # every size is divisible by a ring of one: there the only forbidden input is the unknown axis
    return (divisibility if n > 1 else ()) + unknown_axis


def _block_tags(shapes: tuple[tuple[int, ...], ...], n: int, sources: tuple[int, ...]) -> tuple[np.ndarray]:
    """``x`` zero but the rows of the ring positions ``sources``: position ``s``'s carry ``s + 1``."""
    (shape,) = shapes
    return (rows_tagged_by_position(shape, n, sources),)


ALL_GATHER = FamilySpec(
    name="all_gather",
    summary="x[rows,cols] P(axis) -> the same values replicated, P()",
    operands=(Operand("x", lambda a: P(a), _x_shape),),
    out_spec=lambda a: P(),
    out_shape=_x_shape,
    dims=("rows_per_shard", "cols"),
    canonical_dims={"rows_per_shard": 3, "cols": 128},
    #: Rows: 1, odd and even; trailing width: lane-dense (128, 256) as TPU layouts prefer, and narrow ones.
    dim_values={"rows_per_shard": (1, 2, 3, 5, 8), "cols": (1, 8, 128, 256)},
    # 96 rows: whole tiles for every dtype, and an uneven split of three int8 tiles.
    tpu_native_dims={"rows_per_shard": 96, "cols": 128},
    # float8 moves bit-exact, as every other dtype (training and serving stacks gather float8 weights
    # and activations)
    dtypes=("float32", "bfloat16", "int32", "int8", "float8_e4m3fn", "float8_e5m2"),
    reference=lambda x: x,
    tolerance=lambda x, dtype: tolerances.data_movement_tolerance(x.shape),
    allowed_collectives=frozenset({"all-gather", "collective-permute"}),
    vjp_reference=lambda x, ct: (ct,),
    vjp_tolerance=lambda x, ct, dtype: (tolerances.data_movement_tolerance(ct.shape),),
    backward_allowed_collectives=frozenset(),
    backward_max_received_bytes=lambda d, n, itemsize: 0,
    backward_byte_bound_text="nothing moves: each device slices its rows of the cotangent",
    backward_exact="each device's gradient is its rows of the replicated cotangent, sliced",
    max_received_bytes=_shards_not_held,
    min_received_bytes=_shards_not_held,
    bad_inputs=_bad_inputs,
    byte_bound_text="each device may receive at most (n-1)/n of x",
    block_tags=_block_tags,
)

#: This module's family (:mod:`conformance.specs` collects it).
SPEC = ALL_GATHER
