"""Golden test bundles (``.kdtr``): the cases every kernel is checked against.

Format, version 1: a safetensors file.

- tensors: the contract's inputs ``q``, ``kv_cache``, ``page_table``, ``kv_lens``, ``qo_indptr``,
  ``tree_mask`` (dtypes exactly as ``verify_attention`` takes them; unused cache slots hold NaN)
  and the float64 ``expected_out [T, H, 512]`` and ``expected_lse [T, H]`` of
  :func:`kdtree_engine.reference`.
- metadata (strings): ``format`` = ``"kdtree-verify-bundle"``, ``version`` = ``"1"``, ``spec`` = the
  JSON of the :class:`~kdtree_engine.testing.CaseSpec` that generated it (name, heads, prefixes,
  parent arrays, page size, dtype, seed, ...), ``sm_scale``, ``tolerances`` = JSON
  ``{"out": [atol, rtol], "lse": [atol, rtol]}``, ``generator`` = the package version.

A kernel passes a bundle when both out and lse are within ``|a - e| <= atol + rtol * |e|`` with
NaN/inf at the same places (see :func:`kdtree_engine.testing.compare`).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from .testing import TOLERANCES, CaseSpec, build_case, chain_tree, compare, random_tree, star_tree
from .verify import reference, verify_attention
from .verify.contract import D_QK, D_V

FORMAT = "kdtree-verify-bundle"
VERSION = 1
INPUTS = ("q", "kv_cache", "page_table", "kv_lens", "qo_indptr", "tree_mask")

__all__ = ["Bundle", "BundleError", "standard_specs", "make_bundle", "save_bundle", "load_bundle", "check_bundle",
           "CheckResult"]


class BundleError(ValueError):
    """A file that is not a readable bundle of a known version (missing, a directory, empty,
    truncated, not safetensors, another format or version, tensors or metadata missing)."""


@dataclass
class Bundle:
    spec: CaseSpec
    inputs: dict[str, torch.Tensor]
    expected_out: torch.Tensor  # float64 [T, H, 512]
    expected_lse: torch.Tensor  # float64 [T, H]
    tolerances: dict[str, tuple[float, float]]

    @property
    def filename(self) -> str:
        return f"{self.spec.name}.kdtr"


def _tree(kind: str, n: int, seed: int) -> list[int]:
    if kind == "chain":
        return chain_tree(n)
    if kind == "star":
        return star_tree(n)
    return random_tree(n, torch.Generator().manual_seed(seed))


def standard_specs(large: bool = False) -> list[CaseSpec]:
    """The standard bundle set. ``large=True`` gives the long-context set (GPU-sized)."""

    def spec(name, H, prefixes, trees, **kw):
        return CaseSpec(name=name, num_heads=H, prefix_lens=prefixes, trees=trees, **kw)

    if large:
        return [
            spec("verify_attn_h16_p131072_b8", 16, [131072], [_tree("random", 9, 1)], page_size=1, seed=101),
            spec("verify_attn_h64_p16384_b32", 64, [16384, 9000], [_tree("random", 33, 2), _tree("random", 33, 3)],
                 page_size=1, seed=102),
            spec("verify_attn_h128_p32768_b64_page64", 128, [32768], [_tree("random", 65, 4)], page_size=64, seed=103),
            spec("verify_attn_h8_p2000_n1024", 8, [2000], [_tree("random", 1024, 5)], page_size=16, seed=104),
        ]
    return [
        # the seed system's cases (h = heads, p = prefix, b = tree nodes besides the root)
        spec("verify_attn_h16_p2048_b16", 16, [2048, 2048], [_tree("random", 17, 11), _tree("random", 17, 12)], seed=1),
        spec("verify_attn_h64_p128_b32", 64, [128], [_tree("random", 33, 13)], seed=2),
        spec("verify_attn_h64_p512_b8", 64, [512, 512], [_tree("random", 9, 14), _tree("random", 9, 15)], seed=3),
        spec("verify_attn_h8_p0_b8", 8, [0, 0], [_tree("random", 9, 16), _tree("chain", 9, 0)], seed=4),
        spec("verify_attn_h8_p1_b4", 8, [1, 1], [_tree("random", 5, 17), _tree("star", 5, 0)], seed=5),
        # paging: block tables with permuted pages, ragged prefixes
        spec("verify_attn_page16_h16", 16, [700, 33, 0], [_tree("random", 12, 18), _tree("random", 7, 19),
             _tree("random", 3, 20)], page_size=16, seed=6),
        spec("verify_attn_page64_h16", 16, [300, 1000], [_tree("random", 17, 21), _tree("chain", 9, 0)],
             page_size=64, seed=7),
        spec("verify_attn_page1_ragged_h12", 12, [0, 1, 77, 513, 250], [_tree("random", 1, 0), _tree("random", 3, 22),
             _tree("random", 17, 23), _tree("random", 40, 24), _tree("star", 9, 0)], page_size=1, seed=8,
             extra_mask_words=1),
        # tree shapes
        spec("verify_attn_chain65_h8", 8, [100], [_tree("chain", 65, 0)], page_size=16, seed=9),
        spec("verify_attn_star64_h8", 8, [64], [_tree("star", 64, 0)], page_size=1, seed=10),
        spec("verify_attn_tree130_h4", 4, [200], [_tree("random", 130, 25)], page_size=16, seed=11),
        # dtype and head extremes
        spec("verify_attn_fp16_h16_p700_b16", 16, [700], [_tree("random", 17, 26)], page_size=1, dtype="fp16", seed=12),
        spec("verify_attn_h128_p300_b8", 128, [300], [_tree("random", 9, 27)], page_size=16, seed=13),
        spec("verify_attn_h1_p50_b4", 1, [50, 3], [_tree("random", 5, 28), _tree("chain", 2, 0)], page_size=1, seed=14),
    ]


def make_bundle(spec: CaseSpec, device: str | torch.device = "cpu") -> Bundle:
    """Build the inputs of ``spec`` and their float64 reference (computed on ``device``)."""
    inputs = build_case(spec, device)
    out, lse = reference(**inputs, sm_scale=spec.sm_scale)
    return Bundle(
        spec=spec,
        inputs={k: v.cpu() for k, v in inputs.items()},
        expected_out=out.cpu(),
        expected_lse=lse.cpu(),
        tolerances={k: tuple(v) for k, v in TOLERANCES[spec.dtype].items()},
    )


def save_bundle(bundle: Bundle, path: str | Path) -> Path:
    path = Path(path)
    tensors = {k: v.contiguous() for k, v in bundle.inputs.items()}
    tensors["expected_out"] = bundle.expected_out.contiguous()
    tensors["expected_lse"] = bundle.expected_lse.contiguous()
    from . import __version__

    metadata = {
        "format": FORMAT,
        "version": str(VERSION),
        "spec": json.dumps(bundle.spec.to_dict()),
        "sm_scale": repr(bundle.spec.sm_scale),
        "tolerances": json.dumps({k: list(v) for k, v in bundle.tolerances.items()}),
        "generator": f"kdtree-engine {__version__}",
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path), metadata=metadata)
    return path


def load_bundle(path: str | Path) -> Bundle:
    """Read a ``.kdtr`` file; raises :class:`BundleError` if it is not a readable bundle of a known
    version."""
    path = Path(path)
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
        if meta.get("format") != FORMAT:
            raise BundleError(f"{path} is not a kdtree verify bundle (format={meta.get('format')!r})")
        if meta.get("version") != str(VERSION):
            raise BundleError(f"{path} has bundle version {meta.get('version')!r}; this build reads {VERSION}")
        tensors = load_file(str(path))
        missing = [k for k in INPUTS + ("expected_out", "expected_lse") if k not in tensors]
        if missing:
            raise BundleError(f"{path} lacks tensors {missing}")
        spec = CaseSpec(**json.loads(meta["spec"]))
        tol = _tolerances(json.loads(meta["tolerances"]), spec.dtype, path)
        _check_against_spec(spec, tensors, path)
    except BundleError:
        raise
    except (OSError, SafetensorError, KeyError, TypeError, ValueError, AttributeError) as e:
        reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        raise BundleError(f"{path}: {type(e).__name__}: {reason}") from e
    return Bundle(
        spec=spec,
        inputs={k: tensors[k] for k in INPUTS},
        expected_out=tensors["expected_out"],
        expected_lse=tensors["expected_lse"],
        tolerances=tol,
    )


def _tolerances(stored, dtype: str, path) -> dict:
    """A bundle's ``{"out": (atol, rtol), "lse": (atol, rtol)}``: finite, non-negative and no looser
    than this build's :data:`~kdtree_engine.testing.TOLERANCES` for its dtype (a bundle may ask for
    tighter ones; looser ones would let a wrong result PASS)."""
    if dtype not in TOLERANCES:
        raise BundleError(f"{path}: dtype {dtype!r} is not one of {sorted(TOLERANCES)}")
    tol = {}
    for key, limit in TOLERANCES[dtype].items():
        pair = tuple(float(x) for x in stored[key])
        if len(pair) != 2 or not all(math.isfinite(x) and 0 <= x <= lim for x, lim in zip(pair, limit)):
            raise BundleError(f"{path}: {key} tolerances {list(stored[key])} are not within this build's "
                              f"{list(limit)} for {dtype}")
        tol[key] = pair
    return tol


def _check_against_spec(spec: CaseSpec, tensors: dict, path) -> None:
    """The tensors have the sizes and dtype the bundle's spec says (its PASS line reports the spec)."""
    T, B = sum(len(t) for t in spec.trees), len(spec.trees)
    H = spec.num_heads
    want = {"q": (T, H, D_QK), "kv_lens": (B,), "qo_indptr": (B + 1,), "expected_out": (T, H, D_V),
            "expected_lse": (T, H)}
    for name, shape in want.items():
        if tuple(tensors[name].shape) != shape:
            raise BundleError(f"{path}: {name} has shape {tuple(tensors[name].shape)}; its spec says {shape}")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[spec.dtype]
    if tensors["q"].dtype != dtype or tensors["kv_cache"].dtype != dtype:
        raise BundleError(f"{path}: q / kv_cache are {tensors['q'].dtype} / {tensors['kv_cache'].dtype}; "
                          f"its spec says {spec.dtype}")
    if tensors["kv_lens"].tolist() != spec.kv_lens or tensors["kv_cache"].shape[1] != spec.page_size:
        raise BundleError(f"{path}: kv_lens {tensors['kv_lens'].tolist()} / page size {tensors['kv_cache'].shape[1]} "
                          f"differ from its spec's {spec.kv_lens} / {spec.page_size}")


@dataclass
class CheckResult:
    ok: bool
    line: str


def check_bundle(bundle: Bundle, kernel: str, device: str | torch.device, label: str | None = None) -> CheckResult:
    """Run ``kernel`` on the bundle's inputs (on ``device``) and compare with its expected values.

    ``label`` names the bundle in the PASS/FAIL line (default: ``<spec name>.kdtr``).
    The outputs are pre-filled with NaN so that an element the kernel does not write fails.
    """
    inputs = {k: v.to(device) for k, v in bundle.inputs.items()}
    T, H, _ = inputs["q"].shape
    out = torch.full((T, H, 512), math.nan, dtype=inputs["q"].dtype, device=device)
    lse = torch.full((T, H), math.nan, dtype=torch.float32, device=device)
    verify_attention(**inputs, sm_scale=bundle.spec.sm_scale, kernel=kernel, out=out, lse=lse, validate=True)
    r_out = compare(out, bundle.expected_out, *bundle.tolerances["out"])
    r_lse = compare(lse, bundle.expected_lse, *bundle.tolerances["lse"])
    ok = r_out.ok and r_lse.ok
    n = [len(t) for t in bundle.spec.trees]
    line = (
        f"{'PASS' if ok else 'FAIL'} [{kernel}] {label or bundle.filename} B={len(n)} H={H} q_len={max(n)} "
        f"kv_len={max(bundle.spec.kv_lens)} {r_out} lse_max_abs={r_lse.max_abs:.2e}"
    )
    if not r_out.ok:
        line += f"  out {r_out.detail}"
    if not r_lse.ok:
        line += f"  lse {r_lse.detail}"
    return CheckResult(ok, line)
