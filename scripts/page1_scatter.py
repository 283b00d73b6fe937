"""Where page 1's extra time at large pools comes from (perf log run 36: at B = 4 x 131072 the
Hopper kernel took 1.12-1.17x its page-64 time on page-1 caches scattered by ``randperm``, while
at 4 x 16384 the two were equal): the kernel on the same KV rows in three layouts,

- ``page64``: pages of 64 scattered over the pool (the bench's layout),
- ``page1-ordered``: pages of 1, sequence b's token i in slot ``b * L + i`` (page 1's code path,
  a contiguous pool's memory),
- ``page1-scattered``: pages of 1, every token in a random slot (the bench's page-1 layout),

each replayed from a CUDA graph on its own plan-reusing ``VerifyAttention``, in rounds that rotate
the order, the fastest round per layout reported with its ratio to ``page64``. ``page1-ordered``
near 1.0 and ``page1-scattered`` above it: the cost is the scatter (the memory system), not page
1's loader. All three outputs are compared (same rows, same order of the sums: bitwise equal).

Beside each layout, its read floor: the time a plain Triton kernel takes to read every KV row of
the sequences once through that layout's row addresses (in token order, 16-byte vectors, nothing
else done; timed the same way), and the bandwidth that makes. The Hopper kernel reads each row from
HBM at least once, so its time over this floor says how close to the memory system's limit for
that layout it runs: where the scattered floor itself is the larger part of the kernel's time, page 1
cannot match page 64 at that shape by any kernel that reads the rows where they lie.

    PYTHONPATH=src python3 scripts/page1_scatter.py [--shapes 64x9x4x131072,64x9x4x16384] [--rounds 3] [--calls 8]
        [--latency-probe]
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tune_flash import empty_outputs, make_inputs, time_graph  # noqa: E402

from kdtree_engine import VerifyAttention  # noqa: E402
from kdtree_engine.cliargs import int_in  # noqa: E402


@triton.jit
def _read_rows(kv, rows, n_rows, out, D: tl.constexpr, BLOCK: tl.constexpr, COLS: tl.constexpr):
    """Read rows ``kv[rows[i]]`` (``D`` = 9 x 64 columns) for i in ``[0, n_rows)``, programs striding
    over blocks of ``BLOCK``, ``COLS`` columns a load (64: a warp's 16-byte vectors span 4 rows of
    128 bytes; 256: one row's 512 bytes, the rest of the row in 64); one float a program stored
    (their sum), so nothing but the reads costs."""
    pid = tl.program_id(0)
    o_c = tl.arange(0, COLS)
    o_t = tl.arange(0, 64)
    acc = tl.zeros([BLOCK, COLS], tl.float32)
    acc_t = tl.zeros([BLOCK, 64], tl.float32)
    for start in range(pid * BLOCK, n_rows, tl.num_programs(0) * BLOCK):
        o_r = start + tl.arange(0, BLOCK)
        m_r = o_r < n_rows
        p_row = kv + tl.load(rows + o_r, mask=m_r, other=0) * D
        for c in tl.static_range(D // COLS):
            acc += tl.load(p_row[:, None] + c * COLS + o_c[None, :], mask=m_r[:, None], other=0.0).to(tl.float32)
        for c in tl.static_range((D % COLS) // 64):
            acc_t += tl.load(p_row[:, None] + (D // COLS) * COLS + c * 64 + o_t[None, :], mask=m_r[:, None],
                             other=0.0).to(tl.float32)
    tl.store(out + pid, tl.sum(acc) + tl.sum(acc_t))


def read_time(kv: torch.Tensor, pt: torch.Tensor, B: int, L: int, reps: int, per_sm: int = 8, cols: int = 64) -> float:
    """Seconds to read the ``B x L`` tokens' rows of ``kv [slots / page, page, 576]`` once through the
    page table ``pt [B, pages]`` (:func:`_read_rows` on the rows' flat slot indices, ``per_sm``
    programs of 4 warps an SM, graph replay). At 8 an SM it is the layout's read floor; at 1 too few
    rows are in flight to cover the memory's latency, so the time follows each load's latency."""
    page = kv.shape[1]
    tok = torch.arange(L, device="cuda")
    rows = (pt.long()[:, tok // page] * page + tok % page).reshape(-1)  # [B * L] flat slots
    out = torch.empty(torch.cuda.get_device_properties(0).multi_processor_count * per_sm, device="cuda")
    return time_graph(lambda: _read_rows[(out.numel(),)](kv, rows, rows.numel(), out, D=576, BLOCK=16, COLS=cols),
                      reps)


def layouts(c: dict, B: int, L: int) -> dict:
    """The page-64 cache of ``c`` and the same rows in pages of 1, ordered and scattered."""
    kv64, pt64 = c["kv_cache"], c["page_table"].long()
    pages = math.ceil(L / 64)
    rows = kv64[pt64].view(B, pages * 64, 576)[:, :L].reshape(B * L, 1, 576)  # [B * L, 1, 576] in token order
    ordered = torch.arange(B * L, device="cuda", dtype=torch.int32).view(B, L)
    perm = torch.randperm(B * L, device="cuda")
    scattered = torch.empty_like(rows)
    scattered[perm] = rows
    return {"page64": (kv64, c["page_table"]), "page1-ordered": (rows, ordered),
            "page1-scattered": (scattered, perm.to(torch.int32).view(B, L))}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="64x9x4x131072,128x9x4x131072,64x9x4x16384",
                   help="H x nodes x B x prefix, comma-separated")
    p.add_argument("--rounds", type=int_in(1), default=3)
    p.add_argument("--reps", type=int_in(1), default=30, help="graph replays a round (median)")
    p.add_argument("--calls", type=int_in(1), default=1,
                   help="kernel calls a graph holds, back to back (the read floors keep 1): 8 keep the card "
                        "busy long enough to reach its power limit where a shape's work draws it there "
                        "(perf log run 62)")
    p.add_argument("--latency-probe", action="store_true",
                   help="also read every layout's rows with one program an SM (latency-bound), 64 and 256 "
                        "columns a load: whether a warp's load spanning 4 scattered rows waits longer than "
                        "one spanning 1 (one page translation against four)")
    a = p.parse_args()
    print(f"{torch.cuda.get_device_name()}: the Hopper kernel, CUDA-graph replay ({a.calls} call(s) a graph), "
          f"fastest of {a.rounds} rounds")
    for shape in a.shapes.split(","):
        H, n, B, prefix = (int(x) for x in shape.split("x"))
        L = prefix + n
        c = make_inputs(H, n, [L] * B, 64)
        attn = VerifyAttention(B, n, H, "cuda", kernel="hopper")
        attn.plan(c["kv_lens"].cpu(), c["qo_indptr"].cpu())
        outs, calls, floors, probes = {}, {}, {}, {}
        for name, (kv, pt) in layouts(c, B, L).items():
            floors[name] = read_time(kv, pt, B, L, a.reps) * 1e6
            if a.latency_probe:
                probes[name] = [read_time(kv, pt, B, L, a.reps, per_sm=1, cols=cols) * 1e6 for cols in (64, 256)]
            out, lse = empty_outputs(c["q"])
            calls[name] = (lambda kv=kv, pt=pt, out=out, lse=lse, q=c["q"], mask=c["tree_mask"], attn=attn:
                           attn.run(q, kv, pt, mask, out=out, lse=lse))
            calls[name]()
            outs[name] = (out, lse)
        names = list(calls)
        best = {name: float("inf") for name in names}
        for r in range(a.rounds):
            for name in names[r % len(names):] + names[:r % len(names)]:
                best[name] = min(best[name], time_graph(calls[name], a.reps, a.calls) * 1e6)
        base = outs["page64"]
        line = "  ".join(f"{name} {best[name]:9.1f} us ({best[name] / best['page64']:.3f})" for name in names)
        same = all(torch.equal(outs[k][0], base[0]) and torch.equal(outs[k][1], base[1]) for k in names)
        print(f"{shape}: {line}  outputs {'bitwise equal' if same else 'DIFFER'}", flush=True)
        pool = B * L * 576 * 2
        print("  read floor: " + "  ".join(f"{name} {floors[name]:9.1f} us ({pool / floors[name] / 1e6:.2f} TB/s, "
                                           f"kernel / floor {best[name] / floors[name]:.2f})" for name in names),
              flush=True)
        if probes:
            print("  one program an SM, 64 / 256 columns a load: " + "  ".join(
                f"{name} {us64:.1f} / {us256:.1f} us ({us256 / us64:.3f})" for name, (us64, us256) in probes.items()),
                flush=True)
        del c, attn, outs, calls
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
