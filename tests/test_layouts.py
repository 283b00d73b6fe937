"""Every tensor argument of verify_attention (and of VerifyAttention.run) in every layout a caller can produce.

Each argument is handed in holding the right values in another layout (column-major, a step
slice, a slice of a wider buffer, a broadcast with zero strides); the result must equal the
float64 reference, or the call must refuse the layout with an error naming the argument. Memory
around a strided view holds poison (NaN / out-of-range ids), so a kernel that ignores a stride
reads garbage and fails loudly instead of passing by luck.
"""

import pytest
import torch

from conftest import DEVICE
from kdtree_engine import VerifyAttention, reference, verify_attention
from kdtree_engine.testing import TOLERANCES, CaseSpec, build_case, compare, random_tree
from kdtree_engine.verify import available_kernels

# the opt-in CUDA kernel where it runs (an sm_90 GPU with nvcc); "auto" runs the Gluon kernel on Hopper
KERNELS = ("naive", "flash", pytest.param("hopper_cuda", marks=pytest.mark.skipif(
    "hopper_cuda" not in available_kernels(DEVICE, opt_in=True), reason="hopper_cuda does not run here")))
ARGS = ("q", "kv_cache", "page_table", "kv_lens", "qo_indptr", "tree_mask")


def _poison(dtype: torch.dtype):
    return float("nan") if dtype.is_floating_point else -(2**30)


def relayout(x: torch.Tensor, layout: str) -> torch.Tensor:
    """``x``'s values in another layout; memory outside the view holds poison."""
    if layout == "transposed":  # the first two dims swapped in memory (column-major for 2-D)
        if x.dim() < 2:
            return None
        return x.transpose(0, 1).contiguous().transpose(0, 1)
    if layout == "step":  # every other row of a buffer twice as long
        buf = torch.full((2 * x.shape[0],) + tuple(x.shape[1:]), _poison(x.dtype), dtype=x.dtype, device=x.device)
        buf[::2] = x
        return buf[::2]
    if layout == "wide":  # a slice at an offset, inside a wider buffer (rows of larger stride)
        if x.dim() == 1:
            buf = torch.full((x.shape[0] + 5,), _poison(x.dtype), dtype=x.dtype, device=x.device)
            buf[3 : 3 + x.shape[0]] = x
            return buf[3 : 3 + x.shape[0]]
        dim = 1  # pad dim 1: dim 0 gets a larger stride (the last dim of a 3-D tensor stays contiguous)
        shape = list(x.shape)
        shape[dim] += 3
        buf = torch.full(shape, _poison(x.dtype), dtype=x.dtype, device=x.device)
        view = buf.narrow(dim, 2, x.shape[dim])
        view.copy_(x)
        return view
    raise AssertionError(layout)


CASES = {
    # the reproduction: B=2, H=2, prefix 7, trees of 3 and 2 nodes, page size 1
    "issue": CaseSpec("issue", 2, [7, 7], [[-1, 0, 0], [-1, 0]], page_size=1, seed=11),
    # pages of 3 and a 35-node tree: mask words past the first are read (the mask's column stride
    # matters), with a spare word per row
    "wide_tree": CaseSpec("wide_tree", 2, [7, 4], [[-1, 0, 0], random_tree(35, torch.Generator().manual_seed(3))],
                          page_size=3, seed=12, extra_mask_words=1),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request):
    spec = CASES[request.param]
    c = build_case(spec, DEVICE)
    ref_out, ref_lse = reference(**{k: v.cpu() for k, v in c.items()})
    return c, ref_out, ref_lse


def check_against_reference(out, lse, ref_out, ref_lse, dtype="bf16"):
    tol = TOLERANCES[dtype]
    r = compare(out, ref_out, *tol["out"])
    assert r.ok, f"out: {r} {r.detail}"
    r = compare(lse, ref_lse, *tol["lse"])
    assert r.ok, f"lse: {r} {r.detail}"


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("layout", ("transposed", "step", "wide"))
@pytest.mark.parametrize("arg", ARGS)
def test_input_layout(case, arg, layout, kernel):
    c, ref_out, ref_lse = case
    x = relayout(c[arg], layout)
    if x is None or (x.stride(), x.storage_offset()) == (c[arg].stride(), c[arg].storage_offset()):
        pytest.skip(f"{arg} of shape {tuple(c[arg].shape)} has no distinct {layout} layout")
    torch.testing.assert_close(x, c[arg], rtol=0, atol=0, equal_nan=True)  # same values, other memory
    args = dict(c, **{arg: x})
    out, lse = verify_attention(**args, kernel=kernel, validate=True)
    check_against_reference(out, lse, ref_out, ref_lse)


@pytest.mark.parametrize("kernel", KERNELS)
def test_broadcast_inputs(kernel):
    """Two sequences sharing one page table row, length, q and an all-visible mask row (zero strides)."""
    spec = CaseSpec("shared", 3, [5], [[-1, 0, 0]], page_size=2, seed=5)
    c = build_case(spec, DEVICE)
    n = 3
    q = c["q"][:1].expand(2 * n, -1, -1)  # every node the same query (zero row stride)
    page_table = c["page_table"].expand(2, -1)
    kv_lens = c["kv_lens"].expand(2)
    qo_indptr = torch.tensor([0, n, 2 * n], dtype=torch.int32, device=DEVICE)
    tree_mask = torch.full((1, 1), (1 << n) - 1, dtype=torch.int32, device=DEVICE).expand(2 * n, 1)
    args = dict(q=q, kv_cache=c["kv_cache"], page_table=page_table, kv_lens=kv_lens,
                qo_indptr=qo_indptr, tree_mask=tree_mask)
    ref_out, ref_lse = reference(**{k: v.cpu().contiguous() for k, v in args.items()})
    out, lse = verify_attention(**args, kernel=kernel, validate=True)
    check_against_reference(out, lse, ref_out, ref_lse)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("layout", ("transposed", "step", "wide"))
def test_output_layout(case, layout, kernel):
    """A strided out / lse is written where the caller reads it, and nowhere else in its buffer."""
    c, ref_out, ref_lse = case
    T, H = c["q"].shape[:2]
    out = relayout(torch.zeros(T, H, 512, dtype=c["q"].dtype, device=DEVICE), layout)
    lse = relayout(torch.zeros(T, H, dtype=torch.float32, device=DEVICE), layout)
    out.fill_(float("nan"))
    lse.fill_(float("nan"))
    out_base, lse_base = out._base, lse._base
    got_out, got_lse = verify_attention(**c, kernel=kernel, out=out, lse=lse)
    assert got_out is out and got_lse is lse
    check_against_reference(out, lse, ref_out, ref_lse)
    for base, view in ((out_base, out), (lse_base, lse)):
        if base is None:
            continue
        outside = torch.ones(base.shape, dtype=torch.bool, device=DEVICE)
        outside.as_strided(view.shape, view.stride(), view.storage_offset()).fill_(False)
        assert torch.isnan(base[outside]).all(), "the kernel wrote outside the output view"


@pytest.mark.parametrize(
    "name, make, match",
    [
        ("out", lambda T, H, dt: torch.empty(1, H, 512, dtype=dt, device=DEVICE).expand(T, H, 512), "out has overlapping"),
        ("out", lambda T, H, dt: torch.empty(T, 1, 512, dtype=dt, device=DEVICE).expand(T, H, 512), "out has overlapping"),
        ("out", lambda T, H, dt: torch.empty(T, H, 1024, dtype=dt, device=DEVICE)[..., ::2], "out must be contiguous in its last"),
        ("out", lambda T, H, dt: torch.empty(T * H * 256 + 256, dtype=dt, device=DEVICE).as_strided((T, H, 512), (H * 256, 256, 1)),
         "out has overlapping"),
        ("lse", lambda T, H, dt: torch.empty(T, 1, device=DEVICE).expand(T, H), "lse has overlapping"),
        ("lse", lambda T, H, dt: torch.empty(1, device=DEVICE).expand(T, H), "lse has overlapping"),
    ],
)
def test_overlapping_outputs_refused(case, name, make, match):
    c, _, _ = case
    T, H = c["q"].shape[:2]
    with pytest.raises(ValueError, match=match):
        verify_attention(**c, **{name: make(T, H, c["q"].dtype)})


def test_output_aliasing_an_input_refused(case):
    c, _, _ = case
    T, H = c["q"].shape[:2]
    q = c["q"].clone()
    out = q[..., :512]  # the caller's q buffer
    with pytest.raises(ValueError, match="out overlaps q"):
        verify_attention(**dict(c, q=q), out=out)
    out = torch.empty(T, H, 512, dtype=q.dtype, device=DEVICE)
    lse = out.view(torch.float32)[:, :, 0]  # [T, H] float32 inside out's memory
    with pytest.raises(ValueError, match="lse overlaps out"):
        verify_attention(**c, out=out, lse=lse)


@pytest.mark.parametrize("layout", ("transposed", "step", "wide"))
@pytest.mark.parametrize("arg", ("q", "kv_cache", "page_table", "tree_mask"))
def test_plan_run_input_layout(case, arg, layout):
    """VerifyAttention.run honours the same layouts (its lengths come from the host plan)."""
    c, ref_out, ref_lse = case
    x = relayout(c[arg], layout)
    if x is None or (x.stride(), x.storage_offset()) == (c[arg].stride(), c[arg].storage_offset()):
        pytest.skip(f"{arg} of shape {tuple(c[arg].shape)} has no distinct {layout} layout")
    B = c["kv_lens"].shape[0]
    attn = VerifyAttention(B, 64, c["q"].shape[1], DEVICE)
    attn.plan(c["kv_lens"].cpu(), c["qo_indptr"].cpu())
    args = {k: c[k] for k in ("q", "kv_cache", "page_table", "tree_mask")}
    args[arg] = x
    out, lse = attn.run(**args)
    check_against_reference(out, lse, ref_out, ref_lse)
