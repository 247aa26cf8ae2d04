"""The public registry that built-in and third-party kernels enter the same way.

    import conformance

    @conformance.register("allgather_matmul", name="my_ring_matmul")
    def my_ring_matmul(lhs, rhs, *, mesh, axis_name): ...

    conformance.implementations("allgather_matmul")  # -> {name: callable}

``pytest conformance --kernels=MODULE`` imports ``MODULE`` so its registrations
join the run; importing ``conformance.kernels`` registers every built-in.

What a kernel supports is declared here too, and the suite checks it on exactly
that: ``dtypes`` (the dtype names it claims), ``platforms`` and ``supports``, a
predicate over one case's ``dims``, ``dtype``, ``axis_size`` and ``mesh_shape``
returning ``None`` for a case it claims or a reason for one it does not.
Cases outside the declaration are reported as *not claimed*, never run.
"""

from __future__ import annotations

import dataclasses
import difflib
import fnmatch
import functools
import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, TypeVar

from conformance import dtypes as dtypes_lib

F = TypeVar("F", bound=Callable[..., Any])


class Supports(Protocol):
    """``supports(*, dims, dtype, axis_size, mesh_shape) -> None | str``: ``None`` claims the case;
    a string is the reason the kernel does not (shown as "not claimed: <reason>")."""

    def __call__(
        self, *, dims: Mapping[str, int], dtype: str, axis_size: int, mesh_shape: Mapping[str, int]
    ) -> str | None: ...


def multiples_of(**multiples: int) -> Supports:
    """A ``supports`` predicate: each named dim a multiple of its value, e.g.
    ``multiples_of(rows_per_shard=8)`` for a kernel that tiles rows by 8."""
    for dim, m in multiples.items():
        if not isinstance(m, int) or m < 1:
            raise ValueError(f"multiples_of({dim}={m!r}): a positive integer is needed")

    def supports(*, dims: Mapping[str, int], dtype: str, axis_size: int, mesh_shape) -> str | None:
        bad = [f"{d}={dims[d]} is not a multiple of {m}" for d, m in multiples.items() if dims[d] % m]
        return "; ".join(bad) or None

    supports.__qualname__ = "multiples_of(" + ", ".join(f"{d}={m}" for d, m in multiples.items()) + ")"
    return supports


@dataclasses.dataclass(frozen=True)
class Implementation:
    """One registered kernel: the callable plus what the suite needs to know about it."""

    family: str
    name: str
    fn: Callable[..., Any]
    #: XLA's own op, the oracle the others are compared with; exempt from the
    #: family's collective rule (it is what the rule is measured against).
    baseline: bool = False
    #: The compiler's own form of the family's op (``jax.jit`` of its math with its shardings, no
    #: ``shard_map``): a baseline the schedule and memory checks hold every kernel beside.
    compilers_own: bool = False
    #: It declares it leaves no more bytes exposed than the compiler's own collective matmul in the
    #: compiled schedules: being behind it fails the schedule checks (without it, reported).
    ahead_of_compiler: bool = False
    #: The same kernel with its pacing taken out (a ring that makes each step's transfer wait for the
    #: previous step's matmul, :mod:`conformance.kernels._ring`): where another kernel's compiled
    #: schedule leaves its transfers exposed, the schedule checks compile both to measure on that
    #: compiler, at that topology and size, what pacing does.
    unpaced: Callable[..., Any] | None = None
    #: It sends half of each block each way round the ring (both directions of every link at once):
    #: the direction-balance check holds its compiled module's bytes per ring direction to the halves.
    bidirectional: bool = False
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
    #: Dtype names it claims (``None``: every dtype of the family but its mixed-precision pairs,
    #: :mod:`conformance.dtypes`, which a kernel claims by naming them: it is then called with
    #: ``out_dtype=``).
    dtypes: tuple[str, ...] | None = None
    #: Platforms it claims, of cpu/gpu/tpu (``None``: every platform).
    platforms: tuple[str, ...] | None = None
    #: The shape/mesh predicate (see :class:`Supports`); ``None`` claims every case.
    supports: Supports | None = None
    #: The module whose ``register`` call entered it (what ``--kernels`` must import to find it).
    registered_by: str = ""
    #: Modules it needs at run time (e.g. ``("cupy",)``); where one cannot be imported its checks
    #: skip naming the module and the import error.
    requires: tuple[str, ...] = ()
    #: The family's own registration keywords (its spec's ``registration_options``), every one
    #: present: what it passed, else the option's default.
    options: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    #: One point of the tuning space it declared (``configs=``): the keywords it is called with, and
    #: the name it was registered under (its configurations' names are ``NAME.key.value...``).
    config: tuple[tuple[str, Any], ...] = ()
    configured_from: str = ""

    @property
    def other_reductions(self) -> tuple[str, ...]:
        """The reductions it declares beside its family's own (the reduction families' ``reductions``
        option), each checked by calling it with ``reduction=NAME``."""
        return tuple(r for r in self.options.get("reductions", ()) if r != "add")

    def missing_requirement(self) -> str | None:
        """``None`` if every module of :attr:`requires` imports, else which one and why not."""
        import importlib

        for module in self.requires:
            try:
                importlib.import_module(module)
            except Exception as e:  # ImportError, or a library that fails to load (no driver)
                return f"needs {module}, which does not import here ({type(e).__name__}: {e})"
        return None

    @property
    def module(self) -> str:
        """The module to import to find this implementation: the one that registered it."""
        return self.registered_by or getattr(self.fn, "__module__", "") or ""

    @property
    def is_builtin(self) -> bool:
        return self.module == "conformance.kernels" or self.module.startswith("conformance.kernels.")

    def claims(
        self,
        *,
        platform: str,
        dtype: str,
        dims: Mapping[str, int],
        mesh_shape: Mapping[str, int],
        axis_size: int,
    ) -> str | None:
        """``None`` if this implementation claims the case, else why not (its declaration's words)."""
        if self.platforms is not None and platform not in self.platforms:
            return f"platform {platform} (claims {', '.join(self.platforms)})"
        if self.dtypes is not None and dtype not in self.dtypes:
            return f"dtype {dtype} (claims {', '.join(self.dtypes)})"
        if self.dtypes is None and dtypes_lib.is_mixed(dtype):
            return (
                f"dtype {dtype}: {dtypes_lib.describe(dtype)}, which a kernel takes with out_dtype= and "
                "claims by naming it in register(dtypes=...)"
            )
        if self.supports is None:
            return None
        reason = self.supports(dims=dict(dims), dtype=dtype, axis_size=axis_size, mesh_shape=dict(mesh_shape))
        if reason is not None and not isinstance(reason, str):
            raise TypeError(
                f"{self.family}/{self.name}: supports() must return None or a reason string, got {reason!r}"
            )
        return reason


_REGISTRY: dict[str, dict[str, Implementation]] = {}


def _known_families() -> tuple[str, ...]:
    from conformance import specs

    return tuple(specs.FAMILIES)


def _family_options(family: str, name: str, given: Mapping[str, object]) -> dict[str, object]:
    """``given`` checked against the family's registration options, the others at their defaults."""
    from conformance import specs

    declared = getattr(specs.get(family), "registration_options", {})
    unknown = sorted(set(given) - set(declared))
    if unknown:
        # a typo of any keyword register takes: its own (dtypes=, pallas=) and the family's
        own = [p for p in inspect.signature(register).parameters if p not in ("family", "options")]
        close = {u: difflib.get_close_matches(u, [*own, *declared], n=1) for u in unknown}
        meant = "; ".join(f"{u!r} (did you mean {m[0]!r}?)" for u, m in close.items() if m)
        raise TypeError(
            f"register({family!r}, name={name!r}): unexpected keyword(s) {unknown}"
            + (f": {meant}" if meant else "")
            + f"; the {family} family's own are: {', '.join(declared) or 'none'}"
            + f"; every family's: {', '.join(own)}"
        )
    for key, value in given.items():
        if not declared[key].accepts(value):
            raise TypeError(
                f"register({family!r}, name={name!r}): {key} must be {declared[key].expects}, got {value!r}"
            )
    return {key: given.get(key, option.default) for key, option in declared.items()}


def register(
    family: str,
    *,
    name: str,
    baseline: bool = False,
    compilers_own: bool = False,
    ahead_of_compiler: bool = False,
    unpaced: Callable[..., Any] | None = None,
    bidirectional: bool = False,
    description: str = "",
    pallas: bool = False,
    lowering_targets: tuple[str, ...] | None = None,
    differentiable: bool = False,
    dtypes: tuple[str, ...] | None = None,
    platforms: tuple[str, ...] | None = None,
    supports: Supports | None = None,
    requires: tuple[str, ...] = (),
    configs: Sequence[Mapping[str, object]] = (),
    **options: object,
) -> Callable[[F], F]:
    """Register ``fn`` as an implementation of ``family`` under ``name``; returns ``fn`` unchanged.

    ``baseline=True`` marks XLA's own op written as the family's math (the oracle of accuracy and
    memory); ``compilers_own=True`` marks the family's math left to the compiler (``jax.jit`` with
    the family's shardings), the collective matmul XLA builds by itself. Both are exempt from the
    family's collective rule and reported, not judged, by the schedule and memory checks.
    ``ahead_of_compiler=True`` declares a kernel leaves no more bytes exposed than the compiler's own
    in the compiled schedules: there, being behind fails (``--behind-compiler=fail`` does so for all).
    ``unpaced`` is the same kernel with its ring's pacing taken out (same calling convention): a
    paced ring gives it so that a failing schedule verdict can say, measured, what pacing does.
    ``bidirectional=True`` declares a ring that sends half of each block each way: its bytes per ring
    direction are held to the halves in the compiled module (split a third one way and two thirds the
    other, a ring passes every other check and takes a third longer on a link).

    ``pallas=True`` declares a Pallas TPU kernel taking an ``interpret`` keyword;
    its default ``lowering_targets`` is ``("tpu",)``, otherwise ``("tpu", "cuda")``.
    ``differentiable=True`` opts into the gradient checks (VJP against numpy
    float64) and the backward-pass collective audit.

    What it supports (each ``None``: everything): ``dtypes``, a tuple of dtype names;
    ``platforms``, of ``"cpu"``, ``"gpu"``, ``"tpu"``; ``supports``, a callable taking
    keyword arguments ``dims``, ``dtype``, ``axis_size`` and ``mesh_shape`` (mesh axis name
    -> size) returning ``None`` for a case it claims or the reason it does not
    (:func:`multiples_of` builds the common one). The checks run on the cases it claims
    (draws and fixed shapes adapt) and report the others as not claimed. ``requires`` names
    modules it imports at run time (its checks skip, naming the module, where one is missing).

    ``configs``: the kernel's tuning space (tile sizes, steps in flight), each a mapping of keywords it
    takes: every configuration is registered, and checked, as an implementation of its own, named
    ``NAME.key.value`` (``my_rs.tile_rows.8``); ``--impl=NAME`` selects them all.

    ``options``: the keywords the family's spec adds (``registration_options``), e.g. the
    point-to-point family's ``accepts_timeout=True`` (opts into the timeout check) and
    ``resources=`` (counters of what the implementation holds, which must not grow).
    """
    registered_by = _caller_module()
    if lowering_targets is None:
        lowering_targets = ("tpu",) if pallas else ("tpu", "cuda")
    known = _known_families()
    if family not in known:
        close = difflib.get_close_matches(family, known, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(f"unknown kernel family {family!r}{hint}; known families: {', '.join(known)}")
    if not name or not name.replace("_", "").replace("-", "").isalnum():
        raise ValueError(f"implementation name {name!r} must be non-empty letters, digits, _ or -")
    family_dtypes = _family_dtypes(family)
    if dtypes is not None:
        if isinstance(dtypes, str) or not dtypes:
            raise TypeError(f"register({family!r}, name={name!r}): dtypes must be a non-empty tuple of names")
        unknown = [d for d in dtypes if d not in family_dtypes]
        if unknown:
            raise ValueError(
                f"register({family!r}, name={name!r}): dtypes {unknown} are not dtypes of "
                f"{family!r} ({', '.join(family_dtypes)})"
            )
        dtypes = tuple(dtypes)
    if platforms is not None:
        if isinstance(platforms, str) or not set(platforms) <= {"cpu", "gpu", "tpu"} or not platforms:
            raise ValueError(
                f"register({family!r}, name={name!r}): platforms must be a tuple of "
                f"'cpu', 'gpu', 'tpu'; got {platforms!r}"
            )
        platforms = tuple(platforms)
    if unpaced is not None and not callable(unpaced):
        raise TypeError(f"register({family!r}, name={name!r}): unpaced must be callable, got {unpaced!r}")
    if supports is not None and not callable(supports):
        raise TypeError(f"register({family!r}, name={name!r}): supports must be callable, got {supports!r}")
    if isinstance(requires, str) or not all(isinstance(m, str) and m for m in requires):
        raise TypeError(
            f"register({family!r}, name={name!r}): requires must be a tuple of module names, got {requires!r}"
        )
    options = _family_options(family, name, options)
    points = _configs(family, name, configs)

    def decorator(fn: F) -> F:
        if not callable(fn):
            raise TypeError(f"register({family!r}, name={name!r}) needs a callable, got {fn!r}")
        for config in points or ((),):
            _enter(config_name(name, config), configured(fn, config), config, name if config else "")
        return fn

    def _enter(
        name: str, fn: Callable[..., Any], config: tuple[tuple[str, Any], ...], configured_from: str
    ) -> None:
        impl = Implementation(
            family,
            name,
            fn,
            baseline=baseline or compilers_own,
            compilers_own=compilers_own,
            ahead_of_compiler=ahead_of_compiler,
            unpaced=unpaced,
            bidirectional=bool(bidirectional),
            description=description + (f" (configuration {dict(config)})" if config else ""),
            pallas=pallas,
            lowering_targets=tuple(lowering_targets),
            differentiable=differentiable,
            dtypes=dtypes,
            platforms=platforms,
            supports=supports,
            registered_by=registered_by,
            requires=tuple(requires),
            options=options,
            config=config,
            configured_from=configured_from,
        )
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

    return decorator


def _configs(family: str, name: str, configs: object) -> tuple[tuple[tuple[str, Any], ...], ...]:
    """``configs`` checked: a sequence of mappings of keyword names to non-negative ints, bools or
    names (what goes into an implementation's name), each distinct."""
    where = f"register({family!r}, name={name!r})"
    if isinstance(configs, (str, Mapping)) or not isinstance(configs, Sequence):
        raise TypeError(f"{where}: configs must be a sequence of dicts of keywords, got {configs!r}")
    points = []
    for config in configs:
        if not isinstance(config, Mapping) or not config:
            raise TypeError(f"{where}: each config must be a non-empty dict of keywords, got {config!r}")
        for key, value in config.items():
            ok = type(value) is bool or (type(value) is int and value >= 0)
            ok = ok or (isinstance(value, str) and value.replace("_", "").isalnum())
            if not (isinstance(key, str) and key.isidentifier()) or not ok:
                raise TypeError(
                    f"{where}: config {dict(config)!r}: each key must be a keyword name and each value a "
                    f"non-negative int, a bool or a name (it goes into the implementation's name), got "
                    f"{key!r}: {value!r}"
                )
        points.append(tuple(config.items()))
    if len(set(points)) != len(points):
        raise ValueError(f"{where}: configs repeat one: {[dict(p) for p in points]}")
    return tuple(points)


def config_name(name: str, config: tuple[tuple[str, Any], ...]) -> str:
    """The name a configuration of ``name`` is registered under: ``name.tile_rows.8`` (every key and
    value in order; ``name`` itself where there is none)."""
    return ".".join([name, *(f"{key}.{value}" for key, value in config)])


def configured(fn: Callable[..., Any], config: tuple[tuple[str, Any], ...]) -> Callable[..., Any]:
    """``fn`` called with ``config``'s keywords besides the suite's (``fn`` itself where there are none)."""
    if not config:
        return fn

    @functools.wraps(fn)
    def kernel(*args: Any, **kwargs: Any) -> Any:
        return fn(*args, **dict(config), **kwargs)

    return kernel


def _caller_module() -> str:
    """The module whose code called :func:`register` (outside this module)."""
    frame = inspect.currentframe()
    try:
        while frame is not None and frame.f_globals.get("__name__") == __name__:
            frame = frame.f_back
        return frame.f_globals.get("__name__", "") if frame is not None else ""
    finally:
        del frame


def _family_dtypes(family: str) -> tuple[str, ...]:
    from conformance import specs

    return specs.get(family).dtypes


def implementations(family: str) -> dict[str, Callable[..., Any]]:
    """``{name: callable}`` for every implementation registered for ``family``."""
    return {name: impl.fn for name, impl in sorted(_REGISTRY.get(family, {}).items())}


def registered(family: str, pattern: str | None = None) -> list[Implementation]:
    """The :class:`Implementation` records of ``family`` whose names match ``pattern`` (a glob)."""
    impls = sorted(_REGISTRY.get(family, {}).values(), key=lambda i: i.name)
    if pattern:
        globs = [p.strip() for p in pattern.split(",") if p.strip()]
        impls = [
            i
            for i in impls
            if any(fnmatch.fnmatchcase(i.name, g) or fnmatch.fnmatchcase(i.configured_from, g) for g in globs)
        ]
    return impls


def reference_baseline(family: str) -> Implementation | None:
    """The family's baseline written as its math (``baseline=True``, not the compiler's own form) in
    the family's own form (a baseline of a derived form, e.g. XLA's reduce-scatter along the partials'
    columns, is exempt from the rules as XLA's own op but is not the one others are held against):
    what accuracy and memory are held against; ``None`` if none is registered."""
    from conformance import specs

    family_form = specs.get(family)
    return next(
        (
            i
            for i in registered(family)
            if i.baseline and not i.compilers_own and spec_of(family, i.name) is family_form
        ),
        None,
    )


def compilers_own(family: str) -> Implementation | None:
    """The family's op left to the compiler (``compilers_own=True``), ``None`` if none is registered."""
    return next((i for i in registered(family) if i.compilers_own), None)


def get(family: str, name: str) -> Implementation:
    try:
        return _REGISTRY[family][name]
    except KeyError:
        raise NotRegistered(family, name) from None


class NotRegistered(KeyError):
    """An implementation name the registry does not hold (a missing ``--kernels`` module, a typo)."""

    def __init__(self, family: str, name: str) -> None:
        names = ", ".join(sorted(_REGISTRY.get(family, {}))) or "none"
        super().__init__(
            f"no implementation {name!r} of {family!r} is registered (registered: {names}); "
            "is the module that registers it passed with --kernels?"
        )
        self.family, self.name = family, name

    def __str__(self) -> str:
        return self.args[0]


def spec_of(family: str, impl: str) -> Any:
    """The spec ``impl``'s cases are held to: its family's, or the form its registration options derive
    from it (:attr:`conformance.specs.base.RegistrationOption.derive`: the batched form for
    ``batch_dims=1``, the transposed one for a reduce-scatter's ``scatter_dimension=1``); the family's
    for a name no module registered (a replay's, a report's)."""
    from conformance import specs

    spec = specs.get(family)
    record = _REGISTRY.get(family, {}).get(impl)
    if record is None:
        return spec
    declared = getattr(spec, "registration_options", {})
    derived = tuple(
        (key, value)
        for key, value in record.options.items()
        if declared[key].derive is not None and value != declared[key].default
    )
    return _derived(family, id(spec), derived) if derived else spec


@functools.lru_cache(maxsize=16)
def _derived(family: str, spec_id: int, options: tuple[tuple[str, Any], ...]) -> Any:
    """The family's spec derived by each of ``options`` in turn (``spec_id``: the spec's identity, so
    that a family added again is derived again)."""
    from conformance import specs

    spec = specs.get(family)
    for key, value in options:
        spec = spec.registration_options[key].derive(spec, value)
    return spec
