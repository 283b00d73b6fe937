"""How fast the GPU reads a KV cache's rows in the order a page table gives: the ceiling of a verify
kernel whose time is the KV's traffic (few row blocks a sequence, e.g. 16 heads x 9 nodes).

    PYTHONPATH=src python scripts/gather_bandwidth.py [--rows 524324] [--page-sizes 1,64] [--json out.json]

Reads ``--rows`` rows of 576 bf16 (a sequence's KV, 1,152 B a row) once each, through a row index
built as ``scripts/tune_flash.make_inputs`` builds the page table (pages of ``page_size`` rows
shuffled over the pool; page size 0: the rows in order), by a persistent Triton kernel that sums
what it loads (no writes: read traffic only), and prints the rate in TB/s (graph replay, median).
Compare a kernel's bytes / time at the same layout with these (perf log run 44).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).parent))
from tune_flash import time_graph  # noqa: E402

D = 576


@triton.jit
def _gather_sum(kv, rows, out, n_rows, D: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """Program p sums rows ``rows[p * BLOCK_R + k * grid * BLOCK_R + [0, BLOCK_R)]`` of ``kv [*, D]``."""
    acc = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
    o_d = tl.arange(0, BLOCK_D)
    for r0 in range(tl.program_id(0) * BLOCK_R, n_rows, tl.num_programs(0) * BLOCK_R):
        o_r = r0 + tl.arange(0, BLOCK_R)
        m_r = o_r < n_rows
        p_row = kv + tl.load(rows + o_r, mask=m_r, other=0).to(tl.int64) * D
        for d0 in tl.static_range(0, D, BLOCK_D):
            acc += tl.load(p_row[:, None] + d0 + o_d[None, :], mask=m_r[:, None], other=0.0).to(tl.float32)
    tl.store(out + tl.program_id(0), tl.sum(acc))


def row_index(n_rows: int, page_size: int) -> torch.Tensor:
    """The cache row of each KV position: pages of ``page_size`` rows in a random order (0: in order)."""
    if page_size == 0:
        return torch.arange(n_rows, device="cuda", dtype=torch.int32)
    pages = -(-n_rows // page_size)
    perm = torch.randperm(pages, device="cuda").to(torch.int32)
    return (perm[:, None] * page_size + torch.arange(page_size, device="cuda", dtype=torch.int32)).flatten()[:n_rows]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=4 * 131081, help="rows read (default: 4 sequences of 131072 + 9)")
    p.add_argument("--page-sizes", default="0,1,64")
    p.add_argument("--json")
    a = p.parse_args()
    torch.manual_seed(0)
    kv = torch.randn(-(-a.rows // 64) * 64, D, device="cuda", dtype=torch.bfloat16)
    grid = torch.cuda.get_device_properties(0).multi_processor_count * 8
    out = torch.empty(grid, device="cuda", dtype=torch.float32)
    results = []
    for page_size in (int(x) for x in a.page_sizes.split(",")):
        rows = row_index(a.rows, page_size)
        seconds = time_graph(lambda: _gather_sum[(grid,)](kv, rows, out, a.rows, D=D, BLOCK_R=32, BLOCK_D=64,
                                                          num_warps=4))
        tbps = a.rows * D * 2 / seconds / 1e12
        results.append(dict(page_size=page_size, rows=a.rows, us=seconds * 1e6, tbps=tbps))
        print(f"page size {page_size or 'in order'}: {a.rows * D * 2 / 1e6:.0f} MB in {seconds * 1e6:.1f} us, "
              f"{tbps:.2f} TB/s", flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
