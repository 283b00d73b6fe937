"""Fit the schedule cost model to timed schedules: how well the form of ``plan.schedule_cost`` and an
additive alternative predict the times ``scripts/tune_flash.py --json`` recorded.

    PYTHONPATH=src python scripts/schedule_cost_fit.py docs/results/tune_h100_*.json [--page-size 64]

Each row's schedule is rebuilt on the host (its forced candidate; ``auto``: the current plan's
pick, kept only where its segment count equals the one recorded, i.e. the pick has not changed
since) and reduced to :func:`~kdtree_engine.verify.plan.schedule_terms` (busiest program, total
work, HBM tiles; in tiles). Two forms, their constants fitted by a grid (the additive form's HBM
weight by least squares at each grid point), error = |log(predicted / measured)|:

- ``max`` (``schedule_cost``'s): ``a * max(busiest, hbm_tiles / r)``;
- ``additive``: ``a * (busiest - d * (busiest - total / P)) + c * hbm_tiles``: HBM traffic that
  adds to the time instead of hiding under it, and programs left idle (``d``) giving the busy ones
  part of their time back (the GPU's clock under its power limit).

The HOPPER_COSTS line (``r`` as the plan has it, ``a`` the median us per modelled tile) is printed
beside them. Rows either fitted form misses by more than ``--miss`` are listed. ``--compare N``:
over equal-tree shapes (H 16-128, trees 4-128 nodes, B 1-16, KV 4k-128k) on the rows' programs,
the N shapes where the fitted additive form prices :func:`~kdtree_engine.verify.plan.schedule`'s
pick furthest above its own (the shapes to time next).

``--picks`` judges the plan's picks instead: per shape (equal lengths) with two or more of its
candidates timed (forced, or ``auto`` under the pick it recorded; the fastest time of each), the
timed candidate the plan prices cheapest against the fastest timed, over all such shapes and over
those with a KV parts' tail among them; ``--tail-margin K`` prices the tails as the plan would with
``PARTS_TAIL_SEGMENT_MARGIN = K`` (0: unpriced).
"""

from __future__ import annotations

import argparse
import itertools
import json

import numpy as np

from kdtree_engine.verify import plan as vplan


def tuned_rows(paths: list[str], page_size: int | None):
    """``(path, row, R, T)`` for each row of tune_flash JSON files at ``page_size`` (None: all):
    its row blocks and KV tiles per sequence (int64 ``[B]`` each)."""
    for path in paths:
        with open(path) as f:
            doc = json.load(f)
        for row in doc["rows"] if isinstance(doc, dict) else doc:
            H, n, B, prefix, ps = (int(x) for x in row["shape"].split("x"))
            if page_size is not None and ps != page_size:
                continue
            bm, bn = (int(x) for x in row["config"].split("x")[:2])
            R = np.full(B, -(-H * n // bm))
            T = -(-np.array(row.get("kv_lens", [prefix + n] * B)) // bn)  # ragged rows record their lengths
            yield path, row, R, T


def load_rows(paths: list[str], page_size: int | None) -> list[dict]:
    """Rows of tune_flash JSON files with their schedule's terms (``busiest``, ``total``, ``hbm``)."""
    rows = []
    for path, row, R, T in tuned_rows(paths, page_size):
        only = None if row["schedule"] == "auto" else row["schedule"]
        pieces = vplan.schedule(R, T, row["programs"], costs=vplan.HOPPER_COSTS, only=only)
        if len(pieces.prog) != row["segments"]:
            continue  # an "auto" row whose pick has changed since it was timed
        terms = vplan.schedule_terms(pieces, vplan.HOPPER_COSTS.segment_tiles)
        rows.append(dict(source=path.rsplit("/", 1)[-1], shape=row["shape"], schedule=row["schedule"],
                         us=row["us"], programs=row["programs"], busiest=terms.busiest, total=terms.total,
                         hbm=terms.hbm_tiles))
    return rows


def fit_max(us, busiest, hbm):
    """Best (mean error, max error, a, r) of ``a * max(busiest, hbm / r)``."""
    best = None
    for r in (30, 40, 50, 60, 72, 90, 120, 160, 250, 1e9):
        base = np.maximum(busiest, hbm / r)
        a = float(np.exp(np.median(np.log(us / base))))
        for scale in np.linspace(0.95, 1.05, 41):
            err = np.abs(np.log(a * scale * base / us))
            if best is None or err.mean() < best[0]:
                best = (err.mean(), err.max(), a * scale, r)
    return best


def fit_additive(us, busiest, total, hbm, programs):
    """Best (mean error, max error, a, d, c) of ``a * (busiest - d * (busiest - total / P)) + c * hbm``."""
    best = None
    for d in np.linspace(0.0, 1.0, 21):
        work = busiest - d * (busiest - total / programs)
        for a in np.linspace(1.0, 2.5, 301):
            rest = us - a * work
            c = max(0.0, float((rest * hbm).sum() / (hbm * hbm).sum()))
            err = np.abs(np.log((a * work + c * hbm) / us))
            if best is None or err.mean() < best[0]:
                best = (err.mean(), err.max(), a, d, c)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("json", nargs="+", help="scripts/tune_flash.py --json outputs")
    parser.add_argument("--page-size", type=int, default=64, help="rows of this page size only (0: all)")
    parser.add_argument("--miss", type=float, default=0.06, help="list rows a fitted form misses by more (log)")
    parser.add_argument("--compare", type=int, default=0, metavar="N",
                        help="list the N shapes where the additive form disputes the plan's pick most")
    parser.add_argument("--picks", action="store_true", help="judge the plan's picks against the timed candidates")
    parser.add_argument("--tail-margin", type=float, default=vplan.PARTS_TAIL_SEGMENT_MARGIN,
                        help="with --picks: PARTS_TAIL_SEGMENT_MARGIN to price the tails at")
    args = parser.parse_args()
    if args.picks:
        vplan.PARTS_TAIL_SEGMENT_MARGIN = args.tail_margin
        judge_picks(timed_candidates(args.json, args.page_size or None))
        return
    rows = load_rows(args.json, args.page_size or None)
    if not rows:
        raise SystemExit("no rows to fit")
    us, busiest, total, hbm, programs = (np.array([r[k] for r in rows], dtype=float)
                                         for k in ("us", "busiest", "total", "hbm", "programs"))
    model = np.maximum(busiest, hbm / vplan.HOPPER_COSTS.hbm_tiles_per_tile)
    a_model = float(np.exp(np.median(np.log(us / model))))
    err_model = np.abs(np.log(a_model * model / us))
    mx = fit_max(us, busiest, hbm)
    add = fit_additive(us, busiest, total, hbm, programs)
    print(f"{len(rows)} rows from {len(args.json)} files")
    print(f"HOPPER_COSTS  a * max(busiest, hbm / {vplan.HOPPER_COSTS.hbm_tiles_per_tile}), a = {a_model:.3f} us: "
          f"mean error {err_model.mean():.3f}, max {err_model.max():.3f}")
    print(f"max form      a * max(busiest, hbm / r), a = {mx[2]:.3f} us, r = {mx[3]:g}: "
          f"mean error {mx[0]:.3f}, max {mx[1]:.3f}")
    print(f"additive form a * (busiest - d (busiest - total / P)) + c * hbm, a = {add[2]:.3f} us, d = {add[3]:.2f}, "
          f"c = {add[4]:.5f} us (1 / {add[2] / add[4]:.0f} tile time) per HBM tile: "
          f"mean error {add[0]:.3f}, max {add[1]:.3f}")
    pred_max = mx[2] * np.maximum(busiest, hbm / mx[3])
    pred_add = add[2] * (busiest - add[3] * (busiest - total / programs)) + add[4] * hbm
    print(f"\nrows missed by more than {args.miss:.2f} (predicted / measured):")
    for i, r in enumerate(rows):
        e_max, e_add = np.log(pred_max[i] / us[i]), np.log(pred_add[i] / us[i])
        if max(abs(e_max), abs(e_add)) > args.miss:
            print(f"  {r['source'][:44]:44s} {r['shape']:22s} {r['schedule']:10s} {us[i]:10.1f} us  "
                  f"max {np.exp(e_max):.3f}  additive {np.exp(e_add):.3f}")
    if args.compare:
        compare_picks(add[2:], int(programs.max()), args.compare)


def timed_candidates(paths: list[str], page_size: int | None) -> dict:
    """``{(shape, config, programs): (R, T, {candidate name: fastest us})}`` over the rows of equal lengths
    (a forced ``whole`` is the candidate of whole sequences; ``auto`` rows without the pick they
    recorded are left out)."""
    times = {}
    for _, row, R, T in tuned_rows(paths, page_size):
        name = row.get("picked") if row["schedule"] == "auto" else row["schedule"]
        if name is None or len(set(T.tolist())) > 1:
            continue
        if name == "whole":
            name = f"whole:{int(T.max())}"
        timed = times.setdefault((row["shape"], row["config"], row["programs"]), (R, T, {}))[2]
        timed[name] = min(timed.get(name, float("inf")), row["us"])
    return times


def judge_picks(times: dict, slower: float = 1.015) -> None:
    """Print how the plan's pick among each shape's timed candidates compares with the fastest timed."""
    judged = []
    for (shape, _, programs), (R, T, timed) in sorted(times.items(), key=lambda item: item[0]):
        cost = {c.name: c.cost for c in vplan.schedule_candidates(R, T, programs, costs=vplan.HOPPER_COSTS)}
        timed = {k: v for k, v in timed.items() if k in cost}
        if len(timed) < 2:
            continue
        pick = min(timed, key=cost.get)
        best = min(timed, key=timed.get)
        judged.append((timed[pick] / timed[best], shape, pick, best, any(k.startswith("parts_tail") for k in timed)))
    print(f"PARTS_TAIL_SEGMENT_MARGIN = {vplan.PARTS_TAIL_SEGMENT_MARGIN:g}")
    for label, rows in (("all", judged), ("with a tail timed", [j for j in judged if j[4]])):
        losses = np.array([j[0] for j in rows])
        print(f"{label}: {len(rows)} shapes; the plan's pick > {slower:.3f}x the fastest timed at "
              f"{int((losses > slower).sum())}, {losses.mean():.4f}x at the mean, {losses.max():.3f}x at most")
    for loss, shape, pick, best, _ in sorted(judged, reverse=True):
        if loss > slower:
            print(f"  {shape:22s} plan {pick:14s} {loss:.3f}x  fastest {best}")


def compare_picks(constants, num_programs: int, count: int) -> None:
    """Print the ``count`` equal-tree shapes where the additive form with ``constants`` (a, d, c)
    prices the plan's pick furthest above its own cheapest candidate."""
    a, d, c = constants
    seg = vplan.HOPPER_COSTS.segment_tiles

    def additive(pieces):
        t = vplan.schedule_terms(pieces, seg)
        return a * (t.busiest - d * (t.busiest - t.total / num_programs)) + c * t.hbm_tiles

    shapes = agree = 0
    worse = []
    for H, n, B, kv in itertools.product((16, 32, 64, 128), (4, 9, 16, 24, 33, 48, 65, 96, 128), (1, 2, 3, 4, 6, 8, 16),
                                         (4096, 16384, 32768, 131072)):
        R, T = np.full(B, -(-H * n // 64)), np.full(B, -(-(kv + n) // 64))
        cands = vplan.schedule_candidates(R, T, num_programs, costs=vplan.HOPPER_COSTS)
        if len(cands) == 1:
            continue
        shapes += 1
        picked = min(cands, key=lambda cand: cand.cost)
        own = min(cands, key=lambda cand: additive(cand.pieces))
        if own.name == picked.name:
            agree += 1
        else:
            worse.append((additive(picked.pieces) / additive(own.pieces), f"{H}x{n}x{B}x{kv}", picked.name, own.name))
    worse.sort(reverse=True)
    print(f"\npicks: the additive form agrees with the plan at {agree} of {shapes} priced shapes; "
          f"where not, it prices the plan's pick {np.median([w[0] for w in worse]) if worse else 1:.3f}x its own "
          f"at the median. Furthest:")
    for ratio, shape, picked, own in worse[:count]:
        print(f"  {shape:18s} plan {picked:14s} additive {own:14s} {ratio:.3f}x")


if __name__ == "__main__":
    main()
