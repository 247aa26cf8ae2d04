"""The suite's own XLA:CPU compile options (:func:`conformance.compat.cpu_compiler_options`) make host
compiles cheaper and nothing else: on the built-in rings the compiled module has the collectives
JAX's default options give, and the results pass against the float64 reference as the defaults' do (a
float32 matmul may round differently in its last bit: LLVM at -O0 contracts and vectorizes less; an
all-gather's result is bitwise the same). Run on each env's JAX,
so a jaxlib whose option changes an HLO pass fails here, not in a kernel's verdict.
"""

from __future__ import annotations

import numpy as np
import pytest

import conformance.kernels  # noqa: F401  (registers the built-ins)
from conformance import compat, hlo, runner, strategies
from conformance.checks.base import compare_with_reference
from conformance.fixtures.meshes import parse_mesh
from conformance.runner import Case

pytestmark = pytest.mark.selftest


def test_only_options_this_jaxlib_knows_are_taken() -> None:
    options = compat.cpu_compiler_options()
    assert set(options.items()) <= set(compat.CPU_COMPILE_OPTION_CANDIDATES)
    assert options["xla_backend_optimization_level"] == 0  # every supported jaxlib has it


def test_an_unknown_option_is_left_out_and_a_bad_value_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    probe = compat.cpu_compiler_options.__wrapped__  # uncached: the run's own options stay as they are
    unknown = ("xla_cpu_option_no_jaxlib_has", True)
    monkeypatch.setattr(
        compat, "CPU_COMPILE_OPTION_CANDIDATES", (("xla_backend_optimization_level", 0), unknown)
    )
    assert probe() == {"xla_backend_optimization_level": 0}
    monkeypatch.setattr(
        compat, "CPU_COMPILE_OPTION_CANDIDATES", (("xla_backend_optimization_level", "high"),)
    )
    with pytest.raises(Exception, match="not a valid"):
        probe()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize(
    ("family", "impl"),
    [
        ("allgather_matmul", "ring_allgather_matmul_bidirectional"),
        ("matmul_reduce_scatter", "ring_matmul_reduce_scatter_bidirectional"),
        ("all_gather", "xla_all_gather"),
    ],
)
def test_the_options_keep_the_collectives_and_the_results(family: str, impl: str, dtype: str) -> None:
    mesh = parse_mesh("4-x-explicit")
    case = Case.make(
        family, impl, mesh, strategies.fixed_dims(family, impl, "cpu", mesh, dtype, "odd"), dtype
    )
    lowered = runner.jitted_for(case).lower(*runner.abstract_args(case))
    by_default = lowered.compile()
    with_options = lowered.compile(compiler_options=compat.cpu_compiler_options())

    def collectives(compiled) -> list[str]:
        return [op.describe() for op in hlo.collectives_of(hlo.parse_module(compiled.as_text())).ops]

    assert collectives(with_options) == collectives(by_default)
    inputs = runner.make_inputs(case)
    args = runner.place(case, inputs)
    got, want = with_options(*args), by_default(*args)
    inputs64 = tuple(a.astype(np.float64) for a in inputs)
    compare_with_reference(case, "values", got, inputs64)  # the verdict: within the dtype's tolerance
    compare_with_reference(case, "values", want, inputs64)
    if not case.spec.overlap:  # data movement: bitwise
        assert np.asarray(got).tobytes() == np.asarray(want).tobytes()
