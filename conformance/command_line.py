"""What the ``python -m conformance`` commands share: bad input is a usage error, one ``ERROR:`` line
and pytest's usage-error exit status, so that a script treats the suite's two entry points alike."""

from __future__ import annotations

import argparse
import sys
from typing import NoReturn

#: The exit status of a usage error: pytest's (``pytest.ExitCode.USAGE_ERROR``).
USAGE_ERROR = 4


class UsageError(Exception):
    """Bad input to a command: printed as one line, exit status :data:`USAGE_ERROR`."""


class Parser(argparse.ArgumentParser):
    """An argument parser whose own errors (a missing or malformed argument) exit as the others do."""

    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        self.exit(USAGE_ERROR, f"ERROR: {self.prog}: {message}\n")


def report(error: UsageError) -> int:
    """Print ``error`` as the usage error it is; the exit status to return."""
    print(f"ERROR: {error}", file=sys.stderr)
    return USAGE_ERROR
