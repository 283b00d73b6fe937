"""The FlashMLA peer of ``kdtree bench`` (``--flashmla DIR``), on the CPU with a stand-in module.

The stand-in has FlashMLA's call signature and layouts (q ``[B, s_q, H, 576]``, cache
``[blocks, 64, 1, 576]``, out ``[B, s_q, H, 512]``, lse ``[B, H, s_q]``) and computes causal
attention in float32, so the peer's layout handling (views, the lse transpose in ``collect``) and
its refusals (page size, tree shape) are checked without a GPU.
"""

import json
import textwrap

import pytest
import torch

from conftest import DEVICE
from kdtree_engine.bench.cli import main as bench_main
from kdtree_engine.bench.flashmla import FlashMLAPeer
from kdtree_engine.bench.peers import Unavailable
from kdtree_engine.bench.shapes import Shape, build_case

STAND_IN = textwrap.dedent('''
    import math, types, torch

    def get_mla_metadata(seqlens_k, s_q, h_q, h_k):
        return torch.zeros(1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)

    def dense_decode_fwd(q, kcache, head_dim_v, seqlens_k, block_table, scale, causal, meta, splits):
        B, s_q, H, D = q.shape
        bs = kcache.shape[1]
        out = torch.empty(B, s_q, H, head_dim_v, dtype=q.dtype)
        lse = torch.empty(B, H, s_q, dtype=torch.float32)
        for b in range(B):
            L = int(seqlens_k[b])
            pos = torch.arange(L)
            k = kcache[block_table[b, pos // bs].long(), pos % bs, 0].float()  # [L, 576]
            s = torch.einsum("shd,ld->shl", q[b].float(), k) * scale
            if causal:
                vis = pos[None, :] <= (L - s_q + torch.arange(s_q))[:, None]  # [s_q, L]
                s = s.masked_fill(~vis[:, None, :], float("-inf"))
            out[b] = torch.einsum("shl,ld->shd", torch.softmax(s, -1), k[:, :head_dim_v]).to(q.dtype)
            lse[b] = torch.logsumexp(s, -1).T
        return out, lse, None, None

    def load_flashmla():
        return types.SimpleNamespace(get_mla_metadata=get_mla_metadata, dense_decode_fwd=dense_decode_fwd)
''')


@pytest.fixture
def stand_in(tmp_path):
    (tmp_path / "flashmla_peer.py").write_text(STAND_IN)
    return tmp_path


pytestmark = pytest.mark.skipif(DEVICE != "cpu", reason="the stand-in computes on the CPU")


def test_peer_matches_reference_layouts(stand_in):
    peer = FlashMLAPeer(stand_in)
    assert peer.detect() is None
    case = build_case(Shape(2, 5, 16, 70, 64, "bf16", "chain"), "cpu", seed=1)
    case.reset_outputs()
    prepared = peer.prepare(case)
    prepared.run(0)
    assert torch.isnan(case.sets[0].out).all(), "run must leave the set's buffers to collect"
    prepared.collect(0)
    from kdtree_engine import reference

    ref_out, ref_lse = reference(**case.inputs(0))
    torch.testing.assert_close(case.sets[0].out.double(), ref_out, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(case.sets[0].lse.double(), ref_lse, atol=1e-3, rtol=1e-4)


@pytest.mark.parametrize(
    "shape, why",
    [
        (Shape(1, 5, 16, 70, 1, "bf16", "chain"), "page size 64"),
        (Shape(1, 5, 16, 70, 64, "bf16", "random"), "chain trees only"),
        (Shape(1, 5, 16, 70, 64, "fp16", "chain"), "bf16 only"),
        (Shape(1, 5, 8, 70, 64, "bf16", "chain"), "16..128 heads"),
    ],
)
def test_peer_refuses_what_it_cannot_run(stand_in, shape, why):
    peer = FlashMLAPeer(stand_in)
    assert peer.detect() is None
    with pytest.raises(Unavailable, match=why):
        peer.prepare(build_case(shape, "cpu"))


def test_missing_folder_is_a_note_not_a_crash(tmp_path):
    assert "no flashmla_peer.py" in FlashMLAPeer(tmp_path / "nowhere").detect()
    (tmp_path / "flashmla_peer.py").write_text("def load_flashmla():\n    raise OSError('no nvcc')\n")
    assert "no nvcc" in FlashMLAPeer(tmp_path).detect()


def test_bench_runs_the_peer_side_by_side(stand_in, tmp_path):
    out = tmp_path / "rows.json"
    rc = bench_main(["--flashmla", str(stand_in), "--kernels", "flash", "--tree", "chain", "--heads", "16",
                     "--q-len", "3", "--prefix", "61", "--batch", "1", "--page-size", "64",
                     "--json", str(out), "--csv", str(tmp_path / "r.csv"), "--plot", str(tmp_path / "r.png")])
    assert rc == 0
    rows = json.loads(out.read_text())["rows"]
    assert {(r["kernel"], r["status"], r["tree"]) for r in rows} == {("flash", "ok", "chain"), ("flashmla", "ok", "chain")}
