"""How much of the pool should the pretrained model write? A paired, offline study of the split.

Usage: python -m benchmarks.writer_mix <grid-runs-dir> [--draws 5] [--out docs/writer_mix.csv] [--mixed]

``--mixed`` studies the mixed default's own runs instead (``mixed-contrastive-vote``, whose pool
holds both writers' texts, tagged): the rules ``mix``, ``better`` and each writer alone on the
same texts and votes.

For every (partitioning, seed) of a ``fedsyn experiment`` grid that ran both one-writer methods
(``zero-shot-contrastive-vote``: θ⁰'s pool; ``dp-contrastive-vote``: the finetuned model's), it
builds the mixed pools a run with ``pretrained-share`` = 0, 0.25, 0.5, 0.75, 1 would vote on from
those two pools (per code, the first texts of each writer's pool, the allocation of the finetuned
run), and the larger pools of ``num-synthetic`` = 1.5 s and 2 s at ``pretrained-share`` = 1/3 and
1/2 (the finetuned model's s texts and θ⁰'s 0.5 s or s beside them: 1.5 or 2 times the generation
and the vote's candidates) at the rate that keeps the final size r·s. Each is judged as a run judges it:
every weak node's contrastive
votes (the simulation's own partition of the records, K = num-votes, the vote window) with the
analytic Gaussian noise of its ε_vote, summed, then A.4 at the run's rate; the kept set's accuracy
is the run's classifier on the real held-out split. ``--draws`` noise and A.4 draws per variant.
The texts are the same in every variant, so the differences are the split alone (paired), free of
the variance between DP training runs. Writes one CSV row per (cell, variant) and prints the means.
Simulation only: it reads the records, which is what a simulation's owner may do.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from common.codes import parse_code
from common.config import RunConfig
from common.dp import VOTE, WEAK, analytic_gaussian_sigma, phase_epsilon
from common.federation import benchmark, simulation_node_data
from common.io import atomic_write_csv, read_jsonl
from common.models import embed, load_embedder
from common.voting import contrastive_votes
from fedsyn_server.evaluation import downstream_utility
from strategies.resampling import resample_by_code
from strategies.writers import better_writer

SHARES = (0.0, 0.25, 0.5, 0.75, 1.0)
EXTRA = (0.5, 1.0)  # θ⁰'s texts beside the finetuned model's whole pool, per text of it
PRETRAINED_RUN, FINETUNED_RUN = "zero-shot-contrastive-vote", "dp-contrastive-vote"
MIXED_RUN = "mixed-contrastive-vote"
FIELDS = ["partitioning", "seed", "variant", "share", "pool", "kept", "accuracy", "accuracy_std", "kept_pretrained"]


def mixed_pool(pre: list[dict], tuned: list[dict], share: float | None,
               extra: float = 0.0) -> tuple[list[dict], list[str]]:
    """Per code of ``tuned`` (its allocation n_c), ``round(share * n_c)`` texts of ``pre`` then the
    rest of ``tuned``'s, each tagged; ``share`` None: all of ``tuned``'s and ``round(extra * n_c)``
    of ``pre``'s. Returns (rows, writers)."""
    rows, writers = [], []
    for code in dict.fromkeys(r["control_code"] for r in tuned):
        mine_pre = [r for r in pre if r["control_code"] == code]
        mine_tuned = [r for r in tuned if r["control_code"] == code]
        if share is None:
            k, rest = min(len(mine_pre), math.floor(extra * len(mine_tuned) + 0.5)), len(mine_tuned)
        else:
            k = min(len(mine_pre), math.floor(share * len(mine_tuned) + 0.5))
            rest = len(mine_tuned) - k
        rows += mine_pre[:k] + mine_tuned[:rest]
        writers += ["pretrained"] * k + ["finetuned"] * rest
    return rows, writers


class Judge:
    """A run's votes and classifier, outside the run: every weak node's exact contrastive votes over
    its own records, the analytic Gaussian noise of its ε_vote, and the run's classifier on the
    real held-out split. ``judge`` scores a kept set chosen by a rule, over ``draws`` noise draws."""

    def __init__(self, run: Path, embedders: dict[str, Any]) -> None:
        cfg = self.cfg = RunConfig.from_flower(json.loads((run / "config.json").read_text()))
        self.column = cfg.control_columns[0]
        real = read_jsonl(run / "heldout.jsonl")
        self.vote_emb = embedders.setdefault(cfg.embedder, load_embedder(cfg.embedder))
        self.eval_emb = embedders.setdefault(cfg.eval_embedder, load_embedder(cfg.eval_embedder))
        nodes = 4
        voters = [data for tier, data in (simulation_node_data(cfg, p, nodes) for p in range(nodes)) if tier == WEAK]
        self.local = [(embed(self.vote_emb, d.texts, max_tokens=cfg.vote_window), list(d.codes)) for d in voters]
        delta = cfg.resolve_delta(len(benchmark(cfg).train))
        self.sigma = analytic_gaussian_sigma(phase_epsilon(cfg.epsilon, cfg.epsilon_profile, WEAK, cfg.voters, VOTE),
                                             delta, math.sqrt(2 * cfg.num_votes))
        self.real_emb = embed(self.eval_emb, [r["text"] for r in real])
        self.real_labels = [parse_code(r["control_code"])[self.column] for r in real]

    def votes(self, texts: list[str], codes: list[str]) -> np.ndarray:
        """The weak nodes' exact (noise-free) summed contrastive votes on the candidates."""
        cand = embed(self.vote_emb, texts, max_tokens=self.cfg.vote_window)
        return sum(contrastive_votes(e, c, cand, codes, self.cfg.num_votes) for e, c in self.local).astype(np.float64)

    def judge(self, texts: list[str], codes: list[str], writers: list[str], rule: Any, draws: int,
              exact: np.ndarray | None = None) -> dict[str, float]:
        """Accuracy (mean, std over ``draws``) and θ⁰'s kept share of ``rule(noisy votes, draw)``."""
        exact = self.votes(texts, codes) if exact is None else exact
        syn_emb, labels = embed(self.eval_emb, texts), [parse_code(c)[self.column] for c in codes]
        accuracies, kept_pre = [], []
        for d in range(draws):
            noise = np.random.default_rng([self.cfg.seed, d]).normal(0, self.sigma, (len(self.local), len(texts)))
            idx = rule(exact + noise.sum(axis=0), d)
            accuracies.append(downstream_utility(syn_emb[idx], [labels[i] for i in idx], self.real_emb,
                                                 self.real_labels)["accuracy"])
            kept_pre.append(np.mean([writers[i] == "pretrained" for i in idx]))
        return {"kept": len(idx), "accuracy": float(np.mean(accuracies)), "accuracy_std": float(np.std(accuracies)),
                "kept_pretrained": float(np.mean(kept_pre))}


def study_cell(run_pre: Path, run_tuned: Path, draws: int, embedders: dict[str, Any]) -> list[dict[str, Any]]:
    """Every variant of one (partitioning, seed): mean and std of the kept set's accuracy over draws."""
    judge = Judge(run_tuned, embedders)
    cfg = judge.cfg
    pre, tuned = read_jsonl(run_pre / "pool.jsonl"), read_jsonl(run_tuned / "pool.jsonl")
    out = []
    for share, extra in [*((s, 0.0) for s in SHARES), *((None, e) for e in EXTRA)]:
        rows, writers = mixed_pool(pre, tuned, share, extra)
        texts, codes = [r["text"] for r in rows], [r["control_code"] for r in rows]
        exact = judge.votes(texts, codes)
        rate = cfg.sampling_rate / (1 + extra)
        rules = [("", lambda v, d: resample_by_code(codes, v, rate, seed=cfg.seed + 1000 * d))]
        if share is None and extra == 1.0:
            # writer-choice "better": each code's final texts from the writer whose texts its votes rate
            # higher (mean of the clamped noisy votes), A.4 among that writer's texts
            rules.append((", the code's better-voted writer only",
                          lambda v, d: resample_by_code(codes, v, rate, seed=cfg.seed + 1000 * d,
                                                        among=better_writer(codes, writers, v))))
        for suffix, rule in rules:
            out.append({"variant": (f"pool {1 + extra:g}s, share {extra / (1 + extra):.2g}" if share is None
                                    else f"pool s, share {share:g}") + suffix,
                        "share": extra / (1 + extra) if share is None else share, "pool": len(texts),
                        **judge.judge(texts, codes, writers, rule, draws, exact)})
    return out


def study_mixed_run(run: Path, draws: int, embedders: dict[str, Any]) -> list[dict[str, Any]]:
    """A run of the mixed default (its pool carries both writers, tagged): the same texts kept by
    each rule, paired. ``mix`` = A.4 over the whole pool at the run's rate; ``better`` = each code
    from its better-voted writer; one writer = A.4 among that writer's texts only, at twice the
    rate (the same final size)."""
    judge = Judge(run, embedders)
    cfg = judge.cfg
    rows = read_jsonl(run / "pool.jsonl")
    texts, codes, writers = [r["text"] for r in rows], [r["control_code"] for r in rows], [r["writer"] for r in rows]
    exact = judge.votes(texts, codes)
    rate = cfg.sampling_rate

    def among(writer: str):
        mine = np.array([w == writer for w in writers])
        return lambda v, d: resample_by_code(codes, v, rate, seed=cfg.seed + 1000 * d, among=mine)

    rules = {"mix": lambda v, d: resample_by_code(codes, v, rate, seed=cfg.seed + 1000 * d),
             "better": lambda v, d: resample_by_code(codes, v, rate, seed=cfg.seed + 1000 * d,
                                                     among=better_writer(codes, writers, v)),
             "finetuned only": among("finetuned"), "pretrained only": among("pretrained")}
    return [{"variant": name, "share": 0.5, "pool": len(texts),
             **judge.judge(texts, codes, writers, rule, draws, exact)}
            for name, rule in rules.items()]


def main() -> int:
    """Pair the grid's one-writer runs, study each pair, write the CSV, print the means per variant."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", type=Path)
    ap.add_argument("--draws", type=int, default=5)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--mixed", action="store_true", help="study the mixed default's own runs (each rule on its pool)")
    args = ap.parse_args()
    rows, embedders = [], {}
    for run in sorted(args.runs.glob(f"{MIXED_RUN}__*")) if args.mixed else []:
        if not (run / "pool.jsonl").is_file():
            continue
        cell = dict(part.split("=", 1) for part in run.name.split("__")[1:])
        for r in study_mixed_run(run, args.draws, embedders):
            rows.append({"partitioning": cell.get("partitioning", ""), "seed": int(cell["seed"]), **r})
            print(rows[-1], flush=True)
    for tuned in [] if args.mixed else sorted(args.runs.glob(f"{FINETUNED_RUN}__*")):
        pre = tuned.with_name(tuned.name.replace(FINETUNED_RUN, PRETRAINED_RUN, 1))
        if not ((tuned / "pool.jsonl").is_file() and (pre / "pool.jsonl").is_file()):
            continue
        cell = dict(part.split("=", 1) for part in tuned.name.split("__")[1:])
        for r in study_cell(pre, tuned, args.draws, embedders):
            rows.append({"partitioning": cell.get("partitioning", ""), "seed": int(cell["seed"]), **r})
            print(rows[-1], flush=True)
    atomic_write_csv(args.out or args.runs.parent / "writer_mix.csv", rows, FIELDS)
    print("\n| split | variant | cells | accuracy (mean over cells) | kept from θ⁰ |\n|---|---|---|---|---|")
    for part in dict.fromkeys(r["partitioning"] for r in rows):
        for variant in dict.fromkeys(r["variant"] for r in rows):
            mine = [r for r in rows if (r["partitioning"], r["variant"]) == (part, variant)]
            print(f"| {part} | {variant} | {len(mine)} | {np.mean([r['accuracy'] for r in mine]):.3f} | "
                  f"{np.mean([r['kept_pretrained'] for r in mine]):.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
