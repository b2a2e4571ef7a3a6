"""``fedsyn export <run-dir>``: a run's synthetic set as a publishable Hugging Face dataset folder.

The folder holds the ``datasets`` copy (``load_from_disk(folder)`` gives a ``DatasetDict`` with
a ``train`` split), the same rows as Parquet (``data/train-00000-of-00001.parquet``, the Hub's
layout) and a dataset card (``README.md``) that states what a reader needs to trust it: the
privacy unit, ε and δ per node from the run's privacy report, the method, the model, counts and
the evaluation. Only the synthetic set is exported: ``heldout.jsonl`` holds real records.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from common.io import atomic_folder, read_json, read_jsonl
from fedsyn_server.generate_more import run_config_of

EXPORT = "export"
PARQUET = "data/train-00000-of-00001.parquet"


def dataset_card(run_dir: Path, rows: list[dict[str, Any]]) -> str:
    """The dataset card (Markdown with the Hub's YAML header) for the run in ``run_dir``."""
    cfg = run_config_of(run_dir)
    report = read_json(run_dir / "privacy_report.json")
    evaluation = read_json(run_dir / "evaluation.json") if (run_dir / "evaluation.json").is_file() else None
    counts: dict[str, int] = {}
    by_writer: dict[str, dict[str, int]] = {}
    for r in rows:
        counts[r["control_code"]] = counts.get(r["control_code"], 0) + 1
        mine = by_writer.setdefault(r["control_code"], {})
        mine[r.get("writer", "unknown")] = mine.get(r.get("writer", "unknown"), 0) + 1
    private = bool(report.get("private", True))
    nodes = report.get("nodes", [])
    node_lines = "\n".join(
        f"| {n['node_id']} | {n['tier']} | {n['epsilon_spent']:.4g} | {n.get('epsilon_pld', float('nan')):.4g} | "
        f"{n['delta']:.3g} | {n['epsilon_budget']:g} |" for n in nodes)
    eps = max((float(n["epsilon_spent"]) for n in nodes), default=float("nan"))
    utility = (evaluation or {}).get("utility", {})
    alignment = (evaluation or {}).get("alignment", {})
    mauve = (alignment.get("mauve") or {}).get("mean")
    eval_lines = "\n".join(
        [f"| {col} accuracy / macro-F1 (train on synthetic, test on real held-out) | "
         f"{u['accuracy']:.3f} / {u['macro_f1']:.3f} |" for col, u in utility.items()]
        + ([f"| Fréchet distance (MiniLM embeddings) | {alignment['frechet_distance']:.3f} |"]
           if "frechet_distance" in alignment else [])
        + ([f"| MAUVE | {mauve:.3f} |"] if mauve is not None else [])) or "| (no evaluation in this run) | |"
    privacy = (f"Every record of every participating institution is protected by (ε, δ)-differential privacy "
               f"at the record level, with ε ≤ {eps:.4g} per institution in this run (the table below; basic "
               "composition of every release the institution's own ledger recorded). Noise was added on each "
               "institution's own machine before anything left it." if private else
               "**NOT PRIVATE**: this run used epsilon = inf (no noise). Do not publish it as private data.")
    control_columns = ", ".join(cfg.control_columns)
    return f"""---
pretty_name: fedsyn synthetic text ({cfg.dataset})
tags:
- synthetic
- differential-privacy
- federated-learning
task_categories:
- text-generation
- text-classification
size_categories:
- n<1K
---

# Synthetic text from a federated, differentially private fedsyn run

{privacy}

- **Method:** fedsyn (resource-adaptive federated DP text generation): DP federated finetuning of
  `{cfg.model}` ({cfg.finetune}, {cfg.num_server_rounds} rounds × {cfg.local_steps} DP-SGD steps) on the strong
  institutions, DP profiles and `{cfg.refinement}` refinement with DP votes of the others.
- **Source data:** `{cfg.dataset}` (text column `{cfg.text_column}`, control columns `{control_columns}`);
  the texts here are generated, not copied, but carry whatever the pretrained model already knew.
- **Rows:** {len(rows)} (`text`, `control_code`, one column per control column, `writer`: the
  weights that wrote the row, `pretrained` (the public model, zero-shot) or `finetuned` (DP-finetuned);
  the institutions' DP votes chose between them per control code).
- **Run:** `{run_dir.name}`; its full privacy report is `privacy_report.json` of the run folder.

## Privacy per institution

| node | tier | ε spent (basic) | ε (PLD) | δ (sum over releases) | ε budget |
|---|---|---|---|---|---|
{node_lines}

## Rows per control code

| control code | rows | by writer |
|---|---|---|
""" + "\n".join(f"| `{c}` | {n} | {', '.join(f'{w} {k}' for w, k in sorted(by_writer[c].items()))} |"
                for c, n in sorted(counts.items())) + f"""

## Evaluation against real held-out data

| metric | value |
|---|---|
{eval_lines}

## Load

```python
from datasets import load_from_disk
ds = load_from_disk("<this folder>")["train"]
```
"""


def export_run(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Write ``run_dir``'s ``synthetic.jsonl`` as a dataset folder (``datasets`` + Parquet + card)
    at ``out`` (default ``<run-dir>/export``), replacing an older export whole. Returns the folder."""
    from datasets import Dataset, DatasetDict
    from datasets.utils.logging import disable_progress_bar

    disable_progress_bar()  # a bar per 60-row shard is noise
    run_dir = Path(run_dir).expanduser().resolve()
    rows = read_jsonl(run_dir / "synthetic.jsonl") if (run_dir / "synthetic.jsonl").is_file() else None
    if rows is None:
        raise ValueError(f"{run_dir} has no synthetic.jsonl: give a finished run's folder, such as outputs/latest")
    if not (run_dir / "privacy_report.json").is_file():
        raise ValueError(f"{run_dir} has no privacy_report.json: a dataset without its privacy report is not exported")
    target = Path(out).expanduser().resolve() if out else run_dir / EXPORT
    with atomic_folder(target) as tmp:
        ds = Dataset.from_list(rows)
        DatasetDict({"train": ds}).save_to_disk(str(tmp))
        (tmp / PARQUET).parent.mkdir(parents=True)
        ds.to_parquet(str(tmp / PARQUET))
        (tmp / "README.md").write_text(dataset_card(run_dir, rows), encoding="utf-8")
    return target
