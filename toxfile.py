"""tox plugin (loaded by tox from the project root): say how to get the Python an env needs.

``cpu-newest`` runs on Python 3.13, which the machine's default ``python3`` may not be. tox
alone reports only "could not find python interpreter"; this adds how to get one. The env
still fails: a skipped newest-JAX run would hide exactly what it exists to check.
"""

from __future__ import annotations

import logging
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
