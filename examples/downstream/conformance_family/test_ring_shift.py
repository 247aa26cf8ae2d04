"""A family of this project's own, in one module: its spec, a kernel, and every standard check.

``ring_shift``: ``x[rows, cols]`` sharded by rows over the axis; each device's rows move to
the next device round the ring, so the result is ``x`` rolled down by one shard. The numpy
reference needs the axis size to know how far one shard is: a reference with a keyword
``axis_size`` is given it.

Run with ``pytest conformance_family -m cpu`` (the suite's plugin parametrizes a module
that sets ``FAMILY``, wherever it lives).
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

import conformance
from conformance import checks, specs, tolerances
from conformance.family_tests import *  # noqa: F403  (the standard checks, parametrized per FAMILY)
from conformance.runner import Case


def _shape(d, n):
    return (d["rows_per_shard"] * n, d["cols"])


def _one_shard(d, n, itemsize):
    return d["rows_per_shard"] * d["cols"] * itemsize if n > 1 else 0


def _bad_inputs(n):
    """Inputs the family forbids on a ring of ``n``; every size divides by a ring of one, so none there
    (the suite checks rings of 1 to 8, and reports the check not judged where a family forbids none)."""
    rows = 2 * n + 1
    if n == 1:
        return ()
    return (
        specs.BadInput(
            f"{rows} rows not divisible by the axis size {n}", ((rows, 128),), None, (str(rows), str(n))
        ),
    )


RING_SHIFT = specs.add_family(
    specs.FamilySpec(
        name="ring_shift",
        summary="x[rows,cols] P(axis) -> x rolled down by one shard, P(axis)",
        operands=(specs.Operand("x", lambda a: P(a), _shape),),
        out_spec=lambda a: P(a),
        out_shape=_shape,
        dims=("rows_per_shard", "cols"),
        canonical_dims={"rows_per_shard": 3, "cols": 128},
        dim_values={"rows_per_shard": (1, 2, 3, 5, 8), "cols": (1, 8, 128, 256)},
        dtypes=("float32", "bfloat16", "int32"),
        reference=lambda x, *, axis_size: np.roll(x, x.shape[0] // axis_size, axis=0),
        tolerance=lambda x, dtype: tolerances.data_movement_tolerance(x.shape),
        allowed_collectives=frozenset({"collective-permute"}),
        max_received_bytes=_one_shard,
        min_received_bytes=_one_shard,
        bad_inputs=_bad_inputs,
        byte_bound_text="each device receives exactly one shard",
    )
)
FAMILY = RING_SHIFT.name


@conformance.register(
    "ring_shift", name="downstream_ring_shift", description="one ppermute to the next device"
)
def downstream_ring_shift(x: jax.Array, *, mesh: jax.sharding.Mesh, axis_name: str) -> jax.Array:
    n = mesh.shape[axis_name]
    if x.shape[0] % n:
        raise ValueError(f"downstream_ring_shift: {x.shape[0]} rows do not divide by the axis size {n}")
    to_next = [(j, (j + 1) % n) for j in range(n)]
    return jax.shard_map(
        lambda b: lax.ppermute(b, axis_name, to_next),
        mesh=mesh,
        in_specs=P(axis_name),
        out_specs=P(axis_name),
    )(x)


# -- Reuse: the suite's mesh fixture and checks, in a test of one's own --------------------------


@pytest.mark.conformance_meshes("2-x-auto", "2x4-y-explicit")
def test_values_at_a_wide_bfloat16_shape(conformance_mesh_config) -> None:
    """One check, as a function of a case this project picks (a ConformanceFailure says what is wrong)."""
    case = Case.make(
        "ring_shift",
        "downstream_ring_shift",
        conformance_mesh_config,
        {"rows_per_shard": 16, "cols": 512},
        "bfloat16",
    )
    checks.check_values(case)


@pytest.mark.conformance_meshes("4-x-auto")
def test_the_mesh_fixture_is_a_jax_mesh(conformance_mesh) -> None:
    assert conformance_mesh.shape == {"x": 4}
