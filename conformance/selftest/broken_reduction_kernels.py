"""Reduce-scatter and all-reduce kernels broken in one way each, the ways these collectives break.

Each is the built-in ring (or a plain ``shard_map``) with one defect: the check meant for it must
reject it (``EXPECTED_REJECTION``), naming what is wrong.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

import conformance
from conformance.kernels._reduction import validate
from conformance.kernels._ring import ring_perm, ring_reduce_scatter
from conformance.kernels.reduce_scatter import pallas_hbm_ring, pallas_ring
from conformance.kernels.reduce_scatter.ring import gathered_rows

EXPECTED_REJECTION: dict[str, str] = {
    "broken_rs_rounds_partial_sums_each_hop": "test_accuracy",
    "broken_rs_block_index_wrong_on_odd_rings": "test_values",
    "broken_rs_one_half_goes_the_wrong_way": "test_values",
    "broken_rs_ring_of_one_returns_the_partial_widened": "test_dtype",
    "broken_ar_each_device_sums_in_its_own_order": "test_output_sharding",
    "broken_rs_max_starts_from_zero": "test_other_reductions",
    "broken_rs_declares_columns_scatters_rows": "test_output_sharding",
    "broken_rs_columns_skip_ring_position_one": "test_values",
    "broken_pallas_rs_split_in_thirds": "test_dma_direction_balance",
    "broken_pallas_rs_one_transfer_more_left": "test_dma_direction_balance",
    "broken_rs_float8_partial_sums_each_hop": "test_values",
    "broken_pallas_rs_writes_a_buffer_still_being_read": "test_races",
    "broken_pallas_rs_dma_before_the_barrier": "test_barrier_protocol",
    "broken_pallas_rs_leaves_a_send_unwaited": "test_races",
    "broken_pallas_hbm_rs_reuses_a_tile_still_being_written": "test_tpu_native_values",
    "broken_pallas_hbm_rs_tiled_by_config.tile_rows.8": "test_values",
    "broken_pallas_hbm_rs_never_reads_the_received_tile": "test_values",
}
EXPECTED_MESSAGE: dict[str, str] = {
    "broken_rs_rounds_partial_sums_each_hop": "clearly less accurate than the baseline",
    "broken_rs_block_index_wrong_on_odd_rings": "values differ from the numpy float64 reference",
    "broken_rs_one_half_goes_the_wrong_way": "values differ from the numpy float64 reference",
    "broken_rs_ring_of_one_returns_the_partial_widened": "dtype",
    "broken_ar_each_device_sums_in_its_own_order": "the replicas of one block of the result differ",
    "broken_rs_max_starts_from_zero": "reduction='max': values differ",
    "broken_rs_declares_columns_scatters_rows": "sharding",
    "broken_rs_columns_skip_ring_position_one": "column blocks of the result are wrong",
    "broken_pallas_rs_split_in_thirds": "a ring declared bidirectional moves more of each block one way",
    # the cause named: one transfer more one way, not a block cut unevenly
    "broken_pallas_rs_one_transfer_more_left": "1 transfer more going d -> d-1 than d -> d+1",
    "broken_rs_float8_partial_sums_each_hop": "values differ from the numpy float64 reference",
    "broken_pallas_rs_writes_a_buffer_still_being_read": "TPU interpret mode detected a race",
    "broken_pallas_rs_dma_before_the_barrier": "barrier",
    "broken_pallas_rs_leaves_a_send_unwaited": "a semaphore has a nonzero count at kernel exit",
    "broken_pallas_hbm_rs_reuses_a_tile_still_being_written": "differ from the numpy float64 reference",
    "broken_pallas_hbm_rs_tiled_by_config.tile_rows.8": "values differ from the numpy float64 reference",
    "broken_pallas_hbm_rs_never_reads_the_received_tile": "values differ from the numpy float64 reference",
}
#: The one case of its check the sweep runs where every case fails alike: each of the HBM twin's four
#: TPU-native dtypes took 35-44 s to fail (its block map runs the interpreted ring again per ring
#: position), 158 s of the sweep for the one verdict a dtype gives.
EXPECTED_ON: dict[str, str] = {
    "broken_pallas_hbm_rs_reuses_a_tile_still_being_written": "bfloat16",
    # the two tile defects' values: where a draw meets each (an interpreted HBM ring is 3-5 s a mesh):
    # every ring longer than one for the tile never read in, the mesh whose draw is 20 rows for the
    # dropped remainder
    "broken_pallas_hbm_rs_never_reads_the_received_tile": "5-x-explicit",
    "broken_pallas_hbm_rs_tiled_by_config.tile_rows.8": "2x4-y-auto-v5e",
}
#: A configuration of a declared tuning space that is right: the checks it must pass.
EXPECTED_PASS: dict[str, set[str]] = {"broken_pallas_hbm_rs_tiled_by_config.tile_rows.1": {"test_values"}}


def _reduce_scatter(per_device, x, mesh, axis_name):
    return jax.shard_map(
        per_device, mesh=mesh, in_specs=P(axis_name, None, None), out_specs=P(axis_name, None)
    )(x)


def _wide(dtype: jnp.dtype) -> jnp.dtype:
    return jnp.float32 if jnp.issubdtype(dtype, jnp.floating) else dtype


@conformance.register("reduce_scatter", name="broken_rs_rounds_partial_sums_each_hop")
def broken_rs_rounds_partial_sums_each_hop(x, *, mesh, axis_name):
    """The ring with accumulators in the input dtype: a 16-bit sum is rounded at every hop."""
    validate("broken_rs_rounds_partial_sums_each_hop", x, mesh, axis_name)

    def per_device(block):
        partial = block[0]
        m = partial.shape[0] // lax.axis_size(axis_name)

        def contribution(owner, first, rows):
            return lax.dynamic_slice_in_dim(partial, owner * m + first, rows)  # not widened

        return ring_reduce_scatter(contribution, m, axis_name, bidirectional=False)

    return _reduce_scatter(per_device, x, mesh, axis_name)


@conformance.register("reduce_scatter", name="broken_rs_block_index_wrong_on_odd_rings")
def broken_rs_block_index_wrong_on_odd_rings(x, *, mesh, axis_name):
    """A one-way ring with an off-by-one in a branch for odd rings: there each device starts with
    the accumulator of the block two ahead instead of one, so every sum ends one device early, in
    its neighbour's slot. Right on rings of 1, 2, 4, 6 and 8."""
    n = validate("broken_rs_block_index_wrong_on_odd_rings", x, mesh, axis_name)

    def per_device(block):
        partial = block[0].astype(_wide(block.dtype))
        m = partial.shape[0] // n
        me = lax.axis_index(axis_name)
        # step s adds to block (me + s + start) mod n, which must be (me + s + 1) for the sum of block
        # d to end on d
        start = 1 if n % 2 == 0 else 2

        def rows_of(owner):
            return lax.dynamic_slice_in_dim(partial, owner * m, m)

        acc = rows_of(lax.rem(me + start, n))
        for step in range(1, n):
            acc = lax.ppermute(acc, axis_name, ring_perm(n, -1))
            acc = acc + rows_of(lax.rem(me + step + start, n))
        return acc.astype(block.dtype)

    return _reduce_scatter(per_device, x, mesh, axis_name)


@conformance.register("reduce_scatter", name="broken_rs_one_half_goes_the_wrong_way")
def broken_rs_one_half_goes_the_wrong_way(x, *, mesh, axis_name):
    """A bidirectional ring whose bottom half is sent right while its block indices assume it goes
    left: one device's contribution is added twice to some blocks and another's never (identical on
    a ring of 2, where left and right are the same neighbour)."""
    n = validate("broken_rs_one_half_goes_the_wrong_way", x, mesh, axis_name)

    def per_device(block):
        partial = block[0].astype(_wide(block.dtype))
        m = partial.shape[0] // n
        top_rows = (m + 1) // 2
        me = lax.axis_index(axis_name)

        def rows(owner, first, count):
            return lax.dynamic_slice_in_dim(partial, owner * m + first, count)

        top = rows(lax.rem(me + 1, n), 0, top_rows)
        bottom = rows(lax.rem(me + 1, n), top_rows, m - top_rows)  # indexed as the leftward ring
        for step in range(1, n):
            top = lax.ppermute(top, axis_name, ring_perm(n, -1)) + rows(
                lax.rem(me + step + 1, n), 0, top_rows
            )
            bottom = lax.ppermute(bottom, axis_name, ring_perm(n, +1)) + rows(
                lax.rem(me + step + 1, n), top_rows, m - top_rows
            )
        return jnp.concatenate([top, bottom]).astype(block.dtype)

    return _reduce_scatter(per_device, x, mesh, axis_name)


@conformance.register("reduce_scatter", name="broken_rs_ring_of_one_returns_the_partial_widened")
def broken_rs_ring_of_one_returns_the_partial_widened(x, *, mesh, axis_name):
    """A shortcut for a ring of one that returns its own partial, widened to the accumulator dtype
    and never cast back: right values, a float32 result for 16-bit inputs."""
    n = validate("broken_rs_ring_of_one_returns_the_partial_widened", x, mesh, axis_name)
    if n == 1:
        return _reduce_scatter(lambda block: block[0].astype(_wide(block.dtype)), x, mesh, axis_name)
    return conformance.implementations("reduce_scatter")["ring_reduce_scatter_unidirectional"](
        x, mesh=mesh, axis_name=axis_name
    )


@conformance.register("all_reduce", name="broken_ar_each_device_sums_in_its_own_order")
def broken_ar_each_device_sums_in_its_own_order(x, *, mesh, axis_name):
    """An all-reduce that gathers every partial and has each device sum them starting from its own:
    every replica within the sum's tolerance, and not the same bits on a ring of 3 or more (float
    addition is not associative; a ring of 2 adds two terms, which commute). Its bytes are a whole
    partial per peer, over the family's bound on those rings too."""
    n = validate("broken_ar_each_device_sums_in_its_own_order", x, mesh, axis_name)

    def per_device(block):
        partial = block[0]
        everyone = gathered_rows(partial[None], axis_name, bidirectional=False)  # [n, M, cols]
        me = lax.axis_index(axis_name)
        total = jnp.zeros(partial.shape, _wide(partial.dtype))
        for step in range(n):
            total = total + lax.dynamic_index_in_dim(everyone, lax.rem(me + step, n), keepdims=False).astype(
                total.dtype
            )
        return total.astype(partial.dtype)

    return jax.shard_map(
        per_device, mesh=mesh, in_specs=P(axis_name, None, None), out_specs=P(), check_vma=False
    )(x)


def _pallas_ring_without(
    name: str, *, bidirectional: bool = True, hbm: bool = False, tile_of=None, **protocol: bool
):
    """The built-in Pallas reduce-scatter ring (``hbm``: its HBM form, its tiles ``tile_of(rows)`` rows
    where given) with one guard of its protocol taken out."""

    @conformance.register("reduce_scatter", name=name, pallas=True)
    def kernel(x, *, mesh, axis_name, interpret=False):
        def tile(rows, row_bytes):
            if tile_of is not None:
                return tile_of(rows)
            return pallas_hbm_ring.tile_rows(rows, row_bytes, dtype=x.dtype, interpret=bool(interpret))

        return pallas_ring.reduce_scatter(
            x,
            mesh=mesh,
            axis_name=axis_name,
            interpret=interpret,
            bidirectional=bidirectional,
            name=name,
            protocol=pallas_ring.Protocol(**protocol),
            tile=tile if hbm else None,
        )

    kernel.__name__ = kernel.__qualname__ = name
    return kernel


#: No credit, one way round: a sender two steps ahead writes a receive buffer its neighbour has not
#: added yet, which the interpreter's race detector shows on rings of 4 or more (where a step reuses a
#: buffer); the values are wrong only where a device really runs two steps ahead. (Both ways round,
#: each device also waits for the other direction's transfer from the neighbour it sends to, which
#: orders that neighbour's addition before the next write: the bidirectional ring needs no credit
#: while both halves run.)
broken_pallas_rs_writes_a_buffer_still_being_read = _pallas_ring_without(
    "broken_pallas_rs_writes_a_buffer_still_being_read", bidirectional=False, credits=False
)
#: No barrier of its own, while taking the barrier semaphore's collective_id: a remote DMA may reach a
#: device that has not entered the kernel (never in interpret mode, which starts every device together).
broken_pallas_rs_dma_before_the_barrier = _pallas_ring_without(
    "broken_pallas_rs_dma_before_the_barrier", barrier=False
)
#: Only the last send waited: the one before it is left signalled, and may still read its buffer as
#: the kernel returns.
broken_pallas_rs_leaves_a_send_unwaited = _pallas_ring_without(
    "broken_pallas_rs_leaves_a_send_unwaited", drain_every_send=False
)

#: The HBM ring whose tile pipeline writes a VMEM result slot again before the write-back that last
#: read it has left: a tile two on overwrites the one still going out, so an earlier tile's rows land
#: with a later tile's sums (a direction of three or more tiles), and its write-backs are left signalled.
broken_pallas_hbm_rs_reuses_a_tile_still_being_written = _pallas_ring_without(
    "broken_pallas_hbm_rs_reuses_a_tile_still_being_written", hbm=True, tile_written_back=False
)


#: The HBM ring with a tuning space of its tile (``configs=``): each configuration an implementation of its
#: own. ``tile_rows=1`` divides every block; ``tile_rows=8`` tiles by a sublane's 8 rows (a direction's rows
#: where fewer) whether or not 8 divides them: the pipeline runs ``rows // 8`` tiles, and a direction's
#: rows past the last whole tile are never written. Right at every block of 8 rows or fewer; wrong at a
#: multi-tile shape with a remainder (20 rows a device: 10 each way, one tile of 8 and 2 rows dropped).
@conformance.register(
    "reduce_scatter",
    name="broken_pallas_hbm_rs_tiled_by_config",
    pallas=True,
    configs=({"tile_rows": 1}, {"tile_rows": 8}),
)
def broken_pallas_hbm_rs_tiled_by_config(x, *, mesh, axis_name, tile_rows: int, interpret=False):
    return pallas_ring.reduce_scatter(
        x,
        mesh=mesh,
        axis_name=axis_name,
        interpret=interpret,
        bidirectional=True,
        name=f"broken_pallas_hbm_rs_tiled_by_config.tile_rows.{tile_rows}",
        tile=lambda rows, row_bytes: min(rows, tile_rows),
    )


#: The HBM ring whose steps never read the received accumulator's tile in: each sum is this device's
#: partial alone, as the Pallas TPU tutorial's HBM reduce-scatter, whose ``emit_pipeline`` adds into an
#: output block it never reads in, keeps only the local partial.
broken_pallas_hbm_rs_never_reads_the_received_tile = _pallas_ring_without(
    "broken_pallas_hbm_rs_never_reads_the_received_tile", hbm=True, reads_received_tiles=False
)


@conformance.register("reduce_scatter", name="broken_rs_max_starts_from_zero", reductions=("add", "max"))
def broken_rs_max_starts_from_zero(x, *, mesh, axis_name, reduction="add"):
    """A sum written as a fold from zero, its max the same fold with ``maximum``: right for the sum,
    and for the max wherever some partial is positive; where every partial is negative the max is 0."""
    n = validate("broken_rs_max_starts_from_zero", x, mesh, axis_name)
    combine = {"add": jnp.add, "max": jnp.maximum}[reduction]

    def per_device(block):
        partial = block[0].astype(_wide(block.dtype))
        m, me = partial.shape[0] // n, lax.axis_index(axis_name)
        acc = jnp.zeros((m, partial.shape[1]), partial.dtype)
        for step in range(n):  # the accumulator of block me + step + 1 arrives, this device's rows join it
            if step:
                acc = lax.ppermute(acc, axis_name, ring_perm(n, -1))
            acc = combine(acc, lax.dynamic_slice_in_dim(partial, lax.rem(me + step + 1, n) * m, m))
        return acc.astype(block.dtype)

    return _reduce_scatter(per_device, x, mesh, axis_name)


@conformance.register("reduce_scatter", name="broken_rs_declares_columns_scatters_rows", scatter_dimension=1)
def broken_rs_declares_columns_scatters_rows(x, *, mesh, axis_name):
    """Declares ``scatter_dimension=1`` and scatters the partials' rows: the global sum is right, but
    each device holds a row block of it where the declared form puts a column block."""
    validate("broken_rs_declares_columns_scatters_rows", x, mesh, axis_name, scatter_dimension=1)

    def per_device(block):
        partial = block[0].astype(_wide(block.dtype))
        return lax.psum_scatter(partial, axis_name, scatter_dimension=0, tiled=True).astype(block.dtype)

    return _reduce_scatter(per_device, x, mesh, axis_name)


@conformance.register("reduce_scatter", name="broken_rs_columns_skip_ring_position_one", scatter_dimension=1)
def broken_rs_columns_skip_ring_position_one(x, *, mesh, axis_name):
    """A reduce-scatter along the partials' columns that leaves out ring position 1's partial (as a
    ring whose first hop is never added): every column block lacks it, which the block map names in
    columns."""
    validate("broken_rs_columns_skip_ring_position_one", x, mesh, axis_name, scatter_dimension=1)

    def per_device(block):
        kept = block[0].astype(_wide(block.dtype)) * (lax.axis_index(axis_name) != 1).astype(
            _wide(block.dtype)
        )
        return lax.psum_scatter(kept, axis_name, scatter_dimension=1, tiled=True).astype(block.dtype)

    return jax.shard_map(
        per_device, mesh=mesh, in_specs=P(axis_name, None, None), out_specs=P(None, axis_name)
    )(x)


@conformance.register(
    "reduce_scatter", name="broken_pallas_rs_split_in_thirds", pallas=True, bidirectional=True
)
def broken_pallas_rs_split_in_thirds(x, *, mesh, axis_name, interpret=False):
    """The built-in Pallas ring with a third of each block's accumulator sent left and two thirds
    right: exact, race-free, no more bytes in all; one link direction carries twice the other's."""
    return pallas_ring.reduce_scatter(
        x,
        mesh=mesh,
        axis_name=axis_name,
        interpret=interpret,
        bidirectional=True,
        name="broken_pallas_rs_split_in_thirds",
        cut=lambda m: ((m + 1) // 3 or m, m - ((m + 1) // 3 or m)),
    )


@conformance.register(
    "reduce_scatter", name="broken_pallas_rs_one_transfer_more_left", pallas=True, bidirectional=True
)
def broken_pallas_rs_one_transfer_more_left(x, *, mesh, axis_name, interpret=False):
    """The built-in Pallas ring, halves each way, and after the ring one more DMA leftwards whose data
    nobody reads, as the Pallas TPU tutorial's bidirectional reduce-scatter sends on its last step:
    exact and race-free; the left direction of every link carries one transfer more."""
    return pallas_ring.reduce_scatter(
        x,
        mesh=mesh,
        axis_name=axis_name,
        interpret=interpret,
        bidirectional=True,
        name="broken_pallas_rs_one_transfer_more_left",
        protocol=pallas_ring.Protocol(extra_send_left=True),
    )


@conformance.register(
    "reduce_scatter", name="broken_rs_float8_partial_sums_each_hop", dtypes=("float8_e4m3fn",)
)
def broken_rs_float8_partial_sums_each_hop(x, *, mesh, axis_name):
    """The same ring on float8 partials: each hop rounds the partial sum to 4 significand bits (up to 6%
    of it), where the family sums float8 in float32 and rounds once."""
    return broken_rs_rounds_partial_sums_each_hop(x, mesh=mesh, axis_name=axis_name)
