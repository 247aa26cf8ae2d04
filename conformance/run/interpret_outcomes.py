"""What a Pallas kernel's checks in TPU interpret mode said, kept so that a repeat run does not
interpret an unchanged program again.

Interpret mode runs every DMA, load, store and semaphore of a kernel as a host callback on every
simulated device (1-3 s a case, its compile most of it), and JAX's compilation cache holds none of
it: a repeat run of a
Pallas kernel took as long as the first. The worker process (:mod:`conformance.run.check_worker`)
keeps each verdict of the checks below in a folder beside the compilation cache, under a key of
everything the verdict is a function of:

* the check and the case (its token: mesh, dims, dtype, seed, DMA mode; and the platform), and what
  the kernel's registration declares beside its code (its targets, dtypes, gradients);
* the program the check runs, as traced at the case's operands: the jaxpr of the kernel's forward
  pass (and, for the checks of the backward, of its VJP; for the other reductions, of each call with
  ``reduction=``), with the bytes of its constants. It holds
  the kernel's own code, what it closes over that reaches the program, and the interpret parameters,
  so that any edit of the kernel that changes what runs changes the key;
* the suite's own source and the jax, jaxlib, libtpu and hypothesis versions
  (:func:`conformance.reports.provenance.source_digest`), the options that decide a verdict, and the
  environment variables the compilers read flags from.

Kept: a pass or a failure as the worker sends it (JSON, never unpickled). Never kept: a skip, a
host's limit, a hang or a timeout, which say something of the host and not of the program. A check
that runs another program than these (bad inputs at an indivisible shape, the eager path) is not
kept, nor a check whose program does not trace. ``--compilation-cache=off`` keeps nothing.

The limit: a kernel whose result varies between runs of one program (a race the detector misses)
keeps the verdict of its first run until its code changes; CI's runs start from an empty folder.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from conformance import runner
from conformance.checks import reductions
from conformance.reports import provenance
from conformance.runner import Case
from conformance.session import Settings
from conformance.targets import target_compiles

#: The checks whose verdict is kept, and the program each runs: the forward pass, or its VJP too.
KEPT_CHECKS = {
    "values": "forward",
    "output_sharding": "forward",
    "dtype": "forward",
    "determinism": "forward",
    "races": "forward",
    "tpu_native_values": "forward",
    "dma_direction_balance": "forward",
    "accuracy": "forward",
    "gradients": "backward",
    "backward_accuracy": "backward",
    "other_reductions": "reductions",
    # what reads the modules of the same programs: the CPU compile of the interpreted program (its
    # lowering and compile cost more than its run) and the lowerings for the kernel's targets
    "collectives": "forward",
    "cross_lowering": "forward",
    "backward_collectives": "backward",
}
#: The verdicts kept.
KEPT_VERDICTS = ("passed", "failed")
#: Bumped when what a file holds, or what the key is made of, changes.
FORMAT = 1
#: What a verdict read back is, in the test's JUnit properties and the run's closing lines.
READ_BACK_NOTE = "read back from an earlier run of the same interpreted program"


def _program_text(traced: Any) -> bytes:
    closed = traced.jaxpr
    parts = [str(closed).encode()]
    for const in getattr(closed, "consts", ()):
        try:
            parts.append(np.asarray(const).tobytes())
        except (TypeError, ValueError):  # an opaque constant: its text stands for it
            parts.append(repr(const).encode())
    return b"\n".join(parts)


def _declaration(case: Case) -> str:
    """What the kernel's registration declares beside its code (targets, dtypes, gradients, the
    direction of its ring...): a verdict turns on it, and it is in no traced program."""
    implementation = case.implementation

    def plain(value: Any) -> bool:  # no object whose text names its address, no code (the jaxpr's)
        if isinstance(value, (tuple, list)):
            return all(map(plain, value))
        return value is None or isinstance(value, (str, int, float, bool))

    return repr(
        [
            (field.name, value)
            for field in dataclasses.fields(implementation)
            if plain(value := getattr(implementation, field.name))
        ]
    )


def key_of(check: str, case: Case, settings: Settings) -> str | None:
    """The key of ``check``'s verdict on ``case``, or ``None`` where it is not kept (another check, or a
    program that does not trace: the check then runs and says why)."""
    program = KEPT_CHECKS.get(check)
    if program is None or not isinstance(case, Case):
        return None
    try:
        texts = [_program_text(runner.jitted_for(case).trace(*runner.abstract_args(case)))]
        if program == "backward":
            pullback = runner.jitted_pullback(case)
            texts.append(_program_text(pullback.trace(*runner.abstract_pullback_args(case))))
        if program == "reductions":  # each reduction the kernel declares is a program of its own
            for reduction in case.implementation.other_reductions:
                jitted = reductions.reduction_jitted(case, reduction)
                texts.append(_program_text(jitted.trace(*runner.abstract_args(case))))
    except Exception:  # the check itself traces it again and gives the verdict on whatever it raised
        return None
    digest = hashlib.sha256()
    for part in (
        f"format={FORMAT}",
        f"suite={provenance.source_digest()}",
        f"check={check} platform={case.platform} family={case.family} impl={case.impl}",
        f"case={case.token}",
        f"declared={_declaration(case)}",
        f"options={settings.verdict_options()}",
        *(f"{name}={os.environ.get(name, '')}" for name in target_compiles.FLAG_VARIABLES),
    ):
        digest.update(part.encode() + b"\n")
    for text in texts:
        digest.update(text)
    return digest.hexdigest()


class Store:
    """The folder of kept verdicts: one JSON file per key, written whole or not at all."""

    def __init__(self, folder: str | os.PathLike[str]) -> None:
        self.folder = Path(folder)
        self.read_back = 0

    def read(self, key: str) -> dict[str, Any] | None:
        try:
            document = json.loads((self.folder / f"{key}.json").read_text())
        except (OSError, ValueError):
            return None  # none kept, or one another process is writing: run the check
        if document.get("format") != FORMAT or document.get("answer", {}).get("outcome") not in KEPT_VERDICTS:
            return None
        self.read_back += 1
        return dict(document["answer"])

    def write(self, key: str, answer: dict[str, Any]) -> None:
        if answer.get("outcome") not in KEPT_VERDICTS or answer.get("hung"):
            return
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile("w", dir=self.folder, suffix=".tmp", delete=False) as f:
                json.dump({"format": FORMAT, "answer": answer}, f)
            os.replace(f.name, self.folder / f"{key}.json")
        except OSError:  # a full or read-only disk: the verdict stands, it is only not kept
            return
