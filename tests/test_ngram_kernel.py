"""The n-gram drafter's Triton path (``ngram_draft``) against its tensor ops, bit for bit, on
awkward inputs (Triton's interpreter on the CPU)."""

import pytest
import torch

from kdtree_engine.model.drafters import NGramDrafter


def _both(d_kw, history, lengths, L, device):
    history, lengths = history.to(device), lengths.to(device)
    kern = NGramDrafter(**d_kw, use_triton=True).draft_tensor(history, lengths, L)
    ref = NGramDrafter(**d_kw, use_triton=False).draft_tensor(history, lengths, L)
    assert kern.shape == ref.shape and kern.dtype == ref.dtype == torch.float32
    assert torch.equal(kern.view(torch.int32), ref.view(torch.int32)), (kern - ref).abs().max()
    return ref


def _hist(rows, C, fill=7):
    h = torch.full((len(rows), C), fill, dtype=torch.int64)
    for b, r in enumerate(rows):
        h[b, : len(r)] = torch.as_tensor(r)
    return h, torch.tensor([len(r) for r in rows])


def test_length_one_and_single_column(device):
    for C in (1, 3):
        h, n = _hist([[5]], C)
        out = _both(dict(vocab_size=10), h, n, 4, device)
        assert (out == 0).all()  # no earlier position: uniform


@pytest.mark.parametrize("kw", [dict(), dict(max_ngram=3, min_ngram=2), dict(max_ngram=1, max_matches=3),
                                dict(max_ngram=5, max_matches=1, smoothing=0.2), dict(max_matches=64)])
def test_ragged_random(device, kw):
    g = torch.Generator().manual_seed(1)
    for V, C, B in ((4, 37, 5), (16, 300, 3), (50, 64, 1)):
        h = torch.randint(0, V, (B, C), generator=g)
        n = torch.randint(1, C + 1, (B,), generator=g)
        n[0] = C
        for L in (1, 6, 40):
            _both(dict(vocab_size=V, **kw), h, n, L, device)


def test_repeated_tokens_many_matches(device):
    h, n = _hist([[3] * 50, [3] * 2, [1, 2] * 20, [3] * 9 + [4]], 60)
    out = _both(dict(vocab_size=8, max_matches=8), h, n, 12, device)
    assert out[0, 0, 3] > out[0, 0, 0]


def test_no_matches_and_min_ngram(device):
    h, n = _hist([list(range(20)), [1, 2, 9, 3, 2], [4, 5, 6, 4]], 25)
    out = _both(dict(vocab_size=32, max_ngram=3, min_ngram=2), h, n, 5, device)
    assert (out == 0).all()  # best lengths 0, 1, 1: below min_ngram
    out = _both(dict(vocab_size=32, max_ngram=3, min_ngram=1), h, n, 5, device)
    assert (out[0] == 0).all() and (out[1, 0] != 0).any()


def test_followers_past_the_context(device):
    # the match ends right before the context's last token: few followers, later positions uniform
    h, n = _hist([[1, 2, 3, 1, 2, 3], [9, 8, 9]], 8, fill=1)
    out = _both(dict(vocab_size=12), h, n, 8, device)
    assert (out[:, -1] == 0).all()


def test_many_chunks(device):
    """Histories longer than one match program's chunk: the most recent matches span chunks."""
    g = torch.Generator().manual_seed(3)
    C = 2600
    h = torch.randint(0, 40, (3, C), generator=g)
    motif = torch.tensor([5, 6, 7, 8])
    for p in (10, 1020, 1021, 1500, 2047, 2048, 2400):
        h[:, p : p + 4] = motif
    n = torch.tensor([C, 2052, 1030])
    for b in range(3):
        h[b, n[b] - 4 : n[b]] = motif
    for kw in (dict(), dict(max_matches=3), dict(max_matches=12, max_ngram=6)):
        _both(dict(vocab_size=40, **kw), h, n, 7, device)


def test_strided_history_and_draft(device):
    g = torch.Generator().manual_seed(4)
    wide = torch.randint(0, 6, (4, 90), generator=g)
    h = wide[1:, 10:70]  # non-zero offset, row stride 90
    _both(dict(vocab_size=6), h, torch.tensor([60, 1, 33]), 5, device)
    # column-major history (column stride != 1) and lengths in a strided slice
    _both(dict(vocab_size=6), h.t().contiguous().t(), torch.tensor([60, -1, 1, -1, 33])[::2], 5, device)
    d = NGramDrafter(10, max_ngram=3)
    ctx = torch.tensor([1, 2, 3, 4, 1, 2, 3, 5, 1, 2, 3])
    assert torch.equal(d.draft([ctx], 4), NGramDrafter(10, max_ngram=3, use_triton=False).draft([ctx], 4))
