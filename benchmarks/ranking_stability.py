"""Ranking stability: one grid swept twice back to back; do the two sweeps agree on the best?

For each measurement scheme, pairs of back-to-back sweeps of the same grid (default: the
quickstart) in fresh results folders; the schemes take turns pair by pair, so a drift of the
machine hits each alike. Per pair:

- Kendall's tau-b between the two sweeps' tokens/s over the runs ok in both;
- same best: whether the two sweeps name the same best run at every world size (the reading
  of a tool that reports medians as exact);
- best in tie set: whether, at every world size, each sweep's best is the other's best or tied
  with it among that world size's runs (`fsdp_bench.report.ties.tied_with`, as the best per
  world size in summary.md lists them);
- contended: runs of the two sweeps recorded `contended` (something else ran beside them);
- between: the median over runs of |log(tokens/s in A / in B)|, in percent: how much one run's
  figure moves from one sweep to the next; inside CI: how often B's median lies in A's 95%
  interval (the interval is about the noise between one run's steps, so this shows how much of
  the between-sweep noise it covers).

Schemes: `as-given` measures as the grid says (the quickstart: 2 rounds of 5 steps, so the
ties allow for the noise between passes, pooled over the sweep's runs); `one-pass` times as
many steps in one pass (the quickstart: 2 repeats of 5 steps; its ties see only the noise
between one run's steps, as every sweep's did before rounds); `rounds` times them in
`--rounds` passes.

    python benchmarks/ranking_stability.py                 # 20 minutes, both schemes
    python benchmarks/ranking_stability.py --minutes 8 --schemes as-given,one-pass

Target: each sweep's best in the other's tie set in >= 9 of 10 pairs; tau as measured.
"""

from __future__ import annotations

import argparse
import itertools
import math
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pandas as pd
import yaml

from fsdp_bench import load_results
from fsdp_bench.config.grid import load_grid
from fsdp_bench.report.ties import tied_with
from fsdp_bench.sweep import SweepOptions, run_sweep

REPO = Path(__file__).resolve().parents[1]


def kendall_tau_b(x: list[float], y: list[float]) -> float:
    """Kendall's tau-b of paired values (ties in either list counted as neither way)."""
    concordant = discordant = ties_x = ties_y = 0
    for (x1, y1), (x2, y2) in itertools.combinations(zip(x, y, strict=True), 2):
        dx, dy = (x1 > x2) - (x1 < x2), (y1 > y2) - (y1 < y2)
        if dx == 0 and dy == 0:
            continue
        if dx == 0:
            ties_x += 1
        elif dy == 0:
            ties_y += 1
        elif dx == dy:
            concordant += 1
        else:
            discordant += 1
    pairs_x = concordant + discordant + ties_y
    pairs_y = concordant + discordant + ties_x
    return (concordant - discordant) / (pairs_x * pairs_y) ** 0.5 if pairs_x and pairs_y else 0.0


def scheme_grid(grid_path: Path, scheme: str, rounds: int, folder: Path) -> Path:
    """The grid with its measure section rewritten for `scheme`."""
    grid = yaml.safe_load(grid_path.read_text())
    measure = grid.setdefault("base", {}).setdefault("measure", {})
    passes = measure.get("rounds", 1)
    steps = measure.get("repeats", 3) * measure.get("timed_steps", 5) * passes
    if scheme == "one-pass":
        measure.update(repeats=measure.get("repeats", 3) * passes, rounds=1)
    elif scheme == "rounds":
        measure.update(repeats=1, timed_steps=max(1, -(-steps // rounds)), rounds=rounds)
    path = folder / f"{scheme}.yaml"
    path.write_text(yaml.safe_dump(grid, sort_keys=False))
    return path


def sweep_once(grid: Path, results: Path, estimates: Path | None) -> tuple[pd.DataFrame, float]:
    """One sweep into `results` (estimates copied from an earlier sweep of the same grid:
    they are deterministic, and re-estimating would only lengthen the pair)."""
    if estimates is not None and estimates.exists():
        shutil.copytree(estimates, results / "estimates")
    start = time.perf_counter()
    run_sweep(load_grid(grid), SweepOptions(results_dir=results, progress=False))
    return load_results(results), time.perf_counter() - start


def best_ids(df: pd.DataFrame) -> dict[int, str]:
    """The fastest ok run at each world size."""
    ok = df[df["status"] == "ok"].sort_values("tokens_per_s", ascending=False)
    return {
        int(size): str(ok[ok["world_size"] == size]["run_id"].iloc[0])
        for size in ok["world_size"].unique()
    }


def compare(a: pd.DataFrame, b: pd.DataFrame) -> dict[str, Any]:
    """Agreement of two sweeps of one grid (runs matched by run id)."""
    ok_a = a[a["status"] == "ok"].set_index("run_id")["tokens_per_s"]
    ok_b = b[b["status"] == "ok"].set_index("run_id")["tokens_per_s"]
    both = ok_a.index.intersection(ok_b.index)
    tau = kendall_tau_b([float(ok_a[i]) for i in both], [float(ok_b[i]) for i in both])
    best_a, best_b = best_ids(a), best_ids(b)
    same = best_a == best_b

    def tie_set(df: pd.DataFrame, size: int, best: str) -> set[str]:
        """The best and its ties among the runs of its world size, as summary.md lists them."""
        return {best, *tied_with(df[df["world_size"] == size], best)}

    in_ties = all(
        best_b.get(size) in tie_set(a, size, best)
        and best in tie_set(b, size, str(best_b.get(size)))
        for size, best in best_a.items()
    )
    tie_sizes = [len(tie_set(df, size, best)) for df, bests in ((a, best_a), (b, best_b))
                 for size, best in bests.items()]  # fmt: skip
    contended = sum(int(df["contended"].eq(True).sum()) for df in (a, b) if "contended" in df)
    ratios = [float(ok_a[i]) / float(ok_b[i]) for i in both]
    low = a.set_index("run_id").loc[both, "tokens_per_s_ci_low"]
    high = a.set_index("run_id").loc[both, "tokens_per_s_ci_high"]
    inside = [bool(low[i] <= ok_b[i] <= high[i]) for i in both]
    return {
        "runs": len(both),
        "contended": contended,
        "tau": tau,
        "same_best": same,
        "in_tie_set": in_ties,
        "tie_set_size": sum(tie_sizes) / len(tie_sizes),
        "between_pct": 100 * statistics.median(abs(math.log(r)) for r in ratios),
        "inside_ci_pct": 100 * sum(inside) / len(inside),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("grid", nargs="?", default=str(REPO / "sweeps" / "quickstart.yaml"))
    parser.add_argument("--minutes", type=float, default=20.0, help="wall-time budget")
    parser.add_argument("--schemes", default="as-given,one-pass")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-pairs", type=int, default=10, help="per scheme")
    args = parser.parse_args()
    schemes = args.schemes.split(",")
    deadline = time.monotonic() + 60 * args.minutes
    rows: list[dict[str, Any]] = []
    pair_s: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        grids = {s: scheme_grid(Path(args.grid), s, args.rounds, folder) for s in schemes}
        for index in range(args.max_pairs):
            for scheme in schemes:
                if time.monotonic() + pair_s.get(scheme, 0.0) > deadline:
                    continue
                cache = folder / f"{scheme}-0a" / "estimates"
                first, wall_a = sweep_once(grids[scheme], folder / f"{scheme}-{index}a", cache)
                second, wall_b = sweep_once(grids[scheme], folder / f"{scheme}-{index}b", cache)
                pair_s[scheme] = wall_a + wall_b
                row = {"scheme": scheme, "pair": index + 1, **compare(first, second)}
                row["sweep_s"] = (wall_a + wall_b) / 2
                rows.append(row)
                print(" ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}"
                               for k, v in row.items()), flush=True)  # fmt: skip
    table = pd.DataFrame(rows)
    print(f"\ngrid {args.grid}, {args.minutes:g} minutes")
    print(
        "scheme    pairs  best in tie set  same best  tau median [min, max]  tie set  sweep s"
        "  contended  between %  inside CI %"
    )
    for scheme, got in table.groupby("scheme", sort=False):
        print(
            f"{scheme!s:9s} {len(got):5d} {int(got.in_tie_set.sum()):>9d} of {len(got):<3d}"
            f" {int(got.same_best.sum()):>5d} of {len(got):<3d}"
            f" {got.tau.median():9.2f} [{got.tau.min():.2f}, {got.tau.max():.2f}]"
            f" {got.tie_set_size.mean():8.1f} {got.sweep_s.mean():8.0f}"
            f" {int(got.contended.sum()):10d} {got.between_pct.median():10.1f}"
            f" {got.inside_ci_pct.median():11.0f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
