"""What native libraries write to stderr as they load on a host without their hardware, kept out of a
run's output; everything else they write passes through.

JAX's CUDA plugin (the ``gpu-compile`` extra: XLA:GPU compiling for GPUs this host does not have)
logs, each time it loads a CUDA stub on a host with no NVIDIA driver, before anything could configure
its logging(one line each)::

    WARNING: All log messages before absl::InitializeLog() is called are written to STDERR
    I0000 00:00:1795834408.897999    5559 cudart_stub.cc:31] Could not find cuda drivers on your
    machine, GPU will not be used.

No environment variable reaches that log (``TF_CPP_MIN_LOG_LEVEL`` does not), so where it can be
printed (:func:`filtered`: ``import jax`` and a backend's start) file descriptor 2 goes to a file for
the span and what it held is written back without those lines. This module imports no JAX.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
import re
import sys
import tempfile
from collections.abc import Iterator

#: A line that says nothing to a user of the suite on a host without the hardware it concerns.
NOISE = re.compile(
    r"I\d{4} [\d:. ]+\d+ cudart_stub\.cc:\d+\] Could not find cuda drivers on your machine, GPU will not "
    r"be used\."
)
#: absl's note before its first message, dropped where the message it announces is :data:`NOISE`.
_ABSL_NOTE = "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR"


def without_noise(text: str) -> str:
    """``text`` without :data:`NOISE` lines and the absl notes that announce only them."""
    lines = text.splitlines(keepends=True)
    kept = []
    for i, line in enumerate(lines):
        if NOISE.fullmatch(line.rstrip("\n")):
            continue
        following = lines[i + 1].rstrip("\n") if i + 1 < len(lines) else ""
        if line.rstrip("\n") == _ABSL_NOTE and NOISE.fullmatch(following):
            continue
        kept.append(line)
    return "".join(kept)


def _cuda_plugin_installed() -> bool:
    for name in ("jax-cuda12-plugin", "jax-cuda13-plugin"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            importlib.metadata.version(name)
            return True
    return False


@contextlib.contextmanager
def stderr_captured(into: list[str]) -> Iterator[None]:
    """What is written to file descriptor 2 inside the block (native code's logs, which no Python
    stream sees), appended to ``into`` on leaving it instead of printed."""
    sys.stderr.flush()
    with tempfile.TemporaryFile(mode="w+b") as sink:
        saved = os.dup(2)
        os.dup2(sink.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            sink.seek(0)
            into.append(sink.read().decode(errors="replace"))


@contextlib.contextmanager
def filtered() -> Iterator[None]:
    """Inside the block, what is written to file descriptor 2 is held and written back on leaving it
    without :data:`NOISE`. Only where the CUDA plugin is installed on a host with no NVIDIA driver:
    elsewhere nothing is redirected."""
    if not _cuda_plugin_installed() or os.path.exists("/proc/driver/nvidia/version"):
        yield
        return
    held: list[str] = []
    try:
        with stderr_captured(held):
            yield
    finally:
        text = without_noise("".join(held))
        if text:
            sys.stderr.write(text)
            sys.stderr.flush()
