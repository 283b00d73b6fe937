"""The one place that decides where kernels run: a CUDA device, or the CPU through Triton's interpreter.

Triton reads ``TRITON_INTERPRET`` once, when it is first imported; every module of the package asks
:func:`interpreting` instead of reading the environment, and entry points (the ``kdtree`` command,
the tests) call :func:`select_device` before the first kernel import.

This module imports neither Triton nor any other module of the package.
"""

from __future__ import annotations

import os
import sys

import torch

__all__ = ["interpreting", "select_device", "BackendError"]


class BackendError(RuntimeError):
    """The requested backend cannot be used in this process (no CUDA, or Triton already loaded)."""


def interpreting() -> bool:
    """True when Triton kernels run through the CPU interpreter (``TRITON_INTERPRET`` set)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def select_device(requested: str | None = None) -> str:
    """``"cuda"`` when available (or asked), else ``"cpu"`` with Triton's interpreter switched on.

    Must run before the first kernel import: the interpreter is chosen when Triton loads. Raises
    :class:`BackendError` when ``"cuda"`` is asked for without a CUDA device, or when the CPU is
    chosen after Triton was already imported in compiled mode.
    """
    if requested not in (None, "cuda", "cpu"):
        raise ValueError(f"device must be 'cuda' or 'cpu', got {requested!r}")
    device = requested or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise BackendError("device 'cuda' asked for, but no CUDA device is available")
    if device == "cpu" and not interpreting():
        if "triton" in sys.modules:
            raise BackendError(
                "triton was imported before TRITON_INTERPRET=1 could be set; "
                "set it in the environment to run the kernels on the CPU"
            )
        os.environ["TRITON_INTERPRET"] = "1"
    return device
