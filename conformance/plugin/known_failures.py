"""Known-failures and skips files (array-api-tests' convention): one test id or glob per line,
``#`` comments; ids are the uniform ``family/impl/check/mesh/...`` ones or pytest node ids."""

from __future__ import annotations

import fnmatch
from pathlib import Path

import pytest


def read_patterns(path: str) -> list[tuple[int, str]]:
    """``(line number, pattern)`` of a known-failures file: one id or glob per line, ``#`` comments."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise pytest.UsageError(f"cannot read {path}: {e}") from e
    out = []
    for number, line in enumerate(text.splitlines(), 1):
        pattern = line.split("#", 1)[0].strip()
        if pattern:
            out.append((number, pattern))
    return out


def matches(pattern: str, meta: dict) -> bool:
    return any(fnmatch.fnmatchcase(meta[k], pattern) for k in ("id", "nodeid")) or meta["nodeid"] == pattern
