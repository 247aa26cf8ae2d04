"""The public registry and the plugin's command-line options."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from jax.sharding import PartitionSpec as P

import conformance
from conformance import registry
from conformance.selftest import suite_command

pytestmark = pytest.mark.selftest

ROOT = Path(__file__).resolve().parents[2]


def test_builtins_register_through_the_public_api() -> None:
    import conformance.kernels

    impls = conformance.implementations("allgather_matmul")
    assert {
        "xla_allgather_matmul",
        "ring_allgather_matmul_unidirectional",
        "ring_allgather_matmul_bidirectional",
    } <= set(impls)
    assert all(callable(fn) for fn in impls.values())
    assert registry.get("allgather_matmul", "xla_allgather_matmul").baseline


def test_unknown_family_is_refused_with_the_known_ones() -> None:
    with pytest.raises(ValueError, match=r"unknown kernel family 'allgather_matmull'.*allgather_matmul"):
        conformance.register("allgather_matmull", name="x")


def test_a_family_s_own_registration_keywords_are_its_spec_s() -> None:
    """A keyword another family declares is refused naming this family's own; a wrong value naming
    what it must be; one not passed takes its default."""
    with pytest.raises(
        TypeError,
        match=r"unexpected keyword\(s\) \['accepts_timeout'\]; the all_gather family's own are: none",
    ):
        conformance.register("all_gather", name="selftest_options", accepts_timeout=True)
    with pytest.raises(
        TypeError, match=r"'bidirectonal' \(did you mean 'bidirectional'\?\).*every family's: .*pallas"
    ):
        conformance.register(
            "all_gather", name="selftest_options", bidirectonal=True
        )  # register's own, misspelt
    with pytest.raises(TypeError, match=r"'accept_timeout' \(did you mean 'accepts_timeout'\?\)"):
        conformance.register(
            "send_recv", name="selftest_options", accept_timeout=True
        )  # the family's, misspelt
    with pytest.raises(TypeError, match="resources must be a callable returning counters"):
        conformance.register("send_recv", name="selftest_options", resources=3)
    assert registry.get("send_recv", "xla_device_put").options == {
        "accepts_timeout": False,
        "resources": None,
    }
    assert registry.get("send_recv", "jax_transfer_server").options["resources"] is not None


def test_a_registration_option_that_derives_a_form_holds_the_kernel_to_it() -> None:
    """``scatter_dimension=1`` holds a reduce-scatter to the family's transposed form (the partials
    ``x[n, cols, M]``, the result ``[cols, M] P(None, axis)``), whose reference, block tags and forbidden
    inputs are the family's on the swapped arrays; the family's baseline stays the one in its own form;
    a value the option does not take is refused naming the ones it does."""
    import numpy as np

    import conformance.kernels
    from conformance import specs

    family = specs.get("reduce_scatter")
    columns = registry.spec_of("reduce_scatter", "ring_reduce_scatter_columns_bidirectional")
    assert columns is not family
    assert columns is registry.spec_of("reduce_scatter", "xla_reduce_scatter_columns")
    assert registry.spec_of("reduce_scatter", "ring_reduce_scatter_bidirectional") is family
    assert registry.reference_baseline("reduce_scatter").name == "xla_reduce_scatter"
    dims = {"rows_per_shard": 3, "cols": 8}
    assert columns.operands[0].shape(dims, 4) == (4, 8, 12) and columns.out_shape(dims, 4) == (8, 12)
    assert columns.signature("x") == f"x {P('x', None, None)} -> {P(None, 'x')}"  # repr differs by JAX
    x = np.random.default_rng(0).normal(size=(4, 8, 12))
    np.testing.assert_array_equal(columns.expected((x,), axis_size=4), x.sum(0))
    (tags,) = columns.block_tags(((4, 8, 12),), 4, (2,))
    assert tags[2, 0].tolist() == [1, 1, 1, 2, 2, 2, 3, 3, 3, 4, 4, 4] and not tags[1].any()
    bad = columns.bad_inputs(3)[0]
    assert bad.shapes == ((3, 8, 7),) and "7 columns" in bad.description
    assert columns.block_axis == -1 and columns.family_form is not None
    with pytest.raises(TypeError, match=r"scatter_dimension must be 0 or 1, got 2"):
        conformance.register("reduce_scatter", name="selftest_scatter_dimension", scatter_dimension=2)


def test_a_name_taken_by_another_function_is_refused() -> None:
    @conformance.register("allgather_matmul", name="selftest_duplicate_name")
    def first(lhs, rhs, *, mesh, axis_name): ...

    with pytest.raises(ValueError, match="already has an implementation named 'selftest_duplicate_name'"):

        @conformance.register("allgather_matmul", name="selftest_duplicate_name")
        def second(lhs, rhs, *, mesh, axis_name): ...

    registry._REGISTRY["allgather_matmul"].pop("selftest_duplicate_name")


def test_impl_glob_filters() -> None:
    import conformance.kernels  # noqa: F401

    names = [i.name for i in registry.registered("allgather_matmul", "ring_*")]
    assert names == ["ring_allgather_matmul_bidirectional", "ring_allgather_matmul_unidirectional"]


def _pytest(*args: str) -> subprocess.CompletedProcess:
    cmd = suite_command(*(a for a in args if a != "-q"), marks=None)  # quiet once, as suite_command is
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_unmatched_impl_glob_is_a_usage_error() -> None:
    proc = _pytest("--impl=no_such_kernel*", "--co", "-q")
    assert proc.returncode == 4, proc.stdout + proc.stderr
    assert "--impl=no_such_kernel* matches no implementation" in proc.stderr


def test_unimportable_kernels_module_is_a_usage_error() -> None:
    proc = _pytest("--kernels=no_such_module_anywhere", "--co", "-q")
    assert proc.returncode == 4, proc.stdout + proc.stderr
    assert "cannot import 'no_such_module_anywhere'" in proc.stderr


def test_test_ids_name_the_implementation_and_platforms_carry_markers() -> None:
    proc = _pytest("--impl=ring_allgather_matmul_unidirectional", "-m", "tpu", "--co", "-q")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    ids = [line for line in proc.stdout.splitlines() if "::" in line]
    # -m tpu: the tests of the tpu platform, and the TPU compile tier (no platform: it needs no chip)
    tier = ("::test_tpu_schedule[", "::test_tpu_memory[", "::test_tpu_pod[", "::test_tpu_layout[")
    tier += ("::test_tpu_bytes[",)
    assert ids and all("ring_allgather_matmul_unidirectional" in i for i in ids)
    assert all(i.endswith("-tpu]") or any(t in i for t in tier) for i in ids), ids
    assert any(i.endswith("-tpu]") for i in ids) and any("::test_tpu_schedule[" in i for i in ids), ids


def test_a_tuning_space_registers_each_configuration_as_an_implementation() -> None:
    """``configs=``: each configuration is an implementation of its own, named by its keywords, called
    with them; ``--impl``'s glob on the name registered selects them all; bad configurations are refused
    naming what each must be."""
    calls = []

    def kernel(x, *, mesh, axis_name, tile_rows, in_flight=1):
        calls.append((tile_rows, in_flight))
        return x

    conformance.register(
        "all_gather", name="selftest_tuned", configs=({"tile_rows": 8}, {"tile_rows": 16, "in_flight": 2})
    )(kernel)
    try:
        names = [i.name for i in registry.registered("all_gather", "selftest_tuned")]
        assert names == ["selftest_tuned.tile_rows.16.in_flight.2", "selftest_tuned.tile_rows.8"]
        assert "selftest_tuned" not in registry.implementations("all_gather")
        tuned = registry.get("all_gather", "selftest_tuned.tile_rows.8")
        assert tuned.config == (("tile_rows", 8),) and tuned.configured_from == "selftest_tuned"
        tuned.fn(0, mesh=None, axis_name="x")
        registry.get("all_gather", "selftest_tuned.tile_rows.16.in_flight.2").fn(0, mesh=None, axis_name="x")
        assert calls == [(8, 1), (16, 2)]
    finally:
        for name in ("selftest_tuned.tile_rows.8", "selftest_tuned.tile_rows.16.in_flight.2"):
            registry._REGISTRY["all_gather"].pop(name, None)
    for bad, said in (
        ({"tile_rows": 8}, "configs must be a sequence of dicts"),
        (({},), "non-empty dict"),
        (({"tile rows": 8},), "each key must be a keyword name"),
        (({"tile_rows": -8},), "non-negative int"),
        (({"tile_rows": 0.5},), "non-negative int"),
        (({"tile_rows": 8}, {"tile_rows": 8}), "configs repeat one"),
    ):
        with pytest.raises((TypeError, ValueError), match=said):
            conformance.register("all_gather", name="selftest_badly_tuned", configs=bad)


def test_list_shows_every_declaration_a_kernel_passed() -> None:
    """``python -m conformance list`` shows, beside each name, its traits and every keyword it passed
    other than at its default: what a reader needs to know which checks it claims."""
    from conformance import specs
    from conformance.__main__ import _declarations

    ring = _declarations(registry.get("all_reduce", "ring_all_reduce_bidirectional"), specs.get("all_reduce"))
    assert (
        "(differentiable, bidirectional)" in ring and "[registered by conformance.kernels.all_reduce" in ring
    )
    assert "dtypes=float32," in ring and "reductions=('add', 'min', 'max')" in ring, ring
    gpu = _declarations(registry.get("all_reduce", "mgpu_all_reduce"), specs.get("all_reduce"))
    assert "platforms=gpu" in gpu and "requires=" in gpu and "lowering_targets=cuda" in gpu, gpu
    plain = _declarations(registry.get("all_gather", "xla_all_gather"), specs.get("all_gather"))
    assert "bidirectional" not in plain and "lowering_targets" not in plain, plain
