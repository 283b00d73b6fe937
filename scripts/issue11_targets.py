"""Issue 11's targets read from a bench JSON of its grid (``kdtree bench --grid issue11 --kernels
hopper --flashmla DIR``), and with ``--before`` our times against an earlier run's, shape by shape.

    python scripts/issue11_targets.py docs/results/bench_h200_..._issue11.json [--before OLD.json] [--kernel K]

A shape is (B, H, nodes, prefix). The targets, each printed with the shapes that miss it:

- chain trees, page 64, ours / FlashMLA: every shape <= 1.10 at prefix >= 16k, their median
  <= 1.05; <= 1.5 at 4k;
- random / chain tree, page 64: within 5% at every shape;
- random trees, page 64, prefix >= 16k, H x nodes >= 512: median >= 85% of the roofline floor
  (FlashMLA's chain rows at those shapes beside it; where the JSON has ``ceilings_end``, both again
  against the ceilings measured after the rows; where the median misses, the time every shape would
  have to take for it to reach 85%, and the shapes that would lift it alone, each with the time it
  would have to take: where a speed-up counts for this target);
- random trees, page 1 scattered / page 64: within 10% at every shape.
"""

from __future__ import annotations

import argparse
import json
import statistics

FLOOR_TARGET = 85.0  # % of the floor, the random trees' median


def _times(rows, kernel, tree, page_size, key="median_us"):
    return {(r["batch"], r["heads"], r["q_len"], r["prefix"]): r[key] for r in rows
            if r["kernel"] == kernel and r["tree"] == tree and r["page_size"] == page_size and r["status"] == "ok"}


def _name(shape):
    return "x".join(str(x) for x in shape)


def _misses(ratios, ok):
    bad = [f"{_name(s)} {r:.3f}" for s, r in sorted(ratios.items()) if not ok(r)]
    return f"{len(ratios) - len(bad)} of {len(ratios)}" + (f"; misses: {', '.join(bad)}" if bad else "")


def _median_floor_at(rows, shapes, kernel, tree, ceilings):
    """Median % of the floor of ``kernel``'s ``tree`` rows (page 64) at ``shapes`` with the floor taken
    from ``ceilings`` (a bench JSON's ``ceilings`` or ``ceilings_end``) instead of the run's."""
    pct = {}
    for r in rows:
        shape = (r["batch"], r["heads"], r["q_len"], r["prefix"])
        if (r["kernel"], r["tree"], r["page_size"], r["status"]) == (kernel, tree, 64, "ok") and shape in shapes:
            rate = ceilings["matmul_tflops"].get(r["dtype"], ceilings["matmul_tflops"]["bf16"]) * 1e12
            floor_us = max(r["flops"] / rate, r["bytes"] / (ceilings["copy_tbps"] * 1e12)) * 1e6
            pct[shape] = 100 * floor_us / r["median_us"]
    return statistics.median(pct.values()) if pct else None


def _solo_lifts(pct: dict, target: float) -> list[tuple[tuple, float]]:
    """The shapes of ``pct`` (shape -> % of the floor) whose value alone, raised, lifts the median of
    all to ``target``, each with the fraction of its time it would have to take (% of the floor is
    inversely proportional to the time), the smallest change first."""
    lifts = []
    for shape, now in pct.items():
        others = [v for s, v in pct.items() if s != shape]
        if now >= target or statistics.median(others + [float("inf")]) < target:
            continue
        lo, hi = now, max(target, *others)  # the median reaches the target with this shape at hi
        for _ in range(60):
            mid = (lo + hi) / 2
            lo, hi = (lo, mid) if statistics.median(others + [mid]) >= target else (mid, hi)
        lifts.append((shape, now / hi))
    return sorted(lifts, key=lambda lift: -lift[1])


def report(rows, ours: str = "hopper", ceilings=None, ceilings_end=None) -> list[str]:
    chain, flashmla = _times(rows, ours, "chain", 64), _times(rows, "flashmla", "chain", 64)
    random64, random1 = _times(rows, ours, "random", 64), _times(rows, ours, "random", 1)
    vs_flashmla = {s: chain[s] / flashmla[s] for s in chain if s in flashmla}
    long = {s: r for s, r in vs_flashmla.items() if s[3] >= 16384}
    short = {s: r for s, r in vs_flashmla.items() if s[3] < 16384}
    lines = []
    if long:
        lines.append(f"chain / FlashMLA, prefix >= 16k: median {statistics.median(long.values()):.3f} (target 1.05), "
                     f"range {min(long.values()):.3f}-{max(long.values()):.3f}, <= 1.10 at "
                     + _misses(long, lambda r: r <= 1.10))
    if short:
        lines.append("chain / FlashMLA, prefix < 16k: <= 1.5 at " + _misses(short, lambda r: r <= 1.5))
    same = {s: random64[s] / chain[s] for s in random64 if s in chain}
    lines.append("random / chain, page 64: within 5% at " + _misses(same, lambda r: abs(r - 1) <= 0.05))
    floor_ours = _times(rows, ours, "random", 64, "pct_floor")
    floor_theirs = _times(rows, "flashmla", "chain", 64, "pct_floor")
    big = [s for s in floor_ours if s[3] >= 16384 and s[1] * s[2] >= 512]
    if big:
        theirs = [floor_theirs[s] for s in big if s in floor_theirs]
        pct = {s: floor_ours[s] for s in big}
        median = statistics.median(pct.values())
        lines.append(f"random trees, prefix >= 16k, H x n >= 512 ({len(big)} shapes): median {median:.1f}% of the "
                     f"floor (target {FLOOR_TARGET:.0f}; range {min(pct.values()):.1f}-{max(pct.values()):.1f})"
                     + (f", FlashMLA's chain rows {statistics.median(theirs):.1f}%" if theirs else ""))
        if median < FLOOR_TARGET:
            solo = _solo_lifts(pct, FLOOR_TARGET)
            lines.append(f"  it reaches {FLOOR_TARGET:.0f}% with every shape at {median / FLOOR_TARGET:.3f} of its time"
                         + (", or one alone: " + ", ".join(f"{_name(s)} at {f:.3f} ({pct[s]:.1f}% now)"
                                                          for s, f in solo[:3]) if solo else ""))
        if ceilings and ceilings_end:  # the same rows against the matmul rate measured after them
            start, end = ceilings["matmul_tflops"]["bf16"], ceilings_end["matmul_tflops"]["bf16"]
            at_end = _median_floor_at(rows, set(big), ours, "random", ceilings_end)
            theirs_end = _median_floor_at(rows, set(big), "flashmla", "chain", ceilings_end)
            lines.append(f"  the same against the ceilings measured at the run's end (matmul {end:.0f} TFLOP/s, "
                         f"start {start:.0f}): median {at_end:.1f}%"
                         + (f", FlashMLA's chain rows {theirs_end:.1f}%" if theirs_end is not None else ""))
    scattered = {s: random1[s] / random64[s] for s in random1 if s in random64}
    if scattered:
        lines.append(f"random trees, page 1 / page 64: median {statistics.median(scattered.values()):.3f}, at most "
                     f"{max(scattered.values()):.3f}, within 10% at " + _misses(scattered, lambda r: r <= 1.10))
    return lines


def compare(rows, before, ours: str = "hopper") -> list[str]:
    lines = []
    for kernel, tree, page_size in ((ours, "chain", 64), ("flashmla", "chain", 64), (ours, "random", 64),
                                    (ours, "random", 1)):
        now, then = _times(rows, kernel, tree, page_size), _times(before, kernel, tree, page_size)
        ratios = sorted(now[s] / then[s] for s in now if s in then)
        if ratios:
            lines.append(f"{kernel} {tree} page {page_size}, now / before at {len(ratios)} shapes: median "
                         f"{statistics.median(ratios):.3f} ({ratios[0]:.3f}-{ratios[-1]:.3f})")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("json", help="the bench JSON of the issue-11 grid")
    ap.add_argument("--before", help="an earlier run's bench JSON of the same grid")
    ap.add_argument("--kernel", default="hopper", help="our kernel whose rows are read (default hopper; "
                    "hopper_cuda for a grid run with --kernels hopper_cuda)")
    args = ap.parse_args()
    try:
        data = json.load(open(args.json))
        rows = data["rows"]
        lines = report(rows, args.kernel, data.get("ceilings"), data.get("ceilings_end"))
        if args.before:
            lines += compare(rows, json.load(open(args.before))["rows"], args.kernel)
    except (OSError, ValueError, KeyError, TypeError) as e:  # not a bench JSON of the grid
        ap.error(f"{type(e).__name__}: {e}")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
