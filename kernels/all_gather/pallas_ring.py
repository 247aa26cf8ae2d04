"""Ring all-gather as a Pallas TPU kernel of remote DMAs, race-free under any DMA order.

Algorithm. ``x`` is sharded by rows over a ring of n devices. Each device first
copies its own shard into slot ``me`` of its output ``o[n, m, ...]``. Then, for
n - 1 steps, it forwards the slot it received last step to its neighbour, so
after step s device d holds the shards of d, d-1, ..., d-s. The bidirectional
ring cuts every shard in two, sends the top ``ceil(m/2)`` rows rightwards
(d -> d+1) and the bottom ``floor(m/2)`` rows leftwards (d -> d-1), so both
directions of every link carry data at once. An odd m is exact: the halves are
``ceil`` and ``floor``, never ``m // 2`` twice (which drops the last row); with
m == 1 the bottom half is empty and only the rightward ring runs.

Synchronisation, and why it is race-free:

1. *Barrier before the first remote DMA.* Each device signals the barrier
   semaphore of both neighbours and waits for two signals, so no DMA targets a
   device that has not yet entered the kernel (its output buffer and
   semaphores would not exist yet).
2. *One receive semaphore per ring step and direction.* The DMA of step s
   signals ``recv[s]`` on its target. A device forwards at step s the slot it
   received at step s-1 only after waiting on ``recv[s-1]``. A DMA semaphore
   wait is a byte count, so with a single semaphore reused for every step (the
   seed kernel's design) a neighbour running one step ahead can satisfy the
   wait for step s-1 with the bytes of step s, and the device forwards a slot
   that has not arrived. With a semaphore per step, only the step-(s-1)
   transfer can signal ``recv[s-1]``: a neighbour running ahead signals a
   different semaphore. TPU interpret mode's ``dma_execution_mode="on_wait"``,
   which runs DMAs as late and out of order as the waits allow, is the test.
3. *Each slot is written once.* Device d receives slots d-1, ..., d-(n-1) in
   one direction, never its own and never twice, so no write-after-read or
   write-after-write hazard exists on the output buffer.
4. *Every DMA is waited before exit.* Each device waits for all its sends
   (``send[s]``) and for the last receive of each direction, so no transfer is
   in flight into or out of a buffer after the kernel returns.

Gradient. ``jax.custom_vjp`` around the ``shard_map``: the transpose of a
replicated all-gather is a slice of the cotangent (no collective). The
``custom_vjp`` is outside rather than inside the ``shard_map`` because inside it
would need ``check_vma=True``, and JAX's TPU interpret mode (0.10.2) cannot run
this kernel then: ``axis_index`` in the kernel body is typed as varying and
mixing it with constants fails ("Primitive add requires varying manual axes to
match"), although lowering for a TPU works. README, "Backward passes without
defensive all-reduces", gives both recipes.

Limits. One mesh axis per call; the other axes of a 2-D mesh are replicated and
addressed by their own coordinates. Input and output stay in HBM (``pl.ANY``)
and are touched only by DMAs, so the kernel sets no VMEM tiling constraint of
its own; it uses 4(n-1) + 1 DMA semaphores and one barrier semaphore
(``collective_id=0``). On CPU it runs under TPU interpret mode; its behaviour
on TPU chips is covered by ``pytest -m tpu`` (lowering is checked from CPU).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.sharding import PartitionSpec as P

import conformance
from kernels.all_gather._common import validate


def _neighbour(mesh_axes: tuple[str, ...], axis_name: str, index: jax.Array) -> tuple[jax.Array, ...]:
    """Mesh coordinates of the device at ``index`` along ``axis_name``, same elsewhere."""
    return tuple(index if a == axis_name else lax.axis_index(a) for a in mesh_axes)


def _ring_kernel(
    x_ref: Any,
    o_ref: Any,
    send_right: Any,
    recv_right: Any,
    send_left: Any,
    recv_left: Any,
    copy_sem: Any,
    *,
    axis_name: str,
    mesh_axes: tuple[str, ...],
    bidirectional: bool,
) -> None:
    n = lax.axis_size(axis_name)
    me = lax.axis_index(axis_name)
    rows = x_ref.shape[0]
    right_rows = (rows + 1) // 2 if bidirectional else rows  # ceil: top half
    left_rows = rows - right_rows  # floor: bottom half (0 when unidirectional or rows == 1)
    right = _neighbour(mesh_axes, axis_name, lax.rem(me + 1, n))
    left = _neighbour(mesh_axes, axis_name, lax.rem(me + n - 1, n))

    with jax.named_scope("own_shard"):
        own = pltpu.make_async_copy(x_ref, o_ref.at[me], copy_sem)
        own.start()
        own.wait()

    with jax.named_scope("barrier"):
        # Neighbours must be inside the kernel before we DMA into their buffers.
        barrier = pltpu.get_barrier_semaphore()
        for peer in (left, right):
            pl.semaphore_signal(barrier, 1, device_id=peer, device_id_type=pl.DeviceIdType.MESH)
        pl.semaphore_wait(barrier, 2)

    def send(step: int, slot: jax.Array, first: int, count: int, peer, send_sems, recv_sems):
        window = o_ref.at[slot, pl.ds(first, count)]
        dma = pltpu.make_async_remote_copy(
            window,
            window,
            send_sems.at[step],  # signalled here when the data has left
            recv_sems.at[step],  # signalled on `peer` when it has arrived: this step's only
            device_id=peer,
            device_id_type=pl.DeviceIdType.MESH,
        )
        dma.start()
        return dma

    sent = []
    for step in range(n - 1):
        with jax.named_scope(f"ring_step_{step}"):
            if step > 0:
                # Forward only what has arrived: wait on *last* step's semaphore,
                # which no other transfer can signal.
                sent[-1][0].wait_recv()
                if left_rows:
                    sent[-1][1].wait_recv()
            to_right = send(step, lax.rem(me - step + n, n), 0, right_rows, right, send_right, recv_right)
            to_left = None
            if left_rows:
                to_left = send(step, lax.rem(me + step, n), right_rows, left_rows, left, send_left, recv_left)
            sent.append((to_right, to_left))

    with jax.named_scope("drain"):
        last_right, last_left = sent[-1]
        last_right.wait_recv()
        if last_left is not None:
            last_left.wait_recv()
        for to_right, to_left in sent:
            to_right.wait_send()
            if to_left is not None:
                to_left.wait_send()


def _all_gather(
    x: jax.Array, *, mesh: jax.sharding.Mesh, axis_name: str, interpret: Any, bidirectional: bool, name: str
) -> jax.Array:
    n = validate(name, x, mesh, axis_name)
    if n == 1:
        return x
    steps = n - 1
    kernel = functools.partial(
        _ring_kernel, axis_name=axis_name, mesh_axes=tuple(mesh.axis_names), bidirectional=bidirectional
    )

    def per_device(shard: jax.Array) -> jax.Array:
        gathered = pl.pallas_call(
            kernel,
            out_shape=jax.ShapeDtypeStruct((n, *shard.shape), shard.dtype),
            in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
            out_specs=pl.BlockSpec(memory_space=pl.ANY),
            scratch_shapes=[
                pltpu.SemaphoreType.DMA((steps,)),  # send, rightward ring
                pltpu.SemaphoreType.DMA((steps,)),  # recv, rightward ring
                pltpu.SemaphoreType.DMA((steps,)),  # send, leftward ring
                pltpu.SemaphoreType.DMA((steps,)),  # recv, leftward ring
                pltpu.SemaphoreType.DMA,  # the local copy of the own shard
            ],
            compiler_params=pltpu.CompilerParams(collective_id=0),
            interpret=interpret,
        )(shard)
        return gathered.reshape(n * shard.shape[0], *shard.shape[1:])

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
    pallas=True,
    differentiable=True,
    description="Pallas remote-DMA ring, half of each shard each way, a semaphore per step",
)
def pallas_ring_all_gather_bidirectional(
    x: jax.Array, *, mesh: jax.sharding.Mesh, axis_name: str, interpret: Any = False
) -> jax.Array:
    return _all_gather(x, mesh=mesh, axis_name=axis_name, interpret=interpret, bidirectional=True,
                       name="pallas_ring_all_gather_bidirectional")  # fmt: skip


@conformance.register(
    "all_gather",
    name="pallas_ring_all_gather_unidirectional",
    pallas=True,
    differentiable=True,
    description="Pallas remote-DMA ring in one direction, a semaphore per step",
)
def pallas_ring_all_gather_unidirectional(
    x: jax.Array, *, mesh: jax.sharding.Mesh, axis_name: str, interpret: Any = False
) -> jax.Array:
    return _all_gather(x, mesh=mesh, axis_name=axis_name, interpret=interpret, bidirectional=False,
                       name="pallas_ring_all_gather_unidirectional")  # fmt: skip
