"""What a family spec says: signature, shardings, numpy reference, collectives, byte bounds."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

import numpy as np
from jax.sharding import PartitionSpec as P

Dims = Mapping[str, int]


@dataclasses.dataclass(frozen=True)
class Operand:
    """One input of the family's signature: its name, sharding and global shape."""

    name: str
    spec: Callable[[str], P]  #: axis_name -> PartitionSpec
    shape: Callable[[Dims, int], tuple[int, ...]]  #: (dims, axis size) -> global shape


@dataclasses.dataclass(frozen=True)
class BadInput:
    """An input the family forbids; the kernel (or suite) must raise naming ``must_mention``."""

    description: str
    shapes: tuple[tuple[int, ...], ...]  #: global operand shapes (placed replicated)
    axis_name: str | None  #: ``None``: the mesh config's axis
    must_mention: tuple[str, ...]  #: substrings the error message must contain


@dataclasses.dataclass(frozen=True)
class FamilySpec:
    """The contract of a kernel family: ``fn(*operands, *, mesh, axis_name)``."""

    name: str
    summary: str
    operands: tuple[Operand, ...]
    out_spec: Callable[[str], P]
    out_shape: Callable[[Dims, int], tuple[int, ...]]
    #: Named sizes that parametrize shapes, e.g. rows per shard; strategies draw them.
    dims: tuple[str, ...]
    #: Dims for the fixed-shape checks (sharding, dtype, HLO, lowering, determinism).
    canonical_dims: Mapping[str, int]
    dtypes: tuple[str, ...]
    #: numpy float64 ground truth over float64 copies of the (dtype-rounded) inputs.
    reference: Callable[..., np.ndarray]
    #: Elementwise absolute tolerance given float64 inputs and the dtype name.
    tolerance: Callable[..., np.ndarray]
    #: HLO collective kinds the implementations may use (the baseline is exempt).
    allowed_collectives: frozenset[str]
    #: Max bytes one device may receive per call: (dims, axis size, itemsize) -> bytes.
    max_received_bytes: Callable[[Dims, int, int], int]
    #: Bytes any correct implementation must receive per device (for the report).
    min_received_bytes: Callable[[Dims, int, int], int]
    #: Forbidden inputs for a mesh axis of size n.
    bad_inputs: Callable[[int], tuple[BadInput, ...]]
    #: Sentence stating the byte bound, for failure messages.
    byte_bound_text: str = ""

    @property
    def operand_names(self) -> tuple[str, ...]:
        return tuple(op.name for op in self.operands)

    def signature(self, axis_name: str = "axis") -> str:
        """E.g. ``lhs[M,K] P('x', None), rhs[K,N] P(None, 'x') -> out P(None, 'x')``."""
        ins = ", ".join(f"{op.name} {op.spec(axis_name)}" for op in self.operands)
        return f"{ins} -> {self.out_spec(axis_name)}"
