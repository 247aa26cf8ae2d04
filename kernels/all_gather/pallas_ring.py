"""Ring all-gather as a Pallas TPU kernel of remote DMAs, race-free under any DMA order.

Algorithm. ``x`` is sharded by rows over a ring of n devices. Each device first
copies its own shard into slot ``me`` of its output ``o[n, m, ...]``. Then, for
n - 1 steps, it forwards the slot it received last step to its neighbour, so
after step s device d holds the shards of d, d-1, ..., d-s. The bidirectional
ring cuts every shard in two, sends the top part rightwards (d -> d+1) and the
bottom part leftwards (d -> d-1), so both directions of every link carry data
at once. The cut is ``ceil(m/2)`` / ``floor(m/2)`` rows, or a tile boundary on
a TPU (see "TPU layout"). An odd m is exact: never ``m // 2`` twice (which
drops the last row); with m == 1 the bottom part is empty and only the
rightward ring runs.

Synchronisation, and why it is race-free:

1. *Barrier before the first remote DMA.* Each device signals the barrier
   semaphore of both neighbours and waits for two signals, so no DMA targets a
   device that has not yet entered the kernel (its output buffer and
   semaphores would not exist yet).
2. *Receive semaphores that no other transfer can signal, two per direction.*
   The DMA of step s signals ``recv[s % 2]`` on its target, and a device
   forwards at step s the slot it received at step s-1 only after waiting on
   ``recv[(s-1) % 2]``. A DMA semaphore wait is a byte count, so with a single
   semaphore reused for every step (the seed kernel's design) a neighbour
   running one step ahead can satisfy the wait for step s-1 with the bytes of
   step s, and the device forwards a slot that has not arrived. Here the only
   other transfer that signals ``recv[(s-1) % 2]`` is step s+1's, and the
   sender may not start it before the receiver has waited for step s-1: after
   that wait the receiver signals a *credit* (a regular semaphore) on the
   sender, and the sender waits for one credit before each step from the
   third on (and for its own send of two steps back, whose semaphore it reuses).
   At most two steps are in flight on a link, so the kernel's semaphores do not
   grow with the ring: 8 DMA semaphores, 2 credit semaphores and a copy
   semaphore on any ring (a semaphore per step, 4(n-1)+1 of them, ran out of
   the TPU core's semaphore memory above 110 chips). TPU interpret mode's
   ``dma_execution_mode="on_wait"``, which runs DMAs as late and out of order
   as the waits allow, is the test.
3. *Each slot is written once.* Device d receives slots d-1, ..., d-(n-1) in
   one direction, never its own and never twice, so no write-after-read or
   write-after-write hazard exists on the output buffer.
4. *Every DMA is waited before exit, every credit consumed.* Each device waits
   for all its sends and for the last receive of each direction, so no transfer
   is in flight into or out of a buffer after the kernel returns; a receiver
   gives a credit only for a step whose semaphore its sender will reuse, so
   every credit is waited for and no semaphore keeps a count.

Gradient. ``jax.custom_vjp`` around the ``shard_map``: the transpose of a
replicated all-gather is a slice of the cotangent (no collective). The
``custom_vjp`` is outside rather than inside the ``shard_map`` because inside it
would need ``check_vma=True``, and JAX's TPU interpret mode (0.10.2) cannot run
this kernel then: ``axis_index`` in the kernel body is typed as varying and
mixing it with constants fails ("Primitive add requires varying manual axes to
match"), although lowering for a TPU works. README, "Backward passes without
defensive all-reduces", gives both recipes.

TPU layout. A TPU stores each buffer in tiles over its two minor dims: 128
lanes by a sublane tile of 1 to 32 rows that depends on the dtype and the row
count (``conformance.targets.mosaic``), and its compiler refuses a DMA window that does
not start and end on tile boundaries. Interpret mode has no tiles, so this is
invisible on CPU. Hence the windows: for a 2-D shard that fills whole tiles the
bidirectional split falls on a tile boundary (``row_split``; one tile goes one
way whole). Compiled for a TPU (``interpret`` left out), the kernel refuses
with ``conformance.TpuConstraintError`` naming the tile what a chip cannot
run: a shard whose minor dims do not fill whole tiles (odd rows, fewer than
128 columns), a 1-D shard, and bool or 64-bit elements. Under interpret mode
every shape runs, odd and 1-row shards split ``ceil``/``floor``.

A ring of one (a mesh axis of size 1) runs no kernel: each device's shard is
already the whole array. It still goes through the same ``shard_map``, so the
result is typed replicated, ``P()``, as on every other ring. Returning ``x``
itself (the seed kernel's ``if axis size == 1: return x``) keeps ``x``'s
sharding: on an Explicit mesh the result is then typed as sharded over the
axis, equal in value, and ``jax.vjp`` rejects the family's replicated cotangent.

Limits. One mesh axis per call; the other axes of a 2-D or 3-D mesh are
replicated and addressed by their own coordinates. Input and output stay in HBM (``pl.ANY``)
and are touched only by DMAs (no VMEM, so no VMEM capacity limit); the kernel
uses 9 DMA semaphores, 2 regular ones and one barrier semaphore
(``collective_id=0``) on any ring, and compiles for a v5e slice of 256 chips.
On CPU it runs under TPU interpret mode; the suite audits the windows it lowers
to for TPU from CPU, and ``pytest -m tpu`` runs it compiled on chips.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.sharding import PartitionSpec as P

import conformance
from conformance.kernels._pallas import neighbour
from conformance.kernels.all_gather._common import validate
from conformance.targets import mosaic, tpu_compiler

#: Ring steps a link may have in flight: the receive and send semaphores of a direction are reused
#: every ``IN_FLIGHT`` steps, so the kernel's semaphores do not grow with the ring.
IN_FLIGHT = 2


def _ring_kernel(
    x_ref: Any,
    o_ref: Any,
    send_right: Any,
    recv_right: Any,
    send_left: Any,
    recv_left: Any,
    credit_right: Any,
    credit_left: Any,
    copy_sem: Any,
    *,
    axis_name: str,
    mesh_axes: tuple[str, ...],
    right_rows: int,
    left_rows: int,
    in_flight: int,
) -> None:
    n = lax.axis_size(axis_name)
    me = lax.axis_index(axis_name)
    steps = n - 1
    # Ring arithmetic in int32, the type of axis_index (a bare Python int would
    # become int64 under jax_enable_x64, and lax.rem refuses mixed types).

    def ring(index: jax.Array) -> jax.Array:
        return lax.rem(index, jnp.int32(n))

    right = neighbour(mesh_axes, axis_name, ring(me + 1))
    left = neighbour(mesh_axes, axis_name, ring(me + n - 1))

    with jax.named_scope("own_shard"):
        own = pltpu.make_async_copy(x_ref, o_ref.at[me], copy_sem)
        own.start()
        own.wait()

    with jax.named_scope("barrier"):
        # Neighbours must be inside the kernel before we DMA into their buffers.
        barrier = pltpu.get_barrier_semaphore()
        for peer in (left, right):
            pl.semaphore_signal(barrier, 1, device_id=peer)
        pl.semaphore_wait(barrier, 2)

    def send(step: int, slot: jax.Array, first: int, count: int, peer, send_sems, recv_sems):
        # Static indices as int32 too: under jax_enable_x64 a Python int would
        # lower as i64, which Mosaic's slices do not take.
        window = o_ref.at[slot, pl.ds(jnp.int32(first), count)]
        dma = pltpu.make_async_remote_copy(
            window,
            window,
            send_sems.at[jnp.int32(step % in_flight)],  # signalled here when the data has left
            recv_sems.at[jnp.int32(step % in_flight)],  # signalled on `peer` when it has arrived
            device_id=peer,
        )
        dma.start()
        return dma

    # Each direction: (rows, the peer sent to, the peer received from, its semaphores).
    directions = [(right_rows, right, left, send_right, recv_right, credit_right)]
    if left_rows:
        directions.append((left_rows, left, right, send_left, recv_left, credit_left))

    def received(step: int, dma: Any, upstream, credit) -> None:
        """Wait for the step's arrival; then, if the upstream device will send on the semaphore this
        step used, give it the credit to."""
        dma.wait_recv()
        if step + in_flight < steps:
            pl.semaphore_signal(credit, 1, device_id=upstream)

    sent: list[list[Any]] = []
    for step in range(steps):
        with jax.named_scope(f"ring_step_{step}"):
            now = []
            for d, (rows, downstream, upstream, send_sems, recv_sems, credit) in enumerate(directions):
                if step > 0:
                    # Forward only what has arrived: last step's transfer into this device.
                    received(step - 1, sent[-1][d], upstream, credit)
                if step >= in_flight:
                    # Reuse the semaphores of step - in_flight only when that transfer has left here
                    # and the downstream device has waited for its arrival (its credit).
                    sent[step - in_flight][d].wait_send()
                    pl.semaphore_wait(credit, 1)
                first = 0 if d == 0 else right_rows
                slot = ring(me - step + n) if d == 0 else ring(me + step)
                now.append(send(step, slot, first, rows, downstream, send_sems, recv_sems))
            sent.append(now)

    with jax.named_scope("drain"):
        for d, (_, _, upstream, _, _, credit) in enumerate(directions):
            received(steps - 1, sent[-1][d], upstream, credit)
            for step in range(max(0, steps - in_flight), steps):
                sent[step][d].wait_send()


#: The libtpu versions from which Mosaic's DMA-window rules relaxed, measured with the real compiler
#: (``conformance.targets.tpu_compiler``; v4, v5e and v6e topologies agree): from 0.0.19 a 32-bit shard's
#: rows need not fill a sublane tile (0.0.17, JAX 0.6.2, refuses 3 rows of float32; 0.0.19 to 0.0.40,
#: JAX 0.7.0 to 0.10.0, compile them); from 0.0.42 no 2-D window need be tile-aligned (0.0.40
#: refuses 1 row of bfloat16 and 8 columns; 0.0.42 and 0.0.50, JAX 0.10.2 and 0.12, compile both).
#: A version between two measured ones takes the stricter rule.
ROWS_FREE_FOR_32_BITS = (0, 0, 19)
ANY_2D_WINDOW = (0, 0, 42)


def row_split(
    shard_shape: tuple[int, ...], dtype: Any, *, bidirectional: bool, for_tpu: bool = False
) -> tuple[int, int]:
    """Rows of each shard sent rightwards and leftwards (the second is 0 for a one-way ring).

    Both windows must be whole tiles on a TPU (module docstring, "TPU layout"),
    so a 2-D shard that fills whole tiles is split at a tile boundary: the
    rightward part gets ``ceil(tiles / 2)`` tiles. A shard of one tile goes
    rightwards whole, and so, compiled for a TPU (``for_tpu``), does a shard that
    does not fill whole tiles (no split of it is tile-aligned; libtpu 0.0.42 and
    0.0.50 refuse some such splits, e.g. 5 rows of bfloat16 as 3 + 2). Under
    interpret mode such a shard is split ``ceil(m/2)`` / ``floor(m/2)`` rows: never
    ``m // 2`` twice, which drops the last row of an odd shard.
    """
    rows = shard_shape[0]
    if not bidirectional:
        return rows, 0
    aligned = len(shard_shape) == 2 and mosaic.tile_aligned(shard_shape, dtype)
    if for_tpu and not aligned:
        return rows, 0
    quantum = 1
    if aligned:
        quantum = max(tile[0] for tile in mosaic.tiles(shard_shape, mosaic.bitwidth(dtype)))
    right = quantum * (-(-(rows // quantum) // 2))
    return right, rows - right


def refuse_what_a_tpu_cannot_do(name: str, shard_shape: tuple[int, ...], dtype: Any) -> None:
    """``TpuConstraintError`` naming the constraint, for a shard the TPU compiler of this JAX refuses
    (the libtpu it pins, or the one installed: ``tpu_compiler.libtpu_in_use``), through
    :func:`conformance.targets.mosaic.refuse`, so the suite can hold each refusal against the real compiler.

    Called only when the kernel is compiled for a TPU; interpret mode has no
    layouts and runs every shape.
    """
    width, dt = mosaic.bitwidth(dtype), jnp.dtype(dtype)
    if dt == jnp.bool_ or width not in mosaic.SUPPORTED_BITWIDTHS:
        return mosaic.refuse(
            f"{name}: {dt.name} shards cannot be DMA'd on a TPU (Mosaic moves element "
            f"widths of {'/'.join(map(str, mosaic.SUPPORTED_BITWIDTHS))} bits, and not bool); cast x first"
        )
    if dt == jnp.float16:
        return mosaic.refuse(
            f"{name}: Mosaic takes no float16 kernel arguments (bfloat16 and 32-bit types, and float8: "
            "libtpu 0.0.17 to 0.0.50 refuse float16 at every shape); cast x to bfloat16 or float32"
        )
    if len(shard_shape) < 2:
        return mosaic.refuse(
            f"{name}: a 1-D shard {shard_shape} on a TPU would put the ring's slot index on a tiled dim "
            "of the output buffer, where DMA windows must start on a tile boundary; give x a trailing dim "
            "that is a multiple of 128"
        )
    libtpu = tpu_compiler.libtpu_in_use()
    if libtpu >= ANY_2D_WINDOW:
        return None
    minor = shard_shape[-2:]
    if width == 32 and libtpu >= ROWS_FREE_FOR_32_BITS:
        if minor[-1] % 128:
            return mosaic.refuse(
                f"{name}: on a TPU (libtpu {'.'.join(map(str, libtpu))}) the shard's minor dim "
                f"{minor[-1]} must be a multiple of 128 lanes; pad x, or run it under interpret mode"
            )
        return None
    if not mosaic.tile_aligned(minor, dtype):
        need = " or ".join(str(tile) for tile in mosaic.tiles(minor, width))
        return mosaic.refuse(
            f"{name}: on a TPU the shard's two minor dims {minor} ({dt.name}) must fill "
            f"whole {need} tiles, the HBM layout Mosaic gives them; DMA windows that are not tile-aligned "
            "are refused by the TPU compiler. Pad x to whole tiles, or run it under interpret mode"
        )
    return None


def gathered_shards(
    shard: jax.Array,
    *,
    axis_name: str,
    mesh_axes: tuple[str, ...],
    interpret: Any,
    bidirectional: bool,
    name: str,
    in_flight: int | None = IN_FLIGHT,
) -> jax.Array:
    """Every device's ``shard`` in ring order, ``[n * m, ...]``, by the ring kernel: called on each
    device inside a ``shard_map`` over ``axis_name`` (``in_flight``: steps a link may have in flight, the
    size of each direction's semaphore arrays; ``None``: every step its own semaphores, which grow with
    the ring). Compiled for a TPU, it refuses what a chip cannot run (:func:`refuse_what_a_tpu_cannot_do`)."""
    n = lax.axis_size(axis_name)
    if not interpret:
        refuse_what_a_tpu_cannot_do(name, shard.shape, shard.dtype)
    if n == 1:  # a ring of one holds the whole array: nothing to move, no kernel to run
        return shard
    in_flight = max(1, min(in_flight or n - 1, n - 1))
    right_rows, left_rows = row_split(
        shard.shape, shard.dtype, bidirectional=bidirectional, for_tpu=not interpret
    )
    kernel = functools.partial(
        _ring_kernel,
        axis_name=axis_name,
        mesh_axes=mesh_axes,
        right_rows=right_rows,
        left_rows=left_rows,
        in_flight=in_flight,
    )
    gathered = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((n, *shard.shape), shard.dtype),
        in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
        out_specs=pl.BlockSpec(memory_space=pl.ANY),
        scratch_shapes=[
            pltpu.SemaphoreType.DMA((in_flight,)),  # send, rightward ring
            pltpu.SemaphoreType.DMA((in_flight,)),  # recv, rightward ring
            pltpu.SemaphoreType.DMA((in_flight,)),  # send, leftward ring
            pltpu.SemaphoreType.DMA((in_flight,)),  # recv, leftward ring
            pltpu.SemaphoreType.REGULAR,  # credits from the right neighbour (rightward ring)
            pltpu.SemaphoreType.REGULAR,  # credits from the left neighbour (leftward ring)
            pltpu.SemaphoreType.DMA,  # the local copy of the own shard
        ],
        compiler_params=pltpu.CompilerParams(collective_id=0),
        interpret=interpret,
    )(shard)
    return gathered.reshape(n * shard.shape[0], *shard.shape[1:])


def _all_gather(
    x: jax.Array,
    *,
    mesh: jax.sharding.Mesh,
    axis_name: str,
    interpret: Any,
    bidirectional: bool,
    name: str,
    in_flight: int | None = IN_FLIGHT,
) -> jax.Array:
    """The ring all-gather of ``x`` (:func:`gathered_shards` on each device)."""
    n = validate(name, x, mesh, axis_name)
    per_device = functools.partial(
        gathered_shards,
        axis_name=axis_name,
        mesh_axes=tuple(mesh.axis_names),
        interpret=interpret,
        bidirectional=bidirectional,
        name=name,
        in_flight=in_flight,
    )

    # check_vma=False: shard_map cannot see inside the kernel that its output is
    # replicated, so it is declared by out_specs=P() alone. Left to autodiff, that
    # would cost a defensive all-reduce in the backward; the custom_vjp below
    # sits *around* the shard_map so the backward is ours: a slice.
    gather = jax.shard_map(per_device, mesh=mesh, in_specs=P(axis_name), out_specs=P(), check_vma=False)

    @jax.custom_vjp
    def all_gather(x: jax.Array) -> jax.Array:
        return gather(x)

    def all_gather_fwd(x):
        return gather(x), None

    def all_gather_bwd(_, ct):
        return (_own_rows_of_cotangent(ct, mesh=mesh, axis_name=axis_name, n=n),)

    all_gather.defvjp(all_gather_fwd, all_gather_bwd)
    return all_gather(x)


def _own_rows_of_cotangent(ct: jax.Array, *, mesh: jax.sharding.Mesh, axis_name: str, n: int) -> jax.Array:
    """The all-gather's transpose for a replicated result: each device keeps its rows. No collective."""
    rows = ct.shape[0] // n

    def own_rows(ct_replicated: jax.Array) -> jax.Array:
        return lax.dynamic_slice_in_dim(ct_replicated, lax.axis_index(axis_name) * rows, rows)

    return jax.shard_map(own_rows, mesh=mesh, in_specs=P(), out_specs=P(axis_name))(ct)


@conformance.register(
    "all_gather",
    name="pallas_ring_all_gather_bidirectional",
    bidirectional=True,
    pallas=True,
    differentiable=True,
    description="Pallas remote-DMA ring, half of each shard each way, two steps in flight per link",
)
def pallas_ring_all_gather_bidirectional(
    x: jax.Array, *, mesh: jax.sharding.Mesh, axis_name: str, interpret: Any = False
) -> jax.Array:
    return _all_gather(
        x,
        mesh=mesh,
        axis_name=axis_name,
        interpret=interpret,
        bidirectional=True,
        name="pallas_ring_all_gather_bidirectional",
    )


@conformance.register(
    "all_gather",
    name="pallas_ring_all_gather_unidirectional",
    pallas=True,
    differentiable=True,
    description="Pallas remote-DMA ring in one direction, two steps in flight per link",
)
def pallas_ring_all_gather_unidirectional(
    x: jax.Array, *, mesh: jax.sharding.Mesh, axis_name: str, interpret: Any = False
) -> jax.Array:
    return _all_gather(
        x,
        mesh=mesh,
        axis_name=axis_name,
        interpret=interpret,
        bidirectional=False,
        name="pallas_ring_all_gather_unidirectional",
    )
