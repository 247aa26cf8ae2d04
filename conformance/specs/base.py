"""What a family spec says: signature, shardings, numpy reference, collectives, byte bounds."""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Mapping

import numpy as np
from jax.sharding import PartitionSpec as P

Dims = Mapping[str, int]


def _np_dtype(name: str) -> np.dtype:
    import jax.numpy as jnp

    return np.dtype(jnp.dtype(name))


def partial_itemsize(itemsize: int) -> int:
    """Bytes per element of a matmul partial sum: float32 for 16-bit floats, else the dtype's own.

    (The matmul families' dtypes are float32, bfloat16, float16 and int32, so a
    2-byte dtype there is always a float.)
    """
    return max(itemsize, 4)


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
class RegistrationOption:
    """A keyword a family's implementations may pass to ``conformance.register`` beyond the common
    ones (the spec lists them; the registry knows none of its own)."""

    #: What an implementation that does not pass it gets.
    default: object
    #: Whether a value is acceptable, and what an acceptable one is (for the error message).
    accepts: Callable[[object], bool]
    expects: str
    #: What it declares, for ``register``'s error messages and the docs.
    doc: str


#: The fixed-shape checks' two shapes: the canonical one (an odd dim) and its even twin.
FIXED_SHAPES = ("odd", "even")

#: The values hypothesis draws a dim from when its spec lists none for it: small sizes, 1 and odd
#: ones included (each distinct shape is a compile, so a short list lets examples share them).
DEFAULT_DIM_VALUES = (1, 2, 3, 5, 8)


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
    #: Dims for the fixed-shape checks (sharding, dtype, HLO, lowering, determinism, races).
    #: At least one is odd (odd rows per shard catch a dropped last row); the checks also
    #: run at :attr:`even_dims`, so a defect that needs an odd shape shows as exactly that.
    canonical_dims: Mapping[str, int]
    dtypes: tuple[str, ...]
    #: numpy float64 ground truth over float64 copies of the (dtype-rounded) inputs; a reference
    #: with a keyword parameter ``axis_size`` is also given the mesh axis size (see :meth:`expected`).
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

    # -- autodiff: what ``jax.vjp`` of an implementation that declares itself differentiable must give
    #: (float64 inputs..., float64 cotangent) -> the float64 gradient of each operand.
    vjp_reference: Callable[..., tuple[np.ndarray, ...]] | None = None
    #: (float64 inputs..., float64 cotangent, dtype) -> elementwise tolerance of each gradient.
    vjp_tolerance: Callable[..., tuple[np.ndarray, ...]] | None = None
    #: HLO collectives the pullback (forward recomputation included) may use; the baseline is exempt.
    backward_allowed_collectives: frozenset[str] = frozenset()
    #: Max bytes one device may receive in the pullback: (dims, axis size, itemsize) -> bytes.
    backward_max_received_bytes: Callable[[Dims, int, int], int] | None = None
    backward_byte_bound_text: str = ""

    # -- accuracy against the baseline's own error, for dtypes where the accumulation order matters
    accuracy_dtypes: tuple[str, ...] = ()
    #: Dims for the accuracy check: enough output elements for a stable error statistic.
    accuracy_dims: Mapping[str, int] | None = None
    #: What the baseline does that makes it this accurate, and how a kernel matches it (failure text).
    accuracy_baseline_does: str = ""
    accuracy_how_to_match: str = ""

    # -- overlap: the families whose point is hiding transfers behind compute
    #: How a kernel of the family hides its transfers (the overlap check's failure text); empty: the
    #: family has no compute to hide them behind, and the overlap check does not run for it.
    overlap: str = ""
    #: bfloat16 dims the scheduled-overlap check compiles for TPU topologies, smallest first: a
    #: ladder of realistic per-hop transfers (a few hundred KiB to several MiB), at which XLA:TPU's
    #: scheduler decides differently (:mod:`conformance.checks.tpu_schedule`).
    schedule_ladder: tuple[Mapping[str, int], ...] = ()

    # -- TPU layout: what a Pallas kernel compiled for TPU chips must accept
    #: Dims at which every buffer fills whole TPU tiles for every dtype of the
    #: family (rows a multiple of 32, the int8 sublane tile; lanes a multiple of
    #: 128). A Pallas kernel may refuse other shapes on a TPU (naming the
    #: constraint) but must accept these; ``pytest -m tpu`` runs Pallas kernels here.
    tpu_native_dims: Mapping[str, int] | None = None

    #: Keywords this family's implementations may pass to ``conformance.register``.
    registration_options: Mapping[str, RegistrationOption] = dataclasses.field(default_factory=dict)

    #: The values hypothesis draws each dim from, and that the TPU layout audit moves each dim of
    #: the TPU-native dims to; a dim not listed draws from :data:`DEFAULT_DIM_VALUES`.
    dim_values: Mapping[str, tuple[int, ...]] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        if not any(v % 2 for v in self.canonical_dims.values()):
            raise ValueError(
                f"{self.name}: canonical_dims {dict(self.canonical_dims)} has no odd dim, "
                "so the fixed-shape checks' even shape would be the same case"
            )

    def values_of(self, dim: str) -> tuple[int, ...]:
        """The values hypothesis draws ``dim`` from."""
        if dim not in self.dims:
            raise KeyError(f"{self.name} has no dim {dim!r}; its dims are {self.dims}")
        return tuple(self.dim_values.get(dim, DEFAULT_DIM_VALUES))

    def expected(self, inputs64: tuple[np.ndarray, ...], *, axis_size: int) -> np.ndarray:
        """The reference result: ``reference(*inputs64)``, plus ``axis_size=`` where it takes one."""
        if "axis_size" in inspect.signature(self.reference).parameters:
            return self.reference(*inputs64, axis_size=axis_size)
        return self.reference(*inputs64)

    @property
    def even_dims(self) -> dict[str, int]:
        """:attr:`canonical_dims` with every odd dim made even (one larger): the second fixed shape."""
        return {k: v + v % 2 for k, v in self.canonical_dims.items()}

    def fixed_dims(self, shape: str) -> dict[str, int]:
        """The dims of a fixed shape: ``"odd"`` (:attr:`canonical_dims`) or ``"even"``."""
        if shape not in FIXED_SHAPES:
            raise ValueError(f"fixed shape {shape!r} is not one of {FIXED_SHAPES}")
        return dict(self.canonical_dims) if shape == "odd" else self.even_dims

    @property
    def differentiable(self) -> bool:
        return self.vjp_reference is not None

    @property
    def gradient_dtypes(self) -> tuple[str, ...]:
        """The float dtypes of the family (integers have no gradients)."""
        return tuple(d for d in self.dtypes if not np.issubdtype(_np_dtype(d), np.integer))

    @property
    def sixteen_bit_dtypes(self) -> tuple[str, ...]:
        """The family's 2-byte dtypes, whose traffic only a module lowered for a target shows."""
        return tuple(d for d in self.dtypes if _np_dtype(d).itemsize == 2)

    @property
    def operand_names(self) -> tuple[str, ...]:
        return tuple(op.name for op in self.operands)

    def signature(self, axis_name: str = "axis") -> str:
        """E.g. ``lhs[M,K] P('x', None), rhs[K,N] P(None, 'x') -> out P(None, 'x')``."""
        ins = ", ".join(f"{op.name} {op.spec(axis_name)}" for op in self.operands)
        return f"{ins} -> {self.out_spec(axis_name)}"
