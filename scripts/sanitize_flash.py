"""Small launches of every kernel this GPU runs (flash, hopper on sm_90, naive) and the combine,
for compute-sanitizer (memcheck, racecheck, initcheck, synccheck).

    compute-sanitizer --tool memcheck python3 scripts/sanitize_flash.py
Ragged batch, page sizes 1, 16 and 64 (the Hopper loader's L2 prefetch runs of a row, a page and a
tile), one program running every segment in turn and grids that cut KV ranges mid-sequence (their
splits merged: the Hopper kernel at 12 programs merges 2 split groups in its default tile, at 40 in
its few-groups tile), a tree crossing a cut; checks the result against the float64 reference too.
Then one sequence without a plan, which the flash and Hopper kernels schedule themselves
(``VerifyPlan._plan_in_kernel``: 5 KV parts, their split groups written by the kernel and merged).
"""

import torch

from kdtree_engine import reference, verify_attention
from kdtree_engine.testing import TOLERANCES, CaseSpec, build_case, compare, random_tree
from kdtree_engine.verify import available_kernels, plan_verify


def check(c, kernel, plan, r_out, r_lse, what):
    out, lse = verify_attention(**c, kernel=kernel, plan=plan)
    torch.cuda.synchronize()
    ok = compare(out, r_out, *TOLERANCES["bf16"]["out"]).ok and compare(lse, r_lse, *TOLERANCES["bf16"]["lse"]).ok
    print(f"{'PASS' if ok else 'FAIL'} sanitize case {what}")
    assert ok


gen = torch.Generator().manual_seed(0)
for page_size in (1, 16, 64):
    spec = CaseSpec("sanitize", 5, [300, 0, 70], [random_tree(9, gen), random_tree(40, gen), [-1]],
                    page_size=page_size)
    c = build_case(spec, "cuda")
    r_out, r_lse = reference(**c)
    runs = available_kernels("cuda")
    for kernel, programs in (("flash", 1), ("flash", 4), ("hopper", 1), ("hopper", 12), ("hopper", 40), ("naive", None)):
        if kernel not in runs:
            continue
        plan = plan_verify(c["kv_lens"].cpu(), c["qo_indptr"].cpu(), 5, "cuda", num_programs=programs) if programs else None
        check(c, kernel, plan, r_out, r_lse, f"page_size={page_size} kernel={kernel} programs={programs}")
    one = build_case(CaseSpec("sanitize-one", 5, [300], [random_tree(9, gen)], page_size=page_size), "cuda")
    r_out, r_lse = reference(**one)
    for kernel in ("flash", "hopper"):
        if kernel in runs:
            check(one, kernel, None, r_out, r_lse, f"page_size={page_size} kernel={kernel} one sequence, no plan")
