"""Does the vote's embedding window change what kNN-vote keeps? A paired comparison on finished runs.

Usage: python -m benchmarks.vote_window <out-dir>/runs/<cell> [...] [--draws 20] [--window TOKENS]

For each finished simulation (a grid cell of ``fedsyn experiment``) it takes the run's own pool
(``pool.jsonl``) and the weak nodes' records (the same simulated partitions), computes the kNN
votes twice, with records and candidates embedded whole (MiniLM's 256 tokens) and within the
``max-length`` window the node uses, adds the same Gaussian noise the nodes add (same draws for
both), keeps the texts by A.4 with the same seeds, and scores both kept sets against the run's
held-out split: topic accuracy and macro-F1 (logistic regression), Fréchet distance and MAUVE.
Everything but the window is shared, so the difference is the window's alone (free of the
variance between DP training runs that a new run would add).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np

from common.config import RunConfig
from common.dp import VOTE, WEAK, analytic_gaussian_sigma, phase_epsilon
from common.federation import benchmark, simulation_node_data
from common.io import read_jsonl
from common.models import embed, load_embedder
from common.voting import knn_votes
from fedsyn_server.evaluation.alignment import frechet_distance, mauve_available, mauve_score
from fedsyn_server.evaluation.utility import downstream_utility
from strategies.resampling import resample_by_code


def compare(run_dir: Path, draws: int, window: int = 0) -> dict[str, dict[str, float]]:
    """Mean scores of the kept sets, whole-text votes vs window votes (``window`` tokens; 0: the run's
    vote window), over ``draws`` noise/A.4 draws."""
    cfg = RunConfig.from_flower(json.loads((run_dir / "config.json").read_text()))
    nodes = len(json.loads((run_dir / "metrics.json").read_text())["nodes"])
    pool = read_jsonl(run_dir / "pool.jsonl")
    heldout = read_jsonl(run_dir / "heldout.jsonl")
    texts, codes = [r["text"] for r in pool], [r["control_code"] for r in pool]
    model = load_embedder(cfg.embedder)
    real = embed(model, [r["text"] for r in heldout])
    real_labels = [r["control_code"] for r in heldout]
    scored = embed(model, texts)  # what the evaluation sees: the texts whole, as fedsyn evaluate embeds them
    parts = [simulation_node_data(cfg, p, nodes) for p in range(nodes)]
    weak = [data for tier, data in parts if tier == WEAK]
    delta = cfg.resolve_delta(len(benchmark(cfg).train))  # as the server resolves it
    sigma = analytic_gaussian_sigma(phase_epsilon(cfg.epsilon, cfg.epsilon_profile, WEAK, cfg.voters, VOTE), delta,
                                    math.sqrt(cfg.num_votes))
    votes = {}
    for name, tokens in (("whole", None), ("window", window or cfg.vote_window)):
        syn = embed(model, texts, max_tokens=tokens)
        votes[name] = sum(knn_votes(embed(model, d.texts, max_tokens=tokens), d.codes, syn, codes, cfg.num_votes)
                          for d in weak)
    out: dict[str, dict[str, list[float]]] = {name: {} for name in votes}
    for draw in range(draws):
        noise = np.random.default_rng(draw).normal(0.0, sigma, size=(len(weak), len(texts))).sum(axis=0)
        for name, v in votes.items():
            kept = resample_by_code(codes, v + noise, cfg.sampling_rate, draw)
            emb, labels = scored[kept], [codes[i] for i in kept]
            u = downstream_utility(emb, labels, real, real_labels, seed=draw)
            row = {"accuracy": u["accuracy"], "macro_f1": u["macro_f1"], "frechet": frechet_distance(emb, real)}
            if mauve_available() and draw < 5:  # MAUVE is the slow one: 5 draws
                row["mauve"] = float(mauve_score(real, emb, seeds=(draw,))["mean"])
            for k, val in row.items():
                out[name].setdefault(k, []).append(float(val))
    return {name: {k: float(np.mean(v)) for k, v in m.items()} for name, m in out.items()}


def main() -> int:
    """Print whole vs window per run and the mean difference; exit 0."""
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("runs", nargs="+", type=Path)
    ap.add_argument("--draws", type=int, default=20)
    ap.add_argument("--window", type=int, default=0,
                    help="tokens of the window (default: the run's vote window, 2 x max-length)")
    args = ap.parse_args()
    diffs: dict[str, list[float]] = {}
    for run in args.runs:
        res = compare(run, args.draws, args.window)
        print(run.name, {n: {k: round(v, 3) for k, v in m.items()} for n, m in res.items()}, flush=True)
        for k in res["whole"]:
            diffs.setdefault(k, []).append(res["window"][k] - res["whole"][k])
    print("window - whole, mean over runs (± sample std):",
          {k: f"{np.mean(v):+.3f} ± {np.std(v, ddof=1) if len(v) > 1 else 0:.3f}" for k, v in diffs.items()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
