"""What a family spec says: signature, shardings, numpy reference, collectives, byte bounds."""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Mapping

import numpy as np
from jax.sharding import PartitionSpec as P

from conformance import dtypes

Dims = Mapping[str, int]


def _np_dtype(name: str) -> np.dtype:
    """The operands' numpy dtype of a dtype name (:mod:`conformance.dtypes`)."""
    return dtypes.operand_np(name)


def partial_itemsize(itemsize: int) -> int:
    """Bytes per element of a matmul partial sum, for operands of ``itemsize`` bytes: float32 for
    16-bit floats and float8, int32 for int8, else the dtype's own (partials are summed in at least
    32 bits and cast to the result dtype once)."""
    return max(itemsize, 4)


def rows_tagged_by_position(shape: tuple[int, ...], n: int, sources: tuple[int, ...]) -> np.ndarray:
    """A block map's tagged operand (:attr:`FamilySpec.block_tags`): zero but the row blocks (along dim
    -2) of the ring positions ``sources``, position ``s``'s rows carrying ``s + 1``."""
    x = np.zeros(shape)
    rows = shape[-2] // n
    for s in sources:
        x[..., s * rows : (s + 1) * rows, :] = s + 1
    return x


@dataclasses.dataclass(frozen=True)
class Operand:
    """One input of the family's signature: its name, sharding and global shape; an operand that is
    not data (a ragged all-to-all's offsets and sizes) also fixes its dtype and its values."""

    name: str
    spec: Callable[[str], P]  #: axis_name -> PartitionSpec
    shape: Callable[[Dims, int], tuple[int, ...]]  #: (dims, axis size) -> global shape
    #: The operand's own dtype name (e.g. ``"int32"``); ``None``: the case's dtype, as data is.
    dtype: str | None = None
    #: (dims, axis size) -> the operand's global values, the same in every run of a case's dims;
    #: ``None``: drawn at random in the operand's dtype, as data is.
    values: Callable[[Dims, int], np.ndarray] | None = None

    @property
    def is_data(self) -> bool:
        """Whether the operand holds the data the family moves (its dtype is the case's, its values
        drawn): what checks perturb, tag and differentiate."""
        return self.dtype is None and self.values is None


@dataclasses.dataclass(frozen=True)
class BadInput:
    """An input the family forbids; the kernel (or suite) must raise naming ``must_mention``."""

    description: str
    shapes: tuple[tuple[int, ...], ...]  #: global operand shapes (placed replicated)
    axis_name: str | None  #: ``None``: the mesh config's axis
    must_mention: tuple[str, ...]  #: substrings the error message must contain


@dataclasses.dataclass(frozen=True)
class KnownMistake:
    """A way kernels of a family are known to get it wrong, as the result it gives: a wrong result that
    matches it is named by it (the values check's explanation)."""

    #: What the kernel does, completing "the result is exactly what ... gives".
    description: str
    #: (float64 inputs..., axis_size=) -> the float64 result of the mistake.
    reference: Callable[..., np.ndarray]

    def result(self, inputs64: tuple[np.ndarray, ...], *, axis_size: int) -> np.ndarray:
        return self.reference(*inputs64, axis_size=axis_size)


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
    #: (the family's spec, the value) -> the spec of a kernel registered with a value other than
    #: ``default``: the form it is called in and held to (``None``: the option changes no form).
    derive: Callable[[FamilySpec, object], FamilySpec] | None = None


@dataclasses.dataclass(frozen=True)
class FormChange:
    """How a derived form of a family (:attr:`RegistrationOption.derive`: a batch dim, another scatter
    dimension) maps onto the family's own, in which its baseline runs: the accuracy checks run the
    baseline on a kernel's inputs so mapped, and map its results back."""

    #: A case's dims -> the family form's dims.
    dims: Callable[[Mapping[str, int]], dict[str, int]]
    #: A case's operands (and a trailing cotangent, shaped as the result) -> the family form's.
    fold: Callable[[tuple[np.ndarray, ...]], tuple[np.ndarray, ...]]
    #: (a family-form result or gradient, the case-form array it stands for, the case-form arrays that
    #: were folded) -> it in the case's form.
    unfold: Callable[[np.ndarray, np.ndarray, tuple[np.ndarray, ...]], np.ndarray]


#: ``batch_dims``, a matmul family's registration option: how many leading batch dims a kernel's
#: batched operands and result take (:meth:`FamilySpec.batched`).
BATCH_DIMS_OPTION = RegistrationOption(
    default=0,
    accepts=lambda v: type(v) is int and v in (0, 1),
    expects="0 or 1",
    doc="the leading batch dims the kernel takes: 0, the family's 2-D form; 1, a leading batch dim B on "
    "the batched operands and the result (lhs[B, M, K] -> out[B, M, N])",
    derive=lambda spec, _: spec.batched(),
)

#: The fixed-shape checks' two shapes: the canonical one (an odd dim) and its even twin.
FIXED_SHAPES = ("odd", "even")

#: The values hypothesis draws a dim from when its spec lists none for it: small sizes, 1 and odd
#: ones included (each distinct shape is a compile, so a short list lets examples share them).
DEFAULT_DIM_VALUES = (1, 2, 3, 5, 8)

#: The dim of a batched case's leading batch dimension (:meth:`FamilySpec.batched`).
BATCH_DIM = "batch"


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
    #: HLO collective kinds the implementations may use (the baseline is exempt); a kind qualified by
    #: a dtype (``all-gather:s32``) is allowed of that dtype's operands alone
    #: (:func:`conformance.hlo.disallowed`).
    allowed_collectives: frozenset[str]
    #: Max bytes one device may receive per call: (dims, axis size, itemsize) -> bytes.
    max_received_bytes: Callable[[Dims, int, int], int]
    #: Bytes any correct implementation must receive per device (for the report).
    min_received_bytes: Callable[[Dims, int, int], int]
    #: Forbidden inputs for a mesh axis of size n.
    bad_inputs: Callable[[int], tuple[BadInput, ...]]
    #: Sentence stating the byte bound, for failure messages.
    byte_bound_text: str = ""
    #: Why the family allows the collectives it does, for a failure naming one it forbids ("" where
    #: the kinds say it all).
    collectives_text: str = ""

    # -- autodiff: what ``jax.vjp`` of an implementation that declares itself differentiable must give
    #: (float64 inputs..., float64 cotangent) -> the float64 gradient of each data operand
    #: (:attr:`Operand.is_data`; offsets and sizes have none).
    vjp_reference: Callable[..., tuple[np.ndarray, ...]] | None = None
    #: (float64 inputs..., float64 cotangent, dtype) -> elementwise tolerance of each gradient.
    vjp_tolerance: Callable[..., tuple[np.ndarray, ...]] | None = None
    #: HLO collectives the pullback (forward recomputation included) may use; the baseline is exempt.
    backward_allowed_collectives: frozenset[str] = frozenset()
    #: Max bytes one device may receive in the pullback: (dims, axis size, itemsize) -> bytes.
    backward_max_received_bytes: Callable[[Dims, int, int], int] | None = None
    backward_byte_bound_text: str = ""
    #: The exact gradient where it needs no arithmetic, only the cotangent's elements moved or sliced
    #: ("each device's gradient is the replicated cotangent, as it is"); "" where it is a sum (a
    #: matmul's partials over the ring). Gradients off by roundings alone, and a backward less accurate
    #: than the baseline's, are then explained by it, not by a sum's accumulators.
    backward_exact: str = ""

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
    #: How a ring of the family paces itself, so that a scheduler cannot run its transfers ahead of
    #: the matmuls as a chain (the schedule checks' advice where a built-in ring with an ``unpaced``
    #: twin measures that pacing is the lever, :mod:`conformance.checks.tpu_schedule`).
    pacing: str = ""
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

    # -- which block landed where (:mod:`conformance.checks.block_map`)
    #: (operand shapes, axis size, ring positions) -> float64 operands, zero but what those positions
    #: hold, whose values tag the row block of the result each row belongs to (block ``r``: ``r + 1``),
    #: so that the result's rows carry the tag of the block they came from; ``None``: not traced.
    block_tags: (
        Callable[[tuple[tuple[int, ...], ...], int, tuple[int, ...]], tuple[np.ndarray, ...]] | None
    ) = None
    #: What a ring position contributes to the result, in failure text: a "block" (each row of the
    #: result comes from one position, the result's row block ``r`` from position ``r``: every position
    #: is tagged in one run), a "group" (each row comes from one position, or none, as the case's
    #: routing says: one run, rows named one by one) or a "partial" (each row sums every position's:
    #: one run per position).
    block_unit: str = "block"
    #: Ways kernels of the family are known to go wrong, each as the result it gives: a wrong result
    #: that matches one is named by it.
    known_mistakes: tuple[KnownMistake, ...] = ()
    #: (float64 inputs..., the result as float64, tolerance, axis_size=, dtype=, rerun=) -> lines saying
    #: what a wrong result lacks or holds, beyond where its blocks landed (a MoE dispatch's rows missing,
    #: expert by expert); ``[]`` where it has nothing to say. ``rerun(**{operand: float64 array})``: the
    #: kernel's result on the case's inputs with those operands replaced (tagged rows, say). ``None``:
    #: the family says nothing more.
    explain_wrong: Callable[..., list[str]] | None = None
    #: The same for gradients: each mistake's reference takes the float64 inputs and the cotangent and
    #: gives every data operand's gradient (a tuple); the gradients check names a match.
    vjp_known_mistakes: tuple[KnownMistake, ...] = ()

    # -- reductions other than the family's own (:mod:`conformance.checks.reductions`)
    #: The reductions a kernel may declare beside the family's default (registration option
    #: ``reductions``; it is then called with ``reduction=NAME``): name -> the float64 reference over
    #: the operands, exact (a min or max rounds nothing). Empty: the family has none.
    other_reductions: Mapping[str, Callable[..., np.ndarray]] = dataclasses.field(default_factory=dict)

    #: Keywords this family's implementations may pass to ``conformance.register``.
    registration_options: Mapping[str, RegistrationOption] = dataclasses.field(default_factory=dict)

    #: The dims of a benchmark case whose device shard has ``rows`` rows of 128 lanes (``None``: the
    #: first dim ``rows``, every other 128: :func:`conformance.reports.bench.dims_for`), for a family
    #: whose other dims are not sizes (a ragged all-to-all's routing).
    bench_dims: Callable[[int], Mapping[str, int]] | None = None

    #: The values hypothesis draws each dim from, and that the TPU layout audit moves each dim of
    #: the TPU-native dims to; a dim not listed draws from :data:`DEFAULT_DIM_VALUES`.
    dim_values: Mapping[str, tuple[int, ...]] = dataclasses.field(default_factory=dict)

    #: The operands that take leading batch dimensions in the family's batched form (the result
    #: takes them too): what a kernel registered with ``batch_dims=1`` is called with
    #: (:meth:`batched`). Empty: the family has no batched form.
    batched_operands: tuple[str, ...] = ()
    #: The dim the batch folds into: a batched case is the 2-D case with this dim ``B`` times larger,
    #: on the batched operands reshaped to 2-D (how the accuracy check runs the 2-D baseline on a
    #: batched kernel's inputs).
    batch_folds_into: str = ""
    #: The result's dim its ring positions' blocks run along, as :attr:`block_tags` tag them (the
    #: block map reads the result's blocks there): -2, its rows; -1, its columns (:meth:`transposed`).
    block_axis: int = -2
    #: How this form maps onto the family's own, in which its baseline runs; ``None``: it is the
    #: family's own form.
    family_form: FormChange | None = None

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
        """The float dtypes of the family at least 16 bits wide (integers have no gradients; float8
        and mixed-precision pairs are scaled by their callers, not differentiated as they are)."""
        return tuple(
            d
            for d in self.dtypes
            if not dtypes.is_mixed(d)
            and not np.issubdtype(_np_dtype(d), np.integer)
            and _np_dtype(d).itemsize >= 2
        )

    @property
    def sixteen_bit_dtypes(self) -> tuple[str, ...]:
        """The family's 2-byte dtypes, whose traffic only a module lowered for a target shows."""
        return tuple(d for d in self.dtypes if not dtypes.is_mixed(d) and _np_dtype(d).itemsize == 2)

    @property
    def narrow_dtypes(self) -> tuple[str, ...]:
        """The family's dtypes whose operands are narrower than 32 bits (16-bit, float8 and int8, plain
        or in a mixed-precision pair): what a kernel's transfers ship in them only a module lowered or
        compiled for a target shows (XLA:CPU widens them before a transfer)."""
        return tuple(d for d in self.dtypes if _np_dtype(d).itemsize < 4)

    @property
    def plain_dtypes(self) -> tuple[str, ...]:
        """The family's dtypes but its mixed-precision pairs: what a kernel that declares no dtypes
        claims."""
        return tuple(d for d in self.dtypes if not dtypes.is_mixed(d))

    @property
    def operand_names(self) -> tuple[str, ...]:
        return tuple(op.name for op in self.operands)

    def batched(self) -> FamilySpec:
        """The family's batched form: ``batched_operands`` and the result take one leading batch dim
        ``B`` (the ``batch`` dim), replicated over the mesh, e.g. ``lhs[B, M, K] P(None, axis, None)``
        as activations ``[batch, seq, emb]`` gathered along the sequence. The batch stacks further
        rows on the 2-D form, so the reference, tolerance and gradients are the 2-D ones over the
        ``B x M`` rows (reshaped back), each byte bound is ``B`` times the 2-D one, and each forbidden
        input gets a batch of 2."""
        if not self.batched_operands or self.batch_folds_into not in self.dims:
            raise ValueError(f"the {self.name} family has no batched form")
        return _batched(self)

    def transposed(self) -> FamilySpec:
        """The family's form with the last two dims of every operand and of the result swapped, e.g. a
        reduce-scatter's ``x[n, cols, M] -> [cols, M] P(None, axis)``: the partials scattered along
        their last dim (``lax.psum_scatter(..., scatter_dimension=1)``). Nothing is computed
        differently, so the reference, tolerance, gradients and block tags are the family's on the
        swapped arrays (swapped back), and the byte bounds are the family's."""
        if any(not op.is_data for op in self.operands) or self.block_axis != -2:
            raise ValueError(f"the {self.name} family has no transposed form")
        return _transposed(self)

    def unbatched(self, dims: Mapping[str, int]) -> dict[str, int]:
        """The 2-D form's dims of a batched case's ``dims``: the batch folded into
        :attr:`batch_folds_into`."""
        out = {k: v for k, v in dims.items() if k != BATCH_DIM}
        out[self.batch_folds_into] *= dims[BATCH_DIM]
        return out

    def signature(self, axis_name: str = "axis") -> str:
        """E.g. ``lhs[M,K] P('x', None), rhs[K,N] P(None, 'x') -> out P(None, 'x')``."""
        ins = ", ".join(f"{op.name} {op.spec(axis_name)}" for op in self.operands)
        return f"{ins} -> {self.out_spec(axis_name)}"


def _batched(spec: FamilySpec) -> FamilySpec:
    """:meth:`FamilySpec.batched` (module doc there)."""
    batched = [op.name in spec.batched_operands for op in spec.operands]

    def with_batch(op: Operand, on: bool) -> Operand:
        if not on:
            return op
        return Operand(
            op.name,
            lambda a, inner=op.spec: P(None, *inner(a)),
            lambda d, n, inner=op.shape: (d[BATCH_DIM], *inner(d, n)),
        )

    def fold(a: np.ndarray) -> np.ndarray:
        """A batched array with its batch folded into its rows."""
        return a.reshape(-1, *a.shape[2:])

    def rows(inputs: tuple[np.ndarray, ...]) -> tuple[np.ndarray, ...]:
        """The batched operands with their batch folded into their rows: the 2-D form's inputs."""
        return tuple(fold(a) if on else a for a, on in zip(inputs, batched, strict=True))

    def batch_of(inputs: tuple[np.ndarray, ...]) -> int:
        return next(a.shape[0] for a, on in zip(inputs, batched, strict=True) if on)

    def reference(*inputs: np.ndarray, axis_size: int) -> np.ndarray:
        out = spec.expected(rows(inputs), axis_size=axis_size)
        return out.reshape(batch_of(inputs), -1, *out.shape[1:])

    def tolerance(*inputs_and_dtype: object) -> np.ndarray:  # (inputs..., dtype), as the 2-D form's
        *inputs, dtype = inputs_and_dtype
        tol = spec.tolerance(*rows(tuple(inputs)), dtype)
        return tol.reshape(batch_of(tuple(inputs)), -1, *tol.shape[1:])

    def per_batch(bound: Callable[[Dims, int, int], int]) -> Callable[[Dims, int, int], int]:
        return lambda d, n, itemsize: d[BATCH_DIM] * bound(d, n, itemsize)

    def bad_inputs(n: int) -> tuple[BadInput, ...]:
        return tuple(
            dataclasses.replace(
                bad, shapes=tuple((2, *s) if on else s for s, on in zip(bad.shapes, batched, strict=True))
            )
            for bad in spec.bad_inputs(n)
        )

    def vjp(*inputs_and_ct: np.ndarray) -> tuple[np.ndarray, ...]:  # (inputs..., cotangent)
        *inputs, ct = inputs_and_ct
        grads = spec.vjp_reference(*rows(tuple(inputs)), ct.reshape(-1, *ct.shape[2:]))
        return tuple(g.reshape(a.shape) for g, a in zip(grads, inputs, strict=True))

    def vjp_tolerance(*inputs_ct_and_dtype: object) -> tuple[np.ndarray, ...]:  # (inputs..., ct, dtype)
        *inputs, ct, dtype = inputs_ct_and_dtype
        tols = spec.vjp_tolerance(*rows(tuple(inputs)), ct.reshape(-1, *ct.shape[2:]), dtype)
        return tuple(t.reshape(a.shape) for t, a in zip(tols, inputs, strict=True))

    def with_batch_dim(dims: Mapping[str, int] | None, batch: int) -> dict[str, int] | None:
        return None if dims is None else {BATCH_DIM: batch, **dims}

    return dataclasses.replace(
        spec,
        summary=f"{spec.summary}; {', '.join(spec.batched_operands)} and the result with a leading batch dim",
        operands=tuple(with_batch(op, on) for op, on in zip(spec.operands, batched, strict=True)),
        out_spec=lambda a: P(None, *spec.out_spec(a)),
        out_shape=lambda d, n: (d[BATCH_DIM], *spec.out_shape(d, n)),
        dims=(BATCH_DIM, *spec.dims),
        canonical_dims=with_batch_dim(spec.canonical_dims, 2),
        dim_values={BATCH_DIM: (1, 2, 3), **spec.dim_values},
        reference=reference,
        tolerance=tolerance,
        max_received_bytes=per_batch(spec.max_received_bytes),
        min_received_bytes=per_batch(spec.min_received_bytes),
        bad_inputs=bad_inputs,
        byte_bound_text=f"{spec.byte_bound_text}, for each of the B batches",
        vjp_reference=None if spec.vjp_reference is None else vjp,
        vjp_tolerance=None if spec.vjp_tolerance is None else vjp_tolerance,
        backward_max_received_bytes=(
            None if spec.backward_max_received_bytes is None else per_batch(spec.backward_max_received_bytes)
        ),
        accuracy_dims=with_batch_dim(spec.accuracy_dims, 2),
        tpu_native_dims=with_batch_dim(spec.tpu_native_dims, 2),
        schedule_ladder=tuple(with_batch_dim(rung, 1) for rung in spec.schedule_ladder),
        batched_operands=(),
        family_form=FormChange(
            dims=spec.unbatched,
            fold=lambda arrays: (
                rows(arrays) if len(arrays) == len(batched) else (*rows(arrays[:-1]), fold(arrays[-1]))
            ),
            unfold=lambda value, like, arrays: value.reshape(like.shape),
        ),
    )


def _swap(a: np.ndarray) -> np.ndarray:
    """``a`` with its last two dims swapped."""
    return np.swapaxes(a, -1, -2)


def _transposed(spec: FamilySpec) -> FamilySpec:
    """:meth:`FamilySpec.transposed` (module doc there)."""

    def swapped(*arrays: np.ndarray) -> tuple[np.ndarray, ...]:
        return tuple(_swap(a) for a in arrays)

    def swap_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
        return (*shape[:-2], shape[-1], shape[-2])

    def swap_spec(spec_of: Callable[[str], P]) -> Callable[[str], P]:
        def spec(a: str) -> P:
            *lead, rows, cols = tuple(spec_of(a)) or (None, None)
            return P(*lead, cols, rows)

        return spec

    def operand(op: Operand) -> Operand:
        return Operand(op.name, swap_spec(op.spec), lambda d, n, inner=op.shape: swap_shape(inner(d, n)))

    def reference(*inputs: np.ndarray, axis_size: int) -> np.ndarray:
        return _swap(spec.expected(swapped(*inputs), axis_size=axis_size))

    def tolerance(*inputs_and_dtype: object) -> np.ndarray:  # (inputs..., dtype), as the family's
        *inputs, dtype = inputs_and_dtype
        return _swap(spec.tolerance(*swapped(*inputs), dtype))

    def of_operands_and_ct(per: Callable[..., tuple[np.ndarray, ...]] | None) -> Callable[..., tuple] | None:
        if per is None:
            return None

        def swapped_back(*args: object) -> tuple[np.ndarray, ...]:  # (inputs..., ct[, dtype])
            arrays = [a for a in args if isinstance(a, np.ndarray)]
            rest = args[len(arrays) :]
            return swapped(*per(*swapped(*arrays), *rest))

        return swapped_back

    def bad_inputs(n: int) -> tuple[BadInput, ...]:
        return tuple(
            dataclasses.replace(
                bad,
                description=bad.description.replace(" rows", " columns"),
                shapes=tuple(swap_shape(s) for s in bad.shapes),
            )
            for bad in spec.bad_inputs(n)
        )

    def block_tags(shapes: tuple[tuple[int, ...], ...], n: int, sources: tuple[int, ...]) -> tuple:
        return swapped(*spec.block_tags(tuple(swap_shape(s) for s in shapes), n, sources))

    def other(reduce: Callable[..., np.ndarray]) -> Callable[..., np.ndarray]:
        return lambda *inputs: _swap(reduce(*swapped(*inputs)))

    def mistake(known: KnownMistake) -> KnownMistake:
        def result(*inputs: np.ndarray, axis_size: int) -> np.ndarray:
            return _swap(known.reference(*swapped(*inputs), axis_size=axis_size))

        return KnownMistake(known.description, result)

    out_spec = swap_spec(spec.out_spec)
    return dataclasses.replace(
        spec,
        summary=f"{spec.summary}; every operand and the result with its last two dims swapped",
        operands=tuple(operand(op) for op in spec.operands),
        out_spec=out_spec,
        out_shape=lambda d, n: swap_shape(spec.out_shape(d, n)),
        reference=reference,
        tolerance=tolerance,
        bad_inputs=bad_inputs,
        vjp_reference=of_operands_and_ct(spec.vjp_reference),
        vjp_tolerance=of_operands_and_ct(spec.vjp_tolerance),
        block_tags=None if spec.block_tags is None else block_tags,
        block_axis=-1,
        other_reductions={name: other(f) for name, f in spec.other_reductions.items()},
        known_mistakes=tuple(mistake(k) for k in spec.known_mistakes),
        family_form=FormChange(
            dims=dict, fold=lambda arrays: swapped(*arrays), unfold=lambda value, like, arrays: _swap(value)
        ),
    )
