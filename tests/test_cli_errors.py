"""Every user error at the command line is one stderr line, ``kdtree: error: ...``, naming the
argument and the value, with a non-zero exit and no traceback; for every subcommand."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import kdtree_engine
from conftest import DEVICE, HAS_CUDA
from kdtree_engine.cli import main as kdtree_main
from kdtree_engine.verify import available_kernels

REFS = Path(__file__).parent / "refs"
GOOD = REFS / "verify_attn_h8_p1_b4.kdtr"


@pytest.fixture
def paths(tmp_path):
    """A regular file, a path under it (never creatable), and a directory."""
    f = tmp_path / "a_file"
    f.write_text("x")
    d = tmp_path / "a_dir"
    d.mkdir()
    return {"FILE": str(f), "UNDER_FILE": str(f / "sub"), "DIR": str(d)}


def run(capsys, argv):
    try:
        rc = kdtree_main(argv)
    except SystemExit as e:
        rc = e.code
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


def assert_one_error_line(rc, err, *words):
    assert rc not in (0, None), f"exit status {rc}: {err}"
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("kdtree: error: "), lines[0]
    for w in words:
        assert w in lines[0], f"{w!r} not in {lines[0]!r}"


# (argv, words the error line must contain); FILE / UNDER_FILE / DIR are filled from `paths`
BAD = {
    "no-command": ([], ["required"]),
    "unknown-command": (["frobnicate"], ["frobnicate"]),
    "refs-no-subcommand": (["refs"], ["required"]),
    "refs-check-missing-file": (["refs", "check", "UNDER_FILE"], ["files", "no such file", "sub"]),
    "refs-check-directory": (["refs", "check", "DIR"], ["files", "not a regular file", "a_dir"]),
    "refs-check-bad-kernel": (["refs", "check", "--kernel", "fast", str(GOOD)], ["--kernel", "fast"]),
    "refs-generate-into-file": (["refs", "generate", "FILE"], ["dir", "not a directory", "a_file"]),
    "refs-generate-unwritable": (["refs", "generate", "UNDER_FILE"], ["dir", "cannot write", "sub"]),
    "refs-generate-unknown-only": (["refs", "generate", "DIR", "--only", "nope"], ["--only", "nope"]),
    "refs-generate-bad-device": (["refs", "generate", "DIR", "--device", "tpu"], ["--device", "tpu"]),
    "bench-heads-0": (["bench", "--heads", "0"], ["--heads", "'0'", "1..128"]),
    "bench-heads-neg": (["bench", "--heads", "-4"], ["--heads", "-4"]),
    "bench-heads-129": (["bench", "--heads", "16,129"], ["--heads", "129"]),
    "bench-heads-text": (["bench", "--heads", "many"], ["--heads", "many"]),
    "bench-prefix-neg": (["bench", "--prefix", "-1"], ["--prefix", "-1"]),
    "bench-q-len-0": (["bench", "--q-len", "0"], ["--q-len", "'0'"]),
    "bench-q-len-5000": (["bench", "--q-len", "5000"], ["--q-len", "5000", "1..1024"]),
    "bench-batch-0": (["bench", "--batch", "0"], ["--batch", "'0'"]),
    "bench-page-size-0": (["bench", "--page-size", "0"], ["--page-size", "'0'"]),
    "bench-repeats-neg": (["bench", "--repeats", "-1"], ["--repeats", "-1"]),
    "bench-min-repeats-0": (["bench", "--min-repeats", "0"], ["--min-repeats", "'0'"]),
    "bench-budget-neg": (["bench", "--budget-ms", "-5"], ["--budget-ms", "-5"]),
    "bench-budget-nan": (["bench", "--budget-ms", "nan"], ["--budget-ms", "nan"]),
    "bench-slow-max-0": (["bench", "--slow-max-ms", "0"], ["--slow-max-ms", "'0'"]),
    "bench-graph-max-neg": (["bench", "--graph-max-us", "-1"], ["--graph-max-us", "-1"]),
    "bench-max-sets-0": (["bench", "--max-sets", "0"], ["--max-sets", "'0'"]),
    "bench-check-seqs-0": (["bench", "--check-seqs", "0"], ["--check-seqs", "'0'"]),
    "bench-check-heads-0": (["bench", "--check-heads", "0"], ["--check-heads", "'0'"]),
    "bench-kernels": (["bench", "--kernels", "fastest"], ["--kernels", "fastest"]),
    "bench-dtype": (["bench", "--dtype", "fp8"], ["--dtype", "fp8"]),
    "bench-unknown-flag": (["bench", "--bogus"], ["--bogus"]),
    "bench-out-dir-is-file": (["bench", "--out-dir", "FILE"], ["--out-dir", "not a directory", "a_file"]),
    "bench-out-dir-unwritable": (["bench", "--out-dir", "UNDER_FILE"], ["--out-dir", "cannot write", "sub"]),
    "bench-json-is-dir": (["bench", "--json", "DIR"], ["--json", "is a directory", "a_dir"]),
    "demo-prefix-0": (["demo", "--prefix", "0"], ["--prefix", "'0'"]),
    "demo-batch-0": (["demo", "--batch", "0"], ["--batch", "'0'"]),
    "demo-steps-0": (["demo", "--steps", "0"], ["--steps", "'0'"]),
    "demo-agreement": (["demo", "--agreement", "1.5"], ["--agreement", "1.5"]),
    "demo-budget-neg": (["demo", "--budget", "-1"], ["--budget", "-1"]),
    "demo-budget-big": (["demo", "--budget", "2000"], ["--budget", "2000", "0..1023"]),
    "demo-depth-neg": (["demo", "--depth", "-1"], ["--depth", "-1"]),
    "demo-page-size-0": (["demo", "--page-size", "0"], ["--page-size", "'0'"]),
    "demo-layers-0": (["demo", "--layers", "0"], ["--layers", "'0'"]),
    "demo-sweep": (["demo", "--sweep", "8,-1"], ["--sweep", "-1"]),
    "demo-sweep-batches": (["demo", "--sweep", "8", "--sweep-batches", "0"], ["--sweep-batches", "0"]),
    "demo-sweep-budgets": (["demo", "--sweep", "8", "--sweep-budgets", "8,1024"], ["--sweep-budgets", "1024"]),
    "demo-plot-no-sweep": (["demo", "--plot", "x.png"], ["--plot", "--sweep"]),
    "demo-plot-is-dir": (["demo", "--sweep", "8", "--plot", "DIR"], ["--plot", "is a directory"]),
    "demo-kernel": (["demo", "--kernel", "fast"], ["--kernel", "fast"]),
    "demo-kernel-twice": (["demo", "--kernel", "naive,naive"], ["--kernel", "naive,naive"]),
    "demo-model-dir": (["demo", "--model-dir", "UNDER_FILE"], ["--model-dir", "no such directory"]),
    "demo-model-dir-empty": (["demo", "--model-dir", "DIR", "--no-hf-check"], ["--model-dir", "a_dir", "model.safetensors"]),
    "demo-json-is-dir": (["demo", "--json", "DIR"], ["--json", "is a directory"]),
    "demo-refs-dir-is-file": (["demo", "--refs-dir", "FILE"], ["--refs-dir", "not a directory"]),
}
if not HAS_CUDA:  # asking for a device that is not there is a user error too
    BAD["bench-no-cuda"] = (["bench", "--device", "cuda", "--no-files"], ["cuda"])
    BAD["demo-no-cuda"] = (["demo", "--device", "cuda"], ["cuda"])
    BAD["refs-check-no-cuda"] = (["refs", "check", "--device", "cuda", str(GOOD)], ["cuda"])
if "hopper" not in available_kernels(DEVICE):  # a kernel this device does not run
    BAD["refs-check-kernel-not-here"] = (["refs", "check", "--kernel", "hopper", str(GOOD)], ["--kernel", "hopper", "does not run"])
    BAD["demo-kernel-not-here"] = (["demo", "--kernel", "naive,hopper"], ["--kernel", "hopper", "does not run"])


@pytest.mark.parametrize("case", list(BAD), ids=list(BAD))
def test_bad_argument_is_one_error_line(case, paths, capsys):
    argv, words = BAD[case]
    argv = [paths.get(a, a) for a in argv]
    words = [paths.get(w, w) for w in words]
    rc, out, err = run(capsys, argv)
    assert_one_error_line(rc, err, *words)
    assert "Traceback" not in out


def test_refs_check_unreadable_files_fail_one_line_each(tmp_path, capsys):
    """Empty, random-bytes and truncated files: one FAIL line per file naming it, exit 1."""
    data = GOOD.read_bytes()
    files = {"empty.kdtr": b"", "random.kdtr": os.urandom(4096), "truncated.kdtr": data[: len(data) // 2],
             "header-only.kdtr": data[:200]}
    for name, blob in files.items():
        (tmp_path / name).write_bytes(blob)
    rc, out, err = run(capsys, ["refs", "check", "--kernel", "naive", *(str(tmp_path / n) for n in files)])
    assert rc == 1
    assert "Traceback" not in out + err
    lines = out.strip().splitlines()
    assert len(lines) == len(files) + 1, out
    for name, line in zip(files, lines):
        assert line.startswith(f"FAIL {name}: not a readable bundle"), line
    assert lines[-1].startswith(f"{len(files)} FAIL")


def _subprocess(*argv):
    env = dict(os.environ, PYTHONPATH=str(Path(kdtree_engine.__file__).parents[1]))
    return subprocess.run([sys.executable, "-m", "kdtree_engine.cli", *argv], capture_output=True, text=True,
                          env=env, timeout=300)


def test_version():
    p = _subprocess("--version")
    assert p.returncode == 0 and p.stdout.strip() == f"kdtree-engine {kdtree_engine.__version__}"


@pytest.mark.parametrize("argv", [["refs", "check", "."], ["bench", "--heads", "0"], ["demo", "--batch", "0"]],
                         ids=["refs", "bench", "demo"])
def test_no_traceback_in_a_fresh_process(argv):
    p = _subprocess(*argv)
    assert p.returncode == 2
    assert p.stderr.startswith("kdtree: error: ") and len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert "Traceback" not in p.stderr + p.stdout


def test_refs_check_bundle_breaking_the_contract_is_a_fail_line(tmp_path, capsys):
    """A readable bundle whose inputs the contract rejects: a FAIL line per kernel, exit 1."""
    import dataclasses

    from kdtree_engine.bundles import load_bundle, save_bundle

    good = load_bundle(GOOD)
    bad = dataclasses.replace(good, inputs={**good.inputs, "kv_lens": good.inputs["kv_lens"].to(torch.int64)})
    path = save_bundle(bad, tmp_path / "int64_lens.kdtr")
    rc, out, err = run(capsys, ["refs", "check", "--kernel", "naive", str(path)])
    assert rc == 1 and "Traceback" not in out + err
    assert out.splitlines()[0].startswith("FAIL [naive] int64_lens.kdtr: inputs rejected: "), out
