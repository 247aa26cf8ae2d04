"""The suite's own tests: kernels broken in one known way each, which the suite must reject."""

import os

#: What a self-test's pytest subprocess must not inherit: this process's device count, and
#: pytest-xdist's worker variables when the self-tests run under ``-n`` (pytest-benchmark, seeing
#: them, turns itself off).
_NOT_INHERITED = ("XLA_FLAGS", "JAX_NUM_CPU_DEVICES")


def subprocess_env() -> dict[str, str]:
    """This process's environment for a self-test's pytest subprocess (see ``_NOT_INHERITED``)."""
    return {
        k: v for k, v in os.environ.items() if k not in _NOT_INHERITED and not k.startswith("PYTEST_XDIST_")
    }
