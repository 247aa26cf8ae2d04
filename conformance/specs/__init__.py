"""The spec of every kernel family, in one place each; checks read it, never restate it."""

from __future__ import annotations

from conformance.specs.all_gather import ALL_GATHER
from conformance.specs.allgather_matmul import ALLGATHER_MATMUL
from conformance.specs.base import BadInput, FamilySpec, Operand
from conformance.specs.matmul_reduce_scatter import MATMUL_REDUCE_SCATTER
from conformance.specs.send_recv import SEND_RECV, PointToPointSpec

FAMILIES: dict[str, FamilySpec | PointToPointSpec] = {
    spec.name: spec for spec in (ALL_GATHER, ALLGATHER_MATMUL, MATMUL_REDUCE_SCATTER, SEND_RECV)
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
