"""The suite's own tests: kernels broken in one known way each, which the suite must reject."""

import os
import sys

#: What a self-test's pytest subprocess must not inherit: this process's device count, and
#: pytest-xdist's worker variables when the self-tests run under ``-n`` (pytest-benchmark, seeing
#: them, turns itself off).
_NOT_INHERITED = ("XLA_FLAGS", "JAX_NUM_CPU_DEVICES")

#: What starting a job's processes (Python, JAX, a pytest collection) may take beside the time a test
#: bounds, on the 2-core CI host while the selftest env runs another worker beside it: a job that was
#: stopped still ends well inside the 600 s its hung or sleeping ranks would otherwise run.
STARTUP_ON_A_LOADED_HOST_S = 90


def subprocess_env() -> dict[str, str]:
    """This process's environment for a self-test's pytest subprocess (see ``_NOT_INHERITED``)."""
    return {
        k: v for k, v in os.environ.items() if k not in _NOT_INHERITED and not k.startswith("PYTEST_XDIST_")
    }


def suite_command(*args: str, marks: str | None = "cpu", target: str = "conformance") -> list[str]:
    """A pytest run of the installed suite as a user starts it, quiet and without pytest's cache:
    ``python -m pytest --pyargs TARGET -m MARKS -p no:cacheprovider -q ARGS`` (no ``-m`` where
    ``marks`` is ``None``; ``target`` a module of the suite to run that alone). Every self-test that
    starts the suite builds its command here."""
    return [
        sys.executable,
        *("-m", "pytest", "--pyargs", target),
        *(("-m", marks) if marks else ()),
        *("-p", "no:cacheprovider", "-q"),
        *args,
    ]


def job_command(*, timeout: float | None = None, log_dir: str | None = None) -> list[str]:
    """What starts the command after it as a job of 2 processes x 4 CPU devices: ``python -m
    conformance launch --processes 2 --devices-per-process 4 [--timeout T] [--log-dir DIR] --``."""
    return [
        sys.executable,
        *("-m", "conformance", "launch", "--processes", "2", "--devices-per-process", "4"),
        *(("--timeout", str(timeout)) if timeout is not None else ()),
        *(("--log-dir", log_dir) if log_dir is not None else ()),
        "--",
    ]
