"""tox plugin (loaded by tox from the project root): the Python an env needs, and its disk.

``cpu-newest`` runs on Python 3.13, which the machine's default ``python3`` may not be. tox
alone reports only "could not find python interpreter"; this adds how to get one. The env
still fails: a skipped newest-JAX run would hide exactly what it exists to check.

Every env installs its own JAX, jaxlib and libtpu: ten envs hold about 10 GB, 5.8 GB of it
byte-identical copies (cpu, cpu-wide, tpu-compile and selftest install the same wheels). Before
an env runs its commands, each installed file of 64 KiB or more that a sibling env holds with the
same bytes at the same place in its site-packages becomes a hard link to that copy, and the whole
set takes about 4 GB. pip unlinks a file before it writes one (an upgrade, a reinstall) and tox
removes a recreated env's directory, so no env ever writes through a link into another's files.
"""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path
from typing import Any

from tox.plugin import impl

_HOW_TO = """\
{env} needs {spec}, and none is visible to tox on PATH. {env} runs the newest JAX, whose \
wheels need a newer Python than many machines' default. Get one, then run tox again:
  - with pyenv: `pyenv install 3.13`, then, in this checkout, make it visible beside your
    default: `pyenv local "$(pyenv version-name)" 3.13.x` (it writes .python-version, which git
    ignores; .ci/run does this by itself);
  - with uv: `uv python install 3.13` and put its bin directory on PATH;
  - or your OS's python3.13 package.
This env fails rather than skips when the interpreter is missing."""


def _selected(name: str, state: Any) -> bool:
    chosen = state.conf.options.env
    return chosen.is_default_list or chosen.is_all or name in list(chosen)


@impl
def tox_add_env_config(env_conf: Any, state: Any) -> None:
    if env_conf.name != "cpu-newest" or not _selected(env_conf.name, state):
        return
    from virtualenv.discovery.builtin import get_interpreter

    specs = env_conf["base_python"]
    if not any(get_interpreter(spec, []) is not None for spec in specs):
        logging.getLogger("tox").error(_HOW_TO.format(env=env_conf.name, spec=" or ".join(specs)))


SHARED_MIN_BYTES = 1 << 16


def _site_packages(env_dir: Path) -> list[Path]:
    return sorted(env_dir.glob("lib/python3*/site-packages")) + sorted(env_dir.glob("Lib/site-packages"))


def _same_bytes(path: Path, other: Path) -> bool:
    with path.open("rb") as mine, other.open("rb") as theirs:
        while True:
            chunk = mine.read(1 << 20)
            if chunk != theirs.read(1 << 20):
                return False
            if not chunk:
                return True


def _link_in_place(source: Path, path: Path) -> bool:
    staged = path.with_name(path.name + ".tox-shared")
    try:
        os.link(source, staged)
        os.replace(staged, path)
    except OSError:
        staged.unlink(missing_ok=True)
        return False
    return True


def share_identical_files(env_dir: Path) -> tuple[int, int]:
    """Hard-link ``env_dir``'s large installed files to identical copies in its sibling envs.

    Returns the number of files linked and their bytes. A file already linked (more than one
    name) is left alone, so a repeat run only walks the tree; a file whose sibling copy differs
    in size, mode or bytes keeps its own copy.
    """
    siblings = [
        site
        for other in sorted(env_dir.parent.iterdir())
        if other != env_dir and other.is_dir()
        for site in _site_packages(other)
    ]
    linked = saved = 0
    for site in _site_packages(env_dir) if siblings else []:
        for root, _dirs, names in os.walk(site):
            for name in names:
                path = Path(root, name)
                try:
                    mine = path.lstat()
                except OSError:
                    continue
                if not stat.S_ISREG(mine.st_mode) or mine.st_size < SHARED_MIN_BYTES or mine.st_nlink > 1:
                    continue
                relative = path.relative_to(site)
                for other_site in siblings:
                    candidate = other_site / relative
                    try:
                        theirs = candidate.lstat()
                    except OSError:
                        continue
                    if (
                        stat.S_ISREG(theirs.st_mode)
                        and theirs.st_dev == mine.st_dev
                        and (theirs.st_size, theirs.st_mode) == (mine.st_size, mine.st_mode)
                        and _same_bytes(path, candidate)
                        and _link_in_place(candidate, path)
                    ):
                        linked += 1
                        saved += mine.st_size
                        break
    return linked, saved


@impl
def tox_before_run_commands(tox_env: Any) -> None:
    linked, saved = share_identical_files(Path(tox_env.env_dir))
    if linked:
        logging.getLogger("tox").warning(  # tox's log names the env at the start of the line
            "%d installed files (%.2f GB) now share one copy with a sibling env's by hard link",
            linked,
            saved / 1e9,
        )
