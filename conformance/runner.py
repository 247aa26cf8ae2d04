"""Cases, inputs, and compile-once execution shared by every check.

A :class:`Case` pins everything about one run (family, implementation, mesh, dims, dtype, platform,
seed) and prints as a token the replay command reads back, so any failure can be reproduced with one
line outside pytest. Compiled executables are cached per (implementation, mesh, platform, operand
shapes, dtype): the sharding, dtype, determinism and HLO checks of one mesh all reuse a single
compile, and hypothesis examples that revisit a shape do too.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import shlex
import zlib
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from conformance import case_tokens, compat, dtypes, interpreted_kernels, registry, tolerances, watchdog
from conformance.case_tokens import DMA_MODES
from conformance.fixtures.meshes import MeshConfig, build_mesh
from conformance.specs.base import FamilySpec
from conformance.targets import mosaic, tpu_compiler


@dataclasses.dataclass(frozen=True)
class Case:
    """One fully pinned configuration of one implementation."""

    family: str
    impl: str
    mesh: MeshConfig
    dims: tuple[tuple[str, int], ...]
    dtype: str
    platform: str = "cpu"
    seed: int = 0
    #: Pallas kernels on CPU: TPU interpret mode's DMA execution ("eager" or "on_wait").
    dma_mode: str | None = None

    @classmethod
    def make(
        cls,
        family: str,
        impl: str,
        mesh: MeshConfig,
        dims: Mapping[str, int],
        dtype: str,
        *,
        platform: str = "cpu",
        seed: int = 0,
        dma_mode: str | None = None,
    ) -> Case:
        spec = registry.spec_of(family, impl)
        if dma_mode not in (None, *DMA_MODES):
            raise ValueError(f"dma_mode {dma_mode!r} is not one of {DMA_MODES}")
        missing = set(spec.dims) - set(dims)
        if missing:
            raise ValueError(f"{family} needs dims {spec.dims}; missing {sorted(missing)}")
        return cls(
            family, impl, mesh, tuple((k, int(dims[k])) for k in spec.dims), dtype, platform, seed, dma_mode
        )

    @property
    def spec(self) -> FamilySpec:
        return registry.spec_of(self.family, self.impl)

    @property
    def implementation(self) -> registry.Implementation:
        return registry.get(self.family, self.impl)

    @property
    def dims_map(self) -> dict[str, int]:
        return dict(self.dims)

    @property
    def at_tpu_native_dims(self) -> bool:
        """Whether the dims are the family's TPU-native ones (which a Pallas kernel must accept)."""
        native = self.spec.tpu_native_dims
        return bool(native) and self.dims_map == dict(native)

    @property
    def operand_shapes(self) -> tuple[tuple[int, ...], ...]:
        n = self.mesh.axis_size
        return tuple(op.shape(self.dims_map, n) for op in self.spec.operands)

    @property
    def out_shape(self) -> tuple[int, ...]:
        return self.spec.out_shape(self.dims_map, self.mesh.axis_size)

    @property
    def token(self) -> str:
        """``2x4-y-explicit:rows_per_shard=3,K=8,cols_per_shard=2:bfloat16:seed=0``"""
        dims = ",".join(f"{k}={v}" for k, v in self.dims)
        dma = f":dma={self.dma_mode}" if self.dma_mode else ""
        return f"{self.mesh.label}:{dims}:{self.dtype}:seed={self.seed}{dma}"

    @classmethod
    def from_token(cls, family: str, impl: str, token: str, *, platform: str = "cpu") -> Case:
        spec = registry.spec_of(family, impl)
        read = case_tokens.parse(token, spec)
        case = cls.make(
            family,
            impl,
            read.mesh,
            read.dims,
            read.dtype,
            platform=platform,
            seed=read.seed,
            dma_mode=read.dma_mode,
        )
        case_tokens.check_choices(read, spec, impl=impl, token=token)
        return case

    def size_key(self) -> tuple[int, int, int, str]:
        """Order of "smaller" (the failure summary's smallest case): fewer devices, then fewer
        elements, then a narrower dtype."""
        itemsize = np.dtype(np_dtype(self.dtype)).itemsize
        return self.mesh.num_devices, math.prod(v for _, v in self.dims), itemsize, self.token

    def replay_command(self, check: str) -> str:
        """One line that re-runs exactly this check on exactly this case."""
        from conformance import kernel_paths, session

        parts = ["python", "-m", "conformance", "replay", check, self.family, self.impl, self.token]
        if self.platform != "cpu":
            parts += ["--platform", self.platform]
        module = self.implementation.module if self._is_registered() else ""
        if module and not module.startswith("conformance.kernels"):
            parts += ["--kernels", kernel_paths.kernels_argument(module)]
        return shlex.join([*parts, *session.current().settings.verdict_options()])

    def _is_registered(self) -> bool:
        return self.impl in registry.implementations(self.family)

    def describe(self) -> list[str]:
        """The header every failure message starts with."""
        spec, axis = self.spec, self.mesh.axis_name
        ins = ", ".join(
            f"{op.name}{list(shape)} {op.spec(axis)}"
            for op, shape in zip(spec.operands, self.operand_shapes, strict=True)
        )
        return [
            f"implementation : {self.impl}  (family {self.family})",
            f"mesh           : {self.mesh.describe()} on {self.platform}",
            f"dtype          : {dtypes.describe(self.dtype)}",
            f"shapes         : {ins} -> out{list(self.out_shape)} {spec.out_spec(axis)}",
            f"dims           : {', '.join(f'{k}={v}' for k, v in self.dims)}",
            *(
                [f"interpret      : TPU interpret mode, dma_execution_mode={self.dma_mode!r}"]
                if self.dma_mode
                else []
            ),
        ]


#: TPU interpret mode's DMA execution orders; "on_wait" runs DMAs as late and
#: out of order as the waits allow, which is what exposes reused semaphores.


def np_dtype(dtype: str) -> np.dtype:
    """The numpy dtype of a case's operands (of a mixed-precision pair, the narrow one)."""
    return dtypes.operand_np(dtype)


def operand_np_dtype(case: Case, index: int) -> np.dtype:
    """The numpy dtype of ``case``'s operand ``index``: its own where the spec fixes one (a ragged
    all-to-all's int32 offsets), else the case's (:func:`np_dtype`)."""
    fixed = case.spec.operands[index].dtype
    return np.dtype(dtypes.operand_np(fixed if fixed is not None else case.dtype))


def as_operands(case: Case, arrays: tuple[np.ndarray, ...]) -> tuple[np.ndarray, ...]:
    """``arrays`` (e.g. float64 copies of a case's inputs) cast back to each operand's dtype."""
    return tuple(a.astype(operand_np_dtype(case, i)) for i, a in enumerate(arrays))


def make_inputs(case: Case) -> tuple[np.ndarray, ...]:
    """Deterministic inputs for ``case``, already rounded to its dtype.

    Floats are standard normal; integers are uniform in ``[-B, B]`` with
    ``B = tolerances.INTEGER_INPUT_BOUND`` so integer arithmetic stays exact.
    """
    out = []
    n = case.mesh.axis_size
    for i, (op, shape) in enumerate(zip(case.spec.operands, case.operand_shapes, strict=True)):
        dt = operand_np_dtype(case, i)
        if op.values is not None:
            out.append(np.asarray(op.values(case.dims_map, n)).astype(dt).reshape(shape))
            continue
        rng = np.random.default_rng([case.seed, i, zlib.crc32(case.token.encode())])
        if np.issubdtype(dt, np.integer):
            bound = tolerances.INTEGER_INPUT_BOUND
            out.append(rng.integers(-bound, bound + 1, size=shape).astype(dt))
        else:
            out.append(rng.standard_normal(shape).astype(dt))
    return tuple(out)


def mesh_of(case: Case) -> jax.sharding.Mesh:
    return build_mesh(case.mesh, case.platform)


def operand_shardings(
    case: Case, axis_name: str | None = None, *, mesh: jax.sharding.Mesh | None = None
) -> tuple[NamedSharding, ...]:
    """Each operand's sharding on ``mesh`` (default: the case's own, :func:`mesh_of`)."""
    mesh, axis = mesh or mesh_of(case), axis_name or case.mesh.axis_name
    return tuple(NamedSharding(mesh, op.spec(axis)) for op in case.spec.operands)


def expected_out_sharding(case: Case, *, mesh: jax.sharding.Mesh | None = None) -> NamedSharding:
    """The result's sharding on ``mesh`` (default: the case's own, :func:`mesh_of`)."""
    return NamedSharding(mesh or mesh_of(case), case.spec.out_spec(case.mesh.axis_name))


def global_value(array: jax.Array) -> np.ndarray:
    """The whole value of ``array`` on the host; in a multi-process job, gathered from every rank
    (a collective: every rank must call it, as every rank runs the same checks)."""
    if array.is_fully_addressable:
        return np.asarray(array)
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(array, tiled=True))


def place(case: Case, arrays: tuple[np.ndarray, ...]) -> tuple[jax.Array, ...]:
    return tuple(jax.device_put(a, s) for a, s in zip(arrays, operand_shardings(case), strict=True))


def bound(
    family: str,
    impl: str,
    mesh: MeshConfig,
    platform: str,
    axis_name: str,
    dma_mode: str | None = None,
    detect_races: bool = False,
    dtype: str = "",
) -> Any:
    """The implementation with its static keywords bound: a function of the operands alone.

    A Pallas kernel on CPU gets ``interpret=InterpretParams(...)`` (one that takes no ``interpret=`` is
    called with TPU interpret mode forced, :func:`conformance.interpreted_kernels.interpreted`) and is traced
    with a TPU chip as the default device (:func:`conformance.targets.tpu_compiler.traced_on_a_chip`);
    on a TPU it gets no ``interpret`` and is compiled for the chip. A case at a mixed-precision ``dtype``
    (:mod:`conformance.dtypes`) tells the kernel its result's dtype, ``out_dtype=``.
    """
    record = registry.get(family, impl)
    kwargs: dict[str, Any] = {"mesh": build_mesh(mesh, platform), "axis_name": axis_name}
    kwargs.update(dtypes.kernel_keywords(dtype))
    if record.pallas and platform == "cpu":
        params = compat.interpret_params(dma_execution_mode=dma_mode or "eager", detect_races=detect_races)
        return tpu_compiler.traced_on_a_chip(interpreted_kernels.interpreted(record.fn, params, **kwargs))
    return functools.partial(record.fn, **kwargs)


@functools.cache
def jitted(
    family: str,
    impl: str,
    mesh: MeshConfig,
    platform: str,
    axis_name: str,
    dma_mode: str | None = None,
    detect_races: bool = False,
    dtype: str = "",
) -> Any:
    """``jax.jit`` of :func:`bound` (one per configuration)."""
    return jax.jit(bound(family, impl, mesh, platform, axis_name, dma_mode, detect_races, dtype))


def pullback_of(fn: Any) -> Any:
    """``(*operands, cotangent) -> gradients``: the VJP of ``fn`` with respect to its floating operands
    (every data operand of a gradient case), jitted as one module.

    This is the backward pass as a training step runs it: the forward work its
    residuals need, then the transpose. XLA removes forward work nothing uses.
    """

    def pullback(*operands_and_cotangent: jax.Array) -> tuple[jax.Array, ...]:
        *operands, cotangent = operands_and_cotangent
        # the floating operands: a ragged all-to-all's int32 offsets and sizes have no gradient
        wrt = [i for i, a in enumerate(operands) if jnp.issubdtype(a.dtype, jnp.inexact)]

        def of_floats(*floats: jax.Array) -> Any:
            given = dict(zip(wrt, floats, strict=True))
            return fn(*(given.get(i, a) for i, a in enumerate(operands)))

        _, vjp = jax.vjp(of_floats, *(operands[i] for i in wrt))
        return vjp(cotangent)

    return jax.jit(pullback)


def jitted_for(case: Case, *, axis_name: str | None = None, detect_races: bool = False) -> Any:
    axis = axis_name or case.mesh.axis_name
    keyed_by = case.dtype if dtypes.is_mixed(case.dtype) else ""  # the dtype binds a keyword only for a pair
    return jitted(
        case.family, case.impl, case.mesh, case.platform, axis, case.dma_mode, detect_races, keyed_by
    )


def largest_shard_bytes(case: Case) -> int:
    """The largest buffer one device holds for ``case``: an operand's shard or the result's."""
    sizes = [int(np.prod(s.sharding.shard_shape(s.shape))) * s.dtype.itemsize for s in abstract_args(case)]
    out_shard = expected_out_sharding(case).shard_shape(case.out_shape)
    sizes.append(int(np.prod(out_shard)) * np_dtype(case.dtype).itemsize)
    return max(sizes)


def abstract_args(case: Case, *, mesh: jax.sharding.Mesh | None = None) -> tuple[jax.ShapeDtypeStruct, ...]:
    """The operands' shapes, dtype and shardings on ``mesh`` (default: the case's own)."""
    return tuple(
        jax.ShapeDtypeStruct(shape, jnp.dtype(dtypes.operand(op.dtype or case.dtype)), sharding=sharding)
        for op, shape, sharding in zip(
            case.spec.operands, case.operand_shapes, operand_shardings(case, mesh=mesh), strict=True
        )
    )


def abstract_pullback_args(case: Case) -> tuple[jax.ShapeDtypeStruct, ...]:
    """The operands, then a cotangent shaped and sharded like the result."""
    ct = jax.ShapeDtypeStruct(
        case.out_shape, dtypes.result_np(case.dtype), sharding=expected_out_sharding(case)
    )
    return (*abstract_args(case), ct)


def make_cotangent(case: Case) -> np.ndarray:
    """A random cotangent for ``case``'s result, rounded to its dtype (seeded like the inputs)."""
    rng = np.random.default_rng([case.seed, len(case.operand_shapes), zlib.crc32(case.token.encode())])
    return rng.standard_normal(case.out_shape).astype(dtypes.result_np(case.dtype))


def _compile_key(case: Case) -> Case:
    return dataclasses.replace(case, seed=0)


def compile_lowered(lowered: Any, platform: str) -> Any:
    """``lowered.compile()``, with the suite's CPU compile options on the CPU host
    (:func:`conformance.compat.cpu_compiler_options`: cheaper code generation, the same collectives;
    a compile for a GPU or TPU keeps the backend's defaults); in a multi-process
    job, only once every rank has traced the same program (else each raises, naming the ranks)."""
    from conformance.jobs import distributed

    distributed.agree_on_program(lowered, "this call")
    return lowered.compile(compiler_options=compat.cpu_compiler_options() if platform == "cpu" else None)


@functools.cache
def _compiled(key: Case, detect_races: bool) -> Any:
    lowered = jitted_for(key, detect_races=detect_races).lower(*abstract_args(key))
    return compile_lowered(lowered, key.platform)


def interpreted(case: Case) -> bool:
    """Whether ``case`` runs in TPU interpret mode: a Pallas kernel on the CPU host, in a DMA mode."""
    return case.platform == "cpu" and case.implementation.pallas and case.dma_mode is not None


def compiled(case: Case, *, detect_races: bool | None = None) -> Any:
    """The compiled executable for ``case``'s shapes (cached; the seed does not matter).

    ``detect_races``: by default on for a case in interpret mode (:func:`interpreted`): every check of
    the case reads the one executable its shared run uses (:mod:`conformance.shared_runs`); race
    detection changes no value, and an interpreted kernel's compile costs more than its run."""
    return _compiled(_compile_key(case), interpreted(case) if detect_races is None else detect_races)


@functools.cache
def _jitted_pullback(key: Case) -> Any:
    fn = bound(
        key.family, key.impl, key.mesh, key.platform, key.mesh.axis_name, key.dma_mode, dtype=key.dtype
    )
    return pullback_of(fn)


def jitted_pullback(case: Case) -> Any:
    """The jitted VJP of ``case``'s implementation (:func:`pullback_of`; one per shape)."""
    return _jitted_pullback(_compile_key(case))


@functools.cache
def _compiled_pullback(key: Case) -> Any:
    return compile_lowered(jitted_pullback(key).lower(*abstract_pullback_args(key)), key.platform)


def compiled_pullback(case: Case) -> Any:
    """The compiled VJP of ``case`` (cached per shape)."""
    return _compiled_pullback(_compile_key(case))


def _unjitted_for_target(case: Case) -> Any:
    """The implementation as a target backend sees it: a Pallas kernel without ``interpret``."""
    return kernel_on(case, mesh_of(case))


def kernel_on(case: Case, mesh: jax.sharding.Mesh) -> Any:
    """``case``'s implementation on ``mesh`` (a CPU mesh, a TPU or GPU topology's), a function of the
    operands alone: the kernel as a chip runs it (no ``interpret``), told a pair's result dtype."""
    return functools.partial(
        case.implementation.fn, mesh=mesh, axis_name=case.mesh.axis_name, **dtypes.kernel_keywords(case.dtype)
    )


@functools.lru_cache(maxsize=16)
def _traced_for_targets(key: Case, backward: bool) -> Any:
    """The forward pass (or the VJP) traced once, to be lowered for each target: tracing an
    unrolled ring is most of a lowering's time."""
    fn = _unjitted_for_target(key)
    if backward:
        return pullback_of(fn).trace(*abstract_pullback_args(key))
    return jax.jit(fn).trace(*abstract_args(key))


def traced_for_targets(case: Case) -> Any:
    """``case``'s forward pass traced, as every target's lowering starts from it (cached)."""
    return _traced_for_targets(_compile_key(case), False)


def lower_exactly(case: Case, target: str) -> Any:
    """``case`` lowered (not compiled) for another backend, e.g. ``"tpu"`` or ``"cuda"`` (cached: the
    cross-lowering and overlap checks of one case read the same module).

    A Pallas kernel is lowered as the real kernel (no ``interpret``); a shape it
    refuses on a TPU raises :class:`conformance.targets.mosaic.TpuConstraintError`.
    """
    return _lowered_for_target(_compile_key(case), target)


@functools.lru_cache(maxsize=16)
def _lowered_for_target(key: Case, target: str) -> Any:
    return compat.lower_traced(_traced_for_targets(key, False), target)


def tpu_lowerable(case: Case, target: str, lower: Any) -> Any:
    """``lower(case)``; if a Pallas kernel refuses the case's shape on a TPU, ``lower`` at the
    family's TPU-native dims instead (the refusal itself is the ``tpu_layout`` check's business)."""
    try:
        return lower(case)
    except mosaic.TpuConstraintError:
        if target != "tpu" or not case.spec.tpu_native_dims or case.at_tpu_native_dims:
            raise
        return lower(at_tpu_native_dims(case))


def at_tpu_native_dims(case: Case) -> Case:
    """``case`` at its family's TPU-native dims."""
    native = case.spec.tpu_native_dims
    return dataclasses.replace(case, dims=tuple((k, int(native[k])) for k in case.spec.dims))


def lowered_case(case: Case, target: str) -> Case:
    """The case :func:`lowered_for` lowers for ``target``: ``case``, or ``case`` at the TPU-native dims
    where a Pallas kernel refuses its shape on a TPU (whose byte bounds are then the native dims')."""
    if target != "tpu" or not case.spec.tpu_native_dims or case.at_tpu_native_dims:
        return case
    try:
        lower_exactly(case, target)
    except mosaic.TpuConstraintError:
        return at_tpu_native_dims(case)
    except Exception:  # any other error is the lowering's, reported where the module is lowered
        return case
    return case


def lowered_for(case: Case, target: str) -> Any:
    """:func:`lower_exactly`, at the TPU-native dims where a Pallas kernel refuses the case's on a TPU."""
    return tpu_lowerable(case, target, lambda c: lower_exactly(c, target))


def lowered_pullback_for(case: Case, target: str) -> Any:
    """``case``'s VJP lowered for another backend (what that backend's compiler is given)."""
    return tpu_lowerable(
        case, target, lambda c: compat.lower_traced(_traced_for_targets(_compile_key(c), True), target)
    )


def execute(
    case: Case, *, detect_races: bool | None = None, inputs: tuple[np.ndarray, ...] | None = None
) -> tuple[tuple[np.ndarray, ...], jax.Array]:
    """Run ``case`` once on fresh inputs (or on ``inputs``), in the executable of :func:`compiled`;
    returns (float64 inputs, output)."""
    inputs = make_inputs(case) if inputs is None else inputs
    out = watchdog.run_guarded(case, compiled(case, detect_races=detect_races), place(case, inputs))
    return tuple(a.astype(np.float64) for a in inputs), out


def execute_eagerly(case: Case) -> jax.Array:
    """Run ``case`` once outside ``jax.jit`` (the kernel's Python on concrete arrays, as a user
    calling it eagerly runs it), on the inputs :func:`execute_cached` uses."""
    fn = bound(
        case.family, case.impl, case.mesh, case.platform, case.mesh.axis_name, case.dma_mode, dtype=case.dtype
    )
    return watchdog.run_guarded(case, fn, place(case, make_inputs(case)))


def execute_pullback(
    case: Case, *, inputs: tuple[np.ndarray, ...] | None = None, cotangent: np.ndarray | None = None
) -> tuple[tuple[np.ndarray, ...], np.ndarray, tuple[jax.Array, ...]]:
    """Run ``case``'s VJP on fresh inputs and a random cotangent (or on the ones given):
    (float64 inputs, float64 cotangent, gradients)."""
    inputs = make_inputs(case) if inputs is None else inputs
    ct = make_cotangent(case) if cotangent is None else cotangent
    placed = (*place(case, inputs), jax.device_put(ct, expected_out_sharding(case)))
    grads = watchdog.run_guarded(case, compiled_pullback(case), placed)
    return tuple(a.astype(np.float64) for a in inputs), ct.astype(np.float64), tuple(grads)


@functools.cache
def execute_cached(case: Case) -> tuple[tuple[np.ndarray, ...], jax.Array]:
    """:func:`execute`, memoized: the fixed-shape checks of one case share a single run."""
    return execute(case)


def held_for(case: Case) -> tuple[str, str, MeshConfig, str]:
    """What the caches of this module are shared within: one implementation on one mesh and platform."""
    return (case.family, case.impl, case.mesh, case.platform)


def release_cases() -> None:
    """Drop every program, trace, lowering and run this module holds (its caches above).

    :func:`conformance.run.outcomes.hold` calls it when a check's case is another :func:`held_for`
    than the last one's: the suite runs one implementation's tests on one mesh together
    (:func:`conformance.plugin.xdist_workers.in_groups`), and they share what is held while it is
    (``tox -e cpu`` in one process: 0.75 GB resident at its peak, not 1.8 GB).
    """
    held = (jitted, _compiled, _jitted_pullback, _compiled_pullback, _traced_for_targets)
    for cache in (*held, _lowered_for_target, execute_cached):
        cache.cache_clear()
