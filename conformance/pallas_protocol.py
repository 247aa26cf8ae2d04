"""Static checks of a Pallas TPU kernel's synchronisation protocol, read off its jaxpr.

Some defects never show in TPU interpret mode. The interpreter starts every
device's kernel together, so a kernel that sends a remote DMA before the
barrier (before it knows the neighbour has entered the kernel and allocated
the semaphores and buffers the DMA targets) runs correctly on CPU, every time.
On chips, the neighbour may still be in the previous kernel. That rule is
checked here, in program order, on the traced kernel body.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import jax
from jax._src import source_info_util


def _sub_jaxprs(eqn: Any) -> Iterator[Any]:
    for param in eqn.params.values():
        for value in param if isinstance(param, (list, tuple)) else (param,):
            if hasattr(value, "eqns"):
                yield value
            elif hasattr(getattr(value, "jaxpr", None), "eqns"):
                yield value.jaxpr


def pallas_kernels(jaxpr: Any) -> list[Any]:
    """Kernel bodies of every ``pallas_call`` in ``jaxpr`` (recursively)."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            kernel = eqn.params["jaxpr"]
            found.append(getattr(kernel, "jaxpr", kernel))
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


def remote_dma_before_barrier(kernel: Any) -> ProtocolViolation | None:
    """The first remote DMA started before any wait on the barrier semaphore, if any."""
    barriers: set[Any] = set()
    waited = False
    for eqn in _walk(kernel):
        name = eqn.primitive.name
        if name == "get_barrier_semaphore":
            barriers.update(eqn.outvars)
        elif name == "semaphore_wait" and eqn.invars and eqn.invars[0] in barriers:
            waited = True
        elif _is_remote_dma(eqn) and not waited:
            return ProtocolViolation(
                "a remote DMA starts before the kernel waits on its barrier semaphore",
                source_info_util.summarize(eqn.source_info),
            )
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
