"""Issue 46's grid, summarised: does the mixed pool take the better writer in every dataset × split?

Usage: python -m benchmarks.writer_grid [--out docs/writer_grid]

Reads the finished cells of ``benchmarks/writer_grid_{bbc,rt,source}.toml`` and
``benchmarks/writer_quality.toml`` (each run's ``evaluation.json``, as ``fedsyn experiment`` collects
them; nothing is run) and, for
the cells those grids did not run again, the earlier grids' rows of the same set-up (4 nodes, one
strong, ε = 8, 3 seeds: BBC IID from ``docs/finetune_study_results.csv``, BBC non-IID from
``docs/finetune_study_noniid_results.csv``, Rotten Tomatoes from ``docs/label_grid_results.csv``).
Writes ``<out>_results.csv`` (one row per run: ``dataset``, ``partitioning``, ``method``, ``seed``,
accuracy, label fidelity, MAUVE, the share of kept texts θ⁰ wrote, the run's seconds, the file it
came from), ``<out>.png`` (accuracy per cell and method, mean ± std over seeds) and prints the
markdown table with the issue's test: the mixed pool's mean ≥ the better of the two one-writer
methods' means minus 0.01.
"""

from __future__ import annotations

import argparse
import csv
from pathlib import Path

import numpy as np

from common.io import atomic_write_csv
from fedsyn_server.outputs import save_figure

ROOT = Path(__file__).resolve().parents[1]
LABEL = {"bbc": "topic", "rt": "sentiment", "source": "source"}
NAMES = {"bbc": "BBC News (topic)", "rt": "Rotten Tomatoes (sentiment)", "source": "movie-review-source (who wrote it)"}
# (dataset, grid file or results file, the partitioning of a file without that column)
SOURCES = [
    ("bbc", "benchmarks/writer_grid_bbc.toml", None),
    ("bbc", "benchmarks/writer_quality.toml", "iid"),  # its split is in [base], not a grid axis
    ("bbc", "docs/finetune_study_results.csv", "iid"),
    ("bbc", "docs/finetune_study_noniid_results.csv", "strong-codes:sport,tech"),
    ("rt", "benchmarks/writer_grid_rt.toml", None),
    ("rt", "docs/label_grid_results.csv", None),
    ("source", "benchmarks/writer_grid_source.toml", None),
    # this script's own last CSV: the runs whose result folders are gone (results/ is not kept)
    (None, "docs/writer_grid_results.csv", None),
]
ONE_WRITER = ("zero-shot-contrastive-vote", "dp-contrastive-vote")
# issue 33's quality preset (one writer) beside its re-measure with the mixed pool
QUALITY = ("dp-pe-contrastive-12steps", "quality-mixed")
MIXED = "mixed-contrastive-vote"
COLUMNS = ["dataset", "partitioning", "method", "seed", "accuracy", "label_fidelity", "mauve",
           "kept_pretrained", "seconds", "from"]


def read_rows(root: Path = ROOT) -> list[dict]:
    """One row per run of the grid's methods (``ONE_WRITER``, ``MIXED`` and its variants ``mixed-*``),
    the first file naming a (dataset, partitioning, method, seed) winning: a grid's finished cells,
    then the earlier grids' CSVs, then the rows this script wrote last time."""
    rows: dict[tuple, dict] = {}
    for dataset, name, partitioning in SOURCES:
        path = root / name
        if not path.is_file():
            continue
        if dataset is None:
            for r in _results(path):
                key = (r["dataset"], r["partitioning"], r["method"], int(float(r["seed"])))
                rows.setdefault(key, {**r, "seed": key[3], **{k: _float(r[k]) for k in COLUMNS[4:-1]}})
            continue
        label = LABEL[dataset]
        for r in _results(path):
            if r["method"] not in ONE_WRITER + QUALITY and not r["method"].startswith("mixed"):
                continue
            part = r.get("partitioning") or partitioning
            key = (dataset, part, r["method"], int(float(r["seed"])))
            kept = [float(v) for k, v in r.items() if v and k.startswith("writers/kept_share/")
                    and k.endswith("/pretrained")]
            rows.setdefault(key, {
                "dataset": dataset, "partitioning": part, "method": r["method"], "seed": key[3],
                "accuracy": float(r[f"utility/{label}/accuracy"]),
                "label_fidelity": _float(r.get(f"utility/{label}/label_fidelity")),
                "mauve": _float(r.get("alignment/mauve/mean")),
                # a one-writer method wrote no writers block: its writer is its name's
                "kept_pretrained": (float(np.mean(kept)) if kept else
                                    1.0 if r["method"].startswith("zero-shot") else
                                    0.0 if r["method"].startswith("dp-") else float("nan")),
                "seconds": _float(r.get("seconds/total")), "from": name})
    return list(rows.values())


def _results(path: Path) -> list[dict]:
    """The rows of a results CSV, or a grid file's finished cells (as strings, like the CSV's)."""
    if path.suffix == ".toml":
        from fedsyn_server.experiment import collect, load_grid

        return [{k: str(v) for k, v in row.items()} for row in collect(load_grid(path))]
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def _float(value: str | None) -> float:
    return float(value) if value not in (None, "") else float("nan")


def cells(rows: list[dict]) -> list[tuple[str, str]]:
    """(dataset, partitioning) in the order of ``NAMES``, IID first."""
    found = {(r["dataset"], r["partitioning"]) for r in rows}
    return sorted(found, key=lambda c: (list(NAMES).index(c[0]), c[1] != "iid", c[1]))


def summary(rows: list[dict]) -> list[dict]:
    """Per cell and method: n, mean and std of each metric over seeds."""
    out = []
    for cell in cells(rows):
        methods = dict.fromkeys(r["method"] for r in rows if (r["dataset"], r["partitioning"]) == cell)
        for method in sorted(methods,
                             key=lambda m: (m not in ONE_WRITER, ONE_WRITER.index(m) if m in ONE_WRITER else 0, m)):
            mine = [r for r in rows if (r["dataset"], r["partitioning"], r["method"]) == (*cell, method)]
            entry = {"dataset": cell[0], "partitioning": cell[1], "method": method, "n": len(mine)}
            for key in ("accuracy", "label_fidelity", "mauve", "kept_pretrained", "seconds"):
                values = np.array([r[key] for r in mine], dtype=np.float64)
                entry[key], entry[f"{key}_std"] = float(np.nanmean(values)), float(np.nanstd(values))
            entry["per_seed"] = [round(r["accuracy"], 3) for r in sorted(mine, key=lambda r: r["seed"])]
            out.append(entry)
    return out


def verdicts(table: list[dict], method: str = MIXED, slack: float = 0.01) -> dict[tuple[str, str], str]:
    """Per cell: whether ``method``'s mean accuracy is ≥ the better one-writer mean minus ``slack``."""
    out = {}
    for cell in dict.fromkeys((e["dataset"], e["partitioning"]) for e in table):
        by = {e["method"]: e for e in table if (e["dataset"], e["partitioning"]) == cell}
        if method not in by or not all(m in by for m in ONE_WRITER):
            out[cell] = "not measured yet"
            continue
        best = max(by[m]["accuracy"] for m in ONE_WRITER)
        gap = by[method]["accuracy"] - best
        out[cell] = f"{'met' if gap >= -slack else 'NOT met'} ({gap:+.3f} against the better, {best:.3f})"
    return out


def markdown(table: list[dict]) -> str:
    """The table of ``summary`` with the verdict under each cell."""
    lines = ["| dataset | split | method | n | accuracy (mean ± std) | per seed | label fidelity | MAUVE | "
             "kept from θ⁰ | seconds |", "|---|---|---|---|---|---|---|---|---|---|"]
    for e in table:
        lines.append(f"| {NAMES[e['dataset']]} | {e['partitioning']} | {e['method']} | {e['n']} | "
                     f"{e['accuracy']:.3f} ± {e['accuracy_std']:.3f} | {' / '.join(map(str, e['per_seed']))} | "
                     f"{e['label_fidelity']:.3f} | {e['mauve']:.3f} | {e['kept_pretrained']:.2f} | "
                     f"{e['seconds']:.0f} |")
    mixed = [m for m in dict.fromkeys(e["method"] for e in table) if m.startswith(MIXED.split("-")[0])]
    lines += ["", "| dataset | split | " + " | ".join(f"{m} ≥ the better one-writer method − 0.01" for m in mixed)
              + " |", "|---|---|" + "---|" * len(mixed)]
    verdict = {m: verdicts(table, m) for m in mixed}
    lines += [f"| {NAMES[d]} | {p} | " + " | ".join(verdict[m][(d, p)] for m in mixed) + " |"
              for d, p in dict.fromkeys((e["dataset"], e["partitioning"]) for e in table)]
    return "\n".join(lines)


def plot(table: list[dict], out: Path) -> Path:
    """Accuracy per cell (groups) and method (bars), mean ± std over seeds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = list(dict.fromkeys((e["dataset"], e["partitioning"]) for e in table))
    methods = list(dict.fromkeys(e["method"] for e in table))
    width = 0.8 / max(len(methods), 1)
    fig, ax = plt.subplots(figsize=(2.2 * len(groups) + 2, 4))
    for k, method in enumerate(methods):
        ys = [next((e for e in table if (e["dataset"], e["partitioning"], e["method"]) == (*g, method)), None)
              for g in groups]
        x = np.arange(len(groups)) + (k - (len(methods) - 1) / 2) * width
        ax.bar(x, [e["accuracy"] if e else 0 for e in ys], width, yerr=[e["accuracy_std"] if e else 0 for e in ys],
               label=method, capsize=2)
    ax.set_xticks(np.arange(len(groups)), [f"{NAMES[d].split(' (')[0]}\n{p}" for d, p in groups], fontsize=8)
    ax.set_ylabel("accuracy (classifier on the final set, real held-out)")
    ax.set_ylim(0.3, 1.0)
    ax.set_title("Issue 46: the votes choose the writer (4 nodes, ε = 8, 3 seeds)")
    ax.legend(fontsize=8, loc="lower left")
    return save_figure(fig, out)


def main() -> int:
    """Collect, write the CSV and the plot, print the table."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(ROOT / "docs" / "writer_grid"))
    args = ap.parse_args()
    rows = read_rows()
    out = Path(args.out)
    atomic_write_csv(out.with_name(out.name + "_results.csv"),
                     sorted(rows, key=lambda r: (r["dataset"], r["partitioning"], r["method"], r["seed"])), COLUMNS)
    table = summary(rows)
    plot(table, out.with_suffix(".png"))
    print(markdown(table))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
