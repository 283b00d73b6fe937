"""Where a step of the Hopper kernel spends its cycles: ``%clock64`` stamps per consumer and step.

    PYTHONPATH=src python scripts/hopper_timeline.py [--shapes 64x33x4x16384x64,...] [--steps 96] [--json t.json]
        [--kernel VARIANT.py | --kernel FILE.diff:NAME]

The kernel is not changed for this: the script copies ``verify/hopper.py``'s source (or a variant's,
``--kernel``: a whole ``hopper.py`` of another branch, as ``scripts/ab_hopper.py`` takes; its stamped
copy must not make ptxas serialize the wgmmas, infos C7514 / C7515, or its timeline says nothing:
check with ``scripts/hopper_sm90_compile.py --stamped``; the stamped main kernel compiles clean), adds a
``trace`` pointer to the kernel and the consumer partitions and a stamp (one ``%clock64`` read,
stored by every thread of the warpgroup to the same address) at the points below, imports the
copy from a temporary file and runs it on the plan of each shape as a real call does (where the
plan's grid fits the GPU: one cooperative launch that merges its splits after a grid barrier).
Every anchor must be found as often as ``EDITS`` says, else the script stops: the kernel changed
(tests/test_verify_hopper.py checks the anchors on the CPU).

Per program (``PHASES``, stamped by the kernel's default warps): its entry (once the call before it
has ended: the stamps, as every global access, follow the grid wait), the partitions' join,
the grid barrier passed and its share of the merge done; with consumer 0's first step start and
last step end, printed as the phases ``start`` (Q and the first tiles), ``loop``, ``end`` (row sums,
stores, the other partitions finishing; split by three more stamps of consumer 0 in its last
segment into ``end_pv`` (its last PV), ``end_swap`` (consumer 1's row sums), ``end_store`` (its output
or partial stores issued) and ``end_join``), ``barrier`` (waiting for the slowest program) and
``merge`` (with two stamps in its first item: ``merge_round1``, the barrier to its first round of
splits accumulated, and ``merge_item1``, to its stores issued): what a call spends outside the steps.

Points per consumer and step (``steps``: the consumer's step counter over all its segments, so step
s of both consumers is the same tile pair):

- consumer 0: 0 step start, 1 first K chunk of its tile (the rope) landed (after its PV on the last
  step's P1 was issued, in ``_qk_after_pv``), 2 S = QK^T done, 3 its row max m0 published, 4 consumer 1's
  max m1 received, 5 own PV issued (P0 and O rescaled to m1), 6 P0 published, 7 own PV retired, 8
  consumer 1's P received, 9 step end (its PV on P1 is issued at the next step's start); until run
  35 consumer 0 issued its PV before m1 arrived, and points 4 and 5 were in the other order;
- consumer 1: 0 step start, 1 first K chunk (the rope) landed, 2 QK done, 3 consumer 0's max m0 received,
  4 m1 published, 5 P1 published, 6 own PV issued, 7 consumer 0's P received, 8 the first of its two
  PVs retired, 9 step end;
- both, inside the QK: 10 its own latent half landed, 11 the other half landed (the QK waits for
  each K chunk just before that chunk's wgmma, rope first since run 36: 1 -> 10 -> 11 -> 2 says
  which chunk it waited on; until run 36, 1 was the own half and 10 the rope);
- the loader, per step (its pair counter, the same numbering): the copy of each of the step's six K
  chunks issued, i.e. the chunk's last reader of the step before done (``rope0 left0 right0 rope1
  left1 right1``; stage 0 holds consumer 0's tile): where in the step the copies' shared-memory
  writes fall, run 29 having found the kernel bound by shared memory. Printed as a joint line,
  cycles after consumer 0's start of the step the copies feed (negative: issued during the step
  before).

What L2 holds when the stamped call starts (``--l2``): ``calls`` (default) what the timed calls left,
as in the benchmark's replays (their last KV tiles, and the partials the merge read, still dirty);
``clean`` twice L2's size read after them (the dirty lines written back before the call, L2 full of
clean lines of another buffer); ``dirty`` twice L2's size written (every line dirty: each line the
call brings in first writes one back). The first steps' cycles under the three tell a call's start
paying for the call before it from one that pays for its own DRAM burst.

The JSON also keeps each program's phases, its SM (``%smid``) and its segments (``programs``), to
relate a program's time to its work and place.

Printed per shape and consumer: the median over programs and steps of each interval (cycles),
the step's median, and the stamped kernel's time against the unstamped kernel's (CUDA-graph
replay), so the stamps' own cost is visible. Both consumers of a program run on one SM, whose
``%clock64`` they share, so the script also prints one joint timeline per shape: each point of
both consumers as the median of its time minus consumer 0's step start of the same step
(``joint`` in the JSON). An interval that is mostly waiting (consumer 0's 5 - 4: m1 not there yet;
consumer 1's 7 - 6: P0 not there yet) is on the critical path of the other side; the joint view
says which wgmma, if any, was running meanwhile.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from tune_flash import empty_outputs, equal_step, time_graph  # noqa: E402

from kdtree_engine.verify import combine, hopper  # noqa: E402
from kdtree_engine.verify.contract import kernel_ints  # noqa: E402

NPOINTS = 12
# per program, by the kernel's default warps (consumer 0's, which also merge): entry, partitions joined,
# grid barrier passed, merge done (the last two where the plan split a row block and the kernel merges);
# and in its last segment's epilogue: its last PV retired, the row sums swapped with consumer 1, its
# output (or partial) stores issued; and in the merge, its first item's first round of splits
# accumulated (their loads returned) and that item's stores issued
PHASES = ("entry", "joined", "barrier", "merged", "last_pv", "swapped", "stored", "item_round", "item_stored", "sm")
# the loader's points (trace index 2): the copy of each chunk of a step's two tiles issued (its last reader done)
LOADER_POINTS = ("rope0", "left0", "right0", "rope1", "left1", "right1")
CHAIN = 10  # points 0..9 follow each other in a step; 10 and 11 lie between 1 and 2 (the QK's chunks)
LOG2E = 1.4426950408889634

STAMP_FN = '''
    @gluon.jit
    def _stamp(trace, steps, POINT: gl.constexpr, WG: gl.constexpr):
        """%clock64 into trace[program, WG, steps, POINT] for the first MAX_STEPS steps (WG 2: the loader)."""
        if steps < MAX_STEPS:
            t = gl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l", [], dtype=gl.int64, is_pure=False, pack=1)
            gl.store(trace + ((gl.program_id(0) * 3 + WG) * MAX_STEPS + steps) * NPOINTS + POINT, t)

    @gluon.jit
    def _phase(trace, POINT: gl.constexpr):
        """%clock64 into the program's phase POINT, after the steps' region of trace."""
        t = gl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l", [], dtype=gl.int64, is_pure=False, pack=1)
        gl.store(trace + gl.num_programs(0) * 3 * MAX_STEPS * NPOINTS + gl.program_id(0) * NPHASES + POINT, t)

    @gluon.jit
    def _phase_sm(trace, POINT: gl.constexpr):
        """The SM the program runs on (%smid) into its phase POINT."""
        sm = gl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r", [], dtype=gl.int32, is_pure=True, pack=1)
        gl.store(trace + gl.num_programs(0) * 3 * MAX_STEPS * NPOINTS + gl.program_id(0) * NPHASES + POINT,
                 sm.to(gl.int64))

    @gluon.jit
    def _copy_rows('''

# (anchor, replacement): each anchor occurs exactly once (count given where more)
EDITS = [
    ("    @gluon.jit\n    def _copy_rows(", STAMP_FN, 1),
    ("        scale_log2, merge_splits,\n        H: gl.constexpr, PAGE_SIZE",
     "        scale_log2, merge_splits, trace,\n        H: gl.constexpr, PAGE_SIZE", 1),
    ("stride_ot, stride_oh, stride_lt, stride_lh, scale_log2,\n                     WG: gl.constexpr",
     "stride_ot, stride_oh, stride_lt, stride_lh, scale_log2, trace,\n                     WG: gl.constexpr", 1),
    ("stride_ot, stride_oh, stride_lt, stride_lh, scale_log2,\n                            0, H,",
     "stride_ot, stride_oh, stride_lt, stride_lh, scale_log2, trace,\n                            0, H,", 1),
    ("stride_ot, stride_oh, stride_lt, stride_lh, scale_log2,\n                            1, H,",
     "stride_ot, stride_oh, stride_lt, stride_lh, scale_log2, trace,\n                            1, H,", 1),
    # the loader: when each K chunk's copy is issued (its last reader done), point 3 * stage + chunk
    ("\n                   seg_kv_end, seg_partial, s_q, s_q_rope, s_k_lat, s_k_rope, bars,\n",
     "\n                   seg_kv_end, seg_partial, s_q, s_q_rope, s_k_lat, s_k_rope, bars, trace,\n", 1),
    ("\n                          seg_kv_end, seg_partial, s_q, s_q_rope, s_k_lat, s_k_rope, bars,\n",
     "\n                          seg_kv_end, seg_partial, s_q, s_q_rope, s_k_lat, s_k_rope, bars, trace,\n", 1),
    ("m_n0, bars, 0,", "m_n0, bars, trace, pairs, 0,", 3),
    ("m_n1, bars, 1,", "m_n1, bars, trace, pairs, 1,", 3),
    ("    def _load_chunk(dst, p_row, m_row, bars, STAGE: gl.constexpr,",
     "    def _load_chunk(dst, p_row, m_row, bars, trace, pairs, STAGE: gl.constexpr,", 1),
    ("            mbarrier.wait(bars[_EMPTY + 3 * STAGE + CHUNK], phase)\n",
     "            mbarrier.wait(bars[_EMPTY + 3 * STAGE + CHUNK], phase)\n            _stamp(trace, pairs, 3 * STAGE + CHUNK, 2)\n",
     1),
    # the consumers' step (_consumer_step) takes the trace
    ("                       s_q, s_q_rope, s_k_lat, s_k_rope, s_p0, s_rows, bars,\n                       WG: gl.constexpr, FULL",
     "                       s_q, s_q_rope, s_k_lat, s_k_rope, s_p0, s_rows, bars, trace,\n                       WG: gl.constexpr, FULL", 1),
    ("s_p0, s_rows, bars, WG, False,", "s_p0, s_rows, bars, trace, WG, False,", 1),
    ("s_p0, s_rows, bars, WG, True,", "s_p0, s_rows, bars, trace, WG, True,", 1),
    # step start; first chunk of the own tile (a second wait on a completed phase returns at once)
    ("        b_s = gl.full([BLOCK_M, BLOCK_N], float(\"-inf\"), gl.float32, layout=S_L)\n",
     "        _stamp(trace, steps, 0, WG)\n"
     "        b_s = gl.full([BLOCK_M, BLOCK_N], float(\"-inf\"), gl.float32, layout=S_L)\n", 1),
    ("            zero = j >> 30\n",
     "            zero = j >> 30\n"
     "            if WG == 1:  # consumer 0 stamps it in _qk_after_pv, after issuing its pending PV\n"
     "                mbarrier.wait(bars[_FULL + 3 * WG + _ROPE], own_uses & 1)\n"
     "                _stamp(trace, steps, 1, WG)\n", 1),
    ("            own_uses += 1\n", "            own_uses += 1\n            _stamp(trace, steps, 2, WG)\n", 1),
    # inside the QK (chunks in the order rope, own latent half, other half): the two halves landed
    ("    def _qk_chunks(s_q, q_rope, k_lat, k_rope, bars, phase, WG: gl.constexpr,",
     "    def _qk_chunks(s_q, q_rope, k_lat, k_rope, bars, phase, trace, steps, WG: gl.constexpr,", 1),
    ("s_k_rope.index(WG + zero), bars, own_uses & 1, WG,", "s_k_rope.index(WG + zero), bars, own_uses & 1, trace, steps, WG,", 1),
    ("        mbarrier.wait(bars[_FULL + 3 * WG + FIRST], phase)\n",
     "        mbarrier.wait(bars[_FULL + 3 * WG + FIRST], phase)\n        _stamp(trace, steps, 10, WG)\n", 1),
    ("        mbarrier.wait(bars[_FULL + 3 * WG + SECOND], phase)\n",
     "        mbarrier.wait(bars[_FULL + 3 * WG + SECOND], phase)\n        _stamp(trace, steps, 11, WG)\n", 1),
    # consumer 0's QK (behind its PV on the last step's P1): points 1, 10 and 11 at its waits
    ("    def _qk_after_pv(s_q, q_rope, k_lat, k_rope, bars, phase, acc, p1, v1, pending,\n",
     "    def _qk_after_pv(s_q, q_rope, k_lat, k_rope, bars, phase, acc, p1, v1, pending, trace, steps,\n", 1),
    ("s_k_lat.index(1 + zero).slice(0, HALF, dim=1), pending,\n",
     "s_k_lat.index(1 + zero).slice(0, HALF, dim=1), pending, trace, steps,\n", 1),
    ("        mbarrier.wait(bars[_FULL + _ROPE], phase)\n",
     "        mbarrier.wait(bars[_FULL + _ROPE], phase)\n        _stamp(trace, steps, 1, 0)\n", 1),
    ("        mbarrier.wait(bars[_FULL + _LEFT], phase)\n",
     "        mbarrier.wait(bars[_FULL + _LEFT], phase)\n        _stamp(trace, steps, 10, 0)\n", 1),
    ("        mbarrier.wait(bars[_FULL + _RIGHT], phase)\n",
     "        mbarrier.wait(bars[_FULL + _RIGHT], phase)\n        _stamp(trace, steps, 11, 0)\n", 1),
    # consumer 0
    ("            _publish_rows(s_rows.slice(0, BLOCK_M), m0, bars, 0)\n",
     "            _publish_rows(s_rows.slice(0, BLOCK_M), m0, bars, 0)\n            _stamp(trace, steps, 3, WG)\n",
     1),
    ("            mbarrier.wait(bars[_M_READY + 1], steps & 1)\n",
     "            mbarrier.wait(bars[_M_READY + 1], steps & 1)\n            _stamp(trace, steps, 4, WG)\n", 1),
    ("            acc = warpgroup_mma(gl.convert_layout(b_p, P_DOT), v_own, acc, is_async=True)\n",
     "            acc = warpgroup_mma(gl.convert_layout(b_p, P_DOT), v_own, acc, is_async=True)\n"
     "            _stamp(trace, steps, 5, WG)\n", 1),
    # (before the arrive: stamped after it, with point 7 behind, ptxas serialised the wgmmas, C7515)
    ("            mbarrier.arrive(bars[_P_READY + 0])\n",
     "            _stamp(trace, steps, 6, WG)\n            mbarrier.arrive(bars[_P_READY + 0])\n", 1),
    ("            acc = warpgroup_mma_wait(0, deps=[acc])\n            mbarrier.arrive(bars[_EMPTY + 3 * 0 + _LEFT])\n",
     "            acc = warpgroup_mma_wait(0, deps=[acc])\n            _stamp(trace, steps, 7, WG)\n"
     "            mbarrier.arrive(bars[_EMPTY + 3 * 0 + _LEFT])\n", 1),
    ("            mbarrier.wait(bars[_P_READY + 1], steps & 1)\n",
     "            mbarrier.wait(bars[_P_READY + 1], steps & 1)\n            _stamp(trace, steps, 8, WG)\n", 1),
    # consumer 1
    ("            mbarrier.wait(bars[_M_READY + 0], steps & 1)\n",
     "            mbarrier.wait(bars[_M_READY + 0], steps & 1)\n            _stamp(trace, steps, 3, WG)\n", 1),
    ("            _publish_rows(s_rows.slice(BLOCK_M, BLOCK_M), m1, bars, 1)\n",
     "            _publish_rows(s_rows.slice(BLOCK_M, BLOCK_M), m1, bars, 1)\n"
     "            _stamp(trace, steps, 4, WG)\n", 1),
    ("            mbarrier.arrive(bars[_P_READY + 1])\n",
     "            mbarrier.arrive(bars[_P_READY + 1])\n            _stamp(trace, steps, 5, WG)\n", 1),
    ("                acc = warpgroup_mma(gl.convert_layout(b_p.to(dt), P_DOT), v_own, acc, is_async=True)\n"
     "                mbarrier.wait(bars[_P_READY + 0], steps & 1)\n",
     "                acc = warpgroup_mma(gl.convert_layout(b_p.to(dt), P_DOT), v_own, acc, is_async=True)\n"
     "                _stamp(trace, steps, 6, WG)\n"
     "                mbarrier.wait(bars[_P_READY + 0], steps & 1)\n                _stamp(trace, steps, 7, WG)\n",
     1),
    ("            else:\n                mbarrier.wait(bars[_P_READY + 0], steps & 1)\n",  # no own tile
     "            else:\n                _stamp(trace, steps, 6, WG)\n"
     "                mbarrier.wait(bars[_P_READY + 0], steps & 1)\n                _stamp(trace, steps, 7, WG)\n",
     1),
    ("                acc = warpgroup_mma_wait(1, deps=[acc])\n",
     "                acc = warpgroup_mma_wait(1, deps=[acc])\n                _stamp(trace, steps, 8, WG)\n", 1),
    ("        steps += 1\n", "        _stamp(trace, steps, 9, WG)\n        steps += 1\n", 1),
    # the program's phases (PHASES)
    # (after the grid wait, as every global access of the kernel: the entry is when the call before ended)
    ("        gl.static_assert(num_warps == 4)\n",
     "        gl.static_assert(num_warps == 4)\n        _wait_prior_grid()\n        _phase(trace, 0)\n"
     "        _phase_sm(trace, 9)\n", 1),
    ("        ], [4, LOADER_WARPS], [CONSUMER_REGS, LOADER_REGS])\n",
     "        ], [4, LOADER_WARPS], [CONSUMER_REGS, LOADER_REGS])\n        _phase(trace, 1)\n", 1),
    ("        grid_barrier(barrier_word, gl.program_id(0), gl.num_programs(0))\n",
     "        grid_barrier(barrier_word, gl.program_id(0), gl.num_programs(0))\n        _phase(trace, 2)\n", 1),
    ("                                   BLOCK_S, BLOCK_R, DISCARD)\n",
     "                                   BLOCK_S, BLOCK_R, DISCARD)\n                _phase(trace, 3)\n", 1),
    ("            mbarrier.arrive(bars[_Q_EMPTY])\n",
     "            mbarrier.arrive(bars[_Q_EMPTY])\n            if WG == 0:\n                _phase(trace, 4)\n", 1),
    ("l_i, WG, ROW_S)\n", "l_i, WG, ROW_S)\n            if WG == 0:\n                _phase(trace, 5)\n", 1),
    ("                    gl.store(partial_lse + o_ps, lse2, mask=m_rows_s)\n",
     "                    gl.store(partial_lse + o_ps, lse2, mask=m_rows_s)\n            if WG == 0:\n"
     "                _phase(trace, 6)\n", 1),
    ("out, lse, qo_indptr,\n                       group_seq",
     "out, lse, qo_indptr, trace,\n                       group_seq", 1),
    ("lse, qo_indptr, group_seq", "lse, qo_indptr, trace, group_seq", 2),
    ("                b_m = b_m_new\n", "                b_m = b_m_new\n                if item == first_item:\n"
     "                    if s0 == 0:\n                        _phase(trace, 7)\n", 1),
    ("            gl.store(p_out, b_o.to(out.dtype.element_ty), mask=gl.expand_dims(row_d < n_rows, 1))\n",
     "            gl.store(p_out, b_o.to(out.dtype.element_ty), mask=gl.expand_dims(row_d < n_rows, 1))\n"
     "            if item == first_item:\n                _phase(trace, 8)\n", 1),
]


def stamped_source(max_steps: int, src: str | None = None) -> str:
    """``src`` (default: verify/hopper.py's source) with the stamps (``ValueError`` when an anchor is
    not found as often as expected: the kernel changed, update ``EDITS``)."""
    if src is None:
        src = Path(hopper.__file__).read_text()
    edits = EDITS + [("    _NUM_BARS = gl.constexpr(", f"    MAX_STEPS = gl.constexpr({max_steps})\n"
                      f"    NPOINTS = gl.constexpr({NPOINTS})\n    NPHASES = gl.constexpr({len(PHASES)})\n"
                      "    _NUM_BARS = gl.constexpr(", 1)]
    for anchor, new, count in edits:
        found = src.count(anchor)
        if found != count:
            raise ValueError(f"anchor found {found} times (expected {count}): {anchor[:80]!r}")
        src = src.replace(anchor, new)
    return src


def module_from_source(src: str, name: str):
    """A copy of a kdtree_engine.verify module (its relative imports made absolute), imported from a
    temporary file: Gluon reads a kernel's source from its file."""
    path = Path(tempfile.mkdtemp()) / f"{name}.py"
    path.write_text(src.replace("\nfrom .", "\nfrom kdtree_engine.verify."))
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # gluon.jit reads the function's module
    spec.loader.exec_module(mod)
    return mod


def apply_unified_diff(source: str, diff: str) -> str:
    """``source`` with the hunks of the unified ``diff`` applied (their context and removed lines
    checked; ``ValueError`` where one does not match)."""
    lines = source.splitlines(keepends=True)
    out, pos, in_hunks = [], 0, False
    for line in diff.splitlines(keepends=True):
        if line.startswith("@@"):
            in_hunks = True
            old = line.split()[1]  # -start,count
            start = int(old[1:].split(",")[0])
            count = int(old.split(",")[1]) if "," in old else 1
            start = start - 1 if count else start
            if start < pos:
                raise ValueError(f"hunk {line.strip()} overlaps the one before")
            out += lines[pos:start]
            pos = start
        elif not in_hunks or line.startswith("\\"):  # the file names; "\ No newline at end of file"
            continue
        elif line[:1] in (" ", "-", "\n"):  # context (an empty context line may have lost its space), removed
            if pos >= len(lines) or lines[pos].rstrip("\n") != line[1:].rstrip("\n"):
                raise ValueError(f"line {pos + 1} does not match the diff: {line[1:].rstrip()!r}")
            if line[0] != "-":
                out.append(lines[pos])
            pos += 1
        elif line[:1] == "+":
            out.append(line[1:])
    return "".join(out + lines[pos:])


def variant_source(spec: str) -> tuple[str, str]:
    """``(name, source)`` of a variant kernel: ``spec`` a whole ``verify/hopper.py`` file (named by its
    stem), or ``FILE.diff:NAME``, the section ``### variant NAME`` (or ``### ablation NAME``) of a file
    of unified diffs against ``verify/hopper.py`` applied to this tree's kernel."""
    path, sep, name = spec.rpartition(":")
    if not sep or not path.endswith(".diff"):
        return Path(spec).stem, Path(spec).read_text()
    section, inside = [], False
    for line in Path(path).read_text().splitlines(keepends=True):
        if line.startswith("### "):
            words = line.split()
            inside = len(words) > 2 and words[1] in ("variant", "ablation") and words[2].rstrip(",") == name
        elif inside:
            section.append(line)
    if not section:
        raise SystemExit(f"{path} has no section '### variant {name}'")
    return name, apply_unified_diff(Path(hopper.__file__).read_text(), "".join(section))


def stamped_module(max_steps: int, src: str | None = None):
    """The stamped copy of ``src`` (default: verify/hopper.py)."""
    return module_from_source(stamped_source(max_steps, src), "hopper_stamped")


def launcher(kernel, c, plan, out, lse, trace, H, page_size):
    """A launch of ``kernel`` (the Hopper kernel or its stamped copy) on the plan's tables."""
    tensors = (c["q"], c["kv_cache"], c["page_table"], c["kv_lens"], c["qo_indptr"], c["tree_mask"], out, lse)
    t = plan.tables
    args = (*tensors, t.prog_first_seg, *t.segment_rows, t.partial_out, t.partial_lse, *t.group_rows, t.group_count,
            t.grid_barrier, *kernel_ints(*tensors), LOG2E / math.sqrt(576), 1)
    extra = () if trace is None else (trace,)
    fused = combine.fuses(plan.tables, c["q"].device)  # the merge in the kernel, one launch, at any group count
    consts = dict(hopper.kernel_constexprs(H, page_size), FUSE_COMBINE=fused, BLOCK_S=combine.SPLITS_PER_ROUND,
                  BLOCK_R=combine.ROWS_PER_ITEM, IN_KERNEL=plan.tables.in_kernel,
                  **({"launch_cooperative_grid": True} if fused else {}))
    grid = (plan.num_programs,)
    return lambda: kernel[grid](*args, *extra, **consts)


def intervals(trace: torch.Tensor) -> dict:
    """Median cycles of each interval per consumer (the chain 0..9, and the QK's chunks: ``own-1``,
    ``other-own``, ``2-other``), and the joint timeline: ``trace [P, 3, steps, NPOINTS]`` (-1:
    not stamped; index 2 the loader, whose points 0-5 of step s are the issues of that step's chunk
    copies, ``LOADER_POINTS``)."""
    res = {}
    last = CHAIN - 1
    qk = {"own-1": (10, 1), "other-own": (11, 10), "2-other": (2, 11)}
    for wg in range(2):
        t = trace[:, wg]  # [P, S, N]
        never = [k for k in range(NPOINTS) if not bool((t[..., k] >= 0).any())]
        if never:  # no step of this consumer would count: the stamps no longer fit the kernel's code
            raise ValueError(f"consumer {wg} never stamped points {never}: update EDITS for the kernel's code")
        full = (t >= 0).all(dim=2)
        nxt = torch.zeros_like(full)
        nxt[:, :-1] = full[:, 1:]
        rows = {f"{a}-{a - 1}": [] for a in range(1, CHAIN)}
        rows[f"next0-{last}"], rows["step"] = [], []
        rows.update({k: [] for k in qk})
        for p, s in (full & nxt).nonzero().tolist():
            v = t[p, s].tolist()
            for a in range(1, CHAIN):
                rows[f"{a}-{a - 1}"].append(v[a] - v[a - 1])
            for k, (a, b) in qk.items():
                rows[k].append(v[a] - v[b])
            rows[f"next0-{last}"].append(t[p, s + 1, 0].item() - v[last])
            rows["step"].append(t[p, s + 1, 0].item() - v[0])
        res[f"consumer{wg}"] = {k: (statistics.median(x) if x else None) for k, x in rows.items()}
        res[f"consumer{wg}"]["steps"] = len(rows["step"])
    both = (trace[:, :2] >= 0).all(dim=3).all(dim=1)  # [P, S]: every point of both consumers stamped
    stamped = trace.permute(0, 2, 1, 3)[both]  # [K, 3, NPOINTS]
    rel = stamped - stamped[:, 0:1, 0:1]  # each point minus consumer 0's start of the same step
    res["joint"] = {f"consumer{wg}": [float(rel[:, wg, k].median()) if len(rel) else None for k in range(NPOINTS)]
                    for wg in range(2)}
    loads = {}
    for k, name in enumerate(LOADER_POINTS):  # stage 1's chunks are not stamped where a segment's last pair has one tile
        got = stamped[:, 2, k] >= 0
        loads[name] = float(rel[got, 2, k].median()) if got.any() else None
    res["joint"]["loader"] = loads
    return res


def program_phases(trace: torch.Tensor, stamps: torch.Tensor) -> dict:
    """Per program (``stamps [P, len(PHASES)]``, -1: not reached; ``trace`` the steps' stamps), a
    list over the programs of each phase (None where the program has no such figure): cycles from
    entry to consumer 0's first step (``start``: Q and the first tiles), over its steps (``loop``,
    whole only where no step went unstamped; ``steps``, how many; ``step_cycles``, each step's, from its
    start to the next one's or to the loop's end), from its last step's end to the
    partitions' join (``end``: row sums, output or partial stores, the other partitions finishing;
    split into ``end_pv``, its last PV, ``end_swap``, the wait for consumer 1's row sums,
    ``end_store``, its stores issued, and ``end_join``, the other partitions finishing), then the
    grid barrier's wait (``barrier``) and the merge (``merge``; of it, from the barrier to the first
    item's first round of splits accumulated, ``merge_round1``, and to that item's stores issued,
    ``merge_item1``); ``total``, and the SM the program ran on (``sm``). Programs without a step
    (no work, or the kernel changed) have None throughout."""
    c0 = trace[:, 0]  # [P, S, N]
    keys = ("start", "loop", "steps", "step_cycles", "end", "end_pv", "end_swap", "end_store", "end_join", "barrier",
            "merge", "merge_round1", "merge_item1", "total", "sm")
    rows = {k: [None] * stamps.shape[0] for k in keys}
    for prog in range(stamps.shape[0]):
        entry, joined, barrier, merged, last_pv, swapped, stored, item_round, item_stored, sm = stamps[prog].tolist()
        starts, ends = c0[prog, :, 0], c0[prog, :, CHAIN - 1]
        if entry < 0 or joined < 0 or not bool((starts >= 0).any()) or not bool((ends >= 0).any()):
            continue  # no step (a program without work), or the kernel changed
        first, last = int(starts[starts >= 0][0]), int(ends[ends >= 0][-1])
        row = {"start": first - entry, "sm": sm}
        n = int((starts >= 0).sum())
        if n < c0.shape[1]:  # a slot left: every step was stamped
            row.update(loop=last - first, steps=n, end=joined - last,
                       step_cycles=(starts[1:n] - starts[:n - 1]).tolist() + [last - int(starts[n - 1])])
            if min(last_pv, swapped, stored) >= 0:
                row.update(end_pv=last_pv - last, end_swap=swapped - last_pv, end_store=stored - swapped,
                           end_join=joined - stored)
        if barrier >= 0:
            row["barrier"] = barrier - joined
        if merged >= 0:
            row["merge"] = merged - barrier
            if min(item_round, item_stored) >= 0:
                row.update(merge_round1=item_round - barrier, merge_item1=item_stored - barrier)
        row["total"] = max(joined, barrier, merged) - entry
        for k, v in row.items():
            rows[k][prog] = v
    return rows


def phases(programs: dict) -> dict:
    """:func:`program_phases`' cycles (``programs``), smallest, median and largest over the programs
    that have them."""
    out = {}
    for k, values in programs.items():
        v = [x for x in values if x is not None]
        if k not in ("steps", "sm", "step_cycles"):
            out[k] = {"min": min(v), "median": statistics.median(v), "max": max(v), "programs": len(v)} if v else None
    return out


def loop_spread(programs: dict, block_m: int) -> list[str]:
    """What the programs' loops follow (``programs``: :func:`program_phases`' lists and ``pieces``,
    each program's segments ``[seq, row0, kv_start, kv_end]``, or None): cycles a step, their
    median by the row block of each program's first segment, by a step's index in its program
    (where ``step_cycles`` holds each program's steps: the cold first steps, the tree's tiles at a
    segment's end), and the three fastest and slowest programs with their SM and segments."""
    per = sorted(((q, loop / steps) for q, (loop, steps) in enumerate(zip(programs["loop"], programs["steps"]))
                  if loop is not None and steps), key=lambda x: x[1])
    pieces = programs.get("pieces")
    lines = []
    if pieces:
        by = {}
        for q, c in per:
            by.setdefault(pieces[q][0][1] // block_m, []).append(c)
        lines.append("loop, cycles a step, median by row block (programs): " + "  ".join(
            f"{r}: {statistics.median(v):.0f} ({len(v)})" for r, v in sorted(by.items())))
    by_index = {}
    for cycles in programs.get("step_cycles", ()):
        for i, c in enumerate(cycles or ()):
            by_index.setdefault(i, []).append(c)
    if by_index:
        lines.append("cycles a step by its index in the program, median (programs): " + "  ".join(
            f"{i}: {statistics.median(v):.0f} ({len(v)})" for i, v in sorted(by_index.items())))
    for name, picked in (("fastest", per[:3]), ("slowest", per[::-1][:3])):
        lines.append(f"{name}: " + "; ".join(
            f"program {q} on SM {programs['sm'][q]}, {c:.0f} a step x {programs['steps'][q]}"
            + (f", segments {pieces[q]}" if pieces else "") for q, c in picked))
    return lines


L2_STATES = ("calls", "clean", "dirty")


def set_l2(state: str) -> None:
    """Leave L2 as ``--l2`` names it (``L2_STATES``): untouched, or full of clean or dirty lines of a
    scratch buffer twice its size; synchronised, so only the call that follows runs on it."""
    if state == "calls":
        return
    scratch = torch.empty(2 * torch.cuda.get_device_properties(0).L2_cache_size // 4, device="cuda")
    if state == "clean":
        scratch.sum()  # its values are garbage; only its lines matter
    else:
        scratch.fill_(2.0)
    torch.cuda.synchronize()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="64x33x4x16384x64,64x9x1x131072x64,128x33x1x16384x64,16x9x4x16384x64,"
                   "64x33x4x16384x1", help="H x nodes x B x prefix x page size")
    p.add_argument("--steps", type=int, default=96, help="steps stamped per consumer and program")
    p.add_argument("--json")
    p.add_argument("--l2", choices=L2_STATES, default="calls",
                   help="what L2 holds when the stamped call starts (see above)")
    p.add_argument("--kernel", help="a variant hopper.py, or FILE.diff:NAME (see scripts/ab_hopper.py), to stamp "
                   "and time (default: this tree's)")
    a = p.parse_args()
    src = variant_source(a.kernel)[1] if a.kernel else None
    base = hopper if src is None else module_from_source(src, "hopper_variant")
    mod = stamped_module(a.steps, src)
    results = []
    for text in a.shapes.split(","):
        H, n, B, prefix, ps = (int(x) for x in text.split("x"))
        c, plan = equal_step(H, n, B, prefix, ps)
        out, lse = empty_outputs(c["q"])
        P = plan.num_programs
        buf = torch.full((P * (3 * a.steps * NPOINTS + len(PHASES)),), -1, dtype=torch.int64, device="cuda")
        trace = buf[: P * 3 * a.steps * NPOINTS].view(P, 3, a.steps, NPOINTS)
        plain = launcher(base._hopper_verify_kernel, c, plan, out, lse, None, H, ps)
        stamped = launcher(mod._hopper_verify_kernel, c, plan, out, lse, buf, H, ps)
        plain_us, stamped_us = time_graph(plain) * 1e6, time_graph(stamped) * 1e6
        buf.fill_(-1)
        set_l2(a.l2)
        stamped()
        torch.cuda.synchronize()
        stamps = buf[P * 3 * a.steps * NPOINTS:].view(P, len(PHASES)).cpu()
        first, seg = plan.tables.prog_first_seg.tolist(), [r.tolist() for r in plan.tables.segment_rows[:4]]
        per = program_phases(trace.cpu(), stamps)
        row = dict(shape=text, l2=a.l2, plain_us=plain_us, stamped_us=stamped_us, segments=plan.num_segments,
                   groups=plan.num_groups, **intervals(trace.cpu()), phases=phases(per),
                   programs=dict(per,  # and each program's (seq, row0, kv_start, kv_end)
                                 pieces=None if plan.tables.in_kernel else  # (the kernel schedules one sequence itself)
                                 [[[r[i] for r in seg] for i in range(first[q], first[q + 1])] for q in range(P)]))
        results.append(row)
        print(f"{text}: main kernel {plain_us:.1f} us, stamped {stamped_us:.1f} us, {plan.num_segments} segments, "
              f"{plan.num_groups} split groups")
        print("  program phases, cycles (smallest / median / largest over programs): " + "  ".join(
            f"{k} {v['min']:.0f} / {v['median']:.0f} / {v['max']:.0f}" for k, v in row["phases"].items() if v is not None))
        for line in loop_spread(row["programs"], plan.config.block_m):
            print("  " + line)
        for wg in range(2):
            r = row[f"consumer{wg}"]
            print(f"  consumer {wg} ({r['steps']} steps): " + "  ".join(
                f"{k} {v:.0f}" for k, v in r.items() if k != "steps" and v is not None))
        for wg in range(2):
            print(f"  joint, consumer {wg} (cycles after consumer 0's step start): " + "  ".join(
                f"{k}:{v:.0f}" for k, v in enumerate(row["joint"][f"consumer{wg}"]) if v is not None))
        print("  joint, loader (the step's chunk copies issued, cycles after consumer 0's start of that step): "
              + "  ".join(f"{k}:{v:.0f}" for k, v in row["joint"]["loader"].items() if v is not None))
        del c
        torch.cuda.empty_cache()
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
