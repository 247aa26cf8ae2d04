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
import functools
import hashlib
import importlib
import json
import os
import tempfile
import threading
import time
from collections.abc import Callable
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
    #: The flags it was compiled under (:func:`flags_in_effect`).
    flags: str = "compiler defaults"

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


def devices_text(args: Any) -> str:
    """The devices arguments are sharded on, for messages: ``8 TPU v5 lite (mesh x=4, y=2)``."""
    for arg in jax.tree.leaves(args):
        mesh = getattr(getattr(arg, "sharding", None), "mesh", None)
        if mesh is not None:
            kinds = sorted({d.device_kind for d in mesh.devices.flat})
            shape = ", ".join(f"{n}={s}" for n, s in mesh.shape.items())
            return f"{mesh.devices.size} {'/'.join(kinds)} (mesh {shape})"
    return "its devices"


def typed_value(value: str) -> bool | int | float | str:
    """A compile option's value as XLA takes it through ``compiler_options``: ``true``/``false`` a
    bool, a number an int or float, anything else the text ("'true' is not a valid bool value"
    otherwise)."""
    if value.lower() in ("true", "false"):
        return value.lower() == "true"
    for kind in (int, float):
        try:
            return kind(value)
        except ValueError:
            continue
    return value


def parse_options(given: list[str] | tuple[str, ...]) -> tuple[tuple[str, bool | int | float | str], ...]:
    """``--compiler-option`` values (``NAME=VALUE``) as (name, typed value) pairs (:func:`typed_value`);
    ``ValueError`` naming a value that is not of that form."""
    pairs = []
    for item in given:
        name, sep, value = item.partition("=")
        if not sep or not name.strip() or not value.strip() or " " in name.strip():
            raise ValueError(
                f"--compiler-option {item!r} is not NAME=VALUE (e.g. xla_gpu_dot_merger_threshold_mb=0)"
            )
        pairs.append((name.strip(), typed_value(value.strip())))
    return tuple(pairs)


#: The suite's own flag (simulated CPU devices), which no TPU or GPU compile reads.
_OWN_FLAG = "--xla_force_host_platform_device_count"


def flags_in_effect(options: dict[str, Any] | None) -> str:
    """The flags a compile ran under, as a verdict quotes them: the environment variables XLA and
    libtpu read (less the suite's own CPU device count) and the compile options, or
    ``compiler defaults``."""
    parts = []
    for name in FLAG_VARIABLES:
        flags = [f for f in os.environ.get(name, "").split() if not f.startswith(_OWN_FLAG)]
        if flags:
            parts.append(f"{name}={' '.join(flags)!r}")
    parts += [f"{name}={value}" for name, value in sorted((options or {}).items())]
    return ", ".join(parts) or "compiler defaults"


def probe_option(compiler: Any, name: str, value: object) -> str | None:
    """What ``compiler`` (:mod:`~conformance.targets.tpu_compiler` or
    :mod:`~conformance.targets.gpu_compiler`) says
    to compile option ``name=value`` on a one-device program: ``None`` if it takes it, else its
    words ("No such compile option" where it does not know the name)."""
    device = compiler.topology_devices(compiler.topology_for(8))[0]
    arg = jax.ShapeDtypeStruct((8, 128), "float32", sharding=jax.sharding.SingleDeviceSharding(device))
    from conformance.targets import compilation_cache

    try:
        with compilation_cache.bypassed():
            jax.jit(lambda x: x + 1).lower(arg).compile(compiler_options={name: value})
    except Exception as e:  # XlaRuntimeError or JaxRuntimeError, by version
        return f"{type(e).__name__}: {str(e).strip().splitlines()[0]}"
    return None


@functools.cache
def _knows(compiler_module: str, name: str, value: object) -> bool:
    said = probe_option(importlib.import_module(compiler_module), name, value)
    return said is None or "No such compile option" not in said


def user_options(compiler: Any) -> dict[str, object]:
    """The run's ``--compiler-option`` pairs (:attr:`conformance.session.Settings.compiler_options`)
    that ``compiler`` knows: an option for XLA:TPU is not given to XLA:GPU."""
    pairs = session_lib.current().settings.compiler_options
    return {name: value for name, value in pairs if _knows(compiler.__name__, name, value)}


def check_user_options(pairs: tuple[tuple[str, object], ...], compilers: list[Any]) -> str | None:
    """``None`` if each option of ``pairs`` is taken by one of the available ``compilers``, else why
    not, quoting each compiler: a usage error, found before any check runs (``None`` with no
    compilers to ask: a pytest-xdist worker leaves it to the controller)."""
    if not pairs or not compilers:
        return None
    available = [c for c in compilers if c.available()]
    if pairs and not available:
        names = ", ".join(f"{n}={v}" for n, v in pairs)
        return f"--compiler-option {names}: no TPU or GPU compiler is installed here to take it"
    for name, value in pairs:
        said = {c.NAME: probe_option(c, name, value) for c in available}
        if any(words is None for words in said.values()):
            continue
        quoted = "; ".join(f"{compiler}: {words}" for compiler, words in said.items())
        return f"--compiler-option {name}={value} is refused by every compiler here ({quoted})"
    return None


class UnknownOption(Exception):
    """An option the user gave (``--compiler-option``) that the compiler does not know; the message
    quotes the compiler."""


def compile_lowered(
    lowered: Any, *, compiler: str, devices: list[int], options: dict[str, Any] | None = None
) -> TargetCompile:
    """``lowered.compile(compiler_options=options)`` as a :class:`TargetCompile`, or the one kept from
    an earlier compile of the same program for the same ``devices`` (this session's, else one kept on
    disk); :class:`Refused` with the
    compiler's words where it refuses (a refusal is kept too). The compile's :attr:`~TargetCompile.
    flags` say which flags it ran under."""
    key = key_of(lowered, compiler=compiler, options=options, devices=devices)
    session = session_lib.current()
    memory: dict[str, TargetCompile | str | CompileTimeout] = session.target_compiles
    kept = memory.get(key)
    if kept is None:
        kept = _read(key)
        if kept is not None:
            memory[key] = kept
    if kept is None:
        started = time.monotonic()
        try:
            compiled = _bounded(
                lambda: lowered.compile(compiler_options=options) if options else lowered.compile()
            )
        except CompileTimeout as timeout:
            timeout.compiler = compiler
            memory[key] = timeout  # this run does not try the same program again; another run does
            session.abandoned_compiles.append(f"a compile by {compiler}, past {timeout.seconds:g} s")
            raise
        except Exception as e:  # the compiler's refusal, whatever its exception type
            kept = f"{type(e).__name__}: {e}"
        else:
            kept = TargetCompile(
                compiled.as_text(), MemoryStats.of(compiled.memory_analysis()), time.monotonic() - started
            )
        memory[key] = kept
        _write(key, kept)
    if isinstance(kept, CompileTimeout):
        raise CompileTimeout(kept.seconds, kept.compiler, again=True)
    if isinstance(kept, str):
        raise Refused(kept)
    return dataclasses.replace(kept, flags=flags_in_effect(options))


class CompileTimeout(Exception):
    """A compile for a TPU or GPU topology that did not finish within the run's ``compile_timeout_s``
    (``--compile-timeout``): given up, its thread left to finish or not (a daemon: it does not hold the
    exit, and :func:`conformance.plugin.job_ranks.exit_past_abandoned_calls` ends the process past it)."""

    def __init__(self, seconds: float, compiler: str = "", *, again: bool = False) -> None:
        self.seconds, self.compiler, self.again = seconds, compiler, again
        #: The devices compiled for (:func:`devices_text`), where the caller knows them.
        self.where = ""
        super().__init__(self.describe())

    def describe(self) -> str:
        by = f" by {self.compiler}" if self.compiler else ""
        by += f" for {self.where}" if self.where else ""
        if self.again:
            return (
                f"not compiled again{by}: the same program outran --compile-timeout={self.seconds:g}s "
                "earlier in this run"
            )
        return f"the compile{by} did not finish within --compile-timeout={self.seconds:g}s; abandoned"

    def __str__(self) -> str:
        return self.describe()


def _bounded(compile_it: Callable[[], Any]) -> Any:
    """``compile_it()`` on a daemon thread, waited for at most the run's ``compile_timeout_s``."""
    seconds = session_lib.current().settings.compile_timeout_s
    done: dict[str, Any] = {}

    def run() -> None:
        try:
            done["value"] = compile_it()
        except BaseException as e:  # handed to the caller's thread
            done["error"] = e

    thread = threading.Thread(target=run, name="conformance-target-compile", daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        raise CompileTimeout(seconds)
    if "error" in done:
        raise done["error"]
    return done["value"]


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
