"""Issue 25's comparison: fedsyn's table runs beside MST and AIM on the same splits and budget.

Usage: python -m benchmarks.tables [--grid benchmarks/tables.toml] [--out docs] [--name tables_results.csv]

Run ``fedsyn experiment benchmarks/tables.toml`` first (the fedsyn cells: Breast Cancer, the
preset's settings, 3 seeds). Then, for every seed of the grid, this script reads each finished
cell's ``evaluation.json`` table section and adds, on that seed's split (the same held-out rows,
the same partition into sites):

- **MST / AIM, pooled** (``benchmarks/baselines/mst.py``, ``aim.py``): the baseline on the union
  of the sites' training rows at the node budget (epsilon, delta): the centralised reference a
  federation cannot normally get, since no site may hand its records to a curator.
- **MST / AIM, per site**: each site alone on its own rows at its own (epsilon, delta); the
  figures are the mean over the sites (what one institution gets without the federation).

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


def baseline_rows(cfg: Any, num_nodes: int, rows: int, synthesisers: dict[str, Any],
                  cache: Path | None = None, pooled: bool = True,
                  cached_only: bool = False) -> list[tuple[str, dict[str, float]]]:
    """Each marginal baseline pooled (when ``pooled``) and per site (mean over sites) on ``cfg``'s
    split, at its (epsilon, delta); ``synthesisers`` maps a name to a function with
    ``mst_synthesise``'s signature. With ``cache``, each synthesiser's scores are kept there as JSON
    (one file per method, scope, seed, epsilon and partitioning) and read back on the next call, so a
    long grid resumes where it stopped. With ``cached_only`` nothing is run: a baseline not in the
    cache is left out (a per-site mean needs every site's)."""
    import time

    from common.federation import benchmark, simulation_node_data
    from common.io import atomic_write_text
    from fedsyn_server.evaluation.tables import evaluate_table, records_frame

    schema, bench = cfg.schema(), benchmark(cfg)
    target = cfg.control_columns[0]
    train = records_frame(bench.train.texts, bench.train.codes, schema)
    test = records_frame(bench.test.texts, bench.test.codes, schema)
    sites = [records_frame(d.texts, d.codes, schema)
             for d in (simulation_node_data(cfg, pid, num_nodes)[1] for pid in range(num_nodes))]
    part = cfg.partitioning.replace(":", "-")
    out = []
    for name, synthesise in synthesisers.items():
        def score(own: Any, seed: int, key: str) -> dict[str, float] | None:
            path = cache / f"{name}-{key}-seed{cfg.seed}-eps{cfg.epsilon:g}-rows{rows}.json" if cache else None
            if path is not None and path.is_file():
                return json.loads(path.read_text())
            if cached_only:
                return None
            start = time.perf_counter()
            synthetic = synthesise(own, schema, cfg.epsilon, cfg.resolve_delta(len(own)), rows, seed)
            scores = pick(evaluate_table(synthetic, test, schema, target, real_train=train, seed=cfg.seed))
            _clear_jit_caches()
            print(f"  {name} {key} seed {cfg.seed}: {len(own)} rows in, {time.perf_counter() - start:.0f} s",
                  flush=True)
            if path is not None:
                atomic_write_text(path, json.dumps(scores))
            return scores

        pooled_scores = score(train, cfg.seed, "pooled") if pooled else None
        if pooled_scores is not None:
            out.append((f"{name} pooled", pooled_scores))
        per_site = [score(site, cfg.seed * 1000 + pid + 1, f"site{pid}-{part}") for pid, site in enumerate(sites)]
        if all(s is not None for s in per_site):
            out.append((f"{name} per site (mean of {num_nodes})",
                        {k: float(np.nanmean([s[k] for s in per_site])) for k in METRICS}))
    return out


def _clear_jit_caches() -> None:
    """Drop JAX's compiled code after each baseline: Private-PGM compiles anew for every model
    shape, and one process running dozens of them ran out of memory mappings (LLVM's "Cannot
    allocate memory" at the kernel's 65,530-map limit, with 20 GiB free; 2026-11-28)."""
    import sys

    if "jax" in sys.modules:
        sys.modules["jax"].clear_caches()


def synthesisers() -> dict[str, Any]:
    """The marginal baselines to run: MST, and AIM where its module is there."""
    from benchmarks.baselines.mst import mst_synthesise

    out = {"MST": mst_synthesise}
    try:
        from benchmarks.baselines.aim import aim_synthesise
    except ImportError:
        return out
    out["AIM"] = aim_synthesise
    return out


def grpo_diagnostics(run_dir: Path, cfg: Any, num_nodes: int) -> dict[str, float]:
    """Did GRPO move the generator, and could it? Paired within one run: the column fidelity and
    pair dependence of the rows the DP-finetuned generator wrote before GRPO (round 1 of
    ``refinement_rounds.jsonl``) against those of the final set the trained generator wrote;
    and the reward's signal against its noise: the spread, within each group of
    ``grpo-group-size`` texts, of the *exact* similarity scores (recomputed here from the weak
    sites' rows, which a simulation may read) next to the vote's noise sigma from the privacy
    report. Nothing here is private: a diagnostic of a simulation."""
    from common.federation import benchmark, simulation_node_data, simulation_tiers
    from common.io import read_jsonl
    from common.models import embed, load_embedder
    from common.voting import similarity_scores
    from fedsyn_server.evaluation.tables import column_fidelity, pair_dependence, records_frame

    schema, bench = cfg.schema(), benchmark(cfg)
    test = records_frame(bench.test.texts, bench.test.codes, schema)
    rounds = read_jsonl(run_dir / "refinement_rounds.jsonl")
    first = [r for r in rounds if r["round"] == 1]
    final = read_jsonl(run_dir / "synthetic.jsonl")
    out: dict[str, float] = {}
    for name, rows in (("before", first), ("after", final)):
        frame = records_frame([r["text"] for r in rows], [r["control_code"] for r in rows], schema)
        out[f"fidelity_{name}"] = float(np.mean(list(column_fidelity(test, frame, schema).values())))
        out[f"dependence_{name}"] = float(np.mean(list(pair_dependence(test, frame, schema).values())))
    embedder = load_embedder(cfg.embedder)
    texts, codes = [r["text"] for r in first], [r["control_code"] for r in first]
    syn = embed(embedder, texts, max_tokens=cfg.vote_window)
    exact = np.zeros(len(texts))
    for pid, tier in enumerate(simulation_tiers(num_nodes, cfg.strong_fraction)):
        if tier == "weak":
            data = simulation_node_data(cfg, pid, num_nodes)[1]
            exact += similarity_scores(embed(embedder, data.texts, max_tokens=cfg.vote_window), data.codes, syn, codes)
    g = cfg.grpo_group_size
    spreads = [float(np.std(exact[k:k + g])) for k in range(0, len(texts) - g + 1, g)]
    report = json.loads((run_dir / "privacy_report.json").read_text())
    sigmas = [x["sigma"] for n in report["nodes"] for x in n["releases"] if x["phase"] == "vote" and "sigma" in x]
    voters = max(1, len({n["node_id"] for n in report["nodes"] if n["tier"] == "weak"}))
    out["signal_std_in_group"] = float(np.mean(spreads)) if spreads else math.nan
    # the sum of the voters' noise
    out["noise_sigma"] = float(np.sqrt(voters) * np.mean(sigmas)) if sigmas else math.nan
    return out


def collect(grid_path: Path, only_baselines: bool = False, cache: Path | None = None,
            cached_only: bool = False) -> list[dict[str, Any]]:
    """One row per method and seed: every finished fedsyn cell of the grid and, for each seed,
    partitioning and finite epsilon of a finished cell, the MST and AIM baselines (pooled and per
    site). With ``only_baselines``, the baselines of every cell's split whether it ran or not. Each
    baseline run's scores are kept under ``cache`` (default: the grid's ``<out-dir>/baselines``);
    with ``cached_only`` only those are reported and nothing is run."""
    from common.config import RunConfig
    from fedsyn_server.experiment import load_grid

    grid = load_grid(grid_path)
    cache = cache or grid.out_dir / "baselines"
    cache.mkdir(parents=True, exist_ok=True)
    rows, pooled_done, sites_done = [], set(), set()
    for cell in grid.cells:
        cfg = RunConfig.from_flower(dict(cell.run_config))
        evaluation = grid.out_dir / "runs" / cell.name / "evaluation.json"
        table = json.loads(evaluation.read_text()).get("table") if evaluation.is_file() else None
        eps = "inf" if math.isinf(cfg.epsilon) else f"{cfg.epsilon:g}"
        common_fields = {"epsilon": eps, "partitioning": cfg.partitioning, "seed": cell.seed}
        if table is not None:
            rows.append({"method": f"fedsyn {cell.method}", **common_fields, **pick(table)})
        else:
            print(f"{cell.name}: no table evaluation yet (fedsyn experiment {grid_path})")
        # The baselines do not wait for the fedsyn cell (the two grids can run side by side): they
        # write as many rows as it did, or as it was asked for when it has not run. The pooled
        # baseline sees the union of the sites' rows, the same under every partitioning; the
        # per-site one changes with it.
        key = (cell.seed, cfg.epsilon, cfg.partitioning)
        if math.isfinite(cfg.epsilon) and key not in sites_done and (table is not None or only_baselines):
            sites_done.add(key)
            pooled = key[:2] not in pooled_done
            pooled_done.add(key[:2])
            n_rows = int(table["n_synthetic"]) if table is not None else cfg.num_synthetic
            for method, scores in baseline_rows(cfg, grid.num_supernodes or 2, n_rows,
                                                synthesisers(), cache=cache, pooled=pooled,
                                                cached_only=cached_only):
                scope = {"partitioning": "any"} if method.endswith("pooled") else {}
                rows.append({"method": method, **common_fields, **scope, **scores})
    return rows


def grpo_rows(grid_path: Path) -> list[dict[str, Any]]:
    """``grpo_diagnostics`` of every finished ``grpo`` cell of the grid, one row per seed."""
    from common.config import RunConfig
    from fedsyn_server.experiment import load_grid

    grid = load_grid(grid_path)
    out = []
    for cell in grid.cells:
        run_dir = grid.out_dir / "runs" / cell.name
        cfg = RunConfig.from_flower(dict(cell.run_config))
        if cfg.refinement == "grpo" and (run_dir / "evaluation.json").is_file():
            out.append({"seed": cell.seed, **grpo_diagnostics(run_dir, cfg, grid.num_supernodes or 2)})
    return out


def summary(rows: list[dict[str, Any]]) -> str:
    """Mean ± sample standard deviation (n − 1) over seeds per (method, epsilon, partitioning), as a
    Markdown table."""
    groups: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault((row["method"], row["epsilon"], row.get("partitioning", "iid")), []).append(row)
    names = [m for m in METRICS if m != "rows"]
    lines = ["| method | ε | partitioning | seeds | rows | " + " | ".join(names) + " |",
             "|---" * (5 + len(names)) + "|"]
    for (method, eps, part), group in sorted(groups.items(), key=lambda kv: (kv[0][2], kv[0][0])):
        cells = []
        for name in names:
            values = np.array([g[name] for g in group], dtype=float)
            cells.append("–" if np.isnan(values).all() else
                         f"{np.nanmean(values):.3f} ± "
                         f"{np.nanstd(values, ddof=1) if np.isfinite(values).sum() > 1 else 0.0:.3f}")
        rows_mean = np.nanmean([g["rows"] for g in group])
        lines.append(f"| {method} | {eps} | {part} | {len(group)} | {rows_mean:.0f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--grid", default=str(Path(__file__).with_name("tables.toml")))
    parser.add_argument("--out", default=str(Path(__file__).parents[1] / "docs"))
    parser.add_argument("--name", default="tables_results.csv", help="the CSV's file name under --out")
    parser.add_argument("--baselines-only", action="store_true",
                        help="run the baselines of every split of the grid without waiting for its fedsyn cells")
    parser.add_argument("--cache", default=None,
                        help="folder of each baseline run's scores (default <out-dir>/baselines): one kept with "
                             "the results lets a long grid resume in another checkout")
    parser.add_argument("--cached-only", action="store_true",
                        help="run no baseline: report the fedsyn cells and the baselines already in the cache")
    args = parser.parse_args()
    rows = collect(Path(args.grid), only_baselines=args.baselines_only, cache=Path(args.cache) if args.cache else None,
                   cached_only=args.cached_only)
    if not rows:
        raise SystemExit(f"no finished cell in {args.grid}: run `fedsyn experiment {args.grid}` first")
    path = atomic_write_csv(Path(args.out) / args.name, rows, ["method", "epsilon", "partitioning", "seed", *METRICS])
    print(summary(rows))
    print(f"\n-> {path}")
    diagnostics = grpo_rows(Path(args.grid))
    if diagnostics:
        fields = ["seed", "fidelity_before", "fidelity_after", "dependence_before", "dependence_after",
                  "signal_std_in_group", "noise_sigma"]
        path = atomic_write_csv(Path(args.out) / "tables_grpo.csv", diagnostics, fields)
        print("\n| " + " | ".join(fields) + " |\n" + "|---" * len(fields) + "|")
        for d in diagnostics:
            print("| " + " | ".join(f"{d[f]:.3f}" if isinstance(d[f], float) else str(d[f]) for f in fields) + " |")
        print(f"\n-> {path}")


if __name__ == "__main__":
    main()
