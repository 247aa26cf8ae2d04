"""Static checks of a Pallas TPU kernel's synchronisation protocol, read off its jaxpr.

Some defects never show in TPU interpret mode. The interpreter starts every
device's kernel together, so a kernel that sends a remote DMA before the
barrier (before it knows the neighbour has entered the kernel and allocated
the semaphores and buffers the DMA targets) runs correctly on CPU, every time.
On chips, the neighbour may still be in the previous kernel. That rule is
checked here, in program order, on the traced kernel body.

Which barrier a kernel has: a kernel that sets no ``collective_id`` and takes
no barrier semaphore of its own gets a device barrier before it starts, put
there by JAX/Mosaic ("By default, if you do not specify a barrier semaphore,
Pallas will automatically insert a barrier semaphore at the beginning of your
program", JAX's Pallas TPU distributed guide). That holds on every JAX the
suite supports: JAX 0.6.2's TPU interpreter already models it (a global
barrier before a kernel whose ``collective_id`` is None), and from JAX 0.7.1
``CompilerParams(skip_device_barrier=True)`` turns it off. So a remote DMA is
unprotected only in a kernel that has a barrier of its own (``collective_id``
set, or ``get_barrier_semaphore`` called) and starts it before waiting on
that barrier, or in one that skips the default barrier and has none.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import jax
from jax._src import source_info_util

from conformance import compat


def _sub_jaxprs(eqn: Any) -> Iterator[Any]:
    for param in eqn.params.values():
        for value in param if isinstance(param, (list, tuple)) else (param,):
            if hasattr(value, "eqns"):
                yield value
            elif hasattr(getattr(value, "jaxpr", None), "eqns"):
                yield value.jaxpr


@dataclasses.dataclass(frozen=True)
class PallasKernel:
    """One ``pallas_call`` of a traced function: its body and its TPU compiler params."""

    body: Any
    compiler_params: Any | None

    @property
    def collective_id(self) -> int | None:
        return getattr(self.compiler_params, "collective_id", None)

    @property
    def skips_device_barrier(self) -> bool:
        return bool(getattr(self.compiler_params, "skip_device_barrier", False))


def pallas_kernels(jaxpr: Any) -> list[PallasKernel]:
    """Every ``pallas_call`` in ``jaxpr`` (recursively)."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            body = eqn.params["jaxpr"]
            found.append(
                PallasKernel(getattr(body, "jaxpr", body), compat.pallas_tpu_compiler_params(eqn.params))
            )
        else:
            for sub in _sub_jaxprs(eqn):
                found += pallas_kernels(sub)
    return found


def _walk(jaxpr: Any) -> Iterator[Any]:
    """Equations in program order, descending into loops and branches."""
    for eqn in jaxpr.eqns:
        yield eqn
        for sub in _sub_jaxprs(eqn):
            yield from _walk(sub)


def _is_remote_dma(eqn: Any) -> bool:
    if eqn.primitive.name != "dma_start":
        return False
    args = jax.tree_util.tree_unflatten(eqn.params["tree"], eqn.invars)
    return args[-1] is not None  # the device id; None for a local copy


@dataclasses.dataclass(frozen=True)
class ProtocolViolation:
    rule: str
    where: str


def remote_dma_before_barrier(kernel: PallasKernel) -> ProtocolViolation | None:
    """The first remote DMA that no barrier protects, if any (see the module docstring)."""
    eqns = list(_walk(kernel.body))
    own_barrier = kernel.collective_id is not None or any(
        eqn.primitive.name == "get_barrier_semaphore" for eqn in eqns
    )
    if not own_barrier and not kernel.skips_device_barrier:
        return None  # the default device barrier runs before the kernel
    barriers: set[Any] = set()
    waited = False
    for eqn in eqns:
        name = eqn.primitive.name
        if name == "get_barrier_semaphore":
            barriers.update(eqn.outvars)
        elif name == "semaphore_wait" and eqn.invars and eqn.invars[0] in barriers:
            waited = True
        elif _is_remote_dma(eqn) and not waited:
            rule = (
                "a remote DMA starts before the kernel waits on its barrier semaphore (a kernel with a "
                "barrier of its own gets no default device barrier)"
                if own_barrier
                else "a remote DMA starts in a kernel that skips the default device barrier "
                "(skip_device_barrier=True) and has no barrier of its own"
            )
            return ProtocolViolation(rule, source_info_util.summarize(eqn.source_info))
    return None


def violations(fn: Any, args: tuple[Any, ...]) -> list[ProtocolViolation]:
    """Protocol violations in every Pallas kernel ``fn`` calls on ``args`` (traced, not run)."""
    closed = jax.make_jaxpr(fn)(*args)
    found = []
    for kernel in pallas_kernels(closed.jaxpr):
        violation = remote_dma_before_barrier(kernel)
        if violation:
            found.append(violation)
    return found
