"""Command line: replay one failing check, or list what is registered.

    python -m conformance replay CHECK FAMILY IMPL CASE [--kernels MODULE] [--platform cpu]
    python -m conformance list [--kernels MODULE]
    python -m conformance launch --processes N [--devices-per-process K] [--timeout S] -- COMMAND...

Every failure message ends with a ready-made ``replay`` line. Bad input (a ``--kernels`` module that
does not import, an unknown check, family or implementation, a case token that does not parse) is a
usage error: one ``ERROR:`` line, the words pytest gives for it, and pytest's usage-error exit
status, 4.
"""

from __future__ import annotations

import argparse
import difflib
import os
import sys
from typing import TYPE_CHECKING

from conformance import command_line
from conformance.session import BEHIND_COMPILER_MODES, SCHEDULE_VERDICTS, TIME_BOUNDS, Settings

if TYPE_CHECKING:
    from conformance.registry import Implementation
    from conformance.specs.base import FamilySpec


def _load(modules: list[str]) -> None:
    """What the pytest plugin does at start, before any backend starts: the simulated CPU devices, the
    compile-only starts of libtpu and of JAX's CUDA plugin (with no TPU-VM or CUDA start-up errors), a
    mocked GPU topology; then the built-ins and ``modules``."""
    from conformance import compat
    from conformance.fixtures.devices import CPU_DEVICE_COUNT
    from conformance.plugin import kernel_modules
    from conformance.targets import gpu_compiler, tpu_compiler

    compat.configure_cpu_devices(CPU_DEVICE_COUNT)
    tpu_compiler.chipless_start()
    gpu_compiler.deviceless_start()
    gpu_compiler.configure_from_environment()
    compat.start_backends()
    try:
        kernel_modules.import_modules(["conformance.kernels", *modules])
    except kernel_modules.KernelsModuleError as e:
        raise command_line.UsageError(str(e)) from e


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["launch"]:  # its own parser: everything after -- is the command
        from conformance.jobs import launch

        return launch.main(argv[1:])
    try:
        return _main(argv)
    except command_line.UsageError as e:
        return command_line.report(e)


def _main(argv: list[str]) -> int:
    parser = command_line.Parser(
        prog="python -m conformance",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True)
    replay = sub.add_parser("replay", help="re-run one check on one case")
    replay.add_argument("check")
    replay.add_argument("family")
    replay.add_argument("impl")
    replay.add_argument("case", help="MESH:DIM=V,...:DTYPE:seed=S, as printed in the failure")
    replay.add_argument("--platform", default="cpu", choices=("cpu", "gpu", "tpu"))
    replay.add_argument("--kernels", action="append", default=[])
    for field, what in TIME_BOUNDS.items():
        flag = "--" + field.removesuffix("_s").replace("_", "-")
        replay.add_argument(flag, type=float, default=None, metavar="SECONDS", help=what)
    replay.add_argument("--behind-compiler", choices=BEHIND_COMPILER_MODES, default=Settings.behind_compiler)
    replay.add_argument("--schedule-verdict", choices=SCHEDULE_VERDICTS, default=Settings.schedule_verdict)
    replay.add_argument("--compiler-option", action="append", default=[], metavar="NAME=VALUE")
    replay.add_argument(
        "--isolation",
        choices=("process", "off"),
        default="process",
        help="check Pallas kernels on CPU in a stoppable worker process",
    )
    sub.add_parser("launch", help="run a command as N local processes of one JAX job (launch --help)")
    listing = sub.add_parser("list", help="list registered implementations per family")
    listing.add_argument("--kernels", action="append", default=[])
    args = parser.parse_args(argv)
    from conformance.plugin import kernel_modules

    _load(kernel_modules.split_modules(args.kernels))

    from conformance import checks, registry, specs
    from conformance.run import run_check
    from conformance.runner import Case
    from conformance.session import Session
    from conformance.targets import cpu_ragged_all_to_all, target_compiles

    if args.command == "list":
        for family in specs.FAMILIES:
            print(f"{family}: {specs.get(family).summary}")
            for impl in registry.registered(family):
                print(f"  {impl.name}{_declarations(impl, specs.get(family))}  {impl.description}")
        return 0

    if args.check not in checks.CHECKS:
        raise command_line.UsageError(f"unknown check {args.check!r}{_hint(args.check, checks.CHECKS)}")
    if args.family not in specs.FAMILIES:
        raise command_line.UsageError(f"unknown family {args.family!r}{_hint(args.family, specs.FAMILIES)}")
    if args.family not in specs.shard_map_families():
        raise command_line.UsageError(
            f"{args.family}: its checks replay through pytest; each failure prints the command "
            "(pytest 'PATH::TEST[ID]')"
        )
    try:
        registry.get(args.family, args.impl)
    except registry.NotRegistered as missing:  # not the kernel's failure: the replay cannot find it
        raise command_line.UsageError(f"cannot replay: {missing}") from missing
    try:
        case = Case.from_token(args.family, args.impl, args.case, platform=args.platform)
    except ValueError as e:
        raise command_line.UsageError(f"cannot replay: {e}") from e
    from conformance.fixtures.devices import devices_of

    available = len(devices_of(args.platform))
    if case.mesh.num_devices > available:  # the host's limit, not the kernel's: never run
        raise command_line.UsageError(
            f"cannot replay: {case.mesh.label} needs {case.mesh.num_devices} devices; this host has "
            f"{available} {args.platform} device{'s' * (available != 1)}"
        )
    print("\n".join(case.describe()))
    bounds = {field: getattr(args, field.removesuffix("_s")) for field in TIME_BOUNDS}
    try:
        settings = Settings(
            isolation=args.isolation,
            behind_compiler=args.behind_compiler,
            schedule_verdict=args.schedule_verdict,
            compiler_options=target_compiles.parse_options(args.compiler_option),
            **{k: v for k, v in bounds.items() if v is not None},
        )
    except ValueError as e:
        raise command_line.UsageError(str(e)) from e
    session = Session(settings)
    undo_emulation = cpu_ragged_all_to_all.install()  # as in a pytest run of the suite
    try:
        outcome = run_check(args.check, case, session)
    finally:
        session.close()
        undo_emulation()
    if outcome.verdict == "failed":
        print(f"\nFAILED {args.check}\n{outcome.message}")
        if session.abandoned_calls():  # a thread still in a kernel or a compiler would abort the exit
            sys.stdout.flush()
            os._exit(1)
        return 1
    # not judged: nothing to judge in this kernel, neither a pass nor a failure
    label = {"skipped": "SKIPPED", "not_judged": "NOT JUDGED"}.get(outcome.verdict)
    if label:
        print(f"\n{label} {args.check}: {outcome.message}")
        return 0
    print(f"\nPASSED {args.check}")
    return 0


def _declarations(impl: Implementation, spec: FamilySpec) -> str:
    """What ``list`` shows of a registration beside its name: its traits, who registered it, and every
    keyword it passed other than at its default (``bidirectional=True``, ``dtypes=``, the family's own)."""
    traits = [
        t
        for t, on in (
            ("baseline", impl.baseline),
            ("Pallas", impl.pallas),
            ("differentiable", impl.differentiable),
            ("bidirectional", impl.bidirectional),
            ("the compiler's own", impl.compilers_own),
            ("ahead of the compiler", impl.ahead_of_compiler),
        )
        if on
    ]
    tag = f" ({', '.join(traits)})" if traits else ""
    declared = (("dtypes", impl.dtypes), ("platforms", impl.platforms), ("requires", impl.requires or None))
    claims = [f"{k}={','.join(v)}" for k, v in declared if v is not None]
    if impl.lowering_targets != (("tpu",) if impl.pallas else ("tpu", "cuda")):  # register's default
        claims.append(f"lowering_targets={','.join(impl.lowering_targets)}")
    if impl.supports is not None:
        claims.append(f"supports={getattr(impl.supports, '__qualname__', impl.supports)}")
    if impl.unpaced is not None:
        claims.append(f"unpaced={getattr(impl.unpaced, '__qualname__', impl.unpaced)}")
    own = spec.registration_options
    claims += [f"{k}={v!r}" for k, v in impl.options.items() if k in own and v != own[k].default]
    if impl.config:
        claims.append(f"configuration {dict(impl.config)} of {impl.configured_from}")
    claimed = f"  claims {'; '.join(claims)}" if claims else ""
    return f"{tag}  [registered by {impl.module}]{claimed}"


def _hint(word: str, known) -> str:
    close = difflib.get_close_matches(word, list(known), n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return f"{hint}; known: {', '.join(known)}"


if __name__ == "__main__":
    sys.exit(main())
