"""A repeat run reads back the verdicts of unchanged interpreted programs, and an edited kernel is
judged again (:mod:`conformance.run.interpret_outcomes`)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from conformance.run import interpret_outcomes
from conformance.selftest import subprocess_env, suite_command

pytestmark = pytest.mark.selftest

#: A Pallas kernel of the all-gather family: XLA's gather, then a copy through a Pallas kernel's
#: body, which the edit below changes.
KERNEL = """
import jax
from jax import lax
from jax.experimental import pallas as pl
from jax.sharding import PartitionSpec as P

import conformance


def _copy(x_ref, o_ref):
    o_ref[...] = x_ref[...]


@conformance.register("all_gather", name="edited_pallas_gather", pallas=True, dtypes=("float32",))
def edited_pallas_gather(x, *, mesh, axis_name, interpret=None):
    def per_device(block):
        gathered = lax.all_gather(block, axis_name, tiled=True)
        out = jax.ShapeDtypeStruct(gathered.shape, gathered.dtype)
        return pl.pallas_call(_copy, out_shape=out, interpret=interpret)(gathered)

    return jax.shard_map(per_device, mesh=mesh, in_specs=P(axis_name), out_specs=P(), check_vma=False)(x)
"""
#: The edit: the kernel's body, not its wrapper, now adds one to every element.
EDIT = ("o_ref[...] = x_ref[...]\n", "o_ref[...] = x_ref[...] + 1.0\n")


def _run(directory: Path, cache: Path) -> tuple[int, str]:
    argv = suite_command(
        "--kernels=edited_kernels",
        "--impl=edited_pallas_gather",
        "-k",
        "test_values and (5-x-explicit or 7-x-explicit)",
        f"--compilation-cache={cache}",
        marks="cpu and not tpu_compile",
    )
    env = {**subprocess_env(), "PYTHONPATH": str(directory)}
    done = subprocess.run(argv, cwd=directory, env=env, capture_output=True, text=True, timeout=600)
    return done.returncode, done.stdout + done.stderr


def test_an_unchanged_kernel_is_read_back_and_an_edited_one_judged_again(tmp_path: Path) -> None:
    module = tmp_path / "edited_kernels.py"
    module.write_text(KERNEL)
    cache = tmp_path / "cache"
    code, out = _run(tmp_path, cache)
    assert code == 0 and "2 passed" in out and interpret_outcomes.READ_BACK_NOTE not in out, out[-3000:]
    code, out = _run(tmp_path, cache)  # nothing changed: nothing is interpreted again
    assert code == 0 and "2 passed" in out, out[-3000:]
    assert f"2 checks of Pallas kernels {interpret_outcomes.READ_BACK_NOTE}" in out, out[-3000:]
    kept = set(cache.rglob("*.json"))
    module.write_text(KERNEL.replace(*EDIT))
    code, out = _run(tmp_path, cache)  # the kernel's body changed: judged again, and wrong
    assert code == 1 and "2 failed" in out, out[-3000:]
    assert "[values] all_gather/edited_pallas_gather: values differ" in out, out[-3000:]
    # new verdicts were kept: the edited program has keys of its own (hypothesis' replay of the
    # failing example at the end of each test may read back what its first call just kept)
    judged = set(cache.rglob("*.json")) - kept
    assert len(judged) >= 2, sorted(p.name for p in judged)
    code, out = _run(tmp_path, cache)  # a failure is read back as a failure, with its message
    assert code == 1 and "2 failed" in out and "first wrong index" in out, out[-3000:]
    assert f"2 checks of Pallas kernels {interpret_outcomes.READ_BACK_NOTE}" in out, out[-3000:]
    assert set(cache.rglob("*.json")) == kept | judged, "nothing was judged again"


def test_what_a_registration_declares_beside_its_code_is_in_the_key(monkeypatch: pytest.MonkeyPatch) -> None:
    """A kernel whose code is unchanged but whose declaration is (its lowering targets here) is judged
    again: the collectives and cross-lowering checks read the modules of its declared targets."""
    import dataclasses

    import conformance.kernels  # noqa: F401  (registers the built-ins)
    from conformance import registry, runner
    from conformance.fixtures.meshes import parse_mesh
    from conformance.session import Settings

    case = runner.Case.make(
        "all_reduce",
        "pallas_ring_all_reduce_bidirectional",
        parse_mesh("2-x-auto"),
        {"rows_per_shard": 1, "cols": 8},
        "float32",
        dma_mode="on_wait",
    )
    settings = Settings()
    before = interpret_outcomes.key_of("cross_lowering", case, settings)
    assert before is not None and before == interpret_outcomes.key_of("cross_lowering", case, settings)
    declared = registry.get(case.family, case.impl)
    other = dataclasses.replace(declared, lowering_targets=("tpu", "cuda"))
    monkeypatch.setattr(registry, "get", lambda family, name: other)
    assert interpret_outcomes.key_of("cross_lowering", case, settings) not in (None, before)
