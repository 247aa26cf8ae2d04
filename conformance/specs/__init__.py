"""The spec of every kernel family, in one place each; checks read it, never restate it.

A built-in family joins by being a module here that sets ``SPEC`` (its :class:`FamilySpec`); nothing
else in the suite names it. A third party's family joins with :func:`add_family`.
"""

from __future__ import annotations

import importlib
import pkgutil

from conformance.specs.base import BadInput, FamilySpec, Operand
from conformance.specs.send_recv import PointToPointSpec


def _builtin_specs() -> list[FamilySpec | PointToPointSpec]:
    """``SPEC`` of every module of this package, in the order of the modules' names."""
    found = []
    for info in sorted(pkgutil.iter_modules(__path__, f"{__name__}."), key=lambda i: i.name):
        spec = getattr(importlib.import_module(info.name), "SPEC", None)
        if spec is not None:
            found.append(spec)
    return found


FAMILIES: dict[str, FamilySpec | PointToPointSpec] = {spec.name: spec for spec in _builtin_specs()}


def add_family(spec: FamilySpec) -> FamilySpec:
    """Make ``spec`` a family the suite knows, beside the built-in ones; returns it.

    A test module with ``FAMILY = spec.name`` and ``from conformance.family_tests import *``
    then gets every standard check for each implementation registered for it.
    Adding it again from a re-import of the same module replaces it; another spec of
    the same name is an error.
    """
    if not isinstance(spec, FamilySpec):
        raise TypeError(f"add_family needs a conformance.specs.FamilySpec, got {type(spec).__name__}")
    existing = FAMILIES.get(spec.name)
    if existing is not None and existing is not spec:
        origin = getattr(existing.reference, "__module__", None)
        if origin != getattr(spec.reference, "__module__", None) or existing.name in _BUILTIN:
            raise ValueError(
                f"a family named {spec.name!r} is already known (from {origin}); pick another name"
            )
    FAMILIES[spec.name] = spec
    return spec


_BUILTIN = frozenset(FAMILIES)


def shard_map_families() -> tuple[str, ...]:
    """The families of ``fn(*operands, *, mesh, axis_name)`` kernels (every check of
    :mod:`conformance.family_tests` and the benchmarks); ``send_recv`` has its own module."""
    return tuple(name for name, spec in FAMILIES.items() if isinstance(spec, FamilySpec))


def get(family: str) -> FamilySpec | PointToPointSpec:
    try:
        return FAMILIES[family]
    except KeyError:
        raise KeyError(f"unknown family {family!r}; known: {', '.join(FAMILIES)}") from None


__all__ = [
    "FAMILIES",
    "BadInput",
    "FamilySpec",
    "Operand",
    "PointToPointSpec",
    "add_family",
    "get",
    "shard_map_families",
]
