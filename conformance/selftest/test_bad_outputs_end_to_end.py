"""Each kernel of ``bad_output_kernels`` (a result of the wrong shape or type or dtype, a kernel that
fails while tracing) is one cause in the run's failure summary, under its one verdict line, whichever
checks met it (the TPU compile tier's included): in one process, under pytest-xdist and as a job of two
processes. Never an INTERNALERROR or a check's own traceback ("no verdict line")."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from conformance.selftest import job_command, subprocess_env, suite_command
from conformance.selftest.bad_output_kernels import VERDICTS

pytestmark = [pytest.mark.selftest, pytest.mark.integration]

KERNELS = "conformance.selftest.bad_output_kernels"
ARGS = (f"--kernels={KERNELS}", "--impl=bad_output_*")
#: A ring of 3 for the mesh checks (the eager check's own two meshes and the TPU tier's topologies run too).
MESHES = "--meshes=3-x-auto"

_IMPL = re.compile(r"^(?P<family>\w+)/(?P<impl>\w+): (?P<failed>\d+) failed, \d+ passed$")
_CAUSE = re.compile(r"^ {2,}(?P<count>\d+)x (?P<what>.+)$")


def failure_summary(output: str) -> dict[str, list[str]]:
    """The causes the failure summary gives each implementation, by implementation."""
    causes: dict[str, list[str]] = {}
    impl = None
    for line in output.splitlines():
        if match := _IMPL.match(line):
            impl = match["impl"]
            causes[impl] = []
        elif impl and (match := _CAUSE.match(line)):
            causes[impl].append(match["what"])
        elif impl and not line.startswith(" "):
            impl = None
    return causes


@pytest.mark.parametrize("how", ["one-process", "xdist", "job"])
def test_each_bad_output_is_one_cause_in_the_failure_summary(tmp_path: Path, how: str) -> None:
    command = suite_command(*ARGS, MESHES, *(("-n", "2") if how == "xdist" else ()))
    if how == "job":
        command = [*job_command(timeout=400, log_dir=str(tmp_path / "logs")), *command]
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=900, env=subprocess_env(), cwd=tmp_path
    )
    output = done.stdout + done.stderr
    assert done.returncode == 1, output[-4000:]
    assert "INTERNALERROR" not in output and "no verdict line" not in output, output[-4000:]
    causes = failure_summary(done.stdout)
    assert causes == {impl: [what] for impl, what in VERDICTS.items()}, (causes, output[-4000:])
