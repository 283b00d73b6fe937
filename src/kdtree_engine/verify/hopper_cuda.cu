// The Hopper (sm_90a) tree-verify kernel in CUDA C++ (kdtree_engine.verify.hopper_cuda builds it with nvcc
// at first use and launches it through ctypes): the contract of the Gluon kernel (hopper.py) on the same
// plans, on the step measured in scripts/hopper_cuda_step.cu (docs/perf_log.md, run 45). bf16 and fp16;
// host- and device-scheduled plans, and the one-sequence schedule in the kernel (in_kernel).
//
// One persistent CTA per program of a plan (kdtree_engine.verify.plan.FlashTables): its segments (Work),
// each 64 packed query rows (row r = node r / H, head r % H) against the KV range [kv_start, kv_end) of
// its sequence, written to out / lse (partial slot < 0) or to its partial slot (output [64, 512] fp32
// normalised, log2-sum-exp2). The split row blocks are then merged (Params::fuse: a cooperative launch
// of at most one CTA an SM) by the kernel itself, after a grid barrier, as the library's fused merge
// does; otherwise by the library's combine kernel.
//
// Warpgroups: two math warpgroups (the step spike's step, each its own loop: wg w on the tiles
// 2j + w of a segment, in K stage w, owning output columns [256w, 256w + 256)) and a producer
// warpgroup (setmaxnreg 40, the math ones 232) that loads, through the page table, the segment's Q rows
// (cp.async) and then its tiles in pairs (pairs of whole tiles where pages hold them by TMA, others
// gathered by its 128 threads' cp.asyncs: any page size, 1 included), each
// 64-column chunk of a stage as soon as its last reader released it (the chunk's empty mbarrier, one
// arrival by the releasing warpgroup), rows past the segment's end (and a pair's missing second tile)
// zero-filled so that no NaN of an unused row reaches a product (KD_CONSUMER_TMA: the math warpgroups refill a
// segment's TMA pairs after its first themselves, the producer loading its Q, its first pair and gathered pairs
// only). Tiles that reach the tree nodes or
// the segment's end read the tree mask (scores of invisible keys -inf); the steps before them run
// with no mask code and no branch around their wgmmas.
#include <cuda_runtime.h>

#include "hopper_cuda_ptx.cuh"

#ifndef KD_P1_AFTER_BOTH
#define KD_P1_AFTER_BOTH 1  // wg 1 publishes its P after issuing both its PVs (the step spike's best)
#endif
#ifndef KD_EVICT_FIRST
#define KD_EVICT_FIRST 1  // KV rows gathered with an L2 evict-first hint (the step spike's best)
#endif
#ifndef KD_TMA
// where pages hold whole tiles (page size a multiple of 64, pages back to back in the pool), the producer's
// first thread loads a pair of tiles that ends before the segment's end by TMA, a [64, 64] box a chunk,
// instead of the warpgroup's cp.async gathers (a pair with a partial tile, other page sizes: cp.async).
// Run 46: 0.98-1.16 of the Gluon kernel's time at pages of 64 against 1.24-1.45 gathering (-DKD_TMA=0)
#define KD_TMA 1
#endif
#ifndef KD_CONSUMER_TMA
// 1: a TMA pair after a segment's first is refilled chunk by chunk by the math warpgroup that read the chunk
// last, as soon as it is done with it (the step spike's refills, FlashMLA's), not by the producer after an
// arrival on the chunk's empty barrier; the producer then loads a segment's Q, its first pair and gathered
// pairs only. Run 50 (H100): 0.92-0.98 of 0's time at 16 heads x 9 nodes, 1.04-1.12 at H x n >= 528;
// 0 is the default
#define KD_CONSUMER_TMA 0
#endif
#ifndef KD_FENCE_TMA
// 1: a proxy fence after each chunk's wait before its QK, TMA chunks included (the measured build); 0: after
// gathered chunks only (cp.async writes through the generic proxy, TMA through the async one the wgmmas read).
// Run 50 (H100): 0 took 0.95-0.99 of 1's time at three shapes, 1.05 at a fourth within its rounds' spread
#define KD_FENCE_TMA 1
#endif
#ifndef KD_PDL
// 1: programmatic dependent launch (FlashMLA's launches): the kernel is launched with programmatic stream
// serialization, every thread issues griddepcontrol.launch_dependents at entry and griddepcontrol.wait before
// its first global access, so a call's launch and prologue overlap the kernel before it. Not yet measured
// (docs/perf_log.md, CPU session 35): 0 is the measured build
#define KD_PDL 0
#endif
#ifndef KD_MERGE_SPLITS
// the fused merge's loads a warp issues before folding them in, and the most warps that share a row's
// splits (run 47: 8 and 8 took 16x9x1 from 1.75 to 1.24 of the Gluon kernel's time at 4k; 4 and 1 are
// the merge before it, for A/Bs)
#define KD_MERGE_SPLITS 8
#endif
#ifndef KD_MERGE_WARPS
#define KD_MERGE_WARPS 8
#endif
#ifndef KD_WATCHDOG
// a thread that polls an mbarrier phase 2^26 times (1-70 s) says which one (kd_verify_watchdog) and traps:
// a protocol error then fails the launch at once instead of hanging it (the checks build with it)
#define KD_WATCHDOG 0
#endif

namespace {

constexpr int PRODUCER_THREADS = 128;
constexpr int LAUNCH_THREADS = THREADS + PRODUCER_THREADS;
constexpr int MATH_REGS = 232, PRODUCER_REGS = 40;  // setmaxnreg: 2 x 128 x 232 + 128 x 40 of the 65,536
constexpr uint64_t EVICT_FIRST_POLICY = 0x12F0000000000000ull;
constexpr float LN2 = 0.6931471805599453f;

struct __align__(1024) Smem {
    uint8_t q[TILE_BYTES];        // the segment's Q rows in 9 chunks; chunk 8 (rope) then holds wg 1's P
    uint8_t k[2][TILE_BYTES];     // K stages
    uint8_t p0[CHUNK_BYTES];      // wg 0's P
    float row_max[BM];            // running row max (log2 units, scaled); -inf between segments
    float factor0[BM], factor1[BM];
    float row_sum[2][BM];
    uint64_t k_full[2][CHUNKS];   // a chunk landed: one arrival per producer thread
    uint64_t k_empty[2][CHUNKS];  // a chunk's last reader is done: one arrival
    uint64_t q_full;              // the segment's Q landed: one arrival per producer thread
    uint64_t q_empty;             // both math warpgroups are done with the segment's Q: two arrivals
};

// the kernel's arguments: the contract's tensors and the plan's tables as the library's flash kernels take
// them, their strides (in elements) and sizes
struct Params {
    const uint8_t* q;  // [T, H, 576] bf16 or fp16 (f16)
    const uint8_t* kv;  // [pages, page_size, 576], q's dtype
    const int* page_table;  // [B, max pages]
    const int* kv_lens;  // [B]
    const int* qo_indptr;  // [B + 1]
    const int* tree_mask;  // [T, words]
    uint8_t* out;  // [T, H, 512], q's dtype
    float* lse;  // [T, H] (natural log)
    const int* prog_first_seg;  // [P + 1]
    const int* seg_seq;  // [S] each
    const int* seg_row0;
    const int* seg_kv_start;
    const int* seg_kv_end;
    const int* seg_partial;
    float* partial_out;  // [slots, 64, 512]
    float* partial_lse;  // [slots, 64] (log2)
    long long q_st, q_sh, kv_sp, kv_ss, pt_s0, pt_s1, kl_s, qo_s, mt_s, mw_s, o_st, o_sh, l_st, l_sh;
    int* group_seq;  // [G] each: the split row blocks (for the merge; written here with in_kernel)
    int* group_row0;
    int* group_first;  // first partial slot
    int* group_splits;  // split count
    int* group_count;  // [1]: groups in use
    int* grid_barrier;  // [1]: the grid barrier's word (combine.grid_barrier's protocol)
    long long kv_rows;  // rows of the pool (pages x page_size)
    int heads, page_size, mask_words;
    float scale_log2;  // softmax scale x log2(e)
    int tma;  // KD_TMA and the pool's layout allows it (set by the launch)
    int fuse;  // merge the splits in this kernel after a grid barrier (a cooperative launch of <= 1 CTA an SM)
    int f16;  // q, kv, out are fp16 (else bf16)
    int in_kernel;  // a one-sequence step scheduled here from the device lengths (the plan's segments unread)
    // 0, from the host: added to the wgmma descriptors' high words, which ptxas then cannot take for
    // constants (it re-made them by a UMOV before each wgmma: 88 of the 726 instructions of wg 0's step)
    unsigned zero;
};

extern __shared__ uint8_t smem_raw[];

// the kernel's shared memory (its dynamic allocation, from the first 1024-byte boundary)
__device__ __forceinline__ Smem* smem() {
    return reinterpret_cast<Smem*>(smem_raw + ((1024 - (smem_addr(smem_raw) & 1023)) & 1023));
}

// a one-sequence step scheduled here from its device lengths (in_kernel), as the library's
// scheduler.one_sequence_shape does it: KV length, R row blocks, T tiles, S = max(1, min(P / R, T)) KV
// parts; segment i is row block i % R against part i / R, dealt to CTA i mod P
struct OneSequence {
    int kv_len, R, T, S;
};

__device__ __forceinline__ OneSequence one_sequence(const Params& p) {
    OneSequence o;
    o.kv_len = p.kv_lens[0];
    const int n = min(max(p.qo_indptr[p.qo_s] - p.qo_indptr[0], 1), MAX_TREE_NODES);
    o.R = (n * p.heads + BM - 1) / BM;
    o.T = max((o.kv_len + BN - 1) / BN, 1);
    o.S = max(min(int(gridDim.x) / o.R, o.T), 1);
    return o;
}

// this CTA's segments, i = first, first + step, .. below end: the plan's prog_first_seg[cta] ..
// prog_first_seg[cta + 1], or (in_kernel) cta, cta + P, .. below S R
struct Work {
    int first, end, step;
};

__device__ __forceinline__ Work work_of(const Params& p) {
    if (!p.in_kernel) return {p.prog_first_seg[blockIdx.x], p.prog_first_seg[blockIdx.x + 1], 1};
    const OneSequence o = one_sequence(p);
    return {int(blockIdx.x), o.S * o.R, int(gridDim.x)};
}

struct Segment {
    int seq, row0, kv_start, kv_end, slot, qo_start, n_nodes;
};

// segment i: from the plan's tables, or (in_kernel, its shape computed again here: nothing of it is held
// across a segment's steps) row block r = i % R against the tiles [g T / S, (g + 1) T / S) of part
// g = i / R, its partial slot r S + g (-1 with one part: the segment writes out / lse)
__device__ __forceinline__ Segment load_segment(const Params& p, int i) {
    Segment s;
    if (p.in_kernel) {
        const OneSequence o = one_sequence(p);
        const int r = i % o.R, g = i / o.R;
        s.seq = 0;
        s.row0 = r * BM;
        s.kv_start = int((long long)g * o.T / o.S) * BN;
        s.kv_end = min(int((long long)(g + 1) * o.T / o.S) * BN, o.kv_len);
        s.slot = o.S > 1 ? r * o.S + g : -1;
    } else {
        s.seq = p.seg_seq[i];
        s.row0 = p.seg_row0[i];
        s.kv_start = p.seg_kv_start[i];
        s.kv_end = p.seg_kv_end[i];
        s.slot = p.seg_partial[i];
    }
    s.qo_start = p.qo_indptr[s.seq * p.qo_s];
    s.n_nodes = p.qo_indptr[(s.seq + 1) * p.qo_s] - s.qo_start;
    return s;
}

// (in_kernel) this CTA's share of the split groups for the merge, after its segments: group r (row
// block r, slots r S .., S splits) by CTA r < R when S > 1, the count by CTA 0. Returns the count
__device__ __forceinline__ int write_groups(const Params& p) {
    const OneSequence o = one_sequence(p);
    const int n_groups = o.S > 1 ? o.R : 0;
    if (threadIdx.x == 0) {
        if (int(blockIdx.x) < n_groups) {
            p.group_seq[blockIdx.x] = 0;
            p.group_row0[blockIdx.x] = blockIdx.x * BM;
            p.group_first[blockIdx.x] = blockIdx.x * o.S;
            p.group_splits[blockIdx.x] = o.S;
        }
        if (blockIdx.x == 0) *p.group_count = n_groups;
    }
    return n_groups;
}

// 16 bytes from src into shared memory at dst, zeros where !valid (src then only a valid address)
template <bool EVICT_FIRST>
__device__ __forceinline__ void copy16(uint32_t dst, const uint8_t* src, bool valid) {
    if (EVICT_FIRST)
        asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2, %3;"
                     :: "r"(dst), "l"(src), "r"(valid ? 16 : 0), "l"(EVICT_FIRST_POLICY) : "memory");
    else
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" :: "r"(dst), "l"(src), "r"(valid ? 16 : 0)
                     : "memory");
}

// one arrival on bar once this thread's cp.asyncs issued so far landed
__device__ __forceinline__ void arrive_when_copied(uint64_t* bar) {
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" :: "r"(smem_addr(bar)) : "memory");
}

// a producer thread copies 16-byte vector t % 8 of rows t / 8 + 16i (i < 4) of every [64, 64] chunk:
// the rows' addresses (vector included; nullptr: zero-filled) and the vector's place in a chunk's
// 128-byte swizzle
struct ProducerRows {
    const uint8_t* row[4];
};

__device__ __forceinline__ uint32_t swizzled(int t, int i) {
    const int r = t / 8 + 16 * i, v = t % 8;
    return r * 128 + ((v ^ (r & 7)) << 4);
}

// this producer thread's vectors of chunk c of a [64, 576] tile into `tile`
template <bool EVICT_FIRST>
__device__ __forceinline__ void copy_chunk(uint8_t* tile, const ProducerRows& rows, int c, const uint8_t* any, int t) {
#pragma unroll
    for (int i = 0; i < 4; ++i)
        copy16<EVICT_FIRST>(smem_addr(tile + c * CHUNK_BYTES) + swizzled(t, i),
                            rows.row[i] ? rows.row[i] + c * 128 : any, rows.row[i] != nullptr);
}

// the KV rows of the tile at `start` through the page table (past kv_end: none)
__device__ __forceinline__ ProducerRows kv_rows(const Params& p, const int* pages, int start, int kv_end, int t) {
    ProducerRows rows;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const int pos = start + t / 8 + 16 * i;
        rows.row[i] = nullptr;
        if (pos < kv_end) {
            const long long page = pages[(pos / p.page_size) * p.pt_s1];
            rows.row[i] = p.kv + (page * p.kv_sp + (pos % p.page_size) * p.kv_ss) * 2 + (t % 8) * 16;
        }
    }
    return rows;
}

// KD_WATCHDOG: [5] host-mapped words a stuck thread fills (1, CTA, thread, the barrier's offset in Smem,
// parity) before it traps (kd_verify_watchdog sets it; the launch fails if it is null when one fires)
__device__ int* watchdog_words;

// wait for the phase of `bar` with this parity to complete (KD_WATCHDOG: or, after 2^26 polls, 1-70 s, write
// 1, the CTA, the thread, the barrier's offset in Smem and the parity into watchdog_words and trap). All in
// one asm block, as mbar_wait: the same loop written in C++ made ptxas spill the step's accumulators and
// serialise its wgmmas (and a printf, a call, serialises them too)
__device__ __forceinline__ void wait_phase(uint64_t* bar, int parity) {
    if (!KD_WATCHDOG) return mbar_wait(bar, parity);
    asm volatile(
        "{\n.reg .pred done, more;\n.reg .u32 polls;\n"
        "mov.u32 polls, 0;\n"
        "WAIT_%=:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
        "@done bra DONE_%=;\n"
        "add.u32 polls, polls, 1;\n"
        "setp.lt.u32 more, polls, 67108864;\n"
        "@more bra WAIT_%=;\n"
        "st.global.v4.u32 [%2], {1, %3, %4, %5};\n"
        "st.global.u32 [%2+16], %1;\n"
        "membar.sys;\n"
        "trap;\n"
        "DONE_%=:\n}\n"
        :: "r"(smem_addr(bar)), "r"(parity), "l"(watchdog_words), "r"(blockIdx.x), "r"(threadIdx.x),
           "r"(smem_addr(bar) - smem_addr(smem())) : "memory");
}

// the segment's Q rows (padding rows past its nodes zero-filled)
__device__ __forceinline__ void copy_q(const Params& p, Smem* sm, const Segment& seg, int t) {
    ProducerRows rows;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const int r = seg.row0 + t / 8 + 16 * i;
        rows.row[i] = nullptr;
        if (r < seg.n_nodes * p.heads) {
            const long long token = seg.qo_start + r / p.heads;
            rows.row[i] = p.q + (token * p.q_st + (r % p.heads) * p.q_sh) * 2 + (t % 8) * 16;
        }
    }
#pragma unroll
    for (int c = 0; c < CHUNKS; ++c) copy_chunk<false>(sm->q, rows, c, p.q, t);
    arrive_when_copied(&sm->q_full);
}

// chunks [C0, C1) of a K stage, each once its last reader released it (`loads`: the pairs this warpgroup loaded
// before; no wait for its first), gathered by the warpgroup's cp.asyncs (rows past the segment's end zero-filled)
template <int C0, int C1>
__device__ __forceinline__ void copy_chunks(const Params& p, Smem* sm, int stage, const ProducerRows& rows, int loads,
                                            int t) {
#pragma unroll
    for (int c = C0; c < C1; ++c) {
        if (loads > 0) wait_phase(&sm->k_empty[stage][c], (loads - 1) & 1);
        copy_chunk<KD_EVICT_FIRST>(sm->k[stage], rows, c, p.kv, t);
        arrive_when_copied(&sm->k_full[stage][c]);
    }
}

// chunk c of a K stage, the [64, 64] box of the pool's rows from `row` at column 64c, loaded by TMA: one arrival on
// the chunk's full barrier, which then also waits for the box's bytes
__device__ __forceinline__ void tma_chunk(const CUtensorMap* kv_map, Smem* sm, int stage, int c, int row) {
    mbar_expect_tx(&sm->k_full[stage][c], CHUNK_BYTES);
    tma_load_chunk<KD_EVICT_FIRST>(sm->k[stage] + c * CHUNK_BYTES, kv_map, &sm->k_full[stage][c], c * 64, row);
}

// chunks [C0, C1) of a K stage as copy_chunks, each by TMA (tma_chunk) issued by the first thread (the others arrive
// at once: the barrier counts 128 arrivals either way)
template <int C0, int C1>
__device__ __forceinline__ void tma_chunks(const CUtensorMap* kv_map, Smem* sm, int stage, int row, int loads, int t) {
#pragma unroll
    for (int c = C0; c < C1; ++c) {
        if (loads > 0) wait_phase(&sm->k_empty[stage][c], (loads - 1) & 1);
        if (t == 0)
            tma_chunk(kv_map, sm, stage, c, row);
        else
            mbar_arrive(&sm->k_full[stage][c]);
    }
}

// whether pair k of the segment [kv_start, kv_end) (its tiles at kv_start + 2k BN and the next) is loaded by TMA:
// KD_TMA, the pool's layout allows it (p.tma: pages hold whole tiles) and both tiles end before kv_end; else its
// rows are gathered
__device__ __forceinline__ bool tma_pair(const Params& p, int kv_start, int kv_end, int k) {
    return KD_TMA && p.tma && kv_start + (2 * k + 2) * BN <= kv_end;
}

// the pool rows where the two tiles of the TMA pair at `start` begin (their pages hold whole tiles)
struct PairRows {
    int row0, row1;
};
__device__ __forceinline__ PairRows tma_rows(const Params& p, const int* pages, int start) {
    const auto row = [&](int s) { return pages[(s / p.page_size) * p.pt_s1] * p.page_size + s % p.page_size; };
    return {row(start), row(start + BN)};
}

// the producer warpgroup: per segment its Q (once both math warpgroups are done with the last one), then
// its tiles in pairs (2j -> stage 0, 2j + 1 -> stage 1), chunk by chunk in the order the step releases
// them: stage 0's left half (wg 0 after P0 V0), stage 1's right half and rope (wg 1 after P1 V1), stage
// 0's right half and rope (wg 1 after P0 V0), stage 1's left half (wg 0 after P1 V1). A pair is either
// two TMA tiles or two gathered ones, each path unrolled apart: run 46 measured one unrolled path with
// both (~2,500 instructions a pair) missing the instruction cache (the producer's issue delayed by its
// fetches), and the 18 fills as one loop slower still (~50 dependent instructions between a release and
// its copy)
__device__ void produce(const Params& p, const CUtensorMap* kv_map, Smem* sm, const Work& w, int t) {
    int loads = 0;  // pairs this warpgroup loaded so far (the empty barriers' phases: each load after the first
                    // waits for the releases of the pair before it)
    for (int i = w.first, n_seg = 0; i < w.end; i += w.step, ++n_seg) {
        const Segment seg = load_segment(p, i);
        const int* pages = p.page_table + seg.seq * p.pt_s0;
        // a first TMA pair's pool rows, read before the wait for Q's buffer and Q's copy: the page ids' load
        // overlaps them instead of following them (the copy's asm orders every memory access after it)
        const PairRows first =
            tma_pair(p, seg.kv_start, seg.kv_end, 0) ? tma_rows(p, pages, seg.kv_start) : PairRows{0, 0};
        if (n_seg > 0) wait_phase(&sm->q_empty, (n_seg - 1) & 1);
        copy_q(p, sm, seg, t);
        const int steps = (seg.kv_end - seg.kv_start + 2 * BN - 1) / (2 * BN);
#pragma unroll 1
        for (int j = 0; j < steps; ++j) {
            const int start = seg.kv_start + 2 * j * BN;
            if (tma_pair(p, seg.kv_start, seg.kv_end, j)) {
                if (KD_CONSUMER_TMA && j > 0) continue;  // refilled by the math warpgroups
                const PairRows rows = j == 0 ? first : tma_rows(p, pages, start);
                tma_chunks<0, 4>(kv_map, sm, 0, rows.row0, loads, t);
                tma_chunks<4, CHUNKS>(kv_map, sm, 1, rows.row1, loads, t);
                tma_chunks<4, CHUNKS>(kv_map, sm, 0, rows.row0, loads, t);
                tma_chunks<0, 4>(kv_map, sm, 1, rows.row1, loads, t);
            } else {
                const ProducerRows rows0 = kv_rows(p, pages, start, seg.kv_end, t);
                const ProducerRows rows1 = kv_rows(p, pages, start + BN, seg.kv_end, t);
                copy_chunks<0, 4>(p, sm, 0, rows0, loads, t);
                copy_chunks<4, CHUNKS>(p, sm, 1, rows1, loads, t);
                copy_chunks<4, CHUNKS>(p, sm, 0, rows0, loads, t);
                copy_chunks<0, 4>(p, sm, 1, rows1, loads, t);
            }
            ++loads;
        }
    }
}

// what a masked tile's scores need: the tree-mask row of each of this thread's two query rows (nullptr:
// a padding row, which sees the prefix only), the segment's prefix length and ends
struct MaskRows {
    const int* row[2];
    long long word_stride;
    int words, prefix, kv_end, clean_end;
};

// this thread's scores of the tile at `start` with invisible keys at -inf: positions past kv_end, and
// tree node j = position - prefix where bit j of the row's mask is 0; a tile below clean_end (prefix
// keys only) is left as it is
__device__ __forceinline__ void apply_mask(float (&s)[32], const MaskRows& m, int start, int lane) {
    if (start + BN <= m.clean_end) return;
    const int j0 = start - m.prefix;  // tree node of the tile's first key (negative: a prefix key)
    const int w0 = j0 >> 5;  // the word holding it (floor): the tile's keys lie in words w0 .. w0 + 2
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        uint32_t w[3];
#pragma unroll
        for (int k = 0; k < 3; ++k) {
            const int word = w0 + k;
            w[k] = (m.row[r] && word >= 0 && word < m.words) ? uint32_t(__ldg(m.row[r] + word * m.word_stride)) : 0u;
        }
#pragma unroll
        for (int i = 0; i < 8; ++i)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const int col = 8 * i + 2 * (lane & 3) + e, j = j0 + col, k = (j >> 5) - w0;
                const uint32_t word = k == 0 ? w[0] : (k == 1 ? w[1] : w[2]);
                const bool visible = start + col < m.kv_end && (j < 0 || ((word >> (j & 31)) & 1u));
                if (!visible) s[4 * i + 2 * r + e] = -INFINITY;
            }
    }
}

// what the math warpgroups know of the pair after a step before they release its chunks and wait for the next
// pair's: whether that pair is gathered (cp.async: its chunks need a proxy fence before the QK reads them), and
// whether they refill it themselves (KD_CONSUMER_TMA: a TMA pair after the segment's first; else its chunks go back
// to the producer) and then from which pool rows (its two tiles')
struct NextPair {
    PairRows rows;
    bool gathered, refill;
};

// pair k of the segment seg (pages: its sequence's page-table row); k past its last pair: gathered, not refilled.
// Whether the producer or the math warpgroups load a pair is decided from the segment's bounds alone (tma_pair,
// as the producer decides), never from the page ids: a bad one cannot make the two sides disagree
__device__ __forceinline__ NextPair next_pair(const Params& p, const int* pages, const Segment& seg, int k) {
    const bool tma = tma_pair(p, seg.kv_start, seg.kv_end, k);
    NextPair next{{0, 0}, !tma, KD_CONSUMER_TMA && tma && k > 0};
    if (next.refill) next.rows = tma_rows(p, pages, seg.kv_start + 2 * k * BN);
    return next;
}

// this CTA's release of chunks [C0, C1) of a stage, their last reader done with them: one arrival on each chunk's
// empty barrier for the producer, or with `refill` (KD_CONSUMER_TMA) their refill by TMA with the tile from pool
// row `row`, each chunk's full barrier taking its 128 arrivals here
template <int C0, int C1>
__device__ __forceinline__ void release(Smem* sm, const CUtensorMap* kv_map, int stage, bool refill, int row) {
    if (KD_CONSUMER_TMA && refill) {
#pragma unroll
        for (int c = C0; c < C1; ++c) {
            tma_chunk(kv_map, sm, stage, c, row);
            mbar_arrive(&sm->k_full[stage][c], PRODUCER_THREADS - 1);
        }
    } else {
#pragma unroll
        for (int c = C0; c < C1; ++c) mbar_arrive(&sm->k_empty[stage][c]);
    }
}

// what a warpgroup's step reads besides its registers
struct StepContext : StepDescriptors<Smem> {
    Smem* sm;
    const CUtensorMap* kv_map;
    uint32_t p0, p1;
    int row0, row1, warp, lane;
    bool issuer;
    float sl2;
};

// wait for chunk c of a stage, issue its QK, commit it as one group (gathered: cp.async wrote the chunk)
template <bool F16>
__device__ __forceinline__ void qk_chunk_when_landed(float (&s)[32], const uint32_t (&qr)[4][4], const StepContext& ctx,
                                                     int stage, int c, int parity, bool zero_init, bool gathered) {
    wait_phase(&ctx.sm->k_full[stage][c], parity);
    // cp.async writes through the generic proxy, the wgmmas read through the async one (TMA writes through it too)
    if (KD_FENCE_TMA)
        fence_proxy_async();
    else
        fence_proxy_async(gathered);
    hold(s);
    wgmma_fence();
    if (c == CHUNKS - 1)
        qk_rope<F16>(s, qr, ctx.dk(stage));
    else
        qk_chunk<F16>(s, ctx.dq(), ctx.dk(stage), c, zero_init);
    wgmma_commit();
    hold(s);
}

// wg 0's step j (tile 2j at `start`, in stage 0; see hopper_cuda_step.cu) as pair `pair` of the CTA: MASK,
// its tile may need the mask and whether a next pair follows is `more`; otherwise the tile is clean
// and a next pair follows; `next`: the segment's pair j + 1 (next_pair)
template <bool F16, bool MASK>
__device__ __forceinline__ void wg0_step(const StepContext& shared_ctx, const MaskRows& mask, int start, int pair,
                                         bool more, const NextPair& next, float (&s)[32], float (&o)[128],
                                         float (&rsum)[2], const uint32_t (&qr)[4][4]) {
    const bool MORE = MASK ? more : true;
    const StepContext ctx = opaque(shared_ctx);
    const int parity = (pair + 1) & 1;  // the next pair's
    uint32_t pa[4][4];
    if (MASK) apply_mask(s, mask, start, ctx.lane);
    wg0_softmax(ctx, s, o, rsum);
    named_arrive(BAR_FACTOR0);
#pragma unroll
    for (int ks = 0; ks < 4; ++ks) p_fragment<F16>(pa[ks], s, ks);
    hold(o);
    wgmma_fence();
    issue_pv<F16>(o, pa, ctx.dv(0));
    wgmma_wait<0>();
    hold(o);
    if (ctx.issuer) release<0, 4>(ctx.sm, ctx.kv_map, 0, next.refill, next.rows.row0);
    named_sync(BAR_FACTOR1);
    float f1[2] = {ctx.sm->factor1[ctx.row0], ctx.sm->factor1[ctx.row1]};
    scale_rows(s, f1);
    store_p<F16>(ctx, pa, s, ctx.p0);
    named_arrive(BAR_P0);
    scale_rows(o, f1);
    for (int r = 0; r < 2; ++r) rsum[r] *= f1[r];
    named_sync(BAR_P1);
    hold(o);
    wgmma_fence();
    issue_pv<F16>(o, ctx.dp1(), ctx.dv(1));
    if (MORE) {
#pragma unroll
        for (int c = 0; c < 4; ++c) qk_chunk_when_landed<F16>(s, qr, ctx, 0, c, parity, c == 0, next.gathered);
        wgmma_wait<4>();  // P1 V1 retired: stage 1's left half is free
        if (ctx.issuer) release<0, 4>(ctx.sm, ctx.kv_map, 1, next.refill, next.rows.row1);
#pragma unroll
        for (int c = 4; c < CHUNKS; ++c) qk_chunk_when_landed<F16>(s, qr, ctx, 0, c, parity, false, next.gathered);
    }
    wgmma_wait<0>();
    hold(o);
    hold(s);
    if (!MORE && ctx.issuer) release<0, 4>(ctx.sm, ctx.kv_map, 1, false, 0);
}

// wg 1's step j (tile 2j + 1 at `start`, in stage 1)
template <bool F16, bool MASK>
__device__ __forceinline__ void wg1_step(const StepContext& shared_ctx, const MaskRows& mask, int start, int pair,
                                         bool more, const NextPair& next, float (&s)[32], float (&o)[128],
                                         float (&rsum)[2], const uint32_t (&qr)[4][4]) {
    const bool MORE = MASK ? more : true;
    const StepContext ctx = opaque(shared_ctx);
    const int parity = (pair + 1) & 1;
    float mx[2];
    uint32_t pa[4][4];
    if (MASK) apply_mask(s, mask, start, ctx.lane);
    row_max(s, mx);
    named_sync(BAR_FACTOR0);
    wg1_softmax(ctx, mx, s, o, rsum);
    named_arrive(BAR_FACTOR1);
    store_p<F16>(ctx, pa, s, ctx.p1);
    hold(o);
    wgmma_fence();
    issue_pv<F16>(o, pa, at(ctx.dv(1), 4 * CHUNK_BYTES));
    if (!KD_P1_AFTER_BOTH) named_arrive(BAR_P1);
    named_sync(BAR_P0);
    issue_pv<F16>(o, ctx.dp0(), at(ctx.dv(0), 4 * CHUNK_BYTES));
    if (KD_P1_AFTER_BOTH) named_arrive(BAR_P1);
    wgmma_wait<1>();  // P1 V1 retired: stage 1's right half and rope are free
    if (ctx.issuer) release<4, CHUNKS>(ctx.sm, ctx.kv_map, 1, next.refill, next.rows.row1);
    wgmma_wait<0>();  // P0 V0 retired: stage 0's right half (its rope was free since wg 0's QK)
    if (ctx.issuer) release<4, CHUNKS>(ctx.sm, ctx.kv_map, 0, next.refill, next.rows.row0);
    if (MORE) {
#pragma unroll
        for (int c = 4; c < CHUNKS; ++c) qk_chunk_when_landed<F16>(s, qr, ctx, 1, c, parity, c == 4, next.gathered);
#pragma unroll
        for (int c = 0; c < 4; ++c) qk_chunk_when_landed<F16>(s, qr, ctx, 1, c, parity, false, next.gathered);
    }
    wgmma_wait<0>();
    hold(o);
    hold(s);
}

// this thread's two query rows of a segment: whether each is real (not padding), its token and head
struct QueryRows {
    bool real[2];
    long long token[2];
    int head[2];
};

__device__ __forceinline__ QueryRows query_rows(const Params& p, const Segment& seg, const StepContext& ctx) {
    QueryRows rows;
    const int local[2] = {ctx.row0, ctx.row1};
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int packed = seg.row0 + local[r];
        rows.real[r] = packed < seg.n_nodes * p.heads;
        rows.token[r] = seg.qo_start + min(packed / p.heads, seg.n_nodes - 1);
        rows.head[r] = packed % p.heads;
    }
    return rows;
}

// the segment's normalised output and log-sum-exp: into out / lse (slot < 0) or its partial slot
template <bool F16>
__device__ __forceinline__ void write_segment(const Params& p, const StepContext& ctx, const Segment& seg,
                                              const QueryRows& rows, int wg, const float (&o)[128],
                                              float (&rsum)[2]) {
    Smem* sm = ctx.sm;
#pragma unroll
    for (int r = 0; r < 2; ++r) {  // this thread's parts -> the quad's -> both warpgroups'
        rsum[r] += __shfl_xor_sync(0xffffffffu, rsum[r], 1);
        rsum[r] += __shfl_xor_sync(0xffffffffu, rsum[r], 2);
    }
    if ((ctx.lane & 3) == 0) sm->row_sum[wg][ctx.row0] = rsum[0], sm->row_sum[wg][ctx.row1] = rsum[1];
    named_sync(BAR_MATH);
    const int local[2] = {ctx.row0, ctx.row1};
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const float l = sm->row_sum[0][local[r]] + sm->row_sum[1][local[r]];
        const bool any = l != 0.f;  // NaN (a NaN score of a visible key) propagates
        const float inv = any ? 1.f / l : 1.f;
        const float lse2 = any ? sm->row_max[local[r]] + log2f(l) : -INFINITY;
        if (!rows.real[r]) continue;
        const int col = wg * 256 + 2 * (ctx.lane & 3);
        if (seg.slot < 0) {
            uint8_t* dst = p.out + (rows.token[r] * p.o_st + rows.head[r] * p.o_sh + col) * 2;
#pragma unroll
            for (int i = 0; i < 32; ++i)
                *reinterpret_cast<uint32_t*>(dst + 16 * i) =
                    pack16<F16>(o[4 * i + 2 * r] * inv, o[4 * i + 2 * r + 1] * inv);
            if (wg == 0 && (ctx.lane & 3) == 0) p.lse[rows.token[r] * p.l_st + rows.head[r] * p.l_sh] = lse2 * LN2;
        } else {
            const long long row = (long long)seg.slot * BM + local[r];
            float* dst = p.partial_out + row * D_V + col;
#pragma unroll
            for (int i = 0; i < 32; ++i)
                *reinterpret_cast<float2*>(dst + 8 * i) =
                    make_float2(o[4 * i + 2 * r] * inv, o[4 * i + 2 * r + 1] * inv);
            if (wg == 0 && (ctx.lane & 3) == 0) p.partial_lse[row] = lse2;
        }
    }
    named_sync(BAR_MATH);  // both warpgroups read the row max and sums: the next segment may reset them
    if (wg == 0 && (ctx.lane & 3) == 0) sm->row_max[ctx.row0] = sm->row_max[ctx.row1] = -INFINITY;
}

// the two math warpgroups: per segment, Q's rope columns to registers, the first pair's QK, the clean
// steps, the masked ones, then the output
template <bool F16>
__device__ void compute(const Params& p, const StepContext& ctx, int wg, const Work& w) {
    Smem* sm = ctx.sm;
    int pair = 0;  // pairs computed so far (the barriers' phases)
    for (int i = w.first, n_seg = 0; i < w.end; i += w.step, ++n_seg) {
        const Segment seg = load_segment(p, i);
        const int* pages = p.page_table + seg.seq * p.pt_s0;
        const int prefix = p.kv_lens[seg.seq * p.kl_s] - seg.n_nodes;
        const int steps = (seg.kv_end - seg.kv_start + 2 * BN - 1) / (2 * BN);
        // tiles starting below clean_end hold prefix keys only
        const int clean_end = seg.kv_start + max(min(seg.kv_end, prefix) - seg.kv_start, 0) / BN * BN;
        wait_phase(&sm->q_full, n_seg & 1);
        if (!KD_FENCE_TMA) fence_proxy_async();  // Q came by cp.async (else the first chunk's fence covers it)
        uint32_t qr[4][4];  // Q's rope columns as A fragments; chunk 8 then holds wg 1's P
#pragma unroll
        for (int ks = 0; ks < 4; ++ks) ldmatrix_x4(qr[ks], frag_row_addr(ctx.p1, ctx.warp, ctx.lane, ks));
        named_sync(BAR_MATH);

        float s[32], o[128], rsum[2] = {0.f, 0.f};
#pragma unroll
        for (int k = 0; k < 128; ++k) o[k] = 0.f;
        // the first pair's QK, in the order the producer fills the chunks
        const bool gathered = !tma_pair(p, seg.kv_start, seg.kv_end, 0);
        if (wg == 0) {
#pragma unroll
            for (int c = 0; c < CHUNKS; ++c)
                qk_chunk_when_landed<F16>(s, qr, ctx, 0, c, pair & 1, c == 0, gathered);
        } else {
#pragma unroll
            for (int c = 0; c < CHUNKS; ++c)
                qk_chunk_when_landed<F16>(s, qr, ctx, 1, (c + 4) % CHUNKS, pair & 1, c == 0, gathered);
        }
        wgmma_wait<0>();
        hold(s);

        // the steps whose two tiles are clean and which a next pair follows, then the rest (what those
        // need besides the step's registers is made between the two loops: not live across the first)
        const int clean_steps = min((clean_end - seg.kv_start) / (2 * BN), steps - 1);
        if (wg == 0) {
#pragma unroll 1
            for (int j = 0; j < clean_steps; ++j)
                wg0_step<F16, false>(ctx, MaskRows{}, 0, pair + j, true, next_pair(p, pages, seg, j + 1), s, o, rsum,
                                     qr);
        } else {
#pragma unroll 1
            for (int j = 0; j < clean_steps; ++j)
                wg1_step<F16, false>(ctx, MaskRows{}, 0, pair + j, true, next_pair(p, pages, seg, j + 1), s, o, rsum,
                                     qr);
        }
        const QueryRows rows = query_rows(p, seg, ctx);
        MaskRows mask;
#pragma unroll
        for (int r = 0; r < 2; ++r) mask.row[r] = rows.real[r] ? p.tree_mask + rows.token[r] * p.mt_s : nullptr;
        mask.word_stride = p.mw_s;
        mask.words = p.mask_words;
        mask.prefix = prefix;
        mask.kv_end = seg.kv_end;
        mask.clean_end = clean_end;
#pragma unroll 1
        for (int j = clean_steps; j < steps; ++j) {
            const int start = seg.kv_start + (2 * j + wg) * BN;
            const NextPair next = next_pair(p, pages, seg, j + 1);
            if (wg == 0)
                wg0_step<F16, true>(ctx, mask, start, pair + j, j + 1 < steps, next, s, o, rsum, qr);
            else
                wg1_step<F16, true>(ctx, mask, start, pair + j, j + 1 < steps, next, s, o, rsum, qr);
        }
        pair += steps;
        if (ctx.issuer)  // this warpgroup's wgmmas on Q and on P1 (over Q's rope columns) retired
            mbar_arrive(&sm->q_empty);
        write_segment<F16>(p, ctx, seg, rows, wg, o, rsum);
    }
}

// every CTA of the (cooperative) grid reached this point; what each wrote before is visible to all after.
// The word's protocol is the library's combine.grid_barrier: sense reversal on its top bit (CTA 0 adds
// 2^31 - (parties - 1), the others 1), so it needs no reset and serves the next launch as it is
__device__ __forceinline__ void grid_barrier(int* word) {
    named_sync(BAR_MATH);
    if (threadIdx.x == 0) {
        const int add = blockIdx.x == 0 ? int(unsigned(1 - int(gridDim.x)) ^ 0x80000000u) : 1;
        int seen, now;
        __threadfence();
        asm volatile("atom.add.release.gpu.s32 %0, [%1], %2;" : "=r"(seen) : "l"(word), "r"(add) : "memory");
        do {
            asm volatile("ld.acquire.gpu.s32 %0, [%1];" : "=r"(now) : "l"(word) : "memory");
        } while ((now ^ seen) >= 0);  // the same top bit: not every CTA has arrived
        __threadfence();
    }
    named_sync(BAR_MATH);
}

constexpr int MERGE_SPLITS = KD_MERGE_SPLITS;

// one part folded into a row's running max m (log2 units), sum l and output acc, as online softmax: the
// part's max m_in, its sum l_in (1: a split's normalised partial, whose max is its log2-sum-exp2) and the
// first `cols` of its N columns x
template <int N>
__device__ __forceinline__ void fold_part(float& m, float& l, float* acc, float m_in, float l_in, const float* x,
                                          int cols) {
    const float m_new = fmaxf(m, m_in), off = offset_of(m_new);
    const float alpha = fast_exp2(m - off), w = fast_exp2(m_in - off);
#pragma unroll
    for (int c = 0; c < N; ++c)
        if (c < cols) acc[c] = acc[c] * alpha + w * x[c];
    l = l * alpha + w * l_in;
    m = m_new;
}

// the fused merge, by the math warpgroups after the grid barrier: items (split group, 8 / W rows of its
// block) blockIdx.x, + gridDim.x, ...; the W warps of a row (W: the most of 1, 2, 4, 8, up to
// KD_MERGE_WARPS, that keep every CTA at one item, so that few groups of many splits, one sequence's,
// spread over the grid) each take its splits w, w + W, .. (MERGE_SPLITS loads a round, each lane 16 of the
// 512 columns) and fold them in that order (a running max, sum and output, as online softmax); with W > 1
// they then fold their W parts in order through shared memory (the K stages: every chunk was read before
// the barrier), each finishing 512 / W of the row's columns. Bitwise the same on every call
template <bool F16>
__device__ void merge_splits(const Params& p, Smem* sm, int n_groups, int math_warp, int lane) {
    int W = 1;
    while (W < KD_MERGE_WARPS && n_groups * (BM / 8) * 2 * W <= int(gridDim.x)) W *= 2;
    const int rows = 8 / W, row_in_item = math_warp / W, part = math_warp % W, items_a_group = BM / rows;
    const int n_items = n_groups * items_a_group;
    float* fold_out = reinterpret_cast<float*>(sm->k[0]);  // [8 warps][512]
    float* fold_ml = fold_out + 8 * D_V;                      // [8 warps][2]: max, sum
    for (int item = blockIdx.x; item < n_items; item += gridDim.x) {
        const int g = item / items_a_group, r = (item % items_a_group) * rows + row_in_item;
        const int seq = p.group_seq[g], packed = p.group_row0[g] + r, first = p.group_first[g];
        const int count = p.group_splits[g];
        const int qo_start = p.qo_indptr[seq * p.qo_s], n_nodes = p.qo_indptr[(seq + 1) * p.qo_s] - qo_start;
        const bool real = packed < n_nodes * p.heads;  // (not: a padding row; the same for the row's W warps)
        float m = -INFINITY, l = 0.f, acc[16];
#pragma unroll
        for (int k = 0; k < 16; ++k) acc[k] = 0.f;
        for (int s0 = part; real && s0 < count; s0 += W * MERGE_SPLITS) {
            float lse2[MERGE_SPLITS];
            float4 chunk[MERGE_SPLITS][4];
#pragma unroll
            for (int k = 0; k < MERGE_SPLITS; ++k) {  // the round's loads first (past L1: other CTAs wrote them)
                const int split = s0 + k * W;
                const long long row = (long long)(first + min(split, count - 1)) * BM + r;
                lse2[k] = split < count ? __ldcg(p.partial_lse + row) : -INFINITY;
                const float4* src = reinterpret_cast<const float4*>(p.partial_out + row * D_V + lane * 16);
#pragma unroll
                for (int v = 0; v < 4; ++v) chunk[k][v] = __ldcg(src + v);
            }
#pragma unroll
            for (int k = 0; k < MERGE_SPLITS; ++k)
                fold_part<16>(m, l, acc, lse2[k], 1.f, reinterpret_cast<const float*>(chunk[k]), 16);
        }
        int col = lane * 16, cols = 16;  // the columns this lane finishes
        if (W > 1) {  // the row's W parts, in order, from shared memory
            float4* mine = reinterpret_cast<float4*>(fold_out + math_warp * D_V + lane * 16);
#pragma unroll
            for (int v = 0; v < 4; ++v)
                mine[v] = make_float4(acc[4 * v], acc[4 * v + 1], acc[4 * v + 2], acc[4 * v + 3]);
            if (lane == 0) fold_ml[2 * math_warp] = m, fold_ml[2 * math_warp + 1] = l;
            named_sync(BAR_MATH);
            cols = 16 / W;
            col = part * (D_V / W) + lane * cols;
            m = -INFINITY, l = 0.f;
#pragma unroll
            for (int c = 0; c < 16; ++c) acc[c] = 0.f;
            for (int q = 0; q < W; ++q) {
                const int from = row_in_item * W + q;
                fold_part<8>(m, l, acc, fold_ml[2 * from], fold_ml[2 * from + 1], fold_out + from * D_V + col, cols);
            }
            named_sync(BAR_MATH);  // every part read: the next item may write its own
        }
        if (!real) continue;
        const float inv = l != 0.f ? 1.f / l : 1.f;  // a NaN part propagates
        const long long token = qo_start + packed / p.heads;
        const int head = packed % p.heads;
        uint32_t* dst = reinterpret_cast<uint32_t*>(p.out + (token * p.o_st + head * p.o_sh + col) * 2);
#pragma unroll
        for (int k = 0; k < 8; ++k)  // out: 4-byte
            if (2 * k < cols) dst[k] = pack16<F16>(acc[2 * k] * inv, acc[2 * k + 1] * inv);
        if (lane == 0 && part == 0)
            p.lse[token * p.l_st + head * p.l_sh] = l != 0.f ? (m + log2f(l)) * LN2 : -INFINITY;
    }
}

template <bool F16>
__global__ void __launch_bounds__(LAUNCH_THREADS, 1)
verify_kernel(const Params p, const __grid_constant__ CUtensorMap kv_map) {
    // a dependent launched programmatically may take the SMs of this kernel's CTAs as they exit and wait there
    if (KD_PDL) asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    Smem* sm = smem();
    // the warpgroup, broadcast from lane 0 so that the compiler knows it is the same in a warp
    const int wg = __shfl_sync(0xffffffffu, int(threadIdx.x / 128), 0), t = threadIdx.x % 128, warp = t / 32,
              lane = t % 32;
    if (threadIdx.x == 0) {
        if (p.tma) prefetch_tensor_map(&kv_map);
        for (int s = 0; s < 2; ++s)
            for (int c = 0; c < CHUNKS; ++c) {
                mbar_init(&sm->k_full[s][c], PRODUCER_THREADS);
                mbar_init(&sm->k_empty[s][c], 1);
            }
        mbar_init(&sm->q_full, PRODUCER_THREADS);
        mbar_init(&sm->q_empty, 2);
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    if (threadIdx.x < BM) sm->row_max[threadIdx.x] = -INFINITY;
    __syncthreads();
    // the kernel before this one in the stream completed and its writes are visible (at once without one, or
    // when this launch is not a programmatic dependent); nothing global was read before
    if (KD_PDL) asm volatile("griddepcontrol.wait;" ::: "memory");
    const Work w = work_of(p);
    if (wg == 2) {
        asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" :: "n"(PRODUCER_REGS));
        produce(p, &kv_map, sm, w, t);
    } else {
        asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" :: "n"(MATH_REGS));
        const uint32_t base = smem_addr(sm);
        const int row0 = warp * 16 + lane / 4;
        const uint64_t opaque_zero = uint64_t(p.zero) << 32;
        const StepContext ctx{{k_major(base) + opaque_zero, mn_major_v(base) + opaque_zero}, sm, &kv_map,
                              smem_addr(sm->p0), smem_addr(sm->q) + 8 * CHUNK_BYTES, row0, row0 + 8, warp, lane,
                              t == 0, p.scale_log2};
        compute<F16>(p, ctx, wg, w);
        const int n_groups = p.in_kernel ? write_groups(p) : (p.fuse ? *p.group_count : 0);
        if (p.fuse && n_groups > 0) {  // the producer has left: the math warpgroups merge
            grid_barrier(p.grid_barrier);
            merge_splits<F16>(p, sm, n_groups, wg * 4 + warp, lane);
        }
    }
}

}  // namespace

extern "C" int kd_verify_smem_bytes() { return int(sizeof(Smem) + 1024); }

extern "C" int kd_verify_params_bytes() { return int(sizeof(Params)); }

// KD_WATCHDOG: where a stuck wait says which barrier ([5] ints the device can write: pinned host memory, which
// the host can still read after the trap). 0: set
extern "C" int kd_verify_barrier_offsets(int* offsets) {  // k_full, k_empty, q_full, q_empty (for the watchdog)
    offsets[0] = int(offsetof(Smem, k_full));
    offsets[1] = int(offsetof(Smem, k_empty));
    offsets[2] = int(offsetof(Smem, q_full));
    offsets[3] = int(offsetof(Smem, q_empty));
    return 0;
}

extern "C" int kd_verify_watchdog(int* words) {
    return cudaMemcpyToSymbol(watchdog_words, &words, sizeof(words)) == cudaSuccess ? 0 : 1;
}

// verify_kernel on num_programs CTAs of device `device` on `stream`; params: a Params as laid out above (its
// `tma` set here). 0: launched; 1: the shared memory size could not be set; 2: the launch failed; 3: no tensor
// map (KD_TMA)
extern "C" int kd_verify_launch(const void* params, int num_programs, int device, void* stream) {
    static unsigned long long smem_set = 0;  // the devices whose kernels may use the shared memory (once each)
    int current = -1;
    if (cudaGetDevice(&current) != cudaSuccess || (current != device && cudaSetDevice(device) != cudaSuccess))
        return 2;
    if (device >= 64) return 1;
    if (!(smem_set >> device & 1)) {
        if (cudaFuncSetAttribute(verify_kernel<false>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                 kd_verify_smem_bytes()) != cudaSuccess
            || cudaFuncSetAttribute(verify_kernel<true>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    kd_verify_smem_bytes()) != cudaSuccess)
            return 1;
        smem_set |= 1ull << device;
    }
    Params p = *static_cast<const Params*>(params);
    // TMA reads the pool as [kv_rows, 576] rows kv_ss elements apart: pages back to back, rows 16-byte aligned
    p.tma = KD_TMA && p.page_size % BN == 0 && p.kv_sp == p.page_size * p.kv_ss && p.kv_ss % 8 == 0
            && reinterpret_cast<uintptr_t>(p.kv) % 16 == 0;
    CUtensorMap kv_map = {};
    if (p.tma && make_map(&kv_map, p.kv, p.kv_rows, 256, p.kv_ss * 2)) return 3;
    cudaLaunchConfig_t config = {};
    config.gridDim = dim3(num_programs);
    config.blockDim = dim3(LAUNCH_THREADS);
    config.dynamicSmemBytes = kd_verify_smem_bytes();
    config.stream = static_cast<cudaStream_t>(stream);
    cudaLaunchAttribute attrs[2];
    config.attrs = attrs;
    if (p.fuse) {  // every CTA resident at once (the driver refuses a grid that cannot be), for the grid barrier
        attrs[config.numAttrs].id = cudaLaunchAttributeCooperative;
        attrs[config.numAttrs++].val.cooperative = 1;
    }
    if (KD_PDL) {  // may launch before the kernel ahead of it in the stream ends (its CTAs wait for it, above)
        attrs[config.numAttrs].id = cudaLaunchAttributeProgrammaticStreamSerialization;
        attrs[config.numAttrs++].val.programmaticStreamSerializationAllowed = 1;
    }
    const cudaError_t launched = p.f16 ? cudaLaunchKernelEx(&config, verify_kernel<true>, p, kv_map)
                                       : cudaLaunchKernelEx(&config, verify_kernel<false>, p, kv_map);
    return launched == cudaSuccess ? 0 : 2;
}
