"""A ragged all-to-all as a Pallas TPU kernel of remote DMAs: each group moves once, straight into the
receiver's output.

Algorithm. Every device runs one kernel with its rows ``x[R, cols]``, its output buffer ``output[S,
cols]`` (aliased: rows no group writes keep the caller's values) and the four routing arrays in SMEM.

1. *Barrier.* Each device signals the barrier semaphore of every other device of the axis and waits
   for n - 1 signals, so no DMA reaches a device that has not entered the kernel (its output buffer
   and semaphores would not exist yet).
2. *Scatter.* For every peer ``j`` (itself included) it copies its group, ``send_sizes[j]`` rows from
   ``input_offsets[j]`` of ``x``, to ``output_offsets[j]`` of ``j``'s output (the sender says where:
   rule 2 of the family's contract). A DMA's size must be static, so a group of ``s`` rows is cut into
   the powers of two of ``s``'s binary digits, the largest first: at most ``log2(C) + 1`` DMAs for a
   group (``C = min(R, S)``, the largest group that fits), none for a group of zero rows.
3. *A semaphore per peer.* Group ``i -> j`` signals ``recv[i]`` on ``j``; ``j`` waits on ``recv[i]`` for
   ``recv_sizes[i]`` rows, cut the same way, so a wait is satisfied only by its sender's DMAs. The
   sender waits for each of its sends on ``send[j]``. Every signal is waited for: no semaphore keeps a
   count at exit, and no DMA is in flight into or out of a buffer once the kernel returns.

Sizes that are not transposes (``recv_sizes[i]`` on ``j`` unlike ``send_sizes[j]`` on ``i``) break
rule 3: a receiver waits for bytes nobody sends (it hangs, and the suite's time bound names where) or
returns before a DMA lands.

Gradient. ``jax.custom_vjp``: the backward is the transpose of the exchange, which
:mod:`.dense`'s collectives compute (a cotangent row goes back to the row of ``x`` it came from; the
rows of ``output`` no group wrote pass their cotangent through).

Rows of 16 and 8 bits travel as 32-bit words: a chip's DMA windows of narrower rows must start on a
packed pair or quadruple of rows, which arbitrary offsets do not, so the kernel never windows them.
Where a row's elements fill whole words (an even number of 16-bit ones, a multiple of four 8-bit ones)
each word packs 2 or 4 neighbouring elements of a row (a bitcast, no copy: the bytes moved are the
rows'); otherwise, and where the TPU compiler in use would refuse the packed row's width, each element
is widened to a word of its own bits (zero-extended, 2 or 4 times the bytes). Either way the bits come
back exactly: rows no group writes keep the caller's, bit for bit.

Limits. One mesh axis per call, the others replicated and addressed by their own coordinates.
``2n`` DMA semaphores and one barrier semaphore per device, which a TPU core's semaphore memory holds
for rings of up to :data:`MOST_PEERS` (it refuses longer ones on a TPU); a ring of one runs no kernel
(its one group is a local copy, :mod:`.dense`'s). On CPU it runs under TPU interpret mode.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

import conformance
from conformance.kernels._pallas import neighbour
from conformance.kernels.all_gather.pallas_ring import ANY_2D_WINDOW
from conformance.kernels.ragged_all_to_all._common import validate
from conformance.kernels.ragged_all_to_all.dense import dense_ragged_all_to_all, exchanged
from conformance.specs.ragged_all_to_all import RAGGED_ALL_TO_ALL
from conformance.targets import tpu_compiler

#: The longest ring it takes on a TPU: its 2n DMA semaphores live in the core's semaphore memory (sflag,
#: 2 KiB on v5e), 4 bytes each beside about 92 bytes of others. Compiled for v5e slices, 64 chips
#: compile and 256 are refused ("Ran out of memory in memory space sflag. Used 2.1K of 2.0K"): 8n + 92
#: bytes fit up to n = 244.
MOST_PEERS = 240

#: The row dtypes it moves: every one the family has, narrower ones as 32-bit words (module docstring).
DTYPES = RAGGED_ALL_TO_ALL.dtypes


@dataclasses.dataclass(frozen=True)
class Protocol:
    """Guards of the kernel's synchronisation (module docstring, points 1 and 3) that the self-tests
    take out or turn, one each, to watch the check meant for it fail."""

    #: The barrier before the first remote DMA.
    barrier: bool = True
    #: Every receive waited for before the kernel returns.
    wait_receives: bool = True
    #: The sizes a receiver waits for, per sender: ``recv_sizes`` (else ``send_sizes``, untransposed).
    receive_sizes_transposed: bool = True


SAFE = Protocol()


def _chunks(capacity: int) -> list[int]:
    """The DMA sizes a group of up to ``capacity`` rows is cut into, largest first."""
    return [1 << k for k in reversed(range(max(capacity, 1).bit_length()))]


def _kernel(
    input_offsets: Any,
    send_sizes: Any,
    output_offsets: Any,
    recv_sizes: Any,
    x_ref: Any,
    _output_in: Any,
    out_ref: Any,
    send_sems: Any,
    recv_sems: Any,
    *,
    n: int,
    capacity: int,
    axis_name: str,
    mesh_axes: tuple[str, ...],
    protocol: Protocol,
) -> None:
    me = lax.axis_index(axis_name)
    if protocol.barrier:  # 1. every peer has entered the kernel
        barrier = pltpu.get_barrier_semaphore()
        for j in range(n):

            @pl.when(me != j)
            def _(j=j):
                pl.semaphore_signal(barrier, 1, device_id=neighbour(mesh_axes, axis_name, jnp.int32(j)))

        pl.semaphore_wait(barrier, n - 1)

    def copy(j: Any, first: Any, at: Any, rows: int, *, sender: Any) -> Any:
        """The DMA of ``rows`` rows from ``first`` of ``x`` to ``at`` of device ``j``'s output."""
        return pltpu.make_async_remote_copy(
            x_ref.at[pl.ds(first, rows)],
            out_ref.at[pl.ds(at, rows)],
            send_sems.at[j],
            recv_sems.at[sender],
            device_id=neighbour(mesh_axes, axis_name, j),
        )

    def each_chunk(size: Any, then: Any) -> None:
        """``then(rows, skip)`` for each power of two of ``size``, ``skip`` the rows before it."""
        for rows in _chunks(capacity):

            @pl.when(size & rows != 0)
            def _(rows=rows):
                then(rows, size & ~(2 * rows - 1))

    # 2. each group to its peer, cut into powers of two; 3. then every send and receive waited for
    for j in range(n):
        first, at = input_offsets[j], output_offsets[j]
        each_chunk(
            send_sizes[j],
            lambda rows, skip, j=j, first=first, at=at: copy(
                jnp.int32(j), first + skip, at + skip, rows, sender=me
            ).start(),
        )
    for j in range(n):
        each_chunk(
            send_sizes[j], lambda rows, skip, j=j: copy(jnp.int32(j), 0, 0, rows, sender=me).wait_send()
        )
    incoming = recv_sizes if protocol.receive_sizes_transposed else send_sizes
    for i in range(n if protocol.wait_receives else 0):
        each_chunk(incoming[i], lambda rows, skip, i=i: copy(me, 0, 0, rows, sender=jnp.int32(i)).wait_recv())


def scattered(
    x: jax.Array,
    output: jax.Array,
    input_offsets: jax.Array,
    send_sizes: jax.Array,
    output_offsets: jax.Array,
    recv_sizes: jax.Array,
    *,
    axis_name: str,
    mesh_axes: tuple[str, ...],
    interpret: Any,
    protocol: Protocol = SAFE,
) -> jax.Array:
    """One device's part, by the kernel (module docstring; ``protocol``: the self-tests' knob)."""
    n = send_sizes.shape[0]
    if n == 1:  # a ring of one: its one group is a local copy, no kernel to run
        return exchanged(
            x, output, input_offsets, send_sizes, output_offsets, recv_sizes, axis_name=axis_name
        )
    packed = packs(x.shape[-1], x.dtype, interpret=interpret)
    rows_dtype, cols = x.dtype, x.shape[-1]
    x, output = as_words(x, packed=packed), as_words(output, packed=packed)
    if not interpret:
        refuse_what_a_tpu_cannot_do(x.shape, rows_dtype)
        if n > MOST_PEERS:
            conformance.refuse_on_tpu(
                f"pallas_dma_ragged_all_to_all: a ring of {n} needs {2 * n} DMA semaphores, past the TPU "
                f"core's semaphore memory (2 KiB on v5e: rings of up to {MOST_PEERS}); "
                "dense_ragged_all_to_all takes any"
            )
    any_space, smem = pl.BlockSpec(memory_space=pl.ANY), pl.BlockSpec(memory_space=pltpu.SMEM)
    kernel = functools.partial(
        _kernel,
        n=n,
        capacity=min(x.shape[0], output.shape[0]),
        axis_name=axis_name,
        mesh_axes=mesh_axes,
        protocol=protocol,
    )
    # the routing arrays as SMEM inputs, not scalar prefetch: JAX 0.6's interpreter indexes an alias
    # among the inputs that are not prefetched
    words = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(output.shape, output.dtype),
        in_specs=[smem] * 4 + [any_space, any_space],
        out_specs=any_space,
        scratch_shapes=[pltpu.SemaphoreType.DMA((n,)), pltpu.SemaphoreType.DMA((n,))],
        input_output_aliases={5: 0},
        compiler_params=pltpu.CompilerParams(collective_id=0),
        interpret=interpret,
    )(
        *(a.astype(jnp.int32) for a in (input_offsets, send_sizes, output_offsets, recv_sizes)),
        x,
        output,
    )
    return from_words(words, rows_dtype, packed=packed, cols=cols)


def packs(cols: int, dtype: Any, *, interpret: Any) -> bool:
    """Whether rows of ``cols`` elements of ``dtype`` travel packed, several to a 32-bit word (module
    docstring): they fill whole words, and the TPU compiler in use takes a window of the packed width."""
    per_word = 4 // jnp.dtype(dtype).itemsize
    if per_word == 1 or cols % per_word:
        return False
    return bool(interpret) or tpu_compiler.libtpu_in_use() >= ANY_2D_WINDOW or (cols // per_word) % 128 == 0


def as_words(rows: jax.Array, *, packed: bool) -> jax.Array:
    """``rows[R, cols]`` as 32-bit words: as they are (32-bit rows), packed (``[R, cols * itemsize / 4]``)
    or each element zero-extended (``[R, cols]``)."""
    width = rows.dtype.itemsize
    if width == 4:
        return rows
    bits = lax.bitcast_convert_type(rows, jnp.dtype(f"uint{8 * width}"))
    if packed:
        return lax.bitcast_convert_type(bits.reshape(rows.shape[0], -1, 4 // width), jnp.uint32)
    return bits.astype(jnp.uint32)


def from_words(words: jax.Array, dtype: Any, *, packed: bool, cols: int) -> jax.Array:
    """The rows of ``dtype`` that :func:`as_words` made ``words`` of, bit for bit."""
    width = jnp.dtype(dtype).itemsize
    if width == 4:
        return words
    unsigned = jnp.dtype(f"uint{8 * width}")
    bits = lax.bitcast_convert_type(words, unsigned).reshape(-1, cols) if packed else words.astype(unsigned)
    return lax.bitcast_convert_type(bits, dtype)


def refuse_what_a_tpu_cannot_do(shape: tuple[int, ...], dtype: Any) -> None:
    """``conformance.refuse_on_tpu`` naming the rule, for rows the TPU compiler of this JAX refuses to
    window (:data:`~conformance.kernels.all_gather.pallas_ring.ANY_2D_WINDOW`): before libtpu 0.0.42 a
    DMA window's lanes must be whole 128-lane tiles. Called only when the kernel is compiled for a TPU."""
    libtpu = tpu_compiler.libtpu_in_use()
    if libtpu < ANY_2D_WINDOW and shape[-1] % 128:
        conformance.refuse_on_tpu(
            f"pallas_dma_ragged_all_to_all: on a TPU (libtpu {'.'.join(map(str, libtpu))}) each row of "
            f"{shape[-1]} 32-bit words ({jnp.dtype(dtype).name} rows) must fill whole 128-lane tiles; "
            "pad the rows, or run it under interpret mode"
        )


def exchange(
    operands: tuple[jax.Array, ...],
    *,
    mesh: jax.sharding.Mesh,
    axis_name: str,
    interpret: Any,
    name: str,
    protocol: Protocol = SAFE,
) -> jax.Array:
    """The kernel on every device of the axis, its gradient the transpose (module docstring)."""
    validate(name, operands, mesh, axis_name)
    spec = jax.sharding.PartitionSpec(axis_name)
    per_device_kernel = functools.partial(
        scattered,
        axis_name=axis_name,
        mesh_axes=tuple(mesh.axis_names),
        interpret=interpret,
        protocol=protocol,
    )
    forward = jax.shard_map(
        per_device_kernel, mesh=mesh, in_specs=(spec,) * 6, out_specs=spec, check_vma=False
    )

    @jax.custom_vjp
    def ragged(x: jax.Array, output: jax.Array, *routing: jax.Array) -> jax.Array:
        return forward(x, output, *routing)

    def ragged_fwd(x: jax.Array, output: jax.Array, *routing: jax.Array) -> tuple[jax.Array, tuple]:
        return forward(x, output, *routing), (x, output, routing)

    def ragged_bwd(saved: tuple, ct: jax.Array) -> tuple:
        x, output, routing = saved
        transposed = lambda x, output: dense_ragged_all_to_all(
            x, output, *routing, mesh=mesh, axis_name=axis_name
        )
        _, pullback = jax.vjp(transposed, x, output)
        return (*pullback(ct), *(None for _ in routing))

    ragged.defvjp(ragged_fwd, ragged_bwd)
    return ragged(*operands)


@conformance.register(
    "ragged_all_to_all",
    name="pallas_dma_ragged_all_to_all",
    pallas=True,
    differentiable=True,
    dtypes=DTYPES,
    description="one remote DMA per power of two of each group, a barrier first, a semaphore per peer",
)
def pallas_dma_ragged_all_to_all(
    *operands: jax.Array, mesh: jax.sharding.Mesh, axis_name: str, interpret: Any = False
) -> jax.Array:
    return exchange(
        operands, mesh=mesh, axis_name=axis_name, interpret=interpret, name="pallas_dma_ragged_all_to_all"
    )
