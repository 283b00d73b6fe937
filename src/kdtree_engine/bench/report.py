"""Output of a sweep: the machine line, a rich table (with a progress bar while it runs), JSON and
CSV files for machines, a PNG plot for people."""

from __future__ import annotations

import csv
import datetime as _dt
import json
import os
import platform
import subprocess
from pathlib import Path

import torch
from rich.console import Console
from rich.markup import escape
from rich.panel import Panel
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

__all__ = [
    "CPU_BANNER",
    "make_console",
    "machine_info",
    "machine_line",
    "make_progress",
    "rows_table",
    "write_json",
    "write_csv",
    "write_plot",
]

CPU_BANNER = "CPU functional run — not a performance figure"
REPO_ROOT = Path(__file__).resolve().parents[3]


def make_console() -> Console:
    console = Console()
    if not console.is_terminal:  # piped to a file: wide enough that the table does not wrap
        console = Console(width=200)
    return console


def _run(cmd: list[str]) -> str | None:
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=10, cwd=REPO_ROOT)
    except (OSError, subprocess.SubprocessError):
        return None
    return res.stdout.strip() if res.returncode == 0 else None


def git_commit() -> str:
    """Short commit of the checkout (``-dirty`` with uncommitted changes to tracked files); without
    git or .git, ``$KDTREE_GIT_COMMIT`` if set, else "unknown"."""
    sha = _run(["git", "rev-parse", "--short=12", "HEAD"])
    if not sha:
        return os.environ.get("KDTREE_GIT_COMMIT") or "unknown"  # set but empty counts as unset
    dirty = _run(["git", "status", "--porcelain", "--untracked-files=no"])
    return sha + ("-dirty" if dirty else "")


def machine_info(device: str) -> dict:
    """What produced the numbers: device, driver, software versions, commit, time."""
    try:
        import triton

        triton_version = triton.__version__
    except Exception:  # noqa: BLE001 - report, do not fail
        triton_version = "not importable"
    device = torch.device(device).type  # "cuda:N" -> "cuda", so the checks below (and machine_line) match
    info = {
        "device": device,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": triton_version,
        "python": platform.python_version(),
        "host": platform.node(),
        "git": git_commit(),
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }
    if device == "cuda":
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        info.update(
            gpu=props.name,
            capability=f"sm_{props.major}{props.minor}",
            sms=props.multi_processor_count,
            memory_gib=round(props.total_memory / 2**30, 1),
            l2_bytes=int(getattr(props, "L2_cache_size", 0)) or None,
        )
        drv = _run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
        info["driver"] = drv.splitlines()[0].strip() if drv else "unknown"
    else:
        info.update(gpu=None, cpu=platform.processor() or platform.machine(), driver=None)
    return info


def machine_line(info: dict) -> str:
    if info["device"] == "cuda":
        gpu = f"{info['gpu']} ({info['capability']}, {info['sms']} SMs, {info['memory_gib']} GiB)"
        return (
            f"{gpu} | driver {info['driver']} | CUDA {info['cuda']} | torch {info['torch']} | "
            f"triton {info['triton']} | git {info['git']} | {info['date']}"
        )
    return (
        f"CPU {info['cpu']} (Triton interpreter) | torch {info['torch']} | triton {info['triton']} | "
        f"git {info['git']} | {info['date']}"
    )


def make_progress(console: Console) -> Progress:
    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("eta"),
        TimeRemainingColumn(),
        console=console,
        transient=True,
    )


def _f(x, fmt: str, dash: str = "-") -> str:
    return dash if x is None else format(x, fmt)


def _us(x) -> str:
    if x is None:
        return "-"
    return f"{x:,.1f}" if x < 1000 else f"{x:,.0f}"


STATUS_STYLE = {"ok": "green", "FAIL": "bold red", "skip": "yellow", "error": "bold red"}


def rows_table(rows, *, cpu: bool, title: str | None = None) -> Table:
    """One line per (shape, kernel); the shape's cells only on its first line, shapes separated."""
    table = Table(title=title, title_style="bold", show_lines=False, pad_edge=False)
    for name, just in [
        ("B", "right"), ("n", "right"), ("H", "right"), ("prefix", "right"), ("ps", "right"), ("dtype", "left"),
        ("tree", "left"), ("kernel", "left"), ("status", "left"), ("median us" + (" (CPU)" if cpu else ""), "right"), ("±", "right"),
        ("TFLOP/s", "right"), ("TB/s", "right"), ("% floor", "right"), ("x naive", "right"), ("how", "left"),
        ("eager us", "right"), ("graph us", "right"), ("host us", "right"), ("no-plan us", "right"), ("note", "left"),
    ]:
        table.add_column(name, justify=just, overflow="fold", max_width=48 if name == "note" else None)
    last = None
    for r in rows:
        d = r.to_dict() if hasattr(r, "to_dict") else r
        key = (d["batch"], d["q_len"], d["heads"], d["prefix"], d["page_size"], d["dtype"], d.get("tree", "random"))
        if last is not None and key != last:
            table.add_section()
        first = key != last
        last = key
        shape_cells = [str(x) for x in key]
        if not first:
            shape_cells = [""] * len(key)
        st = d["status"]
        how = d["method"] or ""
        if d["method"] == "graph" and d["calls_per_sample"]:
            how = f"graph x{d['calls_per_sample']}"
        if d.get("l2_warm"):
            how += " L2"
        spread = None
        if d["median_us"] and d["p25_us"] is not None:
            spread = 100 * (d["p75_us"] - d["p25_us"]) / d["median_us"]
        note = d["note"] or ""
        if st == "FAIL":
            note = d["check"]
        note = escape(note)
        table.add_row(
            *shape_cells,
            escape(d["kernel"]),
            f"[{STATUS_STYLE.get(st, '')}]{st}[/]",
            _us(d["median_us"]),
            _f(spread, ".0f") + ("%" if spread is not None else ""),
            _f(d["tflops"], ".1f"),
            _f(d["tbps"], ".2f"),
            _f(d["pct_floor"], ".1f"),
            _f(d["speedup_vs_naive"], ".1f"),
            how,
            _us(d.get("eager_us")),
            _us(d.get("graph_us")),
            _us(d.get("host_us")),
            _us(d.get("unplanned_us")),
            note,
        )
    return table


def banner(console: Console, text: str = CPU_BANNER) -> None:
    console.print(Panel(f"[bold red]{text}[/]", border_style="red", expand=False))


def write_json(path: Path, payload: dict) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(payload, indent=1, default=str) + "\n")
    tmp.replace(path)
    return path


CSV_FIELDS = [
    "batch", "q_len", "heads", "prefix", "page_size", "dtype", "tree", "kernel", "status", "median_us", "min_us",
    "p25_us", "p75_us", "samples", "calls_per_sample", "method", "tflops", "tbps", "pct_floor", "floor_us",
    "speedup_vs_naive", "crossover_prefix", "flops", "bytes", "n_sets", "l2_warm", "max_abs_err",
    "eager_us", "graph_us", "host_us", "unplanned_us", "check", "note",
]


def write_csv(path: Path, row_dicts: list[dict], machine: dict) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        f.write(f"# {machine_line(machine)}\n")
        w = csv.DictWriter(f, fieldnames=CSV_FIELDS, extrasaction="ignore")
        w.writeheader()
        for d in row_dicts:
            w.writerow(d)
    return path


def _klabel(p: int) -> str:
    if p >= 1024 and p % 1024 == 0:
        return f"{p // 1024}k"
    if p >= 1000 and p % 1000 == 0:
        return f"{p // 1000}k"
    return str(p)


KERNEL_COLORS = {"flash": "tab:red", "naive": "tab:gray", "torch": "tab:blue", "sglang": "tab:green",
                 "flashinfer": "tab:purple"}


def write_plot(path: Path, row_dicts: list[dict], *, title: str, cpu: bool, max_groups: int = 30) -> Path | None:
    """Time and % of floor against prefix, one line per kernel, one row of panels per prefix
    series (same B, n, H, page size, dtype). Returns None when nothing was timed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    timed = [d for d in row_dicts if d["median_us"] is not None]
    if not timed:
        return None
    groups: dict[tuple, list[dict]] = {}
    for d in timed:
        groups.setdefault((d["batch"], d["q_len"], d["heads"], d["page_size"], d["dtype"], d.get("tree", "random")), []).append(d)
    # prefix series only (groups with one prefix say nothing against prefix), unless that is all
    series = [k for k in groups if len({d["prefix"] for d in groups[k]}) >= 2] or list(groups)
    keys = sorted(series)[:max_groups]
    fig, axes = plt.subplots(len(keys), 2, figsize=(12, 2.8 * len(keys) + 0.8), squeeze=False)
    for ax_t, ax_p, key in zip(axes[:, 0], axes[:, 1], keys):
        b, n, h, ps, dt, tree = key
        label = f"B={b} n={n} H={h} ps={ps} {dt}" + ("" if tree == "random" else f" {tree}")
        by_kernel: dict[str, list[dict]] = {}
        for d in groups[key]:
            by_kernel.setdefault(d["kernel"], []).append(d)
        for kernel, ds in sorted(by_kernel.items()):
            ds = sorted(ds, key=lambda d: d["prefix"])
            xs = [d["prefix"] for d in ds]
            color = KERNEL_COLORS.get(kernel)
            ax_t.plot(xs, [d["median_us"] for d in ds], marker="o", label=kernel, color=color)
            if not cpu and any(d["pct_floor"] is not None for d in ds):
                ax_p.plot(xs, [d["pct_floor"] for d in ds], marker="o", label=kernel, color=color)
        prefixes = sorted({d["prefix"] for d in groups[key]})
        for ax in (ax_t, ax_p):
            if prefixes[-1] > 1024:
                ax.set_xscale("symlog", linthresh=max(256, min(p for p in prefixes if p > 0) if any(prefixes) else 256))
            ax.set_xticks(prefixes)
            ax.set_xticklabels([_klabel(p) for p in prefixes], fontsize=7, rotation=45 if len(prefixes) > 6 else 0)
            ax.minorticks_off()
            ax.set_xlabel("prefix (tokens)")
            ax.grid(True, alpha=0.3)
            if len(prefixes) == 1:
                ax.set_xlim(prefixes[0] - 1, prefixes[0] + 1)
        ax_t.set_yscale("log")
        ax_t.set_ylabel("median us" + (" (CPU wall)" if cpu else ""))
        ax_t.set_title(label, fontsize=9)
        ax_t.legend(fontsize=8)
        if cpu:
            ax_p.text(0.5, 0.5, "no roofline on the CPU", ha="center", va="center", transform=ax_p.transAxes)
        else:
            ax_p.set_ylabel("% of roofline floor")
            ax_p.set_ylim(bottom=0)
            ax_p.set_title(label, fontsize=9)
            if ax_p.lines:
                ax_p.legend(fontsize=8, loc="best")
    fig.suptitle(title, fontsize=10, color="red" if cpu else "black")
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.35 / fig.get_figheight()))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
