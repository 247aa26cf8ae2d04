"""The seed issue's case (JAX #21855), declared the way current JAX wants: no backward collective.

A Pallas kernel inside ``shard_map`` with a ``custom_vjp``, on a 2-D mesh,
result replicated over one axis (:mod:`conformance.tests.seed_cases`). With its
varying axes declared, its VJP must hold no collective, neither in the module
compiled here nor in the one lowered for TPU, and its gradient must be exact.
The undeclared form is in the self-test: the same audit must report it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from conformance import checks
from conformance.fixtures.meshes import build_mesh, parse_mesh
from conformance.tests import seed_cases

pytestmark = pytest.mark.cpu
#: It runs the seed's own kernel, no registered implementation: ``--impl`` deselects it.
IMPLEMENTATIONS: tuple[str, ...] = ()

#: 4 x 2 devices; rows over x, the result replicated over y (the seed's data x model).
SEED_MESHES = ("4x2-x-explicit", "4x2-x-auto")


def seed_arguments(mesh: jax.sharding.Mesh) -> tuple[jax.ShapeDtypeStruct, jax.ShapeDtypeStruct]:
    sharding = NamedSharding(mesh, P(seed_cases.ROW_AXIS, None))
    shape = (8, 128)
    return jax.ShapeDtypeStruct(shape, jnp.float32, sharding=sharding), jax.ShapeDtypeStruct(
        shape, jnp.float32, sharding=sharding
    )


@pytest.mark.parametrize("mesh_label", SEED_MESHES)
def test_declared_seed_case_has_no_backward_collective(mesh_label: str) -> None:
    mesh = build_mesh(parse_mesh(mesh_label))
    x, ct = seed_arguments(mesh)
    host = seed_cases.pallas_copy_in_shard_map(mesh, declared=True, interpret=seed_cases.interpreted())
    target = seed_cases.pallas_copy_in_shard_map(mesh, declared=True)
    checks.assert_backward_collectives(
        target, (x,), ct, host_fn=host, name=f"seed case (declared), {mesh_label}"
    )


@pytest.mark.pallas_interpret
@pytest.mark.parametrize("mesh_label", SEED_MESHES)
def test_declared_seed_case_gradient_is_exact(mesh_label: str) -> None:
    """The declared form is not just quiet: ``grad(sum(copy(x)))`` is exactly ones."""
    mesh = build_mesh(parse_mesh(mesh_label))
    x, _ = seed_arguments(mesh)
    fn = seed_cases.pallas_copy_in_shard_map(mesh, declared=True, interpret=seed_cases.interpreted())
    values = jax.device_put(np.arange(np.prod(x.shape), dtype=np.float32).reshape(x.shape), x.sharding)
    grad = jax.jit(jax.grad(lambda v: fn(v).sum()))(values)
    np.testing.assert_array_equal(np.asarray(grad), np.ones(x.shape, np.float32))
