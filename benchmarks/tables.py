"""Issue 25's comparison: fedsyn's table runs beside MST on the same splits and the same budget.

Usage: python -m benchmarks.tables [--grid benchmarks/tables.toml] [--out docs]

Run ``fedsyn experiment benchmarks/tables.toml`` first (the fedsyn cells: Breast Cancer, the
preset's settings, 3 seeds). Then, for every seed of the grid, this script reads each finished
cell's ``evaluation.json`` table section and adds, on that seed's split (the same held-out rows,
the same partition into sites):

- **MST, pooled**: MST (``fedsyn_server.evaluation.mst``) on the union of the sites' training
  rows at the node budget (epsilon, delta): the centralised reference a federation cannot
  normally get, since no site may hand its records to a curator.
- **MST, per site**: each site alone on its own rows at its own (epsilon, delta); the figures
  are the mean over the sites (what one institution gets without the federation).

Every table has as many rows as the fedsyn run of the same seed wrote. Writes
``<out>/tables_results.csv`` (one row per method and seed) and prints the mean ± std table
that ``docs/results.md`` quotes.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from common.io import atomic_write_csv

METRICS = {  # column -> path in an evaluate_table dict
    "fidelity": ("column_fidelity_mean",),
    "dependence": ("pair_dependence_mean",),
    "accuracy": ("efficacy", "synthetic", "accuracy"),
    "macro_f1": ("efficacy", "synthetic", "macro_f1"),
    "real_accuracy": ("efficacy", "real", "accuracy"),
    "closer_than_holdout_p5": ("closest_record", "share_closer_than_holdout_p5"),
    "rows": ("n_synthetic",),
}


def pick(scores: dict[str, Any]) -> dict[str, float]:
    """The headline figures of one ``evaluate_table`` result (NaN where one is missing, e.g. a
    synthetic table with one class has no efficacy)."""
    out = {}
    for name, path in METRICS.items():
        value: Any = scores
        for key in path:
            value = value.get(key) if isinstance(value, dict) else None
        out[name] = float(value) if isinstance(value, (int, float)) else math.nan
    return out


def mst_rows(cfg: Any, num_nodes: int, rows: int) -> list[tuple[str, dict[str, float]]]:
    """MST pooled and MST per site (mean over sites) on ``cfg``'s split, at its (epsilon, delta)."""
    from common.federation import benchmark, simulation_node_data
    from fedsyn_server.evaluation.mst import mst_synthesise
    from fedsyn_server.evaluation.tables import evaluate_table, records_frame

    schema, bench = cfg.schema(), benchmark(cfg)
    target = cfg.control_columns[0]
    train = records_frame(bench.train.texts, bench.train.codes, schema)
    test = records_frame(bench.test.texts, bench.test.codes, schema)

    def score(own: Any, seed: int) -> dict[str, float]:
        synthetic = mst_synthesise(own, schema, cfg.epsilon, cfg.resolve_delta(len(own)), rows, seed)
        return pick(evaluate_table(synthetic, test, schema, target, real_train=train, seed=cfg.seed))

    out = [("MST pooled", score(train, cfg.seed))]
    sites = []
    for pid in range(num_nodes):
        data = simulation_node_data(cfg, pid, num_nodes)[1]
        sites.append(score(records_frame(data.texts, data.codes, schema), cfg.seed * 1000 + pid + 1))
    out.append((f"MST per site (mean of {num_nodes})", {k: float(np.nanmean([s[k] for s in sites])) for k in METRICS}))
    return out


def collect(grid_path: Path) -> list[dict[str, Any]]:
    """One row per method and seed: every finished fedsyn cell of the grid and, for each seed at a
    finite epsilon, the two MST baselines."""
    from common.config import RunConfig
    from fedsyn_server.experiment import load_grid

    grid = load_grid(grid_path)
    rows, done = [], set()
    for cell in grid.cells:
        cfg = RunConfig.from_flower(dict(cell.run_config))
        evaluation = grid.out_dir / "runs" / cell.name / "evaluation.json"
        if not evaluation.is_file():
            print(f"{cell.name}: not run yet (fedsyn experiment {grid_path})")
            continue
        table = json.loads(evaluation.read_text()).get("table")
        if table is None:
            print(f"{cell.name}: its evaluation has no table section")
            continue
        eps = "inf" if math.isinf(cfg.epsilon) else f"{cfg.epsilon:g}"
        rows.append({"method": f"fedsyn {cell.method}", "epsilon": eps, "seed": cell.seed, **pick(table)})
        key = (cell.seed, cfg.epsilon)
        if math.isfinite(cfg.epsilon) and key not in done:
            done.add(key)
            for method, scores in mst_rows(cfg, grid.num_supernodes or 2, int(table["n_synthetic"])):
                rows.append({"method": method, "epsilon": eps, "seed": cell.seed, **scores})
    return rows


def summary(rows: list[dict[str, Any]]) -> str:
    """Mean ± std over seeds per (method, epsilon), as a Markdown table."""
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault((row["method"], row["epsilon"]), []).append(row)
    names = [m for m in METRICS if m != "rows"]
    lines = ["| method | ε | seeds | rows | " + " | ".join(names) + " |", "|---" * (4 + len(names)) + "|"]
    for (method, eps), group in groups.items():
        cells = []
        for name in names:
            values = np.array([g[name] for g in group], dtype=float)
            cells.append("–" if np.isnan(values).all() else f"{np.nanmean(values):.3f} ± {np.nanstd(values):.3f}")
        rows_mean = np.nanmean([g["rows"] for g in group])
        lines.append(f"| {method} | {eps} | {len(group)} | {rows_mean:.0f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--grid", default=str(Path(__file__).with_name("tables.toml")))
    parser.add_argument("--out", default=str(Path(__file__).parents[1] / "docs"))
    args = parser.parse_args()
    rows = collect(Path(args.grid))
    if not rows:
        raise SystemExit(f"no finished cell in {args.grid}: run `fedsyn experiment {args.grid}` first")
    path = atomic_write_csv(Path(args.out) / "tables_results.csv", rows, ["method", "epsilon", "seed", *METRICS])
    print(summary(rows))
    print(f"\n-> {path}")


if __name__ == "__main__":
    main()
