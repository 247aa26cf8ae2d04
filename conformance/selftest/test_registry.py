"""The public registry and the plugin's command-line options."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

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
    with pytest.raises(TypeError, match="resources must be a callable returning counters"):
        conformance.register("send_recv", name="selftest_options", resources=3)
    assert registry.get("send_recv", "xla_device_put").options == {
        "accepts_timeout": False,
        "resources": None,
    }
    assert registry.get("send_recv", "jax_transfer_server").options["resources"] is not None


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
    assert ids and all("ring_allgather_matmul_unidirectional" in i for i in ids)
    assert all(i.endswith("-tpu]") or any(t in i for t in tier) for i in ids), ids
    assert any(i.endswith("-tpu]") for i in ids) and any("::test_tpu_schedule[" in i for i in ids), ids
