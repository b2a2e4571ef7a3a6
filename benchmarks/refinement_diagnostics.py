"""Why did refinement help or not? Label fidelity of the pool, the kept and the dropped texts.

Usage: python -m benchmarks.refinement_diagnostics <runs-dir> [--out docs/refinement_diagnostics.csv]

For every finished run folder under ``runs-dir`` (one per ``fedsyn experiment`` cell; it
needs ``pool.jsonl``, ``heldout.jsonl`` and ``config.json``), a classifier trained on the
run's held-out real texts (``evaluation.label_agreement``) says which synthetic texts are
about the topic their control code asked for. Per run it reports the share of on-topic
texts in the whole pool, among the texts kept in the final set and among those dropped,
and, where the pool carries DP votes, the ROC AUC of the votes for "on topic" within each
code, averaged over codes (0.5 = votes blind to topic, 1 = every on-topic text out-voted
every off-topic one of its code; within a code because A.4 draws per code). Where the run kept
only part of its pool, it also compares the kept set's downstream accuracy with that of
A.4 draws with equal weights from the same pool: a paired comparison of the selection
alone, free of the variance between DP training runs. Where the run wrote
``refinement_rounds.jsonl`` (``pe``, ``popri``), its round 1 is the stage-3 pool, i.e. what
the DP-finetuned generator wrote before any refinement: equal-weight A.4 draws from it are
what ``refinement = "none"`` would have kept *from the same model*, so
``accuracy_kept - accuracy_none_same_model`` is the refinement's effect, paired. It also
reports the on-topic share of round 1, the AUC of round 1's noisy scores, and for POPri the
on-topic share of the chosen and the rejected texts of its preference pairs (is the DP
signal right?) against that of the final set the DPO-tuned generator wrote (did DPO move
the generator?). Writes one CSV row per run and prints a markdown table of means ± std over
seeds per method × partitioning.
Nothing here is private: held-out texts never went to a node, and votes are already noised.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

import numpy as np

from common.codes import parse_code
from common.io import atomic_write_csv, read_jsonl
from common.models import embed, load_embedder
from fedsyn_server.evaluation import downstream_utility, label_agreement
from fedsyn_server.experiment import summarise
from fedsyn_server.outputs import save_figure
from strategies.resampling import resample_by_code

ROUND_FIELDS = ["fidelity_round1", "scores_auc_round1", "fidelity_chosen", "fidelity_rejected",
                "accuracy_none_same_model"]
FIELDS = ["method", "partitioning", "seed", "n_pool", "n_kept", "fidelity_pool", "fidelity_kept",
          "fidelity_dropped", "votes_auc", "votes_on_topic", "votes_off_topic", "accuracy_kept",
          "accuracy_uniform_same_pool", *ROUND_FIELDS]
UNIFORM_DRAWS = 10


def _labels(rows: list[dict[str, Any]], column: str) -> list[str]:
    return [parse_code(r["control_code"])[column] for r in rows]


def _mean(values: np.ndarray) -> float:
    return float(values.mean()) if len(values) else math.nan


def diagnose_run(run_dir: Path, embedder: Any) -> dict[str, Any]:
    """Fidelity of pool / kept / dropped texts, the votes' AUC and, from ``refinement_rounds.jsonl``,
    the paired effect of the refinement, for one run folder (one dict of ``FIELDS[3:]``)."""
    config = json.loads((run_dir / "config.json").read_text())
    column = str(config["control-columns"]).split(",")[0].strip()
    pool, real = read_jsonl(run_dir / "pool.jsonl"), read_jsonl(run_dir / "heldout.jsonl")
    kept = np.array([bool(r["selected"]) for r in pool])
    pool_labels, real_labels = _labels(pool, column), _labels(real, column)
    pool_emb, real_emb = embed(embedder, [r["text"] for r in pool]), embed(embedder, [r["text"] for r in real])
    on_topic = label_agreement(pool_emb, pool_labels, real_emb, real_labels)
    out: dict[str, Any] = {
        "n_pool": len(pool), "n_kept": int(kept.sum()),
        "fidelity_pool": _mean(on_topic), "fidelity_kept": _mean(on_topic[kept]),
        "fidelity_dropped": _mean(on_topic[~kept]),
        "votes_auc": math.nan, "votes_on_topic": math.nan, "votes_off_topic": math.nan,
        "accuracy_kept": downstream_utility(pool_emb[kept], list(np.array(pool_labels)[kept]),
                                            real_emb, real_labels)["accuracy"],
        "accuracy_uniform_same_pool": math.nan,
    }
    rate = float(config["sampling-rate"])
    if not kept.all():
        # Paired with the kept set: A.4 with equal weights on the *same* pool (same model,
        # same texts), so the difference is the votes alone, not another DP training run.
        out["accuracy_uniform_same_pool"] = _equal_weight_accuracy(pool_emb, pool_labels, real_emb, real_labels, rate)
    if all(r.get("votes") is not None for r in pool):
        votes = np.array([float(r["votes"]) for r in pool])
        out["votes_auc"] = _auc_within_codes(on_topic, votes, pool_labels)
        out["votes_on_topic"], out["votes_off_topic"] = _mean(votes[on_topic]), _mean(votes[~on_topic])
    out.update(dict.fromkeys(ROUND_FIELDS, math.nan))
    if (run_dir / "refinement_rounds.jsonl").exists():
        history = read_jsonl(run_dir / "refinement_rounds.jsonl")
        rows = [r for r in history if r["round"] == 1]
        labels = _labels(rows, column)
        emb = embed(embedder, [r["text"] for r in rows])
        first = label_agreement(emb, labels, real_emb, real_labels)
        out.update(fidelity_round1=_mean(first),
                   scores_auc_round1=_auc_within_codes(first, np.array([r["score"] for r in rows]), labels),
                   accuracy_none_same_model=_equal_weight_accuracy(emb, labels, real_emb, real_labels, rate))
        paired = [r for r in history if r.get("role")]  # POPri's preference pairs, all rounds
        if paired:
            agree = label_agreement(embed(embedder, [r["text"] for r in paired]), _labels(paired, column),
                                    real_emb, real_labels)
            roles = np.array([r["role"] for r in paired])
            out["fidelity_chosen"], out["fidelity_rejected"] = (_mean(agree[roles == "chosen"]),
                                                                _mean(agree[roles == "rejected"]))
    return out


def _equal_weight_accuracy(emb: np.ndarray, labels: list[str], real_emb: np.ndarray, real_labels: list[str],
                           rate: float) -> float:
    """Mean downstream accuracy of ``UNIFORM_DRAWS`` A.4 draws with equal weights at ``rate``."""
    return float(np.mean([
        downstream_utility(emb[idx], [labels[i] for i in idx], real_emb, real_labels)["accuracy"]
        for idx in (resample_by_code(labels, None, rate, seed=1000 + d) for d in range(UNIFORM_DRAWS))
    ]))


def _auc_within_codes(on_topic: np.ndarray, scores: np.ndarray, labels: list[str]) -> float:
    """ROC AUC of ``scores`` for on-topic within each code (where a code has both), averaged:
    A.4 and POPri's pairs compare texts of the same code only, so scores need only rank those."""
    from sklearn.metrics import roc_auc_score

    codes = np.array(labels)
    aucs = [roc_auc_score(on_topic[codes == c], scores[codes == c]) for c in sorted(set(labels))
            if 0 < on_topic[codes == c].sum() < (codes == c).sum()]
    return float(np.mean(aucs)) if aucs else math.nan


def _cell(name: str) -> dict[str, Any]:
    """Method, partitioning and seed from an experiment cell's folder name
    (``<method>__<param>=<value>...__seed=<n>``, see ``experiment.Cell.name``)."""
    method, *parts = name.split("__")
    params = dict(p.split("=", 1) for p in parts if "=" in p)
    return {"method": method, "partitioning": params.get("partitioning", ""), "seed": int(params.get("seed", 0))}


def plot_fidelity(rows: list[dict[str, Any]], path: Path) -> Path:
    """Bars of the on-topic share of round 1 (the unrefined pool of the same DP model, where the
    run logged its rounds), of the final population and of the kept texts (mean ± std over
    seeds), one panel per partitioning, one group of bars per method; saved as PNG at ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bars = (("fidelity_round1", "round 1 (same model, unrefined)"), ("fidelity_pool", "final population"),
            ("fidelity_kept", "kept (final set)"))
    table = summarise(rows, ["partitioning", "method"], [key for key, _ in bars])
    parts = sorted({e["partitioning"] for e in table})
    fig, axes = plt.subplots(1, len(parts), figsize=(6 * len(parts), 3.8), squeeze=False, sharey=True)
    for ax, part in zip(axes[0], parts):
        entries = sorted((e for e in table if e["partitioning"] == part), key=lambda e: e["method"])
        x = np.arange(len(entries))
        for offset, (key, label) in zip((-0.27, 0.0, 0.27), bars):
            ax.bar(x + offset, [e[key][0] for e in entries], width=0.27, yerr=[e[key][1] for e in entries],
                   capsize=3, label=label)
        ax.set_xticks(x, [e["method"] for e in entries], rotation=30, ha="right", fontsize=8)
        ax.set_title(part or "runs")
        ax.set_ylim(0, 1)
    axes[0][0].set_ylabel("on-topic share (label fidelity)")
    axes[0][0].legend(fontsize=8)
    return save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    """Diagnose every run under the given folder; write the CSV, print the table. Exit 0/1."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs_dir", type=Path)
    ap.add_argument("--out", type=Path, default=None,
                    help="CSV file (default: <runs-dir>/../refinement_diagnostics.csv)")
    args = ap.parse_args(argv)
    runs = sorted(p for p in args.runs_dir.iterdir()
                  if not p.is_symlink() and (p / "pool.jsonl").exists() and (p / "heldout.jsonl").exists())
    if not runs:
        print(f"no finished runs (with pool.jsonl and heldout.jsonl) under {args.runs_dir}", file=sys.stderr)
        return 1
    embedder = load_embedder()
    rows = []
    for run in runs:
        rows.append({**_cell(run.name), **diagnose_run(run, embedder)})
        print(f"{run.name}: pool fidelity {rows[-1]['fidelity_pool']:.3f}, kept {rows[-1]['fidelity_kept']:.3f}",
              file=sys.stderr)
    out = args.out or args.runs_dir.parent / "refinement_diagnostics.csv"
    atomic_write_csv(out, rows, FIELDS)
    plot_fidelity(rows, out.with_suffix(".png"))

    metrics = FIELDS[5:]
    print("| partitioning | method | seeds | " + " | ".join(metrics) + " |")
    print("|---|---|---|" + "---|" * len(metrics))
    for entry in sorted(summarise(rows, ["partitioning", "method"], metrics),
                        key=lambda e: (e["partitioning"], e["method"])):
        cells = ["—" if math.isnan(mu) else f"{mu:.3f}" + (f" ± {sd:.3f}" if entry["n"] > 1 else "")
                 for mu, sd in (entry[m] for m in metrics)]
        print(f"| {entry['partitioning']} | {entry['method']} | {entry['n']} | " + " | ".join(cells) + " |")
    print(f"wrote {out} and {out.with_suffix('.png')}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
