"""How the suite calls a Pallas TPU kernel interpreted on CPU: with ``interpret=`` where the kernel
takes it, else with TPU interpret mode forced while it runs (kernels written as JAX's Pallas TPU
tutorial writes them take no such keyword)."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

from conformance import compat


def interpreted(fn: Callable[..., Any], params: Any, **kwargs: Any) -> Callable[..., Any]:
    """``fn`` with ``kwargs`` bound, run under TPU interpret mode ``params`` (``pltpu.InterpretParams``)."""
    if takes_interpret(fn):
        return functools.partial(fn, **kwargs, interpret=params)
    return interpret_forced(functools.partial(fn, **kwargs), params)


def takes_interpret(fn: Callable[..., Any]) -> bool:
    """Whether a Pallas kernel takes ``interpret=`` (a keyword of that name, or ``**kwargs``)."""
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return True
    return any(p.name == "interpret" or p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)


def interpret_forced(fn: Callable[..., Any], params: Any) -> Callable[..., Any]:
    """``fn`` (a Pallas kernel that takes no ``interpret=``, as JAX's Pallas TPU tutorial writes them)
    called with TPU interpret mode forced (:func:`conformance.compat.forced_interpret_mode`): each
    ``pl.pallas_call`` it builds while it runs, so while it is traced, is interpreted; one it built
    before (at import) is not."""

    @functools.wraps(fn)
    def forced(*args: Any, **kwargs: Any) -> Any:
        with compat.forced_interpret_mode(params):
            return fn(*args, **kwargs)

    return forced
