"""The CUDA C++ Hopper kernel (verify/hopper_cuda.py): its build at first use, where it runs, and its
fused merge.

On the CPU CI: the import, the nvcc lookup, the build's cache and its message, no state shared by
builds loaded in one process (nvcc builds for sm_90a without a GPU where it is installed; skipped
where it is not), the clear errors without a compiler or a GPU, and that it runs only where named.
Its results against the float64 reference are GPU tests in test_verify_hopper.py and
test_verify_kernels.py (parametrised over the planned kernels).
"""

import ctypes
import math
import shutil
import subprocess
import types
from pathlib import Path

import pytest
import torch

from conftest import DEVICE, run_checked
from kdtree_engine import verify_attention
from kdtree_engine.bench.runner import detect_ours
from kdtree_engine.testing import CaseSpec, build_case, random_tree
from kdtree_engine.verify import available_kernels, hopper_cuda, plan_verify
from kdtree_engine.verify.op import resolve

G = torch.Generator().manual_seed(77)
requires_nvcc = pytest.mark.skipif(hopper_cuda.compiler() is None, reason="needs nvcc")
requires_hopper_cuda = pytest.mark.skipif(not hopper_cuda.available(), reason="needs an sm_90 GPU and nvcc")


@pytest.fixture
def fresh_builds(monkeypatch, tmp_path):
    """An empty build cache, and the in-process cache of loaded builds cleared before and after."""
    monkeypatch.setenv("KDTREE_CACHE_DIR", str(tmp_path))
    hopper_cuda.library.cache_clear()
    yield tmp_path
    hopper_cuda.library.cache_clear()


def test_import_never_fails_and_the_cpu_does_not_run_it():
    assert hopper_cuda.available("cpu") is False
    assert "hopper_cuda" not in available_kernels("cpu", opt_in=True)


def test_compiler_lookup(monkeypatch, tmp_path):
    fake = tmp_path / "nvcc"
    fake.write_text("")
    monkeypatch.setenv("KDTREE_NVCC", str(fake))
    assert hopper_cuda.compiler() == str(fake)
    monkeypatch.setenv("KDTREE_NVCC", str(tmp_path / "missing"))
    assert hopper_cuda.compiler() is None


def test_no_compiler_is_a_clear_error(monkeypatch, fresh_builds):
    monkeypatch.setenv("KDTREE_NVCC", str(fresh_builds / "missing"))
    with pytest.raises(hopper_cuda.BuildError, match="no nvcc was found .*KDTREE_NVCC"):
        hopper_cuda.library()
    assert hopper_cuda.available("cuda") is False  # and so neither "auto" nor a list of kernels offers it


@requires_nvcc
def test_build_is_cached_says_so_and_fits_its_params(fresh_builds, capfd):
    """Built once into the cache (a note on stderr), loaded from it afterwards (no note); the
    kernel's Params is this module's (the library checks it at load) and its shared memory fits an
    H200 block (232,448 bytes)."""
    so = hopper_cuda.library()
    assert "building the Hopper CUDA kernel" in capfd.readouterr().err
    assert [p.suffix for p in fresh_builds.iterdir()] == [".so"]  # no partial file left behind
    assert so.kd_verify_params_bytes() == ctypes.sizeof(hopper_cuda.Params)
    so.kd_verify_smem_bytes.restype = ctypes.c_int
    assert 0 < so.kd_verify_smem_bytes() <= 232448
    hopper_cuda.library.cache_clear()
    hopper_cuda.library()
    assert "building" not in capfd.readouterr().err


@requires_nvcc
@pytest.mark.parametrize("flags", ["-DKD_TMA=0 -DKD_EVICT_FIRST=0",
                                   "-DKD_CONSUMER_TMA=1 -DKD_FENCE_TMA=0 -DKD_WATCHDOG=1 -DKD_PDL=1",
                                   "-DKD_MERGE_SPLITS=4 -DKD_MERGE_WARPS=1"])
def test_the_variants_the_perf_log_times_build(fresh_builds, flags):
    """The -D variants that the perf log's A/Bs and checks name build, with the library's Params."""
    assert hopper_cuda.library(flags).kd_verify_params_bytes() == ctypes.sizeof(hopper_cuda.Params)


def process_wide_objects(library: Path) -> list[str]:
    """The library's ``STB_GNU_UNIQUE`` symbols (``nm`` type ``u``), demangled: objects the dynamic
    linker keeps once per process, shared by every library that defines them, even loaded with
    ``RTLD_LOCAL`` (a function-local static of an inline function or class member, for one)."""
    nm = subprocess.run(["nm", "-D", "-C", str(library)], capture_output=True, text=True, check=True).stdout
    return [line.split(" u ", 1)[1] for line in nm.splitlines() if " u " in line]


@requires_nvcc
@pytest.mark.skipif(shutil.which("nm") is None, reason="needs binutils' nm")
@pytest.mark.parametrize("source", ["library", "step spike"])
def test_builds_share_no_state_in_a_process(fresh_builds, source):
    """Several builds are loaded into one process (the A/Bs time ``-D`` variants side by side), so a
    build keeps its once-only state (the kernel's shared-memory attribute) to itself: no process-wide
    object but the driver's tensor-map encoder, which is the same function for every build. The spike's
    launch configuration was such an object once: every build loaded after the first launched without
    its shared memory ("invalid argument", perf log run 50)."""
    if source == "library":
        path = Path(hopper_cuda.library()._name)
    else:
        path = fresh_builds / "step.so"
        spike = Path(__file__).parents[1] / "scripts" / "hopper_cuda_step.cu"
        subprocess.run([hopper_cuda.compiler(), *hopper_cuda.NVCC_TARGET, "-shared", "-Xcompiler", "-fPIC",
                        "-DKD_MULTICAST=3", "-o", str(path), str(spike)], check=True, capture_output=True)
    assert [s for s in process_wide_objects(path) if not s.startswith("make_map(")] == []


@requires_nvcc
def test_a_failed_build_says_why(fresh_builds):
    with pytest.raises(hopper_cuda.BuildError, match="nvcc could not build hopper_cuda.cu"):
        hopper_cuda.library("-DKD_TMA=not_a_number")
    assert not any(fresh_builds.iterdir())


def test_runs_only_where_named():
    """Opt-in: not in the kernels a device runs, never "auto"; named where it cannot run, a
    ValueError saying what it needs; the benchmark takes it only by name."""
    c = build_case(CaseSpec("named", 2, [5], [[-1, 0]]), DEVICE)
    plan = plan_verify([7], [0, 2], 2, DEVICE)
    assert "hopper_cuda" not in available_kernels(DEVICE)
    assert resolve("auto", c["q"], c["kv_cache"], plan.tables.config) != "hopper_cuda"
    assert "hopper_cuda" not in [impl.name for impl in detect_ours(None, DEVICE)[0]]
    if "hopper_cuda" not in available_kernels(DEVICE, opt_in=True):
        with pytest.raises(ValueError, match="kernel='hopper_cuda' needs an sm_90 GPU and an nvcc"):
            verify_attention(**c, kernel="hopper_cuda")
        assert detect_ours(["hopper_cuda"], DEVICE) == ([], {"hopper_cuda": "needs an sm_90 GPU and nvcc"})


def test_prepare_refuses_an_out_it_cannot_store_to():
    """An out with odd strides (the contract allows any): refused before anything is built."""
    q = torch.zeros(2, 4, 576, dtype=torch.bfloat16)
    out = torch.zeros(2, 4, 512, dtype=torch.bfloat16)
    odd = torch.zeros(2, 4, 513, dtype=torch.bfloat16)[..., :512]
    assert not hopper_cuda.supports_out(odd) and hopper_cuda.supports_out(out)
    with pytest.raises(ValueError, match="out 4-byte aligned"):
        hopper_cuda.prepare(q, torch.zeros(3, 64, 576, dtype=torch.bfloat16), None, None, None, None, 0.04, odd,
                            None, types.SimpleNamespace(in_kernel=False))


@requires_hopper_cuda
def test_odd_out_strides_are_refused_on_the_gpu():
    c = build_case(CaseSpec("odd", 4, [100], [random_tree(5, G)], page_size=16), "cuda")
    out = torch.full((5, 4, 513), math.nan, dtype=torch.bfloat16, device="cuda")[..., :512]
    with pytest.raises(ValueError, match="out 4-byte aligned"):
        verify_attention(**c, kernel="hopper_cuda", out=out)


@requires_hopper_cuda
@pytest.mark.parametrize("heads, nodes", [(8, 8), (16, 8), (16, 9), (64, 5), (64, 9)],
                         ids=["1-group", "2-groups", "3-groups", "5-groups", "9-groups"])
def test_fused_merge_shares_a_rows_splits_between_warps(heads, nodes):
    """The fused merge on one planned sequence whose 1, 2, 3, 5 or 9 row blocks are each split across
    the grid: the W warps of a row share its splits, W the most of 1, 2, 4, 8 that keeps every CTA at
    one item (at 132 SMs: 8, 8, 4, 2, 1), and with W > 1 fold their parts through shared memory.
    Against the reference, and bitwise equal over two calls."""
    spec = CaseSpec("merge", heads, [20000], [random_tree(nodes, G)], page_size=64)
    c = build_case(spec, "cuda")
    plan = plan_verify(c["kv_lens"].cpu(), c["qo_indptr"].cpu(), heads, "cuda")
    assert plan.num_groups == math.ceil(heads * nodes / 64)
    out1, lse1 = run_checked(c, "hopper_cuda", "bf16", plan=plan)
    out2, lse2 = run_checked(c, "hopper_cuda", "bf16", plan=plan)
    assert torch.equal(out1, out2) and torch.equal(lse1, lse2)
