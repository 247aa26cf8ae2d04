"""The undeclared seed case (JAX #21855) must be reported by the backward audit.

Same function as ``conformance/tests/test_seed_backward_allreduce.py``, but written
the way the issue's author wrote it: ``check_vma=False`` and an ``out_shape``
that says nothing about varying axes. Its backward holds the defensive
all-reduce over the replicated axis; the audit must name it, say which module
holds it, and point at the fix.
"""

from __future__ import annotations

import pytest

from conformance import checks
from conformance.fixtures.meshes import build_mesh, parse_mesh
from conformance.tests import seed_cases
from conformance.tests.test_seed_backward_allreduce import SEED_MESHES, seed_arguments

pytestmark = pytest.mark.selftest


@pytest.mark.parametrize("mesh_label", SEED_MESHES)
def test_undeclared_seed_case_is_rejected(mesh_label: str) -> None:
    mesh = build_mesh(parse_mesh(mesh_label))
    x, ct = seed_arguments(mesh)
    host = seed_cases.pallas_copy_in_shard_map(
        mesh,
        declared=False,
        interpret=seed_cases.interpreted(),
    )
    target = seed_cases.pallas_copy_in_shard_map(mesh, declared=False)
    with pytest.raises(checks.ConformanceFailure) as failure:
        checks.assert_backward_collectives(target, (x,), ct, host_fn=host, name="seed case (undeclared)")
    message = str(failure.value)
    assert "[backward_collectives] seed case (undeclared)" in message, message
    assert "lowered for tpu: all-reduce" in message, message
    assert "Backward passes without defensive all-reduces" in message, message


def test_undeclared_seed_case_all_reduce_is_over_the_replicated_axis() -> None:
    """The reported all-reduce is the seed's: groups of the 2 devices that share a row block."""
    mesh = build_mesh(parse_mesh("4x2-x-explicit"))
    x, ct = seed_arguments(mesh)
    host = seed_cases.pallas_copy_in_shard_map(
        mesh,
        declared=False,
        interpret=seed_cases.interpreted(),
    )
    target = seed_cases.pallas_copy_in_shard_map(mesh, declared=False)
    audit = checks.audit_backward(target, (x,), ct, host_fn=host, targets=("tpu",))
    for summary in (audit.lowered["tpu"], audit.compiled):
        (all_reduce,) = summary.of_kind("all-reduce")
        groups = sorted(sorted(g) for g in all_reduce.replica_groups or ())
        # mesh devices are row-major over (x=4, y=2): the y-pairs are {0,1}, {2,3}, ...
        assert groups == [[0, 1], [2, 3], [4, 5], [6, 7]], all_reduce.describe()
