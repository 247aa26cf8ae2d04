"""A ``--kernels`` entry that is a path to a ``.py`` file (``--kernels=./my_rings.py``): that file
imported as the module its name makes (``my_rings``), exactly that file, and named by its path again
in every replay line its kernels' failures print, so that the line works from any directory."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

#: The attribute of a module imported from a path that holds the path (:func:`kernels_argument`).
PATH_ATTRIBUTE = "__conformance_kernels_path__"


def is_path(entry: str) -> bool:
    """Whether a ``--kernels`` entry names a file rather than a module: it ends in ``.py`` or holds a
    directory separator."""
    return entry.endswith(".py") or os.sep in entry or bool(os.altsep and os.altsep in entry)


def import_path(entry: str) -> str:
    """Import the file ``entry`` names as the module of its stem; the module's name. ``ValueError``
    saying why where it is no such file, its name is no module name, or another module of that name
    is already imported (what the import itself raises goes through)."""
    path = Path(entry).expanduser().resolve()
    if not path.is_file():
        raise ValueError(
            f"{entry!r} is not a file ({path}); --kernels takes a module name (my_kernels, "
            "my_package.my_kernels) or a path to a .py file"
        )
    name = path.stem
    if path.suffix != ".py" or not name.isidentifier():
        raise ValueError(f"{entry!r}: {path.name!r} is not a Python module's file name (NAME.py)")
    loaded = sys.modules.get(name)
    if loaded is not None:
        if getattr(loaded, PATH_ATTRIBUTE, None) == str(path):
            return name
        raise ValueError(
            f"{entry!r}: a module named {name!r} is already imported (from "
            f"{getattr(loaded, '__file__', None) or 'a built-in'}); rename the file"
        )
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    setattr(module, PATH_ATTRIBUTE, str(path))
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return name


def kernels_argument(module: str) -> str:
    """What a replay line passes ``--kernels`` for ``module``: its file where it was imported from a
    path, else its name."""
    return getattr(sys.modules.get(module), PATH_ATTRIBUTE, None) or module
