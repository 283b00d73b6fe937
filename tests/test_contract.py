"""verify_attention's input checks: each bad input raises a clear error naming the argument."""

import pytest
import torch

from conftest import DEVICE
from kdtree_engine import verify_attention
from kdtree_engine.testing import CaseSpec, build_case, random_tree


@pytest.fixture
def case():
    gen = torch.Generator().manual_seed(0)
    spec = CaseSpec("c", 2, [5, 0], [random_tree(3, gen), random_tree(2, gen)], page_size=4)
    return build_case(spec, DEVICE)


def call(case, **overrides):
    args = dict(case)
    kw = {k: overrides.pop(k) for k in ("kernel", "out", "lse", "sm_scale", "validate") if k in overrides}
    args.update(overrides)
    return verify_attention(**args, **kw)


@pytest.mark.parametrize(
    "name, make, exc, match",
    [
        ("q", lambda c: c["q"].float(), TypeError, "q must be one of"),
        ("q", lambda c: c["q"][0], ValueError, "q must have 3 dimensions"),
        ("q", lambda c: c["q"][..., :512], ValueError, "q must have last dimension 576"),
        ("q", lambda c: c["q"].new_zeros(0, 2, 576), ValueError, "q has no rows"),
        ("q", lambda c: c["q"].new_zeros(5, 2, 576 * 2)[..., ::2], ValueError, "contiguous"),
        ("q", lambda c: c["q"].new_zeros(5, 129, 576), ValueError, "129 heads"),
        ("kv_cache", lambda c: c["kv_cache"].half(), TypeError, "kv_cache must be torch.bfloat16"),
        ("kv_cache", lambda c: c["kv_cache"][..., :512], ValueError, "kv_cache must have last dimension 576"),
        ("page_table", lambda c: c["page_table"].long(), TypeError, "page_table must be torch.int32"),
        ("page_table", lambda c: c["page_table"][:1], ValueError, "page_table has 1 rows"),
        ("kv_lens", lambda c: c["kv_lens"].long(), TypeError, "kv_lens must be torch.int32"),
        ("kv_lens", lambda c: c["kv_lens"][None], ValueError, "kv_lens must have 1 dimensions"),
        ("qo_indptr", lambda c: c["qo_indptr"][:2], ValueError, "qo_indptr must have B\\+1=3"),
        ("tree_mask", lambda c: c["tree_mask"][:4], ValueError, "tree_mask has 4 rows"),
        ("tree_mask", lambda c: c["tree_mask"].to(torch.int64), TypeError, "tree_mask must be torch.int32"),
    ],
)
def test_bad_argument(case, name, make, exc, match):
    with pytest.raises(exc, match=match):
        call(case, **{name: make(case)})


def test_bad_options(case):
    with pytest.raises(ValueError, match="kernel must be one of"):
        call(case, kernel="fast")
    with pytest.raises(ValueError, match="sm_scale"):
        call(case, sm_scale=-1.0)
    with pytest.raises(ValueError, match="sm_scale"):
        call(case, sm_scale=float("nan"))
    with pytest.raises(ValueError, match="sm_scale"):
        call(case, sm_scale=10**400)  # past float's range (it raised OverflowError)
    with pytest.raises(ValueError, match="sm_scale"):
        call(case, sm_scale=1e39)  # a float64 past float32's: the kernels' scale was inf
    with pytest.raises(ValueError, match="sm_scale"):
        call(case, sm_scale=True)
    with pytest.raises(ValueError, match="out must have shape"):
        call(case, out=torch.empty(5, 3, 512, dtype=torch.bfloat16, device=DEVICE))
    with pytest.raises(TypeError, match="out must be torch.bfloat16"):
        call(case, out=torch.empty(5, 2, 512, dtype=torch.float16, device=DEVICE))
    with pytest.raises(TypeError, match="lse must be torch.float32"):
        call(case, lse=torch.empty(5, 2, dtype=torch.float64, device=DEVICE))


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda c: c["page_table"].__setitem__((0, 1), 99), "page_table\\[0, 1\\]=99 is outside"),
        (lambda c: c["page_table"].__setitem__((1, 0), -1), "page_table\\[1, 0\\]=-1 is outside"),
        (lambda c: c["kv_lens"].__setitem__(1, 1), "kv_lens\\[1\\]=1 is shorter than its tree"),
        (lambda c: c["kv_lens"].__setitem__(0, 50), "exceeds page_table capacity"),
        (lambda c: c["qo_indptr"].__setitem__(1, 0), "no tree node"),
        (lambda c: c["qo_indptr"].__setitem__(2, 4), "end at T=5"),
        (lambda c: c["tree_mask"].__setitem__((1, 0), 0), "row 1 does not set its own bit"),
        (lambda c: c["tree_mask"].__setitem__((4, 0), 7), "row 4 sets a bit at or past its tree size n_b=2"),
    ],
)
def test_content_checks(case, edit, match):
    edit(case)
    with pytest.raises(ValueError, match=match):
        call(case, kernel="naive", validate=True)


def test_content_checks_can_be_skipped(case):
    """validate=False skips the content checks (the caller vouches for the inputs)."""
    case["tree_mask"][4, 0] |= 1 << 5  # stray bit past n_b: harmless to the kernels
    with pytest.raises(ValueError):
        call(case, kernel="naive", validate=True)
    call(case, kernel="naive", validate=False)


def test_mask_too_narrow():
    spec = CaseSpec("n", 1, [0], [list(range(-1, 39))], page_size=1)
    c = build_case(spec, DEVICE)
    c["tree_mask"] = c["tree_mask"][:, :1].contiguous()
    # on the CPU the flash path plans from host lengths, so it checks them without being asked; on
    # a GPU the device scheduler plans from the device lengths (no sync): checked when asked
    validate = None if DEVICE == "cpu" else True
    for kernel in ("flash", "auto"):
        with pytest.raises(ValueError, match="too narrow for a tree of 40 nodes"):
            verify_attention(**c, kernel=kernel, validate=validate)
    with pytest.raises(ValueError, match="too narrow for a tree of 40 nodes"):
        verify_attention(**c, kernel="naive", validate=True)


def test_cpu_without_interpreter_is_refused(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    c = build_case(CaseSpec("cpu", 2, [3], [[-1, 0]]), "cpu")
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        verify_attention(**c)


@pytest.mark.skipif(DEVICE != "cuda", reason="device mismatch needs a second device")
def test_device_mismatch(case):
    with pytest.raises(ValueError, match="kv_lens is on cpu"):
        call(case, kv_lens=case["kv_lens"].cpu())


def test_input_check_cache_keeps_the_per_call_checks(case):
    """A signature seen before skips the layout checks (the same Signature object comes back) but
    never the overlap checks, which read addresses; another layout of the same shapes (a
    transposed page table) is another signature, checked in full."""
    from kdtree_engine.verify.contract import InputCheck

    check = InputCheck()
    T, H = case["q"].shape[:2]
    inputs = [case[k] for k in ("q", "kv_cache", "page_table", "kv_lens", "qo_indptr", "tree_mask")]
    buf = torch.zeros(T * H * 256 + T * H, dtype=torch.float32, device=DEVICE)
    out = buf[: T * H * 256].view(torch.bfloat16).view(T, H, 512)
    lse = buf[T * H * 256 :].view(T, H)
    sig, ptrs = check(*inputs, out, lse)
    assert check(*inputs, out, lse)[0] is sig and ptrs[6:] == (out.data_ptr(), lse.data_ptr())
    with pytest.raises(ValueError, match="lse overlaps out"):
        check(*inputs, out, buf[: T * H].view(T, H))  # the same signature, another address
    page_table = inputs[2].t().contiguous().t()
    assert page_table.stride() != inputs[2].stride()
    other, _ = check(*inputs[:2], page_table, *inputs[3:], out, lse)
    assert other is not sig and other.info == sig.info
    with pytest.raises(TypeError, match="tree_mask must be a torch.Tensor"):
        check(*inputs[:5], inputs[5].tolist(), out, lse)


def test_plan_of_other_lengths_or_type_is_refused(case):
    """A plan made for other lengths is refused wherever the call's lengths are read anyway (CPU
    tensors; validate=True): it ran the kernel on the plan's segments with the call's lengths
    (wrong values, unwritten rows, or reads past a page table sized for the call's lengths); a plan
    that is no VerifyPlan is a TypeError, not an AttributeError."""
    from kdtree_engine import VerifyAttention, plan_verify

    validate = None if DEVICE == "cpu" else True
    other = plan_verify([6, 2], [0, 3, 5], 2, DEVICE)
    with pytest.raises(ValueError, match="not the lengths the plan was made for"):
        verify_attention(**case, kernel="flash", plan=other, validate=validate)
    same = plan_verify(case["kv_lens"].cpu(), case["qo_indptr"].cpu(), 2, DEVICE)
    verify_attention(**case, kernel="flash", plan=same, validate=validate)
    attn = VerifyAttention(2, 3, 2, DEVICE)
    with pytest.raises(TypeError, match="plan must be a VerifyPlan.*call its run"):
        verify_attention(**case, plan=attn)
    with pytest.raises(TypeError, match="plan must be a VerifyPlan"):
        verify_attention(**case, plan="x")


@pytest.mark.parametrize("kv_lens, qo_indptr, exc, match", [
    ([8.5, 2], [0, 3, 5], TypeError, "kv_lens must hold integers"),
    ([8, 2], [0.0, 3, 5], TypeError, "qo_indptr must hold integers"),
    ([2**32 + 8, 2], [0, 3, 5], ValueError, "past the kernels' int32 positions"),
])
def test_host_lengths_must_be_int32_integers(kv_lens, qo_indptr, exc, match):
    """Host lengths that are not integers, or past int32, were truncated or wrapped into the
    plan's int32 buffers (2**32 + 8 planned as 8)."""
    from kdtree_engine import VerifyAttention

    with pytest.raises(exc, match=match):
        VerifyAttention(2, 3, 2, DEVICE).plan(kv_lens, qo_indptr)
