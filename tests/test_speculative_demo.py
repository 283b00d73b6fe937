"""``kdtree demo`` on the CPU (Triton interpreter, tiny model): every stage runs and passes."""

from __future__ import annotations

import json

from kdtree_engine.demo import main


def test_demo_cpu_quick(tmp_path, capsys):
    out = tmp_path / "demo.json"
    # prompts of 48/32/16 tokens (seed 0) hold token 0: the HF reference must not take it for padding
    rc = main(["--device", "cpu", "--prefix", "48", "--batch", "3", "--steps", "6", "--kernel", "naive",
               "--drafter", "both", "--no-progress", "--json", str(out)])
    text = capsys.readouterr().out
    assert rc == 0, text
    assert "PASS [naive]" in text and "demo: all checks PASS" in text
    report = json.loads(out.read_text())
    runs = report["runs"]
    assert [r["drafter"].split()[0] for r in runs] == ["plain", "ngram", "SYNTHETIC"]
    assert all(r["ok"] for r in runs)
    assert all("lossless:" in r["lossless_vs_hf"] for r in runs)
    assert runs[2]["mean_accepted"] > 1.5 and runs[0]["mean_accepted"] == 1.0
    for r in runs:
        assert 0 < r["attn_ms"] <= r["step_ms"]


def test_demo_cpu_sweep(capsys):
    rc = main(["--device", "cpu", "--sweep", "8,40", "--batch", "1", "--steps", "4", "--kernel", "naive",
               "--budget", "4", "--depth", "2", "--no-progress"])
    text = capsys.readouterr().out
    assert rc == 0, text
    assert text.count("prefix ") >= 2 and "speedup" in text
