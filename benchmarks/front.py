"""Quality per second: a metric against a run's time, one point per method, the front marked.

Usage: python -m benchmarks.front RESULTS.csv [RESULTS.csv ...] [--metric M] [--limit 150]
       [--out docs/front.png]

Reads ``fedsyn experiment`` results files (one row per cell, with the run's phase times as
``seconds/<phase>``, ``seconds/total`` the server's whole run), groups rows by file and method
(mean ± std over seeds and over the grid's other parameters), and plots the metric against the
median time (a run slowed by something else on the machine must not move its method). The
front is the set of points no other point beats on both (higher metric, less time); the
vertical line is the time limit the default must meet. Prints the points as a markdown table,
front first. matplotlib does the plotting; the front is a few lines by hand, which no plotting
library computes for us.
"""

from __future__ import annotations

import argparse
import csv
import math
import sys
from pathlib import Path

import numpy as np

from fedsyn_server.outputs import save_figure


def read_points(paths: list[Path], metric: str) -> list[dict]:
    """One point per (file, method): label, n, metric mean/std, time median/min/max (seconds/total)."""
    points = []
    for path in paths:
        with open(path, newline="") as f:
            rows = [r for r in csv.DictReader(f) if r.get(metric) and r.get("seconds/total")]
        for method in dict.fromkeys(r["method"] for r in rows):
            mine = [r for r in rows if r["method"] == method]
            y = np.array([float(r[metric]) for r in mine])
            t = np.array([float(r["seconds/total"]) for r in mine])
            label = method if len(paths) == 1 else f"{path.parent.name}: {method}"
            points.append({"label": label, "n": len(mine), "y": float(y.mean()), "y_std": float(y.std()),
                           "t": float(np.median(t)), "t_min": float(t.min()), "t_max": float(t.max())})
    return points


def front(points: list[dict]) -> list[dict]:
    """The points no other point dominates (at least as good on both, better on one), by time."""
    def dominated(p: dict) -> bool:
        return any(q["t"] <= p["t"] and q["y"] >= p["y"] and (q["t"] < p["t"] or q["y"] > p["y"]) for q in points)

    return sorted((p for p in points if not dominated(p)), key=lambda p: p["t"])


def plot(points: list[dict], metric: str, limit: float | None, out: Path) -> Path:
    """Scatter (metric: mean ± std; time: median, min to max), the front as a step line, the time
    limit as a vertical line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # The key lists every point beside the axes: past 16 names it takes a second column, or the
    # figure would cut it off at the bottom.
    columns = 1 if len(points) <= 16 else 2
    fig, ax = plt.subplots(figsize=(10 + 3.5 * (columns - 1), 5))
    # Points sit close together (methods differ by seconds), so each gets a number beside it and
    # its name in the key outside the axes: full names beside the points overlapped.
    for i, p in enumerate(points, 1):
        ax.errorbar(p["t"], p["y"], xerr=[[p["t"] - p["t_min"]], [p["t_max"] - p["t"]]], yerr=p["y_std"], fmt="o",
                    capsize=3, label=f"{i}: {p['label']} (n={p['n']})")
        ax.annotate(str(i), (p["t"], p["y"]), textcoords="offset points", xytext=(4, 3), fontsize=8)
    best = front(points)
    ax.step([p["t"] for p in best], [p["y"] for p in best], where="post", color="grey", alpha=0.6,
            label="front")
    if limit:
        ax.axvline(limit, color="red", linestyle="--", alpha=0.6, label=f"{limit:g} s")
    ax.set_xlabel("run time, seconds (server's whole run, median over seeds)")
    ax.set_ylabel(metric)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0, ncol=columns)
    fig.tight_layout()
    return save_figure(fig, out)


def main(argv: list[str] | None = None) -> int:
    """Print the points as a markdown table and write the plot; 1 when no row has the metric."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("results", nargs="+", type=Path)
    ap.add_argument("--metric", default="utility/topic/accuracy")
    ap.add_argument("--limit", type=float, default=150.0, help="the default's time limit, seconds (0: none)")
    ap.add_argument("--out", type=Path, default=Path("front.png"))
    args = ap.parse_args(argv)
    points = read_points(args.results, args.metric)
    if not points:
        print(f"no row with {args.metric} and seconds/total in {[str(p) for p in args.results]}")
        return 1
    on_front = {id(p) for p in front(points)}
    print(f"| method | n | {args.metric} | seconds, median (min–max) | on the front |\n|---|---|---|---|---|")
    for p in sorted(points, key=lambda p: (id(p) not in on_front, p["t"])):
        print(f"| {p['label']} | {p['n']} | {p['y']:.3f} ± {p['y_std']:.3f} | "
              f"{p['t']:.0f} ({p['t_min']:.0f}–{p['t_max']:.0f}) | "
              f"{'yes' if id(p) in on_front else ''} |")
    print("plot:", plot(points, args.metric, args.limit or None, args.out))
    return 0 if all(math.isfinite(p["y"]) for p in points) else 1


if __name__ == "__main__":
    sys.exit(main())
