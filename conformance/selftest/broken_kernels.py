"""Implementations broken in exactly one way each. The suite must reject every one.

Each registers like a third-party kernel (``broken_*`` names) and names, in
``EXPECTED_REJECTION``, the check that is meant to catch it. Load them with
``pytest conformance --kernels=conformance.selftest.broken_kernels``; the
self-test (``test_rejects_broken_kernels.py``) does exactly that and asserts
each is rejected by its check while the built-ins pass.
"""

from __future__ import annotations

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import io_callback
from jax.sharding import PartitionSpec as P

import conformance
from conformance.kernels._ring import ring_perm, with_ring_vjp
from conformance.kernels.allgather_matmul import ring as good_ring
from conformance.kernels.allgather_matmul._common import local_matmul, validate

#: broken implementation -> the test (check) that must fail for it
EXPECTED_REJECTION: dict[str, str] = {
    "broken_ring_wrong_slot": "test_values",
    "broken_ring_drops_position_zeros_block": "test_values",
    "broken_allgather_then_matmul": "test_collectives",
    "broken_output_sharded_over_other_axis": "test_output_sharding",
    "broken_truncates_indivisible_rows": "test_bad_inputs",
    "broken_bfloat16_compute": "test_values",
    "broken_promotes_dtype": "test_dtype",
    "broken_ring_sends_double": "test_collectives",
    "broken_nondeterministic": "test_determinism",
    "broken_backward_allreduce_then_slice": "test_backward_collectives",
    "broken_backward_ring_stops_after_three_hops": "test_gradients",
    "broken_backward_rounds_partial_sums_each_hop": "test_backward_accuracy",
    "broken_backward_gathers_lhs_as_float32": "test_lowered_bytes",
    "broken_eager_path_rotates_rows": "test_eager",
    "broken_wrong_on_first_sight": "test_values",
}
#: broken implementation -> a phrase its failure message must contain
EXPECTED_MESSAGE: dict[str, str] = {
    "broken_backward_allreduce_then_slice": "all-reduce",
    # right on rings of 2 to 4: only the meshes with a longer ring catch it
    "broken_backward_ring_stops_after_three_hops": "gradient d_lhs differs",
    "broken_backward_rounds_partial_sums_each_hop": "ring carries float32 accumulators",
    # lowered for TPU, or (with libtpu, where XLA:TPU moves the convert past the permute and the compiled
    # TPU module stays within the bound) lowered for CUDA
    "broken_backward_gathers_lhs_as_float32": "the backward pass lowered for",
    "broken_eager_path_rotates_rows": "outside jax.jit",
    # hypothesis runs a failing case again before it reports it, and this kernel then passes
    "broken_wrong_on_first_sight": "nondeterministic on the same case",
    # which block landed where, on source-tagged inputs (conformance.checks.block_map)
    "broken_ring_wrong_slot": "(expected device ",
    "broken_ring_drops_position_zeros_block": "ring position 0's block",
}


def _ring(
    lhs,
    rhs,
    *,
    mesh,
    axis_name,
    slot_sign=+1,
    payload=lambda b: b,
    unpayload=lambda b: b,
    matmul=local_matmul,
    out_spec=None,
    own_block=lambda block, me: block,
):
    """A unidirectional ring with hooks for each way of breaking it."""

    def body(lhs_block, rhs_block):
        n, me, m = lax.axis_size(axis_name), lax.axis_index(axis_name), lhs_block.shape[0]
        out = jnp.zeros((m * n, rhs_block.shape[1]), matmul(lhs_block, rhs_block).dtype)
        block = own_block(lhs_block, me)
        for step in range(n):
            if step < n - 1:
                nxt = unpayload(lax.ppermute(payload(block), axis_name, ring_perm(n, -1)))
            out = lax.dynamic_update_slice(
                out, matmul(block, rhs_block), (((me + slot_sign * step) % n) * m, 0)
            )
            if step < n - 1:
                block = nxt
        return out

    return jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(P(axis_name, None), P(None, axis_name)),
        out_specs=out_spec or P(None, axis_name),
    )(lhs, rhs)


@conformance.register("allgather_matmul", name="broken_ring_wrong_slot")
def broken_ring_wrong_slot(lhs, rhs, *, mesh, axis_name):
    """Writes block (me+s) into slot (me-s): identical on 2 devices, wrong on 4 and 8."""
    validate("broken_ring_wrong_slot", lhs, rhs, mesh, axis_name)
    return _ring(lhs, rhs, mesh=mesh, axis_name=axis_name, slot_sign=-1)


@conformance.register("allgather_matmul", name="broken_ring_drops_position_zeros_block")
def broken_ring_drops_position_zeros_block(lhs, rhs, *, mesh, axis_name):
    """Ring position 0 sends and multiplies zeros in place of its block (a ring whose first sender is
    taken to be position 1): its rows of the product are zero on every device."""
    validate("broken_ring_drops_position_zeros_block", lhs, rhs, mesh, axis_name)
    return _ring(
        lhs,
        rhs,
        mesh=mesh,
        axis_name=axis_name,
        own_block=lambda b, me: jnp.where(me == 0, jnp.zeros_like(b), b),
    )


@conformance.register("allgather_matmul", name="broken_allgather_then_matmul")
def broken_allgather_then_matmul(lhs, rhs, *, mesh, axis_name):
    """Right values, wrong collectives: gathers all of lhs with all_gather, then multiplies."""

    def body(lhs_block, rhs_block):
        return local_matmul(lax.all_gather(lhs_block, axis_name, tiled=True), rhs_block)

    return jax.shard_map(
        body, mesh=mesh, in_specs=(P(axis_name, None), P(None, axis_name)), out_specs=P(None, axis_name)
    )(lhs, rhs)


@conformance.register("allgather_matmul", name="broken_output_sharded_over_other_axis")
def broken_output_sharded_over_other_axis(lhs, rhs, *, mesh, axis_name):
    """Right values per device, but on 2-D meshes rows are split over the other axis."""
    others = [a for a in mesh.axis_names if a != axis_name]
    if not others:
        return _ring(lhs, rhs, mesh=mesh, axis_name=axis_name)
    other = others[0]

    def keep_my_rows(full):  # the block of rows this device's coordinate on `other` owns
        rows = full.shape[0] // lax.axis_size(other)
        return lax.dynamic_slice_in_dim(full, lax.axis_index(other) * rows, rows)

    gathered = _ring(lhs, rhs, mesh=mesh, axis_name=axis_name)
    return jax.shard_map(keep_my_rows, mesh=mesh, in_specs=P(None, axis_name), out_specs=P(other, axis_name))(
        gathered
    )


@conformance.register("allgather_matmul", name="broken_truncates_indivisible_rows")
def broken_truncates_indivisible_rows(lhs, rhs, *, mesh, axis_name):
    """No validation: silently drops the rows (and columns) that do not divide evenly."""
    n = mesh.shape.get(axis_name, 1)
    lhs = lhs[: lhs.shape[0] // n * n]
    rhs = rhs[:, : rhs.shape[1] // n * n]
    return _ring(lhs, rhs, mesh=mesh, axis_name=axis_name)


@conformance.register("allgather_matmul", name="broken_bfloat16_compute")
def broken_bfloat16_compute(lhs, rhs, *, mesh, axis_name):
    """Multiplies in bfloat16 whatever the input dtype: fine for bf16, too coarse for f32."""
    validate("broken_bfloat16_compute", lhs, rhs, mesh, axis_name)

    def matmul(a, b):
        return jnp.dot(a.astype(jnp.bfloat16), b.astype(jnp.bfloat16)).astype(a.dtype)

    return _ring(lhs, rhs, mesh=mesh, axis_name=axis_name, matmul=matmul)


@conformance.register("allgather_matmul", name="broken_promotes_dtype")
def broken_promotes_dtype(lhs, rhs, *, mesh, axis_name):
    """Returns the float32 accumulator for bfloat16/float16 inputs instead of casting back."""
    validate("broken_promotes_dtype", lhs, rhs, mesh, axis_name)

    def matmul(a, b):
        acc = jnp.float32 if jnp.issubdtype(a.dtype, jnp.floating) else a.dtype
        return jnp.dot(a, b, preferred_element_type=acc)

    return _ring(lhs, rhs, mesh=mesh, axis_name=axis_name, matmul=matmul)


@conformance.register("allgather_matmul", name="broken_ring_sends_double")
def broken_ring_sends_double(lhs, rhs, *, mesh, axis_name):
    """Right values, but every ring step ships the block twice (2x the byte bound)."""
    validate("broken_ring_sends_double", lhs, rhs, mesh, axis_name)
    double = lambda b: jnp.concatenate([b, b[::-1]], axis=0)
    first_half = lambda b: b[: b.shape[0] // 2]
    return _ring(lhs, rhs, mesh=mesh, axis_name=axis_name, payload=double, unpayload=first_half)


_calls = itertools.count()


@conformance.register("allgather_matmul", name="broken_nondeterministic")
def broken_nondeterministic(lhs, rhs, *, mesh, axis_name):
    """Right to within one ulp, but every other call nudges the result by that ulp."""
    validate("broken_nondeterministic", lhs, rhs, mesh, axis_name)
    out = _ring(lhs, rhs, mesh=mesh, axis_name=axis_name)
    parity = io_callback(
        lambda: np.int32(next(_calls) % 2), jax.ShapeDtypeStruct((), jnp.int32), ordered=True
    )
    if jnp.issubdtype(out.dtype, jnp.floating):
        return jnp.where(parity == 1, jnp.nextafter(out, jnp.array(jnp.inf, out.dtype)), out)
    return out + parity


_inputs_seen: set[tuple] = set()


def _first_sight(total: np.ndarray, *, where: tuple) -> np.int32:
    key = (float(total), *where)
    seen = key in _inputs_seen
    _inputs_seen.add(key)
    return np.int32(not seen)


@conformance.register("allgather_matmul", name="broken_wrong_on_first_sight")
def broken_wrong_on_first_sight(lhs, rhs, *, mesh, axis_name):
    """Negated (less one) the first time it meets an input, right every later time: a result that varies
    between runs of one case (as a race or a buffer read before it is written makes it), made
    deterministic by keying on the input's sum, so that the values check's verdict is the same on every
    run: it fails, and passes when hypothesis runs the same case again."""
    validate("broken_wrong_on_first_sight", lhs, rhs, mesh, axis_name)
    out = _ring(lhs, rhs, mesh=mesh, axis_name=axis_name)
    where = (lhs.shape, rhs.shape, axis_name, tuple(d.id for d in mesh.devices.flat))
    first = io_callback(
        functools.partial(_first_sight, where=where),
        jax.ShapeDtypeStruct((), jnp.int32),
        jnp.sum(lhs.astype(jnp.float32)),
        ordered=True,
    )
    return jnp.where(first == 1, -out - 1, out)


@conformance.register("allgather_matmul", name="broken_backward_allreduce_then_slice", differentiable=True)
def broken_backward_allreduce_then_slice(lhs, rhs, *, mesh, axis_name):
    """Right forward ring, right gradients, but ``d_lhs`` by all-reduce + slice in its custom_vjp.

    ``d_lhs`` is a matmul + reduce-scatter; summing the whole ``[M, K]`` on every
    device and keeping one row block moves twice the bytes, by a collective the
    math does not need.
    """
    validate("broken_backward_allreduce_then_slice", lhs, rhs, mesh, axis_name)
    forward = functools.partial(good_ring._forward, axis_name=axis_name, bidirectional=False)
    backward = functools.partial(good_ring._backward, axis_name=axis_name, bidirectional=False)

    def allreduce_then_slice(lhs_block, rhs_block, ct):
        _, d_rhs = backward(lhs_block, rhs_block, ct)
        m = lhs_block.shape[0]
        everyone = lax.psum(local_matmul(ct, rhs_block.T).astype(jnp.float32), axis_name)
        own_rows = lax.dynamic_slice_in_dim(everyone, lax.axis_index(axis_name) * m, m)
        return own_rows.astype(lhs_block.dtype), d_rhs

    ring = with_ring_vjp(forward, allreduce_then_slice)
    return jax.shard_map(
        ring, mesh=mesh, in_specs=(P(axis_name, None), P(None, axis_name)), out_specs=P(None, axis_name)
    )(lhs, rhs)


def _ring_with_reduce_scatter_d_lhs(
    lhs, rhs, *, mesh, axis_name, name, max_hops=None, round_each_hop=False, gather_lhs_as_float32=False
):
    """The unidirectional ring forward and ``d_rhs``; ``d_lhs`` (a reduce-scatter of
    ``ct @ rhs.T``) by a ring of its own written here, broken by the knobs."""
    validate(name, lhs, rhs, mesh, axis_name)
    forward = functools.partial(good_ring._forward, axis_name=axis_name, bidirectional=False)
    backward = functools.partial(good_ring._backward, axis_name=axis_name, bidirectional=False)

    def gather_ring_d_rhs(lhs_block, ct):
        """``lhs.T @ ct`` for this device's columns, the lhs blocks travelling the ring as float32."""
        n, me, m = lax.axis_size(axis_name), lax.axis_index(axis_name), lhs_block.shape[0]
        held, d_rhs = lhs_block.astype(jnp.float32), None  # the defect: twice a 16-bit block's bytes
        for step in range(n):
            rows = lax.dynamic_slice_in_dim(ct, lax.rem(me + step, n) * m, m).astype(jnp.float32)
            term = held.T @ rows
            d_rhs = term if d_rhs is None else d_rhs + term
            if step < n - 1:
                held = lax.ppermute(held, axis_name, ring_perm(n, -1))
        return d_rhs.astype(lhs_block.dtype)

    def reduce_scatter_ring(lhs_block, rhs_block, ct):
        if gather_lhs_as_float32:
            d_rhs = gather_ring_d_rhs(lhs_block, ct)
        else:
            _, d_rhs = backward(lhs_block, rhs_block, ct)
        n, me, m = lax.axis_size(axis_name), lax.axis_index(axis_name), lhs_block.shape[0]
        partial = jnp.dot(ct, rhs_block.T, preferred_element_type=jnp.float32)  # [M, K], this device's part
        carried = lhs_block.dtype if round_each_hop else jnp.float32  # the defect: 16-bit partial sums

        def contribution(block):
            return lax.dynamic_slice_in_dim(partial, lax.rem(block, n) * m, m)

        # At hop s this device holds the accumulator of block me + s + 1; after n - 1 hops, its own.
        acc = contribution(me + 1).astype(carried)
        hops = n - 1 if max_hops is None else min(n - 1, max_hops)
        for hop in range(1, hops + 1):
            arrived = lax.ppermute(acc, axis_name, ring_perm(n, -1))
            acc = (arrived.astype(jnp.float32) + contribution(me + hop + 1)).astype(carried)
        return acc.astype(lhs_block.dtype), d_rhs

    ring = with_ring_vjp(forward, reduce_scatter_ring)
    return jax.shard_map(
        ring, mesh=mesh, in_specs=(P(axis_name, None), P(None, axis_name)), out_specs=P(None, axis_name)
    )(lhs, rhs)


@conformance.register(
    "allgather_matmul", name="broken_backward_ring_stops_after_three_hops", differentiable=True
)
def broken_backward_ring_stops_after_three_hops(lhs, rhs, *, mesh, axis_name):
    """``d_lhs`` by a reduce-scatter ring whose loop bound was written for small rings
    (``min(n - 1, 3)`` hops): exact for n <= 4, wrong beyond."""
    return _ring_with_reduce_scatter_d_lhs(
        lhs,
        rhs,
        mesh=mesh,
        axis_name=axis_name,
        max_hops=3,
        name="broken_backward_ring_stops_after_three_hops",
    )


@conformance.register(
    "allgather_matmul", name="broken_backward_rounds_partial_sums_each_hop", differentiable=True
)
def broken_backward_rounds_partial_sums_each_hop(lhs, rhs, *, mesh, axis_name):
    """``d_lhs`` by a reduce-scatter ring that carries its partial sums in the operand's 16-bit
    dtype, rounding at every hop (what JAX's autodiff of a ppermute ring does): within the
    elementwise bound, clearly less accurate than the baseline's backward."""
    return _ring_with_reduce_scatter_d_lhs(
        lhs,
        rhs,
        mesh=mesh,
        axis_name=axis_name,
        round_each_hop=True,
        name="broken_backward_rounds_partial_sums_each_hop",
    )


@conformance.register("allgather_matmul", name="broken_backward_gathers_lhs_as_float32", differentiable=True)
def broken_backward_gathers_lhs_as_float32(lhs, rhs, *, mesh, axis_name):
    """Exact gradients, but the backward's ring ships bfloat16/float16 lhs blocks as float32:
    twice their bytes, which only a module lowered for a target shows (XLA CPU converts 16-bit
    transfers to float32 for every kernel, so its compiled module cannot tell)."""
    name = "broken_backward_gathers_lhs_as_float32"
    return _ring_with_reduce_scatter_d_lhs(
        lhs, rhs, mesh=mesh, axis_name=axis_name, name=name, gather_lhs_as_float32=True
    )


@conformance.register(
    "allgather_matmul",
    name="broken_eager_path_rotates_rows",
    description="right under jax.jit; called eagerly it takes a 'fast path' that gathers lhs one shard off",
)
def broken_eager_path_rotates_rows(lhs, rhs, *, mesh, axis_name):
    if not isinstance(lhs, jax.core.Tracer):  # concrete arrays: called outside jit
        lhs = jnp.roll(lhs, lhs.shape[0] // mesh.shape[axis_name], axis=0)
    return good_ring.ring_allgather_matmul_unidirectional(lhs, rhs, mesh=mesh, axis_name=axis_name)
