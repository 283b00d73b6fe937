"""The KV pool's device kernels: the commit of accepted paths, the page pops of a reservation,
a step's verify inputs and the page copy, with their launchers.

Both kernels work on the pool's own buffers (made by :class:`~kdtree_engine.kvpool.KVPool`, so
their layouts are known): the page store ``[num_layers, num_pages + 1, page_size, 576]`` with
rows contiguous (layer stride passed), the page table ``[max_seqs, cols]`` int32 (row stride
passed), and flat int32 vectors. The accepted paths come from the caller: their row stride is
passed, their column stride must be 1 (:meth:`KVPool.commit` copies otherwise).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..ddtree.kernels import block_of

__all__ = ["copy_pages", "launch_commit", "launch_pop_pages", "launch_step_inputs"]


# ----------------------------------------------------------------------------------------------
# Triton kernels


# Integer arguments that change call to call are not specialised (no recompile mid-decode).
@triton.jit(do_not_specialize=["num_moves"])
def _copy_pages_kernel(
    src, dst, src_idx, dst_idx, num_moves,
    stride_src_l, stride_dst_l,
    ROW: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
    EVEN_D: tl.constexpr,
):
    """dst[l, dst_idx[i]] = src[l, src_idx[i]] for BLOCK_M moves x one layer; a page is ROW values,
    copied in ceil(ROW / BLOCK_D) tiles [BLOCK_M, BLOCK_D] (a small page in one masked tile).

    One pass: correct only if no page is both read and written by this launch (the schedule
    guarantees it)."""
    i_m = tl.program_id(0)
    i_l = tl.program_id(1)
    o_m = i_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_m = o_m < num_moves
    b_src = tl.load(src_idx + o_m, mask=m_m, other=0).to(tl.int64)
    b_dst = tl.load(dst_idx + o_m, mask=m_m, other=0).to(tl.int64)
    p_src = src + i_l.to(tl.int64) * stride_src_l + b_src * ROW  # [BM]
    p_dst = dst + i_l.to(tl.int64) * stride_dst_l + b_dst * ROW  # [BM]
    for i_d in range(0, tl.cdiv(ROW, BLOCK_D)):
        o_d = i_d * BLOCK_D + tl.arange(0, BLOCK_D)
        if EVEN_D:
            m_x = m_m[:, None]
        else:
            m_x = m_m[:, None] & (o_d < ROW)[None, :]
        b_x = tl.load(p_src[:, None] + o_d[None, :], mask=m_x)  # [BM, BD]
        tl.store(p_dst[:, None] + o_d[None, :], b_x, mask=m_x)


@triton.jit(do_not_specialize=["B", "count", "stride_t"])
def _pop_pages_kernel(
    rows, counts, table, lens, tree, stack, top, B, count,
    stride_t,
    PAGE_SIZE: tl.constexpr,
    PER_SEQ: tl.constexpr,
    TREE: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """One program: sequence rows ``rows[b]`` gain ``counts[b]`` positions (``count`` each
    unless PER_SEQ); the pages they need, at most BLOCK_K each, are popped from the top of the
    free stack in (sequence, page) order into their table rows; lengths (and, if TREE, tree
    sizes) updated."""
    o_b = tl.arange(0, BLOCK_B)
    m_b = o_b < B
    row = tl.load(rows + o_b, mask=m_b, other=0)
    old = tl.load(lens + row, mask=m_b, other=0)
    if PER_SEQ:
        cnt = tl.load(counts + o_b, mask=m_b, other=0).to(tl.int32)
    else:
        cnt = tl.zeros([BLOCK_B], dtype=tl.int32) + count
    new = old + cnt
    old_p = (old + PAGE_SIZE - 1) // PAGE_SIZE
    k = tl.where(m_b, (new + PAGE_SIZE - 1) // PAGE_SIZE - old_p, 0)  # [BB] pages gained
    rank = tl.cumsum(k, 0) - k  # pops before sequence b's
    t = tl.load(top)
    o_k = tl.arange(0, BLOCK_K)
    take = o_k[None, :] < k[:, None]  # [BB, BK]
    page = tl.load(stack + (t - 1 - rank[:, None] - o_k[None, :]), mask=take)
    tl.store(table + row[:, None].to(tl.int64) * stride_t + old_p[:, None] + o_k[None, :], page, mask=take)
    tl.store(top, t - tl.sum(k, 0))
    tl.store(lens + row, new, mask=m_b)
    if TREE:
        tl.store(tree + row, cnt, mask=m_b)


@triton.jit
def _kept_count(a, n, max_acc):
    """Accepted nodes a commit keeps: at least the root, at most the tree and the path width."""
    return tl.minimum(tl.maximum(a, 1), tl.minimum(n, max_acc))


@triton.jit
def _freed_count(kv_len, n, a, PAGE_SIZE: tl.constexpr):
    """Pages (page size 1: slots) a sequence frees when ``a`` of its ``n`` tree nodes are kept."""
    if PAGE_SIZE == 1:
        return n - a
    else:
        return (kv_len + PAGE_SIZE - 1) // PAGE_SIZE - (kv_len - n + a + PAGE_SIZE - 1) // PAGE_SIZE


@triton.jit(do_not_specialize=["stride_acc", "stride_t", "num_seqs", "max_acc", "num_programs"])
def _commit_kernel(
    rows, accepted, num_accepted, table, lens, tree, stack, top, done, marks, kv,
    stride_acc, stride_t, stride_kv_l,
    num_seqs, max_acc, num_programs,
    PAGE_SIZE: tl.constexpr,
    D_ROW: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_A: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_F: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Commit of one sequence (program axis 0) for one layer (axis 1; page size 1 has one).

    Accepted node i (root first) becomes position P+i. Page size 1: table[P+i] = slot of node
    accepted[i]; the slots of the other nodes are pushed on the free stack (in node order). A
    node repeated in the path (out of contract) takes, at its later positions, the first
    rejected slots instead, so the pool stays consistent.
    Larger pages: row P+accepted[i] is copied to row P+i (all reads of a column chunk before its
    writes), pages at or past ceil((P+a)/page_size) are pushed. Freed ids of sequence b go after
    those of sequences 0..b-1 (deterministic). The last program to finish updates lens, tree and
    the stack top (all programs read them first).
    """
    i_b = tl.program_id(0)
    i_l = tl.program_id(1)
    r = tl.load(rows + i_b).to(tl.int64)
    kv_len = tl.load(lens + r)
    n = tl.load(tree + r)
    prefix = kv_len - n
    a = _kept_count(tl.load(num_accepted + i_b).to(tl.int32), n, max_acc)
    o_a = tl.arange(0, BLOCK_A)
    m_a = o_a < a
    b_acc = tl.load(accepted + i_b.to(tl.int64) * stride_acc + o_a, mask=m_a, other=0).to(tl.int32)
    b_acc = tl.minimum(tl.maximum(b_acc, 0), n - 1)  # [BA] node indices
    p_row = table + r * stride_t

    # stack position of this sequence's freed ids: after those of sequences 0..i_b-1
    o_bb = tl.arange(0, BLOCK_B)
    m_bb = o_bb < i_b
    r_bb = tl.load(rows + o_bb, mask=m_bb, other=0).to(tl.int64)
    len_bb = tl.load(lens + r_bb, mask=m_bb, other=0)
    n_bb = tl.load(tree + r_bb, mask=m_bb, other=0)
    a_bb = tl.load(num_accepted + o_bb, mask=m_bb, other=1).to(tl.int32)
    a_bb = _kept_count(a_bb, n_bb, max_acc)
    f_bb = tl.where(m_bb, _freed_count(len_bb, n_bb, a_bb, PAGE_SIZE), 0)
    base = tl.load(top) + tl.sum(f_bb, 0)

    if PAGE_SIZE == 1:
        o_n = tl.arange(0, BLOCK_N)
        m_n = o_n < n
        b_node = tl.load(p_row + prefix + o_n, mask=m_n, other=0)  # [BN] slot of each node
        b_acc_slot = tl.load(p_row + prefix + b_acc, mask=m_a, other=0)  # [BA]
        # a per-slot scratch array (kept all zero) marks each accepted slot with a - i of the first
        # position i naming it: a node is accepted where its mark is set, and a later position
        # naming the same node (a repeat: out of contract) is told apart
        tl.atomic_max(marks + b_acc_slot, a - o_a, mask=m_a)
        tl.debug_barrier()
        b_is_acc = tl.load(marks + b_node, mask=m_n, other=0, volatile=True)  # other threads' atomics
        m_first = m_a & (tl.load(marks + b_acc_slot, mask=m_a, other=0, volatile=True) == a - o_a)
        tl.debug_barrier()
        tl.store(marks + b_acc_slot, 0, mask=m_a)
        m_rej = m_n & (b_is_acc == 0)
        b_rej = m_rej.to(tl.int32)
        b_rank = tl.cumsum(b_rej, 0) - b_rej
        # repeated positions take the first rejected slots, in order (their KV is not the node's),
        # so the sequence keeps a slots and frees n - a, as the host counts: no slot in two places
        b_dup = (m_a & ~m_first).to(tl.int32)
        n_dup = tl.sum(b_dup, 0)
        b_dup_rank = tl.cumsum(b_dup, 0) - b_dup
        tl.store(stack + base + b_rank - n_dup, b_node, mask=m_rej & (b_rank >= n_dup))
        tl.store(p_row + prefix + o_a, b_acc_slot, mask=m_first)
        for k in range(0, n_dup):  # none for a path in contract
            spare = tl.sum(tl.where(m_rej & (b_rank == k), b_node, 0), 0)
            pos = tl.sum(tl.where((b_dup == 1) & (b_dup_rank == k), o_a, 0), 0)
            tl.store(p_row + prefix + pos, spare)
    else:
        src_pos = prefix + b_acc
        dst_pos = prefix + o_a
        m_cp = m_a & (src_pos != dst_pos)
        src_slot = tl.load(p_row + src_pos // PAGE_SIZE, mask=m_cp, other=0).to(tl.int64) * PAGE_SIZE + src_pos % PAGE_SIZE
        dst_slot = tl.load(p_row + dst_pos // PAGE_SIZE, mask=m_cp, other=0).to(tl.int64) * PAGE_SIZE + dst_pos % PAGE_SIZE
        p_kv = kv + i_l.to(tl.int64) * stride_kv_l
        for i_d in range(0, D_ROW // BLOCK_D):
            o_d = i_d * BLOCK_D + tl.arange(0, BLOCK_D)
            b_x = tl.load(p_kv + src_slot[:, None] * D_ROW + o_d[None, :], mask=m_cp[:, None])  # [BA, BD]
            tl.debug_barrier()  # every row of this chunk read before any is overwritten
            tl.store(p_kv + dst_slot[:, None] * D_ROW + o_d[None, :], b_x, mask=m_cp[:, None])
        if i_l == 0:
            c_lo = (prefix + a + PAGE_SIZE - 1) // PAGE_SIZE
            c_hi = (kv_len + PAGE_SIZE - 1) // PAGE_SIZE
            o_f = tl.arange(0, BLOCK_F)
            m_f = o_f < c_hi - c_lo
            b_page = tl.load(p_row + c_lo + o_f, mask=m_f, other=0)
            tl.store(stack + base + o_f, b_page, mask=m_f)

    # the last program to finish publishes the new lengths and stack top
    tl.debug_barrier()
    n_done = tl.atomic_add(done, 1)
    if n_done == num_programs - 1:
        o_b = tl.arange(0, BLOCK_B)
        m_b = o_b < num_seqs
        r_b = tl.load(rows + o_b, mask=m_b, other=0).to(tl.int64)
        len_b = tl.load(lens + r_b, mask=m_b, other=0)
        n_b = tl.load(tree + r_b, mask=m_b, other=0)
        a_b = tl.load(num_accepted + o_b, mask=m_b, other=1).to(tl.int32)
        a_b = _kept_count(a_b, n_b, max_acc)
        total = tl.sum(tl.where(m_b, _freed_count(len_b, n_b, a_b, PAGE_SIZE), 0), 0)
        tl.store(lens + r_b, len_b - n_b + a_b, mask=m_b)
        tl.store(tree + r_b, n_b * 0, mask=m_b)
        tl.store(top, tl.load(top) + total)
        tl.store(done, 0)


@triton.jit
def _node_bits(node, o_w):
    """``[BN, BW]`` int32: bit ``node % 32`` of word ``node // 32`` per row (none where node < 0)."""
    hit = (o_w[None, :] == (node // 32)[:, None]) & (node >= 0)[:, None]
    return tl.where(hit, (tl.full([1, 1], 1, tl.int32) << (node % 32).to(tl.int32)[:, None]), 0)


@triton.jit(do_not_specialize=["num_seqs", "width", "max_depth", "stride_tree", "stride_t", "num_cols"])
def _step_inputs_kernel(
    rows, tokens, parents, depths, num_nodes, table, lens, tree,
    out_tokens, out_pos, out_slots, out_pages, out_lens, out_qo, out_mask,
    num_seqs, width, max_depth, stride_tree, stride_t, num_cols,
    PAGE_SIZE: tl.constexpr,
    WORDS: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_W: tl.constexpr,
    BLOCK_P: tl.constexpr,
):
    """The verify inputs of sequence b (one program each) from the pool and its reserved tree.

    Prefix P = lens[r] - tree[r] (r = rows[b]); the tree's first flat row s = sum of num_nodes
    before b. Writes kv_lens[b] = lens[r], qo_indptr[b + 1] = s + n_b (program 0 also the leading
    0), the page-table row (num_cols entries of table row r), and for node j < n_b, row s + j: its
    token, RoPE position P + depth, slot of cache position P + j (page column clamped to
    num_cols - 1) and its ancestor-or-self mask, built by walking up to max_depth parents.
    """
    i_b = tl.program_id(0)
    r = tl.load(rows + i_b).to(tl.int64)
    kv_len = tl.load(lens + r)
    prefix = (kv_len - tl.load(tree + r)).to(tl.int64)
    o_bb = tl.arange(0, BLOCK_B)
    start = tl.sum(tl.load(num_nodes + o_bb, mask=o_bb < i_b, other=0), 0)
    n = tl.load(num_nodes + i_b)
    tl.store(out_lens + i_b, kv_len)
    tl.store(out_qo + i_b + 1, (start + n).to(tl.int32))
    if i_b == 0:
        tl.store(out_qo, 0)
    p_row = table + r * stride_t
    p_pages = out_pages + i_b.to(tl.int64) * num_cols
    for c0 in range(0, num_cols, BLOCK_P):
        o_p = c0 + tl.arange(0, BLOCK_P)
        m_p = o_p < num_cols
        tl.store(p_pages + o_p, tl.load(p_row + o_p, mask=m_p), mask=m_p)
    p_tree = i_b.to(tl.int64) * stride_tree
    o_w = tl.arange(0, BLOCK_W)
    for j0 in range(0, width, BLOCK_N):
        o_j = j0 + tl.arange(0, BLOCK_N)
        m_j = o_j < n
        row = start + o_j
        tl.store(out_tokens + row, tl.load(tokens + p_tree + o_j, mask=m_j), mask=m_j)
        tl.store(out_pos + row, prefix + tl.load(depths + p_tree + o_j, mask=m_j), mask=m_j)
        pos = prefix + o_j
        page = tl.load(p_row + tl.minimum(pos // PAGE_SIZE, num_cols - 1), mask=m_j, other=0).to(tl.int64)
        tl.store(out_slots + row, page * PAGE_SIZE + pos % PAGE_SIZE, mask=m_j)
        node = tl.where(m_j, o_j, -1).to(tl.int64)
        bits = _node_bits(node, o_w)
        for _ in range(max_depth):
            node = tl.load(parents + p_tree + tl.maximum(node, 0), mask=node >= 0, other=-1)
            bits |= _node_bits(node, o_w)
        m_x = m_j[:, None] & (o_w < WORDS)[None, :]
        tl.store(out_mask + row[:, None] * WORDS + o_w[None, :], bits, mask=m_x)


# ----------------------------------------------------------------------------------------------
# Host launchers (Triton) and their torch equivalents (CPU, or use_triton=False)


def _pow2(x: int) -> int:
    return 1 << max(0, int(x) - 1).bit_length()


def _pow2_divisor(x: int) -> int:
    return x & -x


def copy_pages(src: torch.Tensor, dst: torch.Tensor, src_idx: torch.Tensor, dst_idx: torch.Tensor,
                use_triton: bool) -> None:
    """``dst[:, dst_idx] = src[:, src_idx]`` for page stores ``[L, pages, page_size, 576]``.

    Triton: one pass, no temporary (no page may be both read and written). Torch: gather then
    scatter (always safe, two passes)."""
    n = src_idx.numel()
    if n == 0:
        return
    num_layers = src.shape[0]
    row = src.shape[2] * src.shape[3]
    if not use_triton:
        s = src.view(num_layers, src.shape[1], row)
        d = dst.view(num_layers, dst.shape[1], row)
        d[:, dst_idx] = s[:, src_idx]
        return
    # whole pages per tile when they are small (page size 1: [8, 1024] masked to 576 values: a
    # program keeps 8 full rows in flight); else tiles of a power-of-two divisor of the page
    block_d = _pow2(row) if row <= 4096 else min(_pow2_divisor(row), 4096)
    block_m = max(1, 8192 // block_d)
    grid = (triton.cdiv(n, block_m), num_layers)
    _copy_pages_kernel[grid](
        src, dst, src_idx, dst_idx, n,
        src.stride(0), dst.stride(0),
        ROW=row, BLOCK_M=block_m, BLOCK_D=block_d, EVEN_D=row % block_d == 0, num_warps=4,
    )


def launch_commit(store: torch.Tensor, table: torch.Tensor, lens: torch.Tensor, tree: torch.Tensor,
                  stack: torch.Tensor, top: torch.Tensor, done: torch.Tensor, marks: torch.Tensor,
                  rows: torch.Tensor, accepted: torch.Tensor, num_accepted: torch.Tensor, n_max: int) -> None:
    """One launch of the commit kernel (see ``_commit_kernel``) on the pool's buffers.

    ``store [L, pages + 1, page_size, 576]``, ``table [S, cols]`` int32, ``lens``/``tree [S]``
    int32, ``stack [pages + 1]`` int32, ``top``/``done [1]`` int32, ``marks [pages + 1]`` int32;
    ``rows [B]`` int64 sequence rows, ``accepted [B, A]`` (column stride 1), ``num_accepted [B]``
    (contiguous), ``n_max`` the largest reserved tree of the B sequences."""
    B, A = accepted.shape
    num_layers, _, ps, d_row = store.shape
    block_a = _pow2(A)
    if ps == 1:
        grid = (B, 1)
        block_d = 64
    else:
        grid = (B, num_layers)
        block_d = max(1, min(64, 4096 // block_a))
    _commit_kernel[grid](
        rows, accepted, num_accepted, table, lens, tree, stack, top, done, marks, store,
        accepted.stride(0), table.stride(0), store.stride(0),
        B, A, grid[0] * grid[1],
        PAGE_SIZE=ps, D_ROW=d_row,
        BLOCK_B=_pow2(B), BLOCK_A=block_a, BLOCK_N=_pow2(n_max),
        BLOCK_F=_pow2(-(-n_max // ps) + 1), BLOCK_D=block_d,
        num_warps=4,
    )


def launch_pop_pages(table: torch.Tensor, lens: torch.Tensor, tree: torch.Tensor, stack: torch.Tensor,
                     top: torch.Tensor, rows: torch.Tensor, counts, max_pages: int, page_size: int,
                     set_tree: bool) -> None:
    """One launch of the page-pop kernel (see ``_pop_pages_kernel``) on the pool's buffers:
    ``table [S, cols]`` int32 (column stride 1), ``lens``/``tree [S]`` int32, ``stack [pages + 1]``
    int32, ``top [1]`` int32; ``rows [B]`` int64 sequence rows, ``counts`` an int or ``[B]`` int64
    (contiguous), ``max_pages`` the most pages one sequence gains."""
    B = rows.shape[0]
    per_seq = isinstance(counts, torch.Tensor)
    _pop_pages_kernel[(1,)](
        rows, counts if per_seq else rows, table, lens, tree, stack, top, B, 0 if per_seq else int(counts),
        table.stride(0),
        PAGE_SIZE=page_size, PER_SEQ=per_seq, TREE=set_tree,
        BLOCK_B=_pow2(B), BLOCK_K=_pow2(max(1, max_pages)),
        num_warps=1,
    )


def launch_step_inputs(table: torch.Tensor, lens: torch.Tensor, tree: torch.Tensor, rows: torch.Tensor,
                       tokens: torch.Tensor, parents: torch.Tensor, depths: torch.Tensor, num_nodes: torch.Tensor,
                       num_rows: int, max_depth: int, num_cols: int, page_size: int, words: int):
    """One launch of the step-inputs kernel (see ``_step_inputs_kernel``), one program per sequence.

    Pool buffers: ``table [S, cols]`` int32 (column stride 1), ``lens``/``tree [S]`` int32;
    ``rows [B]`` int64 sequence rows. Trees: ``tokens``, ``parents``, ``depths [B, n]`` int64 with
    one row stride and column stride 1, ``num_nodes [B]`` int64 (``num_rows`` their sum, a host
    int), ``max_depth`` a host bound of the depths. ``num_cols <= cols`` page-table columns,
    ``words >= ceil(n / 32)`` mask words.

    Returns ``(tokens [T] int64, rope_pos [T] int64, slots [T] int64, page_table [B, num_cols]
    int32, kv_lens [B] int32, qo_indptr [B+1] int32, tree_mask [T, words] int32)``, T = num_rows.
    """
    B, n = tokens.shape
    dev = tokens.device
    T = num_rows
    out = (torch.empty(T, dtype=torch.int64, device=dev), torch.empty(T, dtype=torch.int64, device=dev),
           torch.empty(T, dtype=torch.int64, device=dev), torch.empty(B, num_cols, dtype=torch.int32, device=dev),
           torch.empty(B, dtype=torch.int32, device=dev), torch.empty(B + 1, dtype=torch.int32, device=dev),
           torch.empty(T, words, dtype=torch.int32, device=dev))
    _step_inputs_kernel[(B,)](
        rows, tokens, parents, depths, num_nodes, table, lens, tree, *out,
        B, n, max_depth, tokens.stride(0), table.stride(0), num_cols,
        **step_inputs_constexprs(B, n, num_cols, page_size, words),
        num_warps=4,
    )
    return out


def step_inputs_constexprs(B: int, n: int, num_cols: int, page_size: int, words: int) -> dict:
    """``_step_inputs_kernel``'s constexprs for ``B`` trees of width ``n``, ``num_cols`` page-table
    columns of pages of ``page_size`` and ``words`` mask words (:func:`launch_step_inputs`)."""
    block_w = block_of(words)
    return dict(PAGE_SIZE=page_size, WORDS=words, BLOCK_B=block_of(B), BLOCK_N=max(2, min(_pow2(n), 4096 // block_w)),
                BLOCK_W=block_w, BLOCK_P=min(1024, block_of(num_cols)))
