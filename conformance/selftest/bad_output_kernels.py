"""Kernels that return the wrong thing or fail while tracing, each with one defect: what a user's first
kernel does. A run of the suite over them (``--kernels=conformance.selftest.bad_output_kernels``)
must give each one cause in the failure summary, whatever check met it first, in one process, under
pytest-xdist and in a multi-process job (``test_bad_outputs_end_to_end.py``)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

import conformance
from conformance import compat, registry

#: Each kernel's one verdict line, as the failure summary groups by it.
VERDICTS = {
    "bad_output_wrong_shape": "out has the wrong shape",
    "bad_output_agmm_wrong_shape": "out has the wrong shape",
    "bad_output_not_an_array": "out is not a jax.Array",
    "bad_output_wrong_dtype": "the result's dtype is not the spec's",
    "bad_output_fails_while_tracing": "raised TypeError on valid input",
    "bad_output_agmm_fails_while_tracing": "raised TypeError on valid input",
}


def _gather(x, axis_name: str, mesh) -> jax.Array:
    """The built-in all-gather (XLA's own op): right, so that each kernel below has one defect."""
    return registry.get("all_gather", "xla_all_gather").fn(x, mesh=mesh, axis_name=axis_name)


@conformance.register("all_gather", name="bad_output_wrong_shape", platforms=("cpu",), dtypes=("float32",))
def wrong_shape(x, *, mesh, axis_name):
    """The gathered rows and every row again: twice the rows the spec says."""
    out = _gather(x, axis_name, mesh)
    return jnp.concatenate([out, out])


@conformance.register("all_gather", name="bad_output_not_an_array", platforms=("cpu",), dtypes=("float32",))
def not_an_array(x, *, mesh, axis_name):
    """The right values in a 1-tuple (a habit of ``out_specs=(P(),)``)."""
    return (_gather(x, axis_name, mesh),)


@conformance.register(
    "all_gather", name="bad_output_wrong_dtype", platforms=("cpu",), dtypes=("float32", "int32")
)
def wrong_dtype(x, *, mesh, axis_name):
    """Gathers in float32 whatever it was given: right for float32, a float32 result for int32."""
    return _gather(x.astype(jnp.float32), axis_name, mesh)


@conformance.register(
    "all_gather", name="bad_output_fails_while_tracing", platforms=("cpu",), dtypes=("float32",)
)
def fails_while_tracing(x, *, mesh, axis_name):
    """A ``fori_loop`` ring whose carry changes dtype in the body: JAX raises TypeError while tracing."""

    def body(block):
        def step(i, carry):
            return carry.astype(jnp.int32)  # the carry must keep its type

        return lax.fori_loop(0, 2, step, compat.all_gather_invariant(block, axis_name, axis=0, tiled=True))

    return jax.shard_map(body, mesh=mesh, in_specs=P(axis_name), out_specs=P())(x)


@conformance.register(
    "allgather_matmul", name="bad_output_agmm_wrong_shape", platforms=("cpu",), dtypes=("float32", "bfloat16")
)
def agmm_wrong_shape(lhs, rhs, *, mesh, axis_name):
    """The product less its last row: the right values where it has them, the wrong shape."""
    ring = registry.get("allgather_matmul", "ring_allgather_matmul_unidirectional").fn
    out = ring(lhs, rhs, mesh=mesh, axis_name=axis_name)
    return out[:-1]


@conformance.register(
    "allgather_matmul", name="bad_output_agmm_fails_while_tracing", dtypes=("float32", "bfloat16")
)
def agmm_fails_while_tracing(lhs, rhs, *, mesh, axis_name):
    """A ``fori_loop`` ring whose carry starts as zeros that do not vary over the axis while the
    ``ppermute``'d blocks added to it do (it needed ``pcast``, shard_map's ``check_vma`` trap): JAX
    raises TypeError while tracing, before any compiler sees the kernel."""

    def body(lhs_block, rhs_block):
        n = lax.axis_size(axis_name)

        def step(i, acc):
            shifted = lax.ppermute(lhs_block, axis_name, [(j, (j + 1) % n) for j in range(n)])
            return acc + shifted @ rhs_block

        acc = jnp.zeros((lhs_block.shape[0], rhs_block.shape[1]), lhs_block.dtype)
        return lax.fori_loop(0, n, step, acc)

    return jax.shard_map(
        body, mesh=mesh, in_specs=(P(axis_name, None), P(None, axis_name)), out_specs=P(None, axis_name)
    )(lhs, rhs)
