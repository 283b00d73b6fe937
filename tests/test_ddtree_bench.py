"""The DDTree timing script runs end to end (small sizes) and reports every stage."""

from __future__ import annotations

import json

from kdtree_engine.ddtree.bench import STAGES, TARGETS, main, run_benchmark


def test_run_benchmark_small(device, capsys):
    rows = run_benchmark(device, budgets=(5, 40), vocab=301, depth=4, batch=3, reps=2, warmup=1)
    assert [r["budget"] for r in rows] == [5, 40]
    cuda = device.startswith("cuda")
    for r in rows:
        assert r["matches_reference"] is True
        assert r["errors"] == {}, r["errors"]
        for s in STAGES:
            if s.endswith("_graph") and not cuda:
                assert s not in r or r[s] is None
            else:
                assert r[s] is not None and r[s] > 0, s
    out = capsys.readouterr().out
    assert "torch" in out.splitlines()[0]  # machine line first
    assert "expand_host" in out


def test_cli_writes_json(tmp_path, device):
    path = tmp_path / "ddtree.json"
    rc = main(["--device", device, "--budgets", "3", "--batch", "2", "--vocab", "50", "--depth", "2",
               "--reps", "1", "--warmup", "0", "--json", str(path)])
    assert rc == 0
    data = json.loads(path.read_text())
    assert data["machine"] and data["rows"][0]["nodes"] == 4


def test_cli_targets_table(tmp_path, device, capsys):
    """``--targets`` runs the targets' batches and budget (toy V and L here) and reports each target."""
    path = tmp_path / "targets.json"
    rc = main(["--device", device, "--targets", "--vocab", "40", "--depth", "2", "--reps", "1", "--warmup", "0",
               "--no-graphs", "--json", str(path)])
    assert rc == 0
    data = json.loads(path.read_text())
    assert sorted({(r["batch"], r["budget"]) for r in data["rows"]}) == [(1, 512), (16, 512)]
    got = {t["target"]: t for t in data["targets"]}
    assert sorted(got) == sorted(t[0] for t in TARGETS)
    for name, stage, batch, budget, target in TARGETS:
        e = got[name]
        assert (e["stage"], e["batch"], e["budget"], e["target_us"]) == (stage, batch, budget, target)
        assert e["eager_us"] > 0 and e["graph_us"] is None
        assert e["met"] == (e["eager_us"] <= target)
    assert "issue-13 targets" in capsys.readouterr().out
