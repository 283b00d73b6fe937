"""Launching a Triton or Gluon kernel without Triton's Python launcher once it is compiled.

``kernel[grid](*args)`` binds and specialises every argument on every call before it reaches the
compiled kernel's C launcher (tens of microseconds on a slow host, for each of a verify call's
launches). A :class:`Launcher` makes the first launch of each specialisation that way and
keeps the compiled kernel it returns; a later launch with the same key calls the compiled
kernel's launcher directly (on the current device and stream, as Triton does).

The key is the caller's: :func:`spec_key` builds it from what Triton specialises on (the dtype
and 16-byte alignment of each tensor argument, the exact value of each integer argument), and
the launch functions add their constexprs and options. Under Triton's interpreter there is no
compiled kernel: every launch goes through ``kernel[grid]``. With a launch hook installed
(``triton.knobs.runtime.launch_enter_hook``, e.g. a profiler) too, so the hook sees every launch.

A :class:`Launch` goes further for the repeated calls of one signature (a planned layer): its
arguments are laid out once, and a call passes the caller's tensors to the kept compiled kernel as
data pointers (Triton's C launcher takes an int for a pointer argument and then skips its own
``data_ptr()`` call and ``cuPointerGetAttribute`` check, the caller having checked the devices).

The layer beside :mod:`.plan` (imports torch, Triton and :func:`~kdtree_engine.backend.interpreting` only).
"""

from __future__ import annotations

from operator import itemgetter

import torch
from triton import knobs

from ..backend import interpreting

__all__ = ["Launcher", "Launch", "spec_key", "current_device", "current_stream"]

# compiled kernels a launcher keeps; past this many keys the table starts over (a key holds no
# tensor, only dtypes, alignments and integers: a long run with ever-new strides stays bounded)
MAX_KEYS = 256


def spec_key(tensors, ints: tuple) -> tuple:
    """What Triton specialises a launch on, for the given tensor and integer arguments: each
    tensor's dtype and whether its data pointer is 16-byte aligned, each integer exactly (a
    stricter key than Triton's, which keeps only 1, divisibility by 16 and the integer width:
    a new value costs one launch through Triton, never a wrong kernel)."""
    return tuple([(t.dtype, t.data_ptr() % 16 == 0) for t in tensors]), ints


class Launcher:
    """Launches of one ``@triton.jit`` / ``@gluon.jit`` function (see the module docstring).

    ``launcher(key, grid, args, constexprs)``: ``args`` the kernel's leading parameters in order
    (tensors, integers, floats), ``constexprs`` every later parameter and launch option by name
    (``num_warps``, ...). ``key`` must determine the compiled kernel: :func:`spec_key` of the
    tensor and integer arguments whose dtype, alignment or value can differ between calls, plus
    the constexprs and options (tensors not in the key must always have the same dtype and be
    16-byte aligned).
    """

    def __init__(self, fn):
        self.fn = fn
        self._compiled: dict = {}  # (key, device) -> (compiled kernel, constexpr values in parameter order)

    def __call__(self, key, grid, args, constexprs) -> None:
        if self._compiled and _no_hooks():
            device = current_device()
            hit = self._compiled.get((key, device))
            if hit is not None:
                kernel, tail = hit
                kernel.run(grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1,
                           current_stream(device), kernel.function, kernel.packed_metadata,
                           None, None, None, *args, *tail)
                return
        self._keep(key, args, constexprs, self.fn[grid](*args, **constexprs))

    def warmup(self, key, grid, args, constexprs) -> None:
        """Compile and keep the kernel of ``key`` without launching it (nothing under the
        interpreter, or where it is kept already), so that its first launch costs no compile."""
        if not interpreting() and self.kept(key) is None:
            kernel = self.fn.warmup(*args, grid=grid, **constexprs)
            self._keep(key, args, constexprs, kernel.result() if hasattr(kernel, "result") else kernel)

    def _keep(self, key, args, constexprs, kernel) -> None:
        if kernel is None or not hasattr(kernel, "packed_metadata"):  # the interpreter: nothing compiled
            return
        names = self.fn.arg_names[len(args):]
        if any(name not in constexprs for name in names):  # a defaulted parameter: no fast path
            return
        if len(self._compiled) >= MAX_KEYS:
            self._compiled.clear()
        self._compiled[(key, current_device())] = (kernel, tuple(constexprs[n] for n in names))

    def kept(self, key):
        """``(compiled kernel, constexpr values in parameter order)`` kept for ``key`` on the current
        device, or None (not launched there yet, the interpreter, or a defaulted parameter)."""
        return self._compiled.get((key, current_device())) if self._compiled else None


class Launch:
    """One launch of a :class:`Launcher` laid out once, for calls that differ only in some tensor
    arguments of the same dtypes and 16-byte alignment (the integers, the grid, the other tensors
    and the constexprs fixed).

    The kernel's leading arguments are ``(*head, *picked, *tail)``: ``picked`` are the entries
    ``picks`` of the per-call tuple ``tensors``. ``key``, ``grid``, ``constexprs``: as for the
    launcher. A call goes through the launcher (compiling if needed) until it has kept a compiled
    kernel for the current device; then it calls that kernel's launcher with the data pointers
    ``ptrs`` (ints, same order as ``tensors``) in place of the picked tensors and ``head`` /
    ``tail`` tensors as data pointers taken once. A launch hook sends every call through the
    launcher. Holds no per-call tensor.

    A call returns the ``(device, stream)`` it launched on through the kept kernel (None when it
    went through the launcher); a launch that follows at once (nothing between them switching the
    device or the stream or installing a hook) passes it as ``site``, saving the reads.
    """

    __slots__ = ("_launcher", "_key", "_grid", "_head", "_pick", "_tail", "_constexprs", "_fast")

    def __init__(self, launcher: Launcher, key, grid: tuple, head: tuple, picks: tuple, tail: tuple, constexprs: dict):
        self._launcher, self._key, self._grid, self._constexprs = launcher, key, grid, constexprs
        self._head, self._tail = head, tail
        self._pick = itemgetter(*picks) if len(picks) > 1 else lambda t, i=picks[0]: (t[i],)
        self._fast: dict = {}  # device -> (kernel.run, grid x, y, z, function, metadata, head, tail + constexprs)

    def __call__(self, tensors: tuple, ptrs: tuple, site: tuple[int, int] | None = None) -> tuple[int, int] | None:
        if self._fast and (site is not None or _no_hooks()):
            if site is None:
                device = current_device()
                site = (device, current_stream(device))
            fast = self._fast.get(site[0])
            if fast is not None:
                run, gx, gy, gz, function, meta, head, tail = fast
                run(gx, gy, gz, site[1], function, meta, None, None, None, *head, *self._pick(ptrs), *tail)
                return site
        self._launcher(self._key, self._grid, (*self._head, *self._pick(tensors), *self._tail), self._constexprs)
        kept = self._launcher.kept(self._key)
        if kept is not None:
            kernel, constexprs = kept
            g = (*self._grid, 1, 1)
            self._fast[current_device()] = (kernel.run, g[0], g[1], g[2], kernel.function, kernel.packed_metadata,
                                            _pointers(self._head), (*_pointers(self._tail), *constexprs))
        return None

    def warmup(self, tensors: tuple) -> None:
        """Compile and keep the kernel for calls on ``tensors`` without launching it
        (:meth:`Launcher.warmup`)."""
        self._launcher.warmup(self._key, self._grid, (*self._head, *self._pick(tensors), *self._tail),
                              self._constexprs)


def _pointers(args: tuple) -> tuple:
    return tuple(a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args)


def current_device() -> int:
    """The current CUDA device's index (Triton launches there)."""
    return torch._C._cuda_getDevice()


def current_stream(device: int) -> int:
    """The current stream of ``device`` as Triton's launcher takes it (read on every launch: the
    caller may switch streams between calls)."""
    return torch._C._cuda_getCurrentRawStream(device)


def _no_hooks() -> bool:
    """No launch hook is installed (Triton 3.6 keeps them as hook chains, older versions as a
    function or None)."""
    r = knobs.runtime
    enter, exit_ = r.launch_enter_hook, r.launch_exit_hook
    return not getattr(enter, "calls", enter) and not getattr(exit_, "calls", exit_)
