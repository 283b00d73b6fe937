"""A small flash + combine launch for compute-sanitizer (memcheck, racecheck, initcheck, synccheck).

    compute-sanitizer --tool memcheck python3 scripts/sanitize_flash.py
Ragged batch, page sizes 1 and 16, forced KV splits (so the combine kernel runs), a tree
crossing a split boundary; checks the result against the float64 reference too.
"""

import torch

from kdtree_engine import reference, verify_attention
from kdtree_engine.testing import TOLERANCES, CaseSpec, build_case, compare, random_tree
from kdtree_engine.verify.flash import plan_verify

gen = torch.Generator().manual_seed(0)
for page_size in (1, 16):
    spec = CaseSpec("sanitize", 5, [300, 0, 70], [random_tree(9, gen), random_tree(40, gen), [-1]],
                    page_size=page_size)
    c = build_case(spec, "cuda")
    plan = plan_verify(c["kv_lens"].cpu(), c["qo_indptr"].cpu(), 5, "cuda", num_splits=3)
    for kernel in ("flash", "naive"):
        out, lse = verify_attention(**c, kernel=kernel, plan=plan if kernel == "flash" else None)
        torch.cuda.synchronize()
        r_out, r_lse = reference(**c)
        ok = compare(out, r_out, *TOLERANCES["bf16"]["out"]).ok and compare(lse, r_lse, *TOLERANCES["bf16"]["lse"]).ok
        print(f"{'PASS' if ok else 'FAIL'} sanitize case page_size={page_size} kernel={kernel}")
        assert ok
