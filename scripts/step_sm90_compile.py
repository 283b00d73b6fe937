"""Compile the engine step's fused Triton kernels for sm_90a without a GPU, and print registers and spills.

The KV pool's step-inputs kernel (``kdtree_engine.kvpool.kernels``) at the demo's sizes (B = 4,
page 16, a 131072-token prompt's page-table row) and at awkward ones (B = 1, one-node trees,
a 1024-node tree), and the step's record kernel (``kdtree_engine.model.step_kernels``, V = 163840
float32 and bfloat16 logits, V = 2), with the constexprs their launchers pick
(``step_inputs_constexprs``, ``record_constexprs``):

    PYTHONPATH=src python scripts/step_sm90_compile.py

Needs a Triton with the NVIDIA backend (no GPU, no CUDA driver); exit status 1 if one fails.
Uses :func:`ddtree_sm90_compile.report` (this directory).
"""

from __future__ import annotations

import sys

from ddtree_sm90_compile import report

from kdtree_engine.kvpool import kernels as K
from kdtree_engine.masks import mask_words
from kdtree_engine.model import step_kernels as S

STEP_TYPES = dict(
    rows="*i64", tokens="*i64", parents="*i64", depths="*i64", num_nodes="*i64", table="*i32", lens="*i32",
    tree="*i32", out_tokens="*i64", out_pos="*i64", out_slots="*i64", out_pages="*i32", out_lens="*i32",
    out_qo="*i32", out_mask="*i32", num_seqs="i32", width="i32", max_depth="i32", stride_tree="i32",
    stride_t="i32", num_cols="i32",
)

CASES = [(f"_step_inputs_kernel (B={B}, n={n}, {cols} page columns, page {ps})", K._step_inputs_kernel, STEP_TYPES,
          K.step_inputs_constexprs(B, n, cols, ps, mask_words(n)), 4)
         for B, n, cols, ps in [(4, 1, 8200, 16), (4, 17, 8200, 16), (1, 1, 1, 1), (64, 33, 2049, 64),
                                (2, 1024, 300, 1)]]

RECORD_TYPES = dict(
    logits="*fp32", qo_indptr="*i32", accepted="*i64", lengths="*i64", new_tokens="*i64", rows="*i64",
    history="*i64", hist_len="*i64", results="*i64", top2="*fp32", part="*fp32", count="*i32", vocab="i32",
    width="i32", stride_row="i32", stride_acc="i32", stride_new="i32", stride_hist="i32",
)
CASES += [(f"_record_kernel (V={V}, {dt}, {A} tokens per sequence)", S._record_kernel,
           dict(RECORD_TYPES, logits=f"*{dt}", top2=f"*{dt}"),
           S.record_constexprs(V, A), 4)
          for V, dt, A in [(163840, "fp32", 1), (163840, "fp32", 7), (163840, "bf16", 7), (2, "fp32", 1)]]


def main() -> int:
    return 1 if report(CASES) else 0


if __name__ == "__main__":
    sys.exit(main())
