"""The ``kdtree`` command.

    kdtree refs generate DIR [--large] [--only NAME ...]
    kdtree refs check [--kernel naive|flash|all] FILES...
    kdtree bench ...      (see ``kdtree bench --help``)
    kdtree demo ...       (the main job; see ``kdtree demo --help``)

Without CUDA the kernels run on the CPU through Triton's interpreter (chosen by
:func:`kdtree_engine.backend.select_device` before Triton is imported). A user error is one line
on stderr, ``kdtree: error: ...``, and exit status 2 (:mod:`kdtree_engine.cliargs`).
"""

from __future__ import annotations

import sys

from . import __version__
from .backend import select_device
from .cliargs import ArgumentParser, UsageError, existing_file, guarded, prepare_output_dir
from .verify import KERNELS, OPT_IN_KERNELS, available_kernels


def refs_generate(args) -> int:
    from .bundles import make_bundle, save_bundle, standard_specs

    specs = standard_specs(large=args.large)
    if args.only:
        unknown = set(args.only) - {s.name for s in specs}
        if unknown:
            raise UsageError(f"argument --only: unknown bundle names {sorted(unknown)}; "
                             f"choose from {sorted(s.name for s in specs)}")
        specs = [s for s in specs if s.name in args.only]
    out_dir = prepare_output_dir(args.dir, "dir")
    device = select_device(args.device)
    for spec in specs:
        path = save_bundle(make_bundle(spec, device), out_dir / f"{spec.name}.kdtr")
        print(f"wrote {path} ({path.stat().st_size / 1e6:.1f} MB)")
    return 0


def refs_check(args) -> int:
    device = select_device(args.device)
    from .bundles import BundleError, check_bundle, load_bundle

    runs = available_kernels(device, opt_in=True)
    if args.kernel not in ("all",) + runs:
        raise UsageError(f"argument --kernel: {args.kernel} does not run on {device} "
                         f"(this device runs {', '.join(runs)})")
    kernels = [k for k in runs if k in KERNELS] if args.kernel == "all" else [args.kernel]
    failures = 0
    for file in args.files:
        try:
            bundle = load_bundle(file)
        except BundleError as e:
            print(f"FAIL {file.name}: not a readable bundle: {e}", flush=True)
            failures += 1
            continue
        for kernel in kernels:
            try:
                result = check_bundle(bundle, kernel, device, label=file.name)
            except (ValueError, TypeError) as e:  # a readable file whose inputs break the contract
                print(f"FAIL [{kernel}] {file.name}: inputs rejected: {e}", flush=True)
                failures += 1
                continue
            print(result.line, flush=True)
            failures += not result.ok
    print(f"{'all PASS' if failures == 0 else f'{failures} FAIL'} on {device}")
    return 1 if failures else 0


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(prog="kdtree", description=__doc__.split("\n\n")[0])
    parser.add_argument("--version", action="version", version=f"kdtree-engine {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    refs = sub.add_parser("refs", help="golden bundles (.kdtr): generate and check")
    refs_sub = refs.add_subparsers(dest="refs_command", required=True)
    gen = refs_sub.add_parser("generate", help="write the standard bundle set to DIR")
    gen.add_argument("dir")
    gen.add_argument("--large", action="store_true", help="the long-context set (prefix up to 131072)")
    gen.add_argument("--only", nargs="+", metavar="NAME", help="only these bundle names")
    gen.add_argument("--device", choices=["cpu", "cuda"], help="where to compute the reference")
    gen.set_defaults(func=refs_generate)
    chk = refs_sub.add_parser("check", help="check kernels against bundles; one PASS/FAIL line each")
    chk.add_argument("files", nargs="+", type=existing_file)
    chk.add_argument("--kernel", choices=[*KERNELS, *OPT_IN_KERNELS, "all"], default="all",
                     help="a kernel, or all: every kernel this device runs but the opt-in ones (run when named)")
    chk.add_argument("--device", choices=["cpu", "cuda"])
    chk.set_defaults(func=refs_check)

    # parsed by their own modules (see main)
    for name, help_text in (("bench", "benchmark the kernels against the roofline"),
                            ("demo", "the main job: end-to-end check and demo")):
        sub.add_parser(name, help=help_text, add_help=False)
    return parser


DELEGATED = {"bench": "kdtree_engine.bench.cli", "demo": "kdtree_engine.demo"}


@guarded
def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in DELEGATED:
        import importlib

        return importlib.import_module(DELEGATED[argv[0]]).main(argv[1:])
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
