"""Compile every DDTree Triton kernel for sm_90a without a GPU, and print registers and spills.

The CPU tests run the kernels through Triton's interpreter, which accepts code the compiler
rejects (a non-constexpr global, for one). This compiles each kernel of
``kdtree_engine.ddtree.kernels`` with the constexprs its launcher picks at the issue-13 sizes
(V = 163840, L = 16, budget 512, K = 512, top-k 50; the
split top-K's slice of 16384 columns and K = 512 and 1023) and runs the bundled ``ptxas -v`` on the PTX:

    PYTHONPATH=src python scripts/ddtree_sm90_compile.py

(``TRITON_PTXAS_PATH`` names another ptxas, e.g. a CUDA toolkit's, for this and for every script
that compiles through :func:`compile_sm90`; the SASS is still disassembled by the bundled cuobjdump.)

Needs a Triton with the NVIDIA backend (no GPU, no CUDA driver); exit status 1 if one fails.
"""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.experimental.gluon._runtime import GluonASTSource, GluonJITFunction

from ptx_grid_wait import accesses_before_grid_wait
from sass_loops import disassemble, wgmma_loops

from kdtree_engine.ddtree import kernels as K
from kdtree_engine.ddtree.tree import _pair_table


BAR_SYNC = re.compile(r"\bbar\.sync\b")  # partition barriers in the PTX (docs/hopper.md)
WGMMA_SERIALIZED = re.compile(r"\((C75\d\d)\)[^\n]*wgmma[^\n]*serialized")  # ptxas gave up pipelining the wgmmas


def compile_sm90(fn, types: dict, consts: dict, num_warps: int, divisible_ints: bool | frozenset = True,
                 sass: Path | None = None) -> str:
    """ptxas's figures for ``fn`` with argument ``types`` (``"*i64"``, ``"i32"``, ..) and ``consts``.

    Every pointer is taken as 16-byte aligned, and (``divisible_ints``) every int argument the
    kernel does not exclude from specialisation (``vocab``, the logits' row stride) as divisible by
    16, as at V = 163840; or only the int arguments named (a set). ``sass``: also write the SASS
    there (the bundled ``cuobjdump -sass``) and add its wgmma loops' sizes and orders (:func:`wgmma_loops`)."""
    names = fn.arg_names
    sig = {n: ("constexpr" if n in consts else types[n]) for n in names}
    fixed = set(fn.do_not_specialize) | {names[i] for i in fn.do_not_specialize if isinstance(i, int)}
    aligned = [n for n in names if n not in consts and n not in fixed and types[n] != "fp32"
               and (divisible_ints is True or types[n].startswith("*")
                    or (divisible_ints is not False and n in divisible_ints))]
    source = GluonASTSource if isinstance(fn, GluonJITFunction) else ASTSource
    src = source(fn, sig, constexprs={(names.index(n),): v for n, v in consts.items()},
                 attrs={(names.index(n),): [["tt.divisibility", 16]] for n in aligned})
    ck = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=num_warps))
    ptxas = Path(triton.knobs.nvidia.ptxas.path)  # the bundled one, or TRITON_PTXAS_PATH
    with tempfile.TemporaryDirectory() as d:
        Path(d, "k.ptx").write_text(ck.asm["ptx"])
        r = subprocess.run([str(ptxas), "-v", "--gpu-name=sm_90a", f"{d}/k.ptx", "-o", f"{d}/k.cubin"],
                           capture_output=True, text=True, check=True)
        if sass is not None:
            sass.write_text(disassemble(Path(d, "k.cubin")))
    regs = re.search(r"Used (\d+) registers", r.stderr)
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", r.stderr)
    stack = re.search(r"(\d+) bytes stack frame", r.stderr)
    return (f"regs {regs.group(1) if regs else '?'}, spill stores {spill.group(1) if spill else '?'} B, "
            f"spill loads {spill.group(2) if spill else '?'} B, stack {stack.group(1) if stack else '?'} B, "
            f"shared {ck.metadata.shared} B, bar.sync {len(re.findall(BAR_SYNC, ck.asm['ptx']))}"
            + "".join(f", WGMMAS SERIALIZED (ptxas info {code})" for code in re.findall(WGMMA_SERIALIZED, r.stderr))
            + _grid_wait_report(ck.asm["ptx"])
            + ("" if sass is None else "".join(f"\n     {loop}" for loop in wgmma_loops(sass.read_text()))))


def _grid_wait_report(ptx: str) -> str:
    """For a kernel that waits for the grid before it (``griddepcontrol.wait``): its global accesses all
    after the wait, or a ``GLOBAL ACCESS BEFORE THE GRID WAIT`` error (:func:`accesses_before_grid_wait`)."""
    if "griddepcontrol.wait" not in ptx:
        return ""
    total, early = accesses_before_grid_wait(ptx)
    if early:
        raise RuntimeError(f"GLOBAL ACCESS BEFORE THE GRID WAIT ({len(early)} of {total}): " + "; ".join(early[:5]))
    return f", {total} global accesses all after griddepcontrol.wait"


WALK_TYPES = dict(
    tok="*i64", par="*i64", num_nodes="*i64", tgt="*i64", starts="*i64", temp="*fp32", top_p="*fp32",
    seed="*i64", buf_v="*fp32", buf_i="*i32", acc="*i64", acc_tok="*i64", new_tok="*i64", lengths="*i64",
    bonus="*i64", num_seqs="i32", max_depth="i32", vocab="i32", stride_tree="i32", seq_rows="i32",
    stride_row="i32", stride_out="i32", temp_val="fp32", top_k="i32", top_p_val="fp32",
)
WALK_CONSTS = dict(USE_STARTS=False, SAMPLE=False, TOP_K=False, TEMP_ROWS=False, TOP_P_ROWS=False, CAP=1,
                   SEQS=1, BLOCK_N=1024, BLOCK_D=32, BLOCK_V=1, UNROLL=K.STREAM_UNROLL)
SAMPLE_CONSTS = dict(WALK_CONSTS, SAMPLE=True, BLOCK_V=K.SAMPLE_BLOCK_V)
SAMPLE_TYPES = dict(WALK_TYPES, tgt="*bf16")

TOPK_TYPES = dict(logits="*bf16", ws_m="*fp32", ws_s="*fp32", ws_cand="*i64", out_lp="*i64", out_ids="*i64",
                  tmp="*i64", num_rows="i32", vocab="i32", stride_row="i32")
TOPK_CONSTS = dict(K=512, SCALE=float(2**20), FLOOR=-1000.0, ROWS=1, SLICE=K.TOPK_SLICE, BITS=16, SELECT=True,
                   FINISH=False, BLOCK_R=512, RANK_SORT=False, CHUNK=512)
MERGE_TYPES = dict(ws_m="*fp32", ws_s="*fp32", ws_cand="*i64", out_lp="*i64", out_ids="*i64", tmp="*i64",
                   num_rows="i32", vocab="i32", num_slices="i32")
MERGE_CONSTS = dict(K=512, SCALE=float(2**20), FLOOR=-1000.0, ROWS=1, SLICE=K.TOPK_SLICE, BITS=16, BLOCK_G=16,
                    BLOCK_C=8192, BLOCK_K=512, RANK_SORT=False, CHUNK=512)

GREEDY_TYPES = dict(logits="*bf16", tgt="*i64", count="*i32", tok="*i64", par="*i64", num_nodes="*i64",
                    starts="*i64", acc="*i64", acc_tok="*i64", new_tok="*i64", lengths="*i64", bonus="*i64",
                    num_seqs="i32", max_depth="i32", vocab="i32", stride_tree="i32", seq_rows="i32", stride_row="i32",
                    stride_out="i32")
GREEDY_CONSTS = dict(USE_STARTS=False, BLOCK_N=1024, BLOCK_D=32, BLOCK_V=K.GREEDY_BLOCK_V, UNROLL=K.STREAM_UNROLL,
                     NODES=1)

CASES = [
    ("_topk_slice_kernel, split (V=163840: 10 slices of 16384, K=512, bf16)", K._topk_slice_kernel, TOPK_TYPES,
     TOPK_CONSTS, K._topk_warps(K.TOPK_SLICE)),
    ("_topk_slice_kernel, split, float32 logits", K._topk_slice_kernel, dict(TOPK_TYPES, logits="*fp32"),
     dict(TOPK_CONSTS, BITS=32), K._topk_warps(K.TOPK_SLICE)),
    ("_topk_merge_kernel (10 slices, K=512)", K._topk_merge_kernel, MERGE_TYPES, MERGE_CONSTS, K._topk_warps(8192)),
    ("_topk_merge_kernel (10 slices, K=1023)", K._topk_merge_kernel, MERGE_TYPES,
     dict(MERGE_CONSTS, K=1023, BLOCK_C=16384, BLOCK_K=1024, CHUNK=1024), K._topk_warps(16384)),
    ("_topk_slice_kernel, one slice (V=16384, K=512: select and finish)", K._topk_slice_kernel, TOPK_TYPES,
     dict(TOPK_CONSTS, FINISH=True), K._topk_warps(K.TOPK_SLICE)),
    ("_greedy_kernel (V=163840, n=513)", K._greedy_kernel, GREEDY_TYPES, GREEDY_CONSTS, 8),
    ("_walk_kernel tokens (n=513)", K._walk_kernel, WALK_TYPES, WALK_CONSTS, 4),
    ("_walk_kernel tokens, flat rows (n=513)", K._walk_kernel, WALK_TYPES, dict(WALK_CONSTS, USE_STARTS=True), 4),
    ("_walk_kernel sample top-k 50 (V=163840, CAP=256)", K._walk_kernel, SAMPLE_TYPES,
     dict(SAMPLE_CONSTS, TOP_K=True, CAP=256), 8),
    ("_walk_kernel sample top-k, per-row temperature/top-p, flat rows", K._walk_kernel, SAMPLE_TYPES,
     dict(SAMPLE_CONSTS, TOP_K=True, CAP=256, TEMP_ROWS=True, TOP_P_ROWS=True, USE_STARTS=True), 8),
    ("_walk_kernel sample top-k 1024 (CAP=2048)", K._walk_kernel, SAMPLE_TYPES,
     dict(SAMPLE_CONSTS, TOP_K=True, CAP=2048), 8),
    ("_walk_kernel sample, temperature only", K._walk_kernel, SAMPLE_TYPES, SAMPLE_CONSTS, 8),
    # one-node trees (sample_rows), 4 lanes and a 16-entry buffer: tests/test_ddtree_accept.py's tiny-buffer
    # case, which crashed Triton 3.6 with one-element blocks (run 24)
    ("_walk_kernel sample, one-node trees, 4 lanes, CAP=16, per-row filters", K._walk_kernel, SAMPLE_TYPES,
     dict(SAMPLE_CONSTS, TOP_K=True, CAP=16, TEMP_ROWS=True, TOP_P_ROWS=True, BLOCK_N=K.block_of(1),
          BLOCK_D=K.block_of(1), BLOCK_V=4), 4),
    ("_greedy_kernel (V=70, one-node trees)", K._greedy_kernel, GREEDY_TYPES,
     dict(GREEDY_CONSTS, BLOCK_N=K.block_of(1), BLOCK_D=K.block_of(1), BLOCK_V=128), 8),
]


EXPAND_TYPES = dict(
    lp="*i64", ids="*i64", roots="*i64", pairs="*i64", pair_end="*i64", scratch="*i64", emit="*i32",
    out_tok="*i64", out_par="*i64", out_dep="*i64", out_rank="*i64", out_score="*i64", out_num="*i64",
    num_seqs="i32", depth_cap="i32", n_draft="i32", stride_top="i32", stride_scratch="i32",
    stride_emit="i32", stride_out="i32",
)
# (budget, top-k, positions): the issue-13 size, then the awkward sizes of tests/test_ddtree_tree.py
# (budget 1 and budget 3 at top-k 2 once crashed Triton 3.6's compiler for sm_90)
for budget, k, L in [(512, 512, 16), (1, 1, 5), (3, 2, 6), (37, 37, 9), (300, 4, 6), (45, 20, 4), (100, 3, 16),
                     (511, 4, 12), (70, 5, 7)]:
    n_pairs = _pair_table(k, budget, "cpu")[0].numel()
    consts = K.expand_constexprs(1, k, budget, n_pairs, L, rank_sort=False)
    CASES.append((f"_expand_kernel (budget {budget}, K={k}, L={L})", K._expand_kernel, EXPAND_TYPES,
                  {n: v for n, v in consts.items() if n != "num_warps"}, consts["num_warps"]))


def report(cases, sass_dir: Path | None = None, **compile_kw) -> int:
    """Compile each ``(name, kernel, types, constexprs, warps)`` case for sm_90a and print an OK line
    with ptxas's figures or a FAIL line with the error; every case runs. Returns how many failed.
    ``sass_dir``: each case's SASS also written there (``case<i>.sass``, in the order printed)."""
    print(f"triton {triton.__version__}, target sm_90a", flush=True)
    failed = 0
    for i, (name, fn, types, consts, warps) in enumerate(cases):
        sass = None if sass_dir is None else Path(sass_dir, f"case{i}.sass")
        try:
            print(f"OK   {name}, {warps} warps: {compile_sm90(fn, types, consts, warps, sass=sass, **compile_kw)}",
                  flush=True)
        except Exception as exc:  # report every kernel, then fail
            failed += 1
            inner = exc  # a Gluon error inside a partition nests: the innermost cause names the line
            while inner.__cause__ is not None:
                inner = inner.__cause__
            cause = f"\n  caused by {type(inner).__name__}: {str(inner)[-2000:]}" if inner is not exc else ""
            print(f"FAIL {name}: {type(exc).__name__}: {str(exc)[-2000:]}{cause}", flush=True)
    return failed


def main() -> int:
    return 1 if report(CASES) else 0


if __name__ == "__main__":
    sys.exit(main())
