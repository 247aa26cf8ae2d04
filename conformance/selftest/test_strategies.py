"""The drawn checks meet the standard meshes with different cases, not 26 copies of the simplest.

Hypothesis tries each test's simplest example first; with one example per mesh (the value and
gradient checks under the CI profile) every mesh met 1 row per shard, the first dtype, seed 0 and
the first DMA mode, and a bidirectional ring never split its rows off a covering mesh. Each mesh
now starts its lists at its own entry (:mod:`conformance.strategies`); these tests draw what the
CI run draws, through the tests' own path (:func:`conformance.family_tests.case_for`).
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from conformance import family_tests, registry, specs, strategies
from conformance.checks import CHECKS
from conformance.checks.base import Axes
from conformance.fixtures.meshes import COVERING_MESHES, MESH_SETS, STANDARD_MESHES, MeshConfig, parse_mesh
from conformance.runner import DMA_MODES, Case

pytestmark = pytest.mark.selftest

STANDARD = [parse_mesh(label) for label in STANDARD_MESHES]
#: The drawn check of each kind of draw; its Axes name the meshes it runs on.
CHECK_OF = {"drawn": "values", "drawn_gradients": "gradients"}


def first_draws(family: str, impl: str, case_kind: str) -> list[Case]:
    """The case each mesh of the check's set (for this implementation) draws first under the suite's
    profile (all of them, in the CI profile's one example per mesh)."""
    axes = CHECKS[CHECK_OF[case_kind]].axes
    assert axes.case == case_kind
    labels = MESH_SETS[axes.meshes_for(registry.get(family, impl))]
    return [_first_draw(family, impl, axes, parse_mesh(label)) for label in labels]


def _first_draw(family: str, impl: str, axes: Axes, mesh: MeshConfig) -> Case:
    cases: list[Case] = []

    @family_tests.PER_MESH
    @given(data=st.data())
    def draw(data: st.DataObject) -> None:
        if not cases:
            params = {"platform": "cpu", "mesh_config": mesh, "data": data}
            cases.append(family_tests.case_for(axes, family, impl, params))

    draw()
    return cases[0]


@pytest.mark.parametrize(
    "family, impl",
    [
        ("all_gather", "pallas_ring_all_gather_bidirectional"),
        ("allgather_matmul", "ring_allgather_matmul_bidirectional"),
        ("matmul_reduce_scatter", "ring_matmul_reduce_scatter_bidirectional"),
    ],
)
def test_the_meshes_meet_every_entry_of_every_drawn_list(family: str, impl: str) -> None:
    spec = specs.get(family)
    values = first_draws(family, impl, "drawn")
    for dim in spec.dims:
        met = {dict(c.dims)[dim] for c in values}
        assert met == set(spec.values_of(dim)), f"{dim}: the meshes met {sorted(met)}"
    assert {c.dtype for c in values} == set(spec.dtypes)  # the built-ins claim every dtype of their family
    assert len({c.seed for c in values}) == len(values)
    if registry.get(family, impl).pallas:
        assert {c.dma_mode for c in values} == set(DMA_MODES)
    if not registry.get(family, impl).differentiable:
        return
    gradients = first_draws(family, impl, "drawn_gradients")  # on the 7 covering meshes
    assert {c.dtype for c in gradients} == set(spec.gradient_dtypes)
    rows = {dict(c.dims)["rows_per_shard"] for c in gradients}
    assert rows == set(spec.values_of("rows_per_shard")), f"rows per shard: the meshes met {sorted(rows)}"
    for dim in spec.dims:  # a draw the bound says nothing of is drawn again (cols 256 in bfloat16)
        met = {dict(c.dims)[dim] for c in gradients}
        assert len(met) >= min(3, len(spec.values_of(dim))), f"{dim}: the meshes met {sorted(met)}"
    # The two checks of one mesh draw different cases.
    same = [v for v in values if v.mesh.label in COVERING_MESHES]
    assert sum(v.dims == g.dims for v, g in zip(same, gradients, strict=True)) < len(gradients) // 2


def test_a_bidirectional_ring_splits_its_rows_on_most_meshes() -> None:
    """A ring of 2 or more with 2 or more rows per shard sends rows both ways: most meshes' draws
    (with 1 row per shard on all of them, none did)."""
    cases = first_draws("all_gather", "pallas_ring_all_gather_bidirectional", "drawn")
    split = [c for c in cases if c.mesh.axis_size > 1 and dict(c.dims)["rows_per_shard"] > 1]
    assert len(split) >= len(cases) // 2, [c.token for c in cases]


def test_a_list_starts_where_the_draw_says_and_passes_over_every_entry() -> None:
    for length in (1, 2, 4, 5, 6):
        for position in range(4):
            starts = [strategies.start_of(length, draw=d, position=position) for d in range(length * 3)]
            for one_pass in range(3):
                assert sorted(starts[one_pass * length : (one_pass + 1) * length]) == list(range(length))
    # Two lists of one length pair different entries on the second pass.
    first = [strategies.start_of(5, draw=d, position=1) for d in range(10)]
    second = [strategies.start_of(5, draw=d, position=2) for d in range(10)]
    assert {a - b for a, b in zip(first[5:], second[5:], strict=True)} != {0}


def test_draw_zero_is_hypothesis_own_order() -> None:
    seen: list[tuple[int, int]] = []

    @family_tests.PER_MESH
    @given(data=st.data())
    def draw(data: st.DataObject) -> None:
        if not seen:
            seen.append((data.draw(strategies.sampled((3, 1, 2))), data.draw(strategies.integers(4, 9))))

    draw()
    assert seen == [(3, 4)]
