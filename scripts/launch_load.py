"""Host cost of a launch (an empty kernel, and a planned verify call at 1x16x9x1024) while the GPU is
idle, sleeping, copying or multiplying (run 32: why the bench's host column reads more at long shapes).

    PYTHONPATH=src python3 scripts/launch_load.py
"""
import time
import torch
import triton
from kdtree_engine import VerifyAttention
from kdtree_engine.bench.shapes import Shape, build_case
from kdtree_engine.verify.launch import current_device, current_stream

@triton.jit
def _empty(x):
    pass

x = torch.zeros(16, device="cuda")
k = _empty[(1,)](x)
def empty():
    k.run(1, 1, 1, current_stream(current_device()), k.function, k.packed_metadata, None, None, None, x.data_ptr())

sh = Shape(batch=1, q_len=9, heads=16, prefix=1024, page_size=64, tree="chain")
case = build_case(sh, "cuda", n_sets=1)
attn = VerifyAttention(1, 9, 16, case.device, kernel="hopper")
attn.plan(case.kv_lens_host, case.qo_indptr_host)
s = case.sets[0]
def planned():
    attn.run(s.q, s.kv_cache, case.page_table, case.tree_mask, out=s.out, lse=s.lse)

big_a = torch.empty(2**29, dtype=torch.bfloat16, device="cuda")  # 1 GiB
big_b = torch.empty_like(big_a)
ma = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
busy = {
    "idle": lambda: None,
    "sleep 20ms": lambda: torch.cuda._sleep(int(20e-3 * 1.98e9)),
    "copy 1GiB x8": lambda: [big_b.copy_(big_a) for _ in range(8)],
    "matmul 8k x12": lambda: [ma @ ma for _ in range(12)],
}
for name, fn in (("empty kernel", empty), ("planned run 1x16x9x1024", planned)):
    for _ in range(50):
        fn()
    for cond, before in busy.items():
        ts = []
        for _ in range(20):
            torch.cuda.synchronize()
            before()
            t0 = time.perf_counter()
            for _ in range(16):
                fn()
            ts.append((time.perf_counter() - t0) * 1e6 / 16)
        torch.cuda.synchronize()
        ts.sort()
        print(f"{name:>24} | GPU {cond:>14}: min {ts[0]:5.1f} median {ts[len(ts)//2]:5.1f} us per call", flush=True)
