"""Compile-only probe (sm_90a, Triton 3.6, no GPU): does Gluon's warp_specialize take a FlashMLA-like split?

    /tmp/t36/bin/python scripts/spike_hopper_ws_probe.py     # a venv with triton==3.6.0

Default partition = warpgroup 0, worker 0 = warpgroup 1 (each: S = Q K^T for its OWN 64-key tile,
m64n64, then O[:, its 256 columns] += P V over both tiles, P exchanged through shared memory and
mbarriers), worker 1 = a cp.async loader that signals "tile full" mbarriers. NOT a kernel: no rope
part, no masking, no scale, never run on a GPU; it only shows what the compiler accepts and emits
(shared memory, setmaxnreg per partition, wgmma shapes, mbarrier ops). docs/perf_log.md, run 14.
"""
import re, subprocess, tempfile, json
from pathlib import Path
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource
from triton.experimental.gluon.language.nvidia.hopper import async_copy, fence_async_shared, warpgroup_mma, warpgroup_mma_wait, mbarrier


@gluon.jit
def _consumer(s_q, s_k, s_p, full, empty, pdone, out, n_tiles, WG: gl.constexpr):
    S_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 16])
    O_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 256, 16])
    acc = gl.zeros([64, 256], gl.float32, layout=O_L)
    m_i = gl.full([64], float("-inf"), gl.float32, layout=gl.SliceLayout(1, S_L))
    for j in range(n_tiles):
        t = 2 * j + WG  # this warpgroup's tile
        stage = t % 2
        mbarrier.wait(full.index(stage), (t // 2) & 1)
        s = warpgroup_mma(s_q, s_k.index(stage).permute((1, 0)), gl.zeros([64, 64], gl.float32, layout=S_L), use_acc=False, is_async=True)
        s = warpgroup_mma_wait(0, deps=[s])
        m_new = gl.maximum(m_i, gl.max(s, axis=1))
        p = gl.exp2(s - gl.expand_dims(m_new, 1))
        acc = acc * gl.expand_dims(gl.convert_layout(gl.exp2(m_i - m_new), gl.SliceLayout(1, O_L)), 1)
        m_i = m_new
        s_p.index(WG).store(p.to(gl.bfloat16))
        fence_async_shared()
        mbarrier.arrive(pdone.index(WG))
        mbarrier.wait(pdone.index(1 - WG), j & 1)  # the other warpgroup's P of this step
        for h in gl.static_range(2):  # both tiles' P, this warpgroup's 256 V columns
            v = s_k.index(h).slice(WG * 256, 256, dim=1)
            acc = warpgroup_mma(s_p.index(h), v, acc, is_async=True)
        acc = warpgroup_mma_wait(0, deps=[acc])
        mbarrier.arrive(empty.index(stage))
    o_r = gl.arange(0, 64, layout=gl.SliceLayout(1, O_L))
    o_c = gl.arange(0, 256, layout=gl.SliceLayout(0, O_L)) + WG * 256
    gl.store(out + gl.expand_dims(o_r, 1) * 512 + gl.expand_dims(o_c, 0), acc)


@gluon.jit
def _loader(s_k, full, empty, kv, page_table, n_tiles):
    L: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [4, 1], [1, 0])
    for t in range(2 * n_tiles):
        stage = t % 2
        mbarrier.wait(empty.index(stage), ((t // 2) & 1) ^ 1, pred=t >= 2)
        o_n = t * 64 + gl.arange(0, 64, layout=gl.SliceLayout(1, L))
        pg = gl.load(page_table + o_n).to(gl.int64)
        o_d = gl.arange(0, 512, layout=gl.SliceLayout(0, L))
        async_copy.async_copy_global_to_shared(s_k.index(stage), gl.expand_dims(kv + pg * 576, 1) + gl.expand_dims(o_d, 0))
        async_copy.mbarrier_arrive(full.index(stage), increment_count=False)


@gluon.jit
def _ws_probe_kernel(q, kv, page_table, out, n_tiles, num_warps: gl.constexpr):
    SH: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, 512], gl.bfloat16)
    PS: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, 64], gl.bfloat16)
    s_q = gl.allocate_shared_memory(gl.bfloat16, [64, 512], SH)
    s_k = gl.allocate_shared_memory(gl.bfloat16, [2, 64, 512], SH)  # latent only in this probe: one 64-key tile per warpgroup
    s_p = gl.allocate_shared_memory(gl.bfloat16, [2, 64, 64], PS)
    full = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    pdone = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(full.index(i), count=128)
        mbarrier.init(empty.index(i), count=2)
    for i in gl.static_range(2):
        mbarrier.init(pdone.index(i), count=1)
    gl.warp_specialize([
        (_consumer, (s_q, s_k, s_p, full, empty, pdone, out, n_tiles, 0)),
        (_consumer, (s_q, s_k, s_p, full, empty, pdone, out, n_tiles, 1)),
        (_loader, (s_k, full, empty, kv, page_table, n_tiles)),
    ], [4, 4], [232, 40])


kern = _ws_probe_kernel
sig = {"q": "*bf16", "kv": "*bf16", "page_table": "*i32", "out": "*fp32", "n_tiles": "i32", "num_warps": "constexpr"}
src = GluonASTSource(kern, sig, constexprs={(kern.arg_names.index("num_warps"),): 4},
                     attrs={(kern.arg_names.index(n),): [["tt.divisibility", 16]] for n in ("q", "kv", "page_table", "out")})
ck = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4))
ptx = ck.asm["ptx"]
ptxas = Path(triton.__file__).parent / "backends/nvidia/bin/ptxas"
with tempfile.TemporaryDirectory() as d:
    Path(d, "k.ptx").write_text(ptx)
    r = subprocess.run([str(ptxas), "-v", "--gpu-name=sm_90a", f"{d}/k.ptx", "-o", f"{d}/k.cubin"], capture_output=True, text=True)
print(json.dumps(dict(shared=ck.metadata.shared, 
                      wgmma=sorted(set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+)", ptx))),
                      mbarrier_ops=len(re.findall(r"mbarrier\.", ptx)), cp_async_mbarrier=len(re.findall(r"cp\.async\.mbarrier", ptx)),
                      ptxas=r.stderr.strip()[-300:])))
print("setmaxnreg:", [" ".join(l.split()) for l in ptx.splitlines() if "setmaxnreg" in l])
print("ttgir ws:", [l.strip()[:160] for l in ck.asm["ttgir"].splitlines() if "warp_specialize" in l or "requestedRegisters" in l or "actualRegisters" in l][:4])
