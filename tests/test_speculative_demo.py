"""``kdtree demo`` end to end at a small size: every stage runs and passes.

On the CPU: the tiny model under the Triton interpreter. On CUDA: the Kimi-K2-attention model
with one layer and short prompts (the full-size run is the GPU job itself, not a test).
"""

from __future__ import annotations

import json

from kdtree_engine.demo import main


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
    runs = report["runs"]
    assert [r["drafter"].split()[0] for r in runs] == ["plain", "ngram", "SYNTHETIC"]
    assert all(r["ok"] for r in runs)
    assert all("lossless" in r["lossless_vs_hf"] or "near-tie" in r["lossless_vs_hf"] for r in runs)
    assert runs[2]["mean_accepted"] > 1.5 and runs[0]["mean_accepted"] == 1.0
    for r in runs:
        assert 0 < r["attn_ms"] <= r["step_ms"]


def test_demo_sweep(capsys, device):
    rc = main(_device_args(device) + ["--sweep", "8,40", "--batch", "1", "--steps", "4", "--kernel", "naive",
                                      "--budget", "4", "--depth", "2", "--no-progress"])
    text = capsys.readouterr().out
    assert rc == 0, text
    assert text.count("prefix ") >= 2 and "speedup" in text
