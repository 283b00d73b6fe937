"""Test set-up: without CUDA the Triton kernels run under the interpreter, at small sizes.

:func:`kdtree_engine.backend.select_device` decides, here at collection time, before any test
module imports Triton (the interpreter is chosen when Triton loads).
"""

import importlib.util
import math
from pathlib import Path

import pytest
import torch

from kdtree_engine import reference, verify_attention  # loads no Triton (select_device comes first)
from kdtree_engine.backend import select_device
from kdtree_engine.testing import TOLERANCES, compare

DEVICE = select_device()
HAS_CUDA = DEVICE == "cuda"

requires_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")


@pytest.fixture
def device() -> str:
    return DEVICE


def load_script(name: str):
    """``scripts/<name>.py`` as a module (the scripts folder is not a package)."""
    spec = importlib.util.spec_from_file_location(name, Path(__file__).parents[1] / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_checked(c, kernel, dtype_name, **kw):
    """``verify_attention(**c, kernel=kernel, **kw)`` with NaN-prefilled outputs, compared with the
    float64 reference at ``dtype_name``'s tolerances; returns ``(out, lse)``."""
    T, H, _ = c["q"].shape
    out = torch.full((T, H, 512), math.nan, dtype=c["q"].dtype, device=c["q"].device)
    lse = torch.full((T, H), math.nan, dtype=torch.float32, device=c["q"].device)
    verify_attention(**c, kernel=kernel, out=out, lse=lse, **kw)
    r_out, r_lse = reference(**c)
    res_out = compare(out, r_out, *TOLERANCES[dtype_name]["out"])
    res_lse = compare(lse, r_lse, *TOLERANCES[dtype_name]["lse"])
    assert res_out.ok, f"out: {res_out} {res_out.detail}"
    assert res_lse.ok, f"lse: {res_lse} {res_lse.detail}"
    return out, lse


def unplanned_workspace(c: dict, stream: int | None = None):
    """The workspace ``verify_attention`` planned into for the case ``c`` when given no plan, on
    ``stream`` (a raw CUDA stream; default: the current one), or None: a lookup that creates nothing."""
    from kdtree_engine.verify import api

    q = c["q"]
    if stream is None:
        stream = torch.cuda.current_stream(q.device).cuda_stream if q.is_cuda else 0
    return api._UNPLANNED.get((q.device, q.shape[1], stream))
