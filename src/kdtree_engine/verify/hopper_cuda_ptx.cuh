// The PTX of the Hopper (sm_90a) verify step in CUDA C++, shared by the step spike
// (hopper_cuda_step.cu) and the contract kernel (hopper_cuda_verify.cu): mbarriers, named barriers,
// wgmma (bf16 or fp16) with 128-byte-swizzled shared-memory operands, ldmatrix / stmatrix, TMA boxes
// and their tensor maps, and the softmax pieces that act on one thread's part of a [64, 64] score
// tile (m64n64 accumulator layout: thread (warp w, lane l) holds rows 16w + l/4 and 16w + l/4 + 8,
// columns 8i + 2(l % 4) + {0, 1}, i < 8, as s[4i + 2r + {0, 1}] for its row r). One translation unit
// a kernel: everything here is inline.
#pragma once
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

constexpr int BM = 64;           // query rows a CTA
constexpr int BN = 64;           // KV rows a tile
constexpr int D_QK = 576;        // latent 512 + rope 64
constexpr int D_V = 512;
constexpr int CHUNKS = D_QK / 64;  // 64-column chunks of a tile (one 128-byte swizzle atom wide)
constexpr int CHUNK_BYTES = BN * 64 * 2;
constexpr int TILE_BYTES = CHUNKS * CHUNK_BYTES;
constexpr int THREADS = 256;  // the two math warpgroups
constexpr int MAX_TREE_NODES = 1024;  // the contract's most nodes a sequence

// named barriers of the two math warpgroups (0 is __syncthreads)
enum { BAR_FACTOR0 = 1, BAR_FACTOR1 = 2, BAR_P0 = 3, BAR_P1 = 4, BAR_MATH = 5 /* the math warpgroups alone */ };

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
    return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void named_arrive(int id) {
    asm volatile("bar.arrive %0, %1;" :: "r"(id), "n"(THREADS) : "memory");
}

__device__ __forceinline__ void named_sync(int id) {
    asm volatile("bar.sync %0, %1;" :: "r"(id), "n"(THREADS) : "memory");
}

__device__ __forceinline__ void mbar_init(uint64_t* bar, int count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(smem_addr(bar)), "r"(count) : "memory");
}

__device__ __forceinline__ void mbar_expect_tx(uint64_t* bar, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(smem_addr(bar)), "r"(bytes)
                 : "memory");
}

// one arrival on bar (release: this thread's earlier accesses happen before the phase completes)
__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
    asm volatile("mbarrier.arrive.release.cta.shared::cta.b64 _, [%0];" :: "r"(smem_addr(bar)) : "memory");
}

// `count` arrivals on bar at once (release, as mbar_arrive)
__device__ __forceinline__ void mbar_arrive(uint64_t* bar, uint32_t count) {
    asm volatile("mbarrier.arrive.release.cta.shared::cta.b64 _, [%0], %1;" :: "r"(smem_addr(bar)), "r"(count)
                 : "memory");
}

// SUSPEND_HINT: the thread suspends until the phase completes or a time limit passes, not a poll
template <bool SUSPEND_HINT = false>
__device__ __forceinline__ void mbar_wait(uint64_t* bar, int parity) {
    if (SUSPEND_HINT)
        asm volatile(
            "{\n.reg .pred done;\n"
            "WAIT_%=:\n"
            "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1, %2;\n"
            "@!done bra WAIT_%=;\n}\n" :: "r"(smem_addr(bar)), "r"(parity), "r"(10000000) : "memory");
    else
        asm volatile(
            "{\n.reg .pred done;\n"
            "WAIT_%=:\n"
            "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
            "@!done bra WAIT_%=;\n}\n" :: "r"(smem_addr(bar)), "r"(parity) : "memory");
}

// the tensor map's 128 bytes fetched into the TMA unit's descriptor cache ahead of its first load (else that load
// waits for them; FlashMLA and CUTLASS prefetch their maps at entry)
__device__ __forceinline__ void prefetch_tensor_map(const CUtensorMap* map) {
    asm volatile("prefetch.tensormap [%0];" :: "l"(map) : "memory");
}

// a [64, 64] box of a 2-D tensor map at (col, row) into dst by TMA, its bytes counted on bar (EVICT_FIRST: with an
// L2 evict-first hint)
template <bool EVICT_FIRST = false>
__device__ __forceinline__ void tma_load_chunk(void* dst, const CUtensorMap* map, uint64_t* bar, int col, int row) {
    if (EVICT_FIRST)
        asm volatile(
            "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint"
            " [%0], [%1, {%3, %4}], [%2], %5;"
            :: "r"(smem_addr(dst)), "l"(map), "r"(smem_addr(bar)), "r"(col), "r"(row), "l"(0x12F0000000000000ull)
            : "memory");
    else
        asm volatile(
            "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4}], [%2];"
            :: "r"(smem_addr(dst)), "l"(map), "r"(smem_addr(bar)), "r"(col), "r"(row) : "memory");
}

__device__ __forceinline__ void fence_proxy_async() {
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

// fence_proxy_async where `fence` holds, predicated in PTX (ptxas still branches around it, but keeps `fence` in one
// register: the same test as a C++ `if` re-derived it before each of a step's 9 fences, ~38 instructions a step)
__device__ __forceinline__ void fence_proxy_async(bool fence) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %0, 0;\n@p fence.proxy.async.shared::cta;\n}\n"
                 :: "r"(int(fence)) : "memory");
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;" :: "n"(N) : "memory"); }

// keeps the compiler from moving accesses of an accumulator across an asynchronous wgmma boundary
template <int N>
__device__ __forceinline__ void hold(float (&d)[N]) {
#pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i]) :: "memory");
}

// shared-memory matrix descriptor, 128-byte swizzle; offsets in bytes
__device__ __forceinline__ uint64_t sw128_desc(uint32_t addr, uint32_t leading, uint32_t stride) {
    return uint64_t((addr & 0x3FFFF) >> 4) | (uint64_t(leading >> 4) << 16) | (uint64_t(stride >> 4) << 32)
           | (uint64_t(1) << 62);
}
// K-major operand ([rows, 64] chunk, 16-column step at +32 B): 8-row groups 1024 B apart
__device__ __forceinline__ uint64_t k_major(uint32_t addr) { return sw128_desc(addr, 16, 1024); }
// V as the B operand of P V ([64 keys, 256 columns] over 4 chunks): 64 columns a chunk (8 KB apart),
// 8 keys 1024 B apart; a 16-key step at +2048 B
__device__ __forceinline__ uint64_t mn_major_v(uint32_t addr) { return sw128_desc(addr, CHUNK_BYTES, 1024); }

__device__ __forceinline__ float fast_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// two values rounded to the wgmmas' 16-bit type (F16: fp16, else bf16) in one register, lo first
template <bool F16 = false>
__device__ __forceinline__ uint32_t pack16(float lo, float hi) {
    if constexpr (F16) {
        __half2 v = __floats2half2_rn(lo, hi);
        return *reinterpret_cast<uint32_t*>(&v);
    } else {
        __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
        return *reinterpret_cast<uint32_t*>(&v);
    }
}

// address of this lane's row for ldmatrix / stmatrix x4 of the 16 x 16 block (k16 step ks) of a
// [64, 64] swizzled chunk: lanes 0-15 rows 0-15 at column 16ks, lanes 16-31 the same rows at +8
__device__ __forceinline__ uint32_t frag_row_addr(uint32_t chunk, int warp, int lane, int ks) {
    int row = warp * 16 + (lane & 15);
    int col16 = ks * 2 + (lane >> 4);
    return chunk + row * 128 + ((col16 ^ (row & 7)) << 4);
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}

__device__ __forceinline__ void stmatrix_x4(const uint32_t (&r)[4], uint32_t addr) {
    asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};"
                 :: "r"(addr), "r"(r[0]), "r"(r[1]), "r"(r[2]), "r"(r[3]) : "memory");
}

// wgmma.mma_async m64nNk16, bf16 in (F16: fp16), fp32 accumulators d (N/2 a thread); rs: A from registers;
// the last immediate transposes B (1 for V, whose columns are contiguous). The accumulators' operand
// lists, shared by the SS and RS forms:
#define ACC32_REGS \
    "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15," \
    " %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31},"
#define ACC32_OUT(d) \
    "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
    "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
    "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
    "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
#define ACC128_REGS \
    "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15," \
    " %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31," \
    " %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47," \
    " %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63," \
    " %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79," \
    " %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95," \
    " %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111," \
    " %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127},"
#define ACC128_OUT(d) \
    "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
    "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
    "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
    "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), \
    "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), \
    "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), \
    "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), \
    "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), \
    "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), \
    "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), \
    "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), \
    "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), \
    "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), \
    "+f"(d[103]), "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), \
    "+f"(d[110]), "+f"(d[111]), "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), \
    "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), \
    "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])

// each wrapper's asm is written once, as KD_ASM(TYPE), for TYPE "bf16" and "f16"
template <bool F16 = false>
__device__ __forceinline__ void wgmma_qk_ss(float (&d)[32], uint64_t desc_a, uint64_t desc_b, int scale_d) {
#define KD_ASM(TYPE)                                                                         \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"                               \
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32." TYPE "." TYPE " " ACC32_REGS \
                 " %32, %33, p, 1, 1, 0, 0;\n}\n"                                          \
                 : ACC32_OUT(d)                                                              \
                 : "l"(desc_a), "l"(desc_b), "r"(scale_d))
    if constexpr (F16) KD_ASM("f16"); else KD_ASM("bf16");
#undef KD_ASM
}

template <bool F16 = false>
__device__ __forceinline__ void wgmma_qk_rs(float (&d)[32], const uint32_t (&a)[4], uint64_t desc_b, int scale_d) {
#define KD_ASM(TYPE)                                                                         \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"                               \
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32." TYPE "." TYPE " " ACC32_REGS \
                 " {%32, %33, %34, %35}, %36, p, 1, 1, 0;\n}\n"                            \
                 : ACC32_OUT(d)                                                              \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d))
    if constexpr (F16) KD_ASM("f16"); else KD_ASM("bf16");
#undef KD_ASM
}

template <bool F16 = false>
__device__ __forceinline__ void wgmma_pv_rs(float (&d)[128], const uint32_t (&a)[4], uint64_t desc_b, int scale_d) {
#define KD_ASM(TYPE)                                                                           \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %133, 0;\n"                                \
                 "wgmma.mma_async.sync.aligned.m64n256k16.f32." TYPE "." TYPE " " ACC128_REGS \
                 " {%128, %129, %130, %131}, %132, p, 1, 1, 1;\n}\n"                         \
                 : ACC128_OUT(d)                                                               \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d))
    if constexpr (F16) KD_ASM("f16"); else KD_ASM("bf16");
#undef KD_ASM
}

template <bool F16 = false>
__device__ __forceinline__ void wgmma_pv_ss(float (&d)[128], uint64_t desc_a, uint64_t desc_b, int scale_d) {
#define KD_ASM(TYPE)                                                                           \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"                                \
                 "wgmma.mma_async.sync.aligned.m64n256k16.f32." TYPE "." TYPE " " ACC128_REGS \
                 " %128, %129, p, 1, 1, 0, 1;\n}\n"                                          \
                 : ACC128_OUT(d)                                                               \
                 : "l"(desc_a), "l"(desc_b), "r"(scale_d))
    if constexpr (F16) KD_ASM("f16"); else KD_ASM("bf16");
#undef KD_ASM
}

// k16 step ks of this thread's P (its S values after the softmax) as an A operand
template <bool F16 = false>
__device__ __forceinline__ void p_fragment(uint32_t (&a)[4], const float (&s)[32], int ks) {
#pragma unroll
    for (int k = 0; k < 4; ++k) a[k] = pack16<F16>(s[8 * ks + 2 * k], s[8 * ks + 2 * k + 1]);
}

// the max of each of this thread's two rows over the quad that holds it
__device__ __forceinline__ void row_max(const float (&s)[32], float (&mx)[2]) {
    mx[0] = mx[1] = -INFINITY;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        mx[0] = fmaxf(mx[0], fmaxf(s[4 * i], s[4 * i + 1]));
        mx[1] = fmaxf(mx[1], fmaxf(s[4 * i + 2], s[4 * i + 3]));
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
        mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
    }
}

// s <- exp2(s * scale_log2 - m[row]); returns this thread's part of each row's sum
__device__ __forceinline__ void exponentiate(float (&s)[32], const float (&m)[2], float scale_log2, float (&sum)[2]) {
    sum[0] = sum[1] = 0.f;
#pragma unroll
    for (int k = 0; k < 32; ++k) {
        int r = (k >> 1) & 1;
        s[k] = fast_exp2(fmaf(s[k], scale_log2, -m[r]));
        sum[r] += s[k];
    }
}

template <int N>
__device__ __forceinline__ void scale_rows(float (&x)[N], const float (&f)[2]) {
#pragma unroll
    for (int k = 0; k < N; ++k) x[k] *= f[(k >> 1) & 1];
}

// a descriptor moved by a byte offset (the address field cannot carry over: shared memory < 256 KB)
__device__ __forceinline__ uint64_t at(uint64_t desc, uint32_t offset) { return desc + (offset >> 4); }

// S (+)= Q[:, chunk c] K[:, chunk c]^T, 4 k16 steps (zero_init: S = ..); dq, dk: K-major descriptors
// of the Q and K stage buffers
template <bool F16 = false>
__device__ __forceinline__ void qk_chunk(float (&s)[32], uint64_t dq, uint64_t dk, int c, bool zero_init) {
#pragma unroll
    for (int ks = 0; ks < 4; ++ks)
        wgmma_qk_ss<F16>(s, at(dq, c * CHUNK_BYTES + ks * 32), at(dk, c * CHUNK_BYTES + ks * 32),
                    (zero_init && ks == 0) ? 0 : 1);
}

// S += Q_rope K_rope^T, Q's rope columns from registers
template <bool F16 = false>
__device__ __forceinline__ void qk_rope(float (&s)[32], const uint32_t (&qr)[4][4], uint64_t dk) {
#pragma unroll
    for (int ks = 0; ks < 4; ++ks) wgmma_qk_rs<F16>(s, qr[ks], at(dk, 8 * CHUNK_BYTES + ks * 32), 1);
}

// the wgmma descriptors of a step's shared memory S (its q, k[2] and p0 buffers: Q in 9 chunks whose rope
// chunk 8 holds wg 1's P, the two K stages, wg 0's P), each made from two base descriptors plus a constant
// offset (two registers, not one pair a buffer)
template <class S>
struct StepDescriptors {
    uint64_t kd, vd;  // K-major and V (MN-major) descriptors of the shared memory's base
    __device__ __forceinline__ uint64_t dq() const { return at(kd, offsetof(S, q)); }
    __device__ __forceinline__ uint64_t dk(int stage) const { return at(kd, offsetof(S, k) + stage * TILE_BYTES); }
    __device__ __forceinline__ uint64_t dp0() const { return at(kd, offsetof(S, p0)); }
    __device__ __forceinline__ uint64_t dp1() const { return at(kd, offsetof(S, q) + 8 * CHUNK_BYTES); }
    __device__ __forceinline__ uint64_t dv(int stage) const { return at(vd, offsetof(S, k) + stage * TILE_BYTES); }
};

// a copy of a step's context whose base descriptors the compiler cannot see through: taken at each step's
// start, it keeps the step's ~50 descriptors from being hoisted out of the loop and spilled (made from the
// bases at each use)
template <class Ctx>
__device__ __forceinline__ Ctx opaque(const Ctx& ctx) {
    Ctx c = ctx;
    asm volatile("" : "+l"(c.kd), "+l"(c.vd));
    return c;
}

// ---- the step's arithmetic, shared by the step spike and the kernel. Ctx: their StepContext (sm with the
// row vectors row_max, factor0, factor1; the thread's rows row0, row1; warp, lane; sl2, the softmax scale x
// log2(e); the descriptors dv(stage), dp0(), dp1())

// a row max as the exponent's offset: 0 where no key of the row is visible yet (-inf), so that exp2 of
// -inf scores gives 0, not NaN
__device__ __forceinline__ float offset_of(float m) { return m == -INFINITY ? 0.f : m; }

// wg 0's softmax of its tile's scores s: m0 = max(the running max m, its rows' max) and f0 = exp2(m - m0)
// published for wg 1 (a quad's first lane), s <- P0 = exp2(s sl2 - m0), this thread's row sums and O
// rescaled by f0
template <class Ctx>
__device__ __forceinline__ void wg0_softmax(const Ctx& ctx, float (&s)[32], float (&o)[128], float (&rsum)[2]) {
    float mx[2], sum[2];
    row_max(s, mx);
    float m_old[2] = {ctx.sm->row_max[ctx.row0], ctx.sm->row_max[ctx.row1]}, m_new[2], m_off[2], f0[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        m_new[r] = fmaxf(m_old[r], mx[r] * ctx.sl2);
        m_off[r] = offset_of(m_new[r]);
        f0[r] = fast_exp2(m_old[r] - m_off[r]);
    }
    if ((ctx.lane & 3) == 0) {
        ctx.sm->row_max[ctx.row0] = m_new[0], ctx.sm->row_max[ctx.row1] = m_new[1];
        ctx.sm->factor0[ctx.row0] = f0[0], ctx.sm->factor0[ctx.row1] = f0[1];
    }
    exponentiate(s, m_off, ctx.sl2, sum);
    for (int r = 0; r < 2; ++r) rsum[r] = rsum[r] * f0[r] + sum[r];
    scale_rows(o, f0);
}

// wg 1's softmax, once wg 0 published m0: m1 = max(m0, mx, its rows' raw max scaled) and f1 = exp2(m0 - m1)
// published for wg 0, s <- P1 = exp2(s sl2 - m1), its row sums and O rescaled from its previous max to
// m1 (f0 f1)
template <class Ctx>
__device__ __forceinline__ void wg1_softmax(const Ctx& ctx, const float (&mx)[2], float (&s)[32], float (&o)[128],
                                            float (&rsum)[2]) {
    float m0[2] = {ctx.sm->row_max[ctx.row0], ctx.sm->row_max[ctx.row1]};
    float f0[2] = {ctx.sm->factor0[ctx.row0], ctx.sm->factor0[ctx.row1]};
    float m_new[2], m_off[2], f[2], sum[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        m_new[r] = fmaxf(m0[r], mx[r] * ctx.sl2);
        m_off[r] = offset_of(m_new[r]);
        f[r] = fast_exp2(m0[r] - m_off[r]);  // wg 0's max to the joint one
    }
    if ((ctx.lane & 3) == 0) {
        ctx.sm->row_max[ctx.row0] = m_new[0], ctx.sm->row_max[ctx.row1] = m_new[1];
        ctx.sm->factor1[ctx.row0] = f[0], ctx.sm->factor1[ctx.row1] = f[1];
    }
    exponentiate(s, m_off, ctx.sl2, sum);
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        f[r] *= f0[r];  // this warpgroup's previous max to the joint one
        rsum[r] = rsum[r] * f[r] + sum[r];
    }
    scale_rows(o, f);
}

// this thread's P (s) as A fragments pa, also stored into the [64, 64] P buffer at shared address `buffer`
// for the other warpgroup's wgmmas (then the proxy fence they need)
template <bool F16, class Ctx>
__device__ __forceinline__ void store_p(const Ctx& ctx, uint32_t (&pa)[4][4], const float (&s)[32], uint32_t buffer) {
#pragma unroll
    for (int ks = 0; ks < 4; ++ks) {
        p_fragment<F16>(pa[ks], s, ks);
        stmatrix_x4(pa[ks], frag_row_addr(buffer, ctx.warp, ctx.lane, ks));
    }
    fence_proxy_async();
}

// O += P V, 4 k16 steps committed as one group (after a wgmma_fence where O was touched since the last
// wgmma), P from registers pa; v: V's descriptor ([64 keys, 256 columns])
template <bool F16>
__device__ __forceinline__ void issue_pv(float (&o)[128], const uint32_t (&pa)[4][4], uint64_t v) {
#pragma unroll
    for (int ks = 0; ks < 4; ++ks) wgmma_pv_rs<F16>(o, pa[ks], at(v, ks * 2048), 1);
    wgmma_commit();
}

// the same with P from the [64, 64] buffer of descriptor p
template <bool F16>
__device__ __forceinline__ void issue_pv(float (&o)[128], uint64_t p, uint64_t v) {
#pragma unroll
    for (int ks = 0; ks < 4; ++ks) wgmma_pv_ss<F16>(o, at(p, ks * 32), at(v, ks * 2048), 1);
    wgmma_commit();
}

typedef CUresult (*EncodeTiled)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

// host: a [rows, 576] bf16 tensor (rows row_bytes apart, 1152 if dense) read in [64, 64] boxes, 128-byte
// swizzled, an L2 miss fetching l2_promotion bytes (128 or 256). 0: made; 1: no driver entry point; 2: refused
inline int make_map(CUtensorMap* map, const void* base, unsigned long long rows, int l2_promotion,
                    unsigned long long row_bytes = D_QK * 2) {
    static EncodeTiled encode = nullptr;
    if (!encode) {
        void* fn = nullptr;
        cudaDriverEntryPointQueryResult found;
        if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &found)
                != cudaSuccess || fn == nullptr)
            return 1;
        encode = reinterpret_cast<EncodeTiled>(fn);
    }
    cuuint64_t dims[2] = {D_QK, rows}, strides[1] = {row_bytes};
    cuuint32_t box[2] = {64, 64}, elem[2] = {1, 1};
    return encode(map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, const_cast<void*>(base), dims, strides, box, elem,
                  CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                  l2_promotion == 128 ? CU_TENSOR_MAP_L2_PROMOTION_L2_128B : CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                  CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS ? 0 : 2;
}
