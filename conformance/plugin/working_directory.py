"""A run leaves the directory it runs in as it found it: what the libraries it runs on would make
there goes to pytest's cache folder instead."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path

import hypothesis.configuration
import pytest


def folders_kept_elsewhere(config: pytest.Config) -> Callable[[], None]:
    """The run leaves the user's directory as it found it: hypothesis keeps a cache of the constants
    in local modules in ``./.hypothesis``, and pytest-benchmark makes ``./.benchmarks`` at start, each
    though the suite stores nothing there. Where the user has neither folder and did not point either
    elsewhere, they go to pytest's cache folder (a temporary one without it) for the run; a run that
    saves or compares benchmarks keeps pytest-benchmark's own. Returns the closure that undoes it."""
    cache = getattr(config, "cache", None)
    undo: list[Callable[[], None]] = []

    def kept(name: str) -> Path:
        if cache is not None:
            return Path(cache.mkdir(f"conformance-{name}"))
        folder = tempfile.TemporaryDirectory(prefix=f"conformance-{name}-")
        undo.append(folder.cleanup)
        return Path(folder.name)

    home_set = vars(hypothesis.configuration).get("__hypothesis_home_directory") is not None
    if not (os.environ.get("HYPOTHESIS_STORAGE_DIRECTORY") or home_set or Path(".hypothesis").exists()):
        hypothesis.configuration.set_hypothesis_home_dir(kept("hypothesis"))
        undo.append(lambda: hypothesis.configuration.set_hypothesis_home_dir(None))
    storing = any(
        getattr(config.option, name, None)
        for name in ("benchmark_save", "benchmark_autosave", "benchmark_compare")
    )
    if (
        getattr(config.option, "benchmark_storage", None) == "file://./.benchmarks"
        and not storing
        and not Path(".benchmarks").exists()
    ):
        before = config.option.benchmark_storage
        config.option.benchmark_storage = f"file://{kept('benchmarks')}"
        undo.append(lambda: setattr(config.option, "benchmark_storage", before))

    def undo_all() -> None:
        for step in reversed(undo):
            step()

    return undo_all
