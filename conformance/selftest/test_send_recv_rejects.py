"""The send_recv checks reject each broken kernel by the check meant for it and pass the correct
kernels written in other styles (and the built-ins, in ``tox -e cpu``).

One subprocess runs the family's test module as a user would (``--kernels``), writing JUnit XML.
The seed's two NCCL defects on real NCCL need a GPU: on a host without one this run reports them
not claimed, which the last test checks (it does not count them as rejected).
"""

from __future__ import annotations

import functools
import subprocess
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

import pytest

from conformance.selftest import broken_send_recv_kernels as kernels
from conformance.selftest import suite_command

pytestmark = pytest.mark.selftest
MODULE = kernels.__name__
#: The values check of a broken kernel runs on two dtypes here (every dtype in the family's own run):
#: each failure costs a report, and two show each defect.
NARROW = {"test_values": " and (bfloat16 or float32)"}
#: ``--hang-timeout`` of the run: the hanging kernel's first call costs 3 times this, once.
HANG_TIMEOUT_S = 3


@functools.cache
def verdicts(tmp_dir: str) -> dict[str, dict[str, list[tuple[str, str]]]]:
    """``{impl: {test: [(outcome, message)]}}`` of one run of the family's tests."""
    report = Path(tmp_dir) / "send_recv.xml"
    targeted = " or ".join(
        f"({impl} and {test}{NARROW.get(test, '')})" for impl, test in kernels.EXPECTED_REJECTION.items()
    )
    targeted += " or correct_sr_ or broken_nccl_"
    command = suite_command(
        f"--kernels={MODULE}",
        "-k",
        targeted,
        f"--hang-timeout={HANG_TIMEOUT_S}",
        f"--junitxml={report}",
        target="conformance.tests.test_send_recv",
    )
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=tmp_dir)
    assert report.exists(), done.stdout[-3000:] + done.stderr[-3000:]
    out: dict[str, dict[str, list[tuple[str, str]]]] = defaultdict(lambda: defaultdict(list))
    for case in ET.parse(report).getroot().iter("testcase"):
        name = case.get("name", "")
        test, _, params = name.partition("[")
        impl = params.split("-", 1)[0]
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                outcome, message = (
                    {"failure": "failed", "error": "error", "skipped": "skipped"}[tag],
                    (node.get("message", "") + (node.text or "")),
                )
        out[impl][test].append((outcome, message))
    return out


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> dict:
    return verdicts(str(tmp_path_factory.mktemp("send_recv")))


@pytest.mark.parametrize("impl", sorted(kernels.EXPECTED_REJECTION))
def test_each_broken_kernel_is_rejected_by_its_check(run, impl: str) -> None:
    test = kernels.EXPECTED_REJECTION[impl]
    outcomes = run[impl][test]
    failed = [m for o, m in outcomes if o == "failed"]
    assert failed, f"{impl}: {test} did not fail: {outcomes[:3]}"
    assert f"send_recv/{impl}" in failed[0] and "replay" in failed[0], failed[0]
    if impl in kernels.EXPECTED_MESSAGE:
        assert any(kernels.EXPECTED_MESSAGE[impl] in m for m in failed), failed[0]


@pytest.mark.parametrize("impl", kernels.CORRECT)
def test_correct_kernels_in_other_styles_pass_every_check(run, impl: str) -> None:
    tests = run[impl]
    every = {
        "test_values",
        "test_values_drawn",
        "test_sharding",
        "test_source_intact",
        "test_bad_destination",
        "test_block_map",
        "test_resources",
        "test_no_pickle",
    }
    assert set(tests) >= every, sorted(tests)
    bad = [(t, o, m[:300]) for t, results in tests.items() for o, m in results if o in ("failed", "error")]
    assert not bad, bad
    assert sum(o == "passed" for results in tests.values() for o, _ in results) > 800


def test_the_nccl_seed_kernels_are_not_claimed_without_a_gpu(run) -> None:
    """Without a GPU they neither pass nor count as rejected: every test of theirs is not claimed."""
    for impl in kernels.EXPECTED_REJECTION_GPU:
        outcomes = [(o, m) for results in run[impl].values() for o, m in results]
        assert outcomes and all(o == "skipped" and "not claimed" in m for o, m in outcomes), outcomes[:3]


def test_a_kernel_that_hung_fails_once_and_its_later_checks_are_not_judged(run) -> None:
    """Its call is still blocked in the process, so its later calls cannot run there; they are reported
    not judged (with the replay that judges one), never as failures the kernel did not show."""
    outcomes = run["broken_sr_hangs_on_empty_shards"]["test_values"]
    failed = [m for o, m in outcomes if o == "failed"]
    assert len(failed) == 1 and "(hung)" in failed[0], failed
    later = [m for o, m in outcomes if o == "skipped"]
    assert later, outcomes
    assert all(
        "not judged" in m and "hung earlier in this run" in m and "To judge this one:" in m for m in later
    ), later[0]
