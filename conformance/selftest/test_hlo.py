"""The HLO parser on hand-written modules and on real compiled ones."""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import pytest
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from conformance import hlo
from conformance.fixtures.meshes import build_mesh, parse_mesh

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
    assert hlo.parse_replica_groups("[4,2]<=[2,4]T(1,0)") == ((0, 4), (1, 5), (2, 6), (3, 7))


# ----------------------------------------------------------------------------- replica-group forms
# Each entry: one program, the line each XLA printed for it (verbatim up to its metadata), and the
# groups they all mean. The same program must read the same on every JAX in the window.

Y_PAIRS = ((0, 1), (2, 3), (4, 5), (6, 7))
SAME_PROGRAM_EVERY_XLA = {
    "psum over y of a 4x2 mesh": (
        Y_PAIRS,
        {
            "0.6.2": "ROOT %all-reduce.1 = f32[2,4]{1,0} all-reduce(%param), channel_id=1, replica_groups={{0,1},{2,3},{4,5},{6,7}}, use_global_device_ids=true, to_apply=%region_0.8",
            "0.10.2": "ROOT %psum.7 = f32[2,4]{1,0} all-reduce(%param.1), channel_id=1, replica_groups={{0,1},{2,3},{4,5},{6,7}}, use_global_device_ids=true, to_apply=%region_0.0",
            "0.12.0.1": "ROOT %psum.7 = f32[2,4]{1,0} all-reduce(%param.1), channel_id=1, replica_groups=mesh['x'=4,'y'=2] {'y'}, use_global_device_ids=true, to_apply=%region_0.0",
        },
    ),
    "psum over (c, a) of a 2x2x2 mesh (grouped axes out of mesh order)": (
        ((0, 4, 1, 5), (2, 6, 3, 7)),
        {
            "0.6.2": "ROOT %all-reduce.1 = f32[2,4]{1,0} all-reduce(%param), channel_id=1, replica_groups={{0,4,1,5},{2,6,3,7}}, use_global_device_ids=true, to_apply=%region_0.8",
            "0.10.2": "ROOT %psum.7 = f32[2,4]{1,0} all-reduce(%param.1), channel_id=1, replica_groups={{0,4,1,5},{2,6,3,7}}, use_global_device_ids=true, to_apply=%region_0.0",
            "0.12.0.1": "ROOT %psum.7 = f32[2,4]{1,0} all-reduce(%param.1), channel_id=1, replica_groups=mesh['a'=2,'b'=2,'c'=2] {'c','a'}, use_global_device_ids=true, to_apply=%region_0.0",
        },
    ),
    "jit sum of x.reshape(2, 4, 8) over dim 1, x sharded over an 8-device mesh (a sub-axis)": (
        ((0, 1, 2, 3), (4, 5, 6, 7)),
        {
            "0.6.2": "ROOT %all-reduce = f32[1,8]{1,0} all-reduce(%param), channel_id=1, replica_groups=[2,4]<=[8], use_global_device_ids=true, to_apply=%region_0.7.clone",
            "0.10.2": "%all-reduce = f32[1,8]{1,0} all-reduce(%param), channel_id=1, replica_groups=mesh['axis_0'=2,'axis_1'=4,'axis_2'=1] {'axis_1'}, use_global_device_ids=true, to_apply=%region_0.0.clone",
            "0.12.0.1": "%all-reduce = f32[1,8]{1,0} all-reduce(%param), channel_id=1, replica_groups=mesh['x'=8] {'x':(2)4}, use_global_device_ids=true, to_apply=%region_0.0.clone, frontend_attributes={is_spmd_generated=\"true\"}",
        },
    ),
    "jit sum of x.reshape(2, 4, 8) over dim 1, x sharded over a 4x2 mesh (a sub-axis of x)": (
        ((0, 2), (1, 3), (4, 6), (5, 7)),
        {
            "0.6.2": "ROOT %all-reduce = f32[1,4]{1,0} all-reduce(%reduce_bitcast_fusion), channel_id=1, replica_groups=[4,2]<=[2,2,2]T(0,2,1), use_global_device_ids=true, to_apply=%region_0.7.clone",
            "0.10.2": "%all-reduce = f32[1,4]{1,0} all-reduce(%reduce_bitcast_fusion), channel_id=1, replica_groups=mesh['axis_0'=2,'axis_1'=2,'axis_2'=2] {'axis_1'}, use_global_device_ids=true, to_apply=%region_0.0.clone",
            "0.12.0.1": "%all-reduce = f32[1,4]{1,0} all-reduce(%reduce_bitcast_fusion), channel_id=1, replica_groups=mesh['x'=4,'y'=2] {'x':(2)2}, use_global_device_ids=true, to_apply=%region_0.0.clone, frontend_attributes={is_spmd_generated=\"true\"}",
        },
    ),
    "the all-gather after that sum (8-device mesh)": (
        ((0, 4), (1, 5), (2, 6), (3, 7)),
        {
            "0.10.2": "ROOT %all-gather = f32[2,8]{1,0} all-gather(%all-reduce), channel_id=2, replica_groups=mesh['axis_0'=2,'axis_1'=1,'axis_2'=4] {'axis_0'}, dimensions={0}, use_global_device_ids=true",
            "0.12.0.1": "ROOT %all-gather = f32[2,8]{1,0} all-gather(%all-reduce), channel_id=2, replica_groups=mesh['x'=8] {'x':(1)2}, dimensions={0}, use_global_device_ids=true, frontend_attributes={is_spmd_generated=\"true\"}",
        },
    ),
    # jit(lhs @ rhs) of lhs[12,8] P('y', None) on a 2x4 ('x', 'y') mesh, left to the partitioner
    # (xla_jit_allgather_matmul): XLA:CPU gathers lhs over y, its mesh's device ids an iota.
    "the partitioner's all-gather over y of a 2x4 mesh": (
        ((0, 1, 2, 3), (4, 5, 6, 7)),
        {
            "0.6.2": "%all-gather = f32[12,8]{1,0} all-gather(%param), channel_id=1, replica_groups=[2,4]<=[8], dimensions={0}, use_global_device_ids=true",
            "0.10.2": "%all-gather = f32[12,8]{1,0} all-gather(%param), channel_id=1, replica_groups=mesh['axis_0'=4,'axis_1'=1,'axis_2'=2], device_ids=([2,4]T(1,0)) {'axis_0'}, dimensions={0}, use_global_device_ids=true",
            "0.12.0.1": "%all-gather = f32[12,8]{1,0} all-gather(%param), channel_id=1, replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_1'}, dimensions={0}, use_global_device_ids=true, frontend_attributes={is_spmd_generated=\"true\"}",
        },
    ),
    # XLA 0.12's own printer, after its parser read a mesh with explicit device ids.
    "psum over y of a 4x2 mesh whose devices are listed": (
        ((3, 1), (2, 0), (7, 5), (6, 4)),
        {
            "0.12.0.1": "ROOT %r = f32[4]{0} all-reduce(%p), channel_id=1, replica_groups=mesh['x'=4,'y'=2], device_ids=(3,1,2,0,7,5,6,4) {'y'}, use_global_device_ids=true, to_apply=%add",
        },
    ),
}


def _module(line: str, header: str = "num_partitions=8") -> str:
    return f"HloModule m, {header}\n\nENTRY %e (p: f32[4]) -> f32[4] {{\n  %p = f32[4]{{0}} parameter(0)\n  {line}\n}}\n"


@pytest.mark.parametrize("program", sorted(SAME_PROGRAM_EVERY_XLA))
def test_every_replica_group_form_reads_the_same_groups(program: str) -> None:
    expected, lines = SAME_PROGRAM_EVERY_XLA[program]
    for version, line in lines.items():
        (op,) = hlo.parse_hlo(_module(line)).ops
        assert op.replica_groups == expected, f"JAX {version}: {line}"


def test_empty_groups_mean_every_participant_of_the_mode() -> None:
    cross_replica = "ROOT %ar = f32[4]{0} all-reduce(%p), replica_groups={}, to_apply=%add"
    (op,) = hlo.parse_hlo(_module(cross_replica, "replica_count=4")).ops
    assert op.replica_groups == ((0, 1, 2, 3),)
    cross_partition = "ROOT %a2a = f32[4]{0} all-to-all(%p), channel_id=1, replica_groups={}, dimensions={0}"
    (op,) = hlo.parse_hlo(_module(cross_partition)).ops
    assert op.replica_groups == (tuple(range(8)),)
    # cross-replica-and-partition: the one replica's group spans all its partitions
    both = "ROOT %ar = f32[4]{0} all-reduce(%p), channel_id=1, replica_groups={{0}}, to_apply=%add"
    (op,) = hlo.parse_hlo(_module(both, "num_partitions=4")).ops
    assert op.replica_groups == ((0, 1, 2, 3),)
    assert op.received_bytes() == 2 * 3 * 16 // 4


UNKNOWN_FORMS = {  # form: (the line, the text the error must quote)
    "a form no XLA prints": (
        "ROOT %ar = f32[4]{0} all-reduce(%p), channel_id=1, replica_groups=devices[8] {x}, use_global_device_ids=true, to_apply=%add",
        "devices[8] {x}",
    ),
    "an axis the mesh lacks": (
        "ROOT %ar = f32[4]{0} all-reduce(%p), channel_id=1, replica_groups=mesh['x'=8] {'z'}, use_global_device_ids=true, to_apply=%add",
        "mesh['x'=8] {'z'}",
    ),
    "device ids as an iota whose transpose is no permutation": (
        "ROOT %r = f32[4]{0} all-reduce(%p), channel_id=1, replica_groups=mesh['x'=4,'y'=2], device_ids=([2,4]T(1,1)) {'y'}, use_global_device_ids=true, to_apply=%add",
        "device_ids=([2,4]T(1,1))",
    ),
    "an iota that does not cover its devices": (
        "ROOT %ar = f32[4]{0} all-reduce(%p), channel_id=1, replica_groups=[3,4]<=[8], use_global_device_ids=true, to_apply=%add",
        "[3,4]<=[8]",
    ),
    "no groups at all": (
        "ROOT %ar = f32[4]{0} all-reduce(%p), channel_id=1, use_global_device_ids=true, to_apply=%add",
        "channel_id=1, use_global_device_ids=true",
    ),
    "flattened ids left empty": (
        "ROOT %ar = f32[4]{0} all-reduce(%p), channel_id=1, replica_groups={}, use_global_device_ids=true, to_apply=%add",
        "'{}'",
    ),
    "pairs in a new form": (
        "ROOT %cp = f32[4]{0} collective-permute(%p), channel_id=1, source_target_pairs=[[0,1],[1,0]]",
        "[[0,1],[1,0]]",
    ),
}


@pytest.mark.parametrize("form", sorted(UNKNOWN_FORMS))
def test_a_form_it_does_not_know_is_an_error_naming_the_text(form: str) -> None:
    line, quoted = UNKNOWN_FORMS[form]
    with pytest.raises(hlo.HloParseError) as caught:
        hlo.parse_hlo(_module(line))
    assert quoted in str(caught.value), str(caught.value)


# The same program lowered for TPU by JAX 0.6.2 (explicit groups) and 0.12.0.1 (mesh axes over an
# sdy.mesh): a psum over (c, a) followed by a ppermute over a.
STABLEHLO_0_6_2 = """\
module @jit_f attributes {mhlo.num_partitions = 8 : i32, mhlo.num_replicas = 1 : i32} {
  func.func private @shmap_body(%arg0: tensor<2x4xf32>) -> (tensor<2x4xf32> {jax.result_info = "[('a', 'b'), ('c',)]"}) {
    %0 = "stablehlo.all_reduce"(%arg0) <{channel_handle = #stablehlo.channel_handle<handle = 1, type = 1>, replica_groups = dense<[[0, 4, 1, 5], [2, 6, 3, 7]]> : tensor<2x4xi64>, use_global_device_ids}> ({
    ^bb0(%arg1: tensor<f32>, %arg2: tensor<f32>):
      %2 = stablehlo.add %arg1, %arg2 : tensor<f32>
      stablehlo.return %2 : tensor<f32>
    }) : (tensor<2x4xf32>) -> tensor<2x4xf32>
    %1 = "stablehlo.collective_permute"(%0) <{channel_handle = #stablehlo.channel_handle<handle = 2, type = 1>, source_target_pairs = dense<[[0, 4], [4, 0], [1, 5], [5, 1], [2, 6], [6, 2], [3, 7], [7, 3]]> : tensor<8x2xi64>}> : (tensor<2x4xf32>) -> tensor<2x4xf32>
    return %1 : tensor<2x4xf32>
  }
}
"""
STABLEHLO_0_12_0_1 = """\
module @jit_f attributes {mhlo.num_partitions = 8 : i32, mhlo.num_replicas = 1 : i32} {
  sdy.mesh @mesh = <["a"=2, "b"=2, "c"=2]> {stablehlo.mesh = {axes = [{name = "a", size = 2 : i64}, {name = "b", size = 2 : i64}, {name = "c", size = 2 : i64}]}}
  sdy.mesh @mesh_0 = <["a"=2, "b"=2, "c"=2]> {stablehlo.mesh = {axes = [{name = "a", size = 2 : i64}, {name = "b", size = 2 : i64}, {name = "c", size = 2 : i64}]}}
  func.func public @main(%arg0: tensor<8x8xf32>) -> (tensor<8x8xf32> {jax.result_info = "result"}) {
    %0 = sdy.manual_computation(%arg0) in_shardings=[<@mesh, [{"a", "b"}, {"c"}]>] out_shardings=[<@mesh, [{"a", "b"}, {"c"}]>] manual_axes={"a", "b", "c"} (%arg1: tensor<2x4xf32>) {
      %1 = "stablehlo.all_reduce"(%arg1) <{channel_handle = #stablehlo.channel_handle<handle = 1, type = 1>, replica_groups = #stablehlo.replica_group_mesh_axes<mesh = @mesh_0, axes = [#stablehlo.axis_ref<name = "c">, #stablehlo.axis_ref<name = "a">]>, use_global_device_ids}> ({
      ^bb0(%arg2: tensor<f32>, %arg3: tensor<f32>):
        %3 = stablehlo.add %arg2, %arg3 : tensor<f32>
        stablehlo.return %3 : tensor<f32>
      }) : (tensor<2x4xf32>) -> tensor<2x4xf32>
      %2 = "stablehlo.collective_permute"(%1) <{channel_handle = #stablehlo.channel_handle<handle = 1, type = 1>, source_target_pairs = dense<[[0, 4], [4, 0], [1, 5], [5, 1], [2, 6], [6, 2], [3, 7], [7, 3]]> : tensor<8x2xi64>}> : (tensor<2x4xf32>) -> tensor<2x4xf32>
      sdy.return %2 : tensor<2x4xf32>
    } : (tensor<8x8xf32>) -> tensor<8x8xf32>
    return %0 : tensor<8x8xf32>
  }
}
"""


@pytest.mark.parametrize("text", [STABLEHLO_0_6_2, STABLEHLO_0_12_0_1], ids=["jax-0.6.2", "jax-0.12.0.1"])
def test_stablehlo_forms_read_the_same_and_each_op_keeps_its_own_attributes(text: str) -> None:
    all_reduce, permute = hlo.parse_stablehlo(text).ops
    assert (all_reduce.kind, permute.kind) == ("all-reduce", "collective-permute")
    assert all_reduce.replica_groups == ((0, 4, 1, 5), (2, 6, 3, 7))
    assert all_reduce.source_target_pairs is None  # not the permute's, lines later
    assert all_reduce.operand_shapes == (hlo.Shape("f32", (2, 4)),)
    assert permute.source_target_pairs == ((0, 4), (4, 0), (1, 5), (5, 1), (2, 6), (6, 2), (3, 7), (7, 3))


def test_stablehlo_splat_and_inline_mesh_forms() -> None:
    splat = STABLEHLO_0_6_2.replace(
        "dense<[[0, 4, 1, 5], [2, 6, 3, 7]]> : tensor<2x4xi64>", "dense<0> : tensor<1x1xi64>"
    )
    assert hlo.parse_stablehlo(splat).ops[0].replica_groups == ((0,),)
    inline = STABLEHLO_0_12_0_1.replace(
        'mesh = @mesh_0, axes = [#stablehlo.axis_ref<name = "c">, #stablehlo.axis_ref<name = "a">]',
        'mesh = #stablehlo.mesh<axes = [#stablehlo.mesh_axis<name = "a", size = 2>, '
        '#stablehlo.mesh_axis<name = "b", size = 2>, #stablehlo.mesh_axis<name = "c", size = 2>]>, axes = ["c", "a"]',
    )
    assert hlo.parse_stablehlo(inline).ops[0].replica_groups == ((0, 4, 1, 5), (2, 6, 3, 7))


@pytest.mark.parametrize(
    ("old", "new"),
    [
        (
            '#stablehlo.axis_ref<name = "a">',
            '#stablehlo.axis_ref<name = "a", sub_axis_info = #stablehlo.sub_axis<pre_size = 1, size = 2>>',
        ),
        ("mesh = @mesh_0", "mesh = @mesh_9"),
        ("#stablehlo.replica_group_mesh_axes<", "#stablehlo.replica_group_future<"),
    ],
    ids=["sub-axis", "unknown mesh", "unknown attribute"],
)
def test_stablehlo_form_it_does_not_know_is_an_error_naming_the_text(old: str, new: str) -> None:
    with pytest.raises(hlo.HloParseError, match=re.escape(new.split("<")[0])):
        hlo.parse_stablehlo(STABLEHLO_0_12_0_1.replace(old, new))


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


def _lowered_for_tpu_text(fn, mesh_label: str, shape=(8, 4), dtype=jnp.bfloat16) -> str:
    from conformance import compat

    mesh = build_mesh(parse_mesh(mesh_label), "cpu")
    arg = jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, P("x")))
    body = jax.shard_map(fn, mesh=mesh, in_specs=P("x"), out_specs=P("x"))
    return compat.lower_for_platform(jax.jit(body), (arg,), "tpu").as_text()


PERM = [(j, (j + 1) % 4) for j in range(4)]


def test_lowered_module_counts_unrolled_permutes_in_the_targets_own_dtype() -> None:
    """Lowered for TPU the transfer stays bfloat16 (XLA CPU's compiled module would show f32)."""

    def ring(x):
        for _ in range(3):
            x = lax.ppermute(x, "x", PERM)
        return x

    summary = hlo.parse_stablehlo(_lowered_for_tpu_text(ring, "4-x-auto"))
    assert [op.multiplicity for op in summary.ops] == [1, 1, 1]
    assert summary.received_bytes_per_device() == 3 * (2 * 4 * 2)  # 3 hops of a 2x4 bf16 block


def test_lowered_module_multiplies_by_calls_and_counted_loops_but_cannot_bound_another_loop() -> None:
    calls = hlo.parse_stablehlo(STABLEHLO_CALLED_TWICE)
    assert [op.multiplicity for op in calls.ops] == [2]
    assert calls.received_bytes_per_device() == 2 * (3 * 8 * 2)

    def counted(x):  # fori_loop and scan lower to a counted while: i from a constant, i < N, i += 1
        x = lax.fori_loop(1, 4, lambda _, v: lax.ppermute(v, "x", PERM), x)
        return lax.scan(lambda v, _: (lax.ppermute(v, "x", PERM), None), x, None, length=2)[0]

    summary = hlo.parse_stablehlo(_lowered_for_tpu_text(counted, "4-x-auto"))
    assert [op.multiplicity for op in summary.ops] == [3, 2]
    assert summary.received_bytes_per_device() == 5 * (2 * 4 * 2)

    def data_dependent(x):  # its trips depend on the data: not in the module
        def body(carry):
            v, total = carry
            return lax.ppermute(v, "x", PERM), total + v.sum()

        return lax.while_loop(lambda c: c[1] < 100.0, body, (x, x.sum() * 0))[0]

    summary = hlo.parse_stablehlo(_lowered_for_tpu_text(data_dependent, "4-x-auto"))
    (op,) = summary.ops
    assert op.multiplicity is None
    assert summary.received_bytes_per_device() is None


def _overlap_of(fn, mesh_label: str = "4-x-auto") -> hlo.OverlapSummary:
    return hlo.overlap(hlo.parse_module(_compiled_text(fn, mesh_label)))


def test_overlap_a_transfer_beside_an_independent_matmul_is_hideable() -> None:
    w = jnp.ones((4, 4), jnp.float32)

    def ring_step(x):  # send the block in hand while multiplying it
        return lax.ppermute(x, "x", PERM) + x @ w

    summary = _overlap_of(ring_step)
    assert summary.fraction == "1/1", [t.describe() for t in summary.transfers]
    assert "can overlap" in summary.transfers[0].describe()


def test_overlap_a_transfer_between_two_matmuls_is_exposed() -> None:
    w = jnp.ones((4, 4), jnp.float32)

    def serial(x):  # the matmul feeds the transfer, the next matmul reads what it delivers
        return lax.ppermute(x @ w, "x", PERM) @ w

    summary = _overlap_of(serial)
    assert summary.fraction == "0/1"
    (transfer,) = summary.exposed
    assert transfer.waits_for and transfer.feeds and "no matmul is independent of it" in transfer.describe()


def test_overlap_reads_a_loop_body_as_one_step_of_the_ring() -> None:
    w = jnp.ones((4, 4), jnp.float32)

    def looped(x):
        def step(_, carry):
            block, acc = carry
            return lax.ppermute(block, "x", PERM), acc + block @ w

        return lax.fori_loop(0, 3, step, (x, x * 0))[1]

    summary = _overlap_of(looped)
    assert summary.fraction == "3/3"  # one op, three trips, each beside the matmul of its step

    def gather_then_multiply(x):
        gathered = lax.fori_loop(0, 3, lambda _, v: lax.ppermute(v, "x", PERM), x)
        return gathered @ w

    assert _overlap_of(gather_then_multiply).fraction == "0/3"


#: The JAX 0.6.2 form: the shard_map body is a private function reached by ``call``.
STABLEHLO_CALLED_TWICE = """\
module @jit_f attributes {mhlo.num_partitions = 4 : i32, mhlo.num_replicas = 1 : i32} {
  func.func public @main(%arg0: tensor<3x8xbf16> {mhlo.sharding = "{manual}"}) -> (tensor<3x8xbf16>) {
    %0 = call @shmap_body(%arg0) : (tensor<3x8xbf16>) -> tensor<3x8xbf16>
    %1 = call @shmap_body(%0) : (tensor<3x8xbf16>) -> tensor<3x8xbf16>
    return %1 : tensor<3x8xbf16>
  }
  func.func private @shmap_body(%arg0: tensor<3x8xbf16>) -> (tensor<3x8xbf16>) {
    %0 = "stablehlo.collective_permute"(%arg0) <{channel_handle = #stablehlo.channel_handle<handle = 1, type = 1>, source_target_pairs = dense<[[0, 3], [1, 0], [2, 1], [3, 2]]> : tensor<4x2xi64>}> : (tensor<3x8xbf16>) -> tensor<3x8xbf16>
    return %0 : tensor<3x8xbf16>
  }
}
"""


#: XLA's ragged all-to-all as JAX 0.6.2 to 0.12 lower it: a custom call (a 2-D mesh's second axis).
STABLEHLO_RAGGED = """module @jit_f attributes {mhlo.num_partitions = 8 : i32, mhlo.num_replicas = 1 : i32} {
  func.func public @main(%arg0: tensor<13x8xbf16>, %arg1: tensor<8x8xbf16>, %arg2: tensor<4xi32>) -> (tensor<8x8xbf16>) {
    %0 = stablehlo.custom_call @ragged_all_to_all(%arg0, %arg1, %arg2, %arg2, %arg2, %arg2) {api_version = 4 : i32, backend_config = {channel_id = 1 : i64, replica_groups = dense<[[0, 1, 2, 3], [4, 5, 6, 7]]> : tensor<2x4xi64>}} : (tensor<13x8xbf16>, tensor<8x8xbf16>, tensor<4xi32>, tensor<4xi32>, tensor<4xi32>, tensor<4xi32>) -> tensor<8x8xbf16>
    return %0 : tensor<8x8xbf16>
  }
}
"""


def test_stablehlo_ragged_all_to_all_is_read_from_its_custom_call_and_another_form_raises() -> None:
    (op,) = hlo.parse_stablehlo(STABLEHLO_RAGGED).ops
    assert op.kind == "ragged-all-to-all" and op.replica_groups == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert op.result_shapes == (hlo.Shape("bf16", (8, 8)),) and op.operand_shapes[0] == hlo.Shape(
        "bf16", (13, 8)
    )
    assert op.received_bytes() == 8 * 8 * 2  # its buffer: what a module's text can say
    generic = STABLEHLO_RAGGED.replace(
        "stablehlo.custom_call @ragged_all_to_all(",
        '"stablehlo.custom_call"() <{call_target_name = "ragged_all_to_all"}> (',
    )
    with pytest.raises(hlo.HloParseError, match="ragged all-to-all in a form not listed"):
        hlo.parse_stablehlo(generic)


def test_byte_lines_give_each_collective_its_bytes_and_sum_to_what_the_device_receives() -> None:
    """A bytes failure's list: each collective with the bytes its runs deliver to the device that receives
    most, summing to the module's count; a permute that skips device 3 makes device 1 the one named."""
    summary = hlo.parse_hlo(LOOPED)
    lines = summary.byte_lines()
    assert len(lines) == len(summary.ops) + 1, lines
    figures = [int(re.search(r": (\d+) bytes$", line)[1]) for line in lines[:-1]]
    assert sum(figures) == summary.received_bytes_per_device(), (figures, lines)
    assert lines[-1] == f"  in all: {summary.received_bytes_per_device()} bytes to each device, per call", (
        lines
    )
    uneven = hlo.CollectiveSummary(
        (
            hlo.CollectiveOp(
                "collective-permute", "sync", "cp", "main", (hlo.Shape("f32", (4, 8)),), (), ((0, 1), (2, 1))
            ),
            hlo.CollectiveOp(
                "collective-permute", "sync", "cq", "main", (hlo.Shape("f32", (2, 8)),), (), ((1, 2),)
            ),
        )
    )
    assert uneven.byte_lines()[-1] == "  in all: 128 bytes to device 1, which receives most, per call"
    assert uneven.byte_lines(summed=False)[-1].endswith("[cq]: 0 bytes")
    # every device receives 64 bytes, from a different op each: the lines are device 0's, summing to 64
    crossed = hlo.CollectiveSummary(
        tuple(
            hlo.CollectiveOp(
                "collective-permute", "sync", f"c{t}", "main", (hlo.Shape("f32", (2, 8)),), (), ((s, t),)
            )
            for s, t in ((0, 1), (1, 0))
        )
    )
    assert [line.rsplit(": ", 1)[1] for line in crossed.byte_lines()] == [
        "0 bytes",
        "64 bytes",
        "64 bytes to each device, per call",
    ]
    looped = hlo.parse_hlo(LOOPED.replace(', backend_config={"known_trip_count":{"n":"3"}}', ""))
    assert looped.byte_lines()[-1] == "  in all: unbounded (a loop of unknown trip count), per call"
