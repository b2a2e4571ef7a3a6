"""Everything a run writes to ``<out-dir>/<run-name>/``, each file atomically.

| file | what |
|---|---|
| ``synthetic.jsonl`` | the final set: ``text``, ``control_code``, one field per control column and ``writer`` (the weights that wrote it: ``pretrained``, ``finetuned``, ``refined``; ``strategies.writers``) |
| ``synthetic.parquet``, ``synthetic.csv`` | a table run: the final set as the typed table, the schema's columns in its order |
| ``pool.jsonl`` | the refinement's final population (for knn-vote: the generated pool) with its writer, its aggregated noisy votes and whether it was kept |
| ``refinement_rounds.jsonl`` | for methods with several rounds (``pe``, ``popri``): every text each round saw, with its aggregated noisy score and the method's columns (PE: ``survived``, ``children``; POPri: ``role`` chosen / rejected) |
| ``profile.json`` | vocabulary, each node's noisy profile, the global profile, the allocation, the writers' split and what the votes kept of each writer per code (``writers``) |
| ``privacy_report.json`` | per node: budget, spent, every release, basic and PLD totals (``fedsyn_server.privacy_report``) |
| ``metrics.json`` | held-out loss per round, phase timings, failures, degradations, sizes, generation (texts asked again, dropped, written per code against the allocation) |
| ``config.json`` | the validated run config |
| ``model/`` | the finetuned trainable weights (a peft adapter or a full model folder) |
| ``plots/*.png`` | votes per code, allocation vs. final counts, each writer's texts in the pool and kept per code, held-out loss per round |
"""  # noqa: E501 - a markdown table: one row a line

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from common.codes import parse_code
from common.config import RunConfig
from common.io import atomic_folder, atomic_write_frame, atomic_write_json, atomic_write_jsonl
from common.logs import get_logger
from fedsyn_server.privacy_report import privacy_report
from strategies.result import FedSynResult
from strategies.writers import pool_writers, writers_summary

if TYPE_CHECKING:
    from common.rows import Schema

log = get_logger(__name__)


def write_outputs(run_dir: Path, cfg: RunConfig, vocabulary: list[str], res: FedSynResult) -> dict[str, Path]:
    """Write all run outputs under ``run_dir``; returns the written paths by name."""
    run_dir.mkdir(parents=True, exist_ok=True)
    selected = set(int(i) for i in (res.selected if res.selected is not None else []))
    writers = pool_writers(res)
    final = [{**text_row(res.pool_texts[i], res.pool_codes[i]), "writer": writers[i]} for i in sorted(selected)]
    pool = [{**text_row(t, c), "writer": w, "votes": (float(res.votes[i]) if res.votes is not None else None),
             "selected": i in selected} for i, (t, c, w) in enumerate(zip(res.pool_texts, res.pool_codes, writers))]
    final_counts = Counter(r["control_code"] for r in final)
    paths = {
        "synthetic": atomic_write_jsonl(run_dir / "synthetic.jsonl", final),
        "pool": atomic_write_jsonl(run_dir / "pool.jsonl", pool),
        "profile": atomic_write_json(run_dir / "profile.json", {
            "vocabulary": vocabulary,
            "node_profiles": {str(n): p for n, p in res.node_profiles.items()},
            "global_profile": res.profile, "allocation": res.allocation, "pretrained_codes": res.pretrained_codes,
            "final_counts": {c: final_counts.get(c, 0) for c in vocabulary},
            "writers": writers_summary(res),
        }),
        "privacy_report": atomic_write_json(run_dir / "privacy_report.json", privacy_report(cfg, res)),
        "metrics": atomic_write_json(run_dir / "metrics.json", {
            "eval": {str(k): v for k, v in res.eval_metrics.items()},
            "train": {str(k): v for k, v in res.train_metrics.items()},
            "timings_s": res.timings, "failures": res.failures,
            "degradations": res.degradations, "degraded": bool(res.degradations), "skipped": res.skipped,
            "pool_size": len(res.pool_texts), "final_size": len(final), "generation": res.generation,
            "nodes": {str(n): t for n, t in res.tiers.items()},
            "refinement": {"method": cfg.refinement, "vote_rounds": res.vote_rounds, **res.refinement},
        }),
        "config": atomic_write_json(run_dir / "config.json", cfg.to_flower()),
    }
    schema = cfg.schema()
    if schema is not None:
        paths.update(write_table(run_dir, schema, [(res.pool_texts[i], res.pool_codes[i]) for i in sorted(selected)]))
    if res.refinement_history:
        paths["refinement_rounds"] = atomic_write_jsonl(run_dir / "refinement_rounds.jsonl", [
            {"round": r["round"], **text_row(r["text"], r["control_code"]),
             **{k: v for k, v in r.items() if k not in ("round", "text", "control_code")}}
            for r in res.refinement_history])
    paths.update(write_plots(run_dir / "plots", vocabulary, res, final_counts))
    return paths


def text_row(text: str, code: str) -> dict[str, str]:
    """One output row: ``text``, ``control_code`` and one field per control column (every text file
    a run writes, synthetic or held-out, has these columns)."""
    return {"text": text, "control_code": code, **parse_code(code)}


def write_table(run_dir: Path, schema: Schema, records: list[tuple[str, str]]) -> dict[str, Path]:
    """A table run's final set as ``synthetic.parquet`` and ``synthetic.csv``: each record's row
    (``common.rows.record_row``), typed by the schema. Generation kept only texts that parse, so a
    record that does not (a refinement's own text) is a bug: it is left out and logged, never written."""
    import pandas as pd

    from common.rows import RowError, record_row

    rows = []
    for text, code in records:
        try:
            rows.append(record_row(text, parse_code(code), schema))
        except RowError as err:
            log.error("a final text is not a row of the table schema (%s); left out of the table", err.reason)
    frame = pd.DataFrame(rows, columns=list(schema.names))
    return {f"table_{kind}": atomic_write_frame(run_dir / f"synthetic.{kind}", frame) for kind in ("parquet", "csv")}


def save_model(model: Any, run_dir: Path) -> Path:
    """Save the finetuned model (a peft adapter saves only the adapter) atomically to ``model/``."""
    with atomic_folder(run_dir / "model") as tmp:
        model.save_pretrained(tmp)
    return run_dir / "model"


def write_plots(plot_dir: Path, vocabulary: list[str], res: FedSynResult, final_counts: Counter) -> dict[str, Path]:
    """Votes per code, allocation vs. final counts, held-out loss per round (PNG files)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plot_dir.mkdir(parents=True, exist_ok=True)
    out: dict[str, Path] = {}

    fig, ax = plt.subplots(figsize=(7, 3.5))
    x = np.arange(len(vocabulary))
    noisy = np.asarray(res.profile if res.profile is not None else np.zeros(len(vocabulary)))
    share = np.clip(noisy, 0, None) / max(np.clip(noisy, 0, None).sum(), 1e-12)
    total_final = max(sum(final_counts.values()), 1)
    ax.bar(x - 0.2, share, 0.4, label="noisy profile share")
    ax.bar(x + 0.2, [final_counts.get(c, 0) / total_final for c in vocabulary], 0.4, label="final set share")
    ax.set_xticks(x, [c.split("=", 1)[-1] for c in vocabulary], rotation=30, ha="right")
    ax.set_ylabel("share")
    ax.set_title("Allocation: noisy profile vs. final synthetic set")
    ax.legend()
    out["plot_allocation"] = save_figure(fig, plot_dir / "allocation.png")

    if res.votes is not None and len(res.votes):
        codes = np.asarray(res.pool_codes)
        present = [c for c in vocabulary if (codes == c).any()]
        fig, axes = plt.subplots(1, max(len(present), 1), figsize=(3 * max(len(present), 1), 3), squeeze=False)
        for ax, code in zip(axes[0], present):
            ax.hist(np.asarray(res.votes)[codes == code], bins=20)
            ax.set_title(code.split("=", 1)[-1])
            ax.set_xlabel("noisy votes")
        axes[0][0].set_ylabel("synthetic texts")
        fig.suptitle("Vote distribution per control code")
        out["plot_votes"] = save_figure(fig, plot_dir / "votes_per_code.png")

    shares = writers_summary(res)["kept_share"]
    if len({w for s in shares.values() for w in s}) > 1:
        names = sorted({w for s in shares.values() for w in s})
        kept_codes = list(shares)
        fig, ax = plt.subplots(figsize=(7, 3.5))
        bottom = np.zeros(len(kept_codes))
        for name in names:
            part = np.asarray([shares[c].get(name, 0.0) for c in kept_codes])
            ax.bar(np.arange(len(kept_codes)), part, 0.6, bottom=bottom, label=name)
            bottom += part
        ax.set_xticks(np.arange(len(kept_codes)), [c.split("=", 1)[-1] for c in kept_codes], rotation=30, ha="right")
        ax.set_ylabel("share of the kept texts")
        ax.set_title(f"Who wrote the final set (pool: {res.pretrained_share:.0%} pretrained)")
        ax.legend()
        out["plot_writers"] = save_figure(fig, plot_dir / "writers.png")

    if res.eval_metrics:
        rounds = sorted(res.eval_metrics)
        fig, ax = plt.subplots(figsize=(5, 3.5))
        ax.plot(rounds, [res.eval_metrics[r]["heldout_loss"] for r in rounds], marker="o")
        ax.set_xlabel("round")
        ax.set_ylabel("held-out loss")
        ax.set_title("Phase 1: global model on held-out data")
        out["plot_loss"] = save_figure(fig, plot_dir / "training_loss.png")
    return out


def save_figure(fig: Any, path: Path) -> Path:
    """Save a matplotlib figure as PNG atomically (temp file, then rename) and close it."""
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.stem}.tmp.png")
    fig.tight_layout()
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    tmp.replace(path)
    return path


