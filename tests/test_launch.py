"""The launch fast path (verify/launch.py): the first launch of a key goes through Triton and keeps
the compiled kernel; later launches of that key call it directly with the same arguments Triton
would pass; another key, a launch hook or the interpreter go through Triton. On the GPU: the fast
path gives bitwise the result of the normal launch, for every kernel this device runs."""

import math

import pytest
import torch

from conftest import DEVICE, requires_cuda
from kdtree_engine.testing import CaseSpec, build_case, random_tree


class FakeCompiled:
    packed_metadata = "meta"
    function = "fn"

    def __init__(self):
        self.calls = []

    def run(self, *a):
        self.calls.append(a)


class FakeJit:
    arg_names = ["x", "n", "scale", "C", "D"]

    def __init__(self):
        self.launches, self.warmups = [], []
        self.compiled = FakeCompiled()

    def __getitem__(self, grid):
        def run(*args, **kw):
            self.launches.append((grid, args, kw))
            return self.compiled
        return run

    def warmup(self, *args, grid, **kw):
        self.warmups.append((grid, args, kw))
        return self.compiled


@pytest.fixture
def fake_cuda(monkeypatch):
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 0, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda d: 1234, raising=False)


def test_second_launch_of_a_key_calls_the_compiled_kernel(fake_cuda):
    from kdtree_engine.verify.launch import Launcher, spec_key

    fn = FakeJit()
    launch = Launcher(fn)
    x = torch.zeros(8)
    key = (spec_key((x,), (3,)), 7)
    launch(key, (2,), (x, 3, 0.5), dict(C=7, D=1, num_warps=4))
    assert len(fn.launches) == 1 and not fn.compiled.calls
    launch(key, (2, 3), (x, 3, 0.25), dict(C=7, D=1, num_warps=4))
    assert len(fn.launches) == 1
    assert fn.compiled.calls == [(2, 3, 1, 1234, "fn", "meta", None, None, None, x, 3, 0.25, 7, 1)]
    # another key (an integer argument changed): through Triton again
    launch((spec_key((x,), (4,)), 7), (2,), (x, 4, 0.5), dict(C=7, D=1, num_warps=4))
    assert len(fn.launches) == 2 and len(fn.compiled.calls) == 1


def test_prepared_launch_passes_data_pointers_on_the_current_stream(fake_cuda, monkeypatch):
    """A Launch: the first call through Triton with the call's tensors; later calls hand the kept
    kernel the per-call data pointers in the picked places, the fixed tensors as their pointers,
    the stream read on each call."""
    from kdtree_engine.verify.launch import Launch, Launcher

    fn = FakeJit()
    fn.arg_names = ["h", "a", "b", "t", "n", "C", "D"]
    h, t = torch.zeros(4), torch.zeros(2)
    x, y = torch.zeros(8), torch.ones(8)
    launch = Launch(Launcher(fn), "k", (5, 2), (h,), (1, 0), (t, 3), dict(C=7, D=1, num_warps=4))
    launch((x, y), (11, 22))
    assert len(fn.launches) == 1 and not fn.compiled.calls
    grid, args, kw = fn.launches[0]
    assert grid == (5, 2) and args[0] is h and args[1] is y and args[2] is x and args[3:] == (t, 3)
    launch((x, y), (11, 22))
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda d: 99, raising=False)
    launch((x, y), (33, 44))
    assert len(fn.launches) == 1
    meta = ("fn", "meta", None, None, None)
    assert fn.compiled.calls == [(5, 2, 1, 1234, *meta, h.data_ptr(), 22, 11, t.data_ptr(), 3, 7, 1),
                                 (5, 2, 1, 99, *meta, h.data_ptr(), 44, 33, t.data_ptr(), 3, 7, 1)]


def test_prepared_launch_returns_its_site_for_the_next(fake_cuda, monkeypatch):
    """A call through the kept kernel returns the (device, stream) it read; a call given a site
    launches there without reading them (nor the hooks); a call through Triton returns None."""
    from kdtree_engine.verify.launch import Launch, Launcher

    fn = FakeJit()
    fn.arg_names = ["a", "n", "C", "D"]
    x = torch.zeros(8)
    launch = Launch(Launcher(fn), "k", (1,), (), (0,), (3,), dict(C=7, D=1))
    assert launch((x,), (11,)) is None
    assert launch((x,), (11,)) == (0, 1234)

    def unread(*a):
        raise AssertionError("read with a site given")

    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", unread, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_getDevice", unread, raising=False)
    assert launch((x,), (22,), (0, 55)) == (0, 55)
    assert fn.compiled.calls[-1] == (1, 1, 1, 55, "fn", "meta", None, None, None, 22, 3, 7, 1)


def test_planned_launch_reads_its_site_once(fake_cuda, monkeypatch):
    """The kernel and the combine of a PlannedLaunch read the device and the stream once between
    them, or not at all when given the site of the launch before (an unplanned call's scheduler)."""
    from kdtree_engine.verify.combine import PlannedLaunch
    from kdtree_engine.verify.launch import Launch, Launcher

    reads = []
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda d: reads.append(d) or 1234, raising=False)
    fns = [FakeJit(), FakeJit()]
    for fn in fns:
        fn.arg_names = ["a", "n", "C", "D"]
    main, merge = (Launch(Launcher(fn), k, (1,), (), (0,), (3,), dict(C=7, D=1)) for fn, k in zip(fns, "mc"))
    planned = PlannedLaunch(None, main, merge, cuda=False)
    x = torch.zeros(8)
    planned((x,), (11,), 1)  # through Triton: each compiles and keeps its kernel
    reads.clear()
    planned((x,), (11,), 1)
    assert reads == [0]
    planned((x,), (11,), 1, (0, 55))
    assert reads == [0]
    assert [fn.compiled.calls[-1][3] for fn in fns] == [55, 55]


def test_warmup_compiles_and_keeps_without_launching(fake_cuda, monkeypatch):
    """A warmed-up Launch's first call runs the kept kernel: no launch through Triton, no compile."""
    from kdtree_engine.verify import launch as launch_module
    from kdtree_engine.verify.launch import Launch, Launcher

    monkeypatch.setattr(launch_module, "interpreting", lambda: False)
    fn = FakeJit()
    fn.arg_names = ["a", "n", "C", "D"]
    launch = Launch(Launcher(fn), "k", (2,), (), (0,), (3,), dict(C=7, D=1))
    x = torch.zeros(8)
    launch.warmup((x,))
    assert fn.warmups == [((2,), (x, 3), dict(C=7, D=1))] and not fn.launches and not fn.compiled.calls
    launch((x,), (11,))
    assert not fn.launches and fn.compiled.calls == [(2, 1, 1, 1234, "fn", "meta", None, None, None, x, 3, 7, 1)]


def test_warmup_under_the_interpreter_does_nothing(fake_cuda, monkeypatch):
    from kdtree_engine.verify import launch as launch_module
    from kdtree_engine.verify.launch import Launcher

    monkeypatch.setattr(launch_module, "interpreting", lambda: True)
    fn = FakeJit()
    launcher = Launcher(fn)
    launcher.warmup("k", (1,), (torch.zeros(4), 1, 1.0), dict(C=1, D=2))
    assert not fn.warmups and launcher.kept("k") is None


@pytest.mark.parametrize("num_groups, form", [(None, "fused"), (0, "fused"), (2, "fused"), (3, "split+merge")])
def test_planned_launch_merges_in_the_kernel_up_to_its_limit(fake_cuda, num_groups, form):
    """With both forms prepared, a call whose host plan split at most ``max_fused_groups`` row
    blocks (or a device plan: the count unknown) runs the fused kernel alone, a call that split more
    the split kernel then the combine; with the fused form alone, every call runs it; without it,
    the combine follows unless the host knows nothing was split."""
    from kdtree_engine.verify.combine import PlannedLaunch
    from kdtree_engine.verify.launch import Launch, Launcher

    fns = {name: FakeJit() for name in ("fused", "split", "merge")}
    launches = {}
    for name, fn in fns.items():
        fn.arg_names = ["a", "n", "C", "D"]
        launches[name] = Launch(Launcher(fn), name, (1,), (), (0,), (3,), dict(C=7, D=1))
    x = torch.zeros(8)

    def ran(planned) -> str:
        for fn in fns.values():
            fn.launches.clear()
            fn.compiled.calls.clear()
        planned((x,), (11,), num_groups)
        return "+".join(name for name, fn in fns.items() if fn.launches or fn.compiled.calls)

    assert ran(PlannedLaunch(launches["fused"], launches["split"], launches["merge"], False, 2)) == form
    assert ran(PlannedLaunch(launches["fused"], None, None, True)) == "fused"
    assert ran(PlannedLaunch(None, launches["split"], launches["merge"], False)) == (
        "split" if num_groups == 0 else "split+merge")


def test_key_tells_alignment_and_dtype():
    from kdtree_engine.verify.launch import spec_key

    x = torch.zeros(16, dtype=torch.float16)
    assert spec_key((x,), ()) != spec_key((x[1:],), ())  # 2-byte offset: not 16-byte aligned
    assert spec_key((x,), ()) == spec_key((x[8:],), ())  # 16-byte offset
    assert spec_key((x,), ()) != spec_key((x.view(torch.bfloat16),), ())


def test_launch_hook_and_interpreter_take_the_normal_path(fake_cuda, monkeypatch):
    from triton import knobs

    from kdtree_engine.verify.launch import Launcher

    fn = FakeJit()
    launch = Launcher(fn)
    args = (torch.zeros(4), 1, 1.0)
    launch("k", (1,), args, dict(C=1, D=2))
    monkeypatch.setattr(knobs.runtime, "launch_enter_hook", lambda *a: None)
    launch("k", (1,), args, dict(C=1, D=2))
    assert len(fn.launches) == 2 and not fn.compiled.calls
    fn.compiled = None  # what the interpreter returns: nothing kept
    interp = Launcher(fn)
    interp("k", (1,), args, dict(C=1, D=2))
    assert not interp._compiled


@requires_cuda
@pytest.mark.parametrize("kernel", ["naive", "flash", "hopper"])
def test_fast_path_is_bitwise_the_normal_launch(kernel, monkeypatch):
    """The same call twice: the first through Triton (compiling if needed, keeping the kernel),
    the second through the kept kernel (Triton's launcher is made to fail, so it must not be
    used); outputs bitwise equal, split KV included."""
    from kdtree_engine import VerifyAttention
    from kdtree_engine.verify import combine, hopper, triton_flash, triton_naive
    from kdtree_engine.verify.op import available_kernels

    if kernel not in available_kernels(DEVICE):
        pytest.skip(f"{kernel} does not run on this device")
    g = torch.Generator().manual_seed(5)
    c = build_case(CaseSpec("fast", 16, [3000, 40], [random_tree(9, g), random_tree(20, g)], page_size=1, seed=11),
                   DEVICE)
    attn = VerifyAttention(2, 20, 16, DEVICE, kernel=kernel)
    attn.plan(c["kv_lens"].cpu(), c["qo_indptr"].cpu())
    args = (c["q"], c["kv_cache"], c["page_table"], c["tree_mask"])
    T = c["q"].shape[0]
    outs = []
    for _ in range(2):
        out = torch.full((T, 16, 512), math.nan, dtype=torch.bfloat16, device=DEVICE)
        lse = torch.full((T, 16), math.nan, dtype=torch.float32, device=DEVICE)
        attn.run(*args, out=out, lse=lse)
        torch.cuda.synchronize()
        outs.append((out, lse))

        class Refuse:
            def __getitem__(self, grid):
                raise AssertionError("launched through Triton, not the kept kernel")
        for mod, name in ((triton_naive, "_NAIVE"), (triton_flash, "_FLASH"), (hopper, "_HOPPER"),
                          (combine, "_COMBINE")):
            if getattr(mod, name) is not None:
                monkeypatch.setattr(getattr(mod, name), "fn", Refuse())
    assert attn.workspace.num_groups > 0 or kernel == "naive"
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
