"""The suite rejects each broken kernel by the check meant for it, and passes the built-ins.

One subprocess runs the real conformance suite (``-m cpu``) on the built-ins
plus ``broken_kernels``, exactly as a user would with ``--kernels``, and writes
JUnit XML; the tests below read the verdicts. Running in a subprocess keeps the
registry of this process clean and tests the command-line path itself.
"""

from __future__ import annotations

import functools
import re
import shlex
import subprocess
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

import pytest

from conformance.selftest.broken_kernels import EXPECTED_REJECTION

pytestmark = pytest.mark.selftest

ROOT = Path(__file__).resolve().parents[2]
BROKEN_MODULE = "conformance.selftest.broken_kernels"
BUILTINS = (
    "xla_allgather_matmul",
    "ring_allgather_matmul_unidirectional",
    "ring_allgather_matmul_bidirectional",
)
_ID = re.compile(r"^(?P<test>test_\w+)\[(?P<impl>[\w-]+?)-(?P<rest>.*)\]$")


@functools.cache
def suite_verdicts(tmp_dir: str) -> dict[str, dict[str, list[tuple[str, str]]]]:
    """{impl: {test: [(outcome, message), ...]}} from one run of the conformance suite."""
    report = Path(tmp_dir) / "conformance.xml"
    cmd = [sys.executable, "-m", "pytest", "conformance", "-m", "cpu", "-q", "-p", "no:cacheprovider",
           f"--kernels={BROKEN_MODULE}", f"--junitxml={report}"]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 1, (
        f"the run with broken kernels must exit 1 (tests failed), got {proc.returncode}:\n"
        f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    )
    verdicts: dict[str, dict[str, list[tuple[str, str]]]] = defaultdict(lambda: defaultdict(list))
    for case in ET.parse(report).getroot().iter("testcase"):
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


@pytest.fixture(scope="module")
def verdicts(tmp_path_factory: pytest.TempPathFactory):
    return suite_verdicts(str(tmp_path_factory.mktemp("suite")))


@pytest.mark.parametrize("impl", BUILTINS)
def test_builtin_passes_every_check(verdicts, impl: str) -> None:
    tests = verdicts[impl]
    assert tests, f"{impl} was not run at all"
    for test, outcomes in tests.items():
        bad = [o for o in outcomes if o[0] != "passed"]
        assert not bad, f"{impl} {test}: {bad[0][0]}: {bad[0][1][:2000]}"
    assert {"test_values", "test_output_sharding", "test_dtype", "test_determinism",
            "test_collectives", "test_cross_lowering", "test_bad_inputs"} <= set(tests)  # fmt: skip


@pytest.mark.parametrize("impl", sorted(EXPECTED_REJECTION))
def test_broken_kernel_rejected_by_its_check(verdicts, impl: str) -> None:
    check = EXPECTED_REJECTION[impl]
    outcomes = verdicts[impl][check]
    failures = [msg for outcome, msg in outcomes if outcome == "failed"]
    assert failures, f"{impl} should fail {check}, but its outcomes were {[o for o, _ in outcomes]}"
    message = failures[0]
    check_name = check.removeprefix("test_")
    for needed in (f"[{check_name}]", impl, "allgather_matmul", "mesh(", "dtype", "shapes",
                   "replay         : python -m conformance replay"):  # fmt: skip
        assert needed in message, f"{impl}'s {check} failure message lacks {needed!r}:\n{message}"


def test_replay_command_reproduces_a_failure(verdicts) -> None:
    message = next(m for o, m in verdicts["broken_ring_wrong_slot"]["test_values"] if o == "failed")
    command = re.search(r"replay\s+: (python -m conformance replay .*)", message)[1]
    argv = shlex.split(command)
    proc = subprocess.run([sys.executable, *argv[1:]], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "FAILED values" in proc.stdout and "first wrong index" in proc.stdout, proc.stdout
