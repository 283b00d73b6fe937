"""Hopper (sm_90a) tree-verify kernel, written in Gluon: a drop-in for the Triton flash kernel's plan.

Same work list as :func:`kdtree_engine.verify.triton_flash.prepare` (the plan's segments
``seq, row0, kv_start, kv_end, partial slot``, ``prog_first_seg``, partials ``[P, 64, 512]`` fp32 with
log2-sum-exp, and :mod:`.combine`), different tile code: one persistent program per SM runs its
segments (64 packed query rows, row r = node r // H, head r % H, against a KV range) with three
warp-specialised partitions (``gl.warp_specialize``), in the manner of FlashMLA's Hopper decode kernel:

- a loader warpgroup gathers KV tiles of 64 rows through the page table with cp.async (any page
  size, 1 included) into two stages of 128-byte-swizzled shared memory, in chunks (latent columns
  ``[0, 256)``, ``[256, 512)``, rope ``[512, 576)``), each chunk with a full and an empty mbarrier so it
  is refilled as soon as its last reader is done;
- two consumer warpgroups, consumer w on tiles ``2j + w`` (stage w): ``S = Q K^T`` (m64n64 wgmma,
  Q from shared memory), FlashMLA's max chain (consumer 0 publishes its running row max, consumer 1
  takes the max with its tile's and publishes that; consumer 0 rescales its P and O to it), then
  ``O[:, w half] += P_own V_own + P_other V_other`` (m64n256, own P from registers, the other's P from
  shared memory: consumer 0's in a P buffer of its own, consumer 1's over Q's rope columns, which
  both consumers hold in registers once a segment's Q landed): each consumer owns 256 of the 512
  output columns (128 fp32 registers per thread);
- a tile's rope chunk has one reader, its consumer's QK, and is released as soon as that is done;
- prefix tiles run unmasked; only tiles that reach the tree nodes or the segment's end read mask words;
  a segment's pairs of two such clean tiles (after its first pair) run a step with no run-time branch
  around its wgmmas (:func:`_consumer_step` with ``FULL``; perf log run 45: 0-3.6% of the call).

Measured on the H200 against the Triton flash kernel and FlashMLA: docs/perf_log.md, runs 14, 17.
Requires Triton with Gluon's Hopper API (3.6 seen working) and an sm_90 GPU: :func:`available`
says whether this module can run; importing it never fails (no Gluon: ``HAVE_GLUON = False``).
"""

from __future__ import annotations

import torch

try:  # Gluon is experimental: its absence (or a renamed API) must not break ``import kdtree_engine``
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        async_copy,
        fence_async_shared,
        mbarrier,
        warpgroup_mma,
        warpgroup_mma_init,
        warpgroup_mma_wait,
    )

    HAVE_GLUON = True
except (ImportError, AttributeError):  # pragma: no cover - depends on the installed Triton
    HAVE_GLUON = False

from .combine import LN2, PlannedLaunch, grid_barrier, group_entries, prepare_planned
from .contract import D_ROPE, D_V as D_LAT
from .launch import Launcher
from .scheduler import one_sequence_groups, one_sequence_shape, work_range, work_segment

BLOCK_M, BLOCK_N = 64, 64
# warps and registers per thread of the partitions: consumer 0 is the default partition (the launch's
# num_warps = 4), consumer 1 and the loader are workers; 2 x 232 + 40 (+ 8 Triton keeps) = 512 per lane
LOADER_WARPS, CONSUMER_REGS, LOADER_REGS = 4, 232, 40
# the fused merge's tile (splits a round, rows an item) where the split groups are few: when the
# combine's own tile (4, 4) gives every program at most 2 items, items of 2 rows spread each group's
# rows over twice the programs, and 16 splits a round read a group's splits in fewer L2 round trips.
# Run 36 (H200, graph replay, 16 x 2 against 4 x 4): 0.90-0.96 of the call's time at 3 groups
# (1 x 16 heads x 9 nodes, 16k-128k), 0.96-0.99 at 9, 0.99-1.00 at 12; 1.01-1.05 at 18-36 groups
FEW_GROUPS_SPLITS, FEW_GROUPS_ROWS = 16, 2
# a host-planned call that split more row blocks than this merges them in the combine kernel after
# the kernel (a launch of its own) rather than in the kernel after its grid barrier. Run 57 (H100,
# 16k prefix, split + combine against fused, the partials kept in L2): 1.154 at 3 groups, 0.994 at 6,
# 1.005-1.012 at 9, 0.982 at 12, 0.967-0.969 at 18, 0.985 at 36. Run 59: the fused merge dropping
# them (DISCARD_PARTIALS) against the combine form at 12 groups (16 heads x 9 nodes x 4): 0.942 at
# 16k, 0.996 at 64k, 0.986 at 128k (page 1), on another H100 0.942 / 0.981 / 1.016; at 18 and 36
# groups 1.023-1.034
FUSED_MERGE_MAX_GROUPS = 12
# the fused merge drops each partial from L2 once read (discard.global.L2, no write-back): dead
# lines left dirty are written back while the next call's first KV tiles come in (run 59: 17 MB at
# 16 heads x 9 nodes x 4: half of that call's first steps' excess, in its timeline). False: kept (A/B)
DISCARD_PARTIALS = True

if HAVE_GLUON:
    # mbarriers: indices into the kernel's tuple of one-barrier allocations
    _Q_FULL = gl.constexpr(0)  # the segment's Q rows landed (one arrival per loader thread)
    _Q_EMPTY = gl.constexpr(1)  # both consumers are done with the segment's Q (2 arrivals)
    _FULL = gl.constexpr(2)  # + 3 * stage + chunk: a K chunk landed (one arrival per loader thread)
    _EMPTY = gl.constexpr(8)  # + 3 * stage + chunk: a K chunk's last reader is done (1 arrival)
    _P_READY = gl.constexpr(14)  # + consumer: its P tile is in shared memory (1 arrival)
    _M_READY = gl.constexpr(16)  # + consumer: its running row max is in shared memory (1 arrival)
    _SWAP = gl.constexpr(18)  # both consumers published their row sums (2 arrivals)
    _NUM_BARS = gl.constexpr(19)
    # chunks of a K stage: latent columns [0, 256) (consumer 0's V half), [256, 512) (consumer 1's),
    # rope columns [512, 576) (QK only; then the stage owner's P tile)
    _ROPE = gl.constexpr(0)
    _LEFT = gl.constexpr(1)
    _RIGHT = gl.constexpr(2)

    def _where_nonzero(*instructions: str) -> gl.constexpr:
        """Inline PTX for :func:`gl.inline_asm_elementwise` that issues ``instructions`` (over the
        operands ``$1``, ``$3``, ..) where the 32-bit operand ``$2`` is nonzero; ``$0``, the required
        output, is 0."""
        return gl.constexpr("{\n\t.reg .pred p;\n\tsetp.ne.s32 p, $2, 0;\n\t"
                            + "".join(f"@p {ins};\n\t" for ins in instructions) + "mov.u32 $0, 0;\n\t}")

    # a KV row (576 16-bit elements, 1152 bytes) into L2 by its 128-byte lines
    _ROW_LINES = gl.constexpr(9)
    _PREFETCH_ROW_LINES = _where_nonzero(*(f"prefetch.global.L2 [$1+{128 * i}]" for i in range(_ROW_LINES.value)))
    # a run of $3 bytes from $1 into L2 by the bulk engine
    _PREFETCH_RUN = _where_nonzero("cp.async.bulk.prefetch.L2.global [$1], $3")
    # the 128-byte line at $1 out of L2 without a write-back
    _DISCARD_LINE = _where_nonzero("discard.global.L2 [$1], 128")

    @gluon.jit
    def _copy_rows(dst, p_row, m_row, COLS: gl.constexpr, L: gl.constexpr):
        """cp.async ``COLS`` columns of the rows at ``p_row [BLOCK_M]`` (rows where ``m_row`` is false
        are zero-filled) into ``dst [BLOCK_M, COLS]``, as one copy: copied one 64-column swizzle atom at a
        time, the compiler put a partition barrier between the atoms (perf log run 63: 0.91x the time at
        page 1, 16x9x4x131072, equal at page 64)."""
        o_c = gl.expand_dims(gl.arange(0, COLS, layout=gl.SliceLayout(0, L)), 0)
        async_copy.async_copy_global_to_shared(dst, gl.expand_dims(p_row, 1) + o_c, mask=gl.expand_dims(m_row, 1))

    @gluon.jit
    def _segment(i_s, kv_len, R, T, S, seg_seq, seg_row0, seg_kv_start, seg_kv_end, seg_partial, qo_indptr,
                 stride_qo, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, IN_KERNEL: gl.constexpr):
        """Segment ``i_s`` of the program's work (:func:`~kdtree_engine.verify.scheduler.work_segment`):
        its sequence, first packed row, KV range ``[kv_start, kv_end)``, partial slot, and the
        sequence's first query token and node count."""
        i_b, row0, kv_start, kv_end, i_part = work_segment(i_s, kv_len, R, T, S, seg_seq, seg_row0, seg_kv_start,
                                                           seg_kv_end, seg_partial, BLOCK_M, BLOCK_N, IN_KERNEL)
        qo_start = gl.load(qo_indptr + i_b * stride_qo)
        n_nodes = gl.load(qo_indptr + (i_b + 1) * stride_qo) - qo_start
        return i_b, row0, kv_start, kv_end, i_part, qo_start, n_nodes

    @gluon.jit
    def _packed_rows(row0, qo_start, n_nodes, H: gl.constexpr, BLOCK_M: gl.constexpr, L: gl.constexpr):
        """Packed rows ``row0 + [0, BLOCK_M)`` in layout ``L``: the row indices (row r = node r // H,
        head r % H), which are real rows (``< n_nodes * H``), and each row's query token (the padding
        rows clamped to the last node)."""
        o_m = row0 + gl.arange(0, BLOCK_M, layout=L)
        return o_m, o_m < n_nodes * H, (qo_start + gl.minimum(o_m // H, n_nodes - 1)).to(gl.int64)

    @gluon.jit
    def _ws_loader(q, kv, page_table, kv_lens, qo_indptr, prog_first_seg, seg_seq, seg_row0, seg_kv_start,
                   seg_kv_end, seg_partial, s_q, s_q_rope, s_k_lat, s_k_rope, bars,
                   stride_qt, stride_qh, stride_kvp, stride_kvs, stride_pt, stride_pp, stride_qo,
                   H: gl.constexpr, PAGE_SIZE: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                   D_LAT: gl.constexpr, D_ROPE: gl.constexpr, LOADER_WARPS: gl.constexpr, IN_KERNEL: gl.constexpr):
        """Loader partition: per segment the Q rows, then the KV tiles in pairs (tile 2j into stage 0,
        2j + 1 into stage 1), chunk by chunk in the order the consumers release them, each chunk as soon
        as its last reader is done. cp.async
        row gathers through the page table (any page size; rows past the segment zero-filled), completion
        signalled per thread on the chunk's mbarrier. A pair's page ids are loaded before waiting on its
        first chunk, so their latency hides behind the wait. After a pair's copies the rows of the next
        pair are prefetched into L2 (one ``cp.async.bulk.prefetch.L2`` per run of rows within a
        page), so its copies, issued once this pair's stages are released, find them there (one pair
        ahead, not two: a segment's start asks DRAM for one pair less at once; perf log run 65, 0.95
        of the call at 16x9x4x16384); a sequence's row blocks share that prefetch, row block
        ``rb`` of ``n_rb`` taking the rows ``[rb * 128 // n_rb, (rb + 1) * 128 // n_rb)`` of each pair:
        the programs of a KV part run its row blocks together, so each row is prefetched once, not
        once per row block (perf log run 42: each row block prefetching every row made 4x the L2
        lookups of FlashMLA at 3 row blocks; shared, 0.92-0.98 of the call at page 1). At pages of one
        row each row is prefetched by its 128-byte lines, at every row-block count (run 63: 0.883 of
        the call at 16x9x4x131072 page 1 with the one-copy chunks, where the bulk prefetch had been
        gated off at <= 3 row blocks; without any page-1 prefetch, run 42, 9 row blocks lost 19%)."""
        HALF: gl.constexpr = D_LAT // 2
        # the L2 prefetch: rows one prefetch covers at most (never crossing a page): a tile where pages
        # hold whole tiles, else a page where tiles hold whole pages, else a row
        PF_RUN: gl.constexpr = BLOCK_N if PAGE_SIZE % BLOCK_N == 0 else (PAGE_SIZE if BLOCK_N % PAGE_SIZE == 0 else 1)
        L: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [LOADER_WARPS, 1], [1, 0])  # 16-byte vectors
        ROW_L: gl.constexpr = gl.SliceLayout(1, L)
        _wait_prior_grid()
        n_seg = 0
        pairs = 0  # tiles loaded into stage 0 / stage 1 so far (the barriers' phases)
        singles1 = 0
        first, end, step, kv_len, R, T, S = work_range(gl.program_id(0), gl.num_programs(0), prog_first_seg, kv_lens,
                                                       qo_indptr, stride_qo, H, BLOCK_M, BLOCK_N, IN_KERNEL)
        for i_s in range(first, end, step):
            i_b, row0, kv_start, kv_end, _, qo_start, n_nodes = _segment(
                i_s, kv_len, R, T, S, seg_seq, seg_row0, seg_kv_start, seg_kv_end, seg_partial, qo_indptr, stride_qo,
                BLOCK_M, BLOCK_N, IN_KERNEL)
            p_pages = page_table + i_b.to(gl.int64) * stride_pt

            o_m, m_rows, o_t = _packed_rows(row0, qo_start, n_nodes, H, BLOCK_M, ROW_L)
            p_qrow = q + o_t * stride_qt + (o_m % H) * stride_qh
            mbarrier.wait(bars[_Q_EMPTY], (n_seg & 1) ^ 1)
            _copy_rows(s_q.index(0), p_qrow, m_rows, D_LAT, L)
            _copy_rows(s_q_rope.index(0), p_qrow + D_LAT, m_rows, D_ROPE, L)
            async_copy.mbarrier_arrive(bars[_Q_FULL], increment_count=False)
            n_seg += 1

            n_tiles = gl.cdiv(kv_end - kv_start, BLOCK_N)
            # this row block's share of each pair's rows in the L2 prefetch (offsets from the pair's start)
            n_rb = gl.cdiv(n_nodes * H, BLOCK_M)
            rb = row0 // BLOCK_M
            pf_lo = rb * (2 * BLOCK_N) // n_rb
            pf_hi = (rb + 1) * (2 * BLOCK_N) // n_rb
            for j in range(gl.cdiv(n_tiles, 2)):  # tile 2j -> stage 0, tile 2j + 1 (if any) -> stage 1
                # the page ids of the next pair (tiles 2j + 2, 2j + 3), loaded here so their
                # latency hides behind this pair's waits; its rows prefetched into L2 after this pair's copies
                pf_pos, pf_page, pf_ok, pf_n = _pages_ahead(p_pages, kv_start + (2 * j + 2) * BLOCK_N, kv_end,
                                                            pf_lo, pf_hi, stride_pp, PAGE_SIZE, BLOCK_N, PF_RUN,
                                                            LOADER_WARPS)
                has1 = 2 * j + 1 < n_tiles
                o_n0 = kv_start + 2 * j * BLOCK_N + gl.arange(0, BLOCK_N, layout=ROW_L)
                o_n1 = o_n0 + BLOCK_N
                m_n0 = o_n0 < kv_end
                m_n1 = o_n1 < kv_end
                pg0 = gl.load(p_pages + (o_n0 // PAGE_SIZE) * stride_pp, mask=m_n0, other=0)
                pg1 = gl.load(p_pages + (o_n1 // PAGE_SIZE) * stride_pp, mask=m_n1, other=0)
                p_row0 = kv + pg0.to(gl.int64) * stride_kvp + (o_n0 % PAGE_SIZE).to(gl.int64) * stride_kvs
                p_row1 = kv + pg1.to(gl.int64) * stride_kvp + (o_n1 % PAGE_SIZE).to(gl.int64) * stride_kvs
                phase0 = (pairs & 1) ^ 1
                phase1 = (singles1 & 1) ^ 1
                # chunks in the order their last readers release them: the rope chunks (after their
                # consumer's QK), each consumer's own V half (after its local PV), then the halves the
                # other consumer reads
                _load_chunk(s_k_rope.index(0), p_row0 + D_LAT, m_n0, bars, 0, _ROPE, phase0, True, D_ROPE, L)
                _load_chunk(s_k_rope.index(1), p_row1 + D_LAT, m_n1, bars, 1, _ROPE, phase1, has1, D_ROPE, L)
                _load_chunk(s_k_lat.index(0).slice(0, HALF, dim=1), p_row0, m_n0, bars, 0, _LEFT, phase0, True, HALF, L)
                _load_chunk(s_k_lat.index(1).slice(HALF, HALF, dim=1), p_row1 + HALF, m_n1, bars, 1, _RIGHT, phase1,
                            has1, HALF, L)
                _load_chunk(s_k_lat.index(0).slice(HALF, HALF, dim=1), p_row0 + HALF, m_n0, bars, 0, _RIGHT, phase0,
                            True, HALF, L)
                _load_chunk(s_k_lat.index(1).slice(0, HALF, dim=1), p_row1, m_n1, bars, 1, _LEFT, phase1, has1, HALF, L)
                _prefetch_runs(kv, pf_pos, pf_page, pf_ok, pf_n, kv_end, stride_kvp, stride_kvs, PAGE_SIZE,
                               D_LAT + D_ROPE)
                pairs += 1
                singles1 += has1.to(gl.int32)

    @gluon.jit
    def _pages_ahead(p_pages, start, kv_end, lo, hi, stride_pp, PAGE_SIZE: gl.constexpr, BLOCK_N: gl.constexpr,
                     RUN: gl.constexpr, LOADER_WARPS: gl.constexpr):
        """The runs of the two tiles from KV position ``start`` (a ``BLOCK_N`` boundary) cut to the
        offsets ``[lo, hi)`` of those ``2 * BLOCK_N`` rows, one a loader thread: their first positions,
        page ids, whether they exist (not empty, starting before ``kv_end``) and their row counts."""
        LANES: gl.constexpr = gl.BlockedLayout([1], [32], [LOADER_WARPS], [0])
        gl.static_assert(2 * BLOCK_N // RUN <= 32 * LOADER_WARPS)
        o_e = gl.arange(0, 32 * LOADER_WARPS, layout=LANES)
        first = gl.maximum(o_e * RUN, lo)
        last = gl.minimum(o_e * RUN + RUN, hi)
        pos = start + first
        ok = (o_e < 2 * BLOCK_N // RUN) & (first < last) & (pos < kv_end)
        return pos, gl.load(p_pages + (pos // PAGE_SIZE) * stride_pp, mask=ok, other=0), ok, last - first

    @gluon.jit
    def _prefetch_runs(kv, pos, page, ok, count, kv_end, stride_kvp, stride_kvs, PAGE_SIZE: gl.constexpr,
                       D: gl.constexpr):
        """Prefetch into L2 a run of :func:`_pages_ahead` (``count`` rows, none past ``kv_end``): one
        ``cp.async.bulk.prefetch.L2`` of the run, or at pages of 1 (a run is one row) one
        ``prefetch.global.L2`` a 128-byte line of the row's 1152 bytes."""
        p_first = kv + page.to(gl.int64) * stride_kvp + (pos % PAGE_SIZE).to(gl.int64) * stride_kvs
        if PAGE_SIZE == 1:  # one row a run: its 128-byte lines by prefetch.global.L2, not the bulk engine
            gl.static_assert(D * 2 == _ROW_LINES * 128)
            gl.inline_asm_elementwise(_PREFETCH_ROW_LINES, "=r,l,r", [p_first, ok.to(gl.int32)],
                                      dtype=gl.int32, is_pure=False, pack=1)
        else:
            n = gl.minimum(kv_end - pos, count)
            # from the first row's start to the last row's end: a multiple of 16 bytes (strides of 16 elements)
            size = ((n - 1) * stride_kvs + D) * 2
            gl.inline_asm_elementwise(_PREFETCH_RUN, "=r,l,r,r", [p_first, ok.to(gl.int32), size], dtype=gl.int32,
                                      is_pure=False, pack=1)

    @gluon.jit
    def _wait_prior_grid():
        """``griddepcontrol.wait``: this thread waits until the kernel launched before this one in the
        stream has completed and its writes are visible (at once when there is none, or when this
        launch was not a programmatic dependent). Each partition executes it before its first global
        access: with the launch's programmatic stream serialization (:func:`prepare`) this kernel
        may start while the one before it still runs (docs/hopper.md, "The launch";
        ``scripts/hopper_sm90_compile.py`` fails a build where a global access can come first)."""
        gl.inline_asm_elementwise("griddepcontrol.wait; mov.u32 $0, 0;", "=r", [], dtype=gl.int32, is_pure=False,
                                  pack=1)

    @gluon.jit
    def _load_chunk(dst, p_row, m_row, bars, STAGE: gl.constexpr, CHUNK: gl.constexpr, phase, pred,
                    COLS: gl.constexpr, L: gl.constexpr):
        """Wait until chunk CHUNK of stage STAGE is free, gather its rows, arrive on its full barrier
        when they land (nothing when ``pred`` is false: no such tile)."""
        if pred:
            mbarrier.wait(bars[_EMPTY + 3 * STAGE + CHUNK], phase)
            _copy_rows(dst, p_row, m_row, COLS, L)
            async_copy.mbarrier_arrive(bars[_FULL + 3 * STAGE + CHUNK], increment_count=False)

    @gluon.jit
    def _swap_rows(buf, bars, n_swaps, x, WG: gl.constexpr, ROW_L: gl.constexpr):
        """Publish this consumer's row vector ``x [BLOCK_M]`` in ``buf [2 * BLOCK_M]`` and return the
        other consumer's (``n_swaps``: swaps done before this one, which gives the barrier's phase)."""
        BLOCK_M: gl.constexpr = x.shape[0]
        buf.slice(WG * BLOCK_M, BLOCK_M).store(x)
        gl.thread_barrier()  # every thread's store lands before the single-thread arrive
        mbarrier.arrive(bars[_SWAP])
        mbarrier.wait(bars[_SWAP], n_swaps & 1)
        return buf.slice((1 - WG) * BLOCK_M, BLOCK_M).load(ROW_L)

    @gluon.jit
    def _mask_scores(b_s, start, clean_end, kv_end, prefix, p_mask_rows, m_rows_s, mask_words, stride_mw,
                     BLOCK_N: gl.constexpr, S_L: gl.constexpr):
        """Scores of one tile with invisible keys at -inf: only tiles past clean_end (tree nodes,
        the segment's end) read mask words."""
        if start + BLOCK_N > clean_end:
            o_n = start + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, S_L))
            o_j = o_n - prefix  # tree node of each position (negative: prefix)
            o_jc = gl.maximum(o_j, 0)
            m_tree = (o_n < kv_end) & (o_j >= 0) & (o_jc // 32 < mask_words)
            b_word = gl.load(gl.expand_dims(p_mask_rows, 1) + gl.expand_dims((o_jc // 32) * stride_mw, 0),
                             mask=gl.expand_dims(m_rows_s, 1) & gl.expand_dims(m_tree, 0), other=0)
            b_bit = (b_word >> gl.expand_dims(o_jc % 32, 0)) & 1
            m_vis = gl.expand_dims(o_n < kv_end, 0) & (gl.expand_dims(o_j < 0, 0) | (b_bit != 0))
            b_s = gl.where(m_vis, b_s, float("-inf"))
        return b_s

    @gluon.jit
    def _publish_rows(dst, x, bars, WG: gl.constexpr):
        """Store this consumer's row vector ``x [BLOCK_M]`` to ``dst`` and arrive on its M_READY barrier."""
        dst.store(x)
        gl.thread_barrier()  # every thread's store lands before the single-thread arrive
        mbarrier.arrive(bars[_M_READY + WG])

    @gluon.jit
    def _row_partials(b_p):
        """Each thread's share of the row sums of ``b_p [BLOCK_M, BLOCK_N]`` (wgmma accumulator layout:
        a thread holds columns ``8 k + 2 (lane % 4) + {0, 1}`` of its rows): ``[BLOCK_M, 4]``, column
        ``lane % 4``, summed within the thread only (no shuffles; the four are added once a segment)."""
        BLOCK_M: gl.constexpr = b_p.shape[0]
        BLOCK_N: gl.constexpr = b_p.shape[1]
        return gl.sum(gl.sum(gl.reshape(b_p, [BLOCK_M, BLOCK_N // 8, 4, 2]), axis=3), axis=1)

    @gluon.jit
    def _scale_row_partials(parts, factor):
        """Row sums' shares ``parts [BLOCK_M, 4]`` (:func:`_row_partials`) times a row vector ``factor
        [BLOCK_M]`` (the row-vector layout of the scores; its conversion moves nothing)."""
        return parts * gl.expand_dims(gl.convert_layout(factor, gl.SliceLayout(1, parts.type.layout)), 1)

    @gluon.jit
    def _qk_chunks(s_q, q_rope, k_lat, k_rope, bars, phase, WG: gl.constexpr, BLOCK_M: gl.constexpr,
                   BLOCK_N: gl.constexpr, HALF: gl.constexpr, S_L: gl.constexpr):
        """S = Q K^T of the tile in stage WG, each K chunk waited for just before its wgmma, in the
        order the chunks are refilled: the rope (read by nothing else, released first, and refilled
        first; Q's rope columns ``q_rope`` from registers: a ninth less shared-memory traffic in the
        QK, whose m64n64 wgmmas read both operands from shared memory at its full bandwidth), the V
        half this consumer released earliest (its own), then the other half, which the other
        consumer's PV releases last (run 36: rope first 0.2-1.6% faster than after the first half at
        9 shapes). The rope chunk is released as soon as its wgmma retired."""
        FIRST: gl.constexpr = _LEFT + WG
        SECOND: gl.constexpr = _RIGHT - WG
        mbarrier.wait(bars[_FULL + 3 * WG + _ROPE], phase)
        fence_async_shared()
        b_s = warpgroup_mma(q_rope, k_rope.permute((1, 0)), gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=S_L),
                            use_acc=False, is_async=True)
        mbarrier.wait(bars[_FULL + 3 * WG + FIRST], phase)
        fence_async_shared()
        b_s = warpgroup_mma(s_q.slice(WG * HALF, HALF, dim=1), k_lat.slice(WG * HALF, HALF, dim=1).permute((1, 0)),
                            b_s, is_async=True)
        mbarrier.wait(bars[_FULL + 3 * WG + SECOND], phase)
        fence_async_shared()
        b_s = warpgroup_mma(s_q.slice((1 - WG) * HALF, HALF, dim=1),
                            k_lat.slice((1 - WG) * HALF, HALF, dim=1).permute((1, 0)), b_s, is_async=True)
        b_s = warpgroup_mma_wait(1, deps=[b_s])
        mbarrier.arrive(bars[_EMPTY + 3 * WG + _ROPE])
        return warpgroup_mma_wait(0, deps=[b_s])

    @gluon.jit
    def _qk_after_pv(s_q, q_rope, k_lat, k_rope, bars, phase, acc, p1, v1, pending,
                     BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HALF: gl.constexpr, S_L: gl.constexpr,
                     PENDING: gl.constexpr):
        """Consumer 0's QK of its next tile (as :func:`_qk_chunks`), with its PV on the previous
        step's P1 (``pending``) issued ahead of it and retired once the QK's first two wgmmas are
        issued (then stage 1's left half is released), so the tensor cores have the QK queued
        behind the PV, as FlashMLA's warpgroup 0 does. ``PENDING``: known to be pending (no branch)."""
        acc = warpgroup_mma_init(acc)
        if PENDING or pending:
            acc = warpgroup_mma(p1, v1, acc, is_async=True)
        mbarrier.wait(bars[_FULL + _ROPE], phase)
        fence_async_shared()
        b_s = warpgroup_mma(q_rope, k_rope.permute((1, 0)), gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=S_L),
                            use_acc=False, is_async=True)
        mbarrier.wait(bars[_FULL + _LEFT], phase)
        fence_async_shared()
        b_s = warpgroup_mma(s_q.slice(0, HALF, dim=1), k_lat.slice(0, HALF, dim=1).permute((1, 0)), b_s,
                            is_async=True)
        acc = warpgroup_mma_wait(2, deps=[acc])  # the PV (when issued) has retired
        if PENDING or pending:
            mbarrier.arrive(bars[_EMPTY + 3 * 1 + _LEFT])
        mbarrier.wait(bars[_FULL + _RIGHT], phase)
        fence_async_shared()
        b_s = warpgroup_mma(s_q.slice(HALF, HALF, dim=1), k_lat.slice(HALF, HALF, dim=1).permute((1, 0)), b_s,
                            is_async=True)
        b_s = warpgroup_mma_wait(1, deps=[b_s])
        mbarrier.arrive(bars[_EMPTY + _ROPE])
        return warpgroup_mma_wait(0, deps=[b_s]), acc

    @gluon.jit
    def _consumer_step(j, acc, m_i, l_i, steps, own_uses, pending, kv_start, n_tiles, clean_end, kv_end, prefix,
                       p_mask_rows, m_rows_s, mask_words, stride_mw, q_rope, scale_log2,
                       s_q, s_q_rope, s_k_lat, s_k_rope, s_p0, s_rows, bars,
                       WG: gl.constexpr, FULL: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                       HALF: gl.constexpr, S_L: gl.constexpr, O_L: gl.constexpr):
        """Consumer ``WG``'s step j of a segment (see :func:`_ws_consumer`); returns the updated
        ``acc, m_i, l_i, steps, own_uses, pending``. ``FULL``: the pair's two tiles exist and hold
        prefix keys only, and consumer 0 has a PV pending (j > 0): the step then has no branch."""
        P_DOT: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=O_L, k_width=2)
        ROW_S: gl.constexpr = gl.SliceLayout(1, S_L)
        ROW_O: gl.constexpr = gl.SliceLayout(1, O_L)
        dt: gl.constexpr = s_q.dtype
        start = kv_start + (2 * j + WG) * BLOCK_N
        has_own = 2 * j + WG < n_tiles  # always true for consumer 0
        has_other = 2 * j + 1 - WG < n_tiles  # always true for consumer 1
        b_s = gl.full([BLOCK_M, BLOCK_N], float("-inf"), gl.float32, layout=S_L)
        if FULL or has_own:
            # zero, but not a constant to the compiler: with constant buffers the 72 wgmma descriptors
            # of the QK are hoisted out of the loop and spilled (1 KB of local memory reloaded
            # before every QK: 10.6k instead of 6.3k cycles per step on the H200, perf log run 17)
            zero = j >> 30
            if WG == 0:
                b_s, acc = _qk_after_pv(s_q.index(zero), q_rope, s_k_lat.index(zero), s_k_rope.index(zero), bars,
                                        own_uses & 1, acc, s_q_rope.index(zero),
                                        s_k_lat.index(1 + zero).slice(0, HALF, dim=1), pending,
                                        BLOCK_M, BLOCK_N, HALF, S_L, FULL)
            else:
                b_s = _qk_chunks(s_q.index(zero), q_rope, s_k_lat.index(WG + zero),
                                 s_k_rope.index(WG + zero), bars, own_uses & 1, WG, BLOCK_M, BLOCK_N, HALF, S_L)
            own_uses += 1
            if not FULL:
                b_s = _mask_scores(b_s, start, clean_end, kv_end, prefix, p_mask_rows, m_rows_s,
                                   mask_words, stride_mw, BLOCK_N, S_L)
        v_own = s_k_lat.index(WG).slice(WG * HALF, HALF, dim=1)
        v_other = s_k_lat.index(1 - WG).slice(WG * HALF, HALF, dim=1)
        if WG == 0:
            # m0 = running max with tile 2j; P0 against m0; then consumer 1's max m1 (>= m0)
            # arrives, P0 is rescaled to it and O0 once (old max -> m1), and the PV issued
            m0 = gl.maximum(m_i, gl.max(b_s, axis=1) * scale_log2)  # = max of the scaled scores
            _publish_rows(s_rows.slice(0, BLOCK_M), m0, bars, 0)
            m0_use = gl.where(m0 == float("-inf"), 0.0, m0)  # rows with nothing visible yet
            b_p = gl.exp2(b_s * scale_log2 - gl.expand_dims(m0_use, 1))  # one FFMA a score
            l_s = _row_partials(b_p)
            mbarrier.wait(bars[_M_READY + 1], steps & 1)
            m1 = s_rows.slice(BLOCK_M, BLOCK_M).load(ROW_S)
            m1_use = gl.where(m1 == float("-inf"), 0.0, m1)
            # P0's factor to m1; where m0 = -inf P0 is zero and any finite factor does (m0_use's
            # 0 would make exp2(-m1) overflow to inf, and 0 * inf NaN, for m1 below -128)
            corr = gl.where(m0 == float("-inf"), 1.0, gl.exp2(m0_use - m1_use))
            alpha = gl.exp2(m_i - m1_use)
            m_i = m1
            l_i = _scale_row_partials(l_i, alpha) + _scale_row_partials(l_s, corr)
            b_p = (b_p * gl.expand_dims(corr, 1)).to(dt)
            acc = acc * gl.expand_dims(gl.convert_layout(alpha, ROW_O), 1)
            acc = warpgroup_mma(gl.convert_layout(b_p, P_DOT), v_own, acc, is_async=True)
            s_p0.store(b_p)
            fence_async_shared()
            gl.thread_barrier()
            mbarrier.arrive(bars[_P_READY + 0])
            acc = warpgroup_mma_wait(0, deps=[acc])
            mbarrier.arrive(bars[_EMPTY + 3 * 0 + _LEFT])
            mbarrier.wait(bars[_P_READY + 1], steps & 1)
            pending = has_other  # its PV on P1 (over Q's rope columns): issued ahead of the next QK
        else:
            # m1 = max(m0, tile 2j + 1): P1 against the final max of the step
            mbarrier.wait(bars[_M_READY + 0], steps & 1)
            m1 = gl.maximum(s_rows.slice(0, BLOCK_M).load(ROW_S), gl.max(b_s, axis=1) * scale_log2)
            _publish_rows(s_rows.slice(BLOCK_M, BLOCK_M), m1, bars, 1)
            m1_use = gl.where(m1 == float("-inf"), 0.0, m1)
            alpha = gl.exp2(m_i - m1_use)
            m_i = m1
            b_p = gl.exp2(b_s * scale_log2 - gl.expand_dims(m1_use, 1))
            l_i = _scale_row_partials(l_i, alpha) + _row_partials(b_p)
            if FULL or has_own:
                s_q_rope.index(0).store(b_p.to(dt))  # P1 over Q's rope columns (in registers)
                fence_async_shared()
            gl.thread_barrier()
            mbarrier.arrive(bars[_P_READY + 1])
            acc = acc * gl.expand_dims(gl.convert_layout(alpha, ROW_O), 1)
            if FULL or has_own:
                acc = warpgroup_mma(gl.convert_layout(b_p.to(dt), P_DOT), v_own, acc, is_async=True)
                mbarrier.wait(bars[_P_READY + 0], steps & 1)
                acc = warpgroup_mma(s_p0, v_other, acc, is_async=True)
                acc = warpgroup_mma_wait(1, deps=[acc])
                mbarrier.arrive(bars[_EMPTY + 3 * 1 + _RIGHT])
                acc = warpgroup_mma_wait(0, deps=[acc])
            else:
                mbarrier.wait(bars[_P_READY + 0], steps & 1)
                acc = warpgroup_mma(s_p0, v_other, acc)
            mbarrier.arrive(bars[_EMPTY + 3 * 0 + _RIGHT])
        steps += 1
        return acc, m_i, l_i, steps, own_uses, pending

    @gluon.jit
    def _ws_consumer(kv_lens, qo_indptr, tree_mask, out, lse, prog_first_seg, seg_seq, seg_row0,
                     seg_kv_start, seg_kv_end, seg_partial, partial_out, partial_lse,
                     s_q, s_q_rope, s_k_lat, s_k_rope, s_p0, s_rows, bars,
                     stride_kl, stride_qo, stride_mt, stride_mw, mask_words,
                     stride_ot, stride_oh, stride_lt, stride_lh, scale_log2,
                     WG: gl.constexpr, H: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                     D_LAT: gl.constexpr, IN_KERNEL: gl.constexpr):
        """Consumer partition ``WG`` (4 warps): the tiles ``2 j + WG`` of each segment, in stage WG.

        Per step j: S = Q K^T of its own tile (64 x 64; the K chunks waited one by one), then the max
        chain (scores unscaled; the scale positive, so the max of the raw scores times it is the
        max of the scaled ones, and the scale goes into the exponent's FFMA): consumer 0 publishes
        m0 = max(m, rowmax S0) and computes P0 against it; consumer 1 publishes m1 = max(m0, rowmax
        S1), stores P1 over Q's rope columns and issues ``O[:, 256:512] += P1 V1 + P0 V0``; consumer 0
        rescales P0 and its row sums to m1 and O once (from m to m1), issues ``O[:, 0:256] += P0 V0``,
        stores P0 (its own buffer), and issues ``O[:, 0:256] += P1 V1`` at the start of step j + 1,
        ahead of that step's QK (:func:`_qk_after_pv`; the segment's last one after its loop). Own P
        comes from registers, the other's from shared memory.
        Each consumer owns half of the 512 output columns (128 fp32 registers per thread) and its own
        row sums, each thread's share of them kept apart through the segment (:func:`_row_partials`,
        no shuffles in the step, as FlashMLA does; perf log run 66: 0.963-0.988 of the call at 33
        nodes x 64-128 heads from 64k keys on, within the spread elsewhere), then added up, and the
        two consumers' sums added through shared memory at the segment's end. A chunk is released as
        soon as its last reader is done.
        """
        HALF: gl.constexpr = D_LAT // 2
        S_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                      instr_shape=[16, BLOCK_N, 16])
        O_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                      instr_shape=[16, HALF, 16])
        P_DOT: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=O_L, k_width=2)
        Q_DOT: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=S_L, k_width=2)
        ROW_S: gl.constexpr = gl.SliceLayout(1, S_L)
        ROW_O: gl.constexpr = gl.SliceLayout(1, O_L)
        COL_O: gl.constexpr = gl.SliceLayout(0, O_L)
        dt: gl.constexpr = s_q.dtype

        _wait_prior_grid()
        n_seg = 0
        steps = 0
        own_uses = 0
        first, end, step, kv_len, R, T, S = work_range(gl.program_id(0), gl.num_programs(0), prog_first_seg, kv_lens,
                                                       qo_indptr, stride_qo, H, BLOCK_M, BLOCK_N, IN_KERNEL)
        for i_s in range(first, end, step):
            i_b, row0, kv_start, kv_end, i_part, qo_start, n_nodes = _segment(
                i_s, kv_len, R, T, S, seg_seq, seg_row0, seg_kv_start, seg_kv_end, seg_partial, qo_indptr, stride_qo,
                BLOCK_M, BLOCK_N, IN_KERNEL)
            prefix = gl.load(kv_lens + i_b * stride_kl) - n_nodes
            n_tiles = gl.cdiv(kv_end - kv_start, BLOCK_N)
            # tiles starting below clean_end hold prefix keys only and need no mask
            clean_end = kv_start + gl.maximum(gl.minimum(kv_end, prefix) - kv_start, 0) // BLOCK_N * BLOCK_N
            o_ms, m_rows_s, o_ts = _packed_rows(row0, qo_start, n_nodes, H, BLOCK_M, ROW_S)
            p_mask_rows = tree_mask + o_ts * stride_mt  # [BM]

            m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=ROW_S)
            l_i = _row_partials(gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=S_L))  # [BLOCK_M, 4]
            acc = gl.zeros([BLOCK_M, HALF], gl.float32, layout=O_L)
            mbarrier.wait(bars[_Q_FULL], n_seg & 1)
            n_seg += 1
            q_rope = s_q_rope.index(0).load(Q_DOT)
            pending = False  # consumer 0: its PV on the last step's P1 is still to be issued
            # step 0 (consumer 0 has no PV pending yet), then the pairs of two clean tiles with no
            # branch in the step (a loop inside the first general step's iteration: one copy of each
            # step's code), then the rest (tree-node tiles, the segment's end)
            n_pairs = gl.cdiv(n_tiles, 2)
            n_full = gl.maximum((clean_end - kv_start) // (2 * BLOCK_N), 1)
            for t in range(0, gl.minimum(n_pairs, 1) + n_pairs - n_full):
                j = gl.where(t == 0, 0, n_full + t - 1)
                acc, m_i, l_i, steps, own_uses, pending = _consumer_step(
                    j, acc, m_i, l_i, steps, own_uses, pending, kv_start, n_tiles, clean_end, kv_end, prefix,
                    p_mask_rows, m_rows_s, mask_words, stride_mw, q_rope, scale_log2,
                    s_q, s_q_rope, s_k_lat, s_k_rope, s_p0, s_rows, bars, WG, False, BLOCK_M, BLOCK_N, HALF, S_L, O_L)
                if t == 0:
                    for jf in range(1, n_full):
                        acc, m_i, l_i, steps, own_uses, pending = _consumer_step(
                            jf, acc, m_i, l_i, steps, own_uses, pending, kv_start, n_tiles, clean_end, kv_end,
                            prefix, p_mask_rows, m_rows_s, mask_words, stride_mw, q_rope, scale_log2,
                            s_q, s_q_rope, s_k_lat, s_k_rope, s_p0, s_rows, bars, WG, True, BLOCK_M, BLOCK_N, HALF,
                            S_L, O_L)
            if WG == 0:
                if pending:  # the segment's last P1
                    acc = warpgroup_mma(s_q_rope.index(0), s_k_lat.index(1).slice(0, HALF, dim=1), acc)
                    mbarrier.arrive(bars[_EMPTY + 3 * 1 + _LEFT])
            mbarrier.arrive(bars[_Q_EMPTY])
            # one row-sum swap per segment: n_seg - 1 swaps came before this one
            l_i = gl.convert_layout(gl.sum(l_i, axis=1), ROW_S)
            l_i = l_i + _swap_rows(s_rows.slice(2 * BLOCK_M, 2 * BLOCK_M), bars, n_seg - 1, l_i, WG, ROW_S)

            has_key = l_i != 0  # NaN (a NaN score of a visible key) propagates: NaN out and lse
            l_safe = gl.where(has_key, l_i, 1.0)
            lse2 = gl.where(has_key, m_i + gl.log2(l_safe), float("-inf"))  # log2-sum-exp2
            b_o = acc * gl.expand_dims(gl.convert_layout(1.0 / l_safe, ROW_O), 1)
            o_mo, m_rows_o, o_to = _packed_rows(row0, qo_start, n_nodes, H, BLOCK_M, ROW_O)
            m_rows_o = gl.expand_dims(m_rows_o, 1)
            o_do = WG * HALF + gl.arange(0, HALF, layout=COL_O)
            if i_part < 0:
                p_out = out + gl.expand_dims(o_to * stride_ot + (o_mo % H) * stride_oh, 1) + gl.expand_dims(o_do, 0)
                gl.store(p_out, b_o.to(out.dtype.element_ty), mask=m_rows_o)
                if WG == 0:
                    gl.store(lse + o_ts * stride_lt + (o_ms % H) * stride_lh, lse2 * LN2, mask=m_rows_s)
            else:
                o_po = i_part.to(gl.int64) * BLOCK_M + gl.arange(0, BLOCK_M, layout=ROW_O)
                gl.store(partial_out + gl.expand_dims(o_po * D_LAT, 1) + gl.expand_dims(o_do, 0), b_o, mask=m_rows_o)
                if WG == 0:
                    o_ps = i_part.to(gl.int64) * BLOCK_M + gl.arange(0, BLOCK_M, layout=ROW_S)
                    gl.store(partial_lse + o_ps, lse2, mask=m_rows_s)

    @gluon.jit(do_not_specialize=["stride_pt", "stride_mt", "mask_words", "merge_splits"])
    def _hopper_verify_kernel(
        q, kv, page_table, kv_lens, qo_indptr, tree_mask, out, lse,
        prog_first_seg, seg_seq, seg_row0, seg_kv_start, seg_kv_end, seg_partial,
        partial_out, partial_lse,
        group_seq, group_row0, group_first, group_splits, num_groups, barrier_word,
        stride_qt, stride_qh, stride_kvp, stride_kvs, stride_pt, stride_pp, stride_kl, stride_qo,
        stride_mt, stride_mw, mask_words, stride_ot, stride_oh, stride_lt, stride_lh,
        scale_log2, merge_splits,
        H: gl.constexpr, PAGE_SIZE: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
        D_LAT: gl.constexpr, D_ROPE: gl.constexpr, LOADER_WARPS: gl.constexpr, CONSUMER_REGS: gl.constexpr,
        LOADER_REGS: gl.constexpr, FUSE_COMBINE: gl.constexpr, BLOCK_S: gl.constexpr, BLOCK_R: gl.constexpr,
        IN_KERNEL: gl.constexpr, FEW_S: gl.constexpr, FEW_R: gl.constexpr, DISCARD: gl.constexpr,
        num_warps: gl.constexpr,
    ):
        """One persistent program: segments ``prog_first_seg[p] : prog_first_seg[p + 1]`` of the plan
        (with ``IN_KERNEL``: those of a one-sequence step, scheduled by each partition from the device
        lengths, :func:`~kdtree_engine.verify.scheduler.work_range`; the split groups written after
        the partitions joined, for the merge).

        Warps: consumer 0 (the default partition, 4 warps), consumer 1 (4 warps), the loader
        (``LOADER_WARPS``). Shared memory (231,216 B of the 232,448 an H200 block may use; compiled
        for sm_90a: 32 / 68 B of spill stores at page 64 / 1, scalars kept across the partitions):
        Q ``[64, 512] + [64, 64]`` (its rope columns later hold consumer 1's P), two K stages
        ``[64, 512] + [64, 64]`` (stage w holds consumer w's tile), consumer 0's P ``[64, 64]``, the row
        max / row sum vectors, the mbarriers. With ``FUSE_COMBINE`` (a cooperative launch) and
        ``merge_splits`` (run time: else the combine kernel follows), once the partitions joined: the
        grid barrier and the program's share of the merge of the split row
        blocks (:func:`_combine_items`), when the plan split any: in ``(BLOCK_S, BLOCK_R)`` tiles
        (splits a round, rows an item), or ``(FEW_S, FEW_R)`` where those would give every program
        at most 2 items (few groups; decided on the group count the schedule wrote, so a device
        schedule and a graph replay take the same rule); with ``DISCARD`` (:data:`DISCARD_PARTIALS`)
        each round's partials leave L2 once read.
        """
        gl.static_assert(num_warps == 4)
        gl.static_assert(BLOCK_M == BLOCK_N and BLOCK_N == D_ROPE)  # a P tile fits over Q's rope columns
        # the next kernel in the stream, if launched as a programmatic dependent, may launch once every
        # program got here: its programs take the SMs this kernel's leave and wait for its end there
        gl.inline_asm_elementwise("griddepcontrol.launch_dependents; mov.u32 $0, 0;", "=r", [], dtype=gl.int32,
                                  is_pure=False, pack=1)
        dt: gl.constexpr = kv.dtype.element_ty
        LAT_S: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, D_LAT], dt)
        ROPE_S: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, D_ROPE], dt)
        s_q = gl.allocate_shared_memory(dt, [1, BLOCK_M, D_LAT], LAT_S)
        s_q_rope = gl.allocate_shared_memory(dt, [1, BLOCK_M, D_ROPE], ROPE_S)
        s_k_lat = gl.allocate_shared_memory(dt, [2, BLOCK_N, D_LAT], LAT_S)
        s_k_rope = gl.allocate_shared_memory(dt, [2, BLOCK_N, D_ROPE], ROPE_S)
        s_p0 = gl.allocate_shared_memory(dt, [BLOCK_M, BLOCK_N], ROPE_S)  # consumer 0's P tile
        # running row maxima m0, m1 [2 * BLOCK_M]; both consumers' row sums [2 * BLOCK_M]
        s_rows = gl.allocate_shared_memory(gl.float32, [4 * BLOCK_M], gl.SwizzledSharedLayout(1, 1, 1, [0]))
        # one allocation per mbarrier (a tuple): the compiler then sees a wait and an arrive on different
        # barriers as disjoint and puts no partition barrier (bar.sync) between them; with one [_NUM_BARS, 1]
        # array it synchronised the partition before every wait (80 bar.sync in the PTX, now 54)
        bars = ()
        for i in gl.static_range(_NUM_BARS):
            bars = bars + (gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout()),)
        mbarrier.init(bars[_Q_FULL], count=32 * LOADER_WARPS)
        mbarrier.init(bars[_Q_EMPTY], count=2)
        for i in gl.static_range(6):
            mbarrier.init(bars[_FULL + i], count=32 * LOADER_WARPS)
            mbarrier.init(bars[_EMPTY + i], count=1)
        for i in gl.static_range(2):
            mbarrier.init(bars[_P_READY + i], count=1)
            mbarrier.init(bars[_M_READY + i], count=1)
        mbarrier.init(bars[_SWAP], count=2)
        fence_async_shared()
        gl.warp_specialize([
            (_ws_consumer, (kv_lens, qo_indptr, tree_mask, out, lse, prog_first_seg, seg_seq, seg_row0,
                            seg_kv_start, seg_kv_end, seg_partial, partial_out, partial_lse,
                            s_q, s_q_rope, s_k_lat, s_k_rope, s_p0, s_rows, bars,
                            stride_kl, stride_qo, stride_mt, stride_mw, mask_words,
                            stride_ot, stride_oh, stride_lt, stride_lh, scale_log2,
                            0, H, BLOCK_M, BLOCK_N, D_LAT, IN_KERNEL)),
            (_ws_consumer, (kv_lens, qo_indptr, tree_mask, out, lse, prog_first_seg, seg_seq, seg_row0,
                            seg_kv_start, seg_kv_end, seg_partial, partial_out, partial_lse,
                            s_q, s_q_rope, s_k_lat, s_k_rope, s_p0, s_rows, bars,
                            stride_kl, stride_qo, stride_mt, stride_mw, mask_words,
                            stride_ot, stride_oh, stride_lt, stride_lh, scale_log2,
                            1, H, BLOCK_M, BLOCK_N, D_LAT, IN_KERNEL)),
            (_ws_loader, (q, kv, page_table, kv_lens, qo_indptr, prog_first_seg, seg_seq, seg_row0, seg_kv_start,
                          seg_kv_end, seg_partial, s_q, s_q_rope, s_k_lat, s_k_rope, bars,
                          stride_qt, stride_qh, stride_kvp, stride_kvs, stride_pt, stride_pp, stride_qo,
                          H, PAGE_SIZE, BLOCK_M, BLOCK_N, D_LAT, D_ROPE, LOADER_WARPS, IN_KERNEL)),
        ], [4, LOADER_WARPS], [CONSUMER_REGS, LOADER_REGS])
        if IN_KERNEL:  # the split groups of the one sequence's schedule, for the merge
            _, R, _, S = one_sequence_shape(kv_lens, qo_indptr, stride_qo, H, gl.num_programs(0), BLOCK_M, BLOCK_N)
            n_groups = one_sequence_groups(gl.program_id(0), R, S, group_seq, group_row0, group_first, group_splits,
                                           num_groups, BLOCK_M)
        if FUSE_COMBINE:
            if not IN_KERNEL:
                n_groups = gl.load(num_groups)
            if (n_groups > 0) & (merge_splits != 0):
                if n_groups * (BLOCK_M // BLOCK_R) <= 2 * gl.num_programs(0):
                    _combine_items(gl.program_id(0), gl.num_programs(0), n_groups, barrier_word, partial_out,
                                   partial_lse, out, lse, qo_indptr, group_seq, group_row0, group_first, group_splits,
                                   stride_qo, stride_ot, stride_oh, stride_lt, stride_lh, H, BLOCK_M, D_LAT, IN_KERNEL,
                                   FEW_S, FEW_R, DISCARD)
                else:
                    _combine_items(gl.program_id(0), gl.num_programs(0), n_groups, barrier_word, partial_out,
                                   partial_lse, out, lse, qo_indptr, group_seq, group_row0, group_first, group_splits,
                                   stride_qo, stride_ot, stride_oh, stride_lt, stride_lh, H, BLOCK_M, D_LAT, IN_KERNEL,
                                   BLOCK_S, BLOCK_R, DISCARD)

    @gluon.jit
    def _discard_lines(ptrs, first_of_line, loaded):
        """``discard.global.L2`` (PTX ISA 7.4, sm_80+) of the 128-byte line at each of ``ptrs`` where
        ``first_of_line``: the line leaves L2 without a write-back, its data undefined. Issued once
        ``loaded`` (the values read from ``ptrs``) arrived: the warp's load of the line, which the
        merge's layout gives to 8 lanes of one warp, has returned for all of them. Nothing reads a
        partial before a call writes it again, but for the rows past a sequence's last in the item
        that holds it, read and never written: undefined after this, as stale before, and only
        their stores masked."""
        gl.inline_asm_elementwise(_DISCARD_LINE, "=r,l,r,f",
                                  [ptrs.to(gl.int64, bitcast=True), first_of_line.to(gl.int32), loaded],
                                  dtype=gl.int32, is_pure=False, pack=1)

    @gluon.jit
    def _combine_items(first_item, item_step, n_groups, barrier_word, partial_out, partial_lse, out, lse, qo_indptr,
                       group_seq, group_row0, group_first, group_splits,
                       stride_qo, stride_ot, stride_oh, stride_lt, stride_lh,
                       H: gl.constexpr, BLOCK_M: gl.constexpr, D_LAT: gl.constexpr, IN_KERNEL: gl.constexpr,
                       BLOCK_S: gl.constexpr, BLOCK_R: gl.constexpr, DISCARD: gl.constexpr):
        """The grid barrier, then :func:`kdtree_engine.verify.combine.combine_items` in Gluon on the
        ``n_groups`` split groups, for the kernel's 4 warps after the partitions joined (Triton's ops
        need layouts here; same loads, same order of the sums over the splits): a thread holds 4
        columns of every (split, row) of a round. The first item's group entries are read before the
        barrier where a plan wrote them (without ``IN_KERNEL``; with it, this kernel's programs write
        them before the barrier), so the partials' loads follow the barrier at once (perf log run 40:
        0.984-0.999 of the call's time at 11 of 12 shapes)."""
        L3: gl.constexpr = gl.BlockedLayout([1, 1, 4], [1, 1, 32], [1, 1, 4], [2, 1, 0])  # [S, R, 512]
        SR: gl.constexpr = gl.SliceLayout(2, L3)
        RD: gl.constexpr = gl.SliceLayout(0, L3)
        ROW_SR: gl.constexpr = gl.SliceLayout(0, SR)
        ROW_RD: gl.constexpr = gl.SliceLayout(1, RD)
        o_d = gl.arange(0, D_LAT, layout=gl.SliceLayout(0, RD))
        o_d3 = gl.expand_dims(gl.expand_dims(o_d, 0), 0)
        o_s = gl.arange(0, BLOCK_S, layout=gl.SliceLayout(1, SR))
        chunks: gl.constexpr = BLOCK_M // BLOCK_R
        n_items = n_groups * chunks
        i_g = first_item // chunks * (first_item < n_items)
        if not IN_KERNEL:
            first, count, i_b, row0 = group_entries(i_g, group_first, group_splits, group_seq, group_row0)
        grid_barrier(barrier_word, gl.program_id(0), gl.num_programs(0))
        if IN_KERNEL:
            first, count, i_b, row0 = group_entries(i_g, group_first, group_splits, group_seq, group_row0)
        for item in range(first_item, n_items, item_step):
            o_r = (item % chunks) * BLOCK_R + gl.arange(0, BLOCK_R, layout=ROW_SR)
            qo_start = gl.load(qo_indptr + i_b * stride_qo)
            n_rows = (gl.load(qo_indptr + (i_b + 1) * stride_qo) - qo_start) * H
            row = row0 + o_r
            g_next = (item + item_step) // chunks * (item + item_step < n_items)
            first_next, count_next, i_b_next, row0_next = group_entries(g_next, group_first, group_splits, group_seq,
                                                                        group_row0)
            b_m = gl.full([BLOCK_R], float("-inf"), gl.float32, layout=ROW_SR)
            b_l = gl.zeros([BLOCK_R], gl.float32, layout=ROW_SR)
            b_acc = gl.zeros([BLOCK_R, D_LAT], gl.float32, layout=RD)
            # an item wholly past its sequence's rows (the padding of a block that is not full) reads nothing
            n_splits = gl.where(row0 + (item % chunks) * BLOCK_R < n_rows, count, 0)
            for s0 in range(0, n_splits, BLOCK_S):
                m_s = gl.expand_dims(s0 + o_s < count, 1)  # [S, 1]
                o_p = gl.expand_dims((first + s0 + o_s).to(gl.int64), 1) * BLOCK_M + gl.expand_dims(o_r, 0)  # [S, R]
                b_lse2 = gl.load(partial_lse + o_p, mask=m_s, other=float("-inf"), cache_modifier=".cg")
                p_part = partial_out + gl.expand_dims(o_p * D_LAT, 2) + o_d3
                b_part = gl.load(p_part, mask=gl.expand_dims(m_s, 2), other=0.0, cache_modifier=".cg")  # [S, R, D]
                b_m_new = gl.maximum(b_m, gl.max(b_lse2, axis=0))
                b_m_use = gl.where(b_m_new == float("-inf"), 0.0, b_m_new)  # rows with no key so far
                b_alpha = gl.exp2(b_m - b_m_use)
                b_w = gl.exp2(b_lse2 - gl.expand_dims(b_m_use, 0))
                b_acc = (b_acc * gl.expand_dims(gl.convert_layout(b_alpha, ROW_RD), 1)
                         + gl.sum(gl.expand_dims(b_w, 2) * b_part, axis=0))
                b_l = b_l * b_alpha + gl.sum(b_w, axis=0)
                b_m = b_m_new
                if DISCARD:  # the round's partials leave L2 without a write-back
                    _discard_lines(p_part, gl.expand_dims(m_s, 2) & (o_d3 % 32 == 0), b_part)
            has_key = b_l != 0  # a NaN part propagates
            b_l_safe = gl.where(has_key, b_l, 1.0)
            o_t = (qo_start + row // H).to(gl.int64)
            gl.store(lse + o_t * stride_lt + (row % H) * stride_lh,
                     gl.where(has_key, (b_m + gl.log2(b_l_safe)) * LN2, float("-inf")), mask=row < n_rows)
            row_d = gl.convert_layout(row, ROW_RD)
            o_td = gl.convert_layout(o_t, ROW_RD)
            p_out = out + gl.expand_dims(o_td * stride_ot + (row_d % H) * stride_oh, 1) + gl.expand_dims(o_d, 0)
            b_o = b_acc / gl.expand_dims(gl.convert_layout(b_l_safe, ROW_RD), 1)
            gl.store(p_out, b_o.to(out.dtype.element_ty), mask=gl.expand_dims(row_d < n_rows, 1))
            first, count, i_b, row0 = first_next, count_next, i_b_next, row0_next


def available(device: torch.device | str | None = None) -> bool:
    """True when this kernel can run on ``device``: Gluon present and an sm_90 (Hopper) GPU."""
    if not HAVE_GLUON or not torch.cuda.is_available():
        return False
    device = torch.device(device if device is not None else "cuda")
    if device.type != "cuda":
        return False
    return torch.cuda.get_device_capability(device) == (9, 0)


def supports_plan(config) -> bool:
    """True when a plan's tile config suits this kernel: 64-row blocks (the partial buffers' rows)
    and KV tiles a multiple of 64 (segments start on a 64-position boundary)."""
    return config.block_m == BLOCK_M and config.block_n % BLOCK_N == 0


def supports(q: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    """True when the inputs' layout suits the kernel's 16-byte cp.async copies: q and kv_cache
    16-byte aligned with their two outer strides multiples of 16 elements (Triton specialises on
    that; without it the copies would need 2-byte transfers, which cp.async cannot do and the
    compile fails). The contract's dense layouts (576-wide rows) always qualify."""
    return (q.data_ptr() % 16 == 0 and kv_cache.data_ptr() % 16 == 0
            and all(s % 16 == 0 for s in (q.stride(0), q.stride(1), kv_cache.stride(0), kv_cache.stride(1))))


def prepare(q, kv_cache, page_table, kv_lens, qo_indptr, tree_mask, sm_scale, out, lse, plan) -> PlannedLaunch:
    """The Hopper kernel on the plan's segments (and the combine kernel), laid out for every call
    with the signature of these tensors (see :func:`~.combine.prepare_planned`).

    Same arguments as :func:`kdtree_engine.verify.triton_flash.prepare` (inputs already checked
    against the contract and the plan); ``plan`` is a :class:`~kdtree_engine.verify.plan.FlashTables`
    whose config satisfies :func:`supports_plan`, and ``q`` / ``kv_cache`` :func:`supports` (both
    checked by :func:`kdtree_engine.verify.op.resolve`). The kernel is launched as a programmatic
    dependent (PDL): its launch and set-up overlap the end of the kernel before it in the stream,
    whose writes it waits for before reading anything (docs/hopper.md, "The launch").
    """
    H, page_size = q.shape[1], kv_cache.shape[1]
    return prepare_planned(_HOPPER, (H, page_size), q, kv_cache, page_table, kv_lens, qo_indptr, tree_mask, sm_scale,
                           out, lse, plan, dict(kernel_constexprs(H, page_size), launch_pdl=True),
                           FUSED_MERGE_MAX_GROUPS)


def kernel_constexprs(H: int, page_size: int) -> dict:
    """The kernel's compile-time arguments for ``H`` heads and pages of ``page_size``, but the
    merge's (``FUSE_COMBINE``, ``BLOCK_S``, ``BLOCK_R``: :func:`~.combine.prepare_planned` adds them);
    also used by the scripts that compile or stamp the kernel."""
    return dict(H=H, PAGE_SIZE=page_size, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, D_LAT=D_LAT, D_ROPE=D_ROPE,
                LOADER_WARPS=LOADER_WARPS, CONSUMER_REGS=CONSUMER_REGS, LOADER_REGS=LOADER_REGS,
                FEW_S=FEW_GROUPS_SPLITS, FEW_R=FEW_GROUPS_ROWS, DISCARD=DISCARD_PARTIALS, num_warps=4)


_HOPPER = Launcher(_hopper_verify_kernel) if HAVE_GLUON else None
