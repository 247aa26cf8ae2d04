"""The suite rejects each broken kernel by the check meant for it, and passes the built-ins.

One subprocess runs the real conformance suite (``-m cpu``) on the built-ins
plus ``broken_kernels``, exactly as a user would with ``--kernels``, and writes
JUnit XML; the tests below read the verdicts. Running in a subprocess keeps the
registry of this process clean and tests the command-line path itself.
"""

from __future__ import annotations

import functools
import inspect
import json
import os
import re
import shlex
import subprocess
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

import pytest

from conformance import compat
from conformance.checks import CHECKS
from conformance.checks.values import EAGER_MESHES
from conformance.claims import NOT_CLAIMED
from conformance.dtypes import LAYOUT_WIDTHS
from conformance.fixtures.meshes import MESH_SETS, MeshConfig, parse_mesh
from conformance.jobs.distributed import PALLAS_INTERPRET
from conformance.reports import provenance
from conformance.selftest import (
    broken_batch_kernels,
    broken_direction_kernels,
    broken_dtype_kernels,
    broken_kernels,
    broken_matmul_reduce_scatter_kernels,
    broken_mesh_kernels,
    broken_moe_kernels,
    broken_moe_layer_kernels,
    broken_overlap_kernels,
    broken_pallas_kernels,
    broken_ragged_kernels,
    broken_reduction_kernels,
    other_style_kernels,
    suite_command,
)
from conformance.selftest.other_style_kernels import HOST_LIMIT

pytestmark = pytest.mark.selftest

ROOT = Path(__file__).resolve().parents[2]
BROKEN = (
    broken_kernels,
    broken_pallas_kernels,
    broken_matmul_reduce_scatter_kernels,
    broken_overlap_kernels,
    broken_mesh_kernels,
    broken_dtype_kernels,
    broken_batch_kernels,
    broken_reduction_kernels,
    broken_direction_kernels,
    broken_ragged_kernels,
    broken_moe_kernels,
    broken_moe_layer_kernels,
)
KERNEL_MODULES = ",".join(module.__name__ for module in (*BROKEN, other_style_kernels))
EXPECTED_REJECTION = {k: v for module in BROKEN for k, v in module.EXPECTED_REJECTION.items()}
EXPECTED_MESSAGE = {k: v for module in BROKEN for k, v in getattr(module, "EXPECTED_MESSAGE", {}).items()}
#: The verdicts of the watchdog (:mod:`conformance.watchdog`, :mod:`conformance.run.check_worker`): a
#: kernel that hangs in TPU interpret mode.
WATCHDOG_VERDICTS = ("did not finish within", "beyond the watchdog's reach")
#: The broken kernels whose defect is a hang: the check meant for each waits out the watchdog.
HANGING = frozenset(k for k, text in EXPECTED_MESSAGE.items() if text.startswith(WATCHDOG_VERDICTS))
#: A broken kernel whose check the sweep runs on one case only (a ``-k`` word of its test ids)
EXPECTED_ON = {k: v for module in BROKEN for k, v in getattr(module, "EXPECTED_ON", {}).items()}
#: Correct kernels of other styles: the checks each must pass.
EXPECTED_PASS = {
    **other_style_kernels.EXPECTED_PASS,
    **broken_moe_kernels.EXPECTED_PASS,
    **broken_reduction_kernels.EXPECTED_PASS,
    **broken_moe_layer_kernels.EXPECTED_PASS,
}
#: A skip for what this host cannot try (never a failure): a kernel it cannot lower for TPU, or no
#: libtpu to judge the TPU layout (the CI envs install it).
HOST_LIMITS = (HOST_LIMIT, "judged by the real TPU compiler", compat.NO_FORCED_INTERPRET)
STANDARD_TESTS = {
    "test_values",
    "test_output_sharding",
    "test_dtype",
    "test_determinism",
    "test_collectives",
    "test_cross_lowering",
    "test_bad_inputs",
    "test_lowered_bytes",
    "test_eager",
}
PALLAS = {"test_races", "test_barrier_protocol", "test_tpu_layout", "test_tpu_native_values"}
AUTODIFF = {"test_gradients", "test_backward_collectives"}
ACCURACY = {"test_accuracy", "test_backward_accuracy"}
OVERLAP = {"test_overlap"}
BALANCE = {"test_direction_balance"}
DMA_BALANCE = {"test_dma_direction_balance"}
REDUCTIONS = {"test_other_reductions"}
#: built-in -> the tests it must have run (and passed)
BUILTINS = {
    "xla_allgather_matmul": STANDARD_TESTS | OVERLAP | AUTODIFF,
    "ring_allgather_matmul_unidirectional": STANDARD_TESTS | OVERLAP | AUTODIFF | ACCURACY,
    "ring_allgather_matmul_bidirectional": STANDARD_TESTS | OVERLAP | AUTODIFF | ACCURACY | BALANCE,
    "xla_all_gather": STANDARD_TESTS | AUTODIFF,
    "pallas_ring_all_gather_unidirectional": STANDARD_TESTS | PALLAS | AUTODIFF,
    "pallas_ring_all_gather_bidirectional": STANDARD_TESTS | PALLAS | AUTODIFF | DMA_BALANCE,
    "xla_matmul_reduce_scatter": STANDARD_TESTS | OVERLAP | AUTODIFF,
    "ring_matmul_reduce_scatter_unidirectional": STANDARD_TESTS | OVERLAP | AUTODIFF | ACCURACY,
    "ring_matmul_reduce_scatter_bidirectional": STANDARD_TESTS | OVERLAP | AUTODIFF | ACCURACY | BALANCE,
    **{
        name: STANDARD_TESTS
        | AUTODIFF
        | REDUCTIONS
        | (set() if name.startswith("xla_") else ACCURACY)
        | (BALANCE if name.endswith("_bidirectional") else set())
        for family in ("reduce_scatter", "all_reduce")
        for name in (f"xla_{family}", f"ring_{family}_unidirectional", f"ring_{family}_bidirectional")
    },
    **{
        f"pallas_ring_{family}_bidirectional": STANDARD_TESTS
        | PALLAS
        | AUTODIFF
        | ACCURACY
        | REDUCTIONS
        | DMA_BALANCE
        for family in ("reduce_scatter", "all_reduce")
    },
    "pallas_hbm_ring_reduce_scatter_bidirectional": STANDARD_TESTS
    | PALLAS
    | AUTODIFF
    | ACCURACY
    | REDUCTIONS
    | DMA_BALANCE,
    "xla_reduce_scatter_columns": STANDARD_TESTS | AUTODIFF,
    "ring_reduce_scatter_columns_bidirectional": STANDARD_TESTS | AUTODIFF | ACCURACY | REDUCTIONS | BALANCE,
}
#: Every kernel of the sweep runs on a ring of one, an odd ring, the longest ring, a 2-D mesh in a TPU
#: slice's order, a 3-D mesh and a reversed ring of 8, plus the mesh-less tests: each broken kernel meets
#: the mesh meant to catch it among these (a rounding per hop needs the ring of 8); on every other mesh of
#: the 26 it would repeat the verdict of one of these at about 2 s a test (430 s of the sweep's 1290).
SUBSET_MESHES = (
    "1-x-explicit",
    "5-x-explicit",
    "8-x-auto",
    "2x4-y-auto-v5e",
    "2x2x2-x-explicit",
    "8-x-explicit-reversed",
)
#: The built-ins pass every check of the suite on every mesh in `tox -e cpu,cpu-wide` (and `tpu-compile`);
#: here the sweep asks that each runs every check it must and passes it beside the broken kernels, on the
#: subset without the longest ring (250 s of the built-ins' 500 s, the Pallas rings interpreted on 8 devices),
#: where only the checks that run on it alone meet them.
LONGEST_RING = MESH_SETS["longest_ring"][0]
BUILTIN_MESHES = tuple(m for m in SUBSET_MESHES if m != LONGEST_RING)
ON_THE_LONGEST_RING_ONLY = sorted(
    f"test_{name}" for name, check in CHECKS.items() if check.axes and check.axes.meshes == "longest_ring"
)
#: (the eager check runs on meshes of its own, family_tests.EAGER_MESHES: all of them)
MESH_LESS = "test_tpu_layout or test_eager or seed or tpu_refusals"
BUILTIN_SUBSET = (
    " or ".join(f"-{m}" for m in BUILTIN_MESHES)
    + f" or (-{LONGEST_RING} and ({' or '.join(ON_THE_LONGEST_RING_ONLY)}))"
    + f" or {MESH_LESS}"
)
KERNEL_SUBSET = " or ".join(f"-{m}" for m in SUBSET_MESHES) + f" or {MESH_LESS} or test_tpu_pod"
#: ``CONFORMANCE_SELFTEST_SCOPE=versions`` (the cpu-oldest and cpu-newest envs): is each broken kernel
#: still rejected, and each correct one of another style still passed, on this JAX? The built-ins are
#: left out (the env's cpu run just ran them on every mesh); the selftest env (``full``, the default)
#: runs them too.
SCOPE = os.environ.get("CONFORMANCE_SELFTEST_SCOPE", "full")
if SCOPE not in ("full", "versions"):
    raise ValueError(f"CONFORMANCE_SELFTEST_SCOPE={SCOPE!r}: expected 'full' or 'versions'")
#: In scope ``versions``, the cases of a correct kernel of another style: each check it must pass on the
#: 2-D mesh in a v5e slice's order (the JAX ends' own mesh for what a dtype turns on), the checks that
#: run on no mesh of it (16- and 8-bit bytes on the longest ring, eager on its own mesh), dtype on the
#: odd ring, and the TPU layout at one dtype of each width the layout reader tells apart (32-, 16- and
#: 8-bit). What a JAX version changes for these kernels is a spelling or a lowering, met on one mesh as
#: on six; the selftest env runs every case (64 s of the 127 s run of the shard_map kernels, 53 s of the
#: Pallas one's 127 s: the emit-pipeline reduce-scatter's layout at six dtypes).
VERSIONS_CORRECT_CASES = (
    "-2x4-y-auto-v5e or test_lowered_bytes or test_eager or (test_dtype and -5-x-explicit)"
    f" or (test_tpu_layout and ({' or '.join(LAYOUT_WIDTHS)}))"
)


def meshes_of(mesh_set: str, *, min_ring: int = 1) -> list[MeshConfig]:
    """The meshes of the named set a kernel of the sweep meets (the subset's), of rings at least
    ``min_ring`` long."""
    labels = [m for m in MESH_SETS[mesh_set] if m in SUBSET_MESHES]
    return [c for c in map(parse_mesh, labels) if c.axis_size >= min_ring]


def check_meshes(check: str, *, min_ring: int | None = None) -> list[MeshConfig]:
    """The meshes ``check``'s test runs on in this run (its ``Axes.meshes``), of rings at least
    ``min_ring`` long (default: the check's own shortest ring)."""
    axes = CHECKS[check].axes
    return meshes_of(axes.meshes, min_ring=axes.min_ring if min_ring is None else min_ring)


def fixed_shape_tests(check: str) -> int:
    """How many tests ``check``, at both fixed shapes, runs per kernel: the odd shape on the check's
    meshes, the even one on its ``Axes.variants_on`` meshes."""
    axes = CHECKS[check].axes
    return len(check_meshes(check)) + len(meshes_of(axes.variants_on, min_ring=axes.min_ring))


#: The end of every skip reason for a case this host cannot run (compat.interpret_mode_limit).
CANNOT_RUN_HERE = "a TPU, more cores or a newer JAX can run the case"
#: A defect that needs an odd shape: it fails the fixed-shape checks at the odd shape only.
ODD_ROWS = "broken_pallas_drops_last_row_of_odd_shards"
#: Test modules of the run that are not per-implementation family tests.
NON_FAMILY_TESTS = ("test_seed_backward_allreduce", "test_tpu_refusals")
#: the watchdog of the sweep's runs: each hanging kernel costs this once (and the one beyond the watchdog
#: this and its abort grace, 10 s). Half the default a user gets (--hang-timeout, 20 s), not less: the
#: slowest interpreted run the sweep makes, the HBM reduce-scatter at its TPU-native dims on 8 simulated
#: devices, takes 1.7 s on the quiet 2-core host, and a watchdog that stops a slow kernel calls it hung
HANG_TIMEOUT_S = 10
#: ``CONFORMANCE_SELFTEST_LAUNCH=2x4``: run the same suite as a job of 2 processes x 4 devices
#: (``python -m conformance launch``); a Pallas check, which interpret mode cannot run across
#: processes, is then skipped with that reason and its kernel's rejection reported as skipped.
LAUNCH = os.environ.get("CONFORMANCE_SELFTEST_LAUNCH", "")
_ID = re.compile(r"^(?P<test>test_\w+)\[(?P<impl>[\w.-]+?)-(?P<rest>.*)\]$")
#: ``CONFORMANCE_BUILTIN_VERDICTS=FILE[:FILE...]`` (the selftest env: the cpu and tpu-compile envs'
#: JUnit files): the built-ins' verdicts from runs of them, taken instead of running them again where
#: every file holds this tree's and this JAX's digest (:mod:`conformance.reports.provenance`) and
#: together they ran every test :data:`BUILTINS` asks of every built-in; else the sweep runs them.
BUILTIN_VERDICTS = [
    Path(p) for p in os.environ.get("CONFORMANCE_BUILTIN_VERDICTS", "").split(os.pathsep) if p
]

#: Where each broken kernel's check catches it: for each, the first mesh of the subset (in
#: :data:`SUBSET_MESHES`' order) on which that check rejected it in a sweep over the whole subset. Every
#: sweep runs each broken kernel's check on that mesh alone: the question is whether the check still sees
#: the defect, which one case where it shows answers; on the subset's other meshes it repeats a verdict at
#: a few seconds a case. A kernel the file does not name (a new one, a mesh-less check) runs on the whole
#: subset. A declared mesh that no longer catches its kernel fails that kernel's self-test, saying how to
#: find where it is caught now: ``CONFORMANCE_SWEEP=whole`` runs every kernel on the whole subset, and
#: with ``CONFORMANCE_SWEEP_CATCHES=FILE`` writes the catches it saw to ``FILE`` (this file, to rewrite it).
CATCHES_FILE = Path(__file__).with_name("sweep_catches.json")
SWEEP = os.environ.get("CONFORMANCE_SWEEP", "cover")
if SWEEP not in ("cover", "whole"):
    raise ValueError(f"CONFORMANCE_SWEEP={SWEEP!r}: expected 'cover' or 'whole'")
SWEEP_CATCHES = (
    Path(os.environ["CONFORMANCE_SWEEP_CATCHES"]) if os.environ.get("CONFORMANCE_SWEEP_CATCHES") else None
)
REWRITE_CATCHES = (
    f"CONFORMANCE_SWEEP=whole CONFORMANCE_SWEEP_CATCHES={CATCHES_FILE.relative_to(ROOT)} "
    f"pytest {Path(__file__).relative_to(ROOT)}"
)
#: The broken kernels each scope runs on the whole subset: those whose self-tests below count their
#: outcomes over it (the odd shape's failures, bad inputs' meshes, the watchdog's one hang, the overlap
#: defects' every other check), and the hanging ones (:data:`HANGING`), whose run waits beside the two
#: that compute and whose hang JAX's interpreter may place elsewhere: JAX 0.6.2's deadlocks inside JAX on
#: the odd ring where a later JAX's kernel hangs there, a host limit that leaves it to another mesh.
WHOLE_SUBSET = frozenset(
    {
        *HANGING,
        ODD_ROWS,
        "broken_truncates_indivisible_rows",
        "broken_pallas_blocks_beyond_the_watchdog",
        *broken_overlap_kernels.EXPECTED_PASS,
    }
)

Verdicts = dict[str, dict[str, list[tuple[str, str]]]]


def verdicts_of(report: Path) -> Verdicts:
    """{impl: {test: [(outcome, message), ...]}} of one JUnit file of the suite's family tests."""
    verdicts: Verdicts = defaultdict(lambda: defaultdict(list))
    for case in ET.parse(report).getroot().iter("testcase"):
        if case.get("classname", "").endswith(NON_FAMILY_TESTS):
            continue
        m = _ID.match(case.get("name", ""))
        assert m, f"unexpected test id {case.get('name')!r}"
        failure = case.find("failure")
        error = case.find("error")
        skipped = case.find("skipped")
        if failure is not None:
            verdicts[m["impl"]][m["test"]].append(
                ("failed", failure.get("message", "") + (failure.text or ""))
            )
        elif error is not None:
            verdicts[m["impl"]][m["test"]].append(("error", error.get("message", "")))
        elif skipped is not None:
            verdicts[m["impl"]][m["test"]].append(("skipped", skipped.get("message", "")))
        else:
            verdicts[m["impl"]][m["test"]].append(("passed", ""))
    return verdicts


def builtin_verdicts_of_earlier_runs(reports: list[Path]) -> tuple[Verdicts | None, str]:
    """The built-ins' verdicts from ``reports`` and where they came from; ``None`` and why not where
    a file is missing, was made by other code or another JAX, or the files lack a test of a built-in."""
    if not reports:
        return None, "no earlier run named (CONFORMANCE_BUILTIN_VERDICTS)"
    merged: Verdicts = defaultdict(lambda: defaultdict(list))
    for report in reports:
        if not report.is_file():
            return None, f"{report} does not exist"
        root = ET.parse(report).getroot()
        digests = {p.get("value") for p in root.iter("property") if p.get("name") == provenance.PROPERTY}
        if digests != {provenance.source_digest()}:
            return None, f"{report} was made by other code or another JAX (digest {sorted(digests)})"
        for impl, tests in verdicts_of(report).items():
            if impl in BUILTINS:
                for test, outcomes in tests.items():
                    merged[impl][test].extend(outcomes)
    for impl, tests in BUILTINS.items():
        missing = tests - set(merged.get(impl, {}))
        if missing:
            return None, f"{impl} did not run {sorted(missing)} there"
    return merged, ", ".join(str(r) for r in reports)


def _mesh_of(rest: str) -> str | None:
    """The mesh of the subset a test id's parameters after the implementation (``5-x-explicit-cpu-odd``)
    name, or ``None`` (a mesh-less test)."""
    return next((m for m in SUBSET_MESHES if rest == m or rest.startswith(f"{m}-")), None)


def catching_meshes(reports: list[Path]) -> dict[str, str]:
    """{broken kernel: the first mesh of the subset (in :data:`SUBSET_MESHES`' order) on which the check
    meant for it failed it} in the sweep's JUnit files ``reports``; a kernel that check failed on no
    mesh of the subset (a mesh-less check, or not rejected at all) has no entry."""
    failed_on: dict[str, set[str]] = defaultdict(set)
    for report in reports:
        for case in ET.parse(report).getroot().iter("testcase"):
            m = _ID.match(case.get("name", ""))
            if not m or EXPECTED_REJECTION.get(m["impl"]) != m["test"] or case.find("failure") is None:
                continue
            if mesh := _mesh_of(m["rest"]):
                failed_on[m["impl"]].add(mesh)
    return {impl: next(m for m in SUBSET_MESHES if m in meshes) for impl, meshes in sorted(failed_on.items())}


def write_catches(path: Path, catches: dict[str, str]) -> None:
    """Write ``catches`` (:func:`catching_meshes`) to ``path``, whole or not at all."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.partial")
    partial.write_text(json.dumps({"catches": dict(sorted(catches.items()))}, indent=1) + "\n")
    partial.replace(path)


def declared_catches(path: Path | None = None) -> dict[str, str]:
    """The catching mesh of each broken kernel that ``path`` (default :data:`CATCHES_FILE`) declares;
    a file that holds anything else raises, naming it."""
    path = path or CATCHES_FILE
    try:
        catches = json.loads(path.read_text()).get("catches")
    except (OSError, ValueError, AttributeError) as e:
        raise ValueError(f"{path} is not a sweep's catches ({e}); {REWRITE_CATCHES} writes it") from e
    if not isinstance(catches, dict) or not all(m in SUBSET_MESHES for m in catches.values()):
        raise ValueError(f"{path} holds meshes outside the subset: {str(catches)[:200]}; {REWRITE_CATCHES}")
    return catches


def narrowed_to_its_catch(impl: str) -> bool:
    """Whether this sweep runs broken kernel ``impl``'s check on its catching mesh alone."""
    return SWEEP == "cover" and impl not in WHOLE_SUBSET and impl in declared_catches()


def _pallas_kernels() -> set[str]:
    """The registered Pallas kernels (those of the sweep's run that TPU interpret mode runs)."""
    from conformance import registry, specs

    return {i.name for family in specs.FAMILIES for i in registry.registered(family) if i.pallas}


def sweep_selections(*, builtins: bool, catches: dict[str, str] | None = None) -> list[str]:
    """The ``-k`` expressions of the sweep's runs: each broken kernel only the check meant for it (on the mesh
    ``catches`` names for it alone, where it names one and the kernel is not in :data:`WHOLE_SUBSET`), each
    correct kernel of another style the checks it must pass (and the built-ins every check, where
    ``builtins``), in three runs side by side: the Pallas kernels, the rest, and the kernels that hang
    (:data:`HANGING`), whose wait for the watchdog costs the run's time and no CPU, so that it passes beside
    the two that compute rather than after one of them. Each kernel's tests stay in one run, so a hang is
    waited out once and its later checks are not judged."""
    catches = catches or {}

    def where(impl: str) -> str:
        on = f" and {EXPECTED_ON[impl]}" if impl in EXPECTED_ON else ""
        return on + (f" and -{catches[impl]}" if impl in catches and impl not in WHOLE_SUBSET else "")

    clauses: list[tuple[str, str]] = [
        (impl, f"({impl} and {test}{where(impl)})") for impl, test in EXPECTED_REJECTION.items()
    ]
    clauses.append(
        (ODD_ROWS, f"({ODD_ROWS} and test_output_sharding)")
    )  # both shapes: the summary's grouping
    passing = {**EXPECTED_PASS, **broken_overlap_kernels.EXPECTED_PASS}  # overlap defects pass the rest

    def of_scope(impl: str) -> str:
        return f" and ({VERSIONS_CORRECT_CASES})" if SCOPE == "versions" and impl in EXPECTED_PASS else ""

    clauses += [
        (impl, f"({impl} and ({' or '.join(sorted(tests))}){of_scope(impl)})")
        for impl, tests in passing.items()
    ]
    pallas = _pallas_kernels()
    run_of = {
        impl: "hanging" if impl in HANGING else "pallas" if impl in pallas else "rest" for impl, _ in clauses
    }
    selections = []
    for run, builtin_side in (("rest", "not pallas_"), ("pallas", "pallas_"), ("hanging", None)):
        chosen = " or ".join(clause for impl, clause in clauses if run_of[impl] == run)
        selected = f"({chosen}) and ({KERNEL_SUBSET})"
        if builtins and builtin_side:
            selected = f"not (broken_ or correct_) and {builtin_side} and ({BUILTIN_SUBSET}) or {selected}"
        selections.append(selected)
    return selections


@functools.cache
def suite_run(tmp_dir: str) -> tuple[Verdicts, str, str, str]:
    """{impl: {test: [(outcome, message), ...]}} from the sweep's runs of the conformance suite, their
    output, where the built-ins' verdicts came from (the earlier runs :data:`BUILTIN_VERDICTS`
    names, where they hold; else these runs, and why), and where each broken kernel's check ran (the
    mesh :data:`CATCHES_FILE` declares for it, or the whole subset). Its
    three runs go at once, as three processes (one, in a job of :data:`LAUNCH`): the self-tests' other
    worker runs the rest beside them. A run on the whole subset (``CONFORMANCE_SWEEP=whole``) writes its
    catches to :data:`SWEEP_CATCHES` where that is set."""
    earlier, source = builtin_verdicts_of_earlier_runs(BUILTIN_VERDICTS) if SCOPE == "full" else (None, "")
    if earlier is None:
        source = f"run by the sweep itself: {source or 'CONFORMANCE_SELFTEST_SCOPE=versions'}"
    catches = declared_catches() if SWEEP == "cover" else None
    cover = (
        f"each broken kernel on the mesh {CATCHES_FILE.name} declares for it, the others on the whole subset"
        if catches is not None
        else "the whole subset (CONFORMANCE_SWEEP=whole)"
    )
    selections = sweep_selections(builtins=SCOPE == "full" and earlier is None, catches=catches)
    if LAUNCH:
        selections = [" or ".join(f"({s})" for s in selections)]
    runs = []
    for number, selected in enumerate(selections):
        report = Path(tmp_dir) / f"conformance-{number}.xml"
        cmd = suite_command(
            "-k",
            selected,
            f"--kernels={KERNEL_MODULES}",
            f"--hang-timeout={HANG_TIMEOUT_S}",
            f"--junitxml={report}",
        )
        if LAUNCH:  # the same run as one job of P processes x K devices; each rank its own JUnit file
            processes, devices = LAUNCH.split("x")
            junit = f"--junitxml={shlex.quote(str(report))}.rank-$CONFORMANCE_PROCESS_ID"
            script = f"exec {shlex.join(cmd[:-1])} {junit}"
            cmd = [
                *(sys.executable, "-m", "conformance", "launch", "--processes", processes),
                *("--devices-per-process", devices, "--timeout", "3000", "--log-dir", f"{tmp_dir}/logs"),
                *("--", "sh", "-c", script),
            ]
            report = Path(f"{report}.rank-0")
        out = open(Path(tmp_dir) / f"stdout-{number}.txt", "w+")  # noqa: SIM115 (read after the wait)
        err = open(Path(tmp_dir) / f"stderr-{number}.txt", "w+")  # noqa: SIM115
        runs.append((subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=err, text=True), out, err, report))
    verdicts: Verdicts = defaultdict(lambda: defaultdict(list))
    output = []
    reports = []
    for proc, out, err, report in runs:
        proc.wait(timeout=3600)
        texts = []
        for stream in (out, err):
            stream.seek(0)
            texts.append(stream.read())
            stream.close()
        stdout, stderr = texts
        assert proc.returncode == 1, (
            f"a run with broken kernels must exit 1 (tests failed), got {proc.returncode}:\n"
            f"{stdout[-3000:]}\n{stderr[-3000:]}"
        )
        for impl, tests in verdicts_of(report).items():
            for test, outcomes in tests.items():
                verdicts[impl][test].extend(outcomes)
        output.append(stdout)
        reports.append(report)
    if SWEEP_CATCHES is not None and catches is None and not LAUNCH:  # a job skips the Pallas checks
        write_catches(SWEEP_CATCHES, catching_meshes(reports))
    if earlier is not None:
        verdicts.update(earlier)
    return verdicts, "\n".join(output), source, cover


@pytest.fixture(scope="module")
def suite(tmp_path_factory: pytest.TempPathFactory):
    return suite_run(str(tmp_path_factory.mktemp("suite")))


@pytest.fixture(scope="module")
def verdicts(suite):
    return suite[0]


def test_the_subset_s_filter_selects_exactly_its_meshes() -> None:
    """``-k`` matches substrings of test ids: no label of the subset may begin another mesh's label
    (``8-x-auto`` once also selected ``8-x-auto-v5p``, and every count here was off by one)."""
    labels = {*MESH_SETS["standard"], *EAGER_MESHES}
    for label in SUBSET_MESHES:
        assert not [other for other in labels if other != label and other.startswith(f"{label}-")], label


@pytest.mark.parametrize("impl", sorted(BUILTINS))
def test_builtin_passes_every_check(suite, verdicts, impl: str, record_property) -> None:
    if SCOPE == "versions":
        pytest.skip(f"{impl}: CONFORMANCE_SELFTEST_SCOPE=versions leaves the built-ins to this env's cpu run")
    # In the JUnit file: a selftest env that ran the built-ins again beside the cpu envs costs minutes
    record_property("builtin_verdicts_from", suite[2])
    tests = verdicts[impl]
    assert tests, f"{impl} was not run at all"
    for test, outcomes in tests.items():
        # A case this host cannot run (JAX's interpreter deadlock, predicted) is skipped, naming why
        excused = [o for o in outcomes if (o[0] == "skipped" and CANNOT_RUN_HERE in o[1]) or _host_limited(o)]
        bad = [o for o in outcomes if o[0] != "passed" and o not in excused]
        assert not bad, f"{impl} {test}: {bad[0][0]}: {bad[0][1][:2000]}"
        if all(_host_limited(o) for o in outcomes):
            continue  # e.g. the TPU layout where no libtpu can judge it (the CI envs install one)
        assert any(o[0] == "passed" for o in outcomes), f"{impl} {test}: nothing passed: {outcomes[:2]}"
    missing = BUILTINS[impl] - set(tests)
    assert not missing, f"{impl} did not run {sorted(missing)}"


def _host_limited(outcome: tuple[str, str]) -> bool:
    return outcome[0] == "skipped" and any(limit in outcome[1] for limit in HOST_LIMITS)


def _not_claimed(outcome: tuple[str, str]) -> bool:
    return outcome[0] == "skipped" and NOT_CLAIMED in outcome[1]


@pytest.mark.parametrize("impl", sorted(EXPECTED_PASS))
def test_correct_kernel_of_another_style_passes(verdicts, impl: str) -> None:
    tests = verdicts[impl]
    for test in sorted(EXPECTED_PASS[impl]):
        outcomes = tests.get(test)
        assert outcomes, f"{impl} did not run {test}"
        # passed, or skipped because this host cannot try it (never failed for the host's limit), or
        # not claimed by the kernel's own declaration (the loop rings claim no ring of one)
        bad = [o for o in outcomes if o[0] != "passed" and not _host_limited(o) and not _not_claimed(o)]
        assert not bad, f"{impl} {test}: {bad[0][0]} (a false positive): {bad[0][1][:2000]}"
        assert any(o[0] == "passed" for o in outcomes) or all(
            _host_limited(o) or _not_claimed(o) for o in outcomes
        ), outcomes


@pytest.mark.parametrize("impl", sorted(broken_overlap_kernels.EXPECTED_PASS))
def test_an_overlap_defect_passes_every_other_check(verdicts, impl: str) -> None:
    """Values, bytes, kinds and sharding are right: only the overlap check can see the defect (the
    mixed-precision pairs, which these kernels do not name, are not claimed)."""
    for test in sorted(broken_overlap_kernels.EXPECTED_PASS[impl]):
        outcomes = verdicts[impl].get(test)
        assert outcomes, f"{impl} did not run {test}"
        assert any(o[0] == "passed" for o in outcomes), outcomes
        bad = [o for o in outcomes if o[0] != "passed" and not _not_claimed(o)]
        assert not bad, f"{impl} {test}: {bad[0][0]}: {bad[0][1][:2000]}"
    rejected = verdicts[impl]["test_overlap"]
    # overlap judges rings with a transfer: of 2 and more
    assert len(rejected) == fixed_shape_tests("overlap"), rejected
    assert all(o == "failed" for o, _ in rejected), rejected


@pytest.mark.parametrize("impl", sorted(EXPECTED_REJECTION))
def test_broken_kernel_rejected_by_its_check(suite, verdicts, impl: str, record_property) -> None:
    record_property("sweep_cover", suite[3])  # in the JUnit file: the whole subset, or the catching meshes
    check = EXPECTED_REJECTION[impl]
    outcomes = verdicts[impl][check]
    if LAUNCH and outcomes and all(o == "skipped" and PALLAS_INTERPRET in m for o, m in outcomes):
        pytest.skip(f"{impl}: {check} {PALLAS_INTERPRET}")
    if outcomes and all(_host_limited(o) for o in outcomes):
        # on the whole subset no mesh could judge it here; narrowed to its catching mesh, another might
        assert not narrowed_to_its_catch(impl), (
            f"{impl}: {check} ran on its catching mesh alone ({declared_catches()[impl]}), which this host "
            f"cannot judge at this JAX ({outcomes[0][1][:300]}): add it to WHOLE_SUBSET, which runs it on "
            "the whole subset"
        )
        pytest.skip(f"{impl}: {check}: {outcomes[0][1]}")
    failures = [msg for outcome, msg in outcomes if outcome == "failed"]
    if not failures and outcomes and all(o == "skipped" and "earlier in this run" in m for o, m in outcomes):
        # it hung in a check that ran first: that check holds its one failure, the hang, and this one
        # was not judged (each later run would wait out the hang again)
        hangs = [
            (t, m)
            for t, outs in verdicts[impl].items()
            for o, m in outs
            if o == "failed" and "did not finish" in m
        ]
        assert len(hangs) == 1, hangs
        check, failures = hangs[0][0], [hangs[0][1]]
    narrowed = (
        f" on {declared_catches()[impl]}, the mesh {CATCHES_FILE.name} declares it caught on; where it is "
        f"caught now: {REWRITE_CATCHES}"
        if narrowed_to_its_catch(impl)
        else f" (run on {suite[3]})"
    )
    assert failures, f"{impl} should fail {check}, but its outcomes were {[o for o, _ in outcomes]}{narrowed}"
    message = failures[0]
    check_name = check.removeprefix("test_")
    for needed in (
        f"[{check_name}]",
        impl,
        "mesh(",
        "dtype",
        "shapes",
        "replay         : python -m conformance replay",
    ):
        assert needed in message, f"{impl}'s {check} failure message lacks {needed!r}:\n{message}"
    if impl in EXPECTED_MESSAGE:
        assert EXPECTED_MESSAGE[impl] in message, f"{impl}: expected {EXPECTED_MESSAGE[impl]!r}:\n{message}"


def test_truncating_kernel_fails_bad_inputs_on_every_mesh_type_for_its_real_reason(verdicts) -> None:
    """On an Explicit mesh JAX refuses replicated inputs before the kernel sees them, with a message
    that names the array's shape; the verdict must come from the kernel's own behaviour instead."""
    outcomes = verdicts["broken_truncates_indivisible_rows"]["test_bad_inputs"]
    assert len(outcomes) == len(check_meshes("bad_inputs")), outcomes  # a mesh of each kind, both types
    failed = [message for outcome, message in outcomes if outcome == "failed"]
    # every size divides by a ring of one: there it has nothing to truncate, and passes
    assert len(failed) == len(check_meshes("bad_inputs", min_ring=2)), outcomes
    assert [o for o, _ in outcomes if o != "failed"] == ["passed"] * (len(outcomes) - len(failed)), outcomes
    for message in failed:
        assert "returned a result of shape" in message, message


def test_a_defect_that_needs_odd_rows_fails_the_odd_shape_only_and_is_summarized_as_one_cause(suite) -> None:
    verdicts, output, *_ = suite
    outcomes = verdicts[ODD_ROWS]["test_output_sharding"]
    names = [message for outcome, message in outcomes if outcome == "failed"]
    assert len(outcomes) == fixed_shape_tests("output_sharding"), outcomes  # both fixed shapes
    # the odd half, where there is a neighbour to send a row to (a ring of one drops nothing)
    assert len(names) == len(check_meshes("output_sharding", min_ring=2)), outcomes
    assert all("rows_per_shard=3" in message for message in names), names[0]
    summary = output[output.index("conformance failures by implementation") :]
    block = summary[summary.index(f"\nall_gather/{ODD_ROWS}:") :]
    block = block[: block.index("start here")]
    assert "needs the odd shape" in block, block
    causes = re.findall(r"^\s+(\d+)x (.*)$", block, re.M)
    assert len(causes) == 1, block  # one cause for every failure of the kernel, whatever the check
    assert int(causes[0][0]) == sum(o == "failed" for t in verdicts[ODD_ROWS].values() for o, _ in t), block


def test_a_hang_beyond_the_watchdog_ends_with_a_verdict_and_the_kernel_is_not_run_again(verdicts) -> None:
    """The hang is the kernel's one failure; its later checks are not judged (each would wait out the
    hang again), never failures it did not show."""
    outcomes = verdicts["broken_pallas_blocks_beyond_the_watchdog"]["test_output_sharding"]
    later = fixed_shape_tests("output_sharding") - 1
    assert [o for o, _ in outcomes] == ["failed"] + ["skipped"] * later, outcomes
    first, *rest = (message for _, message in outcomes)
    assert "threads were stuck at" in first and "_wait_forever: _NEVER.wait()" in first, first
    assert all(
        "not judged" in m and "earlier in this run" in m and "To judge this one:" in m for m in rest
    ), rest[0]


def test_each_collective_in_a_failure_shows_its_own_attributes(verdicts) -> None:
    """The module lowered for TPU once printed an all-reduce with a later collective-permute's pairs."""
    messages = [
        m
        for o, m in verdicts["broken_backward_allreduce_then_slice"]["test_backward_collectives"]
        if o == "failed"
    ]
    assert messages
    for message in messages:
        lines = [line for line in message.splitlines() if "lowered for tpu: all-reduce(" in line]
        assert lines, message
        assert all("groups=[[" in line and "pairs=" not in line for line in lines), lines


def test_replay_command_reproduces_a_failure(verdicts) -> None:
    message = next(m for o, m in verdicts["broken_ring_wrong_slot"]["test_values"] if o == "failed")
    command = re.search(r"replay\s+: (python -m conformance replay .*)", message)[1]
    argv = shlex.split(command)
    proc = subprocess.run([sys.executable, *argv[1:]], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "FAILED values" in proc.stdout and "first wrong index" in proc.stdout, proc.stdout


def test_replay_of_an_overlap_failure_reproduces_it(verdicts) -> None:
    """Every failure's replay line must run: ``overlap`` was once missing from the replay's checks."""
    message = next(
        m for o, m in verdicts["broken_agmm_gathers_then_multiplies"]["test_overlap"] if o == "failed"
    )
    argv = shlex.split(re.search(r"replay\s+: (python -m conformance replay .*)", message)[1])
    proc = subprocess.run([sys.executable, *argv[1:]], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "FAILED overlap" in proc.stdout and "hideable" in proc.stdout, proc.stdout[-3000:]


@pytest.mark.parametrize("impl", ["xla_all_gather", "pallas_ring_all_gather_bidirectional"])
def test_a_replay_with_nothing_to_judge_says_so(impl: str) -> None:
    """Not a traceback, not a pass: the check has nothing to judge in this kernel (in the process, and
    from the worker process a Pallas kernel's check runs in)."""
    if SCOPE == "versions":
        pytest.skip("CONFORMANCE_SELFTEST_SCOPE=versions: run in the selftest env")
    token = "4-x-explicit:rows_per_shard=3,cols=128:float32:seed=0" + (
        ":dma=on_wait" if "pallas" in impl else ""
    )
    command = [sys.executable, "-m", "conformance", "replay", "overlap", "all_gather", impl, token]
    proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "NOT JUDGED overlap: " in proc.stdout and "Traceback" not in proc.stdout + proc.stderr, proc.stdout


def test_earlier_verdicts_are_taken_only_from_this_tree_s_run_of_every_builtin_test(tmp_path: Path) -> None:
    """The sweep takes the built-ins' verdicts from an earlier run only where that run was made by this
    very code and JAX and ran every test each built-in must: never a stale or partial file's passes."""

    def junit(path: Path, digest: str, tests: dict[str, set[str]]) -> Path:
        cases = "".join(
            f'<testcase classname="conformance.tests.test_x" name="{test}[{impl}-1-x-explicit-cpu]"/>'
            for impl, names in tests.items()
            for test in sorted(names)
        )
        path.write_text(
            f'<testsuites><testsuite><properties><property name="{provenance.PROPERTY}" value="{digest}"/>'
            f"</properties>{cases}</testsuite></testsuites>"
        )
        return path

    every = {impl: set(tests) for impl, tests in BUILTINS.items()}
    here = provenance.source_digest()
    taken, where = builtin_verdicts_of_earlier_runs([junit(tmp_path / "all.xml", here, every)])
    assert taken is not None and set(taken) == set(BUILTINS), where
    assert all(taken[i][t] == [("passed", "")] for i in BUILTINS for t in BUILTINS[i])
    stale, why = builtin_verdicts_of_earlier_runs([junit(tmp_path / "stale.xml", "0" * 64, every)])
    assert stale is None and "other code or another JAX" in why, why
    partial = {**every, "xla_all_gather": every["xla_all_gather"] - {"test_values"}}
    missing, why = builtin_verdicts_of_earlier_runs([junit(tmp_path / "partial.xml", here, partial)])
    assert missing is None and "xla_all_gather did not run ['test_values']" in why, why
    absent, why = builtin_verdicts_of_earlier_runs([tmp_path / "absent.xml"])
    assert absent is None and "does not exist" in why, why


def test_the_sweep_runs_each_kernel_on_its_declared_catch_and_narrows_no_counted_kernel(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A sweep over the whole subset finds each broken kernel's catching mesh: the first mesh of the
    subset its check failed it on, never one it passed on. Every sweep runs a kernel on the mesh the
    committed file declares for it, never a kernel whose self-tests count its outcomes over the whole
    subset, nor a hanging one; the file names only broken kernels of this suite, on meshes of the subset."""
    committed = declared_catches()
    # a kernel some JAX lacks (registered where compat says it can be) is still one of the suite's
    sources = "".join(inspect.getsource(module) for module in BROKEN)
    unknown = [k for k in committed if k not in EXPECTED_REJECTION and k.split(".")[0] not in sources]
    assert not unknown, f"{CATCHES_FILE.name} names kernels the suite does not have: {unknown}"
    report = tmp_path / "sweep.xml"
    cases = [
        ("broken_ring_wrong_slot", "test_values", "8-x-auto-cpu", True),
        ("broken_ring_wrong_slot", "test_values", "5-x-explicit-cpu", True),
        ("broken_ring_wrong_slot", "test_values", "1-x-explicit-cpu", False),
        ("broken_ring_wrong_slot", "test_output_sharding", "1-x-explicit-cpu-odd", True),  # not its check
        (ODD_ROWS, "test_values", "5-x-explicit-cpu", True),
    ]
    report.write_text(
        "<testsuites><testsuite>"
        + "".join(
            f'<testcase classname="conformance.tests.test_x" name="{test}[{impl}-{rest}]">'
            + ('<failure message="wrong"/>' if failed else "")
            + "</testcase>"
            for impl, test, rest, failed in cases
        )
        + "</testsuite></testsuites>"
    )
    catches = catching_meshes([report])
    assert catches == {"broken_ring_wrong_slot": "5-x-explicit", ODD_ROWS: "5-x-explicit"}, catches
    path = tmp_path / "catches.json"
    write_catches(path, catches)
    assert declared_catches(path) == catches
    for garbled in ('{"catches": {"x": "9-x-auto"}}', "[]", "not json"):
        path.write_text(garbled)
        with pytest.raises(ValueError, match="CONFORMANCE_SWEEP=whole"):
            declared_catches(path)
    selected = " ".join(sweep_selections(builtins=False, catches=catches))
    assert "(broken_ring_wrong_slot and test_values and -5-x-explicit)" in selected, selected
    assert f"({ODD_ROWS} and test_values)" in selected and f"{ODD_ROWS} and test_values and -" not in selected
    whole = " ".join(sweep_selections(builtins=False))
    assert "(broken_ring_wrong_slot and test_values)" in whole, whole
    # where a narrowed kernel's one case cannot be judged here, its test fails rather than skips
    write_catches(path, {**catches, **dict.fromkeys(HANGING, "5-x-explicit")})
    monkeypatch.setitem(globals(), "CATCHES_FILE", path)
    assert narrowed_to_its_catch("broken_ring_wrong_slot")
    assert not any(narrowed_to_its_catch(impl) for impl in (ODD_ROWS, *HANGING, "broken_not_declared"))
    monkeypatch.setitem(globals(), "SWEEP", "whole")
    assert not narrowed_to_its_catch("broken_ring_wrong_slot")
