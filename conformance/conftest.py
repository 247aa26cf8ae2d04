"""The self-tests (``conformance/selftest``) run only when named: ``pytest conformance/selftest``."""

from __future__ import annotations

from pathlib import Path

import pytest


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    if collection_path.name == "selftest":
        named = any("selftest" in str(arg) for arg in config.args)
        return None if named else True
    return None
