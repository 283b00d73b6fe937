// Spike: the Hopper verify kernel's step (one 64-row query block against KV tiles of 64 rows) in
// CUDA C++, to measure what a step costs outside Gluon (docs/perf_log.md, run 45). Not the
// library's kernel: no tree mask, pages of 64 (of one row with KD_PAGE1), no split merge. Each CTA (256 threads,
// two math warpgroups, no loader; with KD_MULTICAST a producer warpgroup too, and clusters) runs query
// block q_block[cta] against the n_tiles KV tiles whose first rows are tile_rows[cta, :], and writes
// its normalised output [64, 512] (fp32) and the log-sum-exp of its scores (natural log) for each row.
//
// Step j (tiles 2j and 2j+1; warpgroup w owns K stage w, i.e. tile 2j + w, and output columns
// [256w, 256w + 256)):
//   wg 0: softmax of S0 against the running row max -> publishes m0 and its factor; O0 += P0 V0[:, :256]
//         (P0 from registers); waits for wg 1's max; brings P0 to it and stores it (sP0); O0 rescaled,
//         O0 += P1 V1[:, :256] (P1 from shared memory); QK of tile 2j+2 chunk by chunk.
//   wg 1: waits for m0; softmax of S1 against max(m0, its rows) -> publishes m1; stores P1 (over Q's
//         rope columns, which both warpgroups hold in registers); O1 += P1 V1[:, 256:]; waits for
//         sP0; O1 += P0 V0[:, 256:]; QK of tile 2j+3.
// Each 64-column chunk of a K stage has its own mbarrier and is refilled by TMA, by the warpgroup
// that read it last, as soon as that read retired. Each warpgroup runs its own loop, the last step
// apart (no branch inside a step). Fastest measured: -DKD_P1_AFTER_BOTH=1 -DKD_EVICT_FIRST=1.
#include <cstdio>
#include <cuda_runtime.h>

// variants (-D flags), measured in docs/perf_log.md run 45
#ifndef KD_EVICT_FIRST
#define KD_EVICT_FIRST 0  // K tiles loaded with an L2 evict-first hint
#endif
#ifndef KD_PREFETCH
#define KD_PREFETCH 0  // the part's CTAs prefetch the tiles of two pairs ahead into L2, a share each
#endif
#ifndef KD_WAIT_HINT
#define KD_WAIT_HINT 0  // mbarrier waits suspend the thread until the phase completes (a time hint), not poll
#endif
#ifndef KD_L2_PROMOTION
#define KD_L2_PROMOTION 256  // bytes an L2 miss of a TMA load fetches (128 or 256)
#endif
#ifndef KD_RUNTIME_MORE
#define KD_RUNTIME_MORE 0  // one loop over every step, whether a next pair exists tested at run time in the step
#endif
#ifndef KD_STAMPS
#define KD_STAMPS 0  // each warpgroup's thread 0 stamps %clock64 at STAMP_POINTS points of its first STAMP_STEPS steps
#endif
#ifndef KD_P1_AFTER_BOTH
#define KD_P1_AFTER_BOTH 0  // wg 1 publishes its P after issuing both its PVs (wg 0's P1 V1 goes after them)
#endif
#ifndef KD_REFILL0_AFTER_M1
#define KD_REFILL0_AFTER_M1 0  // wg 0 refills stage 0's left half after m1 arrived, not before (FlashMLA's place)
#endif
#ifndef KD_MULTICAST
// C > 0: a producer warpgroup refills the K chunks, and the C CTAs of a cluster (C divides the CTAs of a KV
// part, which read the same tiles: 3 for the checks and the default shapes) share each load: a chunk's
// refill is issued once, by the CTA that owns it (chunk % C), when all C CTAs released it, and TMA
// multicasts it into each CTA's stage (C = 1: the producer alone, the control)
#define KD_MULTICAST 0
#endif
#ifndef KD_CPASYNC
// with KD_MULTICAST=1: the producer warpgroup's 128 threads gather each chunk with cp.async (16-byte
// vectors into the 128-byte swizzle, each thread's completion an arrival on the chunk's barrier), as the
// Gluon kernel's loader does, instead of one TMA load
#define KD_CPASYNC 0
#endif
#ifndef KD_PAGE1
// with KD_CPASYNC: pages of one row, each tile's 64 rows anywhere in the pool (tile_rows holds every
// row's index), gathered row by row as the Gluon kernel gathers them at page size 1
#define KD_PAGE1 0
#endif

#include "../src/kdtree_engine/verify/hopper_cuda_ptx.cuh"

namespace {

constexpr int CLUSTER = KD_MULTICAST > 0 ? KD_MULTICAST : 1;
// KD_MULTICAST: and a producer warpgroup (one thread of it works; all 128 with KD_CPASYNC), its registers
// given to the math warpgroups (setmaxnreg: 2 x 128 x 232 + 128 x 40 of the 65,536)
constexpr int LAUNCH_THREADS = THREADS + (KD_MULTICAST > 0 ? 128 : 0);
constexpr int MATH_REGS = 232, PRODUCER_REGS = 40;
static_assert(CLUSTER <= 8 && !(KD_MULTICAST && KD_PREFETCH), "KD_MULTICAST: clusters of at most 8, no L2 prefetch");
static_assert(!KD_CPASYNC || KD_MULTICAST == 1, "KD_CPASYNC: with the producer alone (KD_MULTICAST=1)");
static_assert(!KD_PAGE1 || KD_CPASYNC, "KD_PAGE1: rows gathered by cp.async (KD_CPASYNC)");
constexpr int ROWS_A_TILE = KD_PAGE1 ? 64 : 1;  // tile_rows entries a tile: its first row, or each row
constexpr int FULL_ARRIVALS = KD_CPASYNC ? 128 : 1;  // a K chunk's landing: the producer's threads, or one expect_tx

struct __align__(1024) Smem {
    uint8_t q[TILE_BYTES];        // Q in 9 chunks; chunk 8 (rope) holds wg 1's P once loaded to registers
    uint8_t k[2][TILE_BYTES];     // K stages
    uint8_t p0[CHUNK_BYTES];      // wg 0's P
    float row_max[BM];            // running row max (log2 units, scaled)
    float factor0[BM], factor1[BM];
    float row_sum[2][BM];
    uint64_t k_full[2][CHUNKS];
    uint64_t k_empty[2][CHUNKS];  // KD_MULTICAST: the owner CTA's, one arrival from each CTA of the cluster
    uint64_t q_full;
};

__device__ __forceinline__ void tma_prefetch_chunk(const CUtensorMap* map, int col, int row) {
    asm volatile("cp.async.bulk.prefetch.tensor.2d.L2.global.tile [%0, {%1, %2}];" :: "l"(map), "r"(col), "r"(row)
                 : "memory");
}

// KD_MULTICAST: chunk refills shared by the CTAs of a cluster
__device__ __forceinline__ uint32_t cluster_rank() {
    uint32_t r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
    return r;
}

__device__ __forceinline__ void cluster_sync() {  // every thread of every CTA of the cluster
    asm volatile("barrier.cluster.arrive.release;\nbarrier.cluster.wait.acquire;" ::: "memory");
}

// one arrival on the barrier at bar's offset in CTA cta of the cluster (this CTA's own with clusters of 1)
__device__ __forceinline__ void mbar_arrive_in(uint64_t* bar, uint32_t cta) {
    if (CLUSTER == 1)
        mbar_arrive(bar);
    else
        asm volatile("{\n.reg .b32 remote;\nmapa.shared::cluster.u32 remote, %0, %1;\n"
                     "mbarrier.arrive.release.cluster.shared::cluster.b64 _, [remote];\n}"
                     :: "r"(smem_addr(bar)), "r"(cta) : "memory");
}

// wait for a phase of a barrier that other CTAs of the cluster arrive on
__device__ __forceinline__ void mbar_wait_cluster(uint64_t* bar, int parity) {
    asm volatile(
        "{\n.reg .pred done;\n"
        "WAIT_%=:\n"
        "mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 done, [%0], %1;\n"
        "@!done bra WAIT_%=;\n}\n" :: "r"(smem_addr(bar)), "r"(parity) : "memory");
}

// a chunk into the same offset of each CTA of the cluster in cta_mask, each CTA's barrier at bar's offset
// told its bytes
__device__ __forceinline__ void tma_multicast_chunk(void* dst, const CUtensorMap* map, uint64_t* bar, int col, int row,
                                                    uint16_t cta_mask) {
    if (KD_EVICT_FIRST)
        asm volatile(
            "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster"
            ".L2::cache_hint [%0], [%1, {%3, %4}], [%2], %5, %6;"
            :: "r"(smem_addr(dst)), "l"(map), "r"(smem_addr(bar)), "r"(col), "r"(row), "h"(cta_mask),
               "l"(0x12F0000000000000ull) : "memory");
    else
        asm volatile(
            "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster"
            " [%0], [%1, {%3, %4}], [%2], %5;"
            :: "r"(smem_addr(dst)), "l"(map), "r"(smem_addr(bar)), "r"(col), "r"(row), "h"(cta_mask) : "memory");
}

struct Params {
    const int* tile_rows;  // [num_cta, n_tiles]: first KV row of each tile (KD_PAGE1: [num_cta, n_tiles, 64], each row)
    const int* q_block;    // [num_cta]: the CTA's query block (rows 64 q_block + [0, 64))
    float* out;            // [num_cta, 64, 512]
    float* lse;            // [num_cta, 64]
    int n_tiles;           // even, >= 2
    int part_ctas;         // CTAs that read the same tiles (adjacent in blockIdx), sharing the L2 prefetch
    float scale_log2;      // softmax scale x log2(e)
    long long* stamps;     // with KD_STAMPS: [num_cta, 2, STAMP_STEPS, STAMP_POINTS] clock64 values
    const uint8_t* kv;     // the pool's rows (576 bf16 each), for KD_CPASYNC
};

// wait for chunk c of a stage, issue its QK, commit it as one group
__device__ __forceinline__ void qk_chunk_when_landed(float (&s)[32], const uint32_t (&qr)[4][4], uint64_t dq,
                                                     uint64_t dk,
                                                     uint64_t* full, int c, int parity, bool zero_init) {
    mbar_wait<KD_WAIT_HINT>(&full[c], parity);
    if (KD_CPASYNC) fence_proxy_async();  // cp.async wrote it through the generic proxy; the wgmmas read async
    hold(s);
    wgmma_fence();
    if (c == CHUNKS - 1)
        qk_rope(s, qr, dk);
    else
        qk_chunk(s, dq, dk, c, zero_init);
    wgmma_commit();
    hold(s);
}

// chunk c of the tile at KV row `row` into its place in a K stage, by TMA (evict-first with KD_EVICT_FIRST)
__device__ __forceinline__ void tma_load_k_chunk(Smem* sm, const CUtensorMap* kv_map, int stage, int c, int row) {
    if (KD_EVICT_FIRST)
        tma_load_chunk<true>(sm->k[stage] + c * CHUNK_BYTES, kv_map, &sm->k_full[stage][c], c * 64, row);
    else
        tma_load_chunk(sm->k[stage] + c * CHUNK_BYTES, kv_map, &sm->k_full[stage][c], c * 64, row);
}

template <int C0, int C1>
__device__ __forceinline__ void load_chunks(Smem* sm, const CUtensorMap* kv_map, int stage, int row) {
#pragma unroll
    for (int c = C0; c < C1; ++c) {
        mbar_expect_tx(&sm->k_full[stage][c], CHUNK_BYTES);
        tma_load_k_chunk(sm, kv_map, stage, c, row);
    }
}

// KD_MULTICAST: this CTA is done with chunks [C0, C1) of a stage: its barriers expect the refill's bytes,
// then each chunk's owner (chunk % CLUSTER) is told, which issues the refill once all CTAs released it
template <int C0, int C1>
__device__ __forceinline__ void release_chunks(Smem* sm, int stage) {
#pragma unroll
    for (int c = C0; c < C1; ++c) {
        if (!KD_CPASYNC) mbar_expect_tx(&sm->k_full[stage][c], CHUNK_BYTES);
        mbar_arrive_in(&sm->k_empty[stage][c], c % CLUSTER);
    }
}

// what a warpgroup's step reads besides its registers
struct StepContext : StepDescriptors<Smem> {
    Smem* sm;
    const CUtensorMap* kv_map;
    const int* rows;
    uint32_t p0, p1;
    int row0, row1, warp, lane, part_ctas, steps;
    bool issuer;
    float sl2;
    long long* stamps;  // this CTA's and warpgroup's [STAMP_STEPS, STAMP_POINTS] (KD_STAMPS)
};

constexpr int STAMP_STEPS = 64, STAMP_POINTS = 8;

// the refill of chunks [C0, C1) of a stage with the tile at KV row `row`, issued by their last reader: the
// TMA loads themselves, or with KD_MULTICAST this CTA's release of them to the chunks' owners
template <int C0, int C1>
__device__ __forceinline__ void refill(const StepContext& ctx, int stage, int row) {
    if (KD_MULTICAST)
        release_chunks<C0, C1>(ctx.sm, stage);
    else
        load_chunks<C0, C1>(ctx.sm, ctx.kv_map, stage, row);
}

// KD_CPASYNC: this producer thread's share of chunk c of a tile ([64 rows, 64 columns]; the rows from
// tile_rows: the first of 64 consecutive ones, or with KD_PAGE1 each row's) by cp.async into dst's
// 128-byte swizzle, its completion an arrival on bar
__device__ __forceinline__ void gather_chunk(uint8_t* dst, const uint8_t* kv, const int* tile_rows, int c,
                                             uint64_t* bar, int t) {
#pragma unroll
    for (int k = t; k < BN * 8; k += 128) {  // 16-byte vector k: row k / 8, vector k % 8 of the row
        const int r = k / 8, v = k % 8;
        const uint32_t d = smem_addr(dst) + r * 128 + ((v ^ (r & 7)) << 4);
        const int row = KD_PAGE1 ? tile_rows[r] : tile_rows[0] + r;
        const uint8_t* g = kv + (size_t(row) * D_QK + c * 64) * 2 + v * 16;
        if (KD_EVICT_FIRST)
            asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2;"
                         :: "r"(d), "l"(g), "l"(0x12F0000000000000ull) : "memory");
        else
            asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" :: "r"(d), "l"(g) : "memory");
    }
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" :: "r"(smem_addr(bar)) : "memory");
}

// KD_MULTICAST: the producer warpgroup's first thread (with KD_CPASYNC: all its threads). Issues this
// CTA's share of every refill (the chunks it owns, chunk % CLUSTER == its rank), each once every CTA of
// the cluster released it, multicast to all of them: the first pair, then pair j + 1 once step j
// released it, in the order the steps release the chunks (stage 0's left half: wg 0 after P0 V0;
// stage 1's right half and rope: wg 1 after P1 V1; stage 0's right half and rope: wg 1 after P0 V0;
// stage 1's left half: wg 0 after P1 V1, at step j + 1's start)
__device__ __forceinline__ void produce(Smem* sm, const CUtensorMap* kv_map, const uint8_t* kv, const int* rows,
                                       int steps, int t) {
    const uint32_t rank = CLUSTER > 1 ? cluster_rank() : 0;
    const uint16_t all = uint16_t((1u << CLUSTER) - 1);
    // chunk c of a tile into its stage; `row`: the tile's first KV row (TMA), read before the waits, as
    // a load after one (its "memory" clobber) would put an L2 round trip on every chunk's refill
    auto issue = [&](int stage, int c, int tile, int row) {
        if (KD_CPASYNC)
            gather_chunk(sm->k[stage] + c * CHUNK_BYTES, kv, rows + tile * ROWS_A_TILE, c, &sm->k_full[stage][c], t);
        else if (CLUSTER > 1)
            tma_multicast_chunk(sm->k[stage] + c * CHUNK_BYTES, kv_map, &sm->k_full[stage][c], c * 64, row, all);
        else
            tma_load_k_chunk(sm, kv_map, stage, c, row);
    };
    auto first_row = [&](int tile) { return KD_CPASYNC ? 0 : __ldg(rows + tile * ROWS_A_TILE); };
    for (int stage = 0; stage < 2; ++stage)
        for (int c = rank; c < CHUNKS; c += CLUSTER) issue(stage, c, stage, first_row(stage));
    const int order[4][3] = {{0, 0, 4}, {1, 4, CHUNKS}, {0, 4, CHUNKS}, {1, 0, 4}};  // stage, first, end chunk
#pragma unroll 1
    for (int j = 0; j + 1 < steps; ++j) {
        const int pair_rows[2] = {first_row(2 * j + 2), first_row(2 * j + 3)};
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            const int stage = order[k][0];
            for (int c = order[k][1]; c < order[k][2]; ++c) {
                if (c % CLUSTER != int(rank)) continue;
                mbar_wait_cluster(&sm->k_empty[stage][c], j & 1);
                issue(stage, c, 2 * j + 2 + stage, pair_rows[stage]);
            }
        }
    }
}

// point k of step j (KD_STAMPS): wg 0: 0 start, 1 m0 published, 2 P0 V0 retired, 3 m1 arrived,
// 4 P0 stored, 5 P1 arrived, 6 QK's first half issued and P1 V1 retired, 7 end; wg 1: 0 start,
// 1 m0 arrived, 2 m1 published, 3 P1 stored and its PV issued, 4 P0 arrived, 5 P1 V1 retired,
// 6 P0 V0 retired, 7 end
__device__ __forceinline__ void stamp(const StepContext& ctx, int j, int k) {
    if (KD_STAMPS && ctx.issuer && j < STAMP_STEPS) {
        long long t;
        asm volatile("mov.u64 %0, %%clock64;" : "=l"(t) :: "memory");
        ctx.stamps[j * STAMP_POINTS + k] = t;
    }
}

// the next pair's page rows, read at the step's start: a load issued at the refill would wait there
__device__ __forceinline__ int2 next_rows(const StepContext& ctx, int j, bool more) {
    return more ? make_int2(__ldg(ctx.rows + 2 * j + 2), __ldg(ctx.rows + 2 * j + 3)) : make_int2(0, 0);
}

// wg 0's step j (tile 2j in stage 0; see the file's head); MORE_STATIC: a next pair exists (more: the same,
// known at run time, taken with KD_RUNTIME_MORE)
template <bool MORE_STATIC>
__device__ __forceinline__ void wg0_step(const StepContext& shared_ctx, int j, bool more, float (&s)[32],
                                         float (&o)[128], float (&rsum)[2], const uint32_t (&qr)[4][4]) {
    const bool MORE = KD_RUNTIME_MORE ? more : MORE_STATIC;
    const StepContext ctx = opaque(shared_ctx);
    const int parity = (j + 1) & 1;
    const int2 next = next_rows(ctx, j, MORE);
    uint32_t pa[4][4];
    stamp(ctx, j, 0);
    if (KD_PREFETCH && ctx.issuer && j + 2 < ctx.steps)
        for (int k = blockIdx.x % ctx.part_ctas; k < 2 * CHUNKS; k += ctx.part_ctas)
            tma_prefetch_chunk(ctx.kv_map, (k % CHUNKS) * 64, ctx.rows[2 * j + 4 + k / CHUNKS]);
    wg0_softmax(ctx, s, o, rsum);
    named_arrive(BAR_FACTOR0);
    stamp(ctx, j, 1);
#pragma unroll
    for (int ks = 0; ks < 4; ++ks) p_fragment(pa[ks], s, ks);
    hold(o);
    wgmma_fence();
    issue_pv<false>(o, pa, ctx.dv(0));
    wgmma_wait<0>();
    hold(o);
    stamp(ctx, j, 2);
    if (!KD_REFILL0_AFTER_M1 && MORE && ctx.issuer) refill<0, 4>(ctx, 0, next.x);
    named_sync(BAR_FACTOR1);
    if (KD_REFILL0_AFTER_M1 && MORE && ctx.issuer) refill<0, 4>(ctx, 0, next.x);
    stamp(ctx, j, 3);
    float f1[2] = {ctx.sm->factor1[ctx.row0], ctx.sm->factor1[ctx.row1]};
    scale_rows(s, f1);
    store_p<false>(ctx, pa, s, ctx.p0);
    named_arrive(BAR_P0);
    stamp(ctx, j, 4);
    scale_rows(o, f1);
    for (int r = 0; r < 2; ++r) rsum[r] *= f1[r];
    named_sync(BAR_P1);
    stamp(ctx, j, 5);
    hold(o);
    wgmma_fence();
    issue_pv<false>(o, ctx.dp1(), ctx.dv(1));
    if (MORE) {
#pragma unroll
        for (int c = 0; c < 4; ++c)
            qk_chunk_when_landed(s, qr, ctx.dq(), ctx.dk(0), ctx.sm->k_full[0], c, parity, c == 0);
        wgmma_wait<4>();  // P1 V1 retired: stage 1's left half is free
        stamp(ctx, j, 6);
        if (ctx.issuer) refill<0, 4>(ctx, 1, next.y);
#pragma unroll
        for (int c = 4; c < CHUNKS; ++c)
            qk_chunk_when_landed(s, qr, ctx.dq(), ctx.dk(0), ctx.sm->k_full[0], c, parity, false);
    }
    wgmma_wait<0>();
    hold(o);
    hold(s);
    stamp(ctx, j, 7);
}

// wg 1's step j (tile 2j + 1 in stage 1)
template <bool MORE_STATIC>
__device__ __forceinline__ void wg1_step(const StepContext& shared_ctx, int j, bool more, float (&s)[32],
                                         float (&o)[128], float (&rsum)[2], const uint32_t (&qr)[4][4]) {
    const bool MORE = KD_RUNTIME_MORE ? more : MORE_STATIC;
    const StepContext ctx = opaque(shared_ctx);
    const int parity = (j + 1) & 1;
    const int2 next = next_rows(ctx, j, MORE);
    float mx[2];
    uint32_t pa[4][4];
    stamp(ctx, j, 0);
    row_max(s, mx);
    named_sync(BAR_FACTOR0);
    stamp(ctx, j, 1);
    wg1_softmax(ctx, mx, s, o, rsum);
    named_arrive(BAR_FACTOR1);
    stamp(ctx, j, 2);
    store_p<false>(ctx, pa, s, ctx.p1);
    hold(o);
    wgmma_fence();
    issue_pv<false>(o, pa, at(ctx.dv(1), 4 * CHUNK_BYTES));
    if (!KD_P1_AFTER_BOTH) named_arrive(BAR_P1);
    stamp(ctx, j, 3);
    named_sync(BAR_P0);
    stamp(ctx, j, 4);
    issue_pv<false>(o, ctx.dp0(), at(ctx.dv(0), 4 * CHUNK_BYTES));
    if (KD_P1_AFTER_BOTH) named_arrive(BAR_P1);
    if (MORE) {
        wgmma_wait<1>();  // P1 V1 retired: stage 1's right half and rope are free
        stamp(ctx, j, 5);
        if (ctx.issuer) refill<4, CHUNKS>(ctx, 1, next.y);
        wgmma_wait<0>();  // P0 V0 retired: stage 0's right half (its rope was free since wg 0's QK)
        stamp(ctx, j, 6);
        if (ctx.issuer) refill<4, CHUNKS>(ctx, 0, next.x);
#pragma unroll
        for (int c = 4; c < CHUNKS; ++c)
            qk_chunk_when_landed(s, qr, ctx.dq(), ctx.dk(1), ctx.sm->k_full[1], c, parity, c == 4);
#pragma unroll
        for (int c = 0; c < 4; ++c)
            qk_chunk_when_landed(s, qr, ctx.dq(), ctx.dk(1), ctx.sm->k_full[1], c, parity, false);
    }
    wgmma_wait<0>();
    hold(o);
    hold(s);
    stamp(ctx, j, 7);
}

// the two math warpgroups' part of step_kernel: the steps, then the normalised output and LSE
__device__ __forceinline__ void math_warpgroups(const Params& p, const StepContext& ctx, int wg, int warp, int lane,
                                                int row0, int row1, uint32_t p1) {
    Smem* sm = ctx.sm;
    // Q's rope columns to registers (A fragments), then chunk 8 is free for wg 1's P
    mbar_wait<KD_WAIT_HINT>(&sm->q_full, 0);
    uint32_t qr[4][4];
#pragma unroll
    for (int ks = 0; ks < 4; ++ks) ldmatrix_x4(qr[ks], frag_row_addr(p1, warp, lane, ks));
    named_sync(BAR_MATH);

    float s[32], o[128], rsum[2] = {0.f, 0.f};
#pragma unroll
    for (int k = 0; k < 128; ++k) o[k] = 0.f;
    wgmma_fence();
#pragma unroll
    for (int c = 0; c < CHUNKS; ++c)
        qk_chunk_when_landed(s, qr, ctx.dq(), ctx.dk(wg), sm->k_full[wg], c, 0, c == 0);
    wgmma_wait<0>();
    hold(s);

    // each warpgroup its own loop, the last step apart: no branch on the warpgroup or on a next pair
    // inside a step (FlashMLA's layout of the two loops)
    if (KD_RUNTIME_MORE) {
        if (wg == 0) {
#pragma unroll 1
            for (int j = 0; j < ctx.steps; ++j) wg0_step<true>(ctx, j, j + 1 < ctx.steps, s, o, rsum, qr);
        } else {
#pragma unroll 1
            for (int j = 0; j < ctx.steps; ++j) wg1_step<true>(ctx, j, j + 1 < ctx.steps, s, o, rsum, qr);
        }
    } else if (wg == 0) {
#pragma unroll 1
        for (int j = 0; j < ctx.steps - 1; ++j) wg0_step<true>(ctx, j, true, s, o, rsum, qr);
        wg0_step<false>(ctx, ctx.steps - 1, false, s, o, rsum, qr);
    } else {
#pragma unroll 1
        for (int j = 0; j < ctx.steps - 1; ++j) wg1_step<true>(ctx, j, true, s, o, rsum, qr);
        wg1_step<false>(ctx, ctx.steps - 1, false, s, o, rsum, qr);
    }

    // row sums: this thread's parts -> the quad's -> both warpgroups'
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        rsum[r] += __shfl_xor_sync(0xffffffffu, rsum[r], 1);
        rsum[r] += __shfl_xor_sync(0xffffffffu, rsum[r], 2);
    }
    if ((lane & 3) == 0) sm->row_sum[wg][row0] = rsum[0], sm->row_sum[wg][row1] = rsum[1];
    named_sync(BAR_MATH);
    const int rr[2] = {row0, row1};
    float* out = p.out + size_t(blockIdx.x) * BM * D_V + wg * 256 + 2 * (lane & 3);
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        float l = sm->row_sum[0][rr[r]] + sm->row_sum[1][rr[r]], inv = 1.f / l;
#pragma unroll
        for (int i = 0; i < 32; ++i)
            *reinterpret_cast<float2*>(out + rr[r] * D_V + 8 * i) =
                make_float2(o[4 * i + 2 * r] * inv, o[4 * i + 2 * r + 1] * inv);
        if (wg == 0 && (lane & 3) == 0)
            p.lse[blockIdx.x * BM + rr[r]] = (sm->row_max[rr[r]] + __log2f(l)) * 0.6931471805599453f;
    }
}

__global__ void __launch_bounds__(LAUNCH_THREADS, 1)
step_kernel(const __grid_constant__ CUtensorMap q_map, const __grid_constant__ CUtensorMap kv_map, const Params p) {
    extern __shared__ uint8_t smem_raw[];
    Smem* sm = reinterpret_cast<Smem*>(smem_raw + ((1024 - (smem_addr(smem_raw) & 1023)) & 1023));
    // the warpgroup, broadcast from lane 0 so that the compiler knows it is the same in a warp (as
    // CUTLASS's canonical_warp_group_idx): branches on it are then uniform, and values made inside them
    // can stay in uniform registers
    const int wg = __shfl_sync(0xffffffffu, int(threadIdx.x / 128), 0), t = threadIdx.x % 128, warp = t / 32,
              lane = t % 32;
    const int row0 = warp * 16 + lane / 4, row1 = row0 + 8;
    const bool issuer = t == 0 && wg < 2;  // a math warpgroup's first thread
    const int* rows = p.tile_rows + size_t(blockIdx.x) * p.n_tiles * ROWS_A_TILE;
    const uint32_t base = smem_addr(sm), p0 = smem_addr(sm->p0), p1 = smem_addr(sm->q) + 8 * CHUNK_BYTES;
    const StepContext ctx{{k_major(base), mn_major_v(base)}, sm, &kv_map, rows, p0, p1, row0, row1, warp, lane,
                          p.part_ctas, p.n_tiles / 2, issuer, p.scale_log2,
                          p.stamps + (size_t(blockIdx.x) * 2 + wg) * STAMP_STEPS * STAMP_POINTS};

    if (threadIdx.x == 0) {
        for (int s = 0; s < 2; ++s)
            for (int c = 0; c < CHUNKS; ++c) {
                mbar_init(&sm->k_full[s][c], FULL_ARRIVALS);
                mbar_init(&sm->k_empty[s][c], CLUSTER);
            }
        mbar_init(&sm->q_full, 1);
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    if (threadIdx.x < BM) sm->row_max[threadIdx.x] = -INFINITY;
    __syncthreads();
    if (threadIdx.x == 0) {
        mbar_expect_tx(&sm->q_full, TILE_BYTES);
        for (int c = 0; c < CHUNKS; ++c)
            tma_load_chunk(sm->q + c * CHUNK_BYTES, &q_map, &sm->q_full, c * 64, p.q_block[blockIdx.x] * BM);
        if (KD_MULTICAST && !KD_CPASYNC)  // the first pair's bytes, expected before any CTA's producer issues them
            for (int s = 0; s < 2; ++s)
                for (int c = 0; c < CHUNKS; ++c) mbar_expect_tx(&sm->k_full[s][c], CHUNK_BYTES);
    }
    if (!KD_MULTICAST) {
        if (issuer) load_chunks<0, CHUNKS>(sm, &kv_map, wg, rows[wg]);
        math_warpgroups(p, ctx, wg, warp, lane, row0, row1, p1);
        return;
    }
    cluster_sync();  // every CTA's barriers initialised and armed before a multicast lands in it
    if (wg == 2) {
        asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" :: "n"(PRODUCER_REGS));
        if (t == 0 || KD_CPASYNC) produce(sm, &kv_map, p.kv, rows, p.n_tiles / 2, t);
    } else {
        asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" :: "n"(MATH_REGS));
        math_warpgroups(p, ctx, wg, warp, lane, row0, row1, p1);
    }
    cluster_sync();  // no CTA leaves while another may still signal its barriers
}

constexpr int SMEM_BYTES = int(sizeof(Smem) + 1024);  // the kernel aligns Smem to 1024 bytes itself

// step_kernel's launch on num_cta CTAs (in clusters of CLUSTER with KD_MULTICAST), its shared memory
// allowed once; false if the attribute could not be set. In the anonymous namespace, as the kernel: a
// class with external linkage would make the `once` a process-wide (STB_GNU_UNIQUE) object, shared by
// every build loaded into the process, so only the first build's kernel would get its shared memory
// (run 50: the later builds' launches failed with "invalid argument")
struct StepLaunch {
    cudaLaunchConfig_t config = {};
    cudaLaunchAttribute cluster[1];
    bool ok;
    StepLaunch(int num_cta, cudaStream_t stream) {
        static const bool smem_set =  // once: the size does not change
            cudaFuncSetAttribute(step_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, SMEM_BYTES)
            == cudaSuccess;
        ok = smem_set;
        config.gridDim = dim3(num_cta);
        config.blockDim = dim3(LAUNCH_THREADS);
        config.dynamicSmemBytes = SMEM_BYTES;
        config.stream = stream;
        if (KD_MULTICAST) {
            cluster[0].id = cudaLaunchAttributeClusterDimension;
            cluster[0].val.clusterDim.x = CLUSTER;
            cluster[0].val.clusterDim.y = cluster[0].val.clusterDim.z = 1;
            config.attrs = cluster;
            config.numAttrs = 1;
        }
    }
};

}  // namespace

extern "C" int kd_step_smem_bytes() { return SMEM_BYTES; }

// the stamps buffer a launch of num_cta CTAs needs with KD_STAMPS (int64 values)
extern "C" int kd_step_stamp_values(int num_cta) { return num_cta * 2 * STAMP_STEPS * STAMP_POINTS; }

extern "C" int kd_step_launch(const void* q, unsigned long long q_rows, const void* kv, unsigned long long kv_rows,
                              const int* tile_rows, const int* q_block, float* out, float* lse, int num_cta,
                              int n_tiles, int part_ctas, float scale_log2, long long* stamps, void* stream) {
    if (n_tiles < 2 || n_tiles % 2) return 3;
    if (part_ctas % CLUSTER || num_cta % CLUSTER) return 5;  // a cluster's CTAs must read the same tiles
    CUtensorMap q_map, kv_map;
    if (make_map(&q_map, q, q_rows, KD_L2_PROMOTION) || make_map(&kv_map, kv, kv_rows, KD_L2_PROMOTION)) return 1;
    StepLaunch launch(num_cta, static_cast<cudaStream_t>(stream));
    if (!launch.ok) return 4;
    Params p{tile_rows, q_block, out, lse, n_tiles, part_ctas, scale_log2, stamps, static_cast<const uint8_t*>(kv)};
    cudaError_t err = cudaLaunchKernelEx(&launch.config, step_kernel, q_map, kv_map, p);
    if (err != cudaSuccess) fprintf(stderr, "kd_step_launch: %s\n", cudaGetErrorString(err));
    return err == cudaSuccess ? 0 : 2;
}

// KD_MULTICAST: how many clusters of the launch can be resident at once (a grid of more CTAs than that
// times CLUSTER runs in two waves); 0 without clusters
extern "C" int kd_step_max_active_clusters() {
    if (!KD_MULTICAST) return 0;
    StepLaunch launch(CLUSTER * 64, nullptr);
    int clusters = 0;
    return launch.ok && cudaOccupancyMaxActiveClusters(&clusters, step_kernel, &launch.config) == cudaSuccess
        ? clusters : -1;
}
