"""Kernels that break only in a multi-process job. Loaded with ``--kernels`` under
``python -m conformance launch`` by ``test_multiprocess.py``; each fault must end the job
cleanly, naming the rank and the test, in bounded time.

- ``broken_mp_traces_per_rank``: Python that branches on ``jax.process_index()`` while
  tracing, so rank 1 traces another program: every rank fails naming the mismatch.
- ``broken_mp_dies_in_kernel``: rank 1's process exits (``os._exit``) inside the kernel.
- ``broken_mp_hangs_in_kernel``: rank 1 never finishes the kernel; rank 0 waits for it in a
  collective until the launcher's timeout.
- ``broken_mp_reads_nonaddressable``: ``np.asarray`` of the global input outside ``jit``,
  which no rank can do in a multi-process job: it fails naming the call.
- ``broken_mp_logs_checksum_eagerly``: called outside ``jit`` it logs a checksum of its global
  input (``np.asarray``): right in one process, an error in a job, where the input is not fully
  addressable; the eager check must fail it on every rank (under ``jit`` it is right everywhere).
- ``broken_mp_claims_per_rank`` (send_recv): its ``supports`` reads ``jax.process_index()``,
  so rank 1 skips the case as not claimed while rank 0 runs it; rank 0 must not wait for rank
  1's verdict of the check, which never comes (a rank that raised where it holds no shard, on
  JAX 0.6.2, once left the job waiting this way for 10 minutes): the test fails on both.
"""

from __future__ import annotations

import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

import conformance
from conformance.kernels.allgather_matmul import ring


def _gather_then_multiply(lhs, rhs, *, mesh, axis_name, scale=1.0):
    def body(lhs_block, rhs_block):
        full = lax.all_gather(lhs_block, axis_name, tiled=True)
        out = jnp.dot(full, rhs_block, preferred_element_type=jnp.float32) * scale
        return out.astype(lhs_block.dtype)

    return jax.shard_map(
        body, mesh=mesh, in_specs=(P(axis_name, None), P(None, axis_name)), out_specs=P(None, axis_name)
    )(lhs, rhs)


@conformance.register("allgather_matmul", name="broken_mp_traces_per_rank")
def broken_mp_traces_per_rank(lhs, rhs, *, mesh, axis_name):
    scale = 2.0 if jax.process_index() == 1 else 1.0  # per-process state read while tracing
    return _gather_then_multiply(lhs, rhs, mesh=mesh, axis_name=axis_name, scale=scale)


def _on_rank_one(action):
    def callback(x):
        if jax.process_index() == 1:
            action()
        return x

    return callback


def _with_callback(lhs, rhs, *, mesh, axis_name, action):
    def body(lhs_block, rhs_block):
        lhs_block = jax.pure_callback(_on_rank_one(action), lhs_block, lhs_block)
        full = lax.all_gather(lhs_block, axis_name, tiled=True)
        return jnp.dot(full, rhs_block, preferred_element_type=jnp.float32).astype(lhs_block.dtype)

    return jax.shard_map(
        body, mesh=mesh, in_specs=(P(axis_name, None), P(None, axis_name)), out_specs=P(None, axis_name)
    )(lhs, rhs)


@conformance.register("allgather_matmul", name="broken_mp_dies_in_kernel")
def broken_mp_dies_in_kernel(lhs, rhs, *, mesh, axis_name):
    return _with_callback(lhs, rhs, mesh=mesh, axis_name=axis_name, action=lambda: os._exit(17))


@conformance.register("allgather_matmul", name="broken_mp_hangs_in_kernel")
def broken_mp_hangs_in_kernel(lhs, rhs, *, mesh, axis_name):
    return _with_callback(lhs, rhs, mesh=mesh, axis_name=axis_name, action=lambda: time.sleep(3600))


@conformance.register("allgather_matmul", name="broken_mp_reads_nonaddressable")
def broken_mp_reads_nonaddressable(lhs, rhs, *, mesh, axis_name):
    if np.asarray(lhs).size == 0:  # reads every shard, including other processes' ones
        raise ValueError("empty lhs")
    return _gather_then_multiply(lhs, rhs, mesh=mesh, axis_name=axis_name)


#: Checksums the eager kernel logged (in one process, where it works).
CHECKSUMS: list[float] = []


@conformance.register("allgather_matmul", name="broken_mp_logs_checksum_eagerly")
def broken_mp_logs_checksum_eagerly(lhs, rhs, *, mesh, axis_name):
    if not isinstance(lhs, jax.core.Tracer):  # concrete arrays: called outside jit
        CHECKSUMS.append(float(np.asarray(lhs, np.float64).sum()))  # every shard, other processes' too
    return ring.ring_allgather_matmul_bidirectional(lhs, rhs, mesh=mesh, axis_name=axis_name)


def _claimed_on_rank_zero_only(**_) -> str | None:
    return None if jax.process_index() == 0 else "not on this process"  # per-process state


@conformance.register("send_recv", name="broken_mp_claims_per_rank", supports=_claimed_on_rank_zero_only)
def broken_mp_claims_per_rank(x, *, dst):
    return jax.device_put(x, dst)  # the cases run inside process 0
