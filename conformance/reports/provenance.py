"""What made a run's verdicts: the suite's own source and the JAX it ran on, as one digest.

A run writes the digest into its JUnit file (a testsuite property, :data:`PROPERTY`), so a later
run that would repeat it can take its verdicts instead, and only where they come from exactly the
code and the JAX it would run itself (the broken-kernel sweep takes the built-ins' verdicts from the
cpu env's run of them: :mod:`conformance.selftest.test_rejects_broken_kernels`). Any change to a
file of the suite (checks, kernels, fixtures, specs), to the installed jax, jaxlib or libtpu, changes
the digest.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import importlib.util
from pathlib import Path

#: The JUnit testsuite property that holds the digest.
PROPERTY = "conformance: source digest"
#: The suite's packages whose files make the digest (installed, kernels/ and fixtures/ are these).
PACKAGES = ("conformance", "conformance.kernels", "conformance.fixtures")
#: The distributions whose versions make the digest.
DISTRIBUTIONS = ("jax", "jaxlib", "libtpu", "hypothesis")
_SUFFIXES = (".py", ".txt", ".txtpb")


def _roots() -> list[Path]:
    roots = []
    for name in PACKAGES:
        spec = importlib.util.find_spec(name)
        for location in (spec.submodule_search_locations or []) if spec else []:
            roots.append(Path(location).resolve())
    return sorted(set(roots))


def _version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "-"


@functools.cache
def source_digest() -> str:
    """SHA-256 of every source file of the suite (path and bytes) and the versions it runs on."""
    digest = hashlib.sha256()
    for name in DISTRIBUTIONS:
        digest.update(f"{name}=={_version(name)}\n".encode())
    digest.update(tree_digest().encode())
    return digest.hexdigest()


@functools.cache
def tree_digest() -> str:
    """SHA-256 of every source file of the suite (path and bytes) alone, whatever JAX it runs on: what
    a run on another JAX reads of this tree's earlier runs is keyed by it."""
    digest = hashlib.sha256()
    for root in _roots():
        for path in sorted(
            p for p in root.rglob("*") if p.suffix in _SUFFIXES and "__pycache__" not in p.parts
        ):
            digest.update(f"{path.relative_to(root.parent)}\n".encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()
