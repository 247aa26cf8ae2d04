"""The forms a MoE kernel declares (:mod:`conformance.specs.moe_forms`): a capacity rule
(``conformance.ExpertCapacity``), whose reference drops the rows the rule drops, and groups aligned to
a multiple of rows; and a dispatch missing rows told which expert lacks which tokens' rows."""

from __future__ import annotations

import re

import numpy as np
import pytest

import conformance
from conformance.specs import moe_dispatch, moe_routing
from conformance.specs.moe_routing import UNROUTED

pytestmark = pytest.mark.selftest

#: 2 devices of 4 tokens, 2 experts each, top 2; every token's first choice expert 0 (a hot expert).
IDS = np.array([[0, 1], [0, 3], [0, 1], [0, 2], [0, 3], [0, 1], [2, 0], [0, 3]])
WHERE = np.arange(4).reshape(2, 2)


def test_a_device_group_in_token_order_keeps_each_expert_s_first_rows_of_each_device() -> None:
    rule = conformance.ExpertCapacity(1.0, group="device", order="token")
    assert rule.rows(4, 2, 4) == 2  # ceil(1.0 * 4 tokens * 2 choices / 4 experts)
    kept = moe_routing.capped(IDS, WHERE, rule)
    # device 0: expert 0 keeps tokens 0, 1; expert 1 tokens 0, 2; expert 3 token 1
    # device 1: expert 0 keeps tokens 4, 5 (token 6's second choice and token 7's are past it)
    assert kept.tolist() == [
        [0, 1],
        [0, 3],
        [UNROUTED, 1],
        [UNROUTED, 2],
        [0, 3],
        [0, 1],
        [2, UNROUTED],
        [UNROUTED, 3],
    ]


def test_choice_order_keeps_every_first_choice_before_a_second_and_all_counts_every_token() -> None:
    rule = conformance.ExpertCapacity(1.0, group="all", order="choice")
    assert rule.rows(8, 2, 4) == 4
    kept = moe_routing.capped(IDS, WHERE, rule)
    # expert 0 takes the first choices of tokens 0..3; tokens 4, 5 and 7's first choices and token 6's
    # second are past its room; the other experts are within theirs
    u = UNROUTED
    assert kept.tolist() == [[0, 1], [0, 3], [0, 1], [0, 2], [u, 3], [u, 1], [2, u], [u, 3]]


def test_the_capped_reference_is_the_family_s_on_the_capped_routing() -> None:
    spec = moe_dispatch.MOE_DISPATCH.registration_options["capacity"].derive(
        moe_dispatch.MOE_DISPATCH, conformance.ExpertCapacity(1.0)
    )
    tokens = np.random.default_rng(0).normal(size=(8, 3))
    capped = moe_routing.capped(IDS, WHERE, conformance.ExpertCapacity(1.0))
    got = spec.expected((tokens, IDS, WHERE), axis_size=2)
    assert np.array_equal(got, moe_dispatch.reference(tokens, capped, WHERE))
    assert not np.array_equal(got, moe_dispatch.reference(tokens, IDS, WHERE))
    assert "capacity factor 1" in spec.summary


@pytest.mark.parametrize(
    "bad, says",
    [
        (dict(factor=0), "factor must be a positive number"),
        (dict(factor=float("inf")), "factor must be a positive number"),
        (dict(factor=1.0, group="batch"), "group must be one of ('device', 'all')"),
        (dict(factor=1.0, order="random"), "order must be one of ('token', 'choice')"),
    ],
)
def test_a_rule_that_means_nothing_is_refused_naming_the_field(bad, says) -> None:
    with pytest.raises(ValueError, match=re.escape(says)):
        conformance.ExpertCapacity(**bad)


def test_a_capacity_that_is_no_rule_is_a_registration_error() -> None:
    with pytest.raises(
        TypeError, match=re.escape("capacity must be None or a conformance.ExpertCapacity, got 1.25")
    ):
        conformance.register("moe_dispatch", name="selftest_capacity_as_a_number", capacity=1.25)


def test_missing_rows_are_named_by_expert_and_a_capacity_s_pattern_said() -> None:
    tokens = np.random.default_rng(1).normal(size=(8, 3))
    expected = moe_dispatch.reference(tokens, IDS, WHERE)
    rule = conformance.ExpertCapacity(1.0)
    dropped = moe_dispatch.reference(tokens, moe_routing.capped(IDS, WHERE, rule), WHERE)
    lines = moe_dispatch.rows_missing(tokens, IDS, WHERE, dropped, 0.0, axis_size=2)
    assert lines[0].startswith("rows missing   : every short expert kept its first rows in token order"), (
        lines
    )
    assert "(within each sender's tokens)" in lines[0]
    assert "expert 0 (on device 0) received 4 of 8 rows, missing tokens 2-3, 6-7" in lines[0], lines
    assert "capacity=conformance.ExpertCapacity" in lines[1]
    # a device's own rows overwritten by another's: rows missing, no capacity said
    overwritten = expected.copy()
    overwritten[0:2] = expected[2:4]
    lines = moe_dispatch.rows_missing(tokens, IDS, WHERE, overwritten, 0.0, axis_size=2)
    assert lines == [
        "rows missing   : expert 0 (on device 0) received 6 of 8 rows, missing tokens 0-1",
        "rows extra     : device 0 holds 2 rows of tokens 2-3 beyond the copies routed to its experts",
    ], lines
    # rows in the wrong order are all there: nothing missing to say
    shuffled = expected.copy()
    shuffled[[0, 1]] = expected[[1, 0]]
    assert moe_dispatch.rows_missing(tokens, IDS, WHERE, shuffled, 0.0, axis_size=2) == []


def test_rows_that_cannot_be_told_apart_are_tagged_and_run_again() -> None:
    """One int8 column repeats its values: the account reruns the kernel on tokens tagged t + 1, or, where
    the dtype cannot hold every tag, says nothing."""
    tokens = np.ones((8, 1))
    rule = conformance.ExpertCapacity(1.0)
    asked = []

    def rerun(**replaced):
        asked.append(sorted(replaced))
        return moe_dispatch.reference(replaced["tokens"], moe_routing.capped(IDS, WHERE, rule), WHERE)

    wrong = np.zeros((32, 1))
    lines = moe_dispatch.rows_missing(tokens, IDS, WHERE, wrong, 0.0, axis_size=2, dtype="int8", rerun=rerun)
    assert asked == [["tokens"]] and "received 4 of 8 rows, missing tokens 2-3, 6-7" in lines[0], lines
    assert moe_dispatch.rows_missing(tokens, IDS, WHERE, wrong, 0.0, axis_size=2, dtype="int8") == []


def test_aligned_groups_start_at_multiples_and_the_rows_between_are_zero() -> None:
    from conformance.specs import moe_combine, moe_forms

    # device 0 hosts experts 0 (8 rows) and 1 (3 rows); device 1 experts 2 (2 rows) and 3 (3 rows)
    places = moe_forms.aligned_places(IDS, WHERE, 4)
    assert places[:16].tolist() == [*range(8), 8, 9, 10, *[-1] * 5]  # C = 16 packed rows a device
    assert places[16:].tolist() == [22, 23, 26, 27, 28, *[-1] * 11]  # 16 + 3 * 2 aligned rows a device
    spec = moe_dispatch.MOE_DISPATCH.registration_options["group_alignment"].derive(
        moe_dispatch.MOE_DISPATCH, 4
    )
    tokens = np.random.default_rng(2).normal(size=(8, 3))
    got = spec.expected((tokens, IDS, WHERE), axis_size=2)
    packed = moe_dispatch.reference(tokens, IDS, WHERE)
    assert got.shape == (44, 3) and np.array_equal(got[places[places >= 0]], packed[places >= 0])
    assert not got[np.setdiff1d(np.arange(44), places)].any()
    assert spec.out_shape({"tokens_per_shard": 4, "experts_per_device": 2, "top_k": 2, "hidden": 3}, 2) == (
        44,
        3,
    )
    # a combine takes its rows from the aligned places, whatever lies between
    combine = moe_combine.MOE_COMBINE.registration_options["group_alignment"].derive(
        moe_combine.MOE_COMBINE, 4
    )
    rows = np.random.default_rng(3).normal(size=(44, 3))
    w = np.random.default_rng(4).normal(size=(8, 2))
    packed_rows = np.zeros((32, 3))
    packed_rows[places >= 0] = rows[places[places >= 0]]
    assert np.allclose(
        combine.expected((rows, w, IDS, WHERE), axis_size=2),
        moe_combine.reference(packed_rows, w, IDS, WHERE),
    )


def test_a_replicated_placement_hosts_its_hot_experts_on_two_devices_and_routes_to_them() -> None:
    """The routing ``REPLICATED_EXPERTS``: a quarter of the slots host a hot expert a second time, on
    another device; every token's first choice is one of them; the ids name only the experts there are."""
    for n, x, k in ((2, 1, 1), (4, 2, 2), (5, 3, 4), (8, 2, 2)):
        d = {"tokens_per_shard": 3, "experts_per_device": x, "top_k": k, "hidden": 8}
        d["routing"] = moe_routing.REPLICATED_EXPERTS
        where, ids = moe_routing.placement(d, n), moe_routing.expert_ids(d, n)
        hot = moe_routing.replicated(d, n)
        assert hot >= 1, (n, x, k)
        flat = where.reshape(-1)
        assert sorted(flat.tolist()) == sorted([*range(n * x - hot), *range(hot)])
        for e in range(hot):
            assert len({int(p) // x for p in np.nonzero(flat == e)[0]}) == 2, (n, x, e, where)
        assert set(ids.reshape(-1).tolist()) <= set(flat.tolist())
        assert all(row[0] < hot for row in ids), ids
    one = {"tokens_per_shard": 3, "experts_per_device": 2, "top_k": 2, "hidden": 8, "routing": 6}
    assert moe_routing.replicated(one, 1) == 0  # a ring of one has no other device to replicate on


def test_each_replica_rule_sends_a_row_to_the_replica_it_names() -> None:
    """Expert 0 on slots 0 (device 0) and 3 (device 1); the rule picks a slot per row, and the placement
    becomes one expert a slot."""
    where = np.array([[0, 1], [2, 0]])
    ids = np.array([[0, 2], [0, 1], [0, 2], [1, 0]])  # 2 devices of 2 tokens
    by_sender, arange = moe_routing.physical(ids, where, "sender")
    assert arange.tolist() == [[0, 1], [2, 3]]
    assert by_sender.tolist() == [[0, 2], [0, 1], [3, 2], [1, 3]]
    by_token, _ = moe_routing.physical(ids, where, "token")
    assert by_token.tolist() == [[0, 2], [3, 1], [0, 2], [1, 3]]
    distinct = np.arange(4).reshape(2, 2)
    assert moe_routing.physical(ids, distinct, "sender")[1] is distinct  # nothing to choose
    with pytest.raises(ValueError, match="rule must be one of"):
        conformance.ExpertReplicas("nearest")


def test_only_a_kernel_declaring_a_replica_rule_is_given_the_replicated_placement() -> None:
    from conformance import registry

    given = registry.spec_of("moe_dispatch", "dense_moe_dispatch").values_of("routing")
    assert moe_routing.REPLICATED_EXPERTS in given
    assert moe_routing.REPLICATED_EXPERTS not in moe_dispatch.SPEC.values_of("routing")
    with pytest.raises(TypeError, match=re.escape("replicas must be None or a conformance.ExpertReplicas")):
        conformance.register("moe_dispatch", name="replicas_by_name", replicas="sender")(lambda *a, **k: None)
