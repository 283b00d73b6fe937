"""The verify package imports downward only: contract <- reference, launch <- scheduler <- plan <- combine <- kernels <- op <- api.

Every import of every module (function-level ones included) is read with ``ast``; a module may
import only modules of a lower layer. Each module also imports on its own in a fresh interpreter
(a cycle would fail there, whatever was imported before).
"""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import kdtree_engine.verify

VERIFY = Path(kdtree_engine.verify.__file__).parent
LAYERS = {
    "contract": 0,
    "reference": 1,
    "launch": 1,
    "scheduler": 2,
    "plan": 3,
    "combine": 4,
    "triton_naive": 5,
    "triton_flash": 5,
    "hopper": 5,
    "hopper_cuda": 5,
    "op": 6,
    "api": 7,
    "__init__": 8,
}


def verify_imports(path: Path) -> set[str]:
    """Modules of ``kdtree_engine.verify`` that ``path`` imports (``from .x import``, ``from . import x``)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            mod = node.module or ""
            if node.level == 1:  # .x or . (this package)
                found |= {mod.split(".")[0]} if mod else {a.name for a in node.names}
            elif node.level == 0 and mod.startswith("kdtree_engine.verify."):
                found.add(mod.split(".")[2])
        elif isinstance(node, ast.Import):
            found |= {a.name.split(".")[2] for a in node.names if a.name.startswith("kdtree_engine.verify.")}
    return found


def test_every_module_has_a_layer():
    assert {p.stem for p in VERIFY.glob("*.py")} == set(LAYERS)


@pytest.mark.parametrize("module", sorted(LAYERS))
def test_imports_only_lower_layers(module):
    imported = verify_imports(VERIFY / f"{module}.py")
    upward = {m for m in imported if LAYERS[m] >= LAYERS[module]}
    assert not upward, f"verify.{module} (layer {LAYERS[module]}) imports {sorted(upward)}"


def test_the_checker_sees_imports():
    """The parser finds relative, absolute and function-level imports (so the test above can fail)."""
    assert {"contract", "plan"} <= verify_imports(VERIFY / "api.py")
    assert {"triton_naive", "triton_flash"} <= verify_imports(VERIFY / "op.py")


@pytest.mark.parametrize("module", sorted(LAYERS))
def test_imports_alone_in_a_fresh_interpreter(module):
    name = "kdtree_engine.verify" + ("" if module == "__init__" else f".{module}")
    code = f"import os; os.environ['TRITON_INTERPRET'] = '1'; import {name}"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]


def test_package_import_does_not_load_triton():
    r = subprocess.run([sys.executable, "-c", "import kdtree_engine, sys; assert 'triton' not in sys.modules"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
