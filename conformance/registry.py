"""The public registry that built-in and third-party kernels enter the same way.

    import conformance

    @conformance.register("allgather_matmul", name="my_ring_matmul")
    def my_ring_matmul(lhs, rhs, *, mesh, axis_name): ...

    conformance.implementations("allgather_matmul")  # -> {name: callable}

``pytest conformance --kernels=MODULE`` imports ``MODULE`` so its registrations
join the run; importing ``kernels`` registers every built-in.
"""

from __future__ import annotations

import dataclasses
import fnmatch
from collections.abc import Callable
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])


@dataclasses.dataclass(frozen=True)
class Implementation:
    """One registered kernel: the callable plus what the suite needs to know about it."""

    family: str
    name: str
    fn: Callable[..., Any]
    #: XLA's own op, the oracle the others are compared with; exempt from the
    #: family's collective rule (it is what the rule is measured against).
    baseline: bool = False
    #: Free-form notes shown in reports (e.g. "bidirectional ring").
    description: str = ""
    #: A Pallas TPU kernel: accepts ``interpret=`` (the suite passes
    #: ``pltpu.InterpretParams`` on CPU and leaves it out on TPU), and gets the
    #: race and hang checks.
    pallas: bool = False
    #: Backends it must lower for from the CPU host.
    lowering_targets: tuple[str, ...] = ("tpu", "cuda")
    #: It supports ``jax.vjp``: the suite checks its gradients against numpy
    #: and audits the collectives of its backward pass.
    differentiable: bool = False

    @property
    def module(self) -> str:
        return getattr(self.fn, "__module__", "") or ""

    @property
    def is_builtin(self) -> bool:
        return self.module.split(".")[0] == "kernels"


_REGISTRY: dict[str, dict[str, Implementation]] = {}


def _known_families() -> tuple[str, ...]:
    from conformance import specs

    return tuple(specs.FAMILIES)


def register(
    family: str,
    *,
    name: str,
    baseline: bool = False,
    description: str = "",
    pallas: bool = False,
    lowering_targets: tuple[str, ...] | None = None,
    differentiable: bool = False,
) -> Callable[[F], F]:
    """Register ``fn`` as an implementation of ``family`` under ``name``; returns ``fn`` unchanged.

    ``pallas=True`` declares a Pallas TPU kernel taking an ``interpret`` keyword;
    its default ``lowering_targets`` is ``("tpu",)``, otherwise ``("tpu", "cuda")``.
    ``differentiable=True`` opts into the gradient checks (VJP against numpy
    float64) and the backward-pass collective audit.
    """
    if lowering_targets is None:
        lowering_targets = ("tpu",) if pallas else ("tpu", "cuda")
    known = _known_families()
    if family not in known:
        raise ValueError(f"unknown kernel family {family!r}; known families: {', '.join(known)}")
    if not name or not name.replace("_", "").replace("-", "").isalnum():
        raise ValueError(f"implementation name {name!r} must be non-empty letters, digits, _ or -")

    def decorator(fn: F) -> F:
        if not callable(fn):
            raise TypeError(f"register({family!r}, name={name!r}) needs a callable, got {fn!r}")
        impl = Implementation(family, name, fn, baseline=baseline, description=description,
                              pallas=pallas, lowering_targets=tuple(lowering_targets),
                              differentiable=differentiable)  # fmt: skip
        existing = _REGISTRY.setdefault(family, {}).get(name)
        if existing is not None and existing.fn is not fn:
            same_place = (existing.module, existing.fn.__qualname__) == (
                impl.module,
                getattr(fn, "__qualname__", ""),
            )
            if not same_place:  # a re-import of the same module re-registers harmlessly
                raise ValueError(
                    f"{family!r} already has an implementation named {name!r} "
                    f"(from {existing.module}); pick another name for {impl.module}"
                )
        _REGISTRY[family][name] = impl
        return fn

    return decorator


def implementations(family: str) -> dict[str, Callable[..., Any]]:
    """``{name: callable}`` for every implementation registered for ``family``."""
    return {name: impl.fn for name, impl in sorted(_REGISTRY.get(family, {}).items())}


def registered(family: str, pattern: str | None = None) -> list[Implementation]:
    """The :class:`Implementation` records of ``family`` whose names match ``pattern`` (a glob)."""
    impls = sorted(_REGISTRY.get(family, {}).values(), key=lambda i: i.name)
    if pattern:
        globs = [p.strip() for p in pattern.split(",") if p.strip()]
        impls = [i for i in impls if any(fnmatch.fnmatchcase(i.name, g) for g in globs)]
    return impls


def get(family: str, name: str) -> Implementation:
    try:
        return _REGISTRY[family][name]
    except KeyError:
        names = ", ".join(sorted(_REGISTRY.get(family, {}))) or "none"
        raise KeyError(f"no implementation {name!r} of {family!r}; registered: {names}") from None
