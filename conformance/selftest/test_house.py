"""The suite's own structure: results travel as values, settings as objects, and no module imports
itself back through another.

* Running checks leaves every module-level container of every conformance module as it was: the
  records come back in the :class:`~conformance.run.outcomes.CheckOutcome`, hangs are remembered on the
  :class:`~conformance.session.Session`, and a pytest session's results live in its run log.
* The import graph of the installed package (deferred imports inside functions included) has no
  circle.
"""

from __future__ import annotations

import ast
import configparser
import importlib
import os
import pkgutil
import re
import types
from collections import deque
from pathlib import Path

import pytest

import conformance
import conformance.plugin
from conformance import session as session_lib
from conformance.dtypes import LAYOUT_WIDTHS
from conformance.fixtures.meshes import parse_mesh
from conformance.run import run_check
from conformance.runner import Case
from conformance.selftest import subprocess_env, suite_command

pytestmark = pytest.mark.selftest

#: Module-level containers that may change while checks run, and why.
MAY_CHANGE = {
    # the registrations of kernels (a test module may register one), not results
    ("conformance.registry", "_REGISTRY"),
}


def _package_modules() -> list[types.ModuleType]:
    """Every module of the installed package but the self-tests and the test modules."""
    found = []
    for info in pkgutil.walk_packages(conformance.__path__, "conformance."):
        short = info.name.rsplit(".", 1)[-1]
        if ".selftest" in info.name or short.startswith("test_") or short == "__main__":
            continue
        found.append(importlib.import_module(info.name))
    return found


def _containers(modules: list[types.ModuleType]) -> dict[tuple[str, str], str]:
    """A fingerprint of every module-level list, dict, set and deque (its type, size and keys)."""
    out = {}
    for module in modules:
        for name, value in vars(module).items():
            if isinstance(value, (list, dict, set, deque)) and not name.startswith("__"):
                keys = sorted(map(repr, value)) if isinstance(value, (dict, set)) else len(value)
                out[(module.__name__, name)] = f"{type(value).__name__}:{len(value)}:{keys}"
    return out


def test_running_checks_leaves_no_module_level_state() -> None:
    """Checks with records (bytes, accuracy, TPU layout), a Pallas kernel checked in the worker
    process, and a failing kernel's check: every module-level container is as it was, and the
    records come back in the outcomes."""
    modules = _package_modules()
    before = _containers(modules)
    mesh = parse_mesh("2-x-auto")
    ring = Case.make("all_gather", "xla_all_gather", mesh, {"rows_per_shard": 3, "cols": 8}, "float32")
    matmul = Case.make(
        "allgather_matmul",
        "ring_allgather_matmul_unidirectional",
        mesh,
        {"rows_per_shard": 3, "K": 8, "cols_per_shard": 2},
        "bfloat16",
    )
    pallas = Case.make(
        "all_gather",
        "pallas_ring_all_gather_unidirectional",
        mesh,
        {"rows_per_shard": 8, "cols": 128},
        "float32",
        dma_mode="on_wait",
    )
    session = session_lib.Session()
    try:
        outcomes = [
            run_check("values", ring, session),
            run_check("collectives", ring, session),
            run_check("accuracy", matmul, session),
            run_check("tpu_layout", pallas, session),
            run_check("backward_collectives", pallas, session),  # in the worker process
        ]
    finally:
        session.close()
    assert [o.verdict for o in outcomes] == ["passed"] * 5, [(o.check, o.message) for o in outcomes]
    kinds = [[type(r).__name__ for r in o.records] for o in outcomes]
    assert kinds == [[], ["ByteRecord"], ["AccuracyRecord"], ["TpuLayoutRecord"], ["ByteRecord"]]
    after = _containers(modules)
    changed = {key for key in before.keys() | after.keys() if before.get(key) != after.get(key)}
    assert changed <= MAY_CHANGE, (
        f"module-level state changed by running checks: {sorted(changed - MAY_CHANGE)}"
    )


def test_two_sessions_in_one_process_see_nothing_of_each_other() -> None:
    """What a compile for a target gave and a job's exchange rounds live on the session: a second
    session compiles anew and counts its own rounds."""
    import jax

    from conformance.targets import target_compiles

    lowered = jax.jit(lambda x: x * 2 + 1).lower(1.0)
    first, second = session_lib.Session(), session_lib.Session()
    with first.active():
        target_compiles.compile_lowered(lowered, compiler="the host's", devices=[0])
        first.agreement.begin("test_a")
        assert first.agreement.next_round("verdict") == 1 and first.agreement.next_round("verdict") == 2
    assert len(first.target_compiles) == 1 and not second.target_compiles
    with second.active():
        assert second.agreement.next_round("verdict") == 1 and second.agreement.test == ""
        target_compiles.compile_lowered(lowered, compiler="the host's", devices=[0])
    (kept,) = second.target_compiles.values()
    assert not kept.from_store and kept is not next(iter(first.target_compiles.values()))


def test_no_module_carries_the_retired_run_state() -> None:
    """The names that once carried results or settings between modules are gone for good."""
    retired = {
        "LAST_CASE",
        "BYTE_RECORDS",
        "LOWERED_BYTE_RECORDS",
        "OVERLAP_RECORDS",
        "TPU_LAYOUT_RECORDS",
        "BACKWARD_BYTE_RECORDS",
        "ACCURACY_RECORDS",
        "BACKWARD_ACCURACY_RECORDS",
        "RECORDS",
        "VERDICTS",
        "ITEM_META",
        "STALE",
        "HUNG",
        "HANG_TIMEOUT_S",
        "CHECK_TIMEOUT_S",
        "MODE",
        "PROFILE",
        "on_unstoppable",
        "_MEMORY",
        "_rounds",
        "_test",
    }
    found = [f"{m.__name__}.{name}" for m in _package_modules() for name in vars(m) if name in retired]
    found += [f"conformance.plugin.{n}" for n in ("OUTCOMES", "VERDICTS") if hasattr(conformance.plugin, n)]
    assert not found, found


def _installed_sources() -> dict[str, str]:
    """Module name -> source file, for the package and its kernels and fixtures (as installed)."""
    out = {}
    for info in pkgutil.walk_packages(conformance.__path__, "conformance."):
        spec = importlib.util.find_spec(info.name)
        if spec is not None and spec.origin and spec.origin.endswith(".py"):
            out[info.name] = spec.origin
    out["conformance"] = conformance.__file__
    return out


def test_no_import_circle() -> None:
    """Every ``conformance`` import of every module, at its top or inside a function, points one way."""
    sources = _installed_sources()
    graph: dict[str, set[str]] = {}
    for name, path in sources.items():
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
        deps = set()
        for node in _runtime_nodes(tree):
            if isinstance(node, ast.Import):
                deps |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                deps |= {
                    f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in sources else node.module
                    for a in node.names
                }
        graph[name] = {d for d in deps if d in sources and d != name}
    circles = _circles(graph)
    assert not circles, "import circles: " + "; ".join(" -> ".join(c) for c in circles)


def _runtime_nodes(tree: ast.AST):
    """Every node but those under ``if TYPE_CHECKING:`` (imports for annotations never run)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            test = getattr(child, "test", None)
            if (
                isinstance(child, ast.If)
                and getattr(test, "id", getattr(test, "attr", None)) == "TYPE_CHECKING"
            ):
                stack.extend(child.orelse)
                continue
            stack.append(child)


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


#: The packages of the suite by role, from the top of the house down (docs/architecture.md): each
#: may import the ones after it and none before it.
PACKAGES_TOP_DOWN = (
    "tests",
    "plugin",
    "run",
    "reports",
    "transfers",
    "checks",
    "hlo",
    "targets",
    "jobs",
    "specs",
)


def _package_arrows(sources: dict[str, str]) -> set[tuple[str, str]]:
    """(importing package, imported package) for every runtime import between two of
    :data:`PACKAGES_TOP_DOWN`."""

    def package(module: str) -> str | None:
        parts = module.split(".")
        return parts[1] if len(parts) > 1 and parts[1] in PACKAGES_TOP_DOWN else None

    arrows = set()
    for name, path in sources.items():
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
        for node in _runtime_nodes(tree):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                targets = [f"{node.module}.{a.name}" for a in node.names] + [node.module]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                continue
            for target in targets:
                a, b = package(name), package(target)
                if a and b and a != b:
                    arrows.add((a, b))
    return arrows


def test_arrows_between_the_packages_run_one_way() -> None:
    """No package imports one above it: the run path, the reports, the checks, the compile targets and
    the jobs each see only what is below them."""
    order = {name: i for i, name in enumerate(PACKAGES_TOP_DOWN)}
    arrows = _package_arrows(_installed_sources())
    upward = sorted((a, b) for a, b in arrows if order[a] > order[b])
    assert not upward, f"imports that run up the house: {upward}"
    assert ("plugin", "run") in arrows and ("run", "checks") in arrows, arrows  # the finder sees imports


def _markdown_anchors(path: Path) -> set[str]:
    """The anchors of a Markdown file's headings, as GitHub makes them."""
    found = set()
    for line in path.read_text(encoding="utf-8").splitlines():
        heading = re.match(r"^#+\s+(.*)", line)
        if heading:
            found.add(re.sub(r"[^\w\- ]", "", heading[1].strip().lower()).replace(" ", "-"))
    return found


def broken_links(repository: Path) -> list[str]:
    """Each relative link of the README and of docs/ whose file, or heading, is not in the repository."""
    bad = []
    for page in [repository / "README.md", *sorted((repository / "docs").glob("*.md"))]:
        for link in re.findall(r"\]\(([^)\s]+)\)", page.read_text(encoding="utf-8")):
            if link.startswith(("http://", "https://", "mailto:")):
                continue
            path, _, anchor = link.partition("#")
            target = (page.parent / path).resolve() if path else page
            if not target.exists() or not target.is_relative_to(repository.resolve()):
                bad.append(f"{page.name}: {link} (no such file in the repository)")
            elif anchor and target.suffix == ".md" and anchor not in _markdown_anchors(target):
                bad.append(f"{page.name}: {link} (no such heading)")
    return bad


def test_the_readme_is_short_and_every_link_resolves(tmp_path: Path) -> None:
    """The README a user reads is at most 400 lines, and every link in it and in docs/ resolves inside
    the repository (a heading too); the link checker itself goes red on a link to nowhere."""
    repository = Path(conformance.__file__).resolve().parents[1]
    if not (repository / "README.md").exists():
        pytest.skip(f"the suite is installed without its repository ({repository})")
    lines = (repository / "README.md").read_text(encoding="utf-8").count("\n")
    assert lines <= 400, f"README.md is {lines} lines"
    assert broken_links(repository) == []
    (tmp_path / "docs").mkdir()
    (tmp_path / "README.md").write_text("# Title\n[ok](#title) [gone](docs/gone.md) [no](#nowhere)\n")
    assert broken_links(tmp_path) == [
        "README.md: docs/gone.md (no such file in the repository)",
        "README.md: #nowhere (no such heading)",
    ]


def test_the_circle_finder_finds_a_circle() -> None:
    """The detector itself goes red on a circle (else the test above asserts nothing)."""
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _circles({"a": {"b"}, "b": set()}) == []


def test_every_module_is_a_readable_size() -> None:
    """No module of the package is longer than a reader can hold (about 500 lines)."""
    long = {}
    for name, path in _installed_sources().items():
        with open(path, encoding="utf-8") as f:
            lines = sum(1 for _ in f)
        if lines > 560 and os.sep + "selftest" + os.sep not in path:
            long[name] = lines
    assert not long, long


NEW_CHECK = '''
"""A check added as one module: where every input is finite, so is every element of the result."""

import numpy as np

from conformance import runner
from conformance.checks.base import Axes, Check, fail, run_case


def check_finite(case):
    _, out = run_case(case, "finite")
    bad = np.argwhere(~np.isfinite(runner.global_value(out).astype(np.float64)))
    if len(bad):
        raise fail(case, "finite", "the result holds NaN or infinity for finite inputs",
                   [f"first at out{list(map(int, bad[0]))}"])


CHECKS = (Check("finite", check_finite, axes=Axes(meshes=("2-x-auto", "4-x-explicit"))),)
'''

NAN_KERNEL = """
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

import conformance
from conformance.kernels.all_gather.xla import xla_all_gather


@conformance.register("all_gather", name="gather_with_a_nan")
def gather_with_a_nan(x, *, mesh, axis_name):
    return xla_all_gather(x, mesh=mesh, axis_name=axis_name).at[0, 0].set(jnp.nan)
"""


def test_a_new_check_is_one_module(tmp_path) -> None:
    """A copy of the installed suite with one module added to ``conformance/checks``: the check is
    a pytest test on its meshes, passes on a correct kernel, fails on a broken one naming it, and
    its replay line re-runs it (nothing else in the suite was edited)."""
    import shutil
    import subprocess
    import sys

    from conformance import fixtures, kernels

    copy = tmp_path / "site" / "conformance"
    ignore = shutil.ignore_patterns("__pycache__", "selftest")
    shutil.copytree(os.path.dirname(conformance.__file__), copy, ignore=ignore)
    shutil.copytree(kernels.__path__[0], copy / "kernels", ignore=ignore, dirs_exist_ok=True)
    shutil.copytree(fixtures.__path__[0], copy / "fixtures", ignore=ignore, dirs_exist_ok=True)
    (copy / "checks" / "finite.py").write_text(NEW_CHECK)
    (tmp_path / "site" / "nan_kernels.py").write_text(NAN_KERNEL)
    env = subprocess_env()
    env["PYTHONPATH"] = str(tmp_path / "site")
    argv = suite_command(
        "-k", "test_finite", "--kernels=nan_kernels", "--impl=xla_all_gather,gather_with_a_nan", "-rA"
    )
    where = subprocess.run(
        [sys.executable, "-c", "import conformance; print(conformance.__file__)"],
        **{"cwd": tmp_path, "env": env, "capture_output": True, "text": True, "check": True},
    )
    assert str(copy) in where.stdout, "the subprocess did not import the copy"
    done = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    out = done.stdout + done.stderr
    assert done.returncode == 1, out[-3000:]
    for mesh in ("2-x-auto", "4-x-explicit"):
        for verdict, impl in (("PASSED", "xla_all_gather"), ("FAILED", "gather_with_a_nan")):
            test = f"test_all_gather.py::test_finite[{impl}-{mesh}-cpu]"
            assert re.search(rf"^{verdict} \S*{re.escape(test)}", out, re.M), (test, out[-3000:])
    assert "[finite] all_gather/gather_with_a_nan: the result holds NaN or infinity for finite inputs" in out
    replay = next(line.split("replay         : ", 1)[1] for line in out.splitlines() if "replay  " in line)
    again = subprocess.run(replay.split(), cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 1, again.stdout[-2000:] + again.stderr[-2000:]
    assert "FAILED finite" in again.stdout


def test_the_wheel_ships_every_package_of_the_tree() -> None:
    """``pyproject.toml`` lists the packages a wheel holds; a package directory it misses is silently
    absent from a non-editable install (its kernels never register), while an editable one, as tox's
    envs use, still finds it on disk."""
    import tomllib

    root = Path(conformance.__file__).resolve().parent.parent
    if not (root / "pyproject.toml").is_file():
        pytest.skip(f"the suite is installed, not a source tree ({root} has no pyproject.toml)")
    config = tomllib.loads((root / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["setuptools"]
    listed = set(config["packages"])
    dirs = {name: root / where for name, where in config.get("package-dir", {}).items()}
    dirs.setdefault("conformance", root / "conformance")
    in_tree = set()
    for name, where in dirs.items():
        for init in where.rglob("__init__.py"):
            relative = init.parent.relative_to(where)
            if "__pycache__" not in relative.parts:
                in_tree.add(".".join([name, *relative.parts]))
    missing = sorted(in_tree - listed)
    assert not missing, f"pyproject.toml's [tool.setuptools] packages leave out {missing}: no wheel has them"


def layout_clause_of(tox_ini: str) -> str | None:
    """The dtypes ``[vars] version_checks`` of a tox.ini's text runs the TPU layout and the TPU bytes at,
    or ``None`` where it has no such clause."""
    parser = configparser.ConfigParser(interpolation=None)
    parser.read_string(tox_ini)
    checks = parser.get("vars", "version_checks", fallback="")
    found = re.search(r"\(test_tpu_layout or test_tpu_bytes\) and not \(([^()]*)\)", checks)
    return found.group(1) if found else None


def test_the_jax_ends_run_the_layout_at_the_dtypes_the_sweep_names() -> None:
    """tox.ini's JAX ends (the TPU layout and bytes) and the sweep's scope ``versions`` (the layout) run at
    :data:`conformance.dtypes.LAYOUT_WIDTHS`: tox.ini cannot import the list, so it is written twice."""
    tox_ini = Path(conformance.__file__).parent.parent / "tox.ini"
    if not tox_ini.exists():
        pytest.skip("an installed suite has no tox.ini: the source tree's selftest env holds this")
    assert layout_clause_of(tox_ini.read_text()) == " or ".join(LAYOUT_WIDTHS), (
        f"tox.ini's [vars] version_checks runs the TPU layout at other dtypes than "
        f"conformance.dtypes.LAYOUT_WIDTHS {LAYOUT_WIDTHS}: change both together"
    )
    drifted = tox_ini.read_text().replace(" or ".join(LAYOUT_WIDTHS), "float32 or bfloat16 or int8")
    assert layout_clause_of(drifted) != " or ".join(LAYOUT_WIDTHS)  # a drifted list is caught
