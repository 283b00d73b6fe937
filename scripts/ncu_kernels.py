"""Each kernel of a FlashMLA call and of ours (the Hopper kernel unfused: kernel + combine kernel,
as a call of many split groups runs; and fused: one kernel that merges its splits itself), timed
apart by Nsight Compute.

    ncu [--clock-control none --cache-control none] --metrics gpu__time_duration.sum --csv \
        -k regex:"mla|verify|combine" python3 scripts/ncu_kernels.py 16x9x4x16384,... [--flashmla DIR] > ncu.csv

(``PYTHONPATH=src``; ``--flashmla``: the folder of FlashMLA's loader, as ``kdtree bench --flashmla``
takes it, default ``.peers/flashmla``.)
Shapes ``H x nodes x B x prefix``, page 64, random inputs (``scripts/tune_flash.equal_step``);
FlashMLA runs its causal mask (a chain tree) on the same KV, ours the inputs' random trees (the same
work, perf log run 31). Per shape, twice: FlashMLA (metadata once, then its main and combine
kernels), ours unfused, ours fused. The bench's graph replay cannot split a call into its
kernels; ncu can (serialised, so FlashMLA's combine no longer overlaps its main kernel's tail
through PDL: the sum of its two kernels is an upper bound of its call). With ncu's default
``--clock-control base`` every kernel runs at the same locked clock (cycles compared); with
``none`` at the clock it gets (perf log run 39).

``--metrics-list`` prints the metrics the step comparisons read (cycles, instructions, tensor pipe,
L2 and DRAM traffic, each stall reason a issue; perf log runs 42 and 45) for ncu's ``--metrics``:

    ncu --clock-control none --csv --metrics $(python3 scripts/ncu_kernels.py --metrics-list) -k ...

``--table NCU.csv SHAPES`` reads such a CSV back (no GPU): one line per metric, one column per
profiled launch, each named by its shape (the launches of a shape in the order this script makes
them, as many per shape as the CSV holds over the shapes given) and its kernel: FlashMLA's, ours
unfused and fused (in that order in each round), or the name of another.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from ab_hopper import MERGE_FORMS, planned_call  # noqa: E402
from hopper_cuda_verify import CudaKernel  # noqa: E402
from tune_flash import empty_outputs, equal_step  # noqa: E402

from kdtree_engine.bench.flashmla import load_flashmla_module  # noqa: E402
from kdtree_engine.bench.peers import Unavailable  # noqa: E402
from kdtree_engine.verify import hopper  # noqa: E402


STALLS = ("barrier", "branch_resolving", "dispatch_stall", "drain", "gmma", "imc_miss", "lg_throttle",
          "long_scoreboard", "math_pipe_throttle", "membar", "mio_throttle", "misc", "no_instruction", "not_selected",
          "selected", "short_scoreboard", "sleeping", "tex_throttle", "wait")
STEP_METRICS = (
    "gpu__time_duration.sum", "gpc__cycles_elapsed.max", "sm__cycles_active.avg", "smsp__inst_executed.sum",
    "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active",
    "lts__throughput.avg.pct_of_peak_sustained_elapsed",
    "lts__t_sectors.sum", "lts__t_sectors_srcunit_tex.sum", "lts__t_sectors_srcunit_tex_op_read.sum",
    "lts__t_sectors_srcunit_tex_op_write.sum", "lts__t_sectors_srcunit_ltcfabric.sum",
    "lts__t_sectors_srcunit_ltcfabric.avg.pct_of_peak_sustained_elapsed",
    "lts__t_sectors_srcunit_tex_op_read_lookup_miss.sum", "lts__t_sector_op_read_hit_rate.pct",
    "l1tex__m_xbar2l1tex_read_bytes.sum", "dram__bytes_read.sum",
    "gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed",
    "l1tex__data_pipe_lsu_wavefronts_mem_shared.sum", "smsp__issue_active.avg.pct_of_peak_sustained_active",
    "gcc__cache_requests_type_instruction.sum.pct_of_peak_sustained_elapsed",
    *(f"smsp__average_warps_issue_stalled_{s}_per_issue_active.ratio" for s in STALLS))


def table(csv_path: str, shapes: list[str]) -> list[str]:
    """The lines of ``--table``: ncu's ``--csv`` rows (``"ID","Process ID",...,"Metric Value"``; the
    program's own output before them skipped) as metric x launch, launches named ``shape kernel``."""
    import csv

    with open(csv_path) as f:
        rows = list(csv.DictReader(line for line in f if line.startswith('"')))
    launches = sorted({int(r["ID"]) for r in rows})
    if not launches or len(launches) % len(shapes):
        raise ValueError(f"{csv_path}: {len(launches)} profiled launches do not divide among {len(shapes)} shapes")
    per_shape = len(launches) // len(shapes)
    kernel = {int(r["ID"]): r["Kernel Name"] for r in rows}
    names, ours_seen = [], 0
    for i, k in enumerate(launches):
        if i % per_shape == 0:
            ours_seen = 0
        if "flash_fwd" in kernel[k]:
            name = "flashmla"
        elif "_hopper_verify_kernel" in kernel[k]:  # each round runs ours unfused, then fused
            name, ours_seen = ("unfused", "fused")[ours_seen % 2], ours_seen + 1
        else:
            name = kernel[k].strip("_")[:24]
        names.append(f"{shapes[i // per_shape]} {name}")
    value = {(int(r["ID"]), r["Metric Name"]): r["Metric Value"].replace(",", "") for r in rows}
    metrics = list(dict.fromkeys(r["Metric Name"] for r in rows))
    lines = ["metric\t" + "\t".join(names)]
    lines += [m + "\t" + "\t".join(value.get((k, m), "-") for k in launches) for m in metrics]
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("shapes", nargs="?", help="H x nodes x B x prefix, comma-separated")
    p.add_argument("--flashmla", default=".peers/flashmla", help="folder holding flashmla_peer.py")
    p.add_argument("--cuda", action="append", default=[], metavar="FLAGS",
                   help="also the CUDA C++ kernel (hopper_cuda.cu, fused) built with nvcc FLAGS, after ours; repeatable "
                   "(its kernel is named verify_kernel)")
    p.add_argument("--metrics-list", action="store_true", help="print the step comparisons' metrics, comma-separated, "
                   "and exit")
    p.add_argument("--table", metavar="NCU_CSV", help="print ncu's CSV of a run over SHAPES as metric x launch, and exit")
    a = p.parse_args()
    if a.metrics_list:
        print(",".join(STEP_METRICS))
        return
    if a.table:
        if a.shapes is None:
            p.error("--table needs the shapes the CSV was made with")
        try:
            print("\n".join(table(a.table, a.shapes.split(","))))
        except (OSError, ValueError, KeyError) as e:
            p.error(f"--table: {e}")
        return
    if a.shapes is None:
        p.error("the shapes are required (or --metrics-list)")
    try:
        fm = load_flashmla_module(a.flashmla)
    except Unavailable as e:
        p.error(str(e))
    for text in a.shapes.split(","):
        H, n, B, prefix = (int(x) for x in text.split("x"))
        c, plan = equal_step(H, n, B, prefix, 64)
        meta, num_splits = fm.get_mla_metadata(c["kv_lens"], n, H, 1)
        num_pages = c["kv_cache"].shape[0]
        out, lse = empty_outputs(c["q"])
        unfused = planned_call(hopper, c, plan, out, lse, max_fused_groups=MERGE_FORMS["unfused"])
        fused = planned_call(hopper, c, plan, out, lse, max_fused_groups=MERGE_FORMS["fused"])
        cuda = [planned_call(CudaKernel(flags), c, plan, out, lse) for flags in a.cuda]
        for _ in range(2):
            fm.dense_decode_fwd(c["q"].view(B, n, H, -1), c["kv_cache"].view(num_pages, 64, 1, -1), 512,
                                c["kv_lens"], c["page_table"], 1 / math.sqrt(576), True, meta, num_splits)
            unfused()
            fused()
            for call in cuda:
                call()
        torch.cuda.synchronize()
        print(f"shape {text}: FlashMLA splits {int(num_splits[-1])}, our plan's split groups {plan.num_groups}",
              flush=True)


if __name__ == "__main__":
    main()
