"""The speculative decoding loop: drafter -> DDTree -> verify -> greedy acceptance -> KV commit.

One step, for all active sequences at once (sequences of different lengths in one batch)::

    contexts --drafter--> draft logits [B, L, V] --ddtree.build_ddtree--> trees (root = last token)
      --KVPool.reserve_step: node j of sequence b at cache position P_b + j; the step's verify
        inputs (slots, page table, lengths, qo_indptr, mask, host lengths of the plan) together
      --MLARunner.forward: every node's KV written, verify_attention over prefix + tree--> logits [T, V]
      --ddtree.accept_greedy--> accepted path + bonus token (one host read per step)
      --KVPool.commit: accepted rows to positions P_b, P_b+1, ...; P_b += path length

Greedy acceptance emits the draft nodes whose token equals the target's argmax at their parent,
then the target's argmax at the last accepted node (the bonus). Every emitted token is the
target's own greedy choice given the tokens before it, so the output equals plain greedy decoding
of the target (lossless), up to floating-point numerics (see :func:`check_lossless`).

Plain decoding is the same loop with one-node trees (the root): both are measured by the same
code on the same kernel.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from ..ddtree import accept_greedy, build_ddtree, tree_from_parents
from ..kvpool.step import VerifyStep
from ..verify.contract import D_QK
from .drafters import Drafter, as_context
from .mla import MLARunner, StepTimer

__all__ = [
    "SpeculativeEngine",
    "GenerateResult",
    "verify_once",
    "RequestTooLarge",
    "MemoryPlan",
    "memory_plan",
    "LosslessReport",
    "check_lossless",
]


# ----------------------------------------------------------------------------------------------
# memory


class RequestTooLarge(ValueError):
    """The request's KV pool (plus working memory) does not fit; raised before any work starts."""


@dataclass
class MemoryPlan:
    """The KV pool a request needs and the working memory its prefill is estimated to need."""

    pages_per_seq: list[int]
    page_size: int
    kv_bytes: int
    work_bytes: int  # estimated peak activations: the prefill of the longest prompt
    free_bytes: int | None  # device memory free now, incl. the allocator's unused cache (None on the CPU)

    @property
    def num_pages(self) -> int:
        return sum(self.pages_per_seq)

    def describe(self) -> str:
        gib = 2**30
        free = "n/a" if self.free_bytes is None else f"{self.free_bytes / gib:.2f} GiB"
        return (f"KV pool {self.num_pages} pages x {self.page_size} tokens = {self.kv_bytes / gib:.2f} GiB, "
                f"prefill working memory ~{self.work_bytes / gib:.2f} GiB, device free {free}")

    def check(self, limit_bytes: int | None = None, margin: float = 0.9) -> None:
        """Raise :class:`RequestTooLarge` if the pool exceeds ``limit_bytes`` or pool + working
        memory exceed ``margin`` of the free device memory."""
        need = self.kv_bytes + self.work_bytes
        if limit_bytes is not None and self.kv_bytes > limit_bytes:
            raise RequestTooLarge(
                f"request does not fit: its KV pool needs {self.kv_bytes / 2**30:.3f} GiB, the limit is "
                f"{limit_bytes / 2**30:.3f} GiB ({self.describe()})")
        if self.free_bytes is not None and need > margin * self.free_bytes:
            raise RequestTooLarge(
                f"request does not fit: needs {need / 2**30:.2f} GiB of the {self.free_bytes / 2**30:.2f} GiB "
                f"free ({self.describe()}); shorten the prompts, decode fewer tokens, use fewer sequences or layers")


def memory_plan(runner: MLARunner, prompt_lens: Sequence[int], max_new_tokens: int, tree_nodes: int,
                page_size: int) -> MemoryPlan:
    """Size the KV pool from the request and estimate the prefill's working memory.

    A sequence holds at most ``prompt + max_new_tokens - 1`` committed tokens plus one reserved
    tree of ``tree_nodes`` nodes; its pages are that, rounded up.
    """
    c = runner.config
    H = runner.num_heads
    elt = torch.empty((), dtype=runner.dtype).element_size()
    per_seq = [math.ceil((p + max_new_tokens - 1 + tree_nodes) / page_size) for p in prompt_lens]
    cache_elt = torch.empty((), dtype=runner.cache_dtype).element_size()
    kv = (sum(per_seq) + 1) * page_size * D_QK * cache_elt * runner.num_layers  # +1: the pool's trash page
    P = max(prompt_lens)
    dk = runner.nope + 64
    # one layer of the dense prefill: q, k, the kv_b expansion, padded v, attention out; MLP
    inter = max(c.intermediate_size, c.moe_intermediate_size * ((c.num_experts_per_tok or 0) + c.n_shared_experts))
    work = P * elt * (H * (4 * dk + runner.nope + 2 * runner.v_dim) + 3 * inter + 6 * c.hidden_size)
    work += P * 4 * 2  # positions, slots
    free = None
    if runner.device.type == "cuda":  # free on the device + what PyTorch's allocator holds unused
        dev = runner.device
        free = torch.cuda.mem_get_info(dev)[0] + torch.cuda.memory_reserved(dev) - torch.cuda.memory_allocated(dev)
    return MemoryPlan(per_seq, page_size, kv, work, free)


# ----------------------------------------------------------------------------------------------
# the loop


@dataclass
class GenerateResult:
    """Output and measurements of one :meth:`SpeculativeEngine.decode` (or ``generate``) call."""

    tokens: list[list[int]]  # new tokens per sequence (the first one comes from the prefill)
    top2: list[torch.Tensor] = field(default_factory=list)  # per sequence [N, 2]: the target's two
    # largest logits behind each new token (their gap is the token's margin; see check_lossless)
    steps: int = 0
    accepted: list[int] = field(default_factory=list)  # tokens emitted per (sequence, step)
    kept: int = 0  # emitted tokens within max_new_tokens (the last step may overshoot)
    prefill_s: float = 0.0
    decode_s: float = 0.0  # wall time of all decode steps (synchronised)
    attn_s: float = 0.0  # time inside the attention kernel, all layers and steps
    forward_s: float = 0.0  # time of the target forwards
    draft_s: float = 0.0  # drafter + tree construction
    tree_nodes: int = 0  # tree nodes verified, all steps

    @property
    def num_tokens(self) -> int:
        return sum(len(t) for t in self.tokens)

    @property
    def decoded_tokens(self) -> int:
        """Tokens the decode steps produced within ``max_new_tokens`` (overshoot of a last step not
        counted); the basis of :attr:`tokens_per_s`."""
        return self.kept

    @property
    def mean_accepted(self) -> float:
        """Mean tokens emitted per sequence per step (accepted drafts + the bonus token)."""
        return sum(self.accepted) / max(1, len(self.accepted))

    @property
    def tokens_per_s(self) -> float:
        """Decode throughput: tokens emitted by the decode steps per second of decoding."""
        return self.decoded_tokens / self.decode_s if self.decode_s > 0 else float("nan")

    @property
    def step_ms(self) -> float:
        return 1e3 * self.decode_s / max(1, self.steps)

    @property
    def attn_ms(self) -> float:
        return 1e3 * self.attn_s / max(1, self.steps)

    @property
    def rest_ms(self) -> float:
        return self.step_ms - self.attn_ms

    @property
    def attn_share(self) -> float:
        return self.attn_s / self.decode_s if self.decode_s > 0 else float("nan")


@dataclass
class _Seq:
    sid: int  # KV pool sequence id
    buf: torch.Tensor  # int64 [capacity]: prompt + output
    length: int  # tokens in buf; the last one is the next root (its KV is not cached yet)
    prompt_len: int
    top2: list = field(default_factory=list)  # [2] float32 per generated token
    done: bool = False

    @property
    def cached(self) -> int:
        """P: committed cache positions."""
        return self.length - 1

    def context(self) -> torch.Tensor:
        return self.buf[: self.length]


class SpeculativeEngine:
    """Batched speculative (or plain) greedy decoding of an :class:`MLARunner`'s model.

    Args:
        runner: the target.
        drafter: a :class:`~kdtree_engine.model.drafters.Drafter`; ``None`` = plain decoding
            (one-node trees). The attribute may be swapped between :meth:`decode` calls (e.g.
            plain, then speculative, on the same prefilled prompts after :meth:`reset`).
        budget: DDTree draft nodes per tree, root excluded (tree = budget + 1 verify rows); the
            KV pool is sized for it at :meth:`prefill`.
        depth: positions asked of the drafter (the deepest a tree can go).
        page_size: KV pool page size.
        max_pool_bytes: optional cap on the KV pool; a larger request raises
            :class:`RequestTooLarge` before any work (on CUDA free memory is checked as well).
    """

    def __init__(self, runner: MLARunner, drafter: Drafter | None = None, *, budget: int = 16, depth: int = 6,
                 page_size: int = 16, max_pool_bytes: int | None = None):
        self.runner = runner
        self.drafter = drafter
        if budget < 0 or depth < 0:
            raise ValueError(f"budget and depth must be >= 0, got {budget}, {depth}")
        self.budget = budget
        self.depth = depth
        self.page_size = page_size
        self.max_pool_bytes = max_pool_bytes
        self.pool = None
        self.seqs: list[_Seq] = []
        self.max_new_tokens = 0

    # -- request set-up -----------------------------------------------------------------------

    def plan(self, prompt_lens: Sequence[int], max_new_tokens: int) -> MemoryPlan:
        return memory_plan(self.runner, prompt_lens, max_new_tokens, self.budget + 1, self.page_size)

    def prefill(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, *,
                progress: Callable[[int], None] | None = None) -> tuple[list[int], float]:
        """Size the KV pool from the request (raises :class:`RequestTooLarge` before any work),
        then prefill every prompt. ``progress(tokens)`` is called as prefill advances.

        Returns (the first generated token of each sequence, prefill seconds).
        """
        from ..kvpool import KVPool

        r = self.runner
        prompts = [as_context(p) for p in prompts]
        if not prompts or any(p.numel() < 1 for p in prompts):
            raise ValueError("need at least one prompt, each of at least one token")
        if max_new_tokens < 1:
            raise ValueError("max_new_tokens must be >= 1")
        plan = self.plan([p.numel() for p in prompts], max_new_tokens)
        plan.check(self.max_pool_bytes)
        self.pool = None  # free a previous request's pool first
        self.pool = KVPool(plan.num_pages, self.page_size, num_layers=r.num_layers, dtype=r.cache_dtype,
                           device=r.device, max_seqs=len(prompts),
                           max_seq_len=max(plan.pages_per_seq) * self.page_size)
        self.max_new_tokens = max_new_tokens
        self.seqs = []
        first = []
        t0 = _now(r.device)
        for p in prompts:
            P = p.numel()
            sid = self.pool.add_sequence()
            slots = self.pool.extend([sid], [P])
            per_layer = P / r.num_layers
            logits = r.prefill(p, self.pool.kv_layers, slots,
                               on_layer=(lambda _i: progress(per_layer)) if progress else None)
            tok = int(logits.argmax())
            top2 = logits.topk(2).values.float().cpu()
            buf = torch.zeros(P + max_new_tokens + self.depth + 1, dtype=torch.int64)
            buf[:P] = p
            buf[P] = tok
            self.seqs.append(_Seq(sid, buf, P + 1, P, [top2]))
            first.append(tok)
        return first, _now(r.device) - t0

    def reset(self) -> None:
        """Back to the state right after prefill: generated tokens dropped, prompt KV kept."""
        for s in self.seqs:
            self.pool.truncate(s.sid, s.prompt_len)
            s.length = s.prompt_len + 1
            del s.top2[1:]
            s.done = False

    # -- decoding -----------------------------------------------------------------------------

    def decode(self, max_new_tokens: int | None = None, *, eos_token_id: int | None = None,
               max_steps: int | None = None, progress: Callable[[int], None] | None = None) -> GenerateResult:
        """Decode until each sequence holds ``max_new_tokens`` new tokens (the first came from the
        prefill), emitted ``eos_token_id``, or ``max_steps`` steps ran."""
        if self.pool is None:
            raise RuntimeError("call prefill() first")
        max_new = self.max_new_tokens if max_new_tokens is None else max_new_tokens
        if max_new > self.max_new_tokens:
            raise ValueError(f"the KV pool was sized for {self.max_new_tokens} new tokens, asked {max_new}")
        r = self.runner
        res = GenerateResult(tokens=[])
        timer = StepTimer(r.device)
        for s in self.seqs:
            s.done = self._finished(s, max_new, eos_token_id)
        while any(not s.done for s in self.seqs) and (max_steps is None or res.steps < max_steps):
            t_step = _now(r.device)
            active = [s for s in self.seqs if not s.done]
            ids = [s.sid for s in active]
            t0 = time.perf_counter()
            tree = self._draft(active)
            res.draft_s += time.perf_counter() - t0
            step = self.pool.reserve_step(ids, tree)
            t_fwd = timer.mark()
            logits = r.forward(step, self.pool.kv_layers, timer, plan=_flash_plan(r, step))
            timer.add_total(t_fwd, timer.mark())
            acc = accept_greedy(tree, logits)
            # new token j of sequence b is the target's argmax at accepted node j: keep its top-2 logits
            rows = step.qo_indptr[:-1, None].to(torch.int64) + acc.accepted.clamp(min=0)  # [B, D+1]
            top2 = logits.topk(2, dim=-1).values[rows].to("cpu", non_blocking=True)  # [B, D+1, 2]
            host = torch.cat([acc.lengths[:, None], acc.new_tokens], 1).cpu()  # the step's sync
            lengths = host[:, 0]
            self.pool.commit(ids, acc.accepted, acc.lengths, num_accepted_host=lengths)
            for b, s in enumerate(active):
                a = int(lengths[b])
                res.kept += min(a, max_new - (s.length - s.prompt_len))
                s.buf[s.length : s.length + a] = host[b, 1 : 1 + a]
                s.top2.extend(top2[b, :a])
                s.length += a
                res.accepted.append(a)
                s.done = self._finished(s, max_new, eos_token_id)
            res.tree_nodes += step.num_rows
            res.steps += 1
            res.decode_s += _now(r.device) - t_step
            if progress:
                progress(int(lengths.sum()))
        timer.flush()
        res.attn_s, res.forward_s = timer.attn_s, timer.total_s
        res.tokens = [self._output(s, max_new, eos_token_id) for s in self.seqs]
        res.top2 = [torch.stack(s.top2[: len(t)]) for s, t in zip(self.seqs, res.tokens)]
        return res

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, *, eos_token_id: int | None = None,
                 prefill_progress=None, decode_progress=None) -> GenerateResult:
        """Prefill + decode: the greedy continuation of every prompt, ``max_new_tokens`` each."""
        _, prefill_s = self.prefill(prompts, max_new_tokens, progress=prefill_progress)
        res = self.decode(max_new_tokens, eos_token_id=eos_token_id, progress=decode_progress)
        res.prefill_s = prefill_s
        return res

    # -- pieces -------------------------------------------------------------------------------

    def _draft(self, active: list[_Seq]):
        dev = self.runner.device
        roots = torch.tensor([int(s.buf[s.length - 1]) for s in active], dtype=torch.int64, device=dev)
        if self.drafter is None or self.budget <= 0 or self.depth <= 0:
            return build_ddtree(torch.zeros(len(active), 0, 1, device=dev), 0, roots)
        logits = self.drafter.draft([s.context() for s in active], self.depth)
        want = (len(active), self.depth, self.runner.vocab_size)
        if tuple(logits.shape) != want:
            raise ValueError(f"drafter {self.drafter.name} returned {tuple(logits.shape)}, expected {want}")
        return build_ddtree(logits.to(dev), self.budget, roots)

    def _output(self, s: _Seq, max_new: int, eos: int | None) -> list[int]:
        out = s.buf[s.prompt_len : s.length].tolist()[:max_new]
        if eos is not None and eos in out:
            out = out[: out.index(eos) + 1]
        return out

    def _finished(self, s: _Seq, max_new: int, eos: int | None) -> bool:
        if s.length - s.prompt_len >= max_new:
            return True
        return eos is not None and bool((s.buf[s.prompt_len : s.length] == eos).any())


def verify_once(runner: MLARunner, prefixes: Sequence[Sequence[int]], trees: Sequence[tuple[list[int], list[int]]],
                *, page_size: int = 16, shuffle_seed: int | None = None, debug: bool = False):
    """Prefill ``prefixes`` into a fresh KV pool and run ONE verify forward over the given trees.

    ``trees[b] = (tokens, parents)`` in node order, node 0 the root (parent -1); node ``j`` goes to
    cache position ``P_b + j`` and RoPE position ``P_b + depth_j``. ``shuffle_seed`` scatters the
    pool's pages first; ``debug`` makes the pool poison free slots with NaN.
    Returns ``(logits [T, V] float32, pool, seq_ids)``.
    """
    from ..kvpool import KVPool

    dev = runner.device
    need = sum(math.ceil((len(p) + len(t[0])) / page_size) for p, t in zip(prefixes, trees))
    pool = KVPool(need + 4, page_size, num_layers=runner.num_layers, dtype=runner.cache_dtype, device=dev,
                  max_seqs=len(prefixes), debug=debug)
    if shuffle_seed is not None:
        pool.shuffle_free_pages(shuffle_seed)
    ids = []
    for p in prefixes:
        sid = pool.add_sequence()
        runner.prefill(torch.tensor(p), pool.kv_layers, pool.extend([sid], [len(p)]))
        ids.append(sid)
    width = max(len(t[0]) for t in trees)
    par = torch.tensor([list(t[1]) + [-1] * (width - len(t[1])) for t in trees], device=dev)
    tok = torch.tensor([list(t[0]) + [-1] * (width - len(t[0])) for t in trees], device=dev)
    tree = tree_from_parents(par, tok, [len(t[0]) for t in trees])
    return runner.forward(pool.reserve_step(ids, tree), pool.kv_layers), pool, ids


def _flash_plan(runner: MLARunner, step: VerifyStep):
    """The flash kernel's plan of the step (built once, reused by every layer), on CUDA."""
    if runner.kernel not in ("flash", "auto") or runner.device.type != "cuda":
        return None
    return step.plan(runner.num_heads)


def _now(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


# ----------------------------------------------------------------------------------------------
# losslessness


@dataclass
class LosslessReport:
    """Token-for-token comparison of an output against a reference greedy output."""

    num_seqs: int
    compared: int  # tokens compared
    matched: int  # tokens equal before the first divergence, summed over sequences
    divergences: list[tuple[int, int, float | None]]  # (sequence, index, reference top-2 margin there)
    tie_tol: float

    @property
    def exact(self) -> bool:
        return not self.divergences

    @property
    def ok(self) -> bool:
        """Exact, or every divergence sits on a near-tie of the reference (margin <= tie_tol)."""
        return all(m is not None and m <= self.tie_tol for _, _, m in self.divergences)

    def line(self) -> str:
        if self.exact:
            return f"lossless: {self.matched}/{self.compared} tokens identical over {self.num_seqs} sequences"
        parts = [f"seq {b} @ token {i} (reference top-2 margin {'?' if m is None else f'{m:.2e}'})"
                 for b, i, m in self.divergences]
        verdict = "near-tie divergence (numerics)" if self.ok else "MISMATCH"
        return f"{verdict}: {self.matched}/{self.compared} tokens identical before divergence; " + "; ".join(parts)


def check_lossless(outputs: Sequence[Sequence[int]], references: Sequence[Sequence[int]],
                   reference_logits: Sequence[torch.Tensor] | None = None, tie_tol: float = 0.0) -> LosslessReport:
    """Compare outputs with reference greedy outputs token for token (first divergence per sequence).

    ``reference_logits[b]``: optional ``[N_b, V]`` logits behind reference b's tokens (or just their
    two largest, ``[N_b, 2]``, as :attr:`GenerateResult.top2` keeps them); at a divergence the
    reference's margin top1 - top2 is reported, and divergences with margin <= ``tie_tol`` count
    as numerics (not losslessness failures) in :attr:`LosslessReport.ok`.
    """
    compared = matched = 0
    div = []
    for b, (out, ref) in enumerate(zip(outputs, references)):
        n = min(len(out), len(ref))
        compared += n
        i = next((j for j in range(n) if out[j] != ref[j]), n)
        matched += i
        if i < n or len(out) != len(ref):
            margin = None
            if reference_logits is not None and i < reference_logits[b].shape[0]:
                top2 = torch.topk(reference_logits[b][i].float(), 2).values
                margin = float(top2[0] - top2[1])
            div.append((b, i, margin))
    return LosslessReport(len(outputs), compared, matched, div, tie_tol)
