"""Golden bundles: format round trip, checked-in goldens, generator determinism, the checker CLI."""

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import DEVICE, HAS_CUDA
from kdtree_engine import reference
from kdtree_engine.bundles import check_bundle, load_bundle, make_bundle, save_bundle, standard_specs
from kdtree_engine.cli import main as kdtree_main

REFS = Path(__file__).parent / "refs"
CHECKED_IN = sorted(REFS.glob("*.kdtr"))
SPECS = {s.name: s for s in standard_specs()}


def test_checked_in_bundles_exist():
    assert len(CHECKED_IN) >= 3


@pytest.mark.parametrize("path", CHECKED_IN, ids=[p.stem for p in CHECKED_IN])
def test_golden_bundle_is_reproduced_bitwise(path):
    """The generator still produces the checked-in inputs and (recomputed) float64 expectations."""
    stored = load_bundle(path)
    fresh = make_bundle(SPECS[stored.spec.name])
    for k, v in stored.inputs.items():
        assert torch.equal(v.nan_to_num(7.0), fresh.inputs[k].nan_to_num(7.0)), k
    torch.testing.assert_close(stored.expected_out, fresh.expected_out, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(stored.expected_lse, fresh.expected_lse, rtol=1e-12, atol=1e-14)
    # and the expectation is the reference of the stored inputs (float64 sums may be ordered
    # differently by another torch build: equal to rounding, not bitwise)
    out, lse = reference(**stored.inputs, sm_scale=stored.spec.sm_scale)
    torch.testing.assert_close(out, stored.expected_out, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(lse, stored.expected_lse, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("kernel", ["naive", "flash"])
@pytest.mark.parametrize("path", CHECKED_IN, ids=[p.stem for p in CHECKED_IN])
def test_kernels_pass_checked_in_bundles(path, kernel):
    result = check_bundle(load_bundle(path), kernel, DEVICE)
    assert result.ok, result.line
    assert result.line.startswith(f"PASS [{kernel}] {path.name} ")


def test_round_trip(tmp_path):
    bundle = make_bundle(SPECS["verify_attn_page16_h16"])
    path = save_bundle(bundle, tmp_path / "x.kdtr")
    back = load_bundle(path)
    assert back.spec == bundle.spec and back.tolerances == bundle.tolerances
    for k in bundle.inputs:
        assert back.inputs[k].dtype == bundle.inputs[k].dtype
        assert torch.equal(back.inputs[k].nan_to_num(0.5), bundle.inputs[k].nan_to_num(0.5))
    assert back.expected_out.dtype == torch.float64


def test_standard_set_covers_the_issue():
    names = set(SPECS)
    for seed_case in ["h16_p2048_b16", "h64_p128_b32", "h64_p512_b8", "h8_p0_b8", "h8_p1_b4"]:
        assert f"verify_attn_{seed_case}" in names
    assert {s.page_size for s in SPECS.values()} >= {1, 16, 64}
    assert any(s.dtype == "fp16" for s in SPECS.values())
    assert any(len(s.trees) >= 4 and len({len(t) for t in s.trees}) > 1 for s in SPECS.values())  # ragged
    assert any(max(len(t) for t in s.trees) > 64 for s in SPECS.values())
    large = standard_specs(large=True)
    assert any(s.prefix_lens[0] == 131072 and s.page_size == 1 for s in large)


def test_wrong_file_is_refused(tmp_path):
    save_file({"x": torch.zeros(1)}, str(tmp_path / "bad.kdtr"), metadata={"format": "other"})
    with pytest.raises(ValueError, match="not a kdtree verify bundle"):
        load_bundle(tmp_path / "bad.kdtr")
    src = CHECKED_IN[0]
    tensors = load_file(str(src))
    save_file(tensors, str(tmp_path / "v9.kdtr"), metadata={"format": "kdtree-verify-bundle", "version": "9"})
    with pytest.raises(ValueError, match="version '9'"):
        load_bundle(tmp_path / "v9.kdtr")


def _rewrite(src, dst, **meta_edits):
    """``src`` saved as ``dst`` with metadata fields replaced (JSON values)."""
    from safetensors import safe_open

    with safe_open(str(src), framework="pt") as f:
        meta = dict(f.metadata())
    meta.update({k: json.dumps(v) for k, v in meta_edits.items()})
    save_file(load_file(str(src)), str(dst), metadata=meta)
    return dst


def test_tampered_metadata_is_refused(tmp_path):
    """The checker takes no tolerance looser than this build's (a bundle with garbage expected
    values and tolerances of 1e9 printed PASS), and the tensors must match the spec its PASS line
    reports (a spec of other trees or dtype passed); malformed tolerances are a BundleError, not a
    KeyError or AttributeError traceback."""
    src = REFS / "verify_attn_h8_p0_b8.kdtr"
    spec = json.loads(json.dumps(load_bundle(src).spec.to_dict()))
    for name, edits, match in (
        ("loose", dict(tolerances={"out": [1e9, 0], "lse": [1e9, 0]}), "not within this build's"),
        ("inf", dict(tolerances={"out": [math.inf, 0], "lse": [0, 0]}), "not within this build's"),
        ("no-out", dict(tolerances={"lse": [0, 0]}), "KeyError"),
        ("list", dict(tolerances=[[0, 0], [0, 0]]), "TypeError|AttributeError"),
        ("trees", dict(spec=spec | {"trees": [[-1]], "prefix_lens": [999999]}), "its spec says"),
        ("dtype", dict(spec=spec | {"dtype": "fp16"}, tolerances={"out": [1e-3, 1e-3], "lse": [1e-3, 1e-4]}),
         "its spec says fp16"),
    ):
        with pytest.raises(ValueError, match=match):
            load_bundle(_rewrite(src, tmp_path / f"{name}.kdtr", **edits))
    tight = load_bundle(_rewrite(src, tmp_path / "tight.kdtr", tolerances={"out": [5e-3, 1e-2], "lse": [1e-3, 0]}))
    assert tight.tolerances == {"out": (5e-3, 1e-2), "lse": (1e-3, 0.0)}  # tighter ones are kept


def test_cli_check_fails_on_a_corrupted_expectation(tmp_path, capsys):
    bundle = load_bundle(REFS / "verify_attn_h8_p0_b8.kdtr")
    good = save_bundle(bundle, tmp_path / "good.kdtr")
    bundle.expected_out[1, 2, 3] += 0.5
    bad = save_bundle(bundle, tmp_path / "bad.kdtr")
    device = ["--device", DEVICE]
    assert kdtree_main(["refs", "check", "--kernel", "naive", str(good), *device]) == 0
    assert kdtree_main(["refs", "check", "--kernel", "naive", str(good), str(bad), *device]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("PASS [naive] good.kdtr") and "max_abs=" in lines[0]
    assert any(line.startswith("FAIL [naive] bad.kdtr") and "(1, 2, 3)" in line for line in lines)


def test_cli_generate_only(tmp_path, capsys):
    assert kdtree_main(["refs", "generate", str(tmp_path), "--only", "verify_attn_h8_p1_b4", "--device", DEVICE]) == 0
    assert [p.name for p in tmp_path.iterdir()] == ["verify_attn_h8_p1_b4.kdtr"]
    meta_spec = json.loads(json.dumps(load_bundle(tmp_path / "verify_attn_h8_p1_b4.kdtr").spec.to_dict()))
    assert meta_spec["name"] == "verify_attn_h8_p1_b4"


# The full standard set through both kernels: minutes in the CPU interpreter, so the flash kernel
# checks every bundle there and the naive kernel the bundles up to ~600 (T x H) programs; the GPU
# script checks everything with both.
NAIVE_CPU_MAX_PROGRAMS = 600


@pytest.mark.parametrize("name", list(SPECS))
def test_standard_bundles(name):
    spec = SPECS[name]
    bundle = make_bundle(spec, DEVICE)
    programs = sum(len(t) for t in spec.trees) * spec.num_heads
    kernels = ["flash", "naive"] if HAS_CUDA or programs <= NAIVE_CPU_MAX_PROGRAMS else ["flash"]
    for kernel in kernels:
        result = check_bundle(bundle, kernel, DEVICE)
        assert result.ok, result.line
    assert not math.isnan(float(bundle.expected_out.sum()))
