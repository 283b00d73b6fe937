"""``kdtree bench``: tree-verify kernels side by side against the roofline.

    kdtree bench                      default sweep (prefix series + one-axis sweeps), ~bf16
    kdtree bench --quick              a one-minute look
    kdtree bench --long               default + prefixes 32k, 64k, 128k, 200k
    kdtree bench --grid issue3        H {16,64,128} x n {9,33,65} x B {1,4,16} x P {1k..128k}
    kdtree bench --heads 16,64 --prefix 1k,16k --q-len 9,33     any axes: their cartesian product
    kdtree bench --dry-run ...        list the shapes with estimated H200 seconds, run nothing
    PYTHONPATH=src python -m kdtree_engine.bench.cli --quick

Without CUDA it runs a tiny functional sweep on the CPU through Triton's interpreter; those
times are not performance figures and say so.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from ..backend import select_device
from ..cliargs import ArgumentParser, UsageError, float_above, guarded, int_in, int_list, prepare_output_dir, prepare_output_file
from ..masks import MAX_TREE_NODES
from ..verify import KERNELS, OPT_IN_KERNELS
from ..verify.contract import MAX_HEADS
from .shapes import TREES

__all__ = ["main", "build_parser"]

OURS = KERNELS + OPT_IN_KERNELS  # the opt-in ones only when named in --kernels
PEERS = ("torch", "sglang", "flashinfer")
ALL_KERNELS = OURS + PEERS

# timing settings per preset (each overridable): repeats, budget per measurement, naive cap
PRESET_TIMING = {
    "tiny": dict(repeats=10, budget_ms=50.0, slow_max_ms=3000.0),
    "quick": dict(repeats=30, budget_ms=150.0, slow_max_ms=500.0),
    "default": dict(repeats=100, budget_ms=400.0, slow_max_ms=1500.0),
    "issue3": dict(repeats=30, budget_ms=150.0, slow_max_ms=500.0),
    "issue11": dict(repeats=30, budget_ms=150.0, slow_max_ms=500.0),
    "custom": dict(repeats=100, budget_ms=400.0, slow_max_ms=1500.0),
}


def _names(choices):
    def parse(text: str) -> list[str]:
        names = [x.strip() for x in text.split(",") if x.strip()]
        bad = [x for x in names if x not in choices]
        if bad or not names:
            raise argparse.ArgumentTypeError(f"choose from {','.join(choices)}; got {text!r}")
        return names

    return parse


def build_parser() -> ArgumentParser:
    p = ArgumentParser(
        prog="kdtree bench",
        description="Benchmark tree-verify attention kernels side by side against the roofline.",
        epilog="Axis flags take comma lists; a k suffix multiplies by 1024 (16k = 16384). "
        "Given any axis flag, the sweep is the cartesian product of the axes, the others at the "
        "base (B=1, n=33, H=64, ps=1, bf16; prefix: the default series).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    g = p.add_argument_group("what to sweep")
    pre = g.add_mutually_exclusive_group()
    pre.add_argument("--quick", action="store_true", help="about ten shapes: a one-minute look")
    pre.add_argument("--tiny", action="store_true", help="three tiny shapes (the CPU functional run)")
    pre.add_argument("--grid", choices=["issue3", "issue11"],
                     help="a named grid (issue3: 135 shapes, page size 1; issue11: 48 shapes x "
                          "{chain tree page 64, random tree page 64, random tree page 1})")
    g.add_argument("--long", action="store_true", help="add prefixes 32k, 64k, 128k, 200k to the prefix series")
    g.add_argument("--batch", type=int_list(1), help="sequences B, e.g. 1,2,4,8,16")
    g.add_argument("--q-len", type=int_list(1, MAX_TREE_NODES), help="tree nodes per sequence, e.g. 9,17,33,65")
    g.add_argument("--heads", type=int_list(1, MAX_HEADS), help="query heads, e.g. 8,16,64,128")
    g.add_argument("--prefix", type=int_list(0), help="prefix tokens, e.g. 0,256,1k,4k,16k")
    g.add_argument("--page-size", type=int_list(1), help="page size: 1 (slots scattered) or 64 (pages scattered)")
    g.add_argument("--dtype", type=_names(("bf16", "fp16")), default=None, help="bf16,fp16 (default bf16)")
    g.add_argument("--tree", type=_names(TREES), default=None,
                   help="random (node order shuffled) and/or chain (FlashMLA's causal mask); default random")
    g.add_argument("--flashmla", metavar="DIR",
                   help="add FlashMLA as a peer: DIR holds flashmla_peer.py with load_flashmla() "
                        "(chain trees, page size 64, bf16 only)")
    g.add_argument("--kernels", type=_names(ALL_KERNELS), default=None,
                   help=f"subset of {','.join(ALL_KERNELS)} (default: all available but "
                        f"{','.join(OPT_IN_KERNELS)}, which run only when named)")
    t = p.add_argument_group("timing")
    t.add_argument("--repeats", type=int_in(1), help="most timed samples per measurement (preset default)")
    t.add_argument("--min-repeats", type=int_in(1), default=5, help="fewest timed samples per measurement")
    t.add_argument("--budget-ms", type=float_above(0), help="timed GPU time per measurement (preset default)")
    t.add_argument("--slow-max-ms", type=float_above(0), help="skip naive and peers where their estimated call (rough H200 model) is longer")
    t.add_argument("--rounds", type=int_in(1), default=3, help="CUDA: a shape's kernels (but naive) timed in turn "
                   "this many times, each round starting at the next kernel, samples pooled (the clock drifts)")
    t.add_argument("--no-graph", action="store_true", help="never use CUDA graphs (eager launches)")
    t.add_argument("--graph-max-us", type=float_above(0), default=2000.0, help="graph-replay calls shorter than this")
    t.add_argument("--max-sets", type=int_in(1), default=16, help="most input sets rotated against L2")
    t.add_argument("--check-seqs", type=int_in(1), default=2, help="sequences checked against the reference")
    t.add_argument("--check-heads", type=int_in(1), default=3, help="heads checked against the reference")
    t.add_argument("--seed", type=int, default=0)
    o = p.add_argument_group("output")
    o.add_argument("--out-dir", default="bench_out", help="where the default file names go")
    o.add_argument("--json", help="JSON file (default OUT_DIR/bench_<preset>.json)")
    o.add_argument("--csv", help="CSV file (default OUT_DIR/bench_<preset>.csv)")
    o.add_argument("--plot", help="PNG plot (default OUT_DIR/bench_<preset>.png)")
    o.add_argument("--no-files", action="store_true", help="terminal only")
    o.add_argument("--dry-run", action="store_true", help="list shapes and estimated H200 seconds; run nothing")
    p.add_argument("--device", choices=["cuda", "cpu"], help="default: cuda when available")
    return p


def _axes_given(a) -> bool:
    return any(v is not None for v in (a.batch, a.q_len, a.heads, a.prefix, a.page_size, a.tree))


def _shapes(a, device: str) -> tuple[list, str, list[str]]:
    from .shapes import BASE, DEFAULT_PREFIXES, ISSUE3_GRID, LONG_PREFIXES, cartesian_shapes, preset_shapes

    notes = []
    dtypes = a.dtype or ["bf16"]
    trees = a.tree or ["random"]
    if a.grid == "issue3":
        g = ISSUE3_GRID
        shapes = cartesian_shapes(a.batch or g["batch"], a.q_len or g["q_len"], a.heads or g["heads"],
                                  a.prefix or g["prefix"], a.page_size or g["page_size"], dtypes, trees)
        return shapes, "issue3", notes
    if a.grid == "issue11":
        return preset_shapes("issue11", dtypes=dtypes), "issue11", notes
    if _axes_given(a):
        prefixes = a.prefix or list(DEFAULT_PREFIXES) + (list(LONG_PREFIXES) if a.long else [])
        shapes = cartesian_shapes(a.batch or [BASE["batch"]], a.q_len or [BASE["q_len"]], a.heads or [BASE["heads"]],
                                  prefixes, a.page_size or [BASE["page_size"]], dtypes, trees)
        return shapes, "custom", notes
    if device == "cpu" and not a.tiny and not a.dry_run:
        notes.append("no CUDA device: running the tiny preset on the CPU instead")
        return preset_shapes("tiny", dtypes=dtypes), "tiny", notes
    preset = "tiny" if a.tiny else "quick" if a.quick else "default"
    return preset_shapes(preset, long=a.long, dtypes=dtypes), preset, notes


@guarded
def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    if not (a.dry_run or a.no_files):  # every output is checked before any work
        if not (a.json and a.csv and a.plot):
            prepare_output_dir(a.out_dir, "--out-dir")
        for arg, path in (("--json", a.json), ("--csv", a.csv), ("--plot", a.plot)):
            if path:
                prepare_output_file(path, arg)
    device = select_device(a.device)
    # Triton may load from here on (the interpreter choice is settled)
    from . import report
    from .peers import detect_peers
    from .runner import SweepOptions, crossovers, detect_ours, est_total_s, estimate, run_sweep
    from .shapes import case_bytes, choose_sets

    from rich.markup import escape

    console = report.make_console()
    cpu = device == "cpu"
    if cpu and not a.dry_run:
        report.banner(console)
    shapes, preset, notes = _shapes(a, device)
    tname = preset
    timing = PRESET_TIMING[preset]
    l2 = 60 * 2**20
    if not cpu:
        l2 = int(getattr(torch.cuda.get_device_properties(torch.cuda.current_device()), "L2_cache_size", 0)) or l2
    opts = SweepOptions(
        device=device,
        repeats=a.repeats or timing["repeats"],
        min_repeats=min(a.min_repeats, a.repeats or timing["repeats"]),
        budget_s=(a.budget_ms if a.budget_ms is not None else timing["budget_ms"]) / 1e3,
        rounds=a.rounds,
        use_graph=not a.no_graph,
        graph_max_us=a.graph_max_us,
        max_sets=a.max_sets,
        l2_bytes=l2,
        slow_max_ms=a.slow_max_ms if a.slow_max_ms is not None else timing["slow_max_ms"],
        check_seqs=a.check_seqs,
        check_heads=a.check_heads,
        seed=a.seed,
    )

    requested = a.kernels
    ours, why_not = detect_ours([k for k in requested if k in OURS] if requested else None, device)
    peers, why_not_peers = detect_peers([k for k in requested if k in PEERS] if requested else None)
    why_not.update(why_not_peers)
    if a.flashmla:
        from .flashmla import FlashMLAPeer

        flashmla = FlashMLAPeer(a.flashmla)
        why = flashmla.detect()
        if why is None:
            peers.append(flashmla)
        else:
            why_not["flashmla"] = why
    impls = ours + peers
    if not impls:
        reasons = "; ".join(f"{k}: {v}" for k, v in why_not.items())
        raise UsageError(f"argument --kernels: none of the requested kernels is available ({reasons})")

    long_tag = "_long" if a.long and preset in ("default", "quick", "custom") else ""
    stem = f"bench_{tname}{long_tag}" + ("_cpu" if cpu else "")
    out_dir = Path(a.out_dir)

    if a.dry_run:
        if "flash" not in [i.name for i in impls] and (not requested or "flash" in requested):
            from .runner import OursImpl

            impls.insert(1 if ours and ours[0].name == "naive" else 0, OursImpl("flash"))
            why_not["flash"] = why_not.get("flash", "") + " (estimated anyway)"
        return _dry_run(console, shapes, impls, opts, preset, why_not, case_bytes, choose_sets, estimate, est_total_s)

    info = report.machine_info(device)
    console.print(f"[bold]{escape(report.machine_line(info))}[/]")
    for n in notes:
        console.print(f"[yellow]{escape(n)}[/]")
    kernels_line = ", ".join(i.name + (f" ({i.version})" if getattr(i, "version", "") else "") for i in impls)
    console.print(escape(f"kernels: {kernels_line}" + "".join(f" | {k}: {v}" for k, v in why_not.items())))
    console.print(
        f"preset {preset}{long_tag.replace('_', ' ')}: {len(shapes)} shapes x {len(impls)} kernels; "
        f"repeats <= {opts.repeats}, budget {opts.budget_s * 1e3:.0f} ms/measurement, "
        f"graphs {'on' if opts.use_graph else 'off'} (< {opts.graph_max_us:.0f} us), "
        f"slow-kernel cap {opts.slow_max_ms:.0f} ms" + ("" if cpu else f"; est. {est_total_s(shapes, impls, opts) / 60:.1f} min on an H200")
    )

    ceilings = None
    if not cpu:
        from .timing import measure_ceilings

        dtypes = sorted({s.dtype for s in shapes})
        with console.status("measuring ceilings (copy bandwidth, matmul rate)..."):
            ceilings = measure_ceilings(dtypes)
        mm = ", ".join(f"{k} matmul {v:.0f} TFLOP/s" for k, v in ceilings.matmul_tflops.items())
        console.print(f"ceilings (this run): copy {ceilings.copy_tbps:.2f} TB/s (read+write), {mm}")

    payload = {
        "machine": info,
        "ceilings": ceilings.to_dict() if ceilings else None,
        "ceilings_end": None,  # measured again after the rows (CUDA)
        "cpu_functional_run": cpu,
        "warning": report.CPU_BANNER if cpu else None,
        "preset": preset,
        "long": bool(a.long),
        "argv": sys.argv[1:] if argv is None else list(argv),
        "options": vars(opts),
        "kernels": {i.name: i.description for i in impls},
        "left_out": why_not,
        "rows": [],
        "crossovers": [],
    }
    files = {} if a.no_files else {
        "json": Path(a.json) if a.json else out_dir / f"{stem}.json",
        "csv": Path(a.csv) if a.csv else out_dir / f"{stem}.csv",
        "plot": Path(a.plot) if a.plot else out_dir / f"{stem}.png",
    }
    total = len(shapes) * len(impls)
    all_rows = []

    with report.make_progress(console) as progress:
        task = progress.add_task("starting", total=total)
        done = [0]

        def on_progress(desc: str) -> None:
            progress.update(task, description=desc)

        def on_row(r) -> None:
            done[0] += 1
            progress.update(task, completed=done[0])
            d = r.to_dict()
            figs = ""
            if d["median_us"] is not None:
                figs = f"{d['median_us']:>10.1f} us"
                if d["pct_floor"] is not None:
                    figs += f" {d['tflops']:7.1f} TFLOP/s {d['pct_floor']:6.1f}% floor"
                if d["speedup_vs_naive"] is not None:
                    figs += f" {d['speedup_vs_naive']:7.1f}x naive"
            else:
                figs = escape((d["check"] if d["status"] == "FAIL" else d["note"])[:160])
            style = report.STATUS_STYLE.get(d["status"], "")
            head = escape(f"[{done[0]:>4}/{total}] {r.shape.label:<32} {r.kernel:<10}")
            progress.console.print(f"{head} [{style}]{d['status']:<5}[/] {figs}", highlight=False)

        def on_shape_done(rows) -> None:
            all_rows.extend(rows)
            if "json" in files:
                payload["rows"] = [r.to_dict() for r in all_rows]
                report.write_json(files["json"], payload)

        rows, abort = run_sweep(shapes, impls, opts, ceilings, on_row=on_row, on_shape_done=on_shape_done,
                                on_progress=on_progress)
    if ceilings and not abort:  # (after an abort the device may be unusable)
        # measured again on the GPU as the rows left it (warm, at its power limit after a long sweep):
        # the floor keeps the start's figures; this one says how much the reading hangs on the ceiling
        with console.status("measuring ceilings again (end of the run)..."):
            ceilings_end = measure_ceilings(dtypes)
        payload["ceilings_end"] = ceilings_end.to_dict()
        mm = ", ".join(f"{k} matmul {v:.0f} TFLOP/s ({v / ceilings.matmul_tflops[k]:.3f} of the start's)"
                       for k, v in ceilings_end.matmul_tflops.items())
        console.print(f"ceilings at the end of the run: copy {ceilings_end.copy_tbps:.2f} TB/s, {mm}; "
                      f"% floor uses the start's")

    title = f"kdtree bench — {preset}{long_tag.replace('_', ' ')} — {info.get('gpu') or 'CPU'}"
    if cpu:
        title = f"{report.CPU_BANNER} — {title}"
    console.print(report.rows_table(rows, cpu=cpu, title=title))
    if ceilings:
        console.print(
            f"floor = max(FLOPs / {' or '.join(f'{v:.0f} ({k})' for k, v in ceilings.matmul_tflops.items())} TFLOP/s, bytes / "
            f"{ceilings.copy_tbps:.2f} TB/s); % floor = floor / median. 'L2' = inputs rotated still fit "
            f"2x L2 (warm-cache figure)."
        )
    cross = crossovers(rows)
    payload["crossovers"] = cross
    if cross:
        console.print("[bold]crossover (flash vs naive, per prefix series):[/]")
        for c in cross:
            console.print(escape(f"  {c['group']}: {c['verdict']}"))
    cross_by_group = {c["group"]: c["crossover_prefix"] for c in cross}
    payload["rows"] = []
    for r in rows:
        d = r.to_dict()
        if r.kernel == "flash" and r.shape.group_label in cross_by_group:
            d["crossover_prefix"] = cross_by_group[r.shape.group_label]  # of its prefix series
        payload["rows"].append(d)
    payload["aborted"] = abort
    counts = {}
    for r in rows:
        counts[r.status] = counts.get(r.status, 0) + 1
    payload["counts"] = counts
    console.print("rows: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
    if abort:
        console.print(f"[bold red]sweep aborted: {escape(abort)}[/]")
    if files:
        report.write_json(files["json"], payload)
        report.write_csv(files["csv"], payload["rows"], info)
        plot = report.write_plot(files["plot"], payload["rows"], title=title, cpu=cpu)
        written = [str(files["json"]), str(files["csv"])] + ([str(plot)] if plot else [])
        console.print(escape("wrote " + ", ".join(written)))
    if cpu:
        report.banner(console)
    bad = counts.get("FAIL", 0) + counts.get("error", 0)
    return 3 if abort else (1 if bad else 0)


def _dry_run(console, shapes, impls, opts, preset, why_not, case_bytes, choose_sets, estimate, est_total_s) -> int:
    from rich.markup import escape
    from rich.table import Table

    table = Table(title=f"dry run: preset {preset}, {len(shapes)} shapes (estimated H200 seconds, rough)")
    for c in ["shape", "GFLOP", "MB moved", "sets", "GiB inputs"] + [i.name for i in impls]:
        table.add_column(c, justify="left" if c == "shape" else "right")
    for s in shapes:
        n_sets = choose_sets(s, l2_bytes=opts.l2_bytes, max_sets=opts.max_sets, free_bytes=130 * 2**30)
        ests = [estimate(s, i, opts) for i in impls]
        table.add_row(s.label, f"{s.flops / 1e9:.1f}", f"{s.bytes / 1e6:.1f}", str(n_sets),
                      f"{case_bytes(s, n_sets) / 2**30:.2f}", *[f"{e:.1f}" if e else "skip" for e in ests])
    console.print(table)
    for k, v in why_not.items():
        console.print(escape(f"{k}: {v}"))
    console.print(f"estimated total: {est_total_s(shapes, impls, opts) / 60:.1f} min on an H200 "
                  f"(budget {opts.budget_s * 1e3:.0f} ms/measurement, repeats <= {opts.repeats})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
