"""JAX's persistent compilation cache: a repeat run reads back the first run's compiles for the
host, never a compile for a TPU topology (the compile-only client cannot read those back: what the
checks read of those is kept beside it, :mod:`conformance.targets.target_compiles`, and read back too), and
``off`` leaves JAX's settings alone.

The sub-runs are separate pytest processes with the suite's plugin loaded as a user gets it, on
one small kernel (:mod:`conformance.selftest.test_plugin_options`).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conformance.selftest.test_plugin_options import KERNELS, _pytest
from conformance.targets import compilation_cache, target_compiles, tpu_compiler

pytestmark = [pytest.mark.selftest, pytest.mark.integration]

#: Checks that compile the kernel for the host, and (with libtpu) for a TPU topology; JAX's warnings
#: shown.
CHECKS = (
    "-k",
    "test_collectives or test_lowered_bytes or test_tpu_bytes",
    "--meshes=2-x-auto,2x4-y-auto",
    "-W",
    "default",
    "-s",
)
UNREADABLE = "Error reading persistent compilation cache entry"
#: The small kernel, claiming bfloat16 and TPU too: its 16-bit bytes are compiled for TPU where libtpu is.
WITH_BFLOAT16 = KERNELS.replace(
    'dtypes=("float32", "int32")', 'dtypes=("float32", "int32", "bfloat16")'
).replace('platforms=("cpu",)', 'platforms=("cpu", "tpu")')


@pytest.fixture(autouse=True)
def as_in_a_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    """The sub-runs see neither tox's env dir (pytest would put its cache there) nor the cache
    directory the tox envs share."""
    monkeypatch.delenv("TOX_ENV_DIR", raising=False)
    monkeypatch.delenv(compilation_cache.DIR_VARIABLE, raising=False)


def test_a_repeat_run_reads_the_host_compiles_back(tmp_path: Path) -> None:
    cache = tmp_path / "cache"

    def run() -> str:
        asked = f"--compilation-cache={cache}"
        done = _pytest(tmp_path, "-m", "cpu", "--impl=opt_gather", asked, *CHECKS, kernels=WITH_BFLOAT16)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        return done.stdout + done.stderr

    run()
    folder = cache / compilation_cache.folder_name()  # one folder per JAX version
    kept = Path(compilation_cache.target_compile_dir(str(folder)))  # the compiles for TPU topologies

    def files(where: Path) -> list[Path]:
        return sorted(e for e in where.iterdir() if e.is_file()) if where.is_dir() else []

    entries, compiled_for_tpu = files(folder), files(kept)
    assert entries, "the first run wrote nothing to the cache"
    if tpu_compiler.available():
        assert compiled_for_tpu, "the compiles for TPU topologies were not kept"
    repeat = run()
    assert UNREADABLE not in repeat, repeat[-3000:]  # no TPU executable was written to be read back
    if tpu_compiler.available():  # the TPU compiles' verdicts, read back in the repeat
        assert "tpu_bytes              ok" in repeat, repeat[-3000:]
    assert files(folder) == entries and files(kept) == compiled_for_tpu  # and wrote no new entry
    for entry in entries:  # the repeat read them: garbled, JAX says so (and compiles afresh)
        entry.write_bytes(b"not an executable")
    for entry in compiled_for_tpu:  # garbled: compiled again, and kept whole
        entry.write_text("{not json")
    assert UNREADABLE in run()
    for entry in compiled_for_tpu:
        assert json.loads(entry.read_text())["format"] == target_compiles.FORMAT, entry


@pytest.mark.parametrize("where", ["default", "off", "variable"])
def test_the_cache_goes_to_pytests_cache_or_the_variables_directory_or_nowhere(
    tmp_path: Path, where: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    asked = ["--compilation-cache=off"] if where == "off" else []
    shared = tmp_path / "shared"
    if where == "variable":
        monkeypatch.setenv(compilation_cache.DIR_VARIABLE, str(shared))
    done = _pytest(tmp_path, "-m", "cpu", "--impl=opt_gather", "-p", "cacheprovider", *asked, *CHECKS)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert (tmp_path / ".pytest_cache").is_dir()  # pytest's cache provider ran
    in_pytests = tmp_path / ".pytest_cache" / "d" / compilation_cache.folder_name()
    in_shared = shared / compilation_cache.folder_name()
    assert in_pytests.is_dir() == (where == "default") and in_shared.is_dir() == (where == "variable")
    for folder in (in_pytests, in_shared):
        assert not folder.is_dir() or any(folder.iterdir()), folder
