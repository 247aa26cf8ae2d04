"""The spec of every kernel family, in one place each; checks read it, never restate it."""

from __future__ import annotations

from conformance.specs.all_gather import ALL_GATHER
from conformance.specs.allgather_matmul import ALLGATHER_MATMUL
from conformance.specs.base import BadInput, FamilySpec, Operand
from conformance.specs.matmul_reduce_scatter import MATMUL_REDUCE_SCATTER

FAMILIES: dict[str, FamilySpec] = {
    spec.name: spec for spec in (ALL_GATHER, ALLGATHER_MATMUL, MATMUL_REDUCE_SCATTER)
}


def get(family: str) -> FamilySpec:
    try:
        return FAMILIES[family]
    except KeyError:
        raise KeyError(f"unknown family {family!r}; known: {', '.join(FAMILIES)}") from None


__all__ = ["FAMILIES", "BadInput", "FamilySpec", "Operand", "get"]
