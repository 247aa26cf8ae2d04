"""A case compiled by the real compiler of a TPU or GPU topology (libtpu's, XLA:GPU's), once, for every
check of the compile tiers that reads it: the forward pass, the backward pass, the module text and
its schedule; a compiler's refusal as the kernel's failure, quoted."""

from __future__ import annotations

import functools
from typing import Any

import jax

from conformance import compat, dtypes, hlo, runner
from conformance import session as session_lib
from conformance.checks.base import call_kernel, fail
from conformance.runner import Case
from conformance.targets import tpu_compiler


def compiler_of(topology: str) -> Any:
    """The compiler module that compiles for ``topology``: ``h100:1x1x8`` is XLA:GPU's, ``v5e:2x4``
    libtpu's."""
    from conformance.targets import gpu_compiler

    return gpu_compiler if topology.split(":", 1)[0] in gpu_compiler.TARGETS else tpu_compiler


def compiled_on_topology(case: Case, topology: str, *, options: tuple[tuple[str, object], ...] = ()) -> Any:
    """``case``'s kernel compiled by the real compiler of ``topology`` (its forward pass, on a mesh of
    the case's shape over the topology's devices; :func:`compiler_of`), with compile ``options``
    besides the run's: one compile shared by every check of the TPU (or GPU) tier.
    :class:`~conformance.targets.tpu_compiler.CompilerRefusal` where the compiler refuses it."""
    return _compiled(case, topology, options, session_lib.current().settings.compiler_options)


@functools.lru_cache(maxsize=64)
def _compiled(case: Case, topology: str, options: tuple, run_options: tuple) -> Any:
    # run_options (the run's --compiler-option pairs, which compile_on reads) only key the cache
    compiler = compiler_of(topology)
    mesh = compiler.mesh_on(case.mesh, topology)
    fn = runner.kernel_on(case, mesh)
    return compiler.compile_on(fn, runner.abstract_args(case, mesh=mesh), options=dict(options) or None)


def compiled_pullback_on_topology(case: Case, topology: str) -> Any:
    """``case``'s VJP (:func:`conformance.runner.pullback_of`: the backward pass as a training step
    runs it) compiled by the real compiler of ``topology``."""
    return _compiled_pullback(case, topology, session_lib.current().settings.compiler_options)


@functools.lru_cache(maxsize=32)
def _compiled_pullback(case: Case, topology: str, run_options: tuple) -> Any:
    compiler = compiler_of(topology)
    mesh = compiler.mesh_on(case.mesh, topology)
    fn = runner.kernel_on(case, mesh)
    out = runner.expected_out_sharding(case, mesh=mesh)
    cotangent = jax.ShapeDtypeStruct(case.out_shape, dtypes.result_np(case.dtype), sharding=out)
    args = (*runner.abstract_args(case, mesh=mesh), cotangent)
    return compiler.compile_on(runner.pullback_of(fn), args)


def module_text(compiled: Any, topology: str) -> str:
    """The compiled module's text; a host limit where this jaxlib gives none (jaxlib 0.6.2's
    deviceless GPU executable: "GetHloModules is not supported")."""
    text = compiled.as_text()
    if text is None:
        raise compat.HostLimit(
            f"jaxlib {jax.__version__}'s {compiler_of(topology).NAME} executable compiled for {topology} "
            "gives no module text to read"
        )
    return text


def compiled_or_fail(case: Case, topology: str, check: str) -> Any:
    """:func:`compiled_on_topology`; the compiler's refusal is the kernel's failure, quoted."""

    def compile_it() -> Any:
        try:
            return compiled_on_topology(case, topology)
        except tpu_compiler.CompilerRefusal as refusal:
            raise fail(
                case,
                check,
                f"the {compiler_of(topology).NAME} compiler refuses it ({topology})",
                [f"compiler       : {refusal}"],
            ) from refusal

    return call_kernel(case, check, compile_it)


def schedule_of(compiled: Any, topology: str) -> tuple[hlo.HloModule, hlo.Schedule]:
    """The compiled module, parsed, and its schedule (:func:`conformance.hlo.schedule`)."""
    module = hlo.parse_module(module_text(compiled, topology))
    return module, hlo.schedule(module)
