"""What a compile for a TPU or GPU topology gave, kept so that no program is compiled for a target
twice: across a run's pytest-xdist workers, and across runs.

JAX's persistent compilation cache cannot hold these compiles (a compile-only client's executable
cannot be read back), and they are most of the suite's compile time: the TPU compile tier compiles
every kernel and its baseline for slices of 8 to 256 chips at three sizes. What the checks read of
such a compile is small and plain: the scheduled module's text and the memory figures
(``Compiled.memory_analysis()``), or the compiler's refusal. :func:`compile_lowered` keeps exactly
that, in memory and, where the run has a directory for it (:attr:`conformance.session.Session.
target_compile_dir`, beside JAX's compilation cache), as one JSON file per compile.

The key is everything the compiler is given: the lowered module with its debug info (locations
name the kernel's lines in the compiled module's metadata), the devices it is assigned to in mesh
order (a permuted device order is another program for the compiler), the compiler and its
version, the compile options, and the environment variables the compilers read flags from
(``XLA_FLAGS``, ``LIBTPU_INIT_ARGS``). A file is JSON, read back as numbers and text, never
unpickled.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import jax
import jaxlib

from conformance import session as session_lib

#: The environment variables XLA and libtpu read compiler flags from: part of every key.
FLAG_VARIABLES = ("XLA_FLAGS", "LIBTPU_INIT_ARGS")
#: ``Compiled.memory_analysis()``'s fields the checks read (``peak_memory_in_bytes`` is absent in
#: jaxlib 0.6.2, and stays ``None`` here).
MEMORY_FIELDS = (
    "peak_memory_in_bytes",
    "temp_size_in_bytes",
    "generated_code_size_in_bytes",
    "argument_size_in_bytes",
    "output_size_in_bytes",
    "alias_size_in_bytes",
)
#: Bumped when what a file holds changes.
FORMAT = 1


@dataclasses.dataclass(frozen=True)
class MemoryStats:
    """The memory figures of a compiled program (``None``: the compiler reported none)."""

    peak_memory_in_bytes: int | None = None
    temp_size_in_bytes: int = 0
    generated_code_size_in_bytes: int = 0
    argument_size_in_bytes: int = 0
    output_size_in_bytes: int = 0
    alias_size_in_bytes: int = 0

    @classmethod
    def of(cls, stats: Any) -> MemoryStats | None:
        if stats is None:
            return None
        values = {name: getattr(stats, name, None) for name in MEMORY_FIELDS}
        peak = values.pop("peak_memory_in_bytes")
        return cls(
            peak_memory_in_bytes=None if peak is None else int(peak),
            **{name: int(value or 0) for name, value in values.items()},
        )


@dataclasses.dataclass(frozen=True)
class TargetCompile:
    """A program compiled for a target: what the checks read of a ``jax.stages.Compiled``."""

    text: str | None  #: the compiled module (``None``: this jaxlib gives no text for the target)
    memory: MemoryStats | None
    seconds: float  #: how long the compile took where it was made
    from_store: bool = False  #: read back, not compiled in this process

    def as_text(self) -> str | None:
        return self.text

    def memory_analysis(self) -> MemoryStats | None:
        return self.memory


class Refused(Exception):
    """The compiler refused the program; the message is its own, as first compiled (and kept)."""


def key_of(lowered: Any, *, compiler: str, options: dict[str, Any] | None, devices: list[int]) -> str:
    """The key of compiling ``lowered`` with ``compiler`` (its name and version) and ``options`` for
    ``devices`` (their ids, in mesh order)."""
    text = lowered.compiler_ir("stablehlo").operation.get_asm(enable_debug_info=True)
    parts = [
        f"format={FORMAT}",
        f"jax={jax.__version__} jaxlib={jaxlib.__version__}",
        f"compiler={compiler}",
        f"options={sorted((options or {}).items())!r}",
        *(f"{name}={os.environ.get(name, '')}" for name in FLAG_VARIABLES),
        f"devices={devices}",
        text,
    ]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def device_ids(args: Any) -> list[int]:
    """The ids of the devices a program of ``args`` (shape-dtype structs with shardings) is assigned
    to, in mesh order."""
    for arg in jax.tree_util.tree_leaves(args):
        mesh = getattr(getattr(arg, "sharding", None), "mesh", None)
        if mesh is not None:
            return [int(d.id) for d in mesh.devices.flat]
    return []


#: In this process: key -> a compile or a refusal's message.
_MEMORY: dict[str, TargetCompile | str] = {}


def compile_lowered(
    lowered: Any, *, compiler: str, devices: list[int], options: dict[str, Any] | None = None
) -> TargetCompile:
    """``lowered.compile(compiler_options=options)`` as a :class:`TargetCompile`, or the one kept from
    an earlier compile of the same program for the same ``devices``; :class:`Refused` with the
    compiler's words where it refuses (a refusal is kept too)."""
    key = key_of(lowered, compiler=compiler, options=options, devices=devices)
    kept = _MEMORY.get(key)
    if kept is None:
        kept = _read(key)
        if kept is not None:
            _MEMORY[key] = kept
    if kept is None:
        started = time.monotonic()
        try:
            compiled = lowered.compile(compiler_options=options) if options else lowered.compile()
        except Exception as e:  # the compiler's refusal, whatever its exception type
            kept = f"{type(e).__name__}: {e}"
        else:
            kept = TargetCompile(
                compiled.as_text(), MemoryStats.of(compiled.memory_analysis()), time.monotonic() - started
            )
        _MEMORY[key] = kept
        _write(key, kept)
    if isinstance(kept, str):
        raise Refused(kept)
    return kept


def _directory() -> Path | None:
    found = session_lib.current().target_compile_dir
    return Path(found) if found else None


def _read(key: str) -> TargetCompile | str | None:
    folder = _directory()
    if folder is None:
        return None
    try:
        document = json.loads((folder / f"{key}.json").read_text())
    except (OSError, ValueError):
        return None  # none kept, or a file another process is writing: compile
    if document.get("format") != FORMAT:
        return None
    if "refused" in document:
        return str(document["refused"])
    memory = document.get("memory")
    return TargetCompile(
        document.get("text"),
        MemoryStats(**memory) if memory is not None else None,
        float(document.get("seconds", 0.0)),
        from_store=True,
    )


def _write(key: str, kept: TargetCompile | str) -> None:
    folder = _directory()
    if folder is None:
        return
    if isinstance(kept, str):
        document: dict[str, Any] = {"format": FORMAT, "refused": kept}
    else:
        memory = dataclasses.asdict(kept.memory) if kept.memory is not None else None
        document = {"format": FORMAT, "text": kept.text, "memory": memory, "seconds": kept.seconds}
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=folder, suffix=".tmp", delete=False) as f:
        json.dump(document, f)
    os.replace(f.name, folder / f"{key}.json")  # whole or absent for a reader in another process
