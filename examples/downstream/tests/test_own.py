"""This project's own tests. The conformance plugin is loaded here too (it is installed), but
no conformance test is collected, so it leaves JAX alone: one CPU device, the default."""

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P


def test_sees_one_cpu_device():
    assert len(jax.devices("cpu")) == 1, jax.devices("cpu")


def test_ring_all_gather_on_one_device():
    from kernels.collectives import downstream_ring_all_gather

    mesh = jax.make_mesh((1,), ("x",))
    x = jax.device_put(jnp.arange(12.0).reshape(3, 4), NamedSharding(mesh, P("x")))
    assert (downstream_ring_all_gather(x, mesh=mesh, axis_name="x") == x).all()
