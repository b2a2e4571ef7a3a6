"""Issue 47, measured: the default run and the quality preset under ``accounting = "basic"`` against ``"pld"``.

Usage: python -m benchmarks.accounting [--state DIR] [--out docs/accounting]

Reads the finished cells of ``benchmarks/accounting_{bbc,rt}.toml`` (the default under pld) and
their basic counterparts (the default's IID cells of ``benchmarks/writer_grid_{bbc,rt}.toml``), the
quality preset's (``benchmarks/accounting_quality_{bbc,rt}.toml``, BBC's basic counterpart in
``benchmarks/writer_quality.toml``), then the rows of its own last CSV for runs whose folders are
gone; and for each run recomputes every node's spend from its own ledger (``DIR``: the simulated nodes'
state root, ``$FEDSYN_STATE_DIR`` or ``<tmp>/fedsyn-sim``) with ``dp_accounting`` alone, not
through ``common.calibration``: the PLD composition of all the run's releases (what the pld
rule promises), as a share of the node's budget. Writes ``<out>_results.csv`` (one row per run and node)
and prints the markdown table
of accuracy, label fidelity and MAUVE per rule with the vote's sigma, the DP-SGD noise
multiplier and the budget share used.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import tempfile
from pathlib import Path

import numpy as np

from benchmarks.writer_grid import LABEL, NAMES, _float, _results
from common.io import atomic_write_csv

ROOT = Path(__file__).resolve().parents[1]
# (dataset, preset, rule, grid file, the grid's method of that rule)
SOURCES = [("bbc", "default", "basic", "benchmarks/writer_grid_bbc.toml", "mixed-contrastive-vote"),
           ("bbc", "default", "pld", "benchmarks/accounting_bbc.toml", "mixed-contrastive-vote-pld"),
           ("rt", "default", "basic", "benchmarks/writer_grid_rt.toml", "mixed-contrastive-vote"),
           ("rt", "default", "pld", "benchmarks/accounting_rt.toml", "mixed-contrastive-vote-pld"),
           ("bbc", "quality", "basic", "benchmarks/writer_quality.toml", "quality-mixed"),
           ("bbc", "quality", "pld", "benchmarks/accounting_quality_bbc.toml", "quality-mixed-pld"),
           ("rt", "quality", "basic", "benchmarks/accounting_quality_rt.toml", "quality-mixed"),
           ("rt", "quality", "pld", "benchmarks/accounting_quality_rt.toml", "quality-mixed-pld")]
PRESETS = ("default", "quality")
COLUMNS = ["dataset", "preset", "rule", "seed", "accuracy", "label_fidelity", "mauve", "node", "tier", "budget",
           "charged",
           "pld_spent", "share_used", "vote_sigma", "noise_multiplier"]


def spent_by_pld(entries: list[dict]) -> float:
    """dp_accounting's PLD epsilon of a run's ledger entries, all composed together at the sum of
    their deltas (a vote after DP-SGD too: the pld rule composes it since 2026-11-28); NaN without
    the details."""
    from dp_accounting import dp_event
    from dp_accounting.pld import pld_privacy_accountant

    acc, delta = pld_privacy_accountant.PLDAccountant(), 0.0
    for e in entries:
        public, private = e.get("public", {}), e.get("private", {})
        if e["mechanism"] == "gaussian":
            acc.compose(dp_event.GaussianDpEvent(public["sigma"] / public["sensitivity"]))
        elif "noise_multiplier" in private:
            step = dp_event.PoissonSampledDpEvent(private["sample_rate"],
                                                  dp_event.GaussianDpEvent(private["noise_multiplier"]))
            acc.compose(dp_event.SelfComposedDpEvent(step, int(private["steps"])))
        else:
            return float("nan")
        # DP-SGD's later rounds are charged 0 and carry no delta of their own
        delta += float(e["delta"]) if float(e["epsilon"]) > 0 or e["mechanism"] == "gaussian" else 0.0
    return float(acc.get_epsilon(delta)) if entries else 0.0


def read_rows(state: Path, root: Path = ROOT, earlier: Path | None = None) -> list[dict]:
    """One row per finished run and node of ``SOURCES`` (the IID cells), then the rows of
    ``earlier`` (this script's last CSV) for the (dataset, preset, rule, seed) none of them ran."""
    from fedsyn_server.experiment import load_grid

    rows = []
    for dataset, preset, rule, name, method in SOURCES:
        path = root / name
        if not path.is_file():
            continue
        grid = load_grid(path)
        cells = {(c.method, c.seed, dict(c.run_config).get("partitioning", "iid")): c.name for c in grid.cells}
        for r in _results(path):
            if r["method"] != method or r.get("partitioning", "iid") != "iid":
                continue
            label = LABEL[dataset]
            run_dir = Path(grid.out_dir) / "runs" / cells[(method, int(float(r["seed"])), "iid")]
            report = json.loads((run_dir / "privacy_report.json").read_text())
            for node in report["nodes"]:
                run_key = node["releases"][0]["run_id"] if node["releases"] else ""
                ledgers = list((state / f"run-{run_key}").glob("node-*/ledger.json"))
                mine = [e for p in ledgers for e in json.loads(p.read_text())["releases"]
                        if e["run_id"] == run_key and e.get("status") != "cancelled"
                        and (json.loads(p.read_text()).get("ref") == node["ledger_ref"])]
                vote = [e["sigma"] for e in node["releases"] if e["phase"] == "vote"]
                nm = [e.get("private", {}).get("noise_multiplier") for e in mine if e["mechanism"] == "dp-sgd"]
                pld = spent_by_pld(mine) if mine else float("nan")
                rows.append({"dataset": dataset, "preset": preset, "rule": rule, "seed": int(float(r["seed"])),
                             "accuracy": float(r[f"utility/{label}/accuracy"]),
                             "label_fidelity": _float(r.get(f"utility/{label}/label_fidelity")),
                             "mauve": _float(r.get("alignment/mauve/mean")), "node": node["node_id"],
                             "tier": node["tier"], "budget": node["epsilon_budget"], "charged": node["epsilon_spent"],
                             "pld_spent": pld, "share_used": pld / node["epsilon_budget"],
                             "vote_sigma": vote[0] if vote else float("nan"),
                             "noise_multiplier": nm[0] if nm and nm[0] else float("nan")})
    if earlier is not None and earlier.is_file():
        done = {(r["dataset"], r["preset"], r["rule"], r["seed"]) for r in rows}
        with open(earlier, newline="") as f:
            for r in csv.DictReader(f):
                r = {**r, "preset": r.get("preset") or "default", "seed": int(float(r["seed"]))}
                if (r["dataset"], r["preset"], r["rule"], r["seed"]) not in done:
                    rows.append({k: r[k] if k in ("dataset", "preset", "rule", "seed", "node", "tier") else _float(r[k])
                                 for k in COLUMNS})
    return rows


def markdown(rows: list[dict]) -> str:
    """Per preset, dataset and rule: the run metrics (mean ± std over seeds) and the nodes' noise and spend."""
    lines = ["| dataset | preset | rule | runs | accuracy | label fidelity | MAUVE | weak vote σ | "
             "DP-SGD noise multiplier | "
             "budget used by PLD (min–max over nodes) |", "|---|---|---|---|---|---|---|---|---|---|"]
    for dataset, preset, rule in ((d, p, r) for p in PRESETS for d in NAMES for r in ("basic", "pld")):
        mine = [r for r in rows if (r["dataset"], r["preset"], r["rule"]) == (dataset, preset, rule)]
        if not mine:
            continue
        runs = {r["seed"]: r for r in mine}

        def stat(key: str, of: list[dict]) -> str:
            values = np.array([r[key] for r in of], dtype=np.float64)
            return f"{np.nanmean(values):.3f} ± {np.nanstd(values):.3f}"

        weak = [r for r in mine if r["tier"] == "weak"]
        strong = [r for r in mine if r["tier"] == "strong"]
        used = np.array([r["share_used"] for r in mine], dtype=np.float64)
        lines.append(f"| {NAMES[dataset]} | {preset} | {rule} | {len(runs)} | "
                     f"{stat('accuracy', list(runs.values()))} | "
                     f"{stat('label_fidelity', list(runs.values()))} | {stat('mauve', list(runs.values()))} | "
                     f"{np.nanmean([r['vote_sigma'] for r in weak]):.3f} | "
                     f"{np.nanmean([r['noise_multiplier'] for r in strong]):.3f} | "
                     f"{np.nanmin(used):.1%}–{np.nanmax(used):.1%} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default_state = Path(os.environ.get("FEDSYN_STATE_DIR") or Path(tempfile.gettempdir()) / "fedsyn-sim")
    parser.add_argument("--state", type=Path, default=default_state)
    parser.add_argument("--out", default="docs/accounting")
    args = parser.parse_args(argv)
    out = ROOT / f"{args.out}_results.csv"
    rows = read_rows(args.state, earlier=out)
    atomic_write_csv(out, sorted(rows, key=lambda r: (r["dataset"], PRESETS.index(r["preset"]), r["rule"], r["seed"])),
                     COLUMNS)
    print(markdown(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
