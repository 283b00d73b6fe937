"""Spike: the Hopper kernel's step in CUDA C++ (scripts/hopper_cuda_step.cu), built with nvcc,
checked against a float64 reference, and timed on long prefixes with the CTAs laid out as the
Hopper kernel's KV parts schedule lays out its programs (docs/perf_log.md, run 45).

    PYTHONPATH=src python3 scripts/hopper_cuda_step.py [--variants NAME=FLAGS;...] [--flashmla DIR] [--stamps]
                                                       [--page1] [--sms N] [--json FILE]

Variants are builds of the same source with preprocessor flags (the KD_* macros at its top), timed
in turn in each round (the clock drifts at the power limit), samples pooled.

Each shape ``HxNxBxPREFIX`` runs ceil(H x N / 64) query blocks per sequence; the CTAs of one KV part
(one per query block) read the same tiles at the same time; the parts split each sequence's tiles
so that the grid has at most 132 CTAs. Pages of 64 rows, shuffled in the pool. No tree mask, no
merge of the parts (the times are the main kernel's alone).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import math
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from kdtree_engine.bench.flashmla import chain_call, load_flashmla_module
from kdtree_engine.verify.hopper_cuda import NVCC_TARGET

SOURCE = Path(__file__).with_suffix(".cu")
SHAPES = ("64x33x4x131072", "16x9x4x131072", "16x9x1x131072", "16x9x4x16384")


def build(out_dir: Path, name: str, flags: str) -> ctypes.CDLL:
    lib = out_dir / f"hopper_cuda_step_{name}.so"
    cmd = ["nvcc", *NVCC_TARGET, "-shared", "-Xcompiler", "-fPIC", "-Xptxas", "-v", *flags.split(), "-o", str(lib),
           str(SOURCE)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    print(f"{name} ({flags or 'no flags'}): " + "; ".join(
        line.strip() for line in r.stderr.splitlines() if "registers" in line or "spill" in line or "error" in line))
    r.check_returncode()
    so = ctypes.CDLL(str(lib))
    so.kd_step_launch.restype = ctypes.c_int
    so.kd_step_launch.argtypes = [ctypes.c_void_p, ctypes.c_ulonglong, ctypes.c_void_p, ctypes.c_ulonglong,
                                  ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int,
                                  ctypes.c_int, ctypes.c_int, ctypes.c_float, ctypes.c_void_p, ctypes.c_void_p]
    so.kd_step_stamp_values.restype = ctypes.c_int
    so.kd_step_max_active_clusters.restype = ctypes.c_int
    clusters = so.kd_step_max_active_clusters()
    if clusters:  # a KD_MULTICAST build: a grid of more clusters than fit at once runs in two waves
        print(f"{name}: at most {clusters} clusters resident at once")
    return so


def launch(so, q, kv, tile_rows, q_block, part_ctas, out, lse, scale, stamps=None):
    rc = so.kd_step_launch(q.data_ptr(), q.shape[0], kv.data_ptr(), kv.shape[0], tile_rows.data_ptr(),
                           q_block.data_ptr(), out.data_ptr(), lse.data_ptr(), tile_rows.shape[0],
                           tile_rows.shape[1], part_ctas, scale * math.log2(math.e),
                           None if stamps is None else stamps.data_ptr(), torch.cuda.current_stream().cuda_stream)
    if rc:
        raise RuntimeError(f"kd_step_launch returned {rc}")


def layout(H: int, n: int, B: int, prefix: int, sms: int, gen: torch.Generator, page1: bool = False):
    """(q_block [C], tile_rows [C, T], pool rows, q rows, R): query block and tile rows of each CTA (the
    R CTAs of a part adjacent). ``page1``: tile_rows ``[C, T, 64]``, each row's index, the rows shuffled
    one by one (pages of one row); else each tile's first row, pages of 64 shuffled."""
    R = -(-H * n // 64)
    tiles = prefix // 64
    parts = max(1, sms // (R * B))
    per = (tiles // parts) // 2 * 2
    if page1:
        pages = torch.randperm(B * tiles * 64, generator=gen).view(B, tiles, 64)  # each row
    else:
        pages = torch.randperm(B * tiles, generator=gen).view(B, tiles) * 64  # first row of each page
    q_block, rows = [], []
    for b in range(B):
        for g in range(parts):
            for r in range(R):
                q_block.append(b * R + r)
                rows.append(pages[b, g * per:(g + 1) * per])
    return (torch.tensor(q_block, dtype=torch.int32), torch.stack(rows).to(torch.int32), B * tiles * 64, B * R * 64,
            R)


def reference(q, kv, tile_rows, q_block, scale):
    outs, lses = [], []
    for c in range(tile_rows.shape[0]):
        qb = q[q_block[c] * 64:(q_block[c] + 1) * 64].double()
        rows = tile_rows[c].long()
        idx = rows.flatten() if rows.dim() == 2 else (rows[:, None] + torch.arange(64, device=q.device)).flatten()
        k = kv[idx].double()
        s = qb @ k.T * scale
        lses.append(torch.logsumexp(s, -1))
        outs.append(torch.softmax(s, -1) @ k[:, :512])
    return torch.stack(outs), torch.stack(lses)


STAMP_STEPS, STAMP_POINTS = 64, 8  # the source's
STAMP_NAMES = (("start", "m0 published", "P0 V0 retired", "m1 arrived", "P0 stored", "P1 arrived",
                "QK half 1 issued, P1 V1 retired", "end"),
               ("start", "m0 arrived", "m1 published", "P1 stored, PV issued", "P0 arrived", "P1 V1 retired",
                "P0 V0 retired", "end"))


def print_stamps(name: str, stamps: torch.Tensor, steps: int) -> dict:
    """Median over CTAs and steps 2 .. of each point's cycles after the point before it (point 0:
    after the last point of the step before), and of a step, for each warpgroup."""
    t = stamps.view(-1, 2, STAMP_STEPS, STAMP_POINTS)[:, :, :min(steps, STAMP_STEPS)].double()
    out = {}
    for wg in range(2):
        x = t[:, wg]
        d = torch.diff(x, dim=-1)  # [C, S, P - 1]
        first = x[:, 1:, 0] - x[:, :-1, -1]
        step = x[:, 1:, 0] - x[:, :-1, 0]
        row = {"step": step[:, 1:].median().item(), STAMP_NAMES[wg][0]: first[:, 1:].median().item()}
        for k in range(1, STAMP_POINTS):
            row[STAMP_NAMES[wg][k]] = d[:, 2:, k - 1].median().item()
        out[f"wg{wg}"] = row
        print(f"{name} wg {wg}: " + ", ".join(f"{k} {v:.0f}" for k, v in row.items()))
    return out


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--variants", default="base=", help="NAME=FLAGS;... (default: the source as it is)")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--iters", type=int, default=10, help="calls of a variant a round, timed together")
    ap.add_argument("--stamps", action="store_true", help="also build each variant with -DKD_STAMPS=1 and print "
                    "its step's timeline (cycles between the points of each warpgroup)")
    ap.add_argument("--flashmla", metavar="DIR", help="also time FlashMLA (flashmla_peer.py in DIR) on each shape")
    ap.add_argument("--page1", action="store_true", help="pages of one row: every variant built with "
                    "-DKD_PAGE1=1 (cp.async builds: -DKD_MULTICAST=1 -DKD_CPASYNC=1); FlashMLA stays at page 64")
    ap.add_argument("--sms", type=positive_int, help="CTAs the timed layouts may use (default: the multiprocessors); "
                    "with KD_MULTICAST builds, at most their resident clusters x the cluster size")
    ap.add_argument("--json")
    a = ap.parse_args()
    dev = torch.device("cuda")
    sms = a.sms or torch.cuda.get_device_properties(dev).multi_processor_count
    out_dir = Path(tempfile.mkdtemp())
    variants, stamped = {}, {}
    for item in a.variants.split(";"):
        name, _, flags = item.partition("=")
        flags += " -DKD_PAGE1=1" if a.page1 else ""
        variants[name] = build(out_dir, name, flags)
        if a.stamps:
            stamped[name] = build(out_dir, f"{name}_stamps", f"{flags} -DKD_STAMPS=1")
    fm = load_flashmla_module(a.flashmla) if a.flashmla else None
    gen = torch.Generator().manual_seed(0)
    scale = 576 ** -0.5
    result = {"gpu": torch.cuda.get_device_name(dev), "variants": a.variants, "checks": [], "shapes": []}

    # correctness: 6 CTAs (2 sequences x 3 query blocks), shuffled pages, scores of a few units
    for n_tiles, spread in ((2, 1.0), (10, 1.0), (10, 4.0)):
        q_block, rows, pool, q_rows, R = layout(64, 3, 2, n_tiles * 64, 6, gen, a.page1)
        q = (torch.randn(q_rows, 576, generator=gen) * spread).to(dev, torch.bfloat16)
        kv = torch.randn(pool, 576, generator=gen).to(dev, torch.bfloat16)
        q_block, rows = q_block.to(dev), rows.to(dev)
        ref_o, ref_l = reference(q, kv, rows, q_block, scale)
        for name, so in variants.items():
            out = torch.full((rows.shape[0], 64, 512), float("nan"), device=dev)
            lse = torch.full((rows.shape[0], 64), float("nan"), device=dev)
            launch(so, q, kv, rows, q_block, R, out, lse, scale)
            torch.cuda.synchronize()
            err_o = (out.double() - ref_o).abs().max().item()
            err_l = (lse.double() - ref_l).abs().max().item()
            ok = err_o < 2e-2 and err_l < 1e-2
            print(f"{name}: check tiles {n_tiles} spread {spread}: max |out - ref| {err_o:.2e}, |lse - ref| "
                  f"{err_l:.2e}: {'PASS' if ok else 'FAIL'}")
            result["checks"].append(dict(variant=name, tiles=n_tiles, spread=spread, err_out=err_o, err_lse=err_l,
                                         ok=ok))

    for shape in a.shapes.split(","):
        H, n, B, prefix = (int(v) for v in shape.split("x"))
        q_block, rows, pool, q_rows, R = layout(H, n, B, prefix, sms, gen, a.page1)
        q = torch.randn(q_rows, 576, generator=gen).to(dev, torch.bfloat16)
        kv = torch.randn(pool, 576, device=dev, dtype=torch.bfloat16)
        q_block, rows = q_block.to(dev), rows.to(dev)
        out = torch.empty((rows.shape[0], 64, 512), device=dev)
        lse = torch.empty((rows.shape[0], 64), device=dev)
        calls = {name: (lambda so=so: launch(so, q, kv, rows, q_block, R, out, lse, scale))
                 for name, so in variants.items()}
        if fm is not None:
            calls["flashmla"] = chain_call(fm, H, n, B, prefix, scale, dev)
        samples = {name: [] for name in calls}
        names = list(calls)
        for rnd in range(a.rounds):
            for name in names[rnd % len(names):] + names[:rnd % len(names)]:
                calls[name]()
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record()
                for _ in range(a.iters):
                    calls[name]()
                e1.record()
                e1.synchronize()
                samples[name].append(e0.elapsed_time(e1) * 1e3 / a.iters)
        base = None
        for name in names:
            t = sorted(samples[name])
            us = t[len(t) // 2]
            base = base or us
            grid = ("FlashMLA's own grid and combine" if name == "flashmla"
                    else f"{rows.shape[0]} CTAs x {rows.shape[1]} tiles")
            print(f"{shape} {name}: {grid}: median {us:.1f} us (min {t[0]:.1f}), "
                  f"{us / rows.shape[1]:.3f} us a tile a CTA, {us / base:.3f} of {names[0]}")
            result["shapes"].append(dict(shape=shape, variant=name, ctas=rows.shape[0], tiles=rows.shape[1],
                                         median_us=us, min_us=t[0], us_per_tile=us / rows.shape[1]))
        for name, so in stamped.items():  # the stamped copy once, warm, after the timing
            stamps = torch.zeros(so.kd_step_stamp_values(rows.shape[0]), dtype=torch.int64, device=dev)
            launch(so, q, kv, rows, q_block, R, out, lse, scale, stamps)
            torch.cuda.synchronize()
            result.setdefault("stamps", {})[f"{shape} {name}"] = print_stamps(f"{shape} {name}", stamps,
                                                                             rows.shape[1] // 2)
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=1))
    return 0 if all(c["ok"] for c in result["checks"]) else 1


if __name__ == "__main__":
    sys.exit(main())
