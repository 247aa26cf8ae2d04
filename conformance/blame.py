"""Whose code an error or a hang is in: the kernel's, a library's (JAX, jaxlib, numpy) or the suite's.

Failure messages name the innermost frame of the kernel's own code (and, when a library raised,
the library's frame); a hung kernel's threads are named by where they are stuck, from live stacks
or from a ``faulthandler`` dump a stopped worker process wrote.
"""

from __future__ import annotations

import os
import re
import sysconfig
import traceback
from collections.abc import Sequence

import jax
import jaxlib
import numpy as np

import conformance
from conformance import compat, fixtures


def error_text(error: BaseException, head: int = 4, tail: int = 16) -> str:
    """An exception's message, long tracebacks cut to their first and last lines (the cause)."""
    lines = [line for line in str(error).splitlines() if line.strip()]
    if len(lines) > head + tail:
        lines = [*lines[:head], f"... ({len(lines) - head - tail} lines omitted) ...", *lines[-tail:]]
    return f"{type(error).__name__}: " + "\n    ".join(lines)


def _roots(*modules: object) -> tuple[str, ...]:
    return tuple(os.path.dirname(os.path.abspath(m.__file__)) + os.sep for m in modules)


#: Where a frame's file lies decides whose code it is.
_LIBRARY_ROOTS = _roots(jax, jaxlib, np)
_SUITE_ROOTS = _roots(conformance, fixtures)
#: The suite's own test kernels (broken and other-style ones) are kernel code, not the suite's.
_KERNEL_ROOTS_IN_SUITE = (os.path.join(_SUITE_ROOTS[0], "selftest") + os.sep,)
#: Python's own library (not the site-packages inside it, where a user's kernels may be installed).
_STDLIB_ROOT = sysconfig.get_paths()["stdlib"] + os.sep
_SITE_ROOTS = tuple({sysconfig.get_paths()[k] + os.sep for k in ("purelib", "platlib")})


def _whose(filename: str) -> str:
    path = os.path.abspath(filename)
    if path.startswith(_LIBRARY_ROOTS):
        return "library"
    if path.startswith(_SUITE_ROOTS) and not path.startswith(_KERNEL_ROOTS_IN_SUITE):
        return "suite"
    if path.startswith(_STDLIB_ROOT) and not path.startswith(_SITE_ROOTS):
        return "suite"  # threading, functools, ...: neither the kernel's code nor the raiser's
    return "kernel"


def is_library_frame(frame: traceback.FrameSummary) -> bool:
    """Whether ``frame`` is in a library the kernel calls (JAX, jaxlib, numpy)."""
    return _whose(frame.filename) == "library"


def error_locations(error: BaseException) -> list[str]:
    """Where ``error`` was raised: the innermost frame of the kernel's own code and, if a library
    (JAX, jaxlib, numpy) raised it, the innermost frame of that library."""
    frames = traceback.extract_tb(error.__traceback__)
    lines = []
    kernel = [f for f in frames if _whose(f.filename) == "kernel"]
    if frames and _whose(frames[-1].filename) == "library":
        raiser = frames[-1]
        lines.append(
            f"raised in      : {frame_text(raiser)} (inside {raiser.filename.split(os.sep)[-1]!r}, "
            "a library the kernel called)"
        )
    if kernel:
        lines.append(f"kernel's code  : {frame_text(kernel[-1])}")
    else:  # raised while JAX ran the traced kernel (e.g. Pallas interpret mode): the op's own line
        interpreted = compat.interpreted_op_source(error)
        where, raised = getattr(error, "raised_in_interpreted_op", (None, None))
        if interpreted:
            lines.append(f"kernel's code  : {interpreted} (the traced op being run when it raised)")
        elif where:  # a callback of TPU interpret mode raised: its op's line, and what it raised
            lines.append(f"kernel's code  : {where} (the op TPU interpret mode was running: {raised[:300]})")
    return lines


def stuck_locations(stacks: Sequence[traceback.StackSummary]) -> tuple[bool, list[str]]:
    """Where hung threads are: each one's innermost frame of kernel code, else of JAX (threads in
    neither, e.g. idle timers, are left out); identical places are counted, not repeated.

    Returns whether any thread is stuck in the kernel's own code, and the lines.
    """
    places: dict[str, int] = {}
    in_kernel = False
    for stack in stacks:
        kernel = [f for f in stack if _whose(f.filename) == "kernel"]
        library = [f for f in stack if _whose(f.filename) == "library"]
        if kernel:
            in_kernel = True
            place = f"kernel's code  : {frame_text(kernel[-1])}"
        elif library:
            place = f"inside JAX     : {frame_text(library[-1])}"
        else:
            continue
        places[place] = places.get(place, 0) + 1
    return in_kernel, [f"{p}  ({n} thread{'s' * (n > 1)})" for p, n in places.items()]


#: faulthandler's dump of one thread: a header, then its frames, innermost first.
_DUMP_HEADER = re.compile(r"^(?:Current thread|Thread) 0x[0-9a-fA-F]+.*\(most recent call first\):$")
_DUMP_FRAME = re.compile(r'^  File "(?P<file>.*)", line (?P<line>\d+|\?\?\?) in (?P<name>.+)$')
_DUMP_OTHER = ("  <no Python frame>", "  ...")


def stacks_from_dump(text: str) -> list[traceback.StackSummary]:
    """The threads' stacks in a ``faulthandler`` dump inside ``text`` (other lines around it are
    left alone), outermost frame first like :func:`traceback.extract_stack`.

    A line inside a thread's block that is not a frame raises, naming it: a dump in a form this
    parser does not know is never read as "no frames".
    """
    stacks: list[traceback.StackSummary] = []
    frames: list[traceback.FrameSummary] | None = None
    for line in text.splitlines():
        if _DUMP_HEADER.match(line.strip()):
            frames = []
            stacks.append(traceback.StackSummary())
            continue
        if frames is None:
            continue
        if not line.startswith("  "):  # the block ended
            stacks[-1] = traceback.StackSummary.from_list(frames[::-1])
            frames = None
            continue
        match = _DUMP_FRAME.match(line.rstrip())
        if match:
            lineno = int(match["line"]) if match["line"].isdigit() else None
            frames.append(traceback.FrameSummary(match["file"], lineno, match["name"]))
        elif line.rstrip() not in _DUMP_OTHER:
            raise ValueError(f"a faulthandler stack dump line in a form this suite does not know: {line!r}")
    if frames is not None:
        stacks[-1] = traceback.StackSummary.from_list(frames[::-1])
    return stacks


def frame_text(frame: traceback.FrameSummary) -> str:
    path = os.path.abspath(frame.filename)
    # JAX's files as jax/..., the user's relative to where they run (a library's parent, the cwd itself)
    for root in (*(os.path.dirname(r.rstrip(os.sep)) + os.sep for r in _LIBRARY_ROOTS), os.getcwd() + os.sep):
        if path.startswith(root):
            path = path[len(root) :]
            break
    code = f": {frame.line.strip()}" if frame.line else ""
    return f"{path}:{frame.lineno} in {frame.name}{code}"
