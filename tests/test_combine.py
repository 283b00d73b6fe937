"""The grid barrier's arithmetic, run through Triton's interpreter (which runs programs one after
another, so only the last arrival can be run: the word is set to what the others left).

The fused merge itself needs every program resident at once: tested on the GPU
(test_verify_kernels.py::test_fused_combine_matches_the_combine_kernel).
"""

import pytest
import torch
import triton

from conftest import DEVICE
from kdtree_engine.verify.combine import grid_barrier

TOP = 1 << 31


@triton.jit
def _last_arrival(word, me, parties):
    grid_barrier(word, me, parties)


def _as_int32(v: int) -> int:
    v %= 1 << 32
    return v - (1 << 32) if v >= TOP else v


@pytest.mark.parametrize("parties", [1, 2, 7, 132, 1024])
@pytest.mark.parametrize("last", ["party 0", "another"])
@pytest.mark.parametrize("start", [0, TOP])
def test_last_arrival_flips_the_top_bit_and_restores_the_rest(parties, last, start):
    """Party 0 adds 2^31 - (parties - 1), every other 1: from a word whose low 31 bits are zero
    (what every finished barrier leaves), the sum carries into the top bit only at the last
    arrival, whichever party that is; its wait then ends at once, the low bits zero again (a
    barrier that miscounts would hang here or leave low bits)."""
    if last == "another" and parties == 1:
        pytest.skip("one party: it is party 0")
    me = 0 if last == "party 0" else parties - 1
    # what the other parties added before the last one
    others = (parties - 1) if me == 0 else (TOP - (parties - 1)) + (parties - 2)
    word = torch.tensor([_as_int32(start + others)], dtype=torch.int32, device=DEVICE)
    _last_arrival[(1,)](word, me, parties)
    assert word.item() == _as_int32(start + TOP)

