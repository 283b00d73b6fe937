"""FlashMLA's Hopper dense-decode kernel as an optional benchmark peer (``kdtree bench --flashmla DIR``).

FlashMLA has no tree mask: with ``causal=True`` query ``i`` of ``s_q`` sees keys up to
``kv_len - s_q + i``, which is exactly a chain-shaped draft tree with its nodes in order. So it
runs the same work as ``verify_attention`` on chain trees (``--tree chain``), page size 64, bf16,
16..128 heads: the speed-of-light reference for the verify kernel on Hopper.

Nothing of FlashMLA is vendored: ``DIR`` is a folder holding ``flashmla_peer.py`` with a
``load_flashmla()`` that returns the compiled extension (``get_mla_metadata``,
``dense_decode_fwd``), e.g. a FlashMLA build made for this machine.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

from ..testing import chain_tree
from ..verify.contract import D_V
from .peers import Impl, Prepared, Unavailable
from .shapes import BenchCase, Shape

__all__ = ["FlashMLAPeer", "chain_call", "load_flashmla_module"]

PAGE_SIZE = 64  # FlashMLA's block size


def load_flashmla_module(path: str | Path):
    """The FlashMLA extension from ``path/flashmla_peer.py``'s ``load_flashmla()``.

    Raises ``Unavailable`` (with the reason) when the folder, the loader or the build is missing.
    """
    loader = Path(path) / "flashmla_peer.py"
    if not loader.is_file():
        raise Unavailable(f"no flashmla_peer.py in {path}")
    spec = importlib.util.spec_from_file_location("flashmla_peer", loader)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
        return module.load_flashmla()
    except Exception as e:  # a build or load failure of a third-party peer: report, don't crash
        raise Unavailable(f"FlashMLA did not load from {path}: {type(e).__name__}: {e}") from None


def chain_call(fm, H: int, n: int, B: int, prefix: int, sm_scale: float, device):
    """One FlashMLA call (``fm``: the loaded extension; its main kernel and its combine) on the work of
    ``B`` chain trees of ``n`` nodes after ``prefix`` positions with ``H`` heads (its causal mask),
    on random inputs of its own, pages of 64 shuffled over the pool: a function making the call (for
    scripts that time it beside our kernels on their own inputs)."""
    kv_len = prefix + n
    pages = -(-kv_len // PAGE_SIZE)
    kv_cache = torch.randn(B * pages, PAGE_SIZE, 1, 576, device=device, dtype=torch.bfloat16)
    page_table = torch.randperm(B * pages, device=device).view(B, pages).to(torch.int32)
    q = torch.randn(B, n, H, 576, device=device, dtype=torch.bfloat16)
    kv_lens = torch.full((B,), kv_len, device=device, dtype=torch.int32)
    meta, num_splits = fm.get_mla_metadata(kv_lens, n, H, 1)
    return lambda: fm.dense_decode_fwd(q, kv_cache, D_V, kv_lens, page_table, sm_scale, True, meta, num_splits)


class FlashMLAPeer(Impl):
    name = "flashmla"
    has_lse = True
    description = "FlashMLA sm_90a dense decode, causal (= chain tree), page 64 (no tree mask)"

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._fm = None

    def detect(self) -> str | None:
        """None when FlashMLA loads, else why not."""
        try:
            self._fm = load_flashmla_module(self.path)
        except Unavailable as e:
            return str(e)
        return None

    def est_tflops(self) -> float:
        return 650.0

    def prepare(self, case: BenchCase) -> Prepared:
        sh: Shape = case.shape
        B, n, H = sh.batch, sh.q_len, sh.heads
        if sh.page_size != PAGE_SIZE:
            raise Unavailable(f"FlashMLA runs page size {PAGE_SIZE} only (shape has {sh.page_size})")
        if sh.dtype != "bf16":
            raise Unavailable("FlashMLA runs bf16 only")
        if any(p != chain_tree(n) for p in case.parents):
            raise Unavailable("FlashMLA has no tree mask: chain trees only (--tree chain)")
        if not 16 <= H <= 128:
            raise Unavailable(f"FlashMLA runs 16..128 heads (shape has {H})")
        fm = self._fm
        meta, num_splits = fm.get_mla_metadata(case.kv_lens, n, H, 1)
        results: dict[int, tuple] = {}

        def run(i: int) -> None:
            s = case.sets[i]
            num_pages = s.kv_cache.shape[0]
            results[i] = fm.dense_decode_fwd(
                s.q.view(B, n, H, -1), s.kv_cache.view(num_pages, PAGE_SIZE, 1, -1), D_V, case.kv_lens,
                case.page_table, case.sm_scale, True, meta, num_splits,
            )[:2]

        def collect(i: int) -> None:
            """Copy FlashMLA's ``[B, s_q, H, 512]`` out and ``[B, H, s_q]`` lse into the set's buffers."""
            out, lse = results[i]
            s = case.sets[i]
            s.out.view(B, n, H, D_V).copy_(out)
            s.lse.view(B, n, H).copy_(lse.transpose(1, 2))

        return Prepared(run=run, collect=collect, keep=[meta, num_splits, results])
