"""The spec of every kernel family, in one place each; checks read it, never restate it."""

from __future__ import annotations

from conformance.specs.all_gather import ALL_GATHER
from conformance.specs.allgather_matmul import ALLGATHER_MATMUL
from conformance.specs.base import BadInput, FamilySpec, Operand
from conformance.specs.matmul_reduce_scatter import MATMUL_REDUCE_SCATTER

FAMILIES: dict[str, FamilySpec] = {
    spec.name: spec for spec in (ALL_GATHER, ALLGATHER_MATMUL, MATMUL_REDUCE_SCATTER)
}


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


def get(family: str) -> FamilySpec:
    try:
        return FAMILIES[family]
    except KeyError:
        raise KeyError(f"unknown family {family!r}; known: {', '.join(FAMILIES)}") from None


__all__ = ["FAMILIES", "BadInput", "FamilySpec", "Operand", "add_family", "get"]
