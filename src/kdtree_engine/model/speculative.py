"""The speculative decoding loop: drafter -> DDTree -> verify -> greedy acceptance -> KV commit.

One step, for all active sequences at once (sequences of different lengths in one batch)::

    host, before:  KVPool.book_tree: node j of sequence b at cache position P_b + j (checks, counts)
                   (a host drafter only: contexts --drafter--> draft logits [B, L, V] -> fixed buffer)
    the step (eager, or ONE captured CUDA graph per step shape, replayed):
                   roots = the last token of each device token history
                   a device drafter (NGramDrafter.draft_tensor) over the histories --> [B, L, V]
                   KVPool.place_tree: the trees' pages popped from the free stack (device)
                   ddtree.build_ddtree --> trees (root = last token)
                   KVPool.step_inputs: slots, page table, lengths, qo_indptr, mask, node tokens
                   VerifyAttention.plan from the step's device lengths (the device scheduler)
                   MLARunner phases: every node's KV written, VerifyAttention.run per layer --> logits [T, V]
                   ddtree.accept_greedy --> accepted path + bonus token; top-2 logits of each
                   KVPool.commit: accepted rows to positions P_b, P_b+1, ...; P_b += path length
                   the emitted tokens appended to the device histories
    host, after:   one non-blocking copy of the results to pinned host memory, an event;
                   KVPool.finalize_commit with the lengths: known without a read for one-node
                   trees (plain decoding), else read (the step's only wait); the step's tokens
                   are taken into the host buffers while the next step runs on the device

Greedy acceptance emits the draft nodes whose token equals the target's argmax at their parent,
then the target's argmax at the last accepted node (the bonus). Every emitted token is the
target's own greedy choice given the tokens before it, so the output equals plain greedy decoding
of the target (lossless), up to floating-point numerics (see :func:`check_lossless`).

Plain decoding is the same loop with one-node trees (the root): both are measured by the same
code on the same kernel. A step shape ("bucket") is (batch size, tree size, drafter positions, a
device drafter's settings, kernel): the active sequences are a device input of the step (their
rows), so a sequence that finishes moves the batch to the shape of one sequence fewer, captured
once per request (:meth:`SpeculativeEngine.warm_up` captures them all before timing).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from ..ddtree import accept_greedy, build_ddtree, greedy_workspace, tree_from_parents
from ..masks import is_int
from ..verify import VerifyAttention
from ..verify.contract import D_QK
from .drafters import Drafter, as_context
from .graphs import GRAPH_MODES, PhaseClock, StepGraph
from .mla import ForwardState, MLARunner, Phase
from .step_kernels import record_step

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
    for name, v in (("max_new_tokens", max_new_tokens), ("tree_nodes", tree_nodes), ("page_size", page_size)):
        if not is_int(v) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
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
    """Output and measurements of one :meth:`SpeculativeEngine.decode` (or ``generate``) call.

    Time per step: ``decode_s`` is wall time (the decode loop between two syncs, capture
    excluded); ``phase_s[kind]``
    the device time of the step's phases by kind (``"attention"``, ``"tree"``, ``"accept"``,
    ``"rest"``; ``"step"`` for whole-step graph replays, whose phases are not separable): CUDA
    events on the GPU, host time on the CPU. What the wall time holds beyond them is host time the
    device waited for (a host drafter, the reservation, launches, waiting for a step's lengths).
    """

    tokens: list[list[int]]  # new tokens per sequence (the first one comes from the prefill)
    top2: list[torch.Tensor] = field(default_factory=list)  # per sequence [N, 2]: the target's two
    # largest logits behind each new token (their gap is the token's margin; see check_lossless)
    graphs: str = "eager"  # how the steps ran: "eager", "step" or "phases" (see model.graphs)
    steps: int = 0
    accepted: list[int] = field(default_factory=list)  # tokens emitted per (sequence, step)
    kept: int = 0  # emitted tokens within max_new_tokens (the last step may overshoot)
    prefill_s: float = 0.0
    decode_s: float = 0.0  # wall time of the decode loop (a sync at each end), capture excluded
    phase_s: dict = field(default_factory=dict)  # device time by phase kind, all steps
    draft_s: float = 0.0  # host time of the drafter
    capture_s: float = 0.0  # CUDA-graph capture during this call (not in decode_s)
    captures: int = 0  # step shapes captured during this call
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

    def _ms(self, seconds: float) -> float:
        return 1e3 * seconds / max(1, self.steps)

    @property
    def step_ms(self) -> float:
        """Wall time per step."""
        return self._ms(self.decode_s)

    @property
    def device_ms(self) -> float:
        """Time of the step's phases per step (GPU time on CUDA)."""
        return self._ms(sum(self.phase_s.values()))

    @property
    def host_ms(self) -> float:
        """Wall time per step outside the phases: host overhead."""
        return self.step_ms - self.device_ms

    def kind_ms(self, kind: str) -> float:
        """Time per step of the phases of one kind (see :data:`~kdtree_engine.model.mla.PHASE_KINDS`)."""
        return self._ms(self.phase_s.get(kind, 0.0))

    @property
    def attn_ms(self) -> float:
        return self.kind_ms("attention")

    @property
    def attn_share(self) -> float:
        """Attention's share of the wall time."""
        return self.phase_s.get("attention", 0.0) / self.decode_s if self.decode_s > 0 else float("nan")


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


class _Bucket:
    """One step shape, (batch size, tree size, drafter positions), and its phases.

    The step's sequences are an input like the others: their rows are in ``rows [B]`` int64 on the
    device, rewritten by :meth:`bind` when the active sequences change, so one captured graph
    serves every set of B sequences (a server's per-batch-size bucket).

    The phases read the engine's device token histories (``history [S, C]`` int64, ``hist_len
    [S]`` int64: each sequence's prompt and output; the last token is the next root) and, for a
    drafter without ``draft_tensor``, the fixed buffer ``draft [B, L, V]`` float32 written before
    each step by :meth:`stage`. They leave the step's results in attributes: ``lengths [B]`` int64
    (tokens emitted), ``results [B, 1 + D+1]`` int64 (the lengths, then the emitted tokens, -1
    padded) and ``top2 [B, D+1, 2]`` float32 (the target's two best logits behind each emitted
    token), copied to the host by :meth:`read`, and append the emitted tokens to the histories.

    Phases: ``draft tree`` (the roots from the histories, the device drafter, the pool's
    :meth:`~kdtree_engine.kvpool.KVPool.place_tree`, :func:`~kdtree_engine.ddtree.build_ddtree`,
    the pool's :meth:`~kdtree_engine.kvpool.KVPool.step_inputs` and the attention plan: on CUDA
    the device scheduler, from the step's device lengths), the runner's forward phases, ``accept +
    commit`` (:func:`~kdtree_engine.ddtree.accept_greedy`,
    :meth:`~kdtree_engine.kvpool.KVPool.commit`, then :func:`~kdtree_engine.model.step_kernels.record_step`:
    top-2 logits, result rows, the histories' append). The host half of the
    reservation, :meth:`~kdtree_engine.kvpool.KVPool.book_tree`, stays outside, before the step.
    """

    def __init__(self, eng: SpeculativeEngine, ids: tuple[int, ...], spec: bool, mode: str, attn):
        r, pool = eng.runner, eng.pool
        dev = r.device
        B = len(ids)
        self.ids: tuple[int, ...] | None = None  # the sequences bound now (see bind)
        self.rows = torch.zeros(B, dtype=torch.int64, device=dev)  # their rows; a graph keeps this address
        self.L = eng.depth if spec else 0
        self.budget = eng.budget if spec else 0
        self.history, self.hist_len = eng._history, eng._hist_len
        # a device drafter runs inside the step; a host drafter's logits are staged into `draft`
        self.drafter = eng.drafter if spec and hasattr(eng.drafter, "draft_tensor") else None
        self.draft = torch.zeros(B, self.L, r.vocab_size if spec else 1, dtype=torch.float32, device=dev)
        self._draft_h = torch.zeros(self.draft.shape, dtype=torch.float32, pin_memory=dev.type == "cuda")
        # the tree's node count is fixed by (B, L, V, budget): probe it once
        self.n = build_ddtree(self.draft, self.budget, torch.zeros(B, dtype=torch.int64, device=dev)).width
        # the device scheduler's schedule for steps of this shape, priced once on the host from the
        # first sequences' lengths (a request's lengths grow by its new tokens only)
        self.device_schedule = "line"
        if attn is not None and dev.type == "cuda":
            self.device_schedule = attn.device_schedule_for([pool.seq_len(s) + self.n for s in ids],
                                                            [self.n * b for b in range(B + 1)])
        self.st = ForwardState()
        self.attn = attn
        self.greedy_ws = greedy_workspace(B, dev)  # acceptance's counter, left zero by each step
        self.graph = StepGraph([Phase("tree", "draft tree", lambda: self._tree(pool)),
                                *r.phases(self.st, pool.kv_layers, attn),
                                Phase("accept", "accept + commit", lambda: self._accept(pool))], mode, dev)
        self.lengths = self.results = self.top2 = self.tree = None
        self._host: list[tuple[torch.Tensor, torch.Tensor, torch.cuda.Event | None]] = []  # 2 read slots
        self._slot = 0

    def bind(self, pool, ids: tuple[int, ...]) -> None:
        """Make ``ids`` (B live sequences) the step's sequences: their rows into :attr:`rows` (a
        device copy on the current stream, before the step that reads them)."""
        if ids != self.ids:
            self.rows.copy_(pool.device_rows(ids))
            self.ids = ids

    def stage(self, draft: torch.Tensor) -> None:
        """Write a host drafter's logits (``[B, L, V]``) into the fixed buffer."""
        self._draft_h.copy_(draft)
        self.draft.copy_(self._draft_h, non_blocking=True)

    def _tree(self, pool) -> None:
        rows = self.rows
        n = self.hist_len[rows]  # [B]
        roots = self.history[rows, n - 1]
        draft = self.draft if self.drafter is None else self.drafter.draft_tensor(self.history[rows], n, self.L)
        pool.place_tree(self.ids, self.n, rows=rows)  # the device half of the reservation booked before the step
        self.tree = build_ddtree(draft, self.budget, roots)
        self.st.step = step = pool.step_inputs(self.ids, self.tree, rows=rows)
        if self.attn is not None:  # device lengths: the scheduler kernel (the CPU reads them: a host plan)
            self.attn.plan(step.kv_lens, step.qo_indptr, device_schedule=self.device_schedule)

    def _accept(self, pool) -> None:
        logits, step = self.st.logits, self.st.step
        acc = accept_greedy(self.tree, logits, workspace=self.greedy_ws)
        self.lengths = acc.lengths
        self.accepted_width = acc.accepted.shape[1]
        pool.commit(self.ids, acc.accepted, acc.lengths, rows=self.rows)
        # new token j of sequence b is the target's argmax at accepted node j: keep its top-2
        # logits; the emitted tokens extend the histories (the next roots, the drafter's context)
        self.results, self.top2 = record_step(logits, step.qo_indptr, acc.accepted, acc.lengths, acc.new_tokens,
                                              self.rows, self.history, self.hist_len)

    def read(self) -> int:
        """Queue the copy of the step's results to the host (pinned, non-blocking, then an event);
        returns the read slot for :meth:`host`. Two slots alternate: a slot is reused two reads
        later, so the host must take a step's results before queuing the read after next."""
        if not self._host:
            cuda = self.results.device.type == "cuda"
            self._host = [(torch.empty(self.results.shape, dtype=torch.int64, pin_memory=cuda),
                           torch.empty(self.top2.shape, dtype=torch.float32, pin_memory=cuda),
                           torch.cuda.Event() if cuda else None) for _ in range(2)]
        slot = self._slot
        self._slot ^= 1
        ints, top2, ev = self._host[slot]
        ints.copy_(self.results, non_blocking=True)
        top2.copy_(self.top2, non_blocking=True)
        if ev is not None:
            ev.record()
        return slot

    def host(self, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A read's results once they are on the host (waits for its copy only):
        ``[B, 1 + D+1]`` int64 (length, new tokens) and the top-2 logits ``[B, D+1, 2]``."""
        ints, top2, ev = self._host[slot]
        if ev is not None:
            ev.synchronize()
        return ints, top2


@dataclass
class _StepRead:
    """A launched step whose tokens the host has not taken yet: its bucket, read slot, sequences,
    and where their new tokens go (``starts[b]``, ``lengths[b]`` of them)."""

    bucket: _Bucket
    slot: int
    seqs: list
    starts: list[int]
    lengths: list[int]


class SpeculativeEngine:
    """Batched speculative (or plain) greedy decoding of an :class:`MLARunner`'s model.

    Args:
        runner: the target.
        drafter: a :class:`~kdtree_engine.model.drafters.Drafter`; ``None`` = plain decoding
            (one-node trees). The attribute may be swapped between :meth:`decode` calls (e.g.
            plain, then speculative, on the same prefilled prompts after :meth:`reset`).
        budget: DDTree draft nodes per tree, root excluded (tree = budget + 1 verify rows); the
            KV pool is sized for it at :meth:`prefill`; it may be lowered afterwards.
        depth: positions asked of the drafter (the deepest a tree can go).
        page_size: KV pool page size.
        max_pool_bytes: optional cap on the KV pool; a larger request raises
            :class:`RequestTooLarge` before any work (on CUDA free memory is checked as well).
        graphs: ``"step"`` (default on CUDA: each step shape captured once as one CUDA graph and
            replayed), ``"phases"`` (a graph per phase, for the time split), ``"eager"`` (the
            default on the CPU, and the fallback for a model with MoE layers; steps with the
            runner's ``"reference"`` kernel run eagerly too). See :mod:`kdtree_engine.model.graphs`.

    One :class:`~kdtree_engine.VerifyAttention` per kernel (workspace allocated once for the
    request's batch and tree) is planned once per step and run by every layer.
    """

    def __init__(self, runner: MLARunner, drafter: Drafter | None = None, *, budget: int = 16, depth: int = 6,
                 page_size: int = 16, max_pool_bytes: int | None = None, graphs: str | None = None):
        self.runner = runner
        self.drafter = drafter
        for name, v in (("budget", budget), ("depth", depth), ("page_size", page_size)):
            if not is_int(v):
                raise TypeError(f"{name} must be an int, got {v!r}")
        if not (max_pool_bytes is None or is_int(max_pool_bytes)):
            raise TypeError(f"max_pool_bytes must be an int or None, got {max_pool_bytes!r}")
        if budget < 0 or depth < 0:
            raise ValueError(f"budget and depth must be >= 0, got {budget}, {depth}")
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.budget = budget
        self.depth = depth
        self.page_size = page_size
        self.max_pool_bytes = max_pool_bytes
        self.graphs = graphs
        self.pool = None
        self.seqs: list[_Seq] = []
        self.max_new_tokens = 0
        self._max_tree = self._max_depth = 0
        self._history = self._hist_len = None  # [S, C] int64, [S] int64 on the device (see _Bucket)
        self._buckets: dict[tuple, _Bucket] = {}
        self._attn: dict[str, VerifyAttention] = {}

    @property
    def graphs(self) -> str:
        return self._graphs

    @graphs.setter
    def graphs(self, mode: str | None) -> None:
        cuda = self.runner.device.type == "cuda"
        if mode is None:
            mode = "step" if cuda and self.runner.capturable else "eager"
        if mode not in GRAPH_MODES:
            raise ValueError(f"graphs must be one of {GRAPH_MODES}, got {mode!r}")
        if mode != "eager" and not cuda:
            raise ValueError(f"graphs={mode!r} captures CUDA graphs: the runner is on {self.runner.device}")
        if mode != "eager" and not self.runner.capturable:
            raise ValueError(f"graphs={mode!r}: the model has MoE layers (host syncs), run it with graphs='eager'")
        self._graphs = mode

    @property
    def capture_s(self) -> float:
        """Wall seconds spent capturing CUDA graphs since :meth:`prefill` (all step shapes)."""
        return sum(b.graph.capture_s for b in self._buckets.values())

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
        V = r.vocab_size
        if any(int(p.min()) < 0 or int(p.max()) >= V for p in prompts):
            raise ValueError(f"prompts hold a token id outside the vocabulary [0, {V})")
        if not is_int(max_new_tokens):
            raise TypeError(f"max_new_tokens must be an int, got {max_new_tokens!r}")
        if max_new_tokens < 1:
            raise ValueError("max_new_tokens must be >= 1")
        self.close()  # a previous request's graphs and pool: freed first, so the plan counts their memory free
        plan = self.plan([p.numel() for p in prompts], max_new_tokens)
        plan.check(self.max_pool_bytes)
        self.pool = KVPool(plan.num_pages, self.page_size, num_layers=r.num_layers, dtype=r.cache_dtype,
                           device=r.device, max_seqs=len(prompts),
                           max_seq_len=max(plan.pages_per_seq) * self.page_size)
        self.max_new_tokens = max_new_tokens
        self._max_tree = self.budget + 1
        self._max_depth = self.depth
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
        # the device copy of every buf (+ a trash column), which the steps read and extend
        self._history = torch.zeros(len(self.seqs), max(s.buf.numel() for s in self.seqs) + 1, dtype=torch.int64)
        for s in self.seqs:
            self._history[s.sid, : s.buf.numel()] = s.buf
        self._history = self._history.to(r.device)
        self._hist_len = torch.zeros(len(self.seqs), dtype=torch.int64, device=r.device)
        self._sync_hist_len()
        return first, _now(r.device) - t0

    def close(self) -> None:
        """Free the request's captured graphs and KV pool now. A bucket's phases refer to the
        bucket and the pool: dropped buckets otherwise wait, with the pool, for Python's cyclic
        collector, which may run late (a long-lived bucket is in its oldest generation) and in
        any thread (see :meth:`~kdtree_engine.model.graphs.StepGraph._capture`)."""
        for b in self._buckets.values():
            b.graph.release()
            b.graph = None  # the cycle bucket -> graph -> phases -> bucket, pool broken here
        self._buckets.clear()
        self._attn.clear()
        self.pool = None

    def _sync_hist_len(self) -> None:
        """The device history lengths from the host ones (one small copy)."""
        self._hist_len[[s.sid for s in self.seqs]] = torch.tensor([s.length for s in self.seqs]).to(self.runner.device)

    def reset(self) -> None:
        """Back to the state right after prefill: generated tokens dropped, prompt KV kept
        (captured step graphs are kept too)."""
        if self.pool is None:
            raise RuntimeError("call prefill() first")
        for s in self.seqs:
            self.pool.truncate(s.sid, s.prompt_len)
            s.length = s.prompt_len + 1
            del s.top2[1:]
            s.done = False
        self._sync_hist_len()

    def warm_up(self) -> None:
        """Make every step shape the decode loop can meet with the current drafter, budget, depth
        and kernel ready before timing: two steps on the first B prefilled sequences for each batch
        size B (the first step runs eagerly: JIT compiles; with graphs the second captures), then
        :meth:`reset`. A loop whose sequences finish at different steps then replays captured
        graphs only (what a server does at start-up, per batch-size bucket)."""
        if self.pool is None:
            raise RuntimeError("call prefill() first")
        seqs = self.seqs
        self.reset()
        try:
            for B in range(len(seqs), 0, -1):
                self.seqs = seqs[:B]
                self.decode(max_steps=2)
                self.reset()
        finally:
            self.seqs = seqs
        self.reset()

    # -- decoding -----------------------------------------------------------------------------

    @torch.inference_mode()
    def decode(self, max_new_tokens: int | None = None, *, eos_token_id: int | None = None,
               max_steps: int | None = None, progress: Callable[[int], None] | None = None) -> GenerateResult:
        """Decode until each sequence holds ``max_new_tokens`` new tokens (the first came from the
        prefill), emitted ``eos_token_id``, or ``max_steps`` steps ran.

        A step: the reservation's host half (host counts), then the step's phases (eager, or a
        captured graph replayed: drafting on the device, draft tree, attention plan, forward,
        acceptance, KV commit, the histories' append), then a non-blocking copy of its results
        to the host. The host waits for a step's lengths only when it cannot know them (a tree of
        more than one node; a host drafter also waits for the tokens), and takes each step's
        tokens while the next step runs on the device: plain decoding never waits inside the loop.
        An EOS is therefore seen one step late (that step's tokens are dropped by the output).
        """
        if self.pool is None:
            raise RuntimeError("call prefill() first")
        for name, v in (("max_new_tokens", max_new_tokens), ("eos_token_id", eos_token_id), ("max_steps", max_steps)):
            if not (v is None or is_int(v)):
                raise TypeError(f"{name} must be an int or None, got {v!r}")
        max_new = self.max_new_tokens if max_new_tokens is None else max_new_tokens
        if max_new > self.max_new_tokens:
            raise ValueError(f"the KV pool was sized for {self.max_new_tokens} new tokens, asked {max_new}")
        spec = self.drafter is not None and self.budget > 0 and self.depth > 0
        if spec and self.budget + 1 > self._max_tree:
            raise ValueError(f"budget {self.budget}: the KV pool was sized at prefill for trees of "
                             f"{self._max_tree} nodes (budget {self._max_tree - 1})")
        if spec and self.depth > self._max_depth:
            raise ValueError(f"depth {self.depth}: the token buffers were sized at prefill for depth {self._max_depth}")
        r = self.runner
        res = GenerateResult(tokens=[], graphs=self._mode())
        clock = PhaseClock(r.device)
        for s in self.seqs:
            s.done = self._finished(s, max_new, eos_token_id)
        pending = None  # the last launched step, its tokens not taken yet
        host_draft = spec and not hasattr(self.drafter, "draft_tensor")  # drafts from the host contexts
        t0 = _now(r.device)
        while (max_steps is None or res.steps < max_steps) and (active := [s for s in self.seqs if not s.done]):
            if host_draft and pending is not None:  # the last step's tokens first (an EOS among them ends
                self._take(pending, eos_token_id, progress)  # its sequence before this step)
                pending = None
                if not (active := [s for s in active if not s.done]):
                    break
            ids = tuple(s.sid for s in active)
            bucket = self._bucket(ids, spec)
            if host_draft:
                t1 = time.perf_counter()
                bucket.stage(self._draft(active))
                res.draft_s += time.perf_counter() - t1
            self.pool.book_tree(ids, bucket.n)  # host counts only; the step places the pages
            bucket.bind(self.pool, ids)
            captured_before = bucket.graph.capture_s
            if not bucket.graph.run(clock):  # a replay: the commit's host half
                self.pool.replayed_commit(ids, bucket.lengths, bucket.accepted_width)
            res.capture_s += bucket.graph.capture_s - captured_before
            res.captures += bucket.graph.capture_s > captured_before
            read = _StepRead(bucket, bucket.read(), active, [s.length for s in active], [1] * len(active))
            if bucket.n > 1:  # one-node trees emit one token each; else wait for this step's lengths
                read.lengths = bucket.host(read.slot)[0][:, 0].tolist()
            self.pool.finalize_commit(read.lengths)
            for s, a in zip(active, read.lengths):
                res.kept += min(a, max_new - (s.length - s.prompt_len))
                res.accepted.append(a)
                s.length += a
                s.done = s.length - s.prompt_len >= max_new
            res.tree_nodes += bucket.n * len(ids)
            res.steps += 1
            self._take(pending, eos_token_id, progress)  # while this step runs
            pending = read
        self._take(pending, eos_token_id, progress)
        res.decode_s = _now(r.device) - t0 - res.capture_s
        clock.flush()
        res.phase_s = dict(clock.seconds)
        res.tokens = [self._output(s, max_new, eos_token_id) for s in self.seqs]
        res.top2 = [torch.stack(s.top2[: len(t)]) for s, t in zip(self.seqs, res.tokens)]
        return res

    def _take(self, read: _StepRead | None, eos: int | None, progress) -> None:
        """Move a launched step's tokens and top-2 logits into the host buffers (waits for its
        copy if it is still on the way); a sequence that emitted ``eos`` is done."""
        if read is None:
            return
        ints, top2 = read.bucket.host(read.slot)
        for b, (s, start, a) in enumerate(zip(read.seqs, read.starts, read.lengths)):
            new = ints[b, 1 : 1 + a]
            s.buf[start : start + a] = new
            s.top2.extend(top2[b, :a].clone())  # the slot is rewritten two reads later
            if eos is not None and bool((new == eos).any()):
                s.done = True
        if progress:
            progress(sum(read.lengths))

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, *, eos_token_id: int | None = None,
                 prefill_progress=None, decode_progress=None) -> GenerateResult:
        """Prefill + decode: the greedy continuation of every prompt, ``max_new_tokens`` each."""
        _, prefill_s = self.prefill(prompts, max_new_tokens, progress=prefill_progress)
        res = self.decode(max_new_tokens, eos_token_id=eos_token_id, progress=decode_progress)
        res.prefill_s = prefill_s
        return res

    # -- pieces -------------------------------------------------------------------------------

    def _bucket(self, ids: tuple[int, ...], spec: bool) -> _Bucket:
        """The step shape's bucket (made on first use), with the kernel's planned attention."""
        r = self.runner
        attn = None
        if r.kernel != "reference":
            attn = self._attn.get(r.kernel)
            if attn is None:
                attn = self._attn[r.kernel] = VerifyAttention(len(self.seqs), self._max_tree, r.num_heads, r.device,
                                                              kernel=r.kernel)
        mode = self._mode()
        key = (r.kernel, mode, len(ids), spec, self.budget if spec else 0, self.depth if spec else 0,
               _drafter_key(self.drafter) if spec else None)
        bucket = self._buckets.get(key)
        if bucket is None:
            bucket = self._buckets[key] = _Bucket(self, ids, spec, mode, attn)
        return bucket

    def _mode(self) -> str:
        """How steps run now: :attr:`graphs`, but eager with the float64 ``reference`` kernel (it
        reads the lengths on the host)."""
        return "eager" if self.runner.kernel == "reference" else self.graphs

    def _draft(self, active: list[_Seq]) -> torch.Tensor:
        logits = self.drafter.draft([s.context() for s in active], self.depth)
        want = (len(active), self.depth, self.runner.vocab_size)
        if tuple(logits.shape) != want:
            raise ValueError(f"drafter {self.drafter.name} returned {tuple(logits.shape)}, expected {want}")
        return logits

    def _output(self, s: _Seq, max_new: int, eos: int | None) -> list[int]:
        out = s.buf[s.prompt_len : s.length].tolist()[:max_new]
        if eos is not None and eos in out:
            out = out[: out.index(eos) + 1]
        return out

    def _finished(self, s: _Seq, max_new: int, eos: int | None) -> bool:
        if s.length - s.prompt_len >= max_new:
            return True
        return eos is not None and bool((s.buf[s.prompt_len : s.length] == eos).any())


def _drafter_key(drafter) -> tuple | None:
    """What a step shape depends on of its drafter: a device drafter's type and settings (a
    captured step holds its kernels), a setting that is not a number or a string by identity (a
    captured step holds the tensors it read; the bucket holds the drafter, so the identity is not
    reused); nothing of a host drafter (its logits are staged)."""
    if not hasattr(drafter, "draft_tensor"):
        return None
    plain = (bool, int, float, str, type(None))
    return (type(drafter).__qualname__,
            tuple((k, v if isinstance(v, plain) else ("id", id(v))) for k, v in sorted(vars(drafter).items())))


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
    if len(outputs) != len(references):
        raise ValueError(f"outputs holds {len(outputs)} sequences, references {len(references)}")
    if reference_logits is not None:
        if len(reference_logits) != len(references):
            raise ValueError(f"reference_logits holds {len(reference_logits)} sequences, references {len(references)}")
        if any(x.dim() != 2 or x.shape[1] < 2 for x in reference_logits):
            raise ValueError("reference_logits[b] must be [N_b, V] with V >= 2 (the margin needs two logits)")
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
