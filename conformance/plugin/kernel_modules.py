"""The kernels modules of ``--kernels`` (module names, or paths to ``.py`` files:
:mod:`conformance.kernel_paths`): imported before collection, so their registrations join the
run; one that does not import is a usage error saying what it raised, where in the user's code, and
for a module Python cannot find, where Python looks. The same for pytest and for ``python -m
conformance`` (:class:`KernelsModuleError`, which each turns into its own usage error)."""

from __future__ import annotations

import importlib
import os
import sys
import traceback

import pytest

from conformance import kernel_paths


def kernel_modules(config: pytest.Config) -> list[str]:
    """The modules ``--kernels`` names (comma-separated, the option repeatable)."""
    return split_modules(config.getoption("kernels"))


def split_modules(options: list[str]) -> list[str]:
    """The module names of repeated ``--kernels=A,B`` options, in order."""
    return [m.strip() for opt in options for m in opt.split(",") if m.strip()]


class KernelsModuleError(Exception):
    """A ``--kernels`` module that does not import; the message is the usage error (:func:`import_error`)."""


def import_modules(modules: list[str]) -> None:
    """Import each of ``modules``, from ``sys.path`` and then the current directory (the ``pytest``
    command, unlike ``python -m pytest``, does not put it on the path); :class:`KernelsModuleError`
    (:func:`import_error`) at the first that raises anything: an ImportError, its own SyntaxError, a
    ``register`` call it makes badly."""
    for module in modules:
        if kernel_paths.is_path(module):
            try:
                kernel_paths.import_path(module)
            except ValueError as e:
                raise KernelsModuleError(f"--kernels: {e}") from e
            except Exception as e:
                raise KernelsModuleError(import_error(module, e)) from e
            continue
        try:
            try:
                importlib.import_module(module)
            except ModuleNotFoundError as e:
                if not (e.name and module.startswith(e.name)) or os.getcwd() in sys.path:
                    raise
                sys.path.append(os.getcwd())
                importlib.import_module(module)
        except Exception as e:
            raise KernelsModuleError(import_error(module, e)) from e
        imported = sys.modules[module]
        if getattr(imported, "__file__", None) is None and hasattr(imported, "__path__"):
            raise KernelsModuleError(namespace_error(module, list(imported.__path__)))


def namespace_error(module: str, folders: list[str]) -> str:
    """The usage error of a ``--kernels`` name that Python found as a folder without ``__init__.py`` (a
    namespace package: importing it runs nothing, so it registers no kernel), naming the modules in it."""
    inside = sorted(
        os.path.join(folder, name)
        for folder in folders
        for name in os.listdir(folder)
        if name.endswith(".py")
    )
    hint = (
        f"; the module is likely {inside[0]}: run from {os.path.dirname(inside[0])} or give its path, "
        f"--kernels={os.path.relpath(inside[0])}"
        if inside
        else ""
    )
    return (
        f"--kernels: {module!r} is the folder {', '.join(folders)}, which has no __init__.py: Python imports "
        f"it as an empty namespace package, which registers no kernel{hint}"
    )


def import_error(module: str, error: BaseException) -> str:
    """The usage error of a ``--kernels`` module that does not import: what it raised, where in the
    user's code, and for a module not found, how Python looks for it."""
    if isinstance(error, ModuleNotFoundError) and error.name and module.startswith(error.name):
        return (
            f"--kernels: cannot import {module!r}: {error}. It is imported by name, from sys.path and the "
            f"current directory ({os.getcwd()}): run the command from the directory that holds it, put that "
            "directory on PYTHONPATH, install the package that holds it, or give the path to its .py file"
        )
    where = ""
    if isinstance(error, SyntaxError) and error.filename:
        where = f" ({error.filename}:{error.lineno})"
    else:
        suite = tuple(
            os.path.dirname(conformance_package.__file__) for conformance_package in _suite_packages()
        )
        frames = [
            f
            for f in traceback.extract_tb(error.__traceback__)
            if "importlib" not in f.filename and not f.filename.startswith(suite)
        ]
        if frames:  # the user's line, not the suite's that raised for it
            where = f" ({frames[-1].filename}:{frames[-1].lineno})"
    return f"--kernels: importing {module!r} raised {type(error).__name__}{where}: {error}"


def _suite_packages() -> list[object]:
    import conformance
    import conformance.kernels

    return [conformance, conformance.kernels]
