"""Kernels right at 32 and 16 bits and wrong only at the narrow dtypes serving and training stacks run
collective matmuls in: int8 operands with an int32 result, float8 operands with a wider result
(:mod:`conformance.dtypes`). Each claims the mixed-precision pair it is wrong at, as a kernel must to
be checked there; ``EXPECTED_REJECTION`` names the check that must reject each.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

import conformance
from conformance.kernels._ring import ring_perm
from conformance.kernels.allgather_matmul._common import validate

EXPECTED_REJECTION: dict[str, str] = {
    "broken_int8_accumulates_in_int8": "test_dtype",
    "broken_float8_ring_ships_bfloat16": "test_lowered_bytes",
}
EXPECTED_MESSAGE: dict[str, str] = {
    "broken_int8_accumulates_in_int8": "int8 operands, int32 result",
    "broken_float8_ring_ships_bfloat16": "moves more float8_e4m3fn_to_bfloat16 bytes than its math needs",
}


def _ring(lhs, rhs, *, mesh, axis_name, out_dtype, accumulate, travels=lambda block: block):
    """A unidirectional gather ring whose step matmul accumulates in ``accumulate`` and whose blocks
    travel as ``travels`` makes them (the operands' dtype by default)."""

    def body(lhs_block, rhs_block):
        n, me, m = lax.axis_size(axis_name), lax.axis_index(axis_name), lhs_block.shape[0]
        result = out_dtype or lhs_block.dtype
        out = jnp.zeros((m * n, rhs_block.shape[1]), result)
        block = travels(lhs_block)
        for step in range(n):
            if step < n - 1:
                arriving = lax.ppermute(block, axis_name, ring_perm(n, -1))
            held = block.astype(lhs_block.dtype)
            product = jnp.dot(held, rhs_block, preferred_element_type=accumulate(lhs_block.dtype))
            out = lax.dynamic_update_slice(out, product.astype(result), (lax.rem(me + step, n) * m, 0))
            if step < n - 1:
                block = arriving
        return out

    return jax.shard_map(
        body, mesh=mesh, in_specs=(P(axis_name, None), P(None, axis_name)), out_specs=P(None, axis_name)
    )(lhs, rhs)


@conformance.register(
    "allgather_matmul", name="broken_int8_accumulates_in_int8", dtypes=("float32", "int8_to_int32")
)
def broken_int8_accumulates_in_int8(lhs, rhs, *, mesh, axis_name, out_dtype=None):
    """Multiplies in the operands' dtype and widens after: exact for float32, and for int8 operands
    with an int32 result its sums wrap at 127 (int8 serving stacks accumulate in int32)."""
    validate("broken_int8_accumulates_in_int8", lhs, rhs, mesh, axis_name)
    same = lambda dtype: dtype if jnp.issubdtype(dtype, jnp.integer) else jnp.float32
    return _ring(lhs, rhs, mesh=mesh, axis_name=axis_name, out_dtype=out_dtype, accumulate=same)


@conformance.register(
    "allgather_matmul",
    name="broken_float8_ring_ships_bfloat16",
    dtypes=("float32", "float8_e4m3fn_to_bfloat16"),
)
def broken_float8_ring_ships_bfloat16(lhs, rhs, *, mesh, axis_name, out_dtype=None):
    """Exact values, but its ring carries float8 blocks as bfloat16: twice the bytes of each hop,
    which only a module compiled or lowered for a target shows (XLA:CPU widens narrow transfers)."""
    validate("broken_float8_ring_ships_bfloat16", lhs, rhs, mesh, axis_name)
    widen = lambda block: block.astype(jnp.bfloat16) if block.dtype.itemsize == 1 else block
    return _ring(
        lhs,
        rhs,
        mesh=mesh,
        axis_name=axis_name,
        out_dtype=out_dtype,
        accumulate=lambda _: jnp.float32,
        travels=widen,
    )
