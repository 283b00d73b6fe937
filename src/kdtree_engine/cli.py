"""The ``kdtree`` command.

    kdtree refs generate DIR [--large] [--only NAME ...]
    kdtree refs check [--kernel naive|flash|all] FILES...
    kdtree bench ...      (see ``kdtree bench --help``)
    kdtree demo ...       (the main job; see ``kdtree demo --help``)

Without CUDA the kernels run on the CPU through Triton's interpreter (``TRITON_INTERPRET=1``, set
here before Triton is imported).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from . import backend
from .backend import BackendError


def select_device(requested: str | None = None) -> str:
    """:func:`kdtree_engine.backend.select_device`, its errors as one line and exit status 1."""
    try:
        return backend.select_device(requested)
    except BackendError as e:
        raise SystemExit(f"kdtree: error: {e}") from None


def available_kernels() -> list[str]:
    """Kernels of ``verify_attention`` that import in this build."""
    kernels = ["naive"]
    try:
        from .verify import triton_flash  # noqa: F401
    except ImportError:
        return kernels
    return kernels + ["flash"]


def refs_generate(args) -> int:
    from .bundles import make_bundle, save_bundle, standard_specs

    device = select_device(args.device)
    specs = standard_specs(large=args.large)
    if args.only:
        unknown = set(args.only) - {s.name for s in specs}
        if unknown:
            raise SystemExit(f"kdtree refs generate: unknown bundle names {sorted(unknown)}")
        specs = [s for s in specs if s.name in args.only]
    out_dir = Path(args.dir)
    for spec in specs:
        path = save_bundle(make_bundle(spec, device), out_dir / f"{spec.name}.kdtr")
        print(f"wrote {path} ({path.stat().st_size / 1e6:.1f} MB)")
    return 0


def refs_check(args) -> int:
    device = select_device(args.device)
    from .bundles import check_bundle, load_bundle

    available = available_kernels()
    kernels = available if args.kernel == "all" else [args.kernel]
    if args.kernel != "all" and args.kernel not in available:
        raise SystemExit(f"kdtree refs check: kernel {args.kernel!r} is not available in this build")
    failures = 0
    for file in args.files:
        bundle = load_bundle(file)
        for kernel in kernels:
            result = check_bundle(bundle, kernel, device, label=Path(file).name)
            print(result.line, flush=True)
            failures += not result.ok
    print(f"{'all PASS' if failures == 0 else f'{failures} FAIL'} on {device}")
    return 1 if failures else 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kdtree", description=__doc__.split("\n\n")[0])
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
    chk.add_argument("files", nargs="+")
    chk.add_argument("--kernel", choices=["naive", "flash", "all"], default="all")
    chk.add_argument("--device", choices=["cpu", "cuda"])
    chk.set_defaults(func=refs_check)

    # parsed by their own modules (see main)
    for name, help_text in (("bench", "benchmark the kernels against the roofline"),
                            ("demo", "the main job: end-to-end check and demo")):
        sub.add_parser(name, help=help_text, add_help=False)
    return parser


DELEGATED = {"bench": "kdtree_engine.bench.cli", "demo": "kdtree_engine.demo"}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in DELEGATED:
        import importlib

        return importlib.import_module(DELEGATED[argv[0]]).main(argv[1:])
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
