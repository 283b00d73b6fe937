"""A/B of a variant of the Hopper kernel against this tree's, in one process on the same plans.

    PYTHONPATH=src python scripts/ab_hopper.py VARIANT.py [--shapes 64x33x4x131072x64,...] [--rounds 3] [--json ab.json]

``VARIANT.py``: a whole ``verify/hopper.py`` (e.g. ``git show hopper-pbuf:src/kdtree_engine/verify/hopper.py
> ab/hopper_pbuf.py``, a path that travels to the GPU machine with the working tree). Both are
prepared on the same plan, inputs and outputs through their own ``prepare`` (kernel + combine), each
checked against the float64 reference on the first sequence (bf16 tolerances), the two outputs
compared (bitwise equal or not, largest difference), then timed alternately: ``--rounds`` rounds of a
CUDA-graph replay median each, the fastest round per kernel reported, so drift between calls of the
machine hits both. Prints a table of us and variant / base per shape.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from hopper_timeline import module_from_source  # noqa: E402
from tune_flash import make_inputs, time_graph  # noqa: E402

from kdtree_engine import reference  # noqa: E402
from kdtree_engine.testing import TOLERANCES, compare  # noqa: E402
from kdtree_engine.verify import hopper  # noqa: E402
from kdtree_engine.verify.plan import plan_verify  # noqa: E402

SHAPES = ("64x33x4x131072x64,128x33x1x16384x64,64x9x1x131072x64,16x9x4x16384x64,128x9x4x131072x64,"
          "16x33x1x131072x64,64x33x4x16384x1")


def planned_call(module, c, plan, out, lse):
    """One planned call of ``module``'s kernel (+ combine) on the inputs ``c``."""
    tensors = (c["q"], c["kv_cache"], c["page_table"], c["kv_lens"], c["qo_indptr"], c["tree_mask"], out, lse)
    launch = module.prepare(*tensors[:6], 1.0 / math.sqrt(576), out, lse, plan.tables)
    ptrs = tuple(t.data_ptr() for t in tensors)
    return lambda: launch(tensors, ptrs, plan.num_groups)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("variant", help="a whole verify/hopper.py")
    p.add_argument("--shapes", default=SHAPES, help="H x nodes x B x prefix x page size, comma-separated")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json")
    a = p.parse_args()
    variant = module_from_source(Path(a.variant).read_text(), "hopper_variant")
    rows = []
    print(f"{'shape':>22} | {'base us':>9} {'variant':>9} {'ratio':>6} | base ok variant ok | outputs")
    for text in a.shapes.split(","):
        H, n, B, prefix, ps = (int(x) for x in text.split("x"))
        c = make_inputs(H, n, B, prefix, ps)
        plan = plan_verify([prefix + n] * B, list(range(0, B * n + 1, n)), H, "cuda")
        ref_out, ref_lse = reference(c["q"][:n], c["kv_cache"], c["page_table"][:1], c["kv_lens"][:1],
                                     c["qo_indptr"][:2], c["tree_mask"][:n])
        res = {}
        for name, module in (("base", hopper), ("variant", variant)):
            out = torch.empty(B * n, H, 512, device="cuda", dtype=torch.bfloat16)
            lse = torch.empty(B * n, H, device="cuda", dtype=torch.float32)
            call = planned_call(module, c, plan, out, lse)
            call()
            torch.cuda.synchronize()
            ok = (compare(out[:n], ref_out, *TOLERANCES["bf16"]["out"]).ok
                  and compare(lse[:n], ref_lse, *TOLERANCES["bf16"]["lse"]).ok)
            res[name] = dict(call=call, out=out, lse=lse, ok=ok, us=[])
        for _ in range(a.rounds):
            for name in ("base", "variant"):
                res[name]["us"].append(time_graph(res[name]["call"]) * 1e6)
        base, var = res["base"], res["variant"]
        equal = torch.equal(base["out"], var["out"]) and torch.equal(base["lse"], var["lse"])
        diff = (base["out"].float() - var["out"].float()).abs().max().item()
        row = dict(shape=text, base_us=min(base["us"]), variant_us=min(var["us"]), base_rounds=base["us"],
                   variant_rounds=var["us"], base_ok=base["ok"], variant_ok=var["ok"], bitwise_equal=equal,
                   max_out_diff=diff)
        row["ratio"] = row["variant_us"] / row["base_us"]
        rows.append(row)
        print(f"{text:>22} | {row['base_us']:9.1f} {row['variant_us']:9.1f} {row['ratio']:6.3f} | "
              f"{'PASS' if base['ok'] else 'FAIL':>7} {'PASS' if var['ok'] else 'FAIL':>10} | "
              f"{'bitwise equal' if equal else f'max |diff| {diff:.3g}'}", flush=True)
        del c, res
        torch.cuda.empty_cache()
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
