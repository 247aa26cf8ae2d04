"""Every hypothesis strategy the suite uses, in one place.

Sizes are drawn from short lists of small values rather than ranges: each
distinct shape is a compile, so a short list lets examples share executables,
while still covering the edge cases that matter (1 row per shard, odd rows, a
contraction of 1, sizes that are not powers of two).

Where each draw starts. Hypothesis tries the *simplest* example first (every list's first entry,
every integer's lower bound) and shrinks a failure towards it; a test with one example per mesh
(the value and gradient checks under the CI profile) would meet every mesh with that same case: 1
row per shard (where a bidirectional ring has nothing to split), the first dtype, seed 0, the first
DMA mode. So each drawn list starts, for the ``draw``-th mesh of a test, at its own entry
(:func:`sampled`, :func:`integers`): consecutive meshes take consecutive entries, and every pass
over a list is shifted, differently for each list, so two lists do not pair the same entries on
every pass. The 26 standard meshes then meet every entry of every list by construction
(``conformance/selftest/test_strategies.py`` holds it); a failure shrinks towards its mesh's start.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from typing import Any, TypeVar

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st

from conformance import claims, registry
from conformance import dtypes as dtypes_lib
from conformance.fixtures.devices import devices_of
from conformance.fixtures.meshes import MESH_CONFIGS, MeshConfig, parse_mesh
from conformance.runner import DMA_MODES, Case

T = TypeVar("T")

settings.register_profile(
    "conformance-ci",
    derandomize=True,
    database=None,
    deadline=None,
    max_examples=10,
    print_blob=True,
    # One failure is one verdict: stop at the first failing example and shrink it. Hypothesis's default
    # goes on drawing after a failure in search of other distinct errors (10 failing examples at one
    # example per mesh, each a run of the kernel and its diagnosis: 7.6 s where one takes 0.7 s).
    report_multiple_bugs=False,
    # No "explain" phase: its line-coverage report is noise next to the failure message.
    phases=(Phase.explicit, Phase.reuse, Phase.generate, Phase.shrink),
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "conformance-thorough",
    parent=settings.get_profile("conformance-ci"),
    derandomize=False,
    max_examples=200,
)
#: The hypothesis profile the suite's own tests run under: the plugin registers it as a copy of
#: ``--hypothesis-profile`` (default ``conformance-ci``) before the test modules are imported.
#: The session's default profile, which a user's own hypothesis tests use, is never changed.
SUITE_PROFILE = "conformance-suite"


def use_profile(name: str | None) -> None:
    """Make the suite's tests run under hypothesis profile ``name`` (``None``: ``conformance-ci``)."""
    settings.register_profile(SUITE_PROFILE, parent=settings.get_profile(name or "conformance-ci"))


def suite_settings() -> settings:
    """The settings of the suite's hypothesis tests (:data:`SUITE_PROFILE`; ``conformance-ci``
    where no pytest session chose one, e.g. the module imported on its own)."""
    try:
        return settings.get_profile(SUITE_PROFILE)
    except Exception:  # hypothesis raises InvalidArgument for an unregistered profile
        return settings.get_profile("conformance-ci")


def mesh_configs(platform: str = "cpu") -> st.SearchStrategy[MeshConfig]:
    """The standard meshes this host's ``platform`` has enough devices for."""
    found = len(devices_of(platform))
    fitting = [c for c in MESH_CONFIGS if c.num_devices <= found]
    if not fitting:
        smallest = min(c.num_devices for c in MESH_CONFIGS)
        pytest.skip(f"needs {smallest} {platform} devices, found {found}")
    return st.sampled_from(fitting)


def draw_number(label: str, *, among: Sequence[str] = ()) -> int:
    """Which draw of a test over meshes (or routes) this is: the position of ``label`` in ``among``
    (the set the test runs on), else a hash of it (a mesh given with ``--meshes``). A set of ``n``
    meshes then meets every entry of each list of ``n`` entries or fewer (:func:`start_of`)."""
    return among.index(label) if label in among else zlib.crc32(label.encode())


def start_of(length: int, *, draw: int, position: int) -> int:
    """The entry a list of ``length`` starts at for draw ``draw``, the ``position``-th list a case
    draws: ``draw`` mod ``length``, each pass over the list shifted by ``position + 1`` more."""
    return (draw + (position + 1) * (draw // length)) % length


def sampled(values: Sequence[T], *, draw: int = 0, position: int = 0) -> st.SearchStrategy[T]:
    """``st.sampled_from(values)``, rotated so that its simplest example is the entry
    :func:`start_of` gives (``draw=0``: the first, as ``sampled_from``)."""
    values = tuple(values)
    k = start_of(len(values), draw=draw, position=position)
    return st.sampled_from(values[k:] + values[:k])


def integers(low: int, high: int, *, draw: int = 0, position: int = 0) -> st.SearchStrategy[int]:
    """``st.integers(low, high)``, its simplest example moved as :func:`sampled` moves a list's."""
    span = high - low + 1
    k = start_of(span, draw=draw, position=position)
    return st.integers(0, span - 1).map(lambda v: low + (v + k) % span)


def dims(family: str, impl: str, *, draw: int = 0) -> st.SearchStrategy[dict[str, int]]:
    spec = registry.spec_of(family, impl)
    return st.fixed_dictionaries(
        {d: sampled(spec.values_of(d), draw=draw, position=1 + i) for i, d in enumerate(spec.dims)}
    )


def tpu_layout_dims(family: str, impl: str) -> list[dict[str, int]]:
    """Shapes at a TPU's tile edges: the family's TPU-native dims, then each dim moved alone
    to every other value the spec draws it from (1 row, odd rows, narrow lanes).

    A Pallas kernel compiled for a TPU must accept the first and, for each of the
    others, either refuse it naming the constraint or lower to windows a TPU accepts.
    """
    spec = registry.spec_of(family, impl)
    native = dict(spec.tpu_native_dims or {})
    shapes = [native]
    for dim, value in native.items():
        shapes += [{**native, dim: v} for v in spec.values_of(dim) if v != value]
    return shapes


def tpu_native(family: str, impl: str, platform: str, dims: dict[str, int]) -> dict[str, int]:
    """``dims``, or the family's TPU-native dims for a Pallas kernel compiled for TPU chips."""
    native = registry.spec_of(family, impl).tpu_native_dims
    if platform == "tpu" and native and registry.get(family, impl).pallas:
        return dict(native)
    return dims


def fixed_dims(
    family: str, impl: str, platform: str, mesh: MeshConfig, dtype: str, shape: str
) -> dict[str, int] | None:
    """The dims of a fixed shape (``"odd"`` or its ``"even"`` twin) as ``impl`` runs it: the
    TPU-native ones for a Pallas kernel on TPU chips, moved to what the kernel claims (the even
    twin to other dims than the odd one's); ``None`` when the even twin still comes to the odd
    one's dims. Raises :class:`conformance.claims.NotClaimed`."""
    spec = registry.spec_of(family, impl)

    def dims_of(which: str, avoid: dict[str, int] | None = None) -> dict[str, int]:
        dims = tpu_native(family, impl, platform, spec.fixed_dims(which))
        return claims.adapt(family, impl, platform=platform, mesh=mesh, dims=dims, dtype=dtype, avoid=avoid)

    odd = dims_of("odd")
    if shape == "odd":
        return odd
    dims = dims_of(shape, avoid=odd)
    return None if dims == odd else dims


def claims_mesh(implementation: Any, label: str) -> bool:
    """Whether ``implementation`` (a registry record) claims the mesh ``label`` at the family's odd
    fixed shape in float32, on the CPU where it runs there (else the first platform it declares): what
    :attr:`conformance.checks.base.Axes.fallback_meshes` asks of each kernel at collection."""
    declared = implementation.platforms
    platform = "cpu" if declared is None or "cpu" in declared else declared[0]
    try:
        fixed_dims(implementation.family, implementation.name, platform, parse_mesh(label), "float32", "odd")
    except claims.NotClaimed:
        return False
    except Exception:  # a declaration that raises: the check's own test says so, on its own meshes
        return True
    return True


def draw_case(
    data: st.DataObject,
    family: str,
    impl: str,
    platform: str,
    *,
    mesh: MeshConfig | None = None,
    dtypes: tuple[str, ...] | None = None,
    draw: int = 0,
) -> Case:
    """Draw a whole case with labelled draws (hypothesis prints each label on failure).

    ``mesh``: the mesh, when the test is parametrized over meshes (so every one is covered by
    construction); otherwise it is drawn too. ``draw``: where each list starts (module doc,
    :func:`draw_number`).
    """
    if mesh is None:
        mesh = data.draw(mesh_configs(platform), label="mesh")
    spec = registry.spec_of(family, impl)
    dtypes = dtypes or spec.dtypes
    canonical = tpu_native(family, impl, platform, dict(spec.canonical_dims))
    if claims.declares_anything(family, impl):  # draw only what the kernel claims (conformance.claims)
        claimed = claims.claimed_dtypes(
            family, impl, platform=platform, mesh=mesh, dims=canonical, dtypes=dtypes
        )
        if not claimed:
            claims.adapt(
                family, impl, platform=platform, mesh=mesh, dims=canonical, dtype=dtypes[0]
            )  # raises
        dtypes = claimed
    else:  # a kernel that declares nothing claims the plain dtypes, not the mixed-precision pairs
        dtypes = tuple(d for d in dtypes if not dtypes_lib.is_mixed(d))
    dtype = data.draw(sampled(dtypes, draw=draw), label="dtype")
    drawn = tpu_native(family, impl, platform, data.draw(dims(family, impl, draw=draw), label="dims"))
    try:
        drawn = claims.adapt(family, impl, platform=platform, mesh=mesh, dims=drawn, dtype=dtype)
    except claims.NotClaimed:  # nothing near the drawn dims: the fixed shape's (claimed) neighbour
        drawn = claims.adapt(family, impl, platform=platform, mesh=mesh, dims=canonical, dtype=dtype)
    seed = data.draw(integers(0, 2**16, draw=draw), label="seed")
    dma_mode = None
    if registry.get(family, impl).pallas and platform == "cpu":
        dma_mode = data.draw(sampled(DMA_MODES, draw=draw, position=len(spec.dims) + 1), label="dma_mode")
    return Case.make(family, impl, mesh, drawn, dtype, platform=platform, seed=seed, dma_mode=dma_mode)
