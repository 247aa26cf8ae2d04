"""JAX's persistent compilation cache for a run of the suite: a developer's repeat run, and the
tox environments of one CI run that use the same JAX, read back what an earlier run compiled.

The plugin puts the cache in pytest's cache directory, one folder per JAX and jaxlib version
(``.pytest_cache/d/conformance-jax-0.10.2-jaxlib-0.10.2``), never shared between versions;
``--compilation-cache=DIR`` (or ``$CONFORMANCE_COMPILATION_CACHE``, which the tox envs set to one
directory for all of them, and which a self-test's pytest subprocess inherits) puts those folders
in ``DIR``; ``--compilation-cache=off`` (or a run without pytest's cache provider and no ``DIR``)
leaves JAX's settings alone, as does a cache directory the user set
(``JAX_COMPILATION_CACHE_DIR``). What it holds: the compiles for the host's devices of the
kernels and their VJPs, which the checks share. Not in it: the Pallas kernels' interpret-mode
runs (they run in the worker process of :mod:`conformance.run.check_worker`, whose verdicts of each
interpreted program are kept in a folder beside it instead, :func:`interpret_outcome_dir`; with
``--isolation=off`` the plugin leaves the cache off), and the compiles for TPU and GPU
topologies (:func:`bypassed`), whose executables cannot be read back: what the checks read of those
is kept in a folder beside it instead (:func:`target_compile_dir`,
:mod:`conformance.targets.target_compiles`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jax
import jaxlib

#: The environment variable that gives ``--compilation-cache`` its default.
DIR_VARIABLE = "CONFORMANCE_COMPILATION_CACHE"

#: JAX's persistent compilation cache settings the suite sets: every compile is written, however
#: fast or small (the suite's compiles take 0.05-2 s each; JAX's defaults keep those above 1 s).
_CACHE_SETTINGS = {
    "jax_persistent_cache_min_compile_time_secs": 0.0,
    "jax_persistent_cache_min_entry_size_bytes": -1,
}


def set_by_user() -> bool:
    """Whether this process already has a cache directory (``JAX_COMPILATION_CACHE_DIR``, or set in
    code before the run)."""
    return bool(jax.config.jax_compilation_cache_dir)


def folder_name() -> str:
    """The cache's folder for this JAX: ``conformance-jax-0.10.2-jaxlib-0.10.2``."""
    return f"conformance-jax-{jax.__version__}-jaxlib-{jaxlib.__version__}"


def directory(asked: str | None, *, in_job: bool, isolated: bool, pytest_cache: Any) -> str | None:
    """Where a pytest run keeps the cache (``asked``: ``--compilation-cache``), or ``None``: off, a
    cache the user set, a run without pytest's cache provider (``pytest_cache``, its ``Cache``) and
    no directory asked for, a multi-process job, and Pallas kernels interpreted in the pytest process
    (not ``isolated``: their executables hold host callbacks, which JAX 0.6 to 0.10 does not write to
    a cache and JAX 0.12 does)."""
    if asked == "off" or in_job or not isolated:
        return None
    if asked:
        return str(Path(asked).expanduser().resolve() / folder_name())
    if set_by_user() or pytest_cache is None:
        return None
    return str(pytest_cache.mkdir(folder_name()))


def target_compile_dir(path: str) -> str:
    """Where the compiles for TPU and GPU topologies of a run with its cache in ``path`` are kept
    (:mod:`conformance.targets.target_compiles`): a folder of it."""
    return str(Path(path) / "target-compiles")


def interpret_outcome_dir(path: str) -> str:
    """Where the verdicts of the Pallas kernels' interpreted programs of a run with its cache in
    ``path`` are kept (:mod:`conformance.run.interpret_outcomes`): a folder of it."""
    return str(Path(path) / "interpret-outcomes")


def use(path: str) -> Callable[[], None]:
    """JAX's persistent compilation cache in ``path`` for this process (its compiles for the host's
    devices; see :func:`bypassed`); returns the closure that restores the settings
    before. Call it before the first compile."""
    from jax.experimental.compilation_cache import compilation_cache

    names = ["jax_compilation_cache_dir", *_CACHE_SETTINGS]
    before = {name: getattr(jax.config, name) for name in names}
    jax.config.update("jax_compilation_cache_dir", path)
    for name, value in _CACHE_SETTINGS.items():
        jax.config.update(name, value)
    compilation_cache.reset_cache()  # the next compile reads the settings afresh

    def undo() -> None:
        for name, value in before.items():
            jax.config.update(name, value)
        compilation_cache.reset_cache()

    return undo


@contextlib.contextmanager
def bypassed() -> Iterator[None]:
    """Compiles inside the block bypass JAX's persistent compilation cache: those for a TPU topology
    without a chip, whose executables the compile-only client can write but not read back
    ("PjRtCompiler must be constructed with a Client to call DeserializeLoadedExecutable", every
    libtpu from 0.0.17 to 0.0.50). JAX decides once per process whether the cache is used; the
    decision is reset on the way in and out."""
    if not jax.config.jax_compilation_cache_dir or not jax.config.jax_enable_compilation_cache:
        yield
        return
    from jax.experimental.compilation_cache import compilation_cache

    jax.config.update("jax_enable_compilation_cache", False)
    compilation_cache.reset_cache()
    try:
        yield
    finally:
        jax.config.update("jax_enable_compilation_cache", True)
        compilation_cache.reset_cache()
