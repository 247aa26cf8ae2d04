"""The plugin's downstream options, each seen to act: declarations, known-failures files
(strict xpass, stale lines), skips files, ``--impl`` on the fixed tests, ``--meshes``, ``--require-backend``,
the device-count rule, and replay of an implementation that is not registered.

Sub-runs are separate pytest processes started from a scratch directory with the suite's
plugin loaded as a user gets it (entry point), on one small implementation each.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from conformance import claims, family_tests, kernel_paths, registry
from conformance.checks.tpu_pod import POD_MESHES
from conformance.checks.tpu_schedule import SCHEDULE_MESHES
from conformance.checks.values import EAGER_FALLBACK_MESHES, EAGER_MESHES
from conformance.fixtures.meshes import INTERPRETED_MESHES, QUICK_MESHES, STANDARD_MESHES, parse_mesh
from conformance.plugin import command_options, kernel_modules, mark_expression
from conformance.selftest import job_command, subprocess_env, suite_command
from conformance.targets import gpu_compiler, tpu_compiler

pytestmark = [pytest.mark.selftest, pytest.mark.integration]

KERNELS = """
import jax
from jax.sharding import PartitionSpec as P

import conformance
from conformance import compat


@conformance.register("all_gather", name="opt_gather", platforms=("cpu",), dtypes=("float32", "int32"))
def opt_gather(x, *, mesh, axis_name):
    if x.shape[0] % mesh.shape[axis_name]:
        raise ValueError(f"{x.shape[0]} rows do not divide by the axis size {mesh.shape[axis_name]}")
    return jax.shard_map(lambda b: compat.all_gather_invariant(b, axis_name, axis=0, tiled=True),
                         mesh=mesh, in_specs=P(axis_name), out_specs=P())(x)
"""


#: How a sub-run is started: one process, pytest-xdist's workers, or a job of two processes.
WORKERS = {
    "one-process": (),
    "xdist": ("-n", "2"),
    "job": tuple(job_command()),
}


def _pytest(
    tmp_path: Path, *args: str, kernels: str = KERNELS, how: str = "one-process"
) -> subprocess.CompletedProcess:
    (tmp_path / "opt_kernels.py").write_text(textwrap.dedent(kernels))
    env = subprocess_env()
    env["PYTHONPATH"] = str(tmp_path)
    launcher = WORKERS[how] if how == "job" else ()
    return subprocess.run(
        [
            *launcher,
            *suite_command(
                "--kernels=opt_kernels", *args, *(WORKERS[how] if how == "xdist" else ()), marks=None
            ),
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )


@pytest.fixture(scope="module")
def shared_run(tmp_path_factory: pytest.TempPathFactory):
    """``_pytest`` for tests that only read a sub-run's output: cases that ask two things of one
    command line (two phrases of one error) share its run, in a scratch directory of its own."""
    runs: dict[tuple[tuple[str, ...], str], subprocess.CompletedProcess] = {}

    def run(*args: str, how: str = "one-process") -> subprocess.CompletedProcess:
        if (args, how) not in runs:
            runs[args, how] = _pytest(tmp_path_factory.mktemp("shared-run"), *args, how=how)
        return runs[args, how]

    return run


@pytest.fixture
def scratch_registry():
    """Registrations made by a test are undone after it."""
    saved = {family: dict(impls) for family, impls in registry._REGISTRY.items()}
    yield
    registry._REGISTRY.clear()
    registry._REGISTRY.update(saved)


def test_register_rejects_declarations_it_cannot_honour(scratch_registry) -> None:
    fn = lambda x, *, mesh, axis_name: x
    with pytest.raises(ValueError, match=r"dtypes \['float64'\] are not dtypes of 'all_gather'"):
        registry.register("all_gather", name="bad_decl", dtypes=("float64",))(fn)
    with pytest.raises(TypeError, match="non-empty tuple"):
        registry.register("all_gather", name="bad_decl", dtypes="float32")(fn)
    with pytest.raises(ValueError, match="platforms must be a tuple"):
        registry.register("all_gather", name="bad_decl", platforms=("cuda",))(fn)
    with pytest.raises(TypeError, match="supports must be callable"):
        registry.register("all_gather", name="bad_decl", supports=8)(fn)


def test_shapes_move_to_the_nearest_claimed_ones(scratch_registry) -> None:
    fn = lambda x, *, mesh, axis_name: x
    registry.register(
        "all_gather", name="claims_rows_of_8", supports=registry.multiples_of(rows_per_shard=8)
    )(fn)
    one_axis = lambda *, dims, dtype, axis_size, mesh_shape: None if len(mesh_shape) == 1 else "1-D only"
    registry.register("all_gather", name="claims_one_axis", supports=one_axis)(fn)
    mesh, mesh2 = parse_mesh("4-x-auto"), parse_mesh("2x4-y-auto")
    at = dict(platform="cpu", dtype="float32")
    assert claims.adapt(
        "all_gather", "claims_rows_of_8", mesh=mesh, dims={"rows_per_shard": 3, "cols": 128}, **at
    ) == {"rows_per_shard": 8, "cols": 128}
    assert claims.adapt(
        "all_gather", "claims_rows_of_8", mesh=mesh, dims={"rows_per_shard": 16, "cols": 1}, **at
    ) == {"rows_per_shard": 16, "cols": 1}
    assert claims.adapt(
        "all_gather", "xla_all_gather", mesh=mesh, dims={"rows_per_shard": 3, "cols": 1}, **at
    ) == {"rows_per_shard": 3, "cols": 1}
    # the even fixed shape (4 rows) avoids the dims the odd one (3 rows) moved to: both run
    odd = claims.adapt(
        "all_gather", "claims_rows_of_8", mesh=mesh, dims={"rows_per_shard": 3, "cols": 128}, **at
    )
    even = claims.adapt(
        "all_gather", "claims_rows_of_8", mesh=mesh, dims={"rows_per_shard": 4, "cols": 128}, avoid=odd, **at
    )
    assert even == {"rows_per_shard": 16, "cols": 128}, even
    with pytest.raises(claims.NotClaimed, match="1-D only"):
        claims.adapt("all_gather", "claims_one_axis", mesh=mesh2, dims={"rows_per_shard": 3, "cols": 1}, **at)
    why = claims.reason(
        "all_gather", "claims_rows_of_8", mesh=mesh, dims={"rows_per_shard": 3, "cols": 1}, **at
    )
    assert why == "rows_per_shard=3 is not a multiple of 8", why


def test_a_compile_tier_compiles_a_kernel_in_a_float_it_claims(scratch_registry) -> None:
    """Memory, pod scale and the schedule compile bfloat16 where the kernel claims it, else the first
    float it claims: a float32-only kernel is judged too; one that claims no float is not claimed,
    saying why at bfloat16."""
    fn = lambda x, *, mesh, axis_name: x
    registry.register("all_gather", name="claims_float32_only", dtypes=("float32",))(fn)
    registry.register("all_gather", name="claims_int32_only", dtypes=("int32",))(fn)
    pod, sizes = parse_mesh("64-x-explicit"), [{"rows_per_shard": 32, "cols": 128}]
    cases = family_tests.claimed_tpu_cases("all_gather", "claims_float32_only", pod, sizes)
    assert [c.dtype for c in cases] == ["float32"], cases
    cases = family_tests.claimed_tpu_cases("all_gather", "xla_all_gather", pod, sizes)
    assert [c.dtype for c in cases] == ["bfloat16"], cases
    with pytest.raises(claims.NotClaimed, match="bfloat16"):
        family_tests.claimed_tpu_cases("all_gather", "claims_int32_only", pod, sizes)


def test_known_failures_are_strict_and_stale_lines_are_reported(tmp_path: Path) -> None:
    (tmp_path / "xfails.txt").write_text(
        "# a comment line\n"
        "all_gather/opt_gather/determinism/5-x-explicit/cpu   # passes: a strict xfail fails the run\n"
        "all_gather/opt_gather/no_such_check/*\n"
    )
    (tmp_path / "skips.txt").write_text("all_gather/opt_gather/determinism/6-x-auto/*\n")
    files = (
        "--xfails-file=xfails.txt",
        "--skips-file=skips.txt",
        "--conformance-json=out.json",
        "--junitxml=junit.xml",
    )
    done = _pytest(
        tmp_path,
        "-m",
        "cpu",
        "--impl=opt_gather",
        "-k",
        "test_determinism or test_dtype or test_collectives",
        *files,
    )
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-2000:]
    assert "xfails.txt:3: all_gather/opt_gather/no_such_check/*  (xfail)" in done.stdout, done.stdout[-3000:]
    document = json.loads((tmp_path / "out.json").read_text())
    by = {o["id"]: o for o in document["outcomes"]}
    assert by["all_gather/opt_gather/determinism/5-x-explicit/cpu"]["outcome"] == "xpassed"
    assert by["all_gather/opt_gather/determinism/6-x-auto/cpu"]["outcome"] == "skipped"
    assert by["all_gather/opt_gather/dtype/5-x-explicit/cpu/int8"]["outcome"] == "not_claimed"
    assert by["all_gather/opt_gather/dtype/5-x-explicit/cpu/int32"]["outcome"] == "passed"
    assert document["known_failures"]["stale"] == [
        {"file": "xfails.txt", "line": 3, "pattern": "all_gather/opt_gather/no_such_check/*", "kind": "xfail"}
    ]
    assert document["counts"]["xpassed"] == 1 and document["counts"]["failed"] == 0, document["counts"]
    junit = (tmp_path / "junit.xml").read_text()  # ids, cases and replay lines reach JUnit; tables too
    assert 'name="conformance_id" value="all_gather/opt_gather/dtype/5-x-explicit/cpu/int32"' in junit
    assert 'name="replay" value="python -m conformance replay dtype all_gather opt_gather' in junit
    assert 'name="conformance: forward: bytes received per device' in junit


def test_impl_filters_the_suites_fixed_tests(tmp_path: Path) -> None:
    done = _pytest(tmp_path, "-m", "cpu", "--impl=opt_gather", "--collect-only")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    ids = [line for line in done.stdout.splitlines() if "::" in line]
    assert ids and all("opt_gather" in i for i in ids), [i for i in ids if "opt_gather" not in i][:5]


#: The TPU compile tier's checks on meshes of their own.
OWN_MESH_TIER_CHECKS = ("tpu_schedule", "tpu_memory", "tpu_pod", "tpu_bytes")


def test_meshes_runs_the_mesh_tests_on_the_meshes_named_and_keeps_every_other(tmp_path: Path) -> None:
    """``--meshes`` takes any mesh the run's devices hold (standard or not: a ring of 6, a 3-D mesh):
    every test over a set of standard meshes runs on exactly those, in all its variants; a check's own
    meshes (eager's, the compile tiers' rings) and the tests without a mesh stay."""
    done = _pytest(tmp_path, "-m", "cpu", "--impl=opt_gather,xla_device_put", "--collect-only")
    every = {line for line in done.stdout.splitlines() if "::" in line}
    wanted = ("6-x-auto", "2x2x2-z-explicit")
    done = _pytest(
        tmp_path,
        "-m",
        "cpu",
        "--impl=opt_gather,xla_device_put",
        f"--meshes={wanted[0]}, {wanted[1]}",
        "--collect-only",
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    kept = {line for line in done.stdout.splitlines() if "::" in line}
    labels = [*STANDARD_MESHES, *wanted, *EAGER_MESHES, *SCHEDULE_MESHES, *POD_MESHES]

    def on(test_id: str) -> set[str]:
        return {label for label in labels if f"-{label}-" in test_id or f"-{label}]" in test_id}

    def own(test_id: str) -> bool:  # a check with meshes of its own: eager's, the compile tiers'
        return any(f"::test_{name}[" in test_id for name in ("eager", *OWN_MESH_TIER_CHECKS))

    without = {t for t in every if not on(t)}
    assert without and without <= kept, "the tests that take no mesh (send_recv's) must stay"
    assert {t for t in every if own(t)} <= kept, "a check's own meshes stay"
    standard = {t for t in kept if on(t) and not own(t)}
    assert {m for t in standard for m in on(t)} == set(wanted), sorted(standard)[:5]
    for mesh in wanted:  # every dtype and both fixed shapes on each mesh named, as on a covering mesh
        assert any(f"test_dtype[opt_gather-{mesh}-int32" in t for t in kept), mesh
        assert any(f"test_output_sharding[opt_gather-{mesh}-even" in t for t in kept), mesh


def test_mesh_cover_parts_the_run_in_two_each_test_in_one(tmp_path: Path) -> None:
    """``--mesh-cover=quick`` and ``--mesh-cover=rest`` are the whole run between them, each test in
    exactly one: the quick part every test on a quick mesh, without a CPU mesh (send_recv's) or on a
    compile tier's rings; the rest every test on another standard mesh (eager's among them). A part
    that is not one of the two is a usage error."""
    base = ("-m", "cpu", "--impl=opt_gather,xla_device_put", "--collect-only")

    def collected(*extra: str) -> set[str]:
        done = _pytest(tmp_path, *base, *extra)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
        return {line for line in done.stdout.splitlines() if "::" in line}

    every, quick, rest = collected(), collected("--mesh-cover=quick"), collected("--mesh-cover=rest")
    assert quick and rest and not quick & rest and quick | rest == every

    def on(test_id: str) -> set[str]:  # the longest label that matches: 2x4-y-auto-v5e, not 2x4-y-auto
        found = [label for label in STANDARD_MESHES if f"-{label}-" in test_id or f"-{label}]" in test_id]
        return {max(found, key=len)} if found else set()

    assert {m for t in rest for m in on(t)} == set(STANDARD_MESHES) - set(QUICK_MESHES)
    assert {m for t in quick for m in on(t)} == set(QUICK_MESHES)
    assert any("test_send_recv.py::" in t and not on(t) for t in quick), "tests without a mesh: quick"
    assert all(on(t) for t in rest), "every test of the rest is on a standard mesh"
    assert any(f"::test_eager[opt_gather-{EAGER_MESHES[0]}" in t for t in rest)
    assert any(f"::test_tpu_pod[opt_gather-{POD_MESHES[0]}" in t for t in quick), "a tier's rings: quick"
    done = _pytest(tmp_path, *base, "--mesh-cover=wide")
    assert done.returncode == 4 and "invalid choice: 'wide'" in done.stderr, done.stderr[-2000:]


def test_a_run_leaves_the_working_directory_as_it_found_it(tmp_path: Path) -> None:
    """No ``.hypothesis`` (hypothesis' cache of local modules' constants) and no ``.benchmarks``
    (pytest-benchmark's storage, made at start) in the directory the suite ran in."""
    done = _pytest(tmp_path, "-m", "cpu", "--impl=opt_gather", "-k", "test_values and 5-x")
    assert done.returncode == 0 and "1 passed" in done.stdout, done.stdout[-3000:] + done.stderr[-2000:]
    left = sorted(p.name for p in tmp_path.iterdir() if p.name != "__pycache__")  # Python's, of the module
    assert left == ["opt_kernels.py"], left


ONE_AXIS_KERNEL = """

def _one_axis(*, dims, dtype, axis_size, mesh_shape):
    return None if len(mesh_shape) == 1 else "one mesh axis only"


@conformance.register("all_gather", name="opt_gather_one_axis", platforms=("cpu",), supports=_one_axis)
def opt_gather_one_axis(x, *, mesh, axis_name):
    return opt_gather(x, mesh=mesh, axis_name=axis_name)
"""


def test_eager_meets_a_kernel_of_one_mesh_axis_on_a_ring(tmp_path: Path) -> None:
    """Eager runs on a 2-D mesh; a kernel whose ``supports=`` refuses every 2-D mesh is called eagerly on
    the fallback ring instead, and passes there, where it was 'not claimed'."""
    args = ("-m", "cpu", "--impl=opt_gather*", "-k", "test_eager")
    kernels = KERNELS + ONE_AXIS_KERNEL
    listed = _pytest(tmp_path, *args, "--collect-only", kernels=kernels)
    assert listed.returncode == 0, listed.stdout[-3000:] + listed.stderr[-2000:]
    ids = {line.split("::", 1)[1] for line in listed.stdout.splitlines() if "::test_eager[" in line}
    assert ids == {
        f"test_eager[opt_gather-{EAGER_MESHES[0]}-cpu]",
        f"test_eager[opt_gather_one_axis-{EAGER_FALLBACK_MESHES[0]}-cpu]",
    }, listed.stdout[-3000:]
    done = _pytest(tmp_path, *args, kernels=kernels)
    assert done.returncode == 0 and "2 passed" in done.stdout, done.stdout[-3000:] + done.stderr[-2000:]


def test_a_pallas_kernel_draws_its_values_on_the_interpreted_meshes(tmp_path: Path) -> None:
    """The values check runs a ``shard_map`` kernel on every standard mesh and a Pallas TPU kernel (TPU
    interpret mode on CPU) on the interpreted ones; ``--meshes`` replaces both sets alike."""
    impls = "--impl=opt_gather,pallas_ring_all_gather_bidirectional"

    def meshes_by_impl(*extra: str) -> dict[str, set[str]]:
        done = _pytest(tmp_path, "-m", "cpu", impls, "-k", "test_values[", *extra, "--collect-only")
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
        found: dict[str, set[str]] = {}
        for line in done.stdout.splitlines():
            if "::test_values[" in line:
                impl, _, rest = line.split("[", 1)[1].partition("-")
                found.setdefault(impl, set()).add(rest.removesuffix("]").removesuffix("-cpu"))
        return found

    assert meshes_by_impl() == {
        "opt_gather": set(STANDARD_MESHES),
        "pallas_ring_all_gather_bidirectional": set(INTERPRETED_MESHES),
    }
    named = meshes_by_impl("--meshes=3-x-auto,2x2x2-y-auto")
    wanted = {"3-x-auto", "2x2x2-y-auto"}
    assert named == {"opt_gather": wanted, "pallas_ring_all_gather_bidirectional": wanted}


def test_meshes_of_rings_of_one_skip_the_checks_that_need_a_longer_ring_saying_so(tmp_path: Path) -> None:
    """``--meshes`` naming only rings of one leaves the overlap check (rings of 2 or more) no mesh:
    one skipped case that says so, not a crash of the collection on pytest's empty parameter set."""
    done = _pytest(
        tmp_path,
        "-m",
        "cpu and not tpu",
        "--impl=xla_allgather_matmul",
        "--meshes=1-x-auto",
        "-k",
        "test_overlap or test_output_sharding",
        "-rs",
        how="xdist",
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "INTERNALERROR" not in done.stdout + done.stderr
    assert "has a ring of 2 or more devices, which this check needs" in done.stdout, done.stdout[-3000:]
    assert "1 skipped" in done.stdout and " passed" in done.stdout, done.stdout[-1500:]


#: Each bad ``--meshes`` label and what the usage error says. Every one is run in one process; with
#: workers and in a job (where the error is raised in a worker or a rank, and the devices counted are the
#: job's) the labels marked ``True``: the device count, whose message turns on where the run is, and
#: one label that does not parse. The parsing is the same code wherever it runs.
BAD_MESHES = (
    (
        "16-x-auto",
        "16-x-auto needs 16 devices; ",
        True,
    ),  # "the suite's CPU run (8 ...) has 8", "this job of 2 x 4"
    ("6-q-auto", "mesh label '6-q-auto': axis 'q' is not one of ('x',)", False),
    ("4-x-atuo", "bad mesh label '4-x-atuo'", True),
    ("4-x-atuo", "did you mean 4-x-auto", True),
    ("3-x-auto-v5e", "no v5e device order is known for the mesh shape 3", False),
)


@pytest.mark.parametrize(
    "meshes, says, how",
    [
        (meshes, says, how)
        for how in sorted(WORKERS)
        for meshes, says, everywhere in BAD_MESHES
        if everywhere or how == "one-process"
    ],
)
def test_a_mesh_the_run_cannot_build_is_a_usage_error(shared_run, meshes: str, says: str, how: str) -> None:
    done = shared_run("-m", "cpu", "--impl=opt_gather", f"--meshes={meshes}", how=how)
    assert done.returncode == 4, done.stdout[-3000:] + done.stderr[-3000:]
    assert says in done.stdout + done.stderr, done.stderr[-2000:]  # a job shows rank 0's output on stdout
    assert "INTERNALERROR" not in done.stdout + done.stderr, (done.stdout + done.stderr)[-3000:]


@pytest.mark.parametrize(
    "option, says",
    [
        (
            "xla_tpu_no_such_flag=1",
            "--compiler-option xla_tpu_no_such_flag=1 is refused by every compiler here",
        ),
        ("xla_tpu_no_such_flag=1", "No such compile option: 'xla_tpu_no_such_flag'"),
        ("xla_tpu_no_such_flag", "--compiler-option 'xla_tpu_no_such_flag' is not NAME=VALUE"),
    ],
)
def test_a_compiler_option_no_compiler_takes_is_a_usage_error(shared_run, option: str, says: str) -> None:
    if not tpu_compiler.available():
        pytest.skip(f"no TPU compiler here to refuse it: {tpu_compiler.unavailable_reason()}")
    done = shared_run("-m", "cpu", "--impl=opt_gather", f"--compiler-option={option}", "-n", "2")
    assert done.returncode == 4, done.stdout[-3000:] + done.stderr[-3000:]
    assert says in done.stderr, done.stderr[-2000:]
    assert "INTERNALERROR" not in done.stdout + done.stderr, (done.stdout + done.stderr)[-3000:]


BAD_KERNEL_MODULES = {
    "a syntax error": ("def broken(:\n    pass\n", "raised SyntaxError (", "opt_kernels.py:1)"),
    "a misspelt family": (
        "import conformance\n\n@conformance.register('allgather_matmull', name='x')\n"
        "def x(lhs, rhs, *, mesh, axis_name):\n    return lhs\n",
        "unknown kernel family 'allgather_matmull' (did you mean 'allgather_matmul'?)",
        "opt_kernels.py:3)",
    ),
    "a module it imports that is not there": (
        "import no_such_module_here\n",
        "raised ModuleNotFoundError",
        "No module named 'no_such_module_here'",
    ),
}


@pytest.mark.parametrize(
    "bad, how",
    # each bad module in one process; with workers and in a job (where the import runs again in each
    # worker or rank, and the launcher adds its lines) the syntax error: the same import path raises
    # each of them
    [(bad, "one-process") for bad in sorted(BAD_KERNEL_MODULES)]
    + [("a syntax error", how) for how in sorted(WORKERS) if how != "one-process"],
)
def test_a_kernels_module_that_does_not_import_is_one_usage_error(tmp_path: Path, bad: str, how: str) -> None:
    source, *says = BAD_KERNEL_MODULES[bad]
    done = _pytest(tmp_path, "-m", "cpu", kernels=source, how=how)
    output = done.stdout + done.stderr
    assert done.returncode == 4, output[-3000:]
    for phrase in says:
        assert phrase in output, output[-2000:]
    assert "INTERNALERROR" not in output, output[-3000:]
    # the error line, and in a job the launcher's lines around it (which rank ended, and its log)
    assert len(output.strip().splitlines()) <= (3 if how != "job" else 9), output
    assert sum(says[0] in line for line in output.splitlines()) <= 2, output


@pytest.mark.parametrize("how", ["one-process", "xdist"])
def test_report_paths_are_made_before_the_run_or_refused(tmp_path: Path, how: str) -> None:
    """A report's directory is created at the start; a path that cannot be written is a usage error
    then, never a traceback after the run."""
    args = ("-m", "cpu", "--impl=opt_gather", "-k", "test_determinism and 1-x-explicit")
    made = ("--conformance-json=results/deep/c.json", "--conformance-html=results/c.html")
    done = _pytest(tmp_path, *args, *made, how=how)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert json.loads((tmp_path / "results/deep/c.json").read_text())["counts"]["passed"] >= 1
    assert (tmp_path / "results/c.html").read_text().startswith("<!DOCTYPE html>")
    assert "conformance: wrote results/deep/c.json" in done.stdout, done.stdout[-2000:]
    (tmp_path / "a_file").write_text("")
    for option, says in (
        ("--conformance-html=results", "--conformance-html=results: that is a directory"),
        ("--conformance-json=a_file/c.json", "--conformance-json=a_file/c.json: cannot create its directory"),
    ):
        done = _pytest(tmp_path, *args, option, how=how)
        assert done.returncode == 4, done.stdout[-3000:] + done.stderr[-3000:]
        assert says in done.stderr and "Traceback" not in done.stdout + done.stderr, done.stderr[-2000:]
        assert "passed" not in done.stdout, done.stdout[-2000:]


def test_a_kernels_module_in_the_current_directory_imports_without_it_on_the_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The ``pytest`` command, unlike ``python -m pytest``, puts no current directory on sys.path."""
    (tmp_path / "here_kernels_4f2.py").write_text("LOADED = True\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".", str(tmp_path))])
    kernel_modules.import_modules(["here_kernels_4f2"])
    assert sys.modules["here_kernels_4f2"].LOADED
    monkeypatch.delitem(sys.modules, "here_kernels_4f2")


def test_a_kernels_folder_without_init_is_a_usage_error_naming_its_module(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--kernels=my_kernels`` run from the folder above the example's: Python imports the folder as an
    empty namespace package, which registers nothing; the error names the module inside and its path."""
    (tmp_path / "folder_kernels_9c1").mkdir()
    (tmp_path / "folder_kernels_9c1" / "folder_kernels_9c1.py").write_text("LOADED = True\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(kernel_modules.KernelsModuleError) as refused:
        kernel_modules.import_modules(["folder_kernels_9c1"])
    monkeypatch.delitem(sys.modules, "folder_kernels_9c1")
    said = str(refused.value)
    assert "has no __init__.py" in said and "registers no kernel" in said, said
    assert "--kernels=folder_kernels_9c1/folder_kernels_9c1.py" in said, said


def test_a_kernels_module_not_on_the_path_says_how_python_finds_it(tmp_path: Path) -> None:
    done = _pytest(tmp_path, "-m", "cpu", "--kernels=not_here_kernels")
    assert done.returncode == 4, done.stdout[-3000:] + done.stderr[-3000:]
    assert "cannot import 'not_here_kernels'" in done.stderr and "PYTHONPATH" in done.stderr, done.stderr


def test_a_platform_without_backend_says_so_and_can_be_required(tmp_path: Path) -> None:
    done = _pytest(tmp_path, "-m", "tpu", "--impl=opt_gather", "-k", "test_determinism")
    assert done.returncode == 0, done.stdout[-3000:]
    assert "no tpu backend on this host" in done.stdout and "--require-backend=tpu" in done.stdout, (
        done.stdout
    )
    done = _pytest(
        tmp_path, "-m", "tpu", "--impl=opt_gather", "-k", "test_determinism", "--require-backend=tpu"
    )
    assert done.returncode == 4, done.stdout[-3000:] + done.stderr[-3000:]
    assert "--require-backend=tpu: this host has no tpu backend" in done.stderr, done.stderr[-3000:]


def test_a_backend_started_during_collection_is_named_with_the_rule(tmp_path: Path) -> None:
    early = KERNELS + "\nimport jax.numpy as jnp\nSTARTED_AT_IMPORT = jnp.zeros(1)\n"
    done = _pytest(tmp_path, "-m", "cpu", "--impl=opt_gather", "-k", "test_determinism", kernels=early)
    assert done.returncode == 4, done.stdout[-3000:] + done.stderr[-3000:]
    assert "had already started with 1 device" in done.stderr and "The rule" in done.stderr, done.stderr[
        -3000:
    ]


def _command(tmp_path: Path, *args: str, kernels: str = KERNELS) -> subprocess.CompletedProcess:
    """``python -m conformance ARGS`` from ``tmp_path``, which holds ``opt_kernels.py``, in the
    environment a user's shell has: without what this process's plugin set for the compilers it
    starts (:data:`tpu_compiler.CHIPLESS_START`, :data:`gpu_compiler.DEVICELESS_START`)."""
    (tmp_path / "opt_kernels.py").write_text(textwrap.dedent(kernels))
    set_here = {*tpu_compiler.CHIPLESS_START, *gpu_compiler.DEVICELESS_START} - {"ALLOW_MULTIPLE_LIBTPU_LOAD"}
    return subprocess.run(
        [sys.executable, "-m", "conformance", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={k: v for k, v in subprocess_env().items() if k not in set_here},
        cwd=tmp_path,
    )


def test_kernels_given_as_a_path_to_their_file_run_and_replay_by_it(tmp_path: Path) -> None:
    """``--kernels=DIR/FILE.py``: that file is imported as the module its name makes, and a replay line
    of one of its kernels names the file again (:mod:`conformance.kernel_paths`)."""
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "my_gathers.py").write_text(textwrap.dedent(KERNELS))
    token = "2-x-auto:rows_per_shard=3,cols=128:float32:seed=0"
    done = _command(
        tmp_path, "replay", "values", "all_gather", "opt_gather", token, "--kernels=mine/my_gathers.py"
    )
    assert done.returncode == 0 and "PASSED values" in done.stdout, done.stdout[-3000:] + done.stderr[-3000:]
    (tmp_path / "plain.py").write_text("VALUE = 1\n")
    name = kernel_paths.import_path(str(tmp_path / "plain.py"))
    try:
        assert name == "plain" and kernel_paths.kernels_argument(name) == str(tmp_path / "plain.py")
        assert kernel_paths.import_path(str(tmp_path / "plain.py")) == name  # the same file: imported once
        assert (
            kernel_paths.kernels_argument("conformance.selftest.broken_kernels")
            == "conformance.selftest.broken_kernels"
        )
    finally:
        sys.modules.pop(name, None)


def test_replay_of_an_unregistered_implementation_is_not_a_kernel_failure(tmp_path: Path) -> None:
    token = "2-x-auto:rows_per_shard=3,cols=128:float32:seed=0"
    done = _command(tmp_path, "replay", "values", "all_gather", "no_such_kernel", token)
    assert done.returncode == 4, done.stdout + done.stderr
    assert "cannot replay: no implementation 'no_such_kernel' of 'all_gather' is registered" in done.stderr
    assert "--kernels" in done.stderr and "FAILED" not in done.stdout


def test_a_replay_prints_the_check_and_none_of_the_compilers_start_up_logs(tmp_path: Path) -> None:
    """The replay starts libtpu and JAX's CUDA plugin as the pytest plugin does: no TPU-VM start-up
    errors (libtpu's "unexpected worker hostname" trace), no "Could not find cuda drivers" lines."""
    done = _command(
        tmp_path, "replay", "determinism", "all_gather", "opt_gather", GATHER_TOKEN, "--kernels=opt_kernels"
    )
    assert done.returncode == 0 and "PASSED determinism" in done.stdout, done.stdout + done.stderr
    for noise in ("E0000", "unexpected worker hostname", "Source Location Trace", "cuda drivers"):
        assert noise not in done.stdout + done.stderr, done.stderr


@pytest.mark.parametrize(
    ("markexpr", "tiers"),
    [
        ("gpu_compile", ["gpu_compile"]),
        ("cpu or tpu_compile", ["tpu_compile"]),
        ("cpu and not tpu_compile", []),
        ("not gpu_compile and tpu_compile", ["tpu_compile"]),
        ("cpu", []),
        (None, []),
    ],
)
def test_the_compile_tiers_a_mark_expression_asks_for(markexpr: str | None, tiers: list[str]) -> None:
    assert command_options.tiers_asked_for(markexpr) == tiers


@pytest.mark.parametrize(
    ("markexpr", "own_marks", "built"),
    [
        ("cpu", (), ["cpu"]),
        ("cpu and not tpu_compile", (), ["cpu"]),
        ("not cpu", (), ["gpu", "tpu"]),
        ("gpu and not cpu", (), ["gpu"]),
        ("cpu and gpu", (), []),
        ("gpu_compile", ("gpu_compile",), ["cpu", "gpu", "tpu"]),
        ("tpu", ("tpu",), ["cpu", "gpu", "tpu"]),  # a test marked tpu itself: every value carries it
        # a mark another parameter may add (a mesh's skip, a user's own): tried both ways, never assumed
        ("cpu or slow", (), ["cpu", "gpu", "tpu"]),
        ("gpu_compile", (), ["cpu", "gpu", "tpu"]),
        ("cpu and not skip", (), ["cpu"]),
        ("not (gpu or slow)", (), ["cpu", "tpu"]),
        ("", (), ["cpu", "gpu", "tpu"]),
        (None, (), ["cpu", "gpu", "tpu"]),
        ("cpu and (", (), ["cpu", "gpu", "tpu"]),  # pytest refuses it itself; nothing is left out here
    ],
)
def test_a_platform_value_is_built_where_the_mark_expression_can_select_it(
    markexpr: str | None, own_marks: tuple[str, ...], built: list[str]
) -> None:
    """-m decides which platform values the family tests build (the others would be deselected): a value
    is left out only where the expression is false whatever marks the test's other parameters add."""
    selectable = mark_expression.selectable_platforms(markexpr, own_marks, ("cpu", "gpu", "tpu"))
    assert [p for p in ("cpu", "gpu", "tpu") if selectable(p)] == built


def test_a_compile_tier_asked_for_by_marker_runs_or_is_a_usage_error(tmp_path: Path) -> None:
    """``-m gpu_compile`` where XLA:GPU cannot compile here is a usage error naming why and the install,
    as ``--require-backend`` is; where it can, the tier runs. Never a run that skips every test."""
    done = _pytest(tmp_path, "-m", "gpu_compile", "-k", "test_gpu_memory and xla_jit_allgather_matmul")
    reason = gpu_compiler.unavailable_reason()
    if reason is None:
        assert done.returncode == 0 and " passed" in done.stdout, done.stdout[-3000:] + done.stderr[-3000:]
        return
    assert done.returncode == 4, done.stdout[-3000:] + done.stderr[-3000:]
    assert "asks for the gpu_compile tier, which cannot run on this host" in done.stderr, done.stderr
    assert 'pip install "jax[cuda12-local]==' in done.stderr, done.stderr


GATHER_TOKEN = "2-x-auto:rows_per_shard=3,cols=128:float32:seed=0"
#: Bad input to ``python -m conformance``, and what its one usage error says.
BAD_COMMANDS = {
    "a kernels module not found": (("list", "--kernels=does_not_exist"), "cannot import 'does_not_exist'"),
    **{
        f"a kernels module with {bad}": (("list", "--kernels=opt_kernels"), BAD_KERNEL_MODULES[bad][1])
        for bad in BAD_KERNEL_MODULES
    },
    "a kernels file that is not there": (
        ("list", "--kernels=./my_rings.py"),
        "--kernels: './my_rings.py' is not a file",
    ),
    "a case token that does not parse": (
        ("replay", "values", "all_gather", "opt_gather", "garbage", "--kernels=opt_kernels"),
        "cannot replay: bad case token 'garbage'; expected MESH:DIM=V,...:DTYPE:seed=S",
    ),
    "a dtype the family does not have": (
        ("replay", "values", "all_gather", "xla_all_gather", GATHER_TOKEN.replace("float32", "float33")),
        "dtype 'float33' (did you mean 'float32'?) is not one of all_gather's",
    ),
    "a dim the family does not have": (
        ("replay", "values", "all_gather", "xla_all_gather", GATHER_TOKEN.replace("cols", "columns")),
        "all_gather's dims are rows_per_shard, cols",
    ),
    "a ragged all-to-all routing out of range": (
        (
            "replay",
            "values",
            "ragged_all_to_all",
            "dense_ragged_all_to_all",
            "4-x-explicit:rows_per_shard=7,out_rows_per_shard=9,cols=8,routing=9:float32:seed=0",
        ),
        "routing=9 is not one of 0..4",
    ),
    "a misspelt mesh": (
        ("replay", "values", "all_gather", "xla_all_gather", GATHER_TOKEN.replace("auto", "atuo")),
        "cannot replay: bad case token '2-x-atuo:rows_per_shard=3,cols=128:float32:seed=0': bad mesh label "
        "'2-x-atuo'",
    ),
    "a mesh the host cannot hold": (
        ("replay", "values", "all_gather", "xla_all_gather", GATHER_TOKEN.replace("2-x-auto", "9-x-auto")),
        "cannot replay: 9-x-auto needs 9 devices; this host has 8 cpu devices",
    ),
    "a misspelt check": (
        ("replay", "valuez", "all_gather", "opt_gather", GATHER_TOKEN),
        "unknown check 'valuez' (did you mean 'values'?)",
    ),
    "a misspelt family": (
        ("replay", "values", "allgather", "opt_gather", GATHER_TOKEN),
        "unknown family 'allgather' (did you mean 'all_gather'?)",
    ),
    "a missing argument": (("replay", "values"), "the following arguments are required"),
    "a launch of no process": (("launch", "--processes", "0", "--", "true"), "must be at least 1"),
}


@pytest.mark.parametrize("bad", sorted(BAD_COMMANDS))
def test_bad_input_to_the_command_line_is_one_usage_error(tmp_path: Path, bad: str) -> None:
    """The command line answers bad input as pytest does: one ``ERROR:`` line, exit status 4."""
    args, says = BAD_COMMANDS[bad]
    source = next((BAD_KERNEL_MODULES[b][0] for b in BAD_KERNEL_MODULES if bad.endswith(b)), KERNELS)
    done = _command(tmp_path, *args, kernels=source)
    assert done.returncode == 4, done.stdout + done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("ERROR: ")]
    assert len(errors) == 1 and says in errors[0], done.stderr
    assert "FAILED" not in done.stdout, done.stdout


ABSLTEST = """
from conformance import absltest as conformance_absltest
import conformance.selftest.broken_kernels  # registers broken_ring_wrong_slot


class RingTest(conformance_absltest.conformance_test_case(
        "allgather_matmul", impls=("ring_allgather_matmul_unidirectional", "broken_ring_wrong_slot"),
        checks=("values", "collectives"), meshes=("4-x-auto",))):
    pass


if __name__ == "__main__":
    conformance_absltest.main()
"""


def test_absltest_entry_passes_a_correct_kernel_and_fails_a_broken_one(tmp_path: Path) -> None:
    (tmp_path / "ring_test.py").write_text(ABSLTEST)
    env = subprocess_env()
    done = subprocess.run(
        [sys.executable, "ring_test.py"], cwd=tmp_path, capture_output=True, text=True, timeout=600, env=env
    )
    assert done.returncode == 1, done.stdout + done.stderr[-4000:]
    assert "Ran 8 tests" in done.stderr and "FAILED (failures=2)" in done.stderr, done.stderr[-4000:]
    failed = [line for line in done.stderr.splitlines() if line.startswith("FAIL: ")]
    assert len(failed) == 2 and all(
        "broken_ring_wrong_slot" in line and "test_values" in line for line in failed
    )
    assert "first wrong shard" in done.stderr and "python -m conformance replay values" in done.stderr
