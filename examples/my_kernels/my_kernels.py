"""A complete collective matmul of one's own, checked by the suite: an all-gather matmul ring.

``lhs[M, K]`` is sharded by rows over ``axis_name`` and ``rhs[K, N]`` by columns; each device must
produce ``lhs @ rhs[:, its columns]``. The ring hands every row block of ``lhs`` round the devices
(``ppermute``, one hop per step) while multiplying the block in hand, so each transfer can hide
behind a matmul. Run from this folder (README, "Check your own kernel")::

    pytest --pyargs conformance -m cpu --kernels=my_kernels --impl='my_*' -n auto

Two things every ``shard_map`` ring author meets, both handled here:

* ``check_vma`` (on by default): inside ``shard_map`` every value is typed as varying or not over
  each mesh axis. A ``fori_loop`` carry that starts as ``jnp.zeros(...)`` (not varying) and becomes
  ``acc + received @ b`` (varying over the axis) changes type, and JAX raises a ``TypeError`` while
  tracing. Start the carry varying: ``jax.lax.pcast(zeros, axis_name, to="varying")`` (``pvary`` in
  older JAX), as ``compat_pcast`` below does.
* Overlap: each step sends the block in hand *before* multiplying it, so the transfer has a matmul
  to hide behind; a loop that multiplies what it just received makes every matmul wait.
* A ring of one device: ``n == 1`` has no hop to make; the loop below runs zero transfers and the
  one matmul, with no special case that could skip a cast.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

import conformance


def compat_pcast(x: jax.Array, axis_name: str) -> jax.Array:
    """``x`` typed as varying over ``axis_name``: ``lax.pcast(..., to="varying")`` in new JAX,
    ``lax.pvary`` in older, nothing to do where shard_map has no such types."""
    if hasattr(lax, "pcast"):
        return lax.pcast(x, axis_name, to="varying")
    if hasattr(lax, "pvary"):
        return lax.pvary(x, axis_name)
    return x


@conformance.register(
    "allgather_matmul",
    name="my_ring_allgather_matmul",
    dtypes=("float32", "bfloat16", "float16"),
    description="an example: ppermute ring, one block per step, float32 accumulation",
)
def my_ring_allgather_matmul(lhs: jax.Array, rhs: jax.Array, *, mesh: jax.sharding.Mesh, axis_name: str):
    n = mesh.shape[axis_name]
    if lhs.shape[0] % n or rhs.shape[1] % n:
        raise ValueError(
            f"my_ring_allgather_matmul: M={lhs.shape[0]} and N={rhs.shape[1]} must divide by the "
            f"{axis_name!r} axis size {n}"
        )

    def per_device(block: jax.Array, w: jax.Array) -> jax.Array:
        m, me = block.shape[0], lax.axis_index(axis_name)
        left = [(j, (j - 1) % n) for j in range(n)]  # device d receives from d + 1

        def multiply(held: jax.Array, s: int | jax.Array, out: jax.Array) -> jax.Array:
            owner = lax.rem(me + s, n)  # at step s the block in hand is device (me + s)'s
            product = jnp.dot(held, w, preferred_element_type=jnp.float32)
            return lax.dynamic_update_slice(out, product, (owner * m, 0))

        def step(s: int, carry: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
            held, out = carry
            incoming = lax.ppermute(held, axis_name, left)  # sent first: it travels while ...
            return incoming, multiply(held, s, out)  # ... the block in hand is multiplied

        # The carry starts varying over the axis, as the loop makes it (check_vma).
        out = compat_pcast(jnp.zeros((m * n, w.shape[1]), jnp.float32), axis_name)
        held, out = lax.fori_loop(0, n - 1, step, (block, out))
        return multiply(held, n - 1, out).astype(block.dtype)

    return jax.shard_map(
        per_device, mesh=mesh, in_specs=(P(axis_name, None), P(None, axis_name)), out_specs=P(None, axis_name)
    )(lhs, rhs)
