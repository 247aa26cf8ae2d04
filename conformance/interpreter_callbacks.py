"""TPU interpret mode's own callbacks, handed XLA's host arrays as they are (:func:`on_host`).

Not a spelling difference (:mod:`conformance.compat`): the same path in JAX 0.6.2 to 0.12, and the cost
of every Pallas kernel's run on CPU (docs/timings.md, "What an interpreted run costs").
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
from collections.abc import Iterator
from typing import Any

import jax
import numpy as np

#: Guards the swap of JAX's callback path; the count of blocks inside lives on the replacement.
_LOCK = threading.Lock()


def _interpreter_function(callback: Any) -> bool:
    """Whether a compiled ``io_callback``'s function is one of TPU interpret mode's own (its memory,
    DMA and semaphore operations), seen through ``functools.partial`` and ``functools.wraps``."""
    fn = getattr(callback, "callback_func", None)
    while fn is not None:
        if isinstance(fn, functools.partial):
            fn = fn.func
        elif hasattr(fn, "__wrapped__"):
            fn = fn.__wrapped__
        else:
            break
    return getattr(fn, "__module__", "").startswith("jax._src.pallas.mosaic.interpret")


def _kernel_line(callback: Any) -> str | None:
    """The kernel's line of the op an interpreter callback runs (the interpreter binds each op's
    ``source_info`` to its callback), ``None`` where it has none."""
    from jax._src import source_info_util

    fn = getattr(callback, "callback_func", None)
    while fn is not None:
        if isinstance(fn, functools.partial):
            if fn.keywords.get("source_info") is not None:
                return source_info_util.summarize(fn.keywords["source_info"])
            fn = fn.func
        else:
            fn = getattr(fn, "__wrapped__", None)
    return None


@contextlib.contextmanager
def on_host() -> Iterator[list[tuple[str | None, str]]]:
    """Within the block, TPU interpret mode's own callbacks take their operands as the host arrays
    XLA hands them, not first copied onto a JAX CPU device. Yields the list of where such a callback
    raised in the block, each the kernel's line of its op and the error: a DMA's error reaches the
    caller as XLA's, raised where the result is waited for, with no frame of the kernel.

    Interpret mode runs every load, store, DMA and semaphore operation of a kernel as an
    ``io_callback`` on each simulated device. For each call, JAX's ``io_callback_impl`` (0.6.2 to
    0.12 alike) ``device_put``s every operand (numpy arrays from XLA) onto the CPU device, and the
    interpreter then reads each back with ``int()`` or ``np.array()``: about 1.4 ms a call here,
    most of a kernel's run (2472 calls, 3.5 s for the HBM reduce-scatter on 8 devices). Its own
    functions take the numpy arrays as they are (the same values, read the same way), and the run
    takes 0.6 s with the same result bit for bit. Any other callback, a kernel author's own
    ``io_callback`` included, still goes through JAX's path. The functions are JAX's interpreter,
    unchanged; only the copy around them is skipped."""
    from jax._src import callback as callback_module

    with _LOCK:  # the count of blocks inside lives on the replacement itself
        on_host = callback_module.io_callback_impl
        if not hasattr(on_host, "blocks_inside"):
            original = on_host

            def on_host(*args: Any, callback: Any, **params: Any) -> Any:
                if not _interpreter_function(callback):
                    return original(*args, callback=callback, **params)
                try:
                    return jax.tree_util.tree_map(np.asarray, callback(*args))
                except BaseException as error:  # as JAX's own path logs it; and where in the kernel
                    logging.getLogger(callback_module.__name__).exception("jax.io_callback failed")
                    raised = (_kernel_line(callback), f"{type(error).__name__}: {error}")
                    for listener in list(on_host.listeners):  # type: ignore[attr-defined]
                        listener.append(raised)
                    raise

            on_host.original, on_host.blocks_inside = original, 0  # type: ignore[attr-defined]
            on_host.listeners = []  # type: ignore[attr-defined]
            on_host.undo_zero_waits = _zero_waits_return()  # type: ignore[attr-defined]
            callback_module.io_callback_impl = on_host
        on_host.blocks_inside += 1  # type: ignore[attr-defined]
        raised_at: list[tuple[str | None, str]] = []
        on_host.listeners.append(raised_at)  # type: ignore[attr-defined]
    try:
        yield raised_at
    finally:
        with _LOCK:
            on_host.listeners.remove(raised_at)  # type: ignore[attr-defined]
            on_host.blocks_inside -= 1  # type: ignore[attr-defined]
            if on_host.blocks_inside == 0:  # type: ignore[attr-defined]
                callback_module.io_callback_impl = on_host.original  # type: ignore[attr-defined]
                on_host.undo_zero_waits()  # type: ignore[attr-defined]


def _semaphore_class() -> Any:
    """The interpreter's semaphore (``interpret/shared_memory.py`` from JAX 0.7, ``interpret.py`` in 0.6)."""
    import importlib

    for module in ("jax._src.pallas.mosaic.interpret.shared_memory", "jax._src.pallas.mosaic.interpret"):
        try:
            cls = getattr(importlib.import_module(module), "Semaphore", None)
        except ImportError:
            continue
        if cls is not None and hasattr(cls, "wait"):
            return cls
    return None


def _zero_waits_return() -> Any:
    """Within :func:`on_host`, a semaphore wait for a count of 0 returns at once, as it does on a chip.

    With ``detect_races=True`` JAX's interpreter (0.6.2 to 0.12) asserts on such a wait (``self.clocks
    [global_core_id] is not None``: no signal ever set the semaphore's clock), and the failure leaves
    the interpreter's shared state broken for every later call in the process. A kernel that waits
    for each peer's rows waits for 0 on a routing where a peer sends it nothing (a ragged all-to-all's
    group of zero rows), so the race detector could not run there. A wait for 0 orders nothing (no
    signal happens before it), so returning at once loses no race the detector could find. Returns
    the undo."""
    cls = _semaphore_class()
    if cls is None:
        return lambda: None
    original = cls.wait

    @functools.wraps(original)
    def wait(self: Any, value: Any, *args: Any, **kwargs: Any) -> Any:
        if int(value) == 0:
            return None
        return original(self, value, *args, **kwargs)

    cls.wait = wait

    def undo() -> None:
        cls.wait = original

    return undo
