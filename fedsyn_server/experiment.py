"""``fedsyn experiment <grid.toml>``: a grid of simulations, resumable, summarised with plots.

A grid file names the cells: every combination of the ``[grid]`` lists, for every
method in ``[methods.<name>]``, for every seed. Each cell is one real ``flwr run`` of
this app (``fedsyn_server.flwr_runner``) with ``[base]`` + method + combination + seed
as run config. A cell whose run folder already holds its evaluation is skipped, so an
interrupted experiment resumes where it stopped.

```toml
[experiment]
out-dir = "results/paper"        # relative to the grid file
seeds = [0, 1, 2]
num-supernodes = 4
metric = "utility/topic/accuracy"  # plotted against strong-fraction
# preset = "../presets/table-breast-cancer.toml"  # optional: a run-config file under [base]

[base]
num-synthetic = 120

[grid]
strong-fraction = [0.25, 0.5]
partitioning = ["iid", "strong-codes:sport,tech"]
epsilon = [inf, 8.0]

[methods.zero-shot]
prompt = "zero-shot"
[methods.knn-vote]
refinement = "knn-vote"
```

Outputs in ``out-dir``: ``runs/<cell>/`` (each run's outputs), ``results.csv`` (one row
per cell), ``results.md`` (mean ± std over seeds), ``plots/metric_vs_strong_fraction.png``
(paper Fig. 2) and ``plots/vote_distributions.png`` (paper Fig. A.3).
"""

from __future__ import annotations

import itertools
import json
import math
import tomllib
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from common.config import RunConfig
from common.io import atomic_write_csv, atomic_write_text, read_jsonl
from common.logs import get_logger
from fedsyn_server.flwr_args import relative_paths
from fedsyn_server.outputs import save_figure
from strategies.checkpoint import FOLDER as CHECKPOINT, STATE as CHECKPOINT_STATE

log = get_logger(__name__)
EVALUATION_FILE = "evaluation.json"
GRID_SECTIONS = ("experiment", "base", "grid", "methods")
EXPERIMENT_KEYS = ("out-dir", "seeds", "num-supernodes", "metric", "preset")


@dataclass(frozen=True)
class Cell:
    """One simulation of the grid."""

    method: str
    params: tuple[tuple[str, Any], ...]  # the grid combination, in grid order
    seed: int
    run_config: tuple[tuple[str, Any], ...]

    @property
    def name(self) -> str:
        """A folder name unique within the grid."""
        parts = [self.method] + [f"{k}={_slug(v)}" for k, v in self.params] + [f"seed={self.seed}"]
        return "__".join(parts)


@dataclass(frozen=True)
class Grid:
    """A parsed grid file."""

    out_dir: Path
    seeds: list[int]
    num_supernodes: int | None
    metric: str
    cells: list[Cell]


def load_grid(path: str | Path) -> Grid:
    """Parse and validate a grid file; every cell's run config is validated here, before
    any simulation starts, so a typo fails in a second rather than after an hour."""
    path = Path(path)
    spec = tomllib.loads(path.read_text())
    # a misspelt section or key would silently run the wrong grid for hours: refuse it now
    for where, keys, allowed in ((path.name, spec, GRID_SECTIONS), ("[experiment]", spec.get("experiment", {}),
                                                                  EXPERIMENT_KEYS)):
        unknown = sorted(set(keys) - set(allowed))
        if unknown:
            raise ValueError(f"{path}: unknown {'section' if where == path.name else 'key'}(s) {unknown} in {where}; "
                             f"allowed: {list(allowed)}")
    exp = spec.get("experiment", {})
    base = spec.get("base", {})
    if exp.get("preset"):  # a run-config file (presets/*.toml) under [base]
        base = {**tomllib.loads((path.parent / exp["preset"]).read_text()), **base}
    if "table-schema" in base:  # inline on one line, or read from its file (relative to the grid file)
        base.update({k: v for k, v in relative_paths(base, path.parent).items() if k == "table-schema"})
    grid = spec.get("grid", {})
    methods = spec.get("methods") or {"default": {}}
    for key, values in grid.items():
        if not isinstance(values, list) or not values:
            raise ValueError(f"[grid] {key} must be a non-empty list, got {values!r}")
    seeds = [int(s) for s in exp.get("seeds", [0])]
    cells = []
    # Seeds outermost: an interrupted experiment has whole seeds done, not whole methods.
    for seed in seeds:
        for combo in itertools.product(*grid.values()) if grid else [()]:
            params = tuple(zip(grid.keys(), combo))
            for method, overrides in methods.items():
                rc = {**base, **overrides, **dict(params), "seed": seed}
                RunConfig.from_flower(rc)  # raises ConfigError naming the key
                cells.append(Cell(method, params, seed, tuple(rc.items())))
    out = Path(exp.get("out-dir", path.stem))
    return Grid(out if out.is_absolute() else (path.parent / out).resolve(), seeds,
                exp.get("num-supernodes"), exp.get("metric", "utility/topic/accuracy"), cells)


def cell_run_config(cell: Cell, runs: Path) -> dict[str, Any]:
    """The run config of ``cell`` under ``runs``; a cell cut off before (timeout, crash) that left
    a checkpoint is resumed from it, so no stage it finished is computed (or paid for) again."""
    rc = {**dict(cell.run_config), "out-dir": str(runs), "run-name": cell.name}
    if (runs / cell.name / CHECKPOINT / CHECKPOINT_STATE).is_file():
        rc["resume"] = str(runs / cell.name)
    return rc


def run_grid(grid: Grid, timeout: float = 3600) -> list[dict[str, Any]]:
    """Run every cell not yet finished, then write results.csv, results.md and the plots."""
    from fedsyn_server.flwr_runner import run_app

    runs = grid.out_dir / "runs"
    fed = f"num-supernodes={grid.num_supernodes}" if grid.num_supernodes else None
    todo = [c for c in grid.cells if not (runs / c.name / EVALUATION_FILE).exists()]
    logs = grid.out_dir / "logs"
    log.info("experiment: %d cells, %d already done, %d to run -> %s (each cell's log: %s/<cell>.log)",
             len(grid.cells), len(grid.cells) - len(todo), len(todo), grid.out_dir, logs)
    for cell in tqdm(todo, desc="experiment", unit="run"):
        rc = cell_run_config(cell, runs)
        if "resume" in rc:
            log.info("cell %s was cut off: resuming it from its checkpoint", cell.name)
        cell_log = logs / f"{cell.name}.log"
        res = run_app(rc, federation_config=fed, timeout=timeout, log_path=cell_log)
        if not res.ok:
            log.error("cell %s failed (exit %d, status %r); it will be retried next time (whole log: %s):\n%s",
                      cell.name, res.returncode, res.status, cell_log, res.output[-3000:])
        else:
            log.info("cell %s done in %.0fs", cell.name, res.seconds)
    rows = collect(grid)
    write_summary(grid, rows)
    return rows


def collect(grid: Grid) -> list[dict[str, Any]]:
    """One row per finished cell: its parameters and its flattened evaluation metrics."""
    rows = []
    for cell in grid.cells:
        path = grid.out_dir / "runs" / cell.name / EVALUATION_FILE
        if not path.exists():
            continue
        row: dict[str, Any] = {"cell": cell.name, "method": cell.method, "seed": cell.seed, **dict(cell.params)}
        row.update(flatten(json.loads(path.read_text())))
        metrics = path.with_name("metrics.json")
        if metrics.exists():  # the run's phase times, for quality per second (benchmarks/front.py)
            row.update(flatten(json.loads(metrics.read_text()).get("timings_s", {}), "seconds/"))
        rows.append(row)
    return rows


def flatten(obj: Any, prefix: str = "") -> dict[str, float]:
    """Numeric leaves of a nested dict as ``a/b/c -> value``."""
    out: dict[str, float] = {}
    if isinstance(obj, dict):
        for k, v in obj.items():
            out.update(flatten(v, f"{prefix}{k}/"))
    elif isinstance(obj, (int, float)) and not isinstance(obj, bool):
        out[prefix.rstrip("/")] = float(obj)
    return out


def summarise(rows: list[dict[str, Any]], group_keys: list[str], metrics: list[str]) -> list[dict[str, Any]]:
    """Mean and std over seeds of each metric, per group (method + grid parameters)."""
    groups: dict[tuple, list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        groups[tuple(r.get(k) for k in group_keys)].append(r)
    out = []
    for key, members in groups.items():
        entry: dict[str, Any] = dict(zip(group_keys, key))
        entry["n"] = len(members)
        for m in metrics:
            vals = [r[m] for r in members if m in r and not math.isnan(r[m])]
            entry[m] = (float(np.mean(vals)), float(np.std(vals))) if vals else (math.nan, math.nan)
        out.append(entry)
    return out


def write_summary(grid: Grid, rows: list[dict[str, Any]]) -> None:
    """results.csv, results.md and the plots for the finished cells."""
    grid.out_dir.mkdir(parents=True, exist_ok=True)
    if not rows:
        log.warning("no finished cells yet")
        return
    columns = list(dict.fromkeys(k for r in rows for k in r))
    atomic_write_csv(grid.out_dir / "results.csv", rows, columns)

    group_keys = ["method"] + [k for k, _ in grid.cells[0].params]
    metrics = [m for m in columns if "/" in m and _headline(m)]
    table = summarise(rows, group_keys, metrics)
    md = ["| " + " | ".join(group_keys + ["n"] + metrics) + " |", "|" + "---|" * (len(group_keys) + 1 + len(metrics))]
    for e in table:
        md.append("| " + " | ".join([str(e[k]) for k in group_keys] + [str(e["n"])] +
                                    [f"{e[m][0]:.4f} ± {e[m][1]:.4f}" for m in metrics]) + " |")
    atomic_write_text(grid.out_dir / "results.md", "\n".join(md) + "\n")
    plot_metric_vs_strong_fraction(grid, rows)
    plot_vote_distributions(grid)


def _headline(metric: str) -> bool:
    # The table keeps the paper's headline numbers; results.csv keeps everything.
    return metric.endswith(("accuracy", "macro_f1", "frechet_distance", "precision", "recall",
                            "label_fidelity", "mauve/mean", "total_variation"))


def plot_metric_vs_strong_fraction(grid: Grid, rows: list[dict[str, Any]]) -> Path | None:
    """Paper Fig. 2: the headline metric against strong fraction, one line per method, a panel per epsilon."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not any("strong-fraction" in r for r in rows) or not any(grid.metric in r for r in rows):
        return None
    eps_values = sorted({str(r.get("epsilon", "8.0")) for r in rows})
    fig, axes = plt.subplots(1, len(eps_values), figsize=(5 * len(eps_values), 3.6), squeeze=False)
    for ax, eps in zip(axes[0], eps_values):
        for method in sorted({r["method"] for r in rows}):
            sel = [r for r in rows
                   if r["method"] == method and str(r.get("epsilon", "8.0")) == eps and grid.metric in r]
            by_f: dict[float, list[float]] = defaultdict(list)
            for r in sel:
                by_f[float(r["strong-fraction"])].append(r[grid.metric])
            if by_f:
                xs = sorted(by_f)
                ax.errorbar(xs, [np.mean(by_f[x]) for x in xs], yerr=[np.std(by_f[x]) for x in xs],
                            marker="o", capsize=3, label=method)
        ax.set_title(f"epsilon = {eps}")
        ax.set_xlabel("strong fraction")
        ax.set_ylabel(grid.metric)
        ax.legend(fontsize=8)
    return save_figure(fig, grid.out_dir / "plots" / "metric_vs_strong_fraction.png")


def pool_votes(grid: Grid) -> dict[str, list[float]]:
    """The noisy votes of every finished cell's pool, keyed by "<writer>, <refinement>" (writer:
    pretrained for zero-shot cells, else finetuned). kNN vote counts and contrastive ±1 sums are
    different statistics, so each refinement keeps its own key."""
    votes: dict[str, list[float]] = defaultdict(list)
    for cell in grid.cells:
        pool = grid.out_dir / "runs" / cell.name / "pool.jsonl"
        if not pool.exists():
            continue
        config = RunConfig.from_flower(dict(cell.run_config))
        writer = "pretrained (zero-shot)" if config.prompt == "zero-shot" else "finetuned"
        for row in read_jsonl(pool):
            v = row.get("votes")
            if v is not None:
                votes[f"{writer}, {config.refinement}"].append(float(v))
    return dict(votes)


def plot_vote_distributions(grid: Grid) -> Path | None:
    """Paper Fig. A.3: noisy votes of the pool before (zero-shot) and after finetuning, one panel
    per key of ``pool_votes``; None when no pool carries votes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    votes = pool_votes(grid)
    if not votes:
        return None
    fig, axes = plt.subplots(1, len(votes), figsize=(5 * len(votes), 3.4), squeeze=False)
    for ax, (label, vals) in zip(axes[0], sorted(votes.items())):
        ax.hist(vals, bins=40)
        ax.set_title(label)
        ax.set_xlabel("aggregated noisy votes per synthetic text")
    axes[0][0].set_ylabel("synthetic texts")
    return save_figure(fig, grid.out_dir / "plots" / "vote_distributions.png")


def _slug(v: Any) -> str:
    return str(v).replace("/", "-").replace(":", "-").replace(",", "+").replace(" ", "")

