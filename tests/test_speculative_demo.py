"""``kdtree demo`` end to end at a small size: every stage runs and passes.

On the CPU: the tiny model under the Triton interpreter. On CUDA: the Kimi-K2-attention model
with one layer and short prompts (the full-size run is the GPU job itself, not a test).
"""

from __future__ import annotations

import json

import pytest
import torch

from kdtree_engine.demo import main, near_tie_tolerance, numerics_check, numerics_tolerance
from kdtree_engine.model import MLARunner, build_random_model, tiny_config


def _device_args(device: str) -> list[str]:
    if device == "cuda":
        return ["--device", "cuda", "--layers", "1", "--no-bundles"]
    return ["--device", "cpu"]


def test_demo_small(tmp_path, capsys, device):
    out = tmp_path / "demo.json"
    # prompts of 48/32/16 tokens (seed 0) hold token 0: the HF reference must not take it for padding
    rc = main(_device_args(device) + ["--prefix", "48", "--batch", "3", "--steps", "6", "--kernel", "naive",
                                      "--drafter", "both", "--no-progress", "--json", str(out)])
    text = capsys.readouterr().out
    assert rc == 0, text
    assert "PASS [naive]" in text and "demo: all checks PASS" in text
    report = json.loads(out.read_text())
    (num,) = report["numerics"]
    assert num["ok"] and num["engine_err"] <= num["tol"] == pytest.approx(num["factor"] * num["hf_err"] + num["floor"])
    if device == "cpu":  # fp32 weights: HF's forward is the truth, the fp16 cache's rounding the only tolerance
        assert num["hf_err"] == 0 and num["tol"] == num["floor"] < 1e-2 * num["logit_std"]
    assert report["tie_tol"] == pytest.approx(near_tie_tolerance(num["engine_err"], num["hf_err"]))
    runs = report["runs"]
    assert [r["drafter"].split()[0] for r in runs] == ["plain", "ngram", "SYNTHETIC"]
    assert all(r["ok"] for r in runs)
    assert all("lossless" in r["lossless_vs_hf"] or "near-tie" in r["lossless_vs_hf"] for r in runs)
    assert runs[2]["mean_accepted"] > 1.5 and runs[0]["mean_accepted"] == 1.0
    for r in runs:
        assert 0 < r["device_ms"] <= r["step_ms"] and 0 < r["attn_ms"] <= r["split_device_ms"]
        assert r["tree_ms"] > 0 and r["accept_ms"] > 0 and r["rest_ms"] > 0
        # the split: every phase of the phase-split run (the run itself when eager) in one of four kinds
        assert r["split_device_ms"] == pytest.approx(r["attn_ms"] + r["tree_ms"] + r["accept_ms"] + r["rest_ms"])
        assert r["graphs"] == ("step" if device == "cuda" else "eager")
        assert r["split_vs_run"] is None if device == "cpu" else r["split_vs_run"].startswith("lossless")


def test_demo_sweep(tmp_path, capsys, device):
    out = tmp_path / "sweep.json"
    rc = main(_device_args(device) + ["--sweep", "8,40", "--sweep-batches", "1,2", "--sweep-budgets", "4,2",
                                      "--steps", "4", "--kernel", "naive", "--depth", "2", "--no-progress",
                                      "--json", str(out)])
    text = capsys.readouterr().out
    assert rc == 0, text
    report = json.loads(out.read_text())
    rows = report["sweep"]
    assert report["sweep_complete"] is True
    # per batch and context: plain, then each budget (ascending)
    assert [(r["batch"], r["context"], r["budget"]) for r in rows] == [
        (b, c, k) for b in (1, 2) for c in (8, 40) for k in (0, 2, 4)]
    for r in rows:
        assert r["tokens_per_s"] > 0 and 0 < r["device_ms"] <= r["step_ms"]
        assert r["budget"] == 0 or (r["ok"] and r["in_sync"] and 1 <= r["sync_passes"] <= 4), r
    assert all(r["mean_accepted"] == 1.0 for r in rows if r["budget"] == 0)
    assert (tmp_path / "sweep.png").stat().st_size > 0  # the plot next to the JSON
    assert text.count("batch ") >= len(rows) and "wrote " in text
    assert all(r["timed_captures"] == 0 for r in rows)


def test_demo_sweep_keeps_its_rows_when_it_fails(tmp_path, monkeypatch, device):
    """The JSON holds every finished row, marked incomplete, when a later row raises."""
    import kdtree_engine.demo as demo

    fields, calls = demo._sweep_fields, []

    def failing(*a, **k):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("row 3 fails")
        return fields(*a, **k)

    monkeypatch.setattr(demo, "_sweep_fields", failing)
    out = tmp_path / "sweep.json"
    with pytest.raises(RuntimeError, match="row 3 fails"):
        main(_device_args(device) + ["--sweep", "8", "--sweep-batches", "1", "--sweep-budgets", "2,4", "--steps", "3",
                                     "--kernel", "naive", "--depth", "2", "--no-progress", "--json", str(out)])
    report = json.loads(out.read_text())
    assert report["sweep_complete"] is False and [r["budget"] for r in report["sweep"]] == [0, 2]


def test_numerics_tolerance():
    # bf16 weights and cache: 2 x HF's error, floor one fp32 unit (negligible)
    tol, floor = numerics_tolerance(0.1, 4.0, torch.bfloat16, torch.bfloat16)
    assert floor == pytest.approx(4.0 * 2**-23) and tol == pytest.approx(0.2 + floor)
    # fp32 weights, fp16 cache: HF is the truth; only the cache's rounding is allowed
    tol, floor = numerics_tolerance(0.0, 4.0, torch.float32, torch.float16)
    assert tol == floor == pytest.approx(4.0 * 2**-10)


@pytest.mark.parametrize("dtype,cache_dtype,bad_scale", [
    (torch.float32, torch.float16, 1.02),
    (torch.bfloat16, torch.bfloat16, 1.15),
], ids=["fp32-fp16-cache", "bf16"])
def test_numerics_check_passes_engine_fails_perturbed_engine(dtype, cache_dtype, bad_scale, device):
    """Stage 2's criterion accepts the engine and rejects it with a slightly wrong softmax scale."""
    model = build_random_model(tiny_config(num_hidden_layers=2, first_k_dense_replace=1), seed=0, dtype=dtype,
                               device=device)
    runner = MLARunner(model, kernel="naive", cache_dtype=cache_dtype)
    good = numerics_check(runner, seed=0, prefix_len=20)
    assert good["ok"], good
    assert (good["hf_err"] == 0) == (dtype == torch.float32)
    assert good["model_dtype"] == str(dtype).removeprefix("torch.")
    runner.sm_scale *= bad_scale
    bad = numerics_check(runner, seed=0, prefix_len=20)
    assert not bad["ok"] and bad["engine_err"] > bad["tol"] == pytest.approx(good["tol"]), bad
