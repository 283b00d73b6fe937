"""``kdtree bench``: tree-verify attention kernels side by side against the roofline.

Modules: :mod:`~kdtree_engine.bench.cli` (the command), :mod:`~kdtree_engine.bench.shapes`
(presets, work per call, inputs on the device), :mod:`~kdtree_engine.bench.timing` (CUDA events,
graphs, ceilings), :mod:`~kdtree_engine.bench.peers` (the implementations compared),
:mod:`~kdtree_engine.bench.runner` (the correctness gate and the sweep),
:mod:`~kdtree_engine.bench.report` (table, JSON, CSV, plot). See docs/benchmark.md.

Importing this package does not import Triton (the CLI sets ``TRITON_INTERPRET`` first on a
machine without CUDA).
"""
