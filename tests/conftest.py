"""Test set-up: without CUDA the Triton kernels run under the interpreter, at small sizes.

:func:`kdtree_engine.backend.select_device` decides, here at collection time, before any test
module imports Triton (the interpreter is chosen when Triton loads).
"""

import pytest

from kdtree_engine.backend import select_device

DEVICE = select_device()
HAS_CUDA = DEVICE == "cuda"

requires_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")


@pytest.fixture
def device() -> str:
    return DEVICE
