"""Compile the n-gram drafter's Triton kernels for sm_90a without a GPU; print registers and spills.

    PYTHONPATH=src python scripts/ngram_sm90_compile.py

At C = 131072 history columns, V = 163840, L = 16, max_ngram 4, max_matches 8 (the defaults).
Needs a Triton with the NVIDIA backend; exit status 1 if one fails.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from ddtree_sm90_compile import report  # noqa: E402

from kdtree_engine.model import ngram_kernels as N  # noqa: E402

C, V, L, K, M = 131072, 163840, 16, 4, 8
NC = C // N.MATCH_BLOCK
HIST = dict(history="*i64", lengths="*i64", cbest="*i32", cpos="*i32", stride_h="i32", stride_n="i32",
            num_chunks="i32")
CASES = [
    ("ngram match", N._match_kernel, HIST, dict(K=K, M=M, BLOCK=N.MATCH_BLOCK, BLOCK_M=M), 4),
    ("ngram vote", N._vote_kernel, dict(HIST, ws_tok="*i64", ws_lp="*fp32"),
     dict(MIN_NGRAM=1, M=M, L=L, A_BITS=N._bits64(0.95), C_BITS=N._bits64(0.05 / V), BLOCK_NC=NC, BLOCK_M=M,
          BLOCK_L=L), 4),
    ("ngram fill", N._fill_kernel, dict(ws_tok="*i64", ws_lp="*fp32", out="*fp32", vocab="i32"),
     dict(M=M, FILL_BITS=N._bits32(math.log(0.05 / V)), BLOCK_V=N.FILL_BLOCK_V, BLOCK_M=M), 4),
]

if __name__ == "__main__":
    sys.exit(1 if report(CASES) else 0)
