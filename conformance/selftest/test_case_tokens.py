"""A hand-edited case token names its bad field and what it may be, before any kernel runs: a dim
given twice, unknown or missing, a value that is no integer or below the dim's least, a seed, a DMA
order, a dtype, a mesh; and every token the suite prints reads back as the same case."""

from __future__ import annotations

import pytest

from conformance import case_tokens, specs
from conformance.fixtures.meshes import parse_mesh
from conformance.runner import Case
from conformance.specs.base import FamilySpec

pytestmark = pytest.mark.selftest

GATHER = "2-x-auto:rows_per_shard=3,cols=128:float32:seed=0"
#: A hand-edited token and the words its error must carry.
BAD_TOKENS = {
    "a negative size": (
        GATHER.replace("rows_per_shard=3", "rows_per_shard=-1"),
        "rows_per_shard=-1: all_gather's rows_per_shard is at least 1",
    ),
    "a size of zero": (GATHER.replace("cols=128", "cols=0"), "cols=0: all_gather's cols is at least 1"),
    "a dim given twice": (GATHER.replace("cols=128", "cols=8,cols=9"), "dim cols given twice"),
    "a value that is a word": (GATHER.replace("=3", "=two"), "rows_per_shard='two' is not an integer"),
    "an unknown dim": (GATHER.replace("cols", "colz"), "unknown dim 'colz' (did you mean 'cols'?)"),
    "a missing dim": (
        GATHER.replace(",cols=128", ""),
        "missing dim cols; all_gather's dims are rows_per_shard, cols",
    ),
    "a dim without a value": (GATHER.replace("cols=128", "cols"), "dim 'cols' is not NAME=VALUE"),
    "a negative seed": (GATHER.replace("seed=0", "seed=-3"), "seed=-3: a seed is a non-negative integer"),
    "a seed without its name": (GATHER.replace("seed=0", "0"), "'0' where seed=S belongs"),
    "an unknown DMA order": (
        f"{GATHER}:dma=onwait",
        "dma=onwait (did you mean 'on_wait'?) is not one of eager, on_wait",
    ),
    "a misspelt dtype": (GATHER.replace("float32", "flaot32"), "dtype 'flaot32' (did you mean 'float32'?)"),
    "a misspelt mesh": (GATHER.replace("auto", "atuo"), "bad mesh label '2-x-atuo'"),
    "too few fields": (
        "2-x-auto:rows_per_shard=3,cols=128",
        "expected MESH:DIM=V,...:DTYPE:seed=S[:dma=MODE] (2 fields",
    ),
}


@pytest.mark.parametrize("bad", sorted(BAD_TOKENS))
def test_a_bad_field_is_named_with_what_it_may_be(bad: str) -> None:
    token, says = BAD_TOKENS[bad]
    with pytest.raises(ValueError) as raised:
        case_tokens.parse(token, specs.get("all_gather"))
    assert says in str(raised.value), str(raised.value)
    with pytest.raises(ValueError, match="bad case token"):  # what replay turns into a usage error
        Case.from_token("all_gather", "xla_all_gather", token)


@pytest.mark.parametrize("dma", [None, *case_tokens.DMA_MODES])
def test_a_printed_token_reads_back_as_its_case(dma: str | None) -> None:
    spec = specs.get("ragged_all_to_all")
    mesh = parse_mesh("3-x-explicit")
    case = Case.make(
        "ragged_all_to_all",
        "dense_ragged_all_to_all",
        mesh,
        spec.canonical_dims,
        "bfloat16",
        seed=7,
        dma_mode=dma,
    )
    assert Case.from_token(case.family, case.impl, case.token) == case, case.token


def test_a_routing_the_kernel_is_not_drawn_is_refused_saying_what_it_needs() -> None:
    """A MoE kernel that declares no replica rule is never drawn the replicated placement (routing 6): a
    token asking for it is refused, naming the declaration; one that declares it replays it."""
    spec = specs.get("moe_dispatch")
    dims = {**spec.canonical_dims, "routing": 6}
    token = f"2-x-explicit:{','.join(f'{k}={v}' for k, v in dims.items())}:float32:seed=0"
    with pytest.raises(
        ValueError, match=r"routing=6 is not one of those xla_moe_dispatch is given"
    ) as raised:
        Case.from_token("moe_dispatch", "xla_moe_dispatch", token)
    assert "a replicated placement needs replicas=conformance.ExpertReplicas(...)" in str(raised.value)
    assert Case.from_token("moe_dispatch", "dense_moe_dispatch", token).dims_map["routing"] == 6


def _every_builtin() -> list[tuple[str, str]]:
    import conformance.kernels  # noqa: F401  (registers the built-ins)
    from conformance import registry

    return sorted(  # the collective families: send_recv's transfers have cases of their own
        (family, impl.name)
        for family, spec in specs.FAMILIES.items()
        if isinstance(spec, FamilySpec)
        for impl in registry.registered(family)
        if impl.is_builtin
    )


@pytest.mark.parametrize("family, impl", _every_builtin())
def test_every_case_the_suite_draws_prints_a_token_replay_reads_back(family: str, impl: str) -> None:
    """Each built-in's drawn cases (dims, dtype, seed, DMA order, on a drawn mesh) print a token that
    replay parses into the same case: what the suite prints, replay accepts."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    from conformance import strategies

    @settings(max_examples=5, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(st.data())
    def round_trip(data: st.DataObject) -> None:
        case = strategies.draw_case(data, family, impl, "cpu")
        assert Case.from_token(family, impl, case.token) == case, case.token

    round_trip()
