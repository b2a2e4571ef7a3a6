"""Does the vote's embedder see the label? Nearest-neighbour label agreement and a linear probe.

Usage: python -m benchmarks.embedder_label [--dataset rotten-tomatoes --column sentiment]
       [--embedder all-MiniLM-L6-v2] [--records 3000]

A vote (kNN or contrastive) can only reward texts for what the embedder places near the records.
For a sample of the dataset's real records (cut to the vote's window, 2 x max-length tokens) it
prints: the share of each record's K = 4 nearest other records (cosine) that carry its label,
against the chance share (sum of squared label frequencies); and the accuracy of a logistic
regression on the embeddings, trained on 60 records (the size of a default final synthetic set,
so roughly the ceiling of the utility metric from a perfect synthetic set of that size) and on
two thirds of the sample, tested on the rest. Public data only; nothing here is private.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np


def neighbour_agreement(emb: np.ndarray, labels: np.ndarray, k: int = 4) -> float:
    """Mean share of each row's k nearest other rows (cosine; rows are unit vectors) with its label."""
    sims = emb @ emb.T
    np.fill_diagonal(sims, -np.inf)
    nearest = np.argpartition(-sims, k - 1, axis=1)[:, :k]
    return float((labels[nearest] == labels[:, None]).mean())


def chance_agreement(labels: np.ndarray) -> float:
    """The share ``neighbour_agreement`` has for an embedder blind to the label."""
    _, counts = np.unique(labels, return_counts=True)
    return float(((counts / counts.sum()) ** 2).sum())


def main(argv: list[str] | None = None) -> int:
    """Print the embedder's neighbour agreement and probe accuracies for one labelled dataset."""
    from sklearn.linear_model import LogisticRegression

    from common.config import RunConfig
    from common.models import embed, load_embedder
    from common.tables import load_table

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dataset", default="rotten-tomatoes")
    ap.add_argument("--column", default="sentiment")
    ap.add_argument("--text-column", default="text")
    ap.add_argument("--embedder", default="all-MiniLM-L6-v2")
    ap.add_argument("--records", type=int, default=3000)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    table = load_table(args.dataset)
    table = table.sample(min(args.records, len(table)), random_state=args.seed)
    labels = np.asarray([str(v) for v in table[args.column]])
    emb = embed(load_embedder(args.embedder), [str(t) for t in table[args.text_column]],
                max_tokens=RunConfig().vote_window)
    cut = 2 * len(labels) // 3
    probe = {n: LogisticRegression(max_iter=2000).fit(emb[:n], labels[:n]).score(emb[cut:], labels[cut:])
             for n in (60, cut)}
    print(f"{args.dataset} / {args.column} / {args.embedder}, {len(labels)} records")
    print(f"  4-NN label agreement {neighbour_agreement(emb, labels):.3f} (chance {chance_agreement(labels):.3f})")
    for n, acc in probe.items():
        print(f"  linear probe trained on {n} real records: accuracy {acc:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
