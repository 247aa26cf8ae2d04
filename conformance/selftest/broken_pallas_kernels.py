"""Pallas ring all-gathers broken in one way each; the suite must reject every one.

One deliberately plain bidirectional ring with a knob per defect (the
production kernel, ``kernels/all_gather/pallas_ring.py``, carries no such
knobs). ``EXPECTED_REJECTION`` names the check meant to catch each, and
``EXPECTED_MESSAGE`` what its failure must say.
"""

from __future__ import annotations

import functools
import threading

import jax
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.sharding import PartitionSpec as P

import conformance
from conformance import compat
from conformance.kernels.all_gather.pallas_ring import (
    _all_gather,
    pallas_ring_all_gather_bidirectional,
    pallas_ring_all_gather_unidirectional,
)

EXPECTED_REJECTION: dict[str, str] = {
    "broken_pallas_seed_shared_semaphores": "test_races",
    "broken_pallas_drops_last_row_of_odd_shards": "test_values",
    "broken_pallas_skips_final_dma_wait": "test_races",
    "broken_pallas_dma_before_barrier_wait": "test_barrier_protocol",
    "broken_pallas_one_coordinate_device_id": "test_output_sharding",
    "broken_pallas_waits_for_missing_signal": "test_values",
    "broken_pallas_blocks_beyond_the_watchdog": "test_output_sharding",
    "broken_pallas_untiled_halves": "test_tpu_layout",
    "broken_pallas_leaves_barrier_count": "test_races",
    "broken_pallas_leaves_send_counts": "test_races",
    "broken_pallas_refuses_every_tpu_shape": "test_tpu_layout",
    "broken_pallas_refuses_what_the_compiler_compiles": "test_tpu_layout",
    "broken_pallas_semaphores_per_step": "test_tpu_pod",
    "broken_pallas_dma_slot_out_of_bounds": "test_values",
}
EXPECTED_MESSAGE: dict[str, str] = {
    "broken_pallas_waits_for_missing_signal": "did not finish within",
    # bounded: the worker process reports where its threads are stuck and is replaced
    "broken_pallas_blocks_beyond_the_watchdog": "beyond the watchdog's reach, in the kernel's own code",
    # the real compiler's refusal (libtpu 0.0.17: 'must be aligned to tiling (4)'; 0.0.42 and 0.0.50:
    # 'Slice sizes along tiled dimensions must be aligned to tiles'), quoted under this verdict line
    "broken_pallas_untiled_halves": "the TPU compiler refuses this shape",
    "broken_pallas_refuses_every_tpu_shape": "refuses the family's TPU-native shape",
    "broken_pallas_refuses_what_the_compiler_compiles": "refuses a shape the TPU compiler compiles",
    # libtpu 0.0.42: "RESOURCE_EXHAUSTED ... Ran out of memory in memory space sflag", quoted below it
    "broken_pallas_semaphores_per_step": "the TPU compiler refuses it on 256 chips",
    "broken_pallas_dma_before_barrier_wait": "before the kernel waits on its barrier semaphore",
    # where: JAX's interpreter raised, at the kernel's semaphore_signal naming a 1-coordinate peer
    "broken_pallas_one_coordinate_device_id": "broken_pallas_kernels.py:",
    "broken_pallas_skips_default_barrier": "skips the default device barrier",
    "broken_pallas_leaves_barrier_count": "barrier semaphore",
    "broken_pallas_leaves_send_counts": "nonzero count at kernel exit",
    # where: the DMA's own line in the kernel, though the interpreter raised it in a host callback
    "broken_pallas_dma_slot_out_of_bounds": "(the op TPU interpret mode was running",
}


#: Never set: a wait on it is one that no abort of interpret mode reaches.
_NEVER = threading.Event()


def _wait_forever() -> None:
    _NEVER.wait()


def _kernel(
    x_ref,
    o_ref,
    send_sems,
    recv_sems,
    copy_sem,
    *,
    axis_name,
    mesh_axes,
    shared_semaphores,
    floor_halves,
    final_wait,
    barrier,
    barrier_expect,
    ring_coordinate_only=False,
    blocks_in_callback=False,
    final_send_wait=True,
    farewell_signal=False,
    slot_unwrapped=False,
):
    n, me, rows = lax.axis_size(axis_name), lax.axis_index(axis_name), x_ref.shape[0]
    if blocks_in_callback:  # a host callback that never returns: below anything the watchdog can abort
        jax.debug.callback(_wait_forever)

    def at(i):
        if ring_coordinate_only:  # names the peer by its ring coordinate alone, wrong on a 2-D mesh
            return (i,)
        return tuple(i if a == axis_name else lax.axis_index(a) for a in mesh_axes)

    right, left = at(lax.rem(me + 1, n)), at(lax.rem(me + n - 1, n))
    own = pltpu.make_async_copy(x_ref, o_ref.at[me], copy_sem)
    own.start()
    own.wait()
    if barrier != "none":  # "before" the DMAs (correct) or "after" them
        sem = pltpu.get_barrier_semaphore()
        for peer in (left, right):
            pl.semaphore_signal(sem, 1, device_id=peer)
        if barrier == "before":
            pl.semaphore_wait(sem, barrier_expect)
    top = rows // 2 if floor_halves else (rows + 1) // 2
    bottom = rows // 2 if floor_halves else rows - top
    halves = [
        (0, top, right, lambda s: me - s + n if slot_unwrapped else lax.rem(me - s + n, n)),
        (top, bottom, left, lambda s: lax.rem(me + s, n)),
    ]
    last = [None, None]
    for step in range(n - 1):
        for d, (first, count, peer, slot) in enumerate(halves):
            if not count:
                continue
            if last[d] is not None:
                last[d].wait_recv()
                last[d].wait_send()
            k = 0 if shared_semaphores else step  # the seed reuses one semaphore per direction
            window = o_ref.at[slot(step), pl.ds(first, count)]
            last[d] = pltpu.make_async_remote_copy(
                window,
                window,
                send_sems.at[d, k],
                recv_sems.at[d, k],
                device_id=peer,
            )
            last[d].start()
    if final_wait:
        for dma in last:
            if dma is not None:
                dma.wait_recv()
                if final_send_wait:  # else the send semaphores keep their counts at exit
                    dma.wait_send()
    if barrier == "after":
        pl.semaphore_wait(sem, barrier_expect)
    if farewell_signal:  # one more barrier signal to the right, which nobody waits for
        pl.semaphore_signal(pltpu.get_barrier_semaphore(), 1, device_id=right)


def _broken_ring(x, *, mesh, axis_name, interpret=False, skip_device_barrier=False, **knobs):
    n = mesh.shape[axis_name]
    kernel = functools.partial(_kernel, axis_name=axis_name, mesh_axes=tuple(mesh.axis_names), **knobs)
    # Mosaic refuses a collective_id without a barrier semaphore, so a kernel without one drops it.
    params = {"collective_id": None if knobs["barrier"] == "none" else 0}
    if skip_device_barrier:
        params["skip_device_barrier"] = True

    def per_device(shard):
        out = pl.pallas_call(
            kernel,
            out_shape=jax.ShapeDtypeStruct((n, *shard.shape), shard.dtype),
            in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
            out_specs=pl.BlockSpec(memory_space=pl.ANY),
            scratch_shapes=[
                pltpu.SemaphoreType.DMA((2, n - 1)),
                pltpu.SemaphoreType.DMA((2, n - 1)),
                pltpu.SemaphoreType.DMA,
            ],
            compiler_params=pltpu.CompilerParams(**params),
            interpret=interpret,
        )(shard)
        return out.reshape(n * shard.shape[0], *shard.shape[1:])

    return jax.shard_map(per_device, mesh=mesh, in_specs=P(axis_name), out_specs=P(), check_vma=False)(x)


_CORRECT = dict(
    shared_semaphores=False, floor_halves=False, final_wait=True, barrier="before", barrier_expect=2
)


def _register(name: str, doc: str, **defect) -> None:
    def fn(x, *, mesh, axis_name, interpret=False):
        return _broken_ring(x, mesh=mesh, axis_name=axis_name, interpret=interpret, **{**_CORRECT, **defect})

    fn.__name__ = fn.__qualname__ = name
    fn.__doc__ = doc
    conformance.register("all_gather", name=name, pallas=True, description=doc)(fn)


_register(
    "broken_pallas_seed_shared_semaphores",
    "the seed kernel: one DMA semaphore per direction for every step, halves of m // 2",
    shared_semaphores=True,
    floor_halves=True,
)
_register(
    "broken_pallas_drops_last_row_of_odd_shards",
    "halves of m // 2 rows each way: an odd shard's last row is never sent",
    floor_halves=True,
)
_register(
    "broken_pallas_skips_final_dma_wait", "returns without waiting for the last step's DMAs", final_wait=False
)
_register(
    "broken_pallas_dma_before_barrier_wait",
    "takes a barrier semaphore (so gets no default barrier) but starts its remote DMAs before "
    "waiting on it: a neighbour may not be in the kernel yet",
    barrier="after",
)
if compat.has_skip_device_barrier():  # JAX 0.7.1 and later
    _register(
        "broken_pallas_skips_default_barrier",
        "skip_device_barrier=True and no barrier of its own: remote DMAs with no barrier at all",
        barrier="none",
        skip_device_barrier=True,
    )
    EXPECTED_REJECTION["broken_pallas_skips_default_barrier"] = "test_barrier_protocol"
_register(
    "broken_pallas_waits_for_missing_signal",
    "waits for three barrier signals when only two neighbours send one",
    barrier_expect=3,
)
_register(
    "broken_pallas_blocks_beyond_the_watchdog",
    "a host callback in the kernel body that never returns: the watchdog's abort cannot reach "
    "it (as JAX 0.10.2's interpreter deadlocked in _allocate_buffer on 8 devices of a 2-core host)",
    blocks_in_callback=True,
)
_register(
    "broken_pallas_one_coordinate_device_id",
    "names its ring neighbour by the ring coordinate alone: right on a 1-D mesh, an error inside "
    "JAX's interpreter on a 2-D one",
    ring_coordinate_only=True,
)
_register(
    "broken_pallas_leaves_barrier_count",
    "signals its right neighbour's barrier semaphore once more after the ring, and nobody waits "
    "for it: exact and race-free, but on a chip the next call's barrier passes at once",
    farewell_signal=True,
)
_register(
    "broken_pallas_leaves_send_counts",
    "waits for its last DMAs to arrive but not for them to be sent: exact and race-free here, "
    "but its send semaphores keep their counts and a chip's kernel may return mid-DMA",
    final_send_wait=False,
)
_register(
    "broken_pallas_dma_slot_out_of_bounds",
    "forgets the `% n` on the rightward half's slot: a DMA window past the output's last block on "
    "every device at or ahead of the step",
    slot_unwrapped=True,
)
_register(
    "broken_pallas_untiled_halves",
    "a correct ring that ignores TPU tiling: ceil/floor halves of every shard, no refusal; "
    "exact under interpret mode, refused by a TPU's compiler",
)


@conformance.register(
    "all_gather",
    name="broken_pallas_blocks_while_tracing",
    pallas=True,
    description="blocks forever while being traced, before any kernel runs: only the check's bound ends it",
)
def broken_pallas_blocks_while_tracing(x, *, mesh, axis_name, interpret=False):
    _wait_forever()


@conformance.register(
    "all_gather",
    name="broken_pallas_refuses_every_tpu_shape",
    pallas=True,
    description="refuses every shape when compiled for a TPU, tile-aligned ones too",
)
def broken_pallas_refuses_every_tpu_shape(x, *, mesh, axis_name, interpret=False):
    if not interpret:
        raise conformance.TpuConstraintError(
            "broken_pallas_refuses_every_tpu_shape: no TPU shape is supported"
        )
    return pallas_ring_all_gather_bidirectional(x, mesh=mesh, axis_name=axis_name, interpret=interpret)


@conformance.register(
    "all_gather",
    name="broken_pallas_refuses_what_the_compiler_compiles",
    pallas=True,
    description="the built-in one-way ring, but refusing (through conformance.refuse_on_tpu) every shard "
    "of rows not a multiple of 16: 8 rows of float32, whole (8, 128) tiles, compile on every libtpu",
)
def broken_pallas_refuses_what_the_compiler_compiles(x, *, mesh, axis_name, interpret=False):
    rows = x.shape[0] // mesh.shape[axis_name]
    if not interpret and rows % 16:
        conformance.refuse_on_tpu(
            f"broken_pallas_refuses_what_the_compiler_compiles: {rows} rows per shard, not a multiple of 16"
        )
    return pallas_ring_all_gather_unidirectional(x, mesh=mesh, axis_name=axis_name, interpret=interpret)


@conformance.register(
    "all_gather",
    name="broken_pallas_semaphores_per_step",
    pallas=True,
    description="the built-in two-way ring with a receive and a send semaphore per ring step and direction "
    "(4(n-1)+1 DMA semaphores, the suite's own earlier design): race-free, and more semaphores than a "
    "TPU core has on a ring of 256",
)
def broken_pallas_semaphores_per_step(x, *, mesh, axis_name, interpret=False):
    return _all_gather(
        x,
        mesh=mesh,
        axis_name=axis_name,
        interpret=interpret,
        bidirectional=True,
        name="broken_pallas_semaphores_per_step",
        in_flight=None,
    )
