"""Everything a run writes to ``<out-dir>/<run-name>/``, each file atomically.

| file | what |
|---|---|
| ``synthetic.jsonl`` | the final set: ``text``, ``control_code`` and one field per control column |
| ``pool.jsonl`` | the refinement's final population (for knn-vote: the generated pool) with its aggregated noisy votes and whether it was kept |
| ``refinement_rounds.jsonl`` | for methods with several rounds (``pe``, ``popri``): every text each round saw, with its aggregated noisy score and the method's columns (PE: ``survived``, ``children``; POPri: ``role`` chosen / rejected) |
| ``profile.json`` | vocabulary, each node's noisy profile, the global profile, the allocation |
| ``privacy_report.json`` | per node: budget, spent, every release, basic and PLD totals |
| ``metrics.json`` | held-out loss per round, phase timings, failures, degradations, sizes, generation (texts asked again, dropped, written per code against the allocation) |
| ``config.json`` | the validated run config |
| ``model/`` | the finetuned trainable weights (a peft adapter or a full model folder) |
| ``plots/*.png`` | votes per code, allocation vs. final counts, held-out loss per round |
"""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from common.codes import parse_code
from common.config import RunConfig
from common.dp import composed_epsilon, phase_epsilon
from common.io import atomic_folder, atomic_write_json, atomic_write_jsonl
from strategies.result import FedSynResult


def write_outputs(run_dir: Path, cfg: RunConfig, vocabulary: list[str], res: FedSynResult) -> dict[str, Path]:
    """Write all run outputs under ``run_dir``; returns the written paths by name."""
    run_dir.mkdir(parents=True, exist_ok=True)
    selected = set(int(i) for i in (res.selected if res.selected is not None else []))
    final = [text_row(res.pool_texts[i], res.pool_codes[i]) for i in sorted(selected)]
    pool = [{**text_row(t, c), "votes": (float(res.votes[i]) if res.votes is not None else None),
             "selected": i in selected} for i, (t, c) in enumerate(zip(res.pool_texts, res.pool_codes))]
    final_counts = Counter(r["control_code"] for r in final)
    paths = {
        "synthetic": atomic_write_jsonl(run_dir / "synthetic.jsonl", final),
        "pool": atomic_write_jsonl(run_dir / "pool.jsonl", pool),
        "profile": atomic_write_json(run_dir / "profile.json", {
            "vocabulary": vocabulary,
            "node_profiles": {str(n): p for n, p in res.node_profiles.items()},
            "global_profile": res.profile, "allocation": res.allocation,
            "final_counts": {c: final_counts.get(c, 0) for c in vocabulary},
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


def privacy_report(cfg: RunConfig, res: FedSynResult) -> dict[str, Any]:
    """Per node: budget, this run's releases as the node stated them, and their totals.

    Each node's releases come from its own ledger (the end-of-run ``query.ledger``), or,
    if it did not answer, from the statements in its replies plus every request whose
    reply never came, counted as spent at what the request asked (``unknown_releases``).
    The basic total sums the
    stated epsilons (as the paper), delta sums the stated deltas. The PLD total composes
    the Gaussian releases (their sigma and sensitivity are data-independent) with a PLD
    accountant and adds DP-SGD's stated epsilon by basic composition: a node never tells
    the server DP-SGD's sampling rate, which would reveal its record count.
    """
    nodes = []
    ids = sorted(set(res.tiers) | set(res.releases) | set(res.ledgers))
    for nid, same in _by_ledger(ids, res).items():
        book = res.ledgers.get(nid)
        statements = book["releases"] if book else [_release_view(r) for r in res.releases.get(nid, [])]
        failures = [f for f in res.failures if f["node_id"] in same]
        if not book:
            statements += unknown_releases(cfg, res.tiers.get(nid, ""), statements, failures)
        basic = float(sum(float(r["epsilon"]) for r in statements))
        total_delta = float(sum(float(r["delta"]) for r in statements))
        last = res.releases.get(nid, [{}])[-1]
        budget = (book or {}).get("epsilon-budget", res.budgets.get(nid, last.get("epsilon-budget", math.nan)))
        nodes.append({
            "node_id": nid, "node_ids": same, "ledger_ref": res.ledger_refs.get(nid, ""),
            "tier": res.tiers.get(nid, "unknown"),
            "source": "node ledger" if book else ("replies (the node did not confirm its ledger); requests without "
                                                  "a reply are counted as spent"),
            "epsilon_budget": float(budget),
            "epsilon_spent": basic,
            "epsilon_spent_all_runs": float((book or {}).get("epsilon-spent", last.get("epsilon-spent", basic))),
            "delta": total_delta,
            "epsilon_basic_composition": basic, "epsilon_pld": composed_epsilon(statements),
            "releases": statements,
            "failures": failures,
        })
    return {
        "private": cfg.private,
        "warning": None if cfg.private else "NO DIFFERENTIAL PRIVACY: epsilon = inf, no noise was added anywhere",
        "unit": "one record of one node (sample-level DP, add/remove)",
        "mechanisms": {"train": "DP-SGD (Opacus, Poisson sampling, RDP accountant over all rounds; the whole "
                                "phase's epsilon is reserved at round 1)",
                       "profile": "analytic Gaussian, L2 sensitivity 1",
                       "vote": "analytic Gaussian at the named histogram's L2 sensitivity (knn-vote sqrt(K), "
                               "nearest-neighbour 1, similarity 1); a refinement's vote rounds split epsilon_vote"},
        "epsilon_split": {"epsilon": cfg.epsilon, "epsilon_profile": cfg.epsilon_profile,
                          "voters": cfg.voters},
        "nodes": nodes,
    }


def _by_ledger(ids: list[int], res: FedSynResult) -> dict[int, list[int]]:
    """Each report entry's node id -> every node id it covers. A SuperNode restarted after a
    crash gets a new node id from Flower but keeps its ledger (same ``ledger_refs``); when the
    new id answered the ledger query, its book holds the old id's releases too, so the old id
    is folded into it rather than counted twice."""
    refs = res.ledger_refs
    booked = {refs[n]: n for n in ids if n in res.ledgers and refs.get(n)}
    entries: dict[int, list[int]] = {}
    for nid in ids:
        owner = booked.get(refs.get(nid, ""), nid) if nid not in res.ledgers else nid
        entries.setdefault(owner, []).append(nid)
    return {owner: sorted(same) for owner, same in sorted(entries.items())}


def unknown_releases(cfg: RunConfig, tier: str, stated: list[dict[str, Any]],
                     failures: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Statements for the release requests of a node that failed without saying what it spent.

    The node may have released and lost the reply, so each counts as spent at the epsilon and
    delta the request asked, capped so that a phase never counts more than this run's epsilon
    for it (DP-SGD reserves its whole phase at round 1: later rounds add nothing). Marked
    ``"status": "unknown, counted as spent"``; never 0, never more than the node could spend.
    """
    out: list[dict[str, Any]] = []
    for f in failures:
        if f.get("spent") != "unknown":
            continue
        phase = f["phase"]
        cap = phase_epsilon(cfg.epsilon, cfg.epsilon_profile, tier, cfg.voters, phase) if tier else math.inf
        counted = sum(float(r["epsilon"]) for r in stated + out if r["phase"] == phase)
        epsilon = min(float(f["epsilon_requested"]), max(cap - counted, 0.0))
        if epsilon > 0 or not cfg.private:
            out.append({"phase": phase, "mechanism": "unknown", "epsilon": epsilon,
                        "delta": float(f["delta_requested"]), "round": f.get("round", 0),
                        "status": "unknown, counted as spent", "reason": f["reason"]})
    return out


def _release_view(r: dict[str, Any]) -> dict[str, Any]:
    view = {k: v for k, v in r.items() if k not in ("epsilon-spent", "epsilon-budget")}
    view["epsilon"] = float(view["epsilon"])
    return view


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


