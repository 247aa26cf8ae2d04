"""The two ring schedules every ``ppermute`` collective matmul here is built from.

Both run inside ``shard_map`` over one mesh axis of n devices, unrolled in
Python (n is static) so that each transfer is its own collective-permute that
XLA can schedule against the matmul of the block already in hand.

**Gather ring** (:func:`ring_gather_visit`). Every device holds one row block
``[m, ...]`` of a row-sharded array; the blocks travel round the ring and each
device *visits* every block once, its own first. Unidirectional: whole blocks
travel one hop left (j -> j-1) per step, so at step s device d holds the block
of device ``(d + s) mod n``. Bidirectional: the top ``ceil(m/2)`` rows travel
left and the bottom ``floor(m/2)`` rows travel right, so at step s device d
holds the top half of block ``d + s`` and the bottom half of block ``d - s``.
Both directions of every link carry data at once, each transfer half the size.
A device receives exactly the ``(n-1) m`` rows it does not hold, the minimum.

**Reduce-scatter ring** (:func:`ring_reduce_scatter`). Every device can compute
its own *contribution* to any row block of a row-sharded result; block j is the
sum of all n contributions to it. An accumulator for each block travels round
the ring and every device adds its contribution as it passes: unidirectionally,
at step s device d holds the accumulator of block ``(d + s + 1) mod n``, so
after n - 1 hops it holds the full sum of block d, its own. Bidirectionally the
top ``ceil(m/2)`` rows of each block travel left and the bottom rows right
(block ``d - s - 1`` at step s). Each device sends ``(n-1) m`` rows of
accumulator: ``(n-1)/n`` of one ``[M, N]`` partial product, the minimum.

Row splits are ``ceil``/``floor``, never ``m // 2`` twice, so odd m is exact;
with m == 1 the bottom half is empty and only the leftward ring runs.

**Pacing.** Each transfer being independent of the matmul beside it lets a
scheduler overlap them; it does not make one. XLA:TPU's latency-hiding
scheduler, left alone, ran the gather ring's first transfers back to back and
several matmuls inside the last ones (2 to 4 of 7 transfers with a matmul
inside, v5e and v6e, 8 chips). So both rings pace themselves: the gather ring
issues a step's transfer only once the previous step's visit is computed
(:func:`after`, an ``optimization_barrier`` over both, free at run time), and
the reduce-scatter ring computes a step's contribution only once the
accumulators it sends are ready, fenced so that the addition of what arrives is
not fused into the matmul (which would make the matmul wait for the transfer).
Compiled by libtpu 0.0.17 to 0.0.50 for v5e and v6e slices of 8 and 16 chips,
every transfer has a matmul inside it but at most one per ring at the smallest
size (``conformance/checks/tpu_schedule.py`` measures it). XLA:GPU would also
merge the steps' matmuls (they share the weight block) into a few that wait for
several transfers each; the kernels give each step's matmul its own operand
(:func:`unmerged`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P


def ring_perm(n: int, shift: int) -> list[tuple[int, int]]:
    """Source->target pairs moving every device's buffer ``shift`` hops along the ring."""
    return [(j, (j + shift) % n) for j in range(n)]


def halves(m: int, *, bidirectional: bool) -> tuple[int, int]:
    """Rows travelling left and right: ``(ceil(m/2), floor(m/2))``, or ``(m, 0)`` one-way."""
    top = (m + 1) // 2 if bidirectional else m
    return top, m - top


def accumulator_dtype(dtype: jnp.dtype) -> jnp.dtype:
    """float32 for sub-32-bit floats (bfloat16, float16, float8), int32 for sub-32-bit integers (int8):
    partial sums are summed there and cast once at the end."""
    dtype = jnp.dtype(dtype)
    if jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize < 4:
        return jnp.dtype(jnp.float32)
    if jnp.issubdtype(dtype, jnp.integer) and dtype.itemsize < 4:
        return jnp.dtype(jnp.int32)
    return dtype


def dot(a: jax.Array, b: jax.Array) -> jax.Array:
    """``a @ b`` in the accumulator dtype of ``a`` (not cast back)."""
    return jnp.dot(a, b, preferred_element_type=accumulator_dtype(a.dtype))


#: visit(owner, first_row, rows): ``rows`` is rows ``[first_row, first_row + len)`` of ``owner``'s block;
#: returns what it computed from them (any pytree of arrays), which paces the ring (see below).
Visit = Callable[[jax.Array, int, jax.Array], Any]


def after(value: Any, *, waits_for: Any) -> Any:
    """``value``, which the compiler may use only once ``waits_for`` is computed (and may not fuse
    with it): an ``optimization_barrier`` over both. Free at run time; it only orders the schedule."""
    if waits_for is None:
        return value
    value, _ = lax.optimization_barrier((value, waits_for))
    return value


def unmerged(shared: jax.Array, *, beside: jax.Array) -> jax.Array:
    """``shared`` (an operand every ring step multiplies by: the weight block) as this step's own
    value, tied by an ``optimization_barrier`` to ``beside``: a value of this step that no transfer
    makes (its block's owner index), so the matmul waits for nothing it did not wait for before.

    XLA:GPU's dot merger fuses independent matmuls that share an operand into one. Merged, a ring's
    per-step matmuls become a few larger ones, each waiting for several transfers, which then run
    back to back: compiled for 8 H100s (``conformance/checks/gpu_compile.py``) the gather ring hid 0
    of 14 transfers, and 13 of 14 with each step's matmul given its own operand. (Tied to the
    block in hand instead, the barrier moved libtpu 0.0.50's schedule: 3 of 7 hidden on v6e.) Free
    at run time."""
    shared, _ = lax.optimization_barrier((shared, beside))
    return shared


def ring_gather_visit(
    block: jax.Array,
    axis_name: str,
    visit: Visit,
    *,
    bidirectional: bool,
    paced: bool = True,
    top_rows: int | None = None,
) -> None:
    """Circulate every device's row block round the ring, calling ``visit`` on each piece.
    ``paced=False`` takes the pacing out (each transfer then depends only on the one before it): the
    ring the schedule checks compile beside a kernel whose transfers are exposed. ``top_rows``: the
    rows that travel left in a bidirectional ring where not the halves (a split on a TPU tile edge)."""
    n = lax.axis_size(axis_name)
    me = lax.axis_index(axis_name)
    top_rows, bottom_rows = (
        halves(block.shape[0], bidirectional=bidirectional)
        if top_rows is None
        else (top_rows, block.shape[0] - top_rows)
    )
    top, bottom = block[:top_rows], block[top_rows:]
    visited = None  # what the previous step's visits computed
    for step in range(n):
        with jax.named_scope(f"gather_ring_step_{step}"):
            # Issue the next transfers first, so they overlap this step's visit; but only once the
            # previous step's visit is done, which paces the ring at one transfer per visit.
            if step < n - 1:
                waits_for = visited if paced else None
                next_top = lax.ppermute(after(top, waits_for=waits_for), axis_name, ring_perm(n, -1))
                if bottom_rows:
                    next_bottom = lax.ppermute(
                        after(bottom, waits_for=waits_for), axis_name, ring_perm(n, +1)
                    )
            if step == 0:
                visited = visit(me, 0, block)  # own block whole: one matmul, not two
            else:
                visited = visit(lax.rem(me + step, n), 0, top)
                if bottom_rows:
                    visited = (visited, visit(lax.rem(me - step + n, n), top_rows, bottom))
            if step < n - 1:
                top = next_top
                if bottom_rows:
                    bottom = next_bottom


def fenced(value: jax.Array) -> jax.Array:
    """``value``, computed apart: no consumer is fused into what computes it."""
    return lax.optimization_barrier(value)


#: contribution(owner, first_row, rows): this device's addend to those rows of ``owner``'s block.
Contribution = Callable[[jax.Array, int, int], jax.Array]


def ring_reduce_scatter(
    contribution: Contribution, m: int, axis_name: str, *, bidirectional: bool, paced: bool = True
) -> jax.Array:
    """This device's ``m``-row block of ``sum over devices of contribution``, summed round the ring.

    Accumulators stay in whatever dtype ``contribution`` returns (the caller's
    accumulator dtype); nothing is rounded between hops. ``paced=False`` takes the pacing and the
    fences out (the schedule checks' measure of what they do).
    """
    pace = after if paced else (lambda value, *, waits_for: value)
    fence = fenced if paced else (lambda value: value)
    n = lax.axis_size(axis_name)
    me = lax.axis_index(axis_name)
    top_rows, bottom_rows = halves(m, bidirectional=bidirectional)
    with jax.named_scope("reduce_scatter_ring_step_0"):
        top = contribution(lax.rem(me + 1, n), 0, top_rows)
        bottom = contribution(lax.rem(me - 1 + n, n), top_rows, bottom_rows) if bottom_rows else None
    for step in range(1, n):
        with jax.named_scope(f"reduce_scatter_ring_step_{step}"):
            incoming_top = lax.ppermute(top, axis_name, ring_perm(n, -1))
            if bottom_rows:
                incoming_bottom = lax.ppermute(bottom, axis_name, ring_perm(n, +1))
            # Computed while the accumulators are in flight: not before they are ready to leave (the
            # owner's index waits for them, which paces the ring at one matmul per transfer), and
            # fenced, so that a compiler cannot fuse the addition of what arrives into the matmul,
            # which would make the matmul wait for the transfer.
            leaving = (top, bottom)
            owner = pace(lax.rem(me + step + 1, n), waits_for=leaving)
            top = incoming_top + fence(contribution(owner, 0, top_rows))
            if bottom_rows:
                owner = pace(lax.rem(me - step - 1 + 2 * n, n), waits_for=leaving)
                bottom = incoming_bottom + fence(contribution(owner, top_rows, bottom_rows))
    return top if bottom is None else jnp.concatenate([top, bottom], axis=0)


def with_ring_vjp(
    forward: Callable[[jax.Array, jax.Array], jax.Array],
    backward: Callable[[jax.Array, jax.Array, jax.Array], tuple[jax.Array, jax.Array]],
) -> Callable[[jax.Array, jax.Array], jax.Array]:
    """``forward(lhs, rhs)`` as a ``jax.custom_vjp`` whose pullback is ``backward(lhs, rhs, ct)``.

    The residuals are the operand blocks themselves: a backward ring recomputes
    what it needs instead of keeping gathered copies alive between the passes.
    """

    @jax.custom_vjp
    def ring(lhs_block: jax.Array, rhs_block: jax.Array) -> jax.Array:
        return forward(lhs_block, rhs_block)

    def ring_fwd(lhs_block: jax.Array, rhs_block: jax.Array) -> tuple[jax.Array, Any]:
        return forward(lhs_block, rhs_block), (lhs_block, rhs_block)

    def ring_bwd(residuals: Any, ct: jax.Array) -> tuple[jax.Array, jax.Array]:
        return backward(*residuals, ct)

    ring.defvjp(ring_fwd, ring_bwd)
    return ring


RingSpecs = Callable[[str], tuple[tuple[P, P], P]]


def shard_mapped_ring(
    forward: Callable[..., jax.Array],
    backward: Callable[..., tuple[jax.Array, jax.Array]],
    *,
    specs: RingSpecs,
) -> Callable[..., jax.Array]:
    """A collective matmul's ring, per device ``forward`` (its pullback ``backward``, both taking
    ``axis_name``, ``bidirectional`` and ``out_dtype``; ``forward`` also ``paced``), as one call over
    the global operands: ``run(lhs, rhs, mesh, axis_name, *, bidirectional, out_dtype=None,
    paced=True)``, under ``jax.shard_map`` with ``specs(axis_name)``: ``((lhs, rhs), out)``."""

    def run(
        lhs: jax.Array,
        rhs: jax.Array,
        mesh: jax.sharding.Mesh,
        axis_name: str,
        *,
        bidirectional: bool,
        out_dtype: object = None,
        paced: bool = True,
    ) -> jax.Array:
        statics = {"axis_name": axis_name, "bidirectional": bidirectional, "out_dtype": out_dtype}
        per_device = with_ring_vjp(
            functools.partial(forward, **statics, paced=paced), functools.partial(backward, **statics)
        )
        in_specs, out_specs = specs(axis_name)
        return jax.shard_map(per_device, mesh=mesh, in_specs=in_specs, out_specs=out_specs)(lhs, rhs)

    return run


def unpaced(run: Callable[..., jax.Array], *, bidirectional: bool) -> Callable[..., jax.Array]:
    """The ring of :func:`shard_mapped_ring` with its pacing taken out, as a kernel: what the
    schedule checks measure pacing against (a registration's ``unpaced``)."""

    def kernel(
        lhs: jax.Array, rhs: jax.Array, *, mesh: jax.sharding.Mesh, axis_name: str, out_dtype: object = None
    ) -> jax.Array:
        return run(lhs, rhs, mesh, axis_name, bidirectional=bidirectional, out_dtype=out_dtype, paced=False)

    return kernel


def sharded_dot(a: jax.Array, b: jax.Array, *, out: jax.sharding.NamedSharding) -> jax.Array:
    """``a @ b`` in the accumulator dtype of ``a``, its result sharded as ``out``, left to XLA's
    partitioner (no ``shard_map``): the compiler decides how the operands move. On a mesh whose axes
    are ``Explicit`` the sharding is the dot's ``out_sharding`` (the only spelling that types such a
    result); on ``Auto`` axes it is a sharding constraint on the result."""
    kinds = dict(zip(out.mesh.axis_names, out.mesh.axis_types, strict=True))
    named = {n for part in out.spec if part is not None for n in ((part,) if isinstance(part, str) else part)}
    explicit = {n for n in named if "Explicit" in str(kinds[n])}
    accumulator = accumulator_dtype(a.dtype)
    if explicit:
        return jnp.dot(a, b, preferred_element_type=accumulator, out_sharding=out)
    return jax.lax.with_sharding_constraint(jnp.dot(a, b, preferred_element_type=accumulator), out)
