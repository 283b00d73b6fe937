"""Test-case construction and the one compare helper, shared by tests, golden bundles and benchmarks.

A :class:`CaseSpec` describes a verify batch (heads, per-sequence prefix and tree, paging, dtype,
seed); :func:`build_case` turns it into the contract's tensors, deterministically from the seed.
Unused cache slots are poisoned with NaN and pages are permuted, so a kernel that reads outside
its sequence or lets a masked-out value through fails.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import numpy as np
import torch

from .masks import concat_tree_masks, mask_words, tree_mask_from_parents
from .verify.contract import D_QK
from .verify.plan import device_parts, programs_with_work, rounds_apply, schedule, whole_segments_apply

__all__ = [
    "CaseSpec",
    "build_case",
    "random_tree",
    "chain_tree",
    "star_tree",
    "CompareResult",
    "compare",
    "TOLERANCES",
    "device_tables",
]

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}

# (atol, rtol) for out and lse per input dtype. Out is rounded to the input dtype and P goes through
# a 16-bit dot in the flash kernel; lse is fp32 throughout.
TOLERANCES = {
    "bf16": {"out": (1e-2, 2e-2), "lse": (2e-3, 1e-4)},
    "fp16": {"out": (2e-3, 5e-3), "lse": (2e-3, 1e-4)},
}


def random_tree(n: int, gen: torch.Generator, shuffle: bool = True) -> list[int]:
    """Parent array of a random ``n``-node tree (root's parent -1); node order shuffled if asked."""
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, n)]
    if not shuffle or n == 1:
        return parents
    perm = torch.randperm(n, generator=gen).tolist()  # old index -> new index
    new = [0] * n
    for old, p in enumerate(parents):
        new[perm[old]] = -1 if p < 0 else perm[p]
    return new


def chain_tree(n: int) -> list[int]:
    """A chain: node i's parent is i-1 (depth n-1)."""
    return [i - 1 for i in range(n)]


def star_tree(n: int) -> list[int]:
    """A star: the root and n-1 children."""
    return [-1] + [0] * (n - 1)


@dataclass
class CaseSpec:
    """One verify batch. ``trees[b]`` is sequence b's parent array; its KV length is
    ``prefix_lens[b] + len(trees[b])``."""

    name: str
    num_heads: int
    prefix_lens: list[int]
    trees: list[list[int]]
    page_size: int = 1
    dtype: str = "bf16"
    seed: int = 0
    scatter: bool = True  # permute the pages of the pool
    spare_pages: int = 3  # pool pages no sequence uses (poisoned)
    q_scale: float = 2.0  # q ~ N(0, q_scale^2): peakier softmax than N(0, 1)
    extra_mask_words: int = 0  # wider tree_mask than needed
    sm_scale: float = field(default=1.0 / math.sqrt(D_QK))

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def kv_lens(self) -> list[int]:
        return [p + len(t) for p, t in zip(self.prefix_lens, self.trees)]


def build_case(spec: CaseSpec, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """The contract's inputs for ``spec``: q, kv_cache, page_table, kv_lens, qo_indptr, tree_mask.

    Built on the CPU from ``spec.seed`` (bitwise reproducible), then moved to ``device``.
    """
    if len(spec.prefix_lens) != len(spec.trees):
        raise ValueError("prefix_lens and trees must have one entry per sequence")
    gen = torch.Generator().manual_seed(spec.seed)
    dtype = DTYPES[spec.dtype]
    ps = spec.page_size
    kv_lens = spec.kv_lens
    pages_per_seq = [math.ceil(L / ps) for L in kv_lens]
    num_pages = sum(pages_per_seq) + spec.spare_pages
    order = torch.randperm(num_pages, generator=gen) if spec.scatter else torch.arange(num_pages)
    max_pages = max(pages_per_seq)
    page_table = torch.zeros(len(kv_lens), max_pages, dtype=torch.int32)
    kv_cache = torch.full((num_pages, ps, D_QK), float("nan"), dtype=dtype)
    cursor = 0
    for b, (L, np_b) in enumerate(zip(kv_lens, pages_per_seq)):
        pages = order[cursor : cursor + np_b]
        cursor += np_b
        page_table[b, :np_b] = pages.to(torch.int32)
        # never-read table entries point at a poisoned spare page
        page_table[b, np_b:] = int(order[-1])
        rows = torch.randn(L, D_QK, generator=gen).to(dtype)
        pos = torch.arange(L)
        kv_cache[pages[pos // ps], pos % ps] = rows
    T = sum(len(t) for t in spec.trees)
    q = (torch.randn(T, spec.num_heads, D_QK, generator=gen) * spec.q_scale).to(dtype)
    qo_indptr = torch.tensor([0] + [len(t) for t in spec.trees], dtype=torch.int64).cumsum(0).to(torch.int32)
    width = mask_words(max(len(t) for t in spec.trees)) + spec.extra_mask_words
    tree_mask = concat_tree_masks([tree_mask_from_parents(t) for t in spec.trees], words=width)
    tensors = {
        "q": q,
        "kv_cache": kv_cache,
        "page_table": page_table,
        "kv_lens": torch.tensor(kv_lens, dtype=torch.int32),
        "qo_indptr": qo_indptr,
        "tree_mask": tree_mask,
    }
    return {k: v.to(device) for k, v in tensors.items()}


@dataclass
class CompareResult:
    ok: bool
    max_abs: float  # max |actual - expected|
    max_rel: float  # max |actual - expected| / (|expected| + atol)
    worst: tuple  # index of the element furthest outside the tolerance (or of max_abs)
    detail: str

    def __str__(self) -> str:
        return f"max_abs={self.max_abs:.2e} max_rel={self.max_rel:.2e}"


def compare(actual: torch.Tensor, expected: torch.Tensor, atol: float, rtol: float) -> CompareResult:
    """Elementwise ``|actual - expected| <= atol + rtol * |expected|`` in float64.

    NaN and inf must sit at the same positions with the same value (a NaN never passes where the
    expected value is finite). Reports the worst element.
    """
    if actual.shape != expected.shape:
        return CompareResult(False, math.inf, math.inf, (), f"shape {tuple(actual.shape)} != {tuple(expected.shape)}")
    a = actual.detach().to("cpu", torch.float64)
    e = expected.detach().to("cpu", torch.float64)
    finite_e = torch.isfinite(e)
    same_nonfinite = (~finite_e) & ((a == e) | (torch.isnan(a) & torch.isnan(e)))
    diff = torch.where(finite_e, (a - e).abs(), torch.where(same_nonfinite, 0.0, math.inf))
    diff = torch.nan_to_num(diff, nan=math.inf)
    excess = diff - (atol + rtol * torch.where(finite_e, e.abs(), 0.0))
    max_abs = float(diff.max()) if diff.numel() else 0.0
    rel = diff / (torch.where(finite_e, e.abs(), 0.0) + atol)
    max_rel = float(rel.max()) if rel.numel() else 0.0
    if diff.numel() == 0:
        return CompareResult(True, 0.0, 0.0, (), "empty")
    flat = int(excess.argmax())
    worst = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), e.shape))
    ok = bool((excess <= 0).all())
    detail = f"worst at {worst}: actual={float(a[worst]):.6g} expected={float(e[worst]):.6g}"
    return CompareResult(ok, max_abs, max_rel, worst, detail)


def device_tables(plan, kv_lens: np.ndarray, tree_sizes: np.ndarray, schedule_kind: str = "line"):
    """What the device scheduler writes into ``plan`` (a :class:`~kdtree_engine.verify.plan.VerifyPlan`)
    for these lengths (``[B]`` each) and ``schedule_kind``, as the host writes it: the KV parts schedule
    for ``"parts"`` where it applies (every tree of the same row blocks L, 2L at most the programs with
    work, the KV tiles in all fewer than 2**31; with its tail where L does not divide those programs:
    :func:`~kdtree_engine.verify.plan.device_parts`) and for ``"auto"``: the parts alone where they
    also keep nine tenths of those programs busy, with their tail where they keep fewer, the cost
    model has ``lockstep`` and the step holds ``AUTO_TAIL_MIN_TILES`` tile pairs per program (see
    :mod:`~kdtree_engine.verify.scheduler`); the rounds schedule for ``"rounds"`` (and
    ``"auto"`` under a cost model with ``lockstep``) where it applies
    (:func:`~kdtree_engine.verify.plan.rounds_apply`); else the line schedule; ``"auto"`` takes whole
    segments first where the host's plan takes them without pricing (KV columns of one program's share
    make at most one segment per program). ``prog_first_seg [P + 1]``, segments ``[5, S]`` and groups
    ``[4, G]`` (int32 numpy)."""
    R, T = plan.blocks_and_tiles(kv_lens, tree_sizes)
    pe = programs_with_work(R, T, plan.num_programs)
    L = int(R.max())
    from .verify.scheduler import AUTO_TAIL_MIN_TILES, PARTS_MAX_TILES, parts_fill  # (loads Triton)

    parts = (schedule_kind in ("parts", "auto") and int(R.min()) == L and 2 * L <= pe
             and int(T.sum()) < PARTS_MAX_TILES.value)
    tail = schedule_kind == "parts"
    if schedule_kind == "auto" and parts and not parts_fill(L, pe):
        tail = parts = plan.costs.lockstep and int(T.sum()) * L >= AUTO_TAIL_MIN_TILES * pe
    if schedule_kind == "auto" and whole_segments_apply(R, T, plan.num_programs):
        pieces = schedule(R, T, plan.num_programs, costs=plan.costs)  # whole segments, taken without pricing
    elif parts:
        pieces = (device_parts(R, T, plan.num_programs, plan.costs) if tail
                  else schedule(R, T, plan.num_programs, only="parts"))
    elif ((schedule_kind == "rounds" or (schedule_kind == "auto" and plan.costs.lockstep))
          and rounds_apply(R, T, plan.num_programs)):
        pieces = schedule(R, T, plan.num_programs, only="rounds")
    else:
        pieces = schedule(R, T, plan.num_programs, only="line")
    first, seg, tile_end, grp, _ = plan._tables_of(pieces, R)
    seg = seg.copy()
    seg[3] = np.minimum(tile_end, kv_lens[seg[0]])
    return first, seg, grp
