"""The tox plugin's disk sharing (``toxfile.py``): an env's installed files that a sibling env holds
with the same bytes become hard links to that copy; a file that differs in bytes, mode or place, a
small one, and one already linked keep what they are, and an upgrade's unlink leaves the sibling's
copy whole."""

from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path

import pytest

import conformance

pytestmark = pytest.mark.selftest

TOXFILE = Path(conformance.__file__).resolve().parents[1] / "toxfile.py"


@pytest.fixture
def toxfile(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    if not TOXFILE.is_file():
        pytest.skip(f"{TOXFILE} is not here: the suite is installed without its repository")
    if importlib.util.find_spec("tox") is None:  # the env runs without tox itself: its hook marker
        plugin = types.ModuleType("tox.plugin")
        plugin.impl = lambda function: function  # type: ignore[attr-defined]
        monkeypatch.setitem(sys.modules, "tox", types.ModuleType("tox"))
        monkeypatch.setitem(sys.modules, "tox.plugin", plugin)
    spec = importlib.util.spec_from_file_location("conformance_toxfile", TOXFILE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _install(env: Path, files: dict[str, bytes]) -> Path:
    site = env / "lib" / "python3.11" / "site-packages"
    for name, data in files.items():
        (site / name).parent.mkdir(parents=True, exist_ok=True)
        (site / name).write_bytes(data)
    return site


def test_identical_files_become_one_copy_and_the_rest_keep_their_own(
    toxfile: types.ModuleType, tmp_path: Path
) -> None:
    big = toxfile.SHARED_MIN_BYTES
    same, other = b"a" * big, b"a" * (big - 1) + b"b"
    first = _install(
        tmp_path / "cpu",
        {"jaxlib/x.so": same, "jaxlib/y.so": same, "libtpu/z.so": same, "small.py": b"s"},
    )
    second = tmp_path / "cpu-wide"
    site = _install(
        second,
        {"jaxlib/x.so": same, "jaxlib/y.so": other, "moved/z.so": same, "small.py": b"s"},
    )
    (site / "jaxlib" / "x.so").chmod(0o644)
    (first / "jaxlib" / "x.so").chmod(0o644)

    linked, saved = toxfile.share_identical_files(second)

    assert (linked, saved) == (1, big)
    assert (site / "jaxlib" / "x.so").stat().st_ino == (first / "jaxlib" / "x.so").stat().st_ino
    for name in ("jaxlib/y.so", "moved/z.so", "small.py"):
        assert (site / name).stat().st_nlink == 1, name
    assert (site / "jaxlib" / "y.so").read_bytes() == other
    assert toxfile.share_identical_files(second) == (0, 0)  # a repeat run only walks the tree

    # pip's upgrade unlinks before it writes: the sibling keeps its bytes.
    (site / "jaxlib" / "x.so").unlink()
    (site / "jaxlib" / "x.so").write_bytes(other)
    assert (first / "jaxlib" / "x.so").read_bytes() == same


def test_a_file_whose_mode_differs_keeps_its_own_copy(toxfile: types.ModuleType, tmp_path: Path) -> None:
    data = b"m" * toxfile.SHARED_MIN_BYTES
    first = _install(tmp_path / "a", {"bin.so": data})
    site = _install(tmp_path / "b", {"bin.so": data})
    (first / "bin.so").chmod(0o755)
    (site / "bin.so").chmod(0o644)
    assert toxfile.share_identical_files(tmp_path / "b") == (0, 0)
