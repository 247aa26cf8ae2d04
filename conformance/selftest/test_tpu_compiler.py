"""The real TPU compiler as the judge of TPU layout: where libtpu is, what it says, and what a host
without it is told.

The kernels the layout check must reject are in the broken-kernel sweep
(``broken_pallas_refuses_what_the_compiler_compiles``: a false refusal; ``broken_pallas_untiled_halves``
on libtpu before 0.0.42: a missed one); here the verdicts at a dtype no libtpu takes (float16), the
compile tier's own pieces, and the skip of a host without libtpu.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import conformance.kernels
import conformance.selftest.broken_pallas_kernels  # noqa: F401  (registers the broken rings)
from conformance import checks, registry
from conformance.fixtures.meshes import parse_mesh
from conformance.run.outcomes import run_here
from conformance.runner import Case
from conformance.session import Session
from conformance.targets import tpu_compiler

pytestmark = pytest.mark.selftest

needs_libtpu = pytest.mark.skipif(
    not tpu_compiler.available(), reason=f"no TPU compiler here: {tpu_compiler.unavailable_reason()}"
)
NATIVE = {"rows_per_shard": 96, "cols": 128}


def _layout(impl: str, dtype: str, dims: dict[str, int] = NATIVE):
    case = Case.make("all_gather", impl, parse_mesh("4-x-explicit"), dims, dtype)
    return run_here(checks.CHECKS["tpu_layout"], case, Session())


def test_this_jax_pins_a_libtpu() -> None:
    """What a TPU host with this JAX runs, read from JAX's own metadata (the kernels' refusal rules
    and the install command depend on it)."""
    pinned = tpu_compiler.pinned_libtpu_version()
    assert pinned and tpu_compiler.version_tuple(pinned) >= (0, 0, 17), pinned
    assert tpu_compiler.libtpu_in_use() >= (0, 0, 17)


def test_a_host_without_libtpu_skips_the_layout_naming_the_install_command(monkeypatch) -> None:
    monkeypatch.setattr(tpu_compiler, "libtpu_version", lambda: None)
    tpu_compiler.unavailable_reason.cache_clear()
    try:
        outcome = _layout("pallas_ring_all_gather_unidirectional", "float32")
    finally:
        monkeypatch.undo()
        tpu_compiler.unavailable_reason.cache_clear()
    assert outcome.verdict == "skipped", outcome
    assert f'pip install "jax[tpu]=={jax.__version__}"' in outcome.message, outcome.message
    assert "judged by the real TPU compiler" in outcome.message, outcome.message


@needs_libtpu
def test_a_topology_mesh_compiles_for_real() -> None:
    """The XLA baseline all-gather on 8 v5e chips: XLA:TPU's module, TPU layouts, a memory analysis."""
    mesh = tpu_compiler.mesh_on(parse_mesh("8-x-explicit"), "v5e:2x4")
    assert {d.platform for d in mesh.devices.flat} == {"tpu"}
    x = jax.ShapeDtypeStruct((8 * 96, 128), jnp.float32, sharding=NamedSharding(mesh, P("x")))
    xla_all_gather = registry.get("all_gather", "xla_all_gather").fn
    compiled = tpu_compiler.compile_on(lambda a: xla_all_gather(a, mesh=mesh, axis_name="x"), (x,))
    text = compiled.as_text()
    assert "all-gather" in text and "T(8,128)" in text, text[:2000]
    assert compiled.memory_analysis().output_size_in_bytes == 8 * 96 * 128 * 4  # the whole result
    assert tpu_compiler.judge("v5e:2x4").startswith("libtpu 0.0.")


@needs_libtpu
@pytest.mark.parametrize("chips", [1, 2, 3, 4, 5, 6, 7, 8, 12])
def test_every_standard_mesh_size_has_a_topology_that_compiles(chips: int) -> None:
    """A v5e slice of as many chips, the first chips of a v6e slice (1 and 2), or of a v5p slice whose
    chip count the ring divides (3, 5, 6, 7; libtpu refuses XLA's all-gather over 6 of 8 v6e chips)."""
    mesh = tpu_compiler.mesh_on(parse_mesh(f"{chips}-x-explicit"))
    assert mesh.devices.size == chips
    x = jax.ShapeDtypeStruct((chips * 8, 128), jnp.float32, sharding=NamedSharding(mesh, P("x")))
    xla_all_gather = registry.get("all_gather", "xla_all_gather").fn
    tpu_compiler.compile_on(lambda a: xla_all_gather(a, mesh=mesh, axis_name="x"), (x,))


@needs_libtpu
def test_the_compiler_refusal_is_quoted() -> None:
    """A program the compiler refuses (a float16 kernel: no libtpu takes one) raises CompilerRefusal
    with the compiler's words, not a traceback."""
    from jax.experimental import pallas as pl

    def copy(x_ref, o_ref):
        o_ref[...] = x_ref[...]

    call = pl.pallas_call(copy, out_shape=jax.ShapeDtypeStruct((8, 128), jnp.float16))
    mesh = tpu_compiler.mesh_on(parse_mesh("4-x-explicit"))
    per_device = jax.shard_map(call, mesh=mesh, in_specs=P("x"), out_specs=P("x"), check_vma=False)
    x = jax.ShapeDtypeStruct((4 * 8, 128), jnp.float16, sharding=NamedSharding(mesh, P("x")))
    with pytest.raises(tpu_compiler.CompilerRefusal) as refusal:
        tpu_compiler.compile_on(per_device, (x,))
    assert "Mosaic failed to compile TPU kernel" in str(refusal.value), str(refusal.value)


@needs_libtpu
def test_float16_is_refused_by_the_builtin_and_by_the_compiler() -> None:
    """No libtpu takes float16 kernel arguments: the built-in refuses them (through
    conformance.refuse_on_tpu), and the compiler, asked with the refusal set aside, agrees."""
    outcome = _layout("pallas_ring_all_gather_bidirectional", "float16")
    assert outcome.verdict == "passed", outcome.message
    (record,) = outcome.records
    assert "float16" in record.refusal and record.compiler_refusal, record


@needs_libtpu
def test_a_kernel_that_lowers_what_the_compiler_refuses_fails_quoting_it() -> None:
    """The plain ring of the broken kernels refuses nothing: at float16 every libtpu refuses it."""
    outcome = _layout("broken_pallas_untiled_halves", "float16")
    assert outcome.verdict == "failed", outcome
    assert "the TPU compiler refuses this shape" in outcome.message, outcome.message
    assert f"libtpu {tpu_compiler.libtpu_version()}" in outcome.message, outcome.message


@needs_libtpu
def test_a_refusal_of_what_the_compiler_compiles_fails() -> None:
    outcome = _layout(
        "broken_pallas_refuses_what_the_compiler_compiles", "float32", {"rows_per_shard": 8, "cols": 128}
    )
    assert outcome.verdict == "failed", outcome
    assert "refuses a shape the TPU compiler compiles" in outcome.message, outcome.message
    assert np.all([r.refusal for r in outcome.records]), outcome.records


def test_the_tpu_mesh_fixture_compiles_for_the_chips(conformance_tpu_mesh) -> None:
    """The fixture a downstream test takes: a 2-D mesh over 8 v6e chips (skipped without libtpu)."""
    mesh = conformance_tpu_mesh("2x4-y-auto", topology="v6e:2x4")
    assert mesh.shape == {"x": 2, "y": 4} and {d.device_kind for d in mesh.devices.flat} == {"TPU v6 lite"}
    x = jax.ShapeDtypeStruct((4 * 96, 128), jnp.bfloat16, sharding=NamedSharding(mesh, P("y")))
    xla_all_gather = registry.get("all_gather", "xla_all_gather").fn
    text = tpu_compiler.compile_on(lambda a: xla_all_gather(a, mesh=mesh, axis_name="y"), (x,)).as_text()
    assert "all-gather" in text, text[:2000]
