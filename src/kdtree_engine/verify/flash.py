"""Flash tree-verify kernel: every head and tree node of a sequence against ONE read of its KV.

MLA in absorbed form has one latent KV head, so the ``n_b x H`` query rows of a sequence form one
matrix problem ``[n_b*H, 576] x [576, kv_len]``. Rows are packed (row ``r`` = node ``r // H``, head
``r % H``) into blocks of ``BLOCK_M``. The kernel is persistent: the plan cuts all (sequence, row
block, KV tile) work into as many near-equal shares as the GPU runs programs at once, so even one
sequence fills the GPU and no wave runs part-empty. A share is a list of segments, each a row
block of a sequence against a KV range:

- for each ``BLOCK_N``-position KV tile (rows gathered through the page table, each 1152-byte
  cache row contiguous): ``S = Q_lat K_lat^T + Q_rope K_rope^T`` on tensor cores, fp32 online
  softmax in base 2 (log2(e) folded into the scale), ``O += P V`` with V = the latent columns of
  the SAME tile (never loaded twice);
- only tiles that reach the last ``n_b`` positions (the tree) or the end of the split apply a mask;
  prefix tiles run unmasked;
- a segment that covers its row block's whole KV writes the final ``out``/``lse``; otherwise it
  writes a normalised partial and its log2-sum-exp, merged by :func:`_combine_kernel`.

The work list comes from :func:`plan_verify`, computed on the host from host lengths and reusable
across the layers of a model step; with a plan, a launch does no host sync and can be captured
in a CUDA graph. No atomics: results are bitwise deterministic.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..backend import interpreting
from .api import D_QK, D_V

LOG2E = 1.4426950408889634
LN2: tl.constexpr = tl.constexpr(0.6931471805599453)


@triton.jit
def _attend_tile(
    b_q, b_qr, b_m, b_l, b_acc,
    kv, p_pages, p_mask_rows, m_rows,
    start, kv_end, prefix, mask_words, stride_kvp, stride_kvs, stride_pp, stride_mw, scale_log2,
    PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, D_LATENT: tl.constexpr, D_ROPE: tl.constexpr,
    MASKED: tl.constexpr, DOT_FP32: tl.constexpr,
):
    """One KV tile of the online softmax. MASKED tiles bound-check and apply the tree mask."""
    o_n = start + tl.arange(0, BLOCK_N)  # [BN] positions
    o_d = tl.arange(0, D_LATENT)
    o_r = tl.arange(0, D_ROPE)
    if PAGE_SIZE % BLOCK_N == 0:
        # the tile lies inside one page: one page id, contiguous rows
        b_page = tl.load(p_pages + (start // PAGE_SIZE) * stride_pp).to(tl.int64)
        p_row = kv + b_page * stride_kvp + (o_n % PAGE_SIZE) * stride_kvs  # [BN]
    else:
        if MASKED:
            b_pages = tl.load(p_pages + (o_n // PAGE_SIZE) * stride_pp, mask=o_n < kv_end, other=0)
        else:
            b_pages = tl.load(p_pages + (o_n // PAGE_SIZE) * stride_pp)
        p_row = kv + b_pages.to(tl.int64) * stride_kvp + (o_n % PAGE_SIZE) * stride_kvs  # [BN]
    if MASKED:
        m_n = o_n < kv_end
        b_k = tl.load(p_row[:, None] + o_d[None, :], mask=m_n[:, None], other=0.0)  # [BN, D_LATENT]
        b_kr = tl.load(p_row[:, None] + D_LATENT + o_r[None, :], mask=m_n[:, None], other=0.0)  # [BN, D_ROPE]
    else:
        b_k = tl.load(p_row[:, None] + o_d[None, :])
        b_kr = tl.load(p_row[:, None] + D_LATENT + o_r[None, :])
    if DOT_FP32:
        b_k = b_k.to(tl.float32)
        b_kr = b_kr.to(tl.float32)
    b_s = tl.dot(b_q, tl.trans(b_k))  # [BM, BN]
    b_s = tl.dot(b_qr, tl.trans(b_kr), b_s)
    b_s = b_s * scale_log2
    if MASKED:
        o_j = o_n - prefix  # tree node index of each position (negative: prefix)
        o_jc = tl.maximum(o_j, 0)
        m_tree = m_n & (o_j >= 0) & (o_jc // 32 < mask_words)
        b_word = tl.load(p_mask_rows[:, None] + (o_jc // 32)[None, :] * stride_mw,
                         mask=m_rows[:, None] & m_tree[None, :], other=0)  # [BM, BN]
        b_bit = (b_word >> (o_jc % 32)[None, :]) & 1
        m_vis = m_n[None, :] & ((o_j < 0)[None, :] | (b_bit != 0))
        b_s = tl.where(m_vis, b_s, float("-inf"))
        b_m_new = tl.maximum(b_m, tl.max(b_s, 1))
        b_m_use = tl.where(b_m_new == float("-inf"), 0.0, b_m_new)  # rows with nothing visible yet
    else:
        b_m_new = tl.maximum(b_m, tl.max(b_s, 1))
        b_m_use = b_m_new
    b_p = tl.exp2(b_s - b_m_use[:, None])  # [BM, BN]
    b_alpha = tl.exp2(b_m - b_m_use)  # [BM]
    b_l = b_l * b_alpha + tl.sum(b_p, 1)
    b_acc = b_acc * b_alpha[:, None]
    b_acc = tl.dot(b_p.to(b_k.dtype), b_k, b_acc)  # [BM, D_LATENT]
    return b_m_new, b_l, b_acc


@triton.jit
def _attend_segment(
    q, kv, page_table, kv_lens, qo_indptr, tree_mask, out, lse, partial_out, partial_lse,
    i_b, row0, kv_start, kv_end, i_part,
    stride_qt, stride_qh, stride_kvp, stride_kvs, stride_pt, stride_pp, stride_kl, stride_qo,
    stride_mt, stride_mw, mask_words, stride_ot, stride_oh, stride_lt, stride_lh, scale_log2,
    H: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    D_LATENT: tl.constexpr, D_ROPE: tl.constexpr, DOT_FP32: tl.constexpr,
):
    """Rows ``row0 : row0 + BLOCK_M`` of sequence ``i_b`` against KV positions ``[kv_start, kv_end)``."""
    qo_start = tl.load(qo_indptr + i_b * stride_qo)
    n_nodes = tl.load(qo_indptr + (i_b + 1) * stride_qo) - qo_start
    prefix = tl.load(kv_lens + i_b * stride_kl) - n_nodes

    o_m = row0 + tl.arange(0, BLOCK_M)  # packed rows of this sequence: node = r // H, head = r % H
    m_rows = o_m < n_nodes * H
    o_node = tl.minimum(o_m // H, n_nodes - 1)
    o_head = o_m % H
    o_t = (qo_start + o_node).to(tl.int64)  # [BM] q rows
    o_d = tl.arange(0, D_LATENT)
    o_r = tl.arange(0, D_ROPE)
    p_q = q + o_t * stride_qt + o_head * stride_qh  # [BM]
    b_q = tl.load(p_q[:, None] + o_d[None, :], mask=m_rows[:, None], other=0.0)  # [BM, D_LATENT]
    b_qr = tl.load(p_q[:, None] + D_LATENT + o_r[None, :], mask=m_rows[:, None], other=0.0)  # [BM, D_ROPE]
    if DOT_FP32:
        b_q = b_q.to(tl.float32)
        b_qr = b_qr.to(tl.float32)
    p_pages = page_table + i_b.to(tl.int64) * stride_pt
    p_mask_rows = tree_mask + o_t * stride_mt  # [BM]

    b_m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    b_l = tl.zeros([BLOCK_M], tl.float32)
    b_acc = tl.zeros([BLOCK_M, D_LATENT], tl.float32)
    # full prefix tiles: no bounds, no tree mask
    clean_end = kv_start + tl.maximum(tl.minimum(kv_end, prefix) - kv_start, 0) // BLOCK_N * BLOCK_N
    for start in range(kv_start, clean_end, BLOCK_N):
        b_m, b_l, b_acc = _attend_tile(
            b_q, b_qr, b_m, b_l, b_acc, kv, p_pages, p_mask_rows, m_rows,
            start, kv_end, prefix, mask_words, stride_kvp, stride_kvs, stride_pp, stride_mw, scale_log2,
            PAGE_SIZE, BLOCK_N, D_LATENT, D_ROPE, False, DOT_FP32,
        )
    # the segment's ragged end and the tree: bounds and tree mask. One or two tiles: not pipelined,
    # so its buffers (K tiles, mask words) do not add to the prefix loop's shared memory.
    for start in tl.range(clean_end, kv_end, BLOCK_N, num_stages=1):
        b_m, b_l, b_acc = _attend_tile(
            b_q, b_qr, b_m, b_l, b_acc, kv, p_pages, p_mask_rows, m_rows,
            start, kv_end, prefix, mask_words, stride_kvp, stride_kvs, stride_pp, stride_mw, scale_log2,
            PAGE_SIZE, BLOCK_N, D_LATENT, D_ROPE, True, DOT_FP32,
        )

    has_key = b_l > 0
    b_l_safe = tl.where(has_key, b_l, 1.0)
    b_out = tl.where(has_key[:, None], b_acc / b_l_safe[:, None], 0.0)
    b_lse2 = tl.where(has_key, b_m + tl.log2(b_l_safe), float("-inf"))  # log2-sum-exp2
    if i_part < 0:
        p_out = out + o_t[:, None] * stride_ot + o_head[:, None] * stride_oh + o_d[None, :]
        tl.store(p_out, b_out.to(out.dtype.element_ty), mask=m_rows[:, None])
        tl.store(lse + o_t * stride_lt + o_head * stride_lh, b_lse2 * LN2, mask=m_rows)
    else:
        o_p = i_part.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
        tl.store(partial_out + o_p[:, None] * D_LATENT + o_d[None, :], b_out, mask=m_rows[:, None])
        tl.store(partial_lse + o_p, b_lse2, mask=m_rows)


# Arguments that vary call to call (page-table width, mask words) are not specialised: a new
# value must never trigger a multi-second recompile in the middle of a decode loop.
@triton.jit(do_not_specialize=["stride_pt", "stride_mt", "mask_words"])
def _verify_flash_kernel(
    q, kv, page_table, kv_lens, qo_indptr, tree_mask, out, lse,
    prog_first_seg, seg_seq, seg_row0, seg_kv_start, seg_kv_end, seg_partial,
    partial_out, partial_lse,
    stride_qt, stride_qh,
    stride_kvp, stride_kvs,
    stride_pt, stride_pp,
    stride_kl, stride_qo,
    stride_mt, stride_mw, mask_words,
    stride_ot, stride_oh,
    stride_lt, stride_lh,
    scale_log2,
    H: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    D_LATENT: tl.constexpr,
    D_ROPE: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    """One persistent program: the plan's segments ``prog_first_seg[p] : prog_first_seg[p+1]``."""
    i_p = tl.program_id(0)
    for i_s in range(tl.load(prog_first_seg + i_p), tl.load(prog_first_seg + i_p + 1)):
        _attend_segment(
            q, kv, page_table, kv_lens, qo_indptr, tree_mask, out, lse, partial_out, partial_lse,
            tl.load(seg_seq + i_s), tl.load(seg_row0 + i_s), tl.load(seg_kv_start + i_s),
            tl.load(seg_kv_end + i_s), tl.load(seg_partial + i_s),
            stride_qt, stride_qh, stride_kvp, stride_kvs, stride_pt, stride_pp, stride_kl, stride_qo,
            stride_mt, stride_mw, mask_words, stride_ot, stride_oh, stride_lt, stride_lh, scale_log2,
            H, PAGE_SIZE, BLOCK_M, BLOCK_N, D_LATENT, D_ROPE, DOT_FP32,
        )


@triton.jit
def _combine_kernel(
    partial_out, partial_lse, out, lse, qo_indptr,
    group_seq, group_row0, group_first, group_count,
    stride_qo, stride_ot, stride_oh, stride_lt, stride_lh,
    H: tl.constexpr, BLOCK_M: tl.constexpr, D_LATENT: tl.constexpr,
):
    """Merge the KV splits of one packed row: one program per (split group, row of the block)."""
    i_g = tl.program_id(0)
    i_r = tl.program_id(1)
    i_b = tl.load(group_seq + i_g)
    row = tl.load(group_row0 + i_g) + i_r
    qo_start = tl.load(qo_indptr + i_b * stride_qo)
    n_nodes = tl.load(qo_indptr + (i_b + 1) * stride_qo) - qo_start
    if row < n_nodes * H:
        first = tl.load(group_first + i_g)
        count = tl.load(group_count + i_g)
        o_d = tl.arange(0, D_LATENT)
        b_m = tl.full([], float("-inf"), tl.float32)
        b_l = tl.zeros([], tl.float32)
        b_acc = tl.zeros([D_LATENT], tl.float32)
        for s in range(count):
            o_p = (first + s).to(tl.int64) * BLOCK_M + i_r
            b_lse2 = tl.load(partial_lse + o_p)
            b_m_new = tl.maximum(b_m, b_lse2)
            b_m_use = tl.where(b_m_new == float("-inf"), 0.0, b_m_new)
            b_w = tl.exp2(b_lse2 - b_m_use)
            b_alpha = tl.exp2(b_m - b_m_use)
            b_part = tl.load(partial_out + o_p * D_LATENT + o_d)
            b_acc = b_acc * b_alpha + b_w * b_part
            b_l = b_l * b_alpha + b_w
            b_m = b_m_new
        has_key = b_l > 0
        b_l_safe = tl.where(has_key, b_l, 1.0)
        o_t = (qo_start + row // H).to(tl.int64)
        head = row % H
        tl.store(out + o_t * stride_ot + head * stride_oh + o_d, (b_acc / b_l_safe).to(out.dtype.element_ty))
        tl.store(lse + o_t * stride_lt + head * stride_lh, tl.where(has_key, (b_m + tl.log2(b_l_safe)) * LN2, float("-inf")))


@dataclass(frozen=True)
class FlashConfig:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int

    def shared_bytes(self, elem: int = 2) -> int:
        """Upper estimate of the shared memory: q block, two K tiles (Triton 3.6 allocates two for
        1-3 stages), the P tile. Compiler reports (``scripts/compile_report.py``, sm_90 and
        sm_120): 64x64x8x2 221,184 B (estimate 229,376), 64x32x8x3 147,712 (151,552), 32x16x4x2
        69,632 (74,752), 32x32x4x1 102,400 (112,640)."""
        return elem * (self.block_m * D_QK + 2 * self.block_n * D_QK + self.block_m * self.block_n)


# Ordered by preference; the first that fits the device's shared memory is used: 64x64x8x2 on
# Hopper (227 KB), 64x32x8x3 on A100-class parts (163 KB), 32x16x4x2 within 99 KB (sm_120 and
# other consumer parts). BLOCK_N=64 gives the QK wgmma N=32 instead of 16: measured on the H200 in
# docs/perf_log.md (run 7).
CONFIGS = (
    FlashConfig(block_m=64, block_n=64, num_warps=8, num_stages=2),
    FlashConfig(block_m=64, block_n=32, num_warps=8, num_stages=3),
    FlashConfig(block_m=32, block_n=16, num_warps=4, num_stages=2),
)
INTERPRETER_CONFIG = FlashConfig(block_m=32, block_n=16, num_warps=4, num_stages=1)
MIN_SPLIT_TILES = 4  # the line schedule does not cut a segment into pieces shorter than this (tiles)


def _device_limits(device: torch.device) -> tuple[int, int]:
    """(multiprocessor count, max shared memory per block in bytes)."""
    if device.type != "cuda":
        return 4, 1 << 30
    props = triton.runtime.driver.active.utils.get_device_properties(device.index or 0)
    return props["multiprocessor_count"], props["max_shared_mem"]


def pick_config(device: torch.device) -> FlashConfig:
    if interpreting():
        return INTERPRETER_CONFIG
    _, smem = _device_limits(device)
    for cfg in CONFIGS:
        if cfg.shared_bytes() <= smem:
            return cfg
    return CONFIGS[-1]


def resident_programs(cfg: FlashConfig, device: torch.device) -> int:
    """Programs of ``cfg`` the device runs at once: SMs x blocks per SM (shared memory, and the
    register file at 255 registers per thread)."""
    num_sms, smem = _device_limits(device)
    return num_sms * max(1, min(smem // cfg.shared_bytes(), 8 // cfg.num_warps))


@dataclass
class VerifyPlan:
    """Work list of the flash kernel for one set of lengths and head count (see :func:`plan_verify`).

    Reusable for every layer of a model step (same lengths, same heads); holds its own partial
    buffers, so calls that share a plan must run one after another on one stream.
    """

    num_heads: int
    num_rows: int
    num_seqs: int
    kv_lens_host: list[int]
    qo_indptr_host: list[int]
    config: FlashConfig
    device: torch.device
    prog_first_seg: torch.Tensor  # [num_programs + 1] int32: program p runs segments [first[p], first[p+1])
    num_segments: int
    num_groups: int
    # int32 tables, one field per row, columns padded to a multiple of 4 so that every row starts
    # 16-byte aligned (Triton specialises pointers on alignment: a ragged count must not recompile)
    segments: torch.Tensor  # [5, >= num_segments]: seq, row0, kv_start, kv_end, partial slot (-1: final)
    groups: torch.Tensor  # [4, >= num_groups]: seq, row0, first partial slot, split count
    partial_out: torch.Tensor  # [num_partials, BLOCK_M, 512] float32
    partial_lse: torch.Tensor  # [num_partials, BLOCK_M] float32 (log2 units)

    @property
    def num_programs(self) -> int:
        return self.prog_first_seg.shape[0] - 1


Program = list[tuple[int, int, int, int]]  # pieces (sequence, row block, first tile, end tile)

# A segment's fixed cost in KV tiles: q block load, pipeline fill, epilogue (a partial: 128 KB of
# fp32 written per program at ~32 GB/s per SM). Measured on the H200 (docs/perf_log.md, run 9):
# ~16 us per extra segment against ~4.4 us per 64 x 64 tile.
SEGMENT_COST_TILES = 3


def schedule_cost(programs: Sequence[Program]) -> int:
    """Estimated time of a schedule in tiles: its longest program, a segment costing extra."""
    return max((sum(t1 - t0 + SEGMENT_COST_TILES for *_, t0, t1 in prog) for prog in programs), default=0)


def schedule(row_blocks: Sequence[int], tiles: Sequence[int], num_programs: int,
             min_tiles: int = MIN_SPLIT_TILES) -> list[Program]:
    """Cut the work (sequence b, row block r, KV tiles) into at most ``num_programs`` programs;
    returns each program's pieces ``(b, r, first tile, end tile)``: the cheapest (by
    :func:`schedule_cost`) of

    - whole segments (KV columns of a width W, each with every row block of its sequence) dealt
      to the least-loaded program, longest first, for W = the smallest width that gives at most
      one segment per program, W = one program's share, and W = whole sequences;
    - the line schedule (:func:`_line_schedule`): exact shares, segments cut where they fall.
    """
    total = sum(r * t for r, t in zip(row_blocks, tiles))
    if total == 0:
        return []
    P = max(1, min(num_programs, total))
    chunk = math.ceil(total / P)
    widths = {chunk, max(tiles)}
    lo, hi = 1, max(tiles)  # smallest W with sum_b R_b * ceil(T_b / W) <= P, if any
    while lo < hi:
        mid = (lo + hi) // 2
        if sum(r * math.ceil(t / mid) for r, t in zip(row_blocks, tiles)) <= P:
            hi = mid
        else:
            lo = mid + 1
    widths.add(lo)
    candidates = [_line_schedule(row_blocks, tiles, P, chunk, min(min_tiles, chunk // 4))]
    candidates += [_whole_segments(row_blocks, tiles, P, w) for w in sorted(widths)]
    return min(candidates, key=schedule_cost)


def _whole_segments(row_blocks, tiles, P: int, width: int) -> list[Program]:
    """KV columns of ``width`` tiles x row blocks, dealt longest first to the least-loaded program."""
    segs = [(b, r, c0, min(c0 + width, T)) for b, (R, T) in enumerate(zip(row_blocks, tiles))
            for c0 in range(0, T, width) for r in range(R)]
    segs.sort(key=lambda s: s[2] - s[3])  # longest first (stable: keeps sequence order on ties)
    heap = [(0, p) for p in range(min(P, len(segs)))]
    programs: list[Program] = [[] for _ in heap]
    for seg in segs:
        load, p = heapq.heappop(heap)
        programs[p].append(seg)
        heapq.heappush(heap, (load + seg[3] - seg[2] + SEGMENT_COST_TILES, p))
    return programs


def _line_schedule(row_blocks, tiles, P: int, chunk: int, snap: int) -> list[Program]:
    """The work on a line (per sequence, KV columns of about ``chunk`` tiles; within a column the
    sequence's row blocks one after another, so programs side by side read the same KV); program
    p takes ``[p * total / P, (p + 1) * total / P)``, cut at tile granularity; a cut that would
    leave a piece shorter than ``snap`` tiles moves to the segment's edge."""
    total = sum(r * t for r, t in zip(row_blocks, tiles))

    def end_of(p: int) -> int:  # first line position past program p
        return (p + 1) * total // P

    programs: list[Program] = [[] for _ in range(P)]
    pos, p = 0, 0
    for b, (R, T) in enumerate(zip(row_blocks, tiles)):
        if T == 0:
            continue
        width = math.ceil(T / math.ceil(T / chunk))
        for c0 in range(0, T, width):
            c1 = min(c0 + width, T)
            for r in range(R):
                x, e = pos, pos + c1 - c0
                while x < e:
                    while p + 1 < P and x >= end_of(p):
                        p += 1
                    y = min(e, end_of(p))
                    if y < e and y - x < snap and p + 1 < P:  # a sliver for p: start p + 1 here
                        p += 1
                        y = min(e, end_of(p))
                    if y < e and e - y < snap:  # a sliver left for p + 1: p takes it
                        y = e
                    programs[p].append((b, r, c0 + x - pos, c0 + y - pos))
                    x = y
                pos = e
    return [prog for prog in programs if prog]


def plan_verify(
    kv_lens: Sequence[int] | torch.Tensor,
    qo_indptr: Sequence[int] | torch.Tensor,
    num_heads: int,
    device: str | torch.device = "cuda",
    *,
    config: FlashConfig | None = None,
    num_programs: int | None = None,
) -> VerifyPlan:
    """Build the flash kernel's work list from HOST lengths (no device sync if they are host data).

    The kernel is persistent: at most as many programs as the device runs at once, each a list of
    segments (a row block of a sequence against a KV range) of near-equal total work (see
    :func:`schedule`), so no wave runs part-empty. A (sequence, row block) whose KV is cut into
    several segments writes partials, merged by the combine kernel.

    Args:
        kv_lens: ``[B]`` KV length per sequence (host list / CPU tensor; a CUDA tensor is copied,
            which syncs).
        qo_indptr: ``[B+1]`` q row offsets (host).
        num_heads: H.
        device: where the kernel runs.
        config: kernel tile config (default: the best that fits the device).
        num_programs: most programs (tuning / tests); default: the programs the device runs at
            once. Small work is spread too: at prefix 1k-4k, 12-48 programs of 4+ tiles took
            39-42 us where one tile per program took 29-33 us (H200, docs/perf_log.md run 11).
    """
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    kv = [int(x) for x in (kv_lens.tolist() if isinstance(kv_lens, torch.Tensor) else kv_lens)]
    qo = [int(x) for x in (qo_indptr.tolist() if isinstance(qo_indptr, torch.Tensor) else qo_indptr)]
    if len(qo) != len(kv) + 1:
        raise ValueError(f"qo_indptr must have {len(kv) + 1} entries, got {len(qo)}")
    if not 1 <= num_heads <= 128:
        raise ValueError(f"num_heads must be in 1..128, got {num_heads}")
    if num_programs is not None and num_programs < 1:
        raise ValueError(f"num_programs must be >= 1, got {num_programs}")
    cfg = config or pick_config(device)
    bm, bn = cfg.block_m, cfg.block_n

    row_blocks = [math.ceil((qo[b + 1] - qo[b]) * num_heads / bm) for b in range(len(kv))]
    tiles = [math.ceil(L / bn) for L in kv]
    programs = schedule(row_blocks, tiles, num_programs or resident_programs(cfg, device))

    pieces: dict[tuple[int, int], list[tuple[int, int]]] = {}  # (b, r) -> [(program, index)]
    for p, prog in enumerate(programs):
        for i, (b, r, _, _) in enumerate(prog):
            pieces.setdefault((b, r), []).append((p, i))
    slot = {}
    groups = []
    num_partials = 0
    for (b, r), where in pieces.items():
        if len(where) > 1:
            groups.append([b, r * bm, num_partials, len(where)])
            for k, w in enumerate(where):
                slot[w] = num_partials + k
            num_partials += len(where)
    first, segments = [0], []
    for p, prog in enumerate(programs):
        for i, (b, r, t0, t1) in enumerate(prog):
            segments.append([b, r * bm, t0 * bn, min(t1 * bn, kv[b]), slot.get((p, i), -1)])
        first.append(len(segments))

    return VerifyPlan(
        num_heads=num_heads,
        num_rows=qo[-1],
        num_seqs=len(kv),
        kv_lens_host=kv,
        qo_indptr_host=qo,
        config=cfg,
        device=device,
        prog_first_seg=torch.tensor(first, dtype=torch.int32).to(device),
        num_segments=len(segments),
        num_groups=len(groups),
        segments=_aligned_rows(segments, 5, device),
        groups=_aligned_rows(groups, 4, device),
        partial_out=torch.empty(num_partials, bm, D_V, dtype=torch.float32, device=device),
        partial_lse=torch.empty(num_partials, bm, dtype=torch.float32, device=device),
    )


def _aligned_rows(records: list[list[int]], fields: int, device: torch.device) -> torch.Tensor:
    """``records`` as an int32 ``[fields, n]`` table whose rows start 16-byte aligned (n padded to 4)."""
    table = torch.zeros(fields, max(4, -(-len(records) // 4) * 4), dtype=torch.int32)
    if records:
        table[:, : len(records)] = torch.tensor(records, dtype=torch.int32).T
    return table.to(device)


def verify_attention_flash(q, kv_cache, page_table, kv_lens, qo_indptr, tree_mask, sm_scale, out, lse, plan):
    """Launch the flash and combine kernels; inputs already validated by ``verify_attention``."""
    T, H, _ = q.shape
    if (plan.num_heads, plan.num_rows, plan.num_seqs) != (H, T, kv_lens.shape[0]) or plan.device != q.device:
        raise ValueError(
            f"plan was built for H={plan.num_heads}, T={plan.num_rows}, B={plan.num_seqs} on {plan.device}; "
            f"got H={H}, T={T}, B={kv_lens.shape[0]} on {q.device}"
        )
    cfg = plan.config
    if plan.num_programs == 0:  # every sequence has an empty KV (and so no rows)
        return
    sg = plan.segments
    _verify_flash_kernel[(plan.num_programs,)](
        q, kv_cache, page_table, kv_lens, qo_indptr, tree_mask, out, lse,
        plan.prog_first_seg, sg[0], sg[1], sg[2], sg[3], sg[4],
        plan.partial_out, plan.partial_lse,
        q.stride(0), q.stride(1),
        kv_cache.stride(0), kv_cache.stride(1),
        page_table.stride(0), page_table.stride(1),
        kv_lens.stride(0), qo_indptr.stride(0),
        tree_mask.stride(0), tree_mask.stride(1), tree_mask.shape[1],
        out.stride(0), out.stride(1),
        lse.stride(0), lse.stride(1),
        sm_scale * LOG2E,
        H=H,
        PAGE_SIZE=kv_cache.shape[1],
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        D_LATENT=D_V,
        D_ROPE=D_QK - D_V,
        DOT_FP32=interpreting(),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    if plan.num_groups:
        g = plan.groups
        _combine_kernel[(plan.num_groups, cfg.block_m)](
            plan.partial_out, plan.partial_lse, out, lse, qo_indptr,
            g[0], g[1], g[2], g[3],
            qo_indptr.stride(0), out.stride(0), out.stride(1), lse.stride(0), lse.stride(1),
            H=H, BLOCK_M=cfg.block_m, D_LATENT=D_V,
            num_warps=4,
        )
