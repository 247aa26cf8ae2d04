"""The HLO parser on hand-written modules and on real compiled ones."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import pytest
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from conformance import hlo
from fixtures.meshes import build_mesh, parse_mesh

pytestmark = pytest.mark.selftest

LOOPED = """
HloModule looped, entry_computation_layout={(f32[4,8]{1,0})->f32[4,8]{1,0}}

%body (p: (s32[], f32[4,8])) -> (s32[], f32[4,8]) {
  %p = (s32[], f32[4,8]{1,0}) parameter(0)
  %x = f32[4,8]{1,0} get-tuple-element(%p), index=1
  %cp = f32[4,8]{1,0} collective-permute(%x), channel_id=1, source_target_pairs={{0,1},{1,2},{2,3},{3,0}}
  ROOT %t = (s32[], f32[4,8]{1,0}) tuple(%i, %cp)
}

%cond (p: (s32[], f32[4,8])) -> pred[] {
  ROOT %lt = pred[] compare(%a, %b), direction=LT
}

ENTRY %main (a: f32[4,8]) -> f32[4,8] {
  %a = f32[4,8]{1,0} parameter(0)
  %ag = f32[16,8]{1,0} all-gather(%a), channel_id=2, replica_groups=[1,4]<=[4], dimensions={0}
  %ars = (f32[4,8]{1,0}, f32[4,8]{1,0}) all-reduce-start(%a, %a), replica_groups={{0,1},{2,3}}, to_apply=%cond
  %ard = (f32[4,8]{1,0}, f32[4,8]{1,0}) all-reduce-done(%ars)
  %w = (s32[], f32[4,8]{1,0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
  ROOT %r = f32[4,8]{1,0} get-tuple-element(%w), index=1
}
"""


def test_parses_kinds_phases_groups_and_loop_multiplicity() -> None:
    summary = hlo.parse_hlo(LOOPED)
    by_name = {op.name: op for op in summary.ops}
    assert summary.kinds == {"collective-permute", "all-gather", "all-reduce"}
    cp = by_name["cp"]
    assert cp.multiplicity == 3 and cp.computation == "body"
    assert cp.source_target_pairs == ((0, 1), (1, 2), (2, 3), (3, 0))
    assert cp.operand_shapes == (hlo.Shape("f32", (4, 8)),)
    assert by_name["ag"].replica_groups == ((0, 1, 2, 3),)
    assert (by_name["ars"].phase, by_name["ard"].phase) == ("start", "done")
    assert by_name["ars"].replica_groups == ((0, 1), (2, 3))
    # per device: permute 3 x 128 B + all-gather 3 x 128 B + all-reduce 2*(1/2)*(2 x 128 B)
    assert summary.received_bytes_per_device() == 3 * 128 + 3 * 128 + 256


def test_unknown_trip_count_is_unbounded() -> None:
    text = LOOPED.replace(', backend_config={"known_trip_count":{"n":"3"}}', "")
    summary = hlo.parse_hlo(text)
    assert {op.name: op.multiplicity for op in summary.ops}["cp"] is None
    assert summary.received_bytes_per_device() is None


def test_iota_replica_groups_with_transpose() -> None:
    assert hlo._iota_groups("[4,2]<=[2,4]T(1,0)") == ((0, 4), (1, 5), (2, 6), (3, 7))


def _compiled_text(fn, mesh_label: str, shape=(8, 4)) -> str:
    config = parse_mesh(mesh_label)
    mesh = build_mesh(config)
    arg = jax.ShapeDtypeStruct(shape, jnp.float32, sharding=NamedSharding(mesh, P("x")))
    body = jax.shard_map(fn, mesh=mesh, in_specs=P("x"), out_specs=P("x"))
    return jax.jit(body).lower(arg).compile().as_text()


def test_real_fori_loop_of_permutes_counts_every_trip() -> None:
    def ring(x):
        perm = [(j, (j + 1) % 4) for j in range(4)]
        return lax.fori_loop(0, 3, lambda _, v: lax.ppermute(v, "x", perm), x)

    summary = hlo.parse_hlo(_compiled_text(ring, "4-x-auto"))
    (op,) = summary.of_kind("collective-permute")
    assert op.multiplicity == 3  # from the while's known_trip_count
    assert summary.received_bytes_per_device() == 3 * (2 * 4 * 4)  # 3 trips of a 2x4 f32 block


def test_real_psum_is_an_all_reduce() -> None:
    summary = hlo.parse_hlo(_compiled_text(functools.partial(lax.psum, axis_name="x"), "4-x-auto"))
    assert summary.kinds == {"all-reduce"}
    (op,) = summary.ops
    assert op.group_size == 4
