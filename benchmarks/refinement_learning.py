"""Issue 74: what POPri's DPO and GRPO did in each cell of ``benchmarks/refinement_learning.toml``.

Reads the finished runs of the grid (``--runs``, default ``results/refinement_learning/runs``) and
prints, per cell, the accuracy and label fidelity, the update's own measures (POPri: pairs, DPO steps,
loss first to last, held-out margin before and after, kept; GRPO: steps, the PPO clip's share) and
each training round's reward signal-to-noise ratio; then each method paired with its no-update run
(``popri-epochs = 0``, ``grpo-iterations = 0``) seed by seed. Writes the rows to ``--csv``.

The SNR of a round is read from what the run released, nothing else: the mean within-group
variance of the summed DP scores (groups of J or G consecutive texts of a code) is the signal's
variance plus the noise's, σ² = Σ over the round's voters of their stated σ² (the privacy report);
SNR = sqrt(max(0, variance − σ²)) / σ. An estimate (its own noise is that of a variance over the
groups), not a measurement with the data.

    python -m benchmarks.refinement_learning [--runs DIR] [--csv docs/refinement_learning.csv]
"""

from __future__ import annotations

import argparse
import csv
import json
import math
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np

from common.io import read_jsonl


def round_snr(scores: list[float], codes: list[str], group: int, sigma: float) -> float:
    """The estimated signal-to-noise ratio of one round's summed scores: groups of ``group``
    consecutive texts of each code, signal variance = mean within-group variance (ddof 1) − σ²."""
    by_code: dict[str, list[float]] = defaultdict(list)
    for s, c in zip(scores, codes):
        by_code[c].append(s)
    variances = [float(np.var(v[i:i + group], ddof=1)) for v in by_code.values()
                 for i in range(0, len(v), group) if len(v[i:i + group]) > 1]
    if not variances or sigma <= 0:
        return math.nan
    return math.sqrt(max(0.0, float(np.mean(variances)) - sigma ** 2)) / sigma


def round_sigma(report: dict[str, Any], round_: int) -> float:
    """sqrt of the sum over voters of the stated σ² of their vote release of ``round_``."""
    variances = [r["sigma"] ** 2 for n in report["nodes"] for r in n.get("releases", [])
                 if r.get("phase") == "vote" and r.get("round") == round_ and r.get("sigma")]
    return math.sqrt(sum(variances)) if variances else 0.0


def cell_row(run: Path) -> dict[str, Any]:
    """One finished run's row."""
    cfg = json.loads((run / "config.json").read_text())
    cfg = cfg.get("run_config", cfg)
    evaluation = json.loads((run / "evaluation.json").read_text())
    metrics = json.loads((run / "metrics.json").read_text())
    report = json.loads((run / "privacy_report.json").read_text())
    topic = evaluation["utility"]["topic"]
    name = run.name.split("__")[0]
    seed = int(run.name.rsplit("seed=", 1)[1])
    row: dict[str, Any] = {"method": name, "seed": seed, "accuracy": round(topic["accuracy"], 4),
                           "label_fidelity": round(topic.get("label_fidelity", math.nan), 4),
                           "refine_s": round(metrics["timings_s"].get("refine", math.nan), 1)}
    notes = metrics.get("refinement", {}).get("rounds", [])
    method = metrics.get("refinement", {}).get("method", "")
    group = int(cfg.get("popri-samples-per-prompt", 10) if method == "popri" else cfg.get("grpo-group-size", 8))
    history = read_jsonl(run / "refinement_rounds.jsonl") if (run / "refinement_rounds.jsonl").exists() else []
    snrs = []
    for note in notes[:-1]:  # the training rounds (the last scores the final population)
        mine = [h for h in history if h["round"] == note["round"]]
        snrs.append(round_snr([h["score"] for h in mine], [h["control_code"] for h in mine], group,
                              round_sigma(report, note["round"])))
    row["reward_snr"] = "; ".join(f"{s:.2f}" for s in snrs)
    if method == "popri":
        trained = [n for n in notes if "dpo_steps" in n]
        row.update(pairs="; ".join(str(n["pairs"]) for n in trained),
                   steps="; ".join(str(n["dpo_steps"]) for n in trained),
                   loss="; ".join(f"{n['dpo_first_loss']:.3f}->{n['dpo_last_loss']:.3f}" for n in trained),
                   held_out_margin="; ".join(f"{n['held_out_margin_before']:.2f}->{n['held_out_margin_after']:.2f}"
                                             for n in trained if "held_out_margin_after" in n),
                   kept="; ".join(str(n["kept"]) for n in trained))
    elif method == "grpo" and len(notes) > 1:
        row.update(steps=str(notes[0].get("steps", "")), clip_ratio=f"{notes[0].get('clip_ratio', 0):.5f}")
    return row


def paired(rows: list[dict[str, Any]]) -> list[str]:
    """Each method against its ``-no-update`` run, seed by seed: mean ± sd of the difference."""
    acc = {(r["method"], r["seed"]): r["accuracy"] for r in rows}
    lines = []
    for method in sorted({r["method"] for r in rows if not r["method"].endswith("-no-update")}):
        control = f"{method}-no-update"
        seeds = sorted(s for m, s in acc if m == method and (control, s) in acc)
        if not seeds:
            continue
        diff = np.array([acc[(method, s)] - acc[(control, s)] for s in seeds])
        a, b = np.array([acc[(method, s)] for s in seeds]), np.array([acc[(control, s)] for s in seeds])
        lines.append(f"{method}: {a.mean():.3f} ± {a.std():.3f} against {control} {b.mean():.3f} ± {b.std():.3f}; "
                     f"paired difference {diff.mean():+.3f} ± {diff.std():.3f} over seeds {seeds}")
    return lines


def main() -> None:
    """Print the cells' rows and the paired differences; write the CSV."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=Path, default=Path("results/refinement_learning/runs"))
    ap.add_argument("--csv", type=Path, default=None)
    args = ap.parse_args()
    runs = sorted(p for p in args.runs.iterdir() if "seed=" in p.name and (p / "evaluation.json").exists())
    rows = [cell_row(r) for r in runs]
    keys = list(dict.fromkeys(k for r in rows for k in r))
    print(" | ".join(keys))
    for r in rows:
        print(" | ".join(str(r.get(k, "")) for k in keys))
    for line in paired(rows):
        print(line)
    if args.csv:
        with args.csv.open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=keys)
            writer.writeheader()
            writer.writerows(rows)


if __name__ == "__main__":
    main()
