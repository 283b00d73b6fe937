"""Test set-up: without CUDA the Triton kernels run under the interpreter, at small sizes.

TRITON_INTERPRET must be set before triton is first imported, hence here, at collection time.
"""

import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

DEVICE = "cuda" if HAS_CUDA else "cpu"

requires_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")


@pytest.fixture
def device() -> str:
    return DEVICE
