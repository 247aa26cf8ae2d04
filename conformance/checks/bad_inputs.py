"""Bad inputs: each input the family forbids is refused by the kernel with an error naming it."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import numpy as np

from conformance import runner
from conformance.checks.base import Axes, Check, NotJudged, fail
from conformance.runner import Case


def _replicated_call(case: Case, shapes: Sequence[tuple[int, ...]], axis_name: str) -> object:
    """Call the implementation on arrays of ``shapes``, replicated over the case's mesh."""
    mesh = runner.mesh_of(case)
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    args = [
        jax.device_put(np.ones(shape, runner.operand_np_dtype(case, i)), replicated)
        for i, shape in enumerate(shapes)
    ]
    return jax.block_until_ready(runner.jitted_for(case, axis_name=axis_name)(*args))


def check_bad_inputs(case: Case) -> None:
    """Each forbidden input raises an error, from the kernel, that names the offending values.

    Bad inputs are replicated arrays (an indivisible dim cannot be sharded). On an
    Explicit mesh JAX's shard_map refuses a replicated input whose sharding differs
    from its ``in_specs`` before the kernel sees it, and that refusal names the
    array's shape, so it would pass for the kernel's own check. The check first
    calls the kernel with *valid* shapes placed the same way: if JAX refuses those
    too, the bad inputs go to the same kernel on the Auto twin of the mesh (same
    devices and axes), where they reach the kernel.
    """
    spec = case.spec
    problems = []
    probe_case, note = case, ""
    if case.mesh.axis_type == "explicit":
        try:
            _replicated_call(case, case.operand_shapes, case.mesh.axis_name)
        except Exception:
            probe_case = dataclasses.replace(case, mesh=dataclasses.replace(case.mesh, axis_type="auto"))
            note = (
                " (on the Auto twin of this mesh: on an Explicit mesh JAX's shard_map refuses "
                "replicated inputs, even valid ones, before the kernel sees them)"
            )
    forbidden = spec.bad_inputs(case.mesh.axis_size)
    if not forbidden:
        raise NotJudged(f"the {case.family} family forbids no input on a ring of {case.mesh.axis_size}")
    for bad in forbidden:
        try:
            result = _replicated_call(probe_case, bad.shapes, bad.axis_name or case.mesh.axis_name)
        except Exception as e:
            message = str(e)
            missing = [m for m in bad.must_mention if m not in message]
            if missing:
                problems.append(
                    f"{bad.description}{note}: raised {type(e).__name__} without naming "
                    f"{missing}: {message[:300]!r}"
                )
            continue
        shape = getattr(result, "shape", "?")
        problems.append(f"{bad.description}{note}: returned a result of shape {shape} instead of raising")
    if problems:
        raise fail(case, "bad_inputs", "forbidden input is not rejected with a clear error", problems)


# an error path: it turns on the axis type (JAX refuses some inputs itself on an Explicit mesh) and on
# whether the ring divides at all (a ring of one divides every size): a mesh of each kind, both types
CHECKS = (Check("bad_inputs", check_bad_inputs, axes=Axes(meshes="covering")),)
