"""absltest entry: the suite's checks as a ``parameterized.TestCase``, for projects that test
the way JAX, Flax and Optax do::

    from conformance import absltest as conformance_absltest
    import my_kernels  # registers my_ring with conformance.register

    class MyRingTest(conformance_absltest.conformance_test_case(
        "all_gather", impls=("my_ring",), checks=("values", "output_sharding", "collectives"),
        meshes=("2-x-auto", "2x4-y-explicit"),
    )):
        pass

    if __name__ == "__main__":
        conformance_absltest.main()   # sets 8 CPU devices before JAX starts, then absltest.main()

One test method per check, each parameterized over implementation x mesh x fixed shape
(``test_values_my_ring_2_x_auto_odd``). The cases are the family's fixed shapes, moved to
what each kernel claims (:mod:`conformance.claims`); a case a kernel does not claim, or
one this host cannot run, is ``skipTest`` with the reason. A failure's message is the
check's own, with its replay line. The hypothesis-drawn checks run under pytest only.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from absl.testing import absltest, parameterized

from conformance import checks as checks_module
from conformance import claims, compat, registry, runner, specs, strategies
from conformance.fixtures import devices as devices_lib
from conformance.fixtures.meshes import MESH_CONFIGS, build_mesh, parse_mesh
from conformance.run import run_check
from conformance.session import Session
from conformance.specs.base import FIXED_SHAPES
from conformance.targets import cpu_ragged_all_to_all

#: The checks a generated TestCase runs when none are named (each one compile per mesh and shape).
DEFAULT_CHECKS = (
    "values",
    "output_sharding",
    "dtype",
    "determinism",
    "collectives",
    "cross_lowering",
    "bad_inputs",
)


def _name(text: str) -> str:
    return re.sub(r"\W", "_", text)


def conformance_test_case(
    family: str,
    *,
    impls: Sequence[str] | None = None,
    checks: Sequence[str] = DEFAULT_CHECKS,
    meshes: Sequence[str] | None = None,
    dtype: str = "float32",
    platform: str = "cpu",
) -> type[parameterized.TestCase]:
    """A ``parameterized.TestCase`` subclass checking ``impls`` (default: every registered one
    of ``family``, at the time of the call) on ``meshes`` (labels; default: every standard mesh)."""
    spec = specs.get(family)
    names = list(impls) if impls is not None else [i.name for i in registry.registered(family)]
    for name in names:
        registry.get(family, name)  # raises NotRegistered, naming the registered ones
    configs = [parse_mesh(label) for label in meshes] if meshes is not None else list(MESH_CONFIGS)
    unknown = [c for c in checks if c not in checks_module.CHECKS]
    if unknown:
        raise ValueError(f"unknown checks {unknown}; one of {', '.join(checks_module.CHECKS)}")
    params = [
        {
            "testcase_name": _name(f"_{impl}_{config.label}_{shape}"),
            "impl": impl,
            "mesh_label": config.label,
            "shape": shape,
        }
        for impl in names
        for config in configs
        for shape in FIXED_SHAPES
    ]

    # The class's session: default bounds, one worker process kept warm across its tests; XLA's
    # ragged all-to-all emulated on CPU where XLA:CPU lacks it, from the class's first test to its last.
    session = Session()
    undo_emulation: list = []

    def make_test(check_name: str):
        def test(self: parameterized.TestCase, impl: str, mesh_label: str, shape: str) -> None:
            _run_one(self, session, family, impl, check_name, parse_mesh(mesh_label), shape, dtype, platform)

        test.__name__ = f"test_{check_name}"
        test.__doc__ = f"conformance check {check_name!r} of {family} ({spec.summary})"
        return parameterized.named_parameters(*params)(test)

    body = {f"test_{c}": make_test(c) for c in checks}
    generated = type(f"{_name(family).title()}ConformanceTest", (parameterized.TestCase,), body)

    def set_up_class(cls: type) -> None:
        super(generated, cls).setUpClass()
        undo_emulation.append(cpu_ragged_all_to_all.install())

    def tear_down_class(cls: type) -> None:
        try:
            super(generated, cls).tearDownClass()
        finally:
            session.close()  # the worker process, if a Pallas kernel started one
            while undo_emulation:
                undo_emulation.pop()()

    generated.setUpClass = classmethod(set_up_class)
    generated.tearDownClass = classmethod(tear_down_class)
    return generated


def _run_one(test, session, family, impl, check_name, mesh, shape, dtype, platform) -> None:
    if not devices_lib.has_platform(platform):
        test.skipTest(f"needs a {platform} backend; this host has {devices_lib.describe_host()}")
    if len(devices_lib.devices_of(platform)) < mesh.num_devices:
        test.skipTest(
            f"needs {mesh.num_devices} {platform} devices, found {len(devices_lib.devices_of(platform))}"
        )
    try:
        dims = strategies.fixed_dims(family, impl, platform, mesh, dtype, shape)
    except claims.NotClaimed as why:
        test.skipTest(str(why.msg))
    if dims is None:
        test.skipTest(f"{impl}: both fixed shapes come to the same dims; the odd one runs them")
    dma_mode = "on_wait" if platform == "cpu" and registry.get(family, impl).pallas else None
    case = runner.Case.make(family, impl, mesh, dims, dtype, platform=platform, dma_mode=dma_mode)
    build_mesh(mesh, platform)
    outcome = run_check(check_name, case, session)
    if outcome.verdict == "failed":
        test.fail(outcome.message)
    if outcome.verdict in ("skipped", "not_judged"):
        test.skipTest(outcome.skip_reason)


def main(*args, **kwargs) -> None:
    """``absltest.main`` after asking for the suite's simulated CPU devices (before JAX starts)."""
    problem = compat.ensure_cpu_devices(devices_lib.CPU_DEVICE_COUNT)
    if problem:
        raise SystemExit(f"{problem}: call conformance.absltest.main() before anything starts a JAX backend")
    absltest.main(*args, **kwargs)
