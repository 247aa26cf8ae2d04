"""The plugin's meshes: ``--meshes``, and the parametrization of a test over its meshes.

``--meshes=LABEL[,LABEL...]`` takes any mesh the run's devices can hold (``6-x-auto``,
``2x2x2-z-explicit``, ``8-x-explicit-reversed``; :func:`conformance.fixtures.meshes.parse_mesh`) and
replaces every named set of standard meshes with it; it is read once, in ``pytest_configure``, so a
bad label is one usage error before any pytest-xdist worker starts. A test over meshes takes them
from its :class:`~conformance.checks.base.Axes`: a named set, or labels of its own.
"""

from __future__ import annotations

import difflib
import itertools
import os
import re

import pytest

from conformance.checks.base import Axes
from conformance.fixtures import devices as devices_lib
from conformance.fixtures import meshes, pytest_fixtures
from conformance.jobs import distributed
from conformance.specs.base import FIXED_SHAPES


def meshes_option(config: pytest.Config) -> tuple[meshes.MeshConfig, ...] | None:
    """``--meshes`` as the meshes it names (``None``: not given). Any mesh label is accepted that the
    run's devices can hold; a label that names no mesh, or a mesh larger than the run's devices, is a
    usage error saying why (checked once, before any worker starts)."""
    text = config.getoption("meshes")
    if text is None:
        return None
    labels = list(dict.fromkeys(label.strip() for label in text.split(",") if label.strip()))
    if not labels:
        raise pytest.UsageError(f"--meshes={text!r} names no mesh; e.g. {meshes.LABEL_EXAMPLES}")
    configs, problems = [], []
    for label in labels:
        try:
            configs.append(meshes.parse_mesh(label))
        except ValueError as e:
            close = difflib.get_close_matches(label, meshes.STANDARD_MESHES, n=3)
            problems.append(f"{e}" + (f" (did you mean {' or '.join(close)}?)" if close else ""))
    devices, where = _devices_for_meshes(config)
    if devices is not None:
        problems += [
            f"{c.label} needs {c.num_devices} devices; {where} has {devices}"
            for c in configs
            if c.num_devices > devices
        ]
    if problems:
        raise pytest.UsageError(f"--meshes={text}: " + "; ".join(problems))
    return tuple(configs)


def _devices_for_meshes(config: pytest.Config) -> tuple[int | None, str]:
    """How many devices a mesh of this run may take, and where they are; ``None`` where that is not
    known before the backend starts (a job of another launcher; a GPU or TPU run, whose devices are
    the host's: a mesh it cannot hold skips there, naming what it needs)."""
    if distributed.launched():
        from conformance.jobs import launch

        processes, per_process = (
            os.environ.get(launch.NUM_PROCESSES),
            os.environ.get(launch.DEVICES_PER_PROCESS),
        )
        if processes and per_process:
            return int(processes) * int(per_process), f"this job of {processes} x {per_process} devices"
        return None, ""
    if config.getoption("distributed"):
        return None, ""
    targets = f"{config.getoption('markexpr') or ''} {config.getoption('require_backend') or ''}"
    if re.search(r"\b(gpu|tpu)\b", targets):
        return None, ""
    count = devices_lib.CPU_DEVICE_COUNT
    return count, f"the suite's CPU run ({count} simulated devices)"


#: The variants a test may run of each mesh's case, the first of each the one every mesh runs
#: (:attr:`conformance.checks.base.Axes.variants_on`): the adversarial DMA order, the odd shape.
_VARIANTS = (("dma_mode", ("on_wait", "eager")), ("shape", FIXED_SHAPES))


def parametrize_meshes(metafunc: pytest.Metafunc, axes: Axes, *, implementations: list | None = None) -> None:
    """``mesh_config`` (with ``dma_mode`` and ``shape`` where the test takes them) over the test's
    meshes: its named set, or the ones ``--meshes`` names instead, or its own; the first variant on
    every one of them, the other variants on :attr:`Axes.variants_on`'s meshes of them.

    With ``implementations`` (registry records), ``implementation`` is parametrized with them, each on
    its own meshes (:meth:`Axes.meshes_for`: a Pallas kernel's interpreted set where the test has one)."""
    taken = [(name, values) for name, values in _VARIANTS if name in metafunc.fixturenames]
    combos = list(itertools.product(*(values for _, values in taken)))
    names = ["mesh_config", *(name for name, _ in taken)]
    if implementations is None:
        params = _mesh_params(metafunc.config, axes, axes.meshes, combos)
    else:
        names = ["implementation", *names]
        params = [
            (impl.name, *row)
            for impl in implementations
            for row in _mesh_params(metafunc.config, axes, axes.meshes_for(impl), combos)
        ]
    if not params:  # pytest would make a case of a NOTSET mesh; say instead why none runs
        why = f"a ring of {axes.min_ring} or more devices" if axes.min_ring > 1 else "a mesh"
        reason = f"none of the meshes this run takes (--meshes) has {why}, which this check needs"
        blank = [None] * (len(names) - len(combos[0])) + list(combos[0])
        skip = pytest.mark.skip(reason=reason)
        metafunc.parametrize(names, [pytest.param(*blank, marks=skip, id="no-mesh")])
        return
    ids = ["-".join(str(getattr(p, "label", p)) for p in row) for row in params]
    metafunc.parametrize(names, params, ids=ids)


def _mesh_params(
    config: pytest.Config, axes: Axes, mesh_names: str | tuple[str, ...], combos: list[tuple]
) -> list[tuple]:
    """(mesh, *variant) rows: the first variant on each of the meshes, the others on the
    :attr:`Axes.variants_on` meshes among them."""
    if isinstance(mesh_names, str):
        configs = pytest_fixtures.mesh_set(config, mesh_names)
        second = {c.label for c in pytest_fixtures.mesh_set(config, axes.variants_on)}
    else:  # a check's own meshes (the compile tiers' rings): --meshes leaves them alone
        configs = tuple(map(meshes.parse_mesh, mesh_names))
        second = {c.label for c in configs}
    return [
        (config, *combo)
        for config in configs
        if config.axis_size >= axes.min_ring
        for i, combo in enumerate(combos)
        if i == 0 or config.label in second
    ]


def mesh_label_of(item: pytest.Item) -> str | None:
    """The label of the CPU mesh a test runs on (its first parameter that is a mesh); ``None`` for a
    test without one."""
    params = getattr(getattr(item, "callspec", None), "params", {})
    return next((p.label for p in params.values() if isinstance(p, meshes.MeshConfig)), None)


def outside_mesh_cover(config: pytest.Config, items: list[pytest.Item]) -> list[pytest.Item]:
    """The tests ``--mesh-cover`` leaves to the other part of the run
    (:func:`conformance.fixtures.meshes.in_mesh_cover`); none without the option."""
    cover = config.getoption("mesh_cover")
    if cover is None:
        return []
    return [item for item in items if not meshes.in_mesh_cover(mesh_label_of(item), cover)]
