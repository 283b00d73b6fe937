"""Benchmark shapes: presets, the work of one call (FLOPs, bytes, roofline floor), memory
estimates, and the input builder (random data made directly on the device).

A :class:`Shape` is one verify call: ``batch`` sequences, each with ``prefix`` committed tokens and
a random draft tree of ``q_len`` nodes, ``heads`` query heads, a KV pool of ``page_size``-token
pages, ``dtype`` inputs. Every sequence of a shape has the same prefix and tree size (the trees
differ).

Work of one call (docs/benchmark.md, "The problem in numbers"), summed over the B sequences:

- FLOPs = 2 * n * H * (P + n) * (576 + 512)
- bytes >= (P + n) * 1152 (the KV, read once) + T*H*576*2 (q) + T*H*512*2 (out) + T*H*4 (lse)
- floor = max(FLOPs / matmul ceiling, bytes / copy ceiling); "% of floor" = floor / measured.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import asdict, dataclass, field

import torch

from ..masks import ancestor_matrix, concat_tree_masks, pack_tree_mask
from ..testing import chain_tree, random_tree
from ..verify.contract import D_QK, D_V

__all__ = [
    "Shape",
    "BenchCase",
    "InputSet",
    "DTYPES",
    "DEFAULT_PREFIXES",
    "LONG_PREFIXES",
    "PRESETS",
    "BASE",
    "preset_shapes",
    "cartesian_shapes",
    "build_case",
    "case_bytes",
    "choose_sets",
]

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
TREES = ("random", "chain")
ELEM = 2  # bytes per bf16/fp16 element
TOKEN_BYTES = D_QK * ELEM  # one cached token: 1152 bytes

DEFAULT_PREFIXES = (0, 256, 1024, 4096, 16384)
LONG_PREFIXES = (32768, 65536, 131072, 200000)
QUICK_PREFIXES = (0, 1024, 4096, 16384)
SWEEP_PREFIX = 4096  # where the one-axis-at-a-time sweeps sit

# The axis values of the issue text (what `--batch all` etc. would mean) and the base shape that
# the one-axis-at-a-time sweeps move away from: Kimi K2 at TP1 (64 heads), a 33-node tree, one
# sequence, page size 1 with scattered slots, bf16.
AXES = {
    "batch": (1, 2, 4, 8, 16),
    "q_len": (9, 17, 33, 65),
    "heads": (8, 16, 64, 128),
    "page_size": (1, 64),
}
BASE = {"batch": 1, "q_len": 33, "heads": 64, "page_size": 1, "dtype": "bf16"}

ISSUE3_GRID = {
    "heads": (16, 64, 128),
    "q_len": (9, 33, 65),
    "batch": (1, 4, 16),
    "prefix": (1024, 4096, 16384, 65536, 131072),
    "page_size": (1,),
}

# the 48 shapes FlashMLA was measured on (docs/perf_log.md): chain trees there are its causal mask
ISSUE11_GRID = {
    "heads": (16, 64, 128),
    "q_len": (9, 33),
    "batch": (1, 4),
    "prefix": (4096, 16384, 65536, 131072),
}

PRESETS = ("tiny", "quick", "default", "issue3", "issue11")


@dataclass(frozen=True, order=True)
class Shape:
    """One verify call (see the module docstring)."""

    batch: int
    q_len: int
    heads: int
    prefix: int
    page_size: int = 1
    dtype: str = "bf16"
    tree: str = "random"  # "random" (shuffled node order) or "chain" (in order: FlashMLA's causal mask)

    def __post_init__(self):
        if self.batch < 1 or self.q_len < 1 or self.heads < 1 or self.prefix < 0 or self.page_size < 1:
            raise ValueError(f"invalid shape {self}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.tree not in TREES:
            raise ValueError(f"tree must be one of {TREES}, got {self.tree!r}")

    @property
    def kv_len(self) -> int:
        return self.prefix + self.q_len

    @property
    def rows(self) -> int:  # T
        return self.batch * self.q_len

    @property
    def pages_per_seq(self) -> int:
        return math.ceil(self.kv_len / self.page_size)

    @property
    def flops(self) -> int:
        return 2 * self.q_len * self.heads * self.kv_len * (D_QK + D_V) * self.batch

    @property
    def bytes(self) -> int:
        """Least bytes one call moves: the KV once, q read, out and lse written."""
        io = self.rows * self.heads * (D_QK * ELEM + D_V * ELEM + 4)
        return self.batch * self.kv_len * TOKEN_BYTES + io

    @property
    def group(self) -> tuple:
        """Everything but the prefix: the key of a prefix series (one line of the plot)."""
        return (self.batch, self.q_len, self.heads, self.page_size, self.dtype, self.tree)

    @property
    def _tree_tag(self) -> str:
        return "" if self.tree == "random" else f" {self.tree}"

    @property
    def group_label(self) -> str:
        return f"B={self.batch} n={self.q_len} H={self.heads} ps={self.page_size} {self.dtype}{self._tree_tag}"

    @property
    def label(self) -> str:
        return f"B{self.batch} n{self.q_len} H{self.heads} P{self.prefix} ps{self.page_size} {self.dtype}{self._tree_tag}"

    def floor_s(self, copy_bps: float, matmul_flops: float) -> float:
        """Roofline floor in seconds for ceilings in bytes/s and FLOP/s."""
        return max(self.flops / matmul_flops, self.bytes / copy_bps)

    def to_dict(self) -> dict:
        return asdict(self)


def _dedup(shapes) -> list[Shape]:
    seen, out = set(), []
    for s in shapes:
        if s not in seen:
            seen.add(s)
            out.append(s)
    return out


def cartesian_shapes(batch, q_len, heads, prefix, page_size, dtype, tree=("random",)) -> list[Shape]:
    """Every combination of the given axis values, in a stable order (prefix varies fastest)."""
    combos = itertools.product(dtype, tree, page_size, heads, q_len, batch, prefix)
    return _dedup(Shape(b, n, h, p, ps, dt, tr) for dt, tr, ps, h, n, b, p in combos)


def preset_shapes(preset: str, *, long: bool = False, dtypes=("bf16",)) -> list[Shape]:
    """The shapes of a preset.

    - ``tiny``: three small shapes (the CPU functional run; on a GPU a smoke test).
    - ``quick``: about ten shapes around the base (a one-minute look).
    - ``default``: prefix series (0..16k) for five configurations, plus one-axis-at-a-time sweeps
      of batch, tree size, heads and page size at prefix 4096 around the base
      (B=1, n=33, H=64, page size 1, bf16). ``long=True`` extends the prefix series to
      32k, 64k, 128k and 200k.
    - ``issue3``: the issue-3 grid, H {16,64,128} x n {9,33,65} x B {1,4,16} x prefix
      {1k,4k,16k,64k,128k}, page size 1 scattered (135 shapes).
    - ``issue11``: the Hopper grid, H {16,64,128} x n {9,33} x B {1,4} x prefix {4k,16k,64k,128k}
      (48 shapes), each with a chain tree at page size 64 (FlashMLA's work), and a random tree at
      page size 64 and at page size 1 scattered (144 shapes).

    ``dtypes`` multiplies every preset shape (default bf16 only).
    """
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose from {PRESETS}")
    long_p = LONG_PREFIXES if long else ()
    shapes: list[Shape] = []
    for dt in dtypes:
        if preset == "tiny":
            shapes += [  # interpreter-sized: prefix 0, two sequences, a 2-word mask, pages of 16
                Shape(2, 9, 2, 0, 1, dt),
                Shape(2, 9, 2, 40, 1, dt),
                Shape(1, 33, 1, 30, 16, dt),
            ]
        elif preset == "quick":
            base = dict(BASE, dtype=dt)
            for p in QUICK_PREFIXES + tuple(x for x in long_p if x <= 65536):
                shapes.append(Shape(prefix=p, **base))
            for h in (16, 128):
                shapes.append(Shape(**dict(base, heads=h), prefix=SWEEP_PREFIX))
            shapes.append(Shape(**dict(base, batch=4), prefix=SWEEP_PREFIX))
            shapes.append(Shape(**dict(base, q_len=9, heads=16), prefix=16384))
            shapes.append(Shape(**dict(base, page_size=64), prefix=SWEEP_PREFIX))
        elif preset == "default":
            lines = [
                dict(batch=1, q_len=33, heads=64, page_size=1),  # the base: Kimi K2 TP1
                dict(batch=1, q_len=9, heads=16, page_size=1),  # small tree, tensor parallel
                dict(batch=1, q_len=65, heads=128, page_size=1),  # DeepSeek-V3 TP1, big tree
                dict(batch=16, q_len=33, heads=64, page_size=1),  # batched
                dict(batch=1, q_len=33, heads=64, page_size=64),  # paged by 64
            ]
            for line in lines:
                for p in DEFAULT_PREFIXES + long_p:
                    shapes.append(Shape(prefix=p, dtype=dt, **line))
            base = dict(BASE, dtype=dt)
            for axis, values in AXES.items():
                for v in values:
                    shapes.append(Shape(**dict(base, **{axis: v}), prefix=SWEEP_PREFIX))
        elif preset == "issue3":
            g = ISSUE3_GRID
            shapes += cartesian_shapes(g["batch"], g["q_len"], g["heads"], g["prefix"], g["page_size"], (dt,))
        elif preset == "issue11":
            g = ISSUE11_GRID
            for tree, page_size in (("chain", 64), ("random", 64), ("random", 1)):
                shapes += cartesian_shapes(g["batch"], g["q_len"], g["heads"], g["prefix"], (page_size,), (dt,), (tree,))
    return _dedup(shapes)


# ----------------------------------------------------------------------------------------------
# Memory


def set_bytes(shape: Shape) -> int:
    """Device bytes of one input set: KV pool (+1 poisoned spare page), q, out, lse."""
    pool = (shape.batch * shape.pages_per_seq + 1) * shape.page_size * TOKEN_BYTES
    return pool + shape.rows * shape.heads * (D_QK * ELEM + D_V * ELEM + 4)


def shared_bytes(shape: Shape) -> int:
    """Device bytes shared by the sets: page table, lengths, masks, plus the float64 reference of
    the checked sample (gathered KV and scores of one sequence, a few heads)."""
    table = shape.batch * shape.pages_per_seq * 4
    ref = shape.kv_len * D_QK * 8 * 2 + shape.q_len * 4 * shape.kv_len * 8 * 4
    return table + ref


def case_bytes(shape: Shape, n_sets: int) -> int:
    return n_sets * set_bytes(shape) + shared_bytes(shape)


def choose_sets(shape: Shape, *, l2_bytes: int, max_sets: int, free_bytes: int | None) -> int:
    """How many input sets to rotate so that consecutive calls do not find their KV in L2.

    Enough sets to cover three times the L2 (at most ``max_sets``), and never more than 30% of
    the free device memory.
    """
    per = set_bytes(shape)
    n = max(1, min(max_sets, math.ceil(3 * l2_bytes / per)))
    if free_bytes is not None:
        while n > 1 and n * per > 0.3 * free_bytes:
            n -= 1
    return n


# ----------------------------------------------------------------------------------------------
# Inputs


@dataclass
class InputSet:
    """Per-set tensors: different q and KV pool (same page table), own output buffers."""

    q: torch.Tensor  # [T, H, 576]
    kv_cache: torch.Tensor  # [num_pages, page_size, 576]
    out: torch.Tensor  # [T, H, 512], pre-filled with NaN
    lse: torch.Tensor  # [T, H] float32, pre-filled with NaN


@dataclass
class BenchCase:
    """A shape's inputs on the device: ``sets`` rotate; the index tensors are shared."""

    shape: Shape
    device: torch.device
    sets: list[InputSet]
    page_table: torch.Tensor  # [B, pages_per_seq] int32
    kv_lens: torch.Tensor  # [B] int32
    qo_indptr: torch.Tensor  # [B+1] int32
    tree_mask: torch.Tensor  # [T, W] int32
    kv_lens_host: torch.Tensor  # [B] int32 CPU
    qo_indptr_host: torch.Tensor  # [B+1] int32 CPU
    parents: list[list[int]]  # per sequence
    tree_visible: list[torch.Tensor]  # per sequence, bool [n, n] on the device
    sm_scale: float = field(default=1.0 / math.sqrt(D_QK))

    def inputs(self, i: int) -> dict[str, torch.Tensor]:
        s = self.sets[i]
        return {
            "q": s.q,
            "kv_cache": s.kv_cache,
            "page_table": self.page_table,
            "kv_lens": self.kv_lens,
            "qo_indptr": self.qo_indptr,
            "tree_mask": self.tree_mask,
        }

    def slots(self, b: int) -> torch.Tensor:
        """``[P+n]`` int64 on the device: flat slot (``page * page_size + offset``) of each position
        of sequence b, in position order."""
        ps = self.shape.page_size
        pos = torch.arange(self.shape.kv_len, device=self.device)
        return self.page_table[b].to(torch.int64)[pos // ps] * ps + pos % ps

    def visible(self, b: int) -> torch.Tensor:
        """``[n, P+n]`` bool on the device: which keys each tree node of sequence b sees."""
        n, p = self.shape.q_len, self.shape.prefix
        v = torch.ones(n, p + n, dtype=torch.bool, device=self.device)
        v[:, p:] = self.tree_visible[b]
        return v

    def reset_outputs(self) -> None:
        """Poison every output buffer with NaN (an unwritten element then fails the check)."""
        for s in self.sets:
            s.out.fill_(float("nan"))
            s.lse.fill_(float("nan"))


def build_case(shape: Shape, device, n_sets: int = 1, seed: int = 0, q_scale: float = 2.0) -> BenchCase:
    """Random inputs for ``shape`` made on ``device``; ``n_sets`` sets of q and KV pool.

    KV rows and q are standard normal (q scaled by ``q_scale``, as in the tests); pages are
    scattered over the pool by ``randperm`` (page size 1: every token in a random slot); a spare
    page and the unused tail of each sequence's last page hold NaN; the tree of each sequence is
    random (:func:`kdtree_engine.testing.random_tree`, node order shuffled).
    """
    device = torch.device(device)
    dtype = DTYPES[shape.dtype]
    B, n, H, ps = shape.batch, shape.q_len, shape.heads, shape.page_size
    L, pps, T = shape.kv_len, shape.pages_per_seq, shape.rows
    num_pages = B * pps + 1
    gen_cpu = torch.Generator().manual_seed(seed)
    gen_dev = torch.Generator(device=device).manual_seed(seed)

    perm = torch.randperm(num_pages, generator=gen_dev, device=device)
    page_table = perm[: B * pps].view(B, pps).to(torch.int32).contiguous()
    spare = perm[B * pps :]  # the poisoned spare page
    tail = L - (pps - 1) * ps  # valid slots of each sequence's last page
    last_pages = page_table[:, -1].to(torch.int64)

    sets = []
    for _ in range(n_sets):
        kv = torch.randn(num_pages, ps, D_QK, generator=gen_dev, device=device, dtype=dtype)
        kv[spare] = float("nan")
        if tail < ps:
            kv[last_pages, tail:] = float("nan")
        q = torch.randn(T, H, D_QK, generator=gen_dev, device=device, dtype=dtype) * q_scale
        out = torch.full((T, H, D_V), float("nan"), device=device, dtype=dtype)
        lse = torch.full((T, H), float("nan"), device=device, dtype=torch.float32)
        sets.append(InputSet(q=q, kv_cache=kv, out=out, lse=lse))

    parents = [chain_tree(n) if shape.tree == "chain" else random_tree(n, gen_cpu) for _ in range(B)]
    visible = [ancestor_matrix(p) for p in parents]
    tree_mask = concat_tree_masks([pack_tree_mask(v) for v in visible]).to(device)
    kv_lens_host = torch.full((B,), L, dtype=torch.int32)
    qo_indptr_host = (torch.arange(B + 1, dtype=torch.int32) * n).to(torch.int32)
    return BenchCase(
        shape=shape,
        device=device,
        sets=sets,
        page_table=page_table,
        kv_lens=kv_lens_host.to(device),
        qo_indptr=qo_indptr_host.to(device),
        tree_mask=tree_mask,
        kv_lens_host=kv_lens_host,
        qo_indptr_host=qo_indptr_host,
        parents=parents,
        tree_visible=[v.to(device) for v in visible],
    )
