"""Command line: replay one failing check, or list what is registered.

    python -m conformance replay CHECK FAMILY IMPL CASE [--kernels MODULE] [--platform cpu]
    python -m conformance list [--kernels MODULE]
    python -m conformance launch --processes N [--devices-per-process K] [--timeout S] -- COMMAND...

Every failure message ends with a ready-made ``replay`` line.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from conformance.session import TIME_BOUNDS


def _load(modules: list[str]) -> None:
    from conformance import compat
    from conformance.fixtures.devices import CPU_DEVICE_COUNT

    compat.configure_cpu_devices(CPU_DEVICE_COUNT)  # before any backend starts
    for module in ["conformance.kernels", *modules]:
        importlib.import_module(module)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["launch"]:  # its own parser: everything after -- is the command
        from conformance import launch

        return launch.main(argv[1:])
    parser = argparse.ArgumentParser(
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
    replay.add_argument("--platform", default="cpu")
    replay.add_argument("--kernels", action="append", default=[])
    for field, what in TIME_BOUNDS.items():
        flag = "--" + field.removesuffix("_s").replace("_", "-")
        replay.add_argument(flag, type=float, default=None, metavar="SECONDS", help=what)
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
    _load([m for opt in args.kernels for m in opt.split(",") if m])

    from conformance import checks, registry, specs
    from conformance.run import run_check
    from conformance.runner import Case
    from conformance.session import Session, Settings

    if args.command == "list":
        for family in specs.FAMILIES:
            print(f"{family}: {specs.get(family).summary}")
            for impl in registry.registered(family):
                traits = [
                    t
                    for t, on in (
                        ("baseline", impl.baseline),
                        ("Pallas", impl.pallas),
                        ("differentiable", impl.differentiable),
                    )
                    if on
                ]
                tag = f" ({', '.join(traits)})" if traits else ""
                declared = (("dtypes", impl.dtypes), ("platforms", impl.platforms))
                claims = [f"{k}={','.join(v)}" for k, v in declared if v is not None]
                if impl.supports is not None:
                    claims.append(f"supports={getattr(impl.supports, '__qualname__', impl.supports)}")
                claimed = f"  claims {'; '.join(claims)}" if claims else ""
                print(f"  {impl.name}{tag}  [registered by {impl.module}]{claimed}  {impl.description}")
        return 0

    if args.check not in checks.CHECKS:
        parser.error(f"unknown check {args.check!r}; one of {', '.join(checks.CHECKS)}")
    if args.family not in specs.FAMILIES:
        print(f"unknown family {args.family!r}; known: {', '.join(specs.FAMILIES)}", file=sys.stderr)
        return 2
    if args.family not in specs.shard_map_families():
        print(
            f"{args.family}: its checks replay through pytest; each failure prints the command "
            "(pytest 'PATH::TEST[ID]')",
            file=sys.stderr,
        )
        return 2
    try:
        registry.get(args.family, args.impl)
    except registry.NotRegistered as missing:  # not the kernel's failure: the replay cannot find it
        print(f"cannot replay: {missing}", file=sys.stderr)
        return 2
    case = Case.from_token(args.family, args.impl, args.case, platform=args.platform)
    print("\n".join(case.describe()))
    bounds = {field: getattr(args, field.removesuffix("_s")) for field in TIME_BOUNDS}
    settings = Settings(isolation=args.isolation, **{k: v for k, v in bounds.items() if v is not None})
    session = Session(settings)
    try:
        outcome = run_check(args.check, case, session)
    finally:
        session.close()
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


if __name__ == "__main__":
    sys.exit(main())
