"""The plugin's options: what ``pytest --help`` lists under "collective-kernel conformance", and the
usage errors a run is refused with before it starts (a report path it could not write at its end, a
compile tier ``-m`` asks for that cannot run on this host). The options themselves are described in
:mod:`conformance.plugin`."""

from __future__ import annotations

import os
import re

import pytest

from conformance.fixtures import devices as devices_lib
from conformance.fixtures import meshes
from conformance.reports import results
from conformance.session import (
    BEHIND_COMPILER_MODES,
    ISOLATION_MODES,
    SCHEDULE_VERDICTS,
    TIME_BOUNDS,
    Settings,
)
from conformance.targets import compilation_cache, gpu_compiler, tpu_compiler


def add_options(parser: pytest.Parser) -> None:
    """The suite's options, in their own group of ``pytest --help``."""
    group = parser.getgroup("conformance", "collective-kernel conformance")
    group.addoption(
        "--kernels",
        action="append",
        default=[],
        metavar="MODULE[,MODULE...]",
        help="import these modules so their conformance.register calls join the run",
    )
    for field, what in TIME_BOUNDS.items():
        flag = "--" + field.removesuffix("_s").replace("_", "-")
        group.addoption(flag, type=float, default=getattr(Settings, field), metavar="SECONDS", help=what)
    group.addoption(
        "--isolation",
        choices=ISOLATION_MODES,
        default=Settings.isolation,
        help="process (default): check Pallas kernels on CPU in a worker process that can "
        "be stopped whatever hangs; off: in this process",
    )
    group.addoption(
        "--compiler-option",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a compiler option for every compile for a TPU or GPU topology whose compiler knows it "
        "(e.g. xla_tpu_all_gather_collective_matmul_mode=post_spmd), beside XLA_FLAGS and "
        "LIBTPU_INIT_ARGS; recorded with each verdict; one no available compiler knows is a usage error",
    )
    group.addoption(
        "--behind-compiler",
        choices=BEHIND_COMPILER_MODES,
        default=Settings.behind_compiler,
        help="report (default): the schedule tables say where a kernel leaves more bytes exposed than "
        "the compiler's own collective matmul; fail: the schedule checks fail it there",
    )
    group.addoption(
        "--schedule-verdict",
        choices=SCHEDULE_VERDICTS,
        default=Settings.schedule_verdict,
        help="compiler (default): a kernel whose compiled schedule leaves transfers exposed fails only "
        "where it also leaves more bytes exposed than the compiler's own collective matmul (level or "
        "ahead is no worse than not writing it); hidden: it fails wherever a transfer it could hide is "
        "exposed",
    )
    group.addoption(
        "--compilation-cache",
        default=os.environ.get(compilation_cache.DIR_VARIABLE),
        metavar="DIR|off",
        help="JAX's persistent compilation cache for the suite's compiles on this host, read back by "
        "a repeat run, in a folder per JAX and jaxlib version of DIR (default: "
        f"${compilation_cache.DIR_VARIABLE}, else pytest's cache directory; a cache the user set, "
        "JAX_COMPILATION_CACHE_DIR, is left as it is); off: none",
    )
    group.addoption(
        "--bench-sizes",
        default="4K:256K:4",
        metavar="BEGIN:END:FACTOR",
        help="-m benchmark: the ladder of one device's input shard sizes in bytes, as "
        "nccl-tests' -b/-e/-f (K, M suffixes)",
    )
    group.addoption(
        "--bench-meshes",
        default="2-x-auto,4-x-auto,8-x-auto,2x4-y-auto,4x2-y-auto",
        metavar="LABEL[,LABEL...]",
        help="-m benchmark: the meshes to time on",
    )
    group.addoption(
        "--bench-rounds",
        type=int,
        default=5,
        metavar="N",
        help="-m benchmark: timed calls per case after a warm-up (median reported)",
    )
    group.addoption(
        "--meshes",
        default=None,
        metavar="LABEL[,LABEL...]",
        help="run the tests over standard meshes on these meshes instead: any the run's devices hold, "
        "e.g. 6-x-auto,2x2x2-z-explicit,8-x-explicit-reversed (SHAPE-AXIS-TYPE[-ORDER]); a check's "
        "own meshes (the compile tiers' rings) and tests without a mesh all run",
    )
    group.addoption(
        "--mesh-cover",
        default=None,
        choices=meshes.MESH_COVERS,
        help="run one part of the run: quick, each test's cases on the meshes of the quick cover (a ring "
        "of one, an odd ring, a 2-D mesh in a v5e slice's order, a 3-D mesh; tests without a CPU mesh and "
        "the compile tiers' rings go with it: tox -e cpu), or rest, its cases on every other mesh "
        "(tox -e cpu-wide); the two parts together are the whole run",
    )
    group.addoption(
        "--impl",
        default=None,
        metavar="GLOB[,GLOB...]",
        help="run only implementations whose names match one of these globs",
    )
    group.addoption(
        "--xfails-file",
        default=None,
        metavar="FILE",
        help="known failures: a test id or glob per line (# comments); strict",
    )
    group.addoption(
        "--skips-file",
        default=None,
        metavar="FILE",
        help="tests not to run: a test id or glob per line (# comments)",
    )
    group.addoption(
        "--conformance-json",
        default=None,
        metavar="PATH",
        help="write every outcome and table of the run as JSON",
    )
    group.addoption(
        "--conformance-html",
        default=None,
        metavar="PATH",
        help="write the matrix, failures and tables as one self-contained HTML page",
    )
    group.addoption(
        "--distributed",
        action="store_true",
        default=False,
        help="this process is one rank of a multi-process JAX job (mpirun, srun, "
        "a TPU pod's --worker=all, conformance launch): join it first",
    )
    group.addoption(
        "--require-backend",
        choices=devices_lib.PLATFORMS,
        default=None,
        metavar="PLATFORM",
        help="fail, instead of skipping, when this host has no PLATFORM backend",
    )


def usage_problem(config: pytest.Config) -> str | None:
    """What refuses the run before it starts, in words (``None``: nothing): a report path that cannot
    be written (its directory is made here), or a compile tier asked for that cannot run here."""
    for option in ("conformance_json", "conformance_html"):
        path, flag = config.getoption(option), "--" + option.replace("_", "-")
        if path and (problem := results.report_path_problem(path, option=flag)):
            return problem
    return _tier_problem(config.getoption("markexpr"))


#: The compile tiers, by marker: each runs on any host whose compiler is installed.
COMPILE_TIERS = {"tpu_compile": tpu_compiler, "gpu_compile": gpu_compiler}


def tiers_asked_for(markexpr: str | None) -> list[str]:
    """The compile tiers a ``-m`` expression names, not negated (``-m gpu_compile``, ``-m "cpu or
    tpu_compile"``; not ``-m "cpu and not tpu_compile"``)."""
    words = re.findall(r"\w+", markexpr or "")
    return [w for i, w in enumerate(words) if w in COMPILE_TIERS and (i == 0 or words[i - 1] != "not")]


def _tier_problem(markexpr: str | None) -> str | None:
    """A compile tier ``-m`` asks for that cannot run on this host: as ``--require-backend`` for a
    backend, a usage error naming why and the install command, not a run that skips every test."""
    for tier in tiers_asked_for(markexpr):
        reason = COMPILE_TIERS[tier].unavailable_reason()
        if reason is not None:
            return f"-m {markexpr!r} asks for the {tier} tier, which cannot run on this host: {reason}"
    return None
