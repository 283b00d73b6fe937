"""``kdtree demo``: the project's main job.

Stage 1 (this module today): generate the standard golden bundles and check every available
kernel on them, on the GPU when present, else on the CPU through Triton's interpreter.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path


def check_standard_bundles(device: str, out_dir: Path | None = None) -> int:
    """Generate the standard bundles (into ``out_dir`` or a temp dir) and check every kernel.

    Prints one PASS/FAIL line per (bundle, kernel); returns the number of failures.
    """
    from .bundles import check_bundle, make_bundle, save_bundle, standard_specs
    from .cli import available_kernels

    failures = 0
    with tempfile.TemporaryDirectory() as tmp:
        root = out_dir or Path(tmp)
        for spec in standard_specs():
            bundle = make_bundle(spec, device)
            save_bundle(bundle, root / bundle.filename)
            for kernel in available_kernels():
                result = check_bundle(bundle, kernel, device)
                print(result.line, flush=True)
                failures += not result.ok
    return failures


def main(argv: list[str] | None = None) -> int:
    from .cli import select_device

    parser = argparse.ArgumentParser(prog="kdtree demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["cpu", "cuda"])
    parser.add_argument("--refs-dir", type=Path, help="keep the generated bundles here")
    args = parser.parse_args(argv)
    device = select_device(args.device)
    print(f"kdtree demo on {device}{' (Triton interpreter, small sizes)' if device == 'cpu' else ''}")
    failures = check_standard_bundles(device, args.refs_dir)
    print("golden bundles: " + ("all PASS" if failures == 0 else f"{failures} FAIL"))
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
