"""Reduce-scatter as a Pallas TPU kernel: accumulators round the ring by remote DMA, added in VMEM.

Algorithm. Each of n devices holds an ``[M, cols]`` partial, seen by the kernel as ``[n, m, cols]``
(block ``j`` is rows ``j m`` to ``(j + 1) m``, the rows device ``j`` ends with). One way round the ring
(``bidirectional=False``, JAX's Pallas TPU tutorial's reduce-scatter in one direction) device ``d``
starts with its own contribution to block ``d + 1`` and, for n - 1 steps, sends its accumulator to
``d - 1`` while receiving ``d + 1``'s, which holds the block one further on; it adds its own rows of that
block. After n - 1 hops what arrives is block ``d``'s sum less its own part, which it adds last. The
bidirectional kernel (the one registered: the one-way ring is its half where a block has a single
row, and the self-tests' form of it) cuts every block in two (top ``ceil(m/2)`` rows, the rest) and
runs the top rows that way and the bottom rows the other (block ``d - 1`` first), two rings at once,
each half the bytes. ``reduction="min"|"max"`` combines by ``minimum``/``maximum`` instead of adding.
Accumulators are float32 for 16-bit floats (int32 for int32), added in VMEM and rounded once: the
partial sums that travel are never rounded between hops.

Buffers and synchronisation, per direction:

1. *Two send and two receive buffers* (``[2, rows, cols]`` in VMEM), used alternately: the DMA of step
   ``s`` reads ``send[s % 2]`` and writes the downstream device's ``recv[s % 2]``; the new accumulator
   of step ``s`` goes to ``send[(s + 1) % 2]``, written only once the DMA that last read it (step
   ``s - 1``) has left this device.
2. *A barrier before the first remote DMA*: each device signals both neighbours' barrier semaphore and
   waits for two signals, so no DMA or signal reaches a device that has not entered the kernel.
3. *A credit before a receive buffer is written again*: the DMA of step ``s + 2`` writes the buffer
   step ``s`` filled, so after adding it the receiver signals a credit (a regular semaphore) on its
   sender, which waits for one before each step from the third on. The receive semaphores are then
   signalled only by the DMA they wait for (a DMA semaphore's wait is a byte count: with one shared
   semaphore a neighbour one step ahead could satisfy it with the next step's bytes). In the
   bidirectional kernel each device also waits, every step, for the other ring's transfer from the
   device it sends to, which already orders that device's addition before the next write; the credit
   is what orders it where one ring runs alone (``bidirectional=False``, a block of one row).
4. *Every DMA waited, every credit consumed* before the kernel returns: no transfer is in flight into or
   out of a buffer after it, no semaphore keeps a count.

A ring of one runs no kernel (the partial is the sum); it still goes through the ``shard_map``, so the
result is typed as sharded, as on every ring.

Gradient. Every partial adds to every element of the result, so each device's gradient is the whole
cotangent: a ``custom_vjp`` around the ``shard_map`` gathers the cotangent's row blocks with XLA's own
all-gather (the transpose of a reduce-scatter), ``(n-1)/n`` of it per device.

Limits. One mesh axis (other axes replicated and addressed by their coordinates). The partial, the
result and four accumulator buffers per direction live in VMEM: ``M cols`` input elements plus
``(m + 4 m) cols`` (accumulator-width) per direction must fit the core's VMEM (16 MiB on v5e by
default), so this kernel is for partials of a few MiB; a larger one takes its HBM form
(:mod:`conformance.kernels.reduce_scatter.pallas_hbm_ring`: the same rings, each addition pipelined
through VMEM in tiles). The steps are unrolled (n static). Mosaic takes no
float16 kernel arguments, so compiled for a TPU float16 partials enter the kernel widened to float32
(the accumulators' type anyway) and the sum is rounded to float16 after it; interpret mode, which has
no such limit, takes them as they are (half the memory it allocates per simulated device).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.sharding import PartitionSpec as P

import conformance
from conformance.kernels._pallas import TILE_BUFFERS, neighbour, pipelined
from conformance.kernels._reduction import COMBINE, REDUCTIONS, combine, validate
from conformance.kernels._ring import accumulator_dtype, halves
from conformance.kernels.all_gather.pallas_ring import ANY_2D_WINDOW
from conformance.specs.reduce_scatter import REDUCE_SCATTER
from conformance.targets import mosaic, tpu_compiler

#: Steps a link may have in flight: each direction's buffers and semaphores are reused every 2 steps.
IN_FLIGHT = 2


@dataclasses.dataclass(frozen=True)
class Protocol:
    """Guards of the kernel's synchronisation (module docstring, points 2 to 4) that the self-tests
    take out, one each, to watch the check meant for it fail."""

    #: The barrier before the first remote DMA.
    barrier: bool = True
    #: A credit before a receive buffer is written again.
    credits: bool = True
    #: Every send waited before the kernel returns (else only the last).
    drain_every_send: bool = True
    #: The HBM kernel's: a tile's write-back waited before its VMEM slot takes the tile two on.
    tile_written_back: bool = True
    #: A defect, not a guard: one more DMA leftwards after the ring (the last accumulator sent again, into
    #: a buffer of the downstream device's that nothing reads), as the Pallas TPU tutorial's
    #: bidirectional reduce-scatter sends on its last step. Exact and race-free; one direction of
    #: every link carries a transfer more than the other. The VMEM kernel's only.
    extra_send_left: bool = False
    #: The HBM kernel's, a defect: each step's tiles combine this device's partial with nothing, the
    #: received accumulator's tile never read in, as an ``emit_pipeline`` that adds into an output block
    #: it never reads in (the Pallas TPU tutorial's HBM reduce-scatter) keeps only the local partial.
    reads_received_tiles: bool = True


SAFE = Protocol()


def _ring_kernel(
    *refs: Any,
    axis_name: str,
    mesh_axes: tuple[str, ...],
    directions: int,
    reduction: str = "add",
    protocol: Protocol = SAFE,
    gather: bool = False,
    tile_rows: tuple[int, ...] | None = None,
    split_rows: tuple[int, ...] = (),
    pipeline: Callable[..., None] = pipelined,
) -> None:
    """``directions`` rings (1: leftwards; 2: top rows leftwards, bottom rows rightwards). ``refs``:
    the inputs ``x[n, rows, cols]`` of each direction, its outputs ``[rows, cols]`` (``gather``: every
    block, ``[n, rows, cols]``), then per direction send and receive buffers, send and receive DMA
    semaphores and a credit semaphore. ``tile_rows``: the HBM kernel's, a direction's tile of rows (its
    refs in HBM, its send and receive buffers outputs after the results, as interpret mode allocates no
    HBM scratch, and ``TILE_BUFFERS`` more scratch per direction for ``_pallas.pipelined``); None:
    every ref in VMEM; ``pipeline``: what adds in tiles (``_pallas.pipelined``'s signature; the
    self-tests' other styles). ``split_rows``: one input ``x[n, M/n, cols]``, each direction's inputs
    its next rows of every block (a view, where one input per direction would be a copy of the
    partial)."""
    if split_rows:
        starts = [sum(split_rows[:k]) for k in range(directions)]
        inputs = tuple(refs[0].at[:, pl.ds(starts[k], split_rows[k])] for k in range(directions))
        refs = (*inputs, *refs[1:])
    inputs, outputs = refs[:directions], refs[directions : 2 * directions]
    scratch = refs[2 * directions :]
    if protocol.extra_send_left:  # its buffer and semaphores after every direction's
        spare, spare_sent, spare_received = scratch[-3:]
        scratch = scratch[:-3]
    per_direction = 5 + (TILE_BUFFERS if tile_rows else 0)
    if tile_rows:  # each direction's HBM send and receive buffers before its scratch
        buffers, rest, each = scratch[: 2 * directions], scratch[2 * directions :], per_direction - 2
        scratch = tuple(
            ref
            for k in range(directions)
            for ref in (*buffers[2 * k : 2 * k + 2], *rest[each * k : each * (k + 1)])
        )
    n = lax.axis_size(axis_name)
    me = lax.axis_index(axis_name)

    def ring(index: Any) -> jax.Array:
        return lax.rem(index, jnp.int32(n))

    left = neighbour(mesh_axes, axis_name, ring(me + n - 1))
    right = neighbour(mesh_axes, axis_name, ring(me + 1))
    rings = []
    for k in range(directions):
        send, recv, send_sems, recv_sems, credit = scratch[per_direction * k : per_direction * k + 5]
        # leftwards: block me + s + 1 at step s, sent to the left, received from the right
        hop = 1 if k == 0 else -1
        downstream, upstream = (left, right) if k == 0 else (right, left)
        rings.append(
            (inputs[k], outputs[k], send, recv, send_sems, recv_sems, credit, hop, downstream, upstream)
        )

    def block(hop: int, step: int) -> jax.Array:
        """The block whose accumulator this device holds after step ``step - 1`` (``step`` 0: its first)."""
        return ring(me + hop * (step + 1) + n * (step + 1))

    def add_tiles(k: int, dst: Any, first: Any | None, second: Any) -> None:
        """The HBM kernel's ``dst = first + second`` (``second`` where ``first`` is None) in direction
        ``k``'s tiles."""
        tiles = tuple(scratch[per_direction * k + 5 : per_direction * (k + 1)])
        combined = COMBINE[reduction]
        pipeline(
            dst,
            first,
            second,
            tiles,
            rows=tile_rows[k],
            combine=combined,
            written_back=protocol.tile_written_back,
        )

    with jax.named_scope("first_contribution"):
        for k, (x_ref, _, send, _, _, _, _, hop, _, _) in enumerate(rings):
            if tile_rows:
                add_tiles(k, send.at[jnp.int32(0)], None, x_ref.at[block(hop, 0)])
            else:
                send[jnp.int32(0)] = x_ref[block(hop, 0)].astype(send.dtype)

    if protocol.barrier:
        with jax.named_scope("barrier"):
            barrier = pltpu.get_barrier_semaphore()
            for peer in (left, right):
                pl.semaphore_signal(barrier, 1, device_id=peer)
            pl.semaphore_wait(barrier, 2)

    steps = n - 1
    every_step = 2 * steps if gather else steps  # the gather steps follow on the same semaphores
    sent: list[list[Any]] = []
    waited: set[int] = set()  # the steps whose sends have been waited for
    for step in range(steps):
        slot = jnp.int32(step % IN_FLIGHT)
        with jax.named_scope(f"ring_step_{step}_send"):
            now = []
            for _, _, send, recv, send_sems, recv_sems, credit, _, downstream, _ in rings:
                if step >= IN_FLIGHT and protocol.credits:  # downstream has added what it got in this slot
                    pl.semaphore_wait(credit, 1)
                dma = pltpu.make_async_remote_copy(
                    send.at[slot], recv.at[slot], send_sems.at[slot], recv_sems.at[slot], device_id=downstream
                )
                dma.start()
                now.append(dma)
            sent.append(now)
        with jax.named_scope(f"ring_step_{step}_add"):
            for k, (x_ref, o_ref, send, recv, _, _, credit, hop, _, upstream) in enumerate(rings):
                sent[step][k].wait_recv()
                if tile_rows:  # combined tile by tile straight into where it goes, then the credit
                    if step == steps - 1:
                        dst = o_ref.at[me] if gather else o_ref
                    else:
                        if step >= 1:
                            sent[step - 1][k].wait_send()
                        dst = send.at[jnp.int32((step + 1) % IN_FLIGHT)]
                    received = recv.at[slot] if protocol.reads_received_tiles else None
                    add_tiles(k, dst, received, x_ref.at[block(hop, step + 1)])
                    if step + IN_FLIGHT < every_step and protocol.credits:
                        pl.semaphore_signal(credit, 1, device_id=upstream)
                    continue
                total = COMBINE[reduction](recv[slot], x_ref[block(hop, step + 1)].astype(recv.dtype))
                if step + IN_FLIGHT < every_step and protocol.credits:  # upstream will write this slot again
                    pl.semaphore_signal(credit, 1, device_id=upstream)
                if step == steps - 1 and gather:  # this device's block, rounded once, to be gathered
                    o_ref[me] = total.astype(o_ref.dtype)
                elif step == steps - 1:
                    o_ref[...] = total.astype(o_ref.dtype)
                else:
                    if step >= 1:  # the DMA of step - 1 read the buffer written next
                        sent[step - 1][k].wait_send()
                    send[jnp.int32((step + 1) % IN_FLIGHT)] = total
            if 1 <= step < steps - 1:
                waited.add(step - 1)

    for g in range(steps if gather else 0):  # the sums go round the same ring, each block once
        step = steps + g
        slot = jnp.int32(step % IN_FLIGHT)
        with jax.named_scope(f"gather_step_{g}_send"):
            prior = step - IN_FLIGHT  # the step whose send semaphores this one reuses
            if prior >= 0 and prior not in waited:
                for k in range(directions):
                    sent[prior][k].wait_send()
                waited.add(prior)
            now = []
            for _, o_ref, _, _, send_sems, recv_sems, credit, hop, downstream, _ in rings:
                if step >= IN_FLIGHT and protocol.credits:  # downstream has waited for this slot's last
                    pl.semaphore_wait(credit, 1)
                block_sent = ring(me + hop * g + n)  # this device's own at g = 0, then what it received
                dma = pltpu.make_async_remote_copy(
                    o_ref.at[block_sent],
                    o_ref.at[block_sent],
                    send_sems.at[slot],
                    recv_sems.at[slot],
                    device_id=downstream,
                )
                dma.start()
                now.append(dma)
            sent.append(now)
        with jax.named_scope(f"gather_step_{g}_receive"):
            for k, (_, _, _, _, _, _, credit, _, _, upstream) in enumerate(rings):
                sent[step][k].wait_recv()
                if step + IN_FLIGHT < every_step and protocol.credits:
                    pl.semaphore_signal(credit, 1, device_id=upstream)

    if protocol.extra_send_left:  # the defect: one more transfer leftwards, which nobody reads
        with jax.named_scope("extra_send"):
            _, _, send, _, _, _, _, _, downstream, _ = rings[0]
            extra = pltpu.make_async_remote_copy(
                send.at[jnp.int32((steps - 1) % IN_FLIGHT)],
                spare,
                spare_sent,
                spare_received,
                device_id=downstream,
            )
            extra.start()
            extra.wait_send()
            extra.wait_recv()

    with jax.named_scope("drain"):  # every send not yet waited (the last one only, with the knob off)
        unwaited = [step for step in range(every_step) if step not in waited]
        for step in unwaited if protocol.drain_every_send else unwaited[-1:]:
            for k in range(directions):
                sent[step][k].wait_send()


def refuse_what_a_tpu_cannot_do(name: str, cols: int) -> None:
    """``TpuConstraintError`` (:func:`conformance.targets.mosaic.refuse`, held against the real TPU
    compiler) for what the libtpu of this JAX refuses of the kernel's DMA windows: before 0.0.42 a
    window of a VMEM buffer whose minor dim is not whole 128-lane tiles (libtpu 0.0.17: "Slice shape
    along dimension 2 must be aligned to tiling (128)"; the all-gather ring's measured rule)."""
    libtpu = tpu_compiler.libtpu_in_use()
    if libtpu < ANY_2D_WINDOW and cols % 128:
        mosaic.refuse(
            f"{name}: on a TPU (libtpu {'.'.join(map(str, libtpu))}) the partials' {cols} columns must be "
            "a multiple of 128 lanes for the ring's DMA windows; pad them, or run it under interpret mode"
        )


#: Rows a window of a packed (16- or 8-bit) HBM partial must be a multiple of before libtpu 0.0.42.
PACKED_HBM_ROWS = 16
#: Rows of a sublane tile: before libtpu :data:`WINDOWS_ACROSS_TILES` a window of a packed partial's
#: block of more rows starts and ends on one.
SUBLANES = 8
WINDOWS_ACROSS_TILES = (0, 0, 50)


def refuse_unaligned_hbm_rows(name: str, cuts: list[int], dtype: jnp.dtype) -> None:
    """``TpuConstraintError`` for the HBM kernel's row windows of a 16- or 8-bit partial (``cuts``: each
    direction's rows of a block) that the TPU compiler of this JAX refuses; 32-bit partials take any
    window. Measured on blocks of 1, 2, 3, 5, 8 and 32 rows:

    - before 0.0.42 each direction's rows must be a multiple of 16 (libtpu 0.0.17: "Slice shape along
      dimension 1 must be aligned to tiling (4), but is 2" for every block but 32 rows);
    - from 0.0.42 (0.0.42 and 0.0.50 alike) each direction must start on a multiple of the packing (2
      rows of 16-bit, 4 of 8-bit) and span a multiple of it or one row ("Slice sizes along tiled
      dimensions must be aligned to tiles ... divisible by the tile dimension 4"): bfloat16 blocks of 2
      and 5 rows and float8 blocks of 2, 3 and 5 are refused; and before 0.0.50 a block of more than
      one sublane tile (8 rows) is cut only at multiples of 8 (libtpu 0.0.42 on bfloat16 blocks of 20
      rows, 10 a direction: "... divisible by the tile dimension 8"; 0.0.50 compiles them)."""
    libtpu, itemsize = tpu_compiler.libtpu_in_use(), jnp.dtype(dtype).itemsize
    if itemsize >= 4:
        return
    packing = 4 // itemsize
    starts = [sum(cuts[:k]) for k in range(len(cuts))]
    if libtpu < ANY_2D_WINDOW:
        refused, rule = any(r % PACKED_HBM_ROWS for r in cuts), f"a multiple of {PACKED_HBM_ROWS}"
    else:
        refused = any(s % packing or (r % packing and r != 1) for s, r in zip(starts, cuts, strict=True))
        rule = f"a multiple of {packing} (or one row) from a multiple of {packing}"
        if (
            not refused
            and libtpu < WINDOWS_ACROSS_TILES
            and sum(cuts) > SUBLANES
            and any(s % SUBLANES or r % SUBLANES for s, r in zip(starts, cuts, strict=True))
        ):
            refused, rule = (
                True,
                f"a multiple of {SUBLANES} from a multiple of {SUBLANES} (a block of several tiles)",
            )
    if refused:
        mosaic.refuse(
            f"{name}: on a TPU (libtpu {'.'.join(map(str, libtpu))}) the {jnp.dtype(dtype).name} partials' "
            f"rows of a block go {' and '.join(map(str, cuts))} per ring direction, and each must be {rule} "
            "for the HBM windows; pad them, or run it under interpret mode"
        )


#: Element types Mosaic takes no kernel arguments of (libtpu 0.0.17 to 0.0.50 refuse float16 at every
#: shape): the kernel takes such partials widened to float32, and its result is rounded outside it.
WIDENED_OUTSIDE = (jnp.dtype(jnp.float16),)


def scattered_partial(
    partial: jax.Array,
    *,
    axis_name: str,
    mesh_axes: tuple[str, ...],
    interpret: Any,
    bidirectional: bool,
    name: str,
    reduction: str = "add",
    protocol: Protocol = SAFE,
    cut: Callable[[int], tuple[int, int]] | None = None,
    gather: bool = False,
    tile: Callable[[int, int], int] | None = None,
    pipeline: Callable[..., None] = pipelined,
) -> jax.Array:
    """This device's row block of the sum of every device's ``partial[M, cols]``, by the ring kernel,
    rounded once to ``partial``'s dtype: called on each device inside a ``shard_map`` over ``axis_name``
    (``cut``: a block's rows -> the rows sent left and right, the self-tests' knob; the halves).
    ``tile``: the HBM kernel, ``(rows, row_bytes) ->`` the rows of a tile that divides a direction's
    ``rows`` (every buffer in HBM, tiles through VMEM, added by ``pipeline``); None: every buffer in VMEM.
    ``gather``: the whole ``[M, cols]`` sum, each block rounded on its owner and gathered round the same
    rings in the same kernel (an all-reduce)."""
    n = lax.axis_size(axis_name)
    m, cols = partial.shape[0] // n, partial.shape[1]
    if not interpret:
        refuse_what_a_tpu_cannot_do(name, cols)
    blocks = partial.reshape(n, m, cols)
    if blocks.dtype in WIDENED_OUTSIDE and not interpret:
        blocks = blocks.astype(jnp.float32)
    if n == 1:  # the partial is the sum: nothing to move, no kernel to run
        return partial
    top, bottom = cut(m) if cut else halves(m, bidirectional=bidirectional)
    cuts = [rows for rows in (top, bottom) if rows]
    acc = accumulator_dtype(blocks.dtype)
    tile_rows = tuple(tile(rows, cols * acc.itemsize) for rows in cuts) if tile else None
    if tile_rows and not interpret:
        refuse_unaligned_hbm_rows(name, cuts, blocks.dtype)
    kernel = functools.partial(
        _ring_kernel,
        axis_name=axis_name,
        mesh_axes=mesh_axes,
        directions=len(cuts),
        reduction=reduction,
        protocol=protocol,
        gather=gather,
        tile_rows=tile_rows,
        split_rows=tuple(cuts) if tile_rows else (),
        pipeline=pipeline,
    )
    # the sums go round in the partials' dtype, rounded once on their owner; a libtpu older than 0.0.42
    # refuses windows of narrower rows than a sublane tile, so there they go as the float32 accumulators
    # are (the same bits on every device all the same: rounded after the kernel, once)
    narrow_windows = not interpret and tpu_compiler.libtpu_in_use() < ANY_2D_WINDOW
    out_dtype = acc if gather and narrow_windows else blocks.dtype
    scratch, hbm_buffers = [], []
    for k, rows in enumerate(cuts):
        accumulators = (IN_FLIGHT, rows, cols)
        if tile_rows:  # accumulators sent and received, in HBM: outputs, dropped after
            hbm_buffers += [jax.ShapeDtypeStruct(accumulators, acc)] * 2
        else:
            scratch += [pltpu.VMEM(accumulators, acc), pltpu.VMEM(accumulators, acc)]  # sent, received
        scratch += [
            pltpu.SemaphoreType.DMA((IN_FLIGHT,)),  # sent
            pltpu.SemaphoreType.DMA((IN_FLIGHT,)),  # received
            pltpu.SemaphoreType.REGULAR,  # credits from the downstream device
        ]
        if tile_rows:  # the tile pipeline's buffers (_pallas.pipelined)
            rows_in_tile = tile_rows[k]
            tile_shape = (2, rows_in_tile, cols)
            scratch += [
                pltpu.VMEM(tile_shape, acc),
                pltpu.VMEM(tile_shape, blocks.dtype),
                pltpu.VMEM(tile_shape, acc),
                # results in the output's dtype: unread where it is the accumulators', so one sublane
                # tile stands in (libtpu 0.0.42 allocates no VMEM for an unread buffer either way: at 512 KiB
                # tiles a float32 ring compiles within 6 MiB of scoped VMEM with either; interpret mode
                # allocates what it is given)
                pltpu.VMEM(tile_shape if out_dtype != acc else (1, 8, 128), out_dtype),
                pltpu.SemaphoreType.DMA((3, 2)),
            ]
    if protocol.extra_send_left:
        if tile_rows:
            raise ValueError(f"{name}: Protocol.extra_send_left is the VMEM kernel's")
        scratch += [pltpu.VMEM((cuts[0], cols), acc), pltpu.SemaphoreType.DMA, pltpu.SemaphoreType.DMA]
    vmem = pl.BlockSpec(memory_space=pl.ANY if tile else pltpu.VMEM)
    summed = pl.pallas_call(
        kernel,
        out_shape=[
            jax.ShapeDtypeStruct((n, rows, cols) if gather else (rows, cols), out_dtype) for rows in cuts
        ]
        + hbm_buffers,
        in_specs=[vmem] * (1 if tile_rows else len(cuts)),
        out_specs=[vmem] * (len(cuts) + len(hbm_buffers)),
        scratch_shapes=scratch,
        compiler_params=pltpu.CompilerParams(collective_id=0),
        interpret=interpret,
    )(*([blocks] if tile_rows else [blocks[:, :top], blocks[:, top:]][: len(cuts)]))[: len(cuts)]
    whole = jnp.concatenate(summed, axis=-2) if len(summed) > 1 else summed[0]
    return (whole.reshape(n * m, cols) if gather else whole).astype(partial.dtype)


def reduce_scatter(
    x: jax.Array,
    *,
    mesh: jax.sharding.Mesh,
    axis_name: str,
    interpret: Any,
    bidirectional: bool,
    name: str,
    reduction: str = "add",
    protocol: Protocol = SAFE,
    cut: Callable[[int], tuple[int, int]] | None = None,
    tile: Callable[[int, int], int] | None = None,
    pipeline: Callable[..., None] = pipelined,
) -> jax.Array:
    """The ring reduce-scatter of the partials ``x[n, M, cols]`` (``protocol`` and ``cut``: the
    self-tests' knobs; ``tile``: the HBM kernel's, :func:`scattered_partial`)."""
    validate(name, x, mesh, axis_name)
    combine(name, reduction)

    def per_device(block: jax.Array) -> jax.Array:
        return scattered_partial(
            block[0],
            axis_name=axis_name,
            mesh_axes=tuple(mesh.axis_names),
            interpret=interpret,
            bidirectional=bidirectional,
            name=name,
            reduction=reduction,
            protocol=protocol,
            cut=cut,
            tile=tile,
            pipeline=pipeline,
        )

    scatter = jax.shard_map(
        per_device,
        mesh=mesh,
        in_specs=P(axis_name, None, None),
        out_specs=P(axis_name, None),
        check_vma=False,
    )

    @jax.custom_vjp
    def scattered(x: jax.Array) -> jax.Array:
        return scatter(x)

    def scattered_fwd(x: jax.Array) -> tuple[jax.Array, None]:
        return scatter(x), None

    def scattered_bwd(_: None, ct: jax.Array) -> tuple[jax.Array]:
        every = jax.shard_map(
            lambda block: lax.all_gather(block, axis_name, tiled=True)[None],
            mesh=mesh,
            in_specs=P(axis_name, None),
            out_specs=P(axis_name),
        )
        return (every(ct),)

    scattered.defvjp(scattered_fwd, scattered_bwd)
    return scattered(x)


@conformance.register(
    "reduce_scatter",
    name="pallas_ring_reduce_scatter_bidirectional",
    pallas=True,
    bidirectional=True,
    differentiable=True,
    dtypes=REDUCE_SCATTER.dtypes,
    reductions=REDUCTIONS,
    description="Pallas remote-DMA rings, the top rows of each block leftwards and the rest rightwards",
)
def pallas_ring_reduce_scatter_bidirectional(
    x: jax.Array, *, mesh: jax.sharding.Mesh, axis_name: str, interpret: Any = False, reduction: str = "add"
) -> jax.Array:
    return reduce_scatter(
        x,
        mesh=mesh,
        axis_name=axis_name,
        interpret=interpret,
        bidirectional=True,
        name="pallas_ring_reduce_scatter_bidirectional",
        reduction=reduction,
    )
