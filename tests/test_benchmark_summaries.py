"""The benchmark summaries keep what they measured when a run's folder is gone (``results/`` is
not kept between checkouts): their own last CSV is read after the grids, and a re-run wins."""

from __future__ import annotations

import csv
from pathlib import Path

from benchmarks import accounting, writer_grid


def _write(path: Path, rows: list[dict], fields: list[str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        w.writerows(rows)


def test_writer_grid_keeps_the_runs_of_its_last_csv_and_a_grids_row_wins(tmp_path):
    row = {"dataset": "rt", "partitioning": "iid", "method": "mixed-contrastive-vote", "seed": "1", "accuracy": "0.7",
           "label_fidelity": "0.6", "mauve": "", "kept_pretrained": "0.5", "seconds": "200",
           "from": "benchmarks/writer_grid_rt.toml"}
    _write(tmp_path / "docs" / "writer_grid_results.csv", [row], writer_grid.COLUMNS)
    kept = writer_grid.read_rows(tmp_path)
    assert len(kept) == 1 and kept[0]["accuracy"] == 0.7 and kept[0]["seed"] == 1 and kept[0]["from"] == row["from"]
    assert kept[0]["mauve"] != kept[0]["mauve"]  # an empty cell is NaN, as from a grid
    # an earlier grid's CSV naming the same run comes first
    earlier = {"method": "mixed-contrastive-vote", "seed": "1", "partitioning": "iid",
               "utility/sentiment/accuracy": "0.9"}
    _write(tmp_path / "docs" / "label_grid_results.csv", [earlier], list(earlier))
    (again,) = writer_grid.read_rows(tmp_path)
    assert again["accuracy"] == 0.9 and again["from"] == "docs/label_grid_results.csv"


def test_accounting_keeps_its_last_csvs_rows_and_reads_an_old_one_as_the_default_preset(tmp_path):
    old_fields = [c for c in accounting.COLUMNS if c != "preset"]  # written before the preset column
    row = {"dataset": "bbc", "rule": "pld", "seed": "2", "accuracy": "0.85", "label_fidelity": "0.8", "mauve": "0.1",
           "node": "4388972780238831648", "tier": "weak", "budget": "8.0", "charged": "8.0", "pld_spent": "7.99",
           "share_used": "0.999", "vote_sigma": "1.73", "noise_multiplier": "nan"}
    earlier = tmp_path / "accounting_results.csv"
    _write(earlier, [row], old_fields)
    (kept,) = accounting.read_rows(tmp_path / "no-state", root=tmp_path, earlier=earlier)
    assert kept["preset"] == "default" and kept["seed"] == 2 and kept["node"] == row["node"]
    assert kept["share_used"] == 0.999 and "| BBC News (topic) | default | pld | 1 |" in accounting.markdown([kept])
