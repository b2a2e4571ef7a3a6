"""The server's half of federated marginals (issue 48): sum every site's noisy marginals, fit a
graphical model to the sums, sample rows from it.

Each site releases its own marginals with Gaussian noise (``common.marginals.marginal_counts``
through the node's release path); the server adds them up. Their sum is the marginal of the union
of the sites' rows plus Gaussian noise whose variance is the sum of the sites' variances, so it is
one measurement of the pooled data, which Private-PGM (``mbi``) fits exactly like a central
measurement: everything here is post-processing of what the sites released.

Written by hand: summing and the variance bookkeeping are three lines; the estimation and the
sampling are mbi's (``MirrorDescent``, ``synthetic_data``), as in the MST and AIM baselines.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd

Clique = tuple[str, ...]
# mirror-descent iterations of the final model: the MST reference's count
ESTIMATE_ITERS = 10000


@dataclass(frozen=True)
class Measured:
    """One marginal of the pooled rows as the server knows it: the sum of the sites' noisy counts
    and the standard deviation of that sum's noise (per cell)."""

    clique: Clique
    counts: np.ndarray
    stddev: float


def sum_marginals(answers: Sequence[Mapping[Clique, np.ndarray]], stddevs: Sequence[float]) -> list[Measured]:
    """The pooled measurement of each clique every site answered: in each site's noisy marginals
    (clique -> counts) and the stddev of its noise, out the summed counts with stddev
    sqrt(sum of the sites' variances). A clique some site did not answer is left out: a sum over
    fewer sites is a marginal of other rows."""
    if len(answers) != len(stddevs):
        raise ValueError(f"{len(answers)} sites' answers but {len(stddevs)} noise levels")
    if not answers:
        return []
    common = [c for c in answers[0] if all(c in a for a in answers[1:])]
    out = []
    for clique in common:
        shapes = {np.shape(a[clique]) for a in answers}
        if len(shapes) != 1:
            raise ValueError(f"clique {clique}: the sites' marginals have different shapes {sorted(shapes)}")
        out.append(Measured(clique, np.sum([np.asarray(a[clique], dtype=np.float64) for a in answers], axis=0),
                            math.sqrt(sum(float(s) ** 2 for s in stddevs))))
    return out


def fit_and_sample(sizes: Mapping[str, int], measured: Sequence[Measured], rows: int, seed: int,
                   iters: int = ESTIMATE_ITERS) -> pd.DataFrame:
    """Rows drawn from the graphical model that best explains ``measured``: in each column's
    domain size (columns in order), the pooled measurements and how many rows to draw; out one
    int64 column of bin indices per column (``common.marginals.undiscretise`` turns them back
    into values). The total is mbi's minimum-variance estimate from the measurements."""
    import jax

    jax.config.update("jax_enable_x64", True)  # mbi's estimators stall in float32 on larger counts
    from mbi import Domain, LinearMeasurement
    from mbi.estimation import MirrorDescent, minimum_variance_unbiased_total
    from mbi.extensions import precompile, synthetic_data

    if rows < 1:
        raise ValueError("rows must be >= 1")
    attrs = list(sizes)
    domain = Domain(attrs, [int(sizes[a]) for a in attrs])
    loss = [LinearMeasurement(m.counts, m.clique, stddev=m.stddev) for m in measured]
    # the sampler's programs compile in mbi's background thread while the model is estimated
    # (one program per column: 19 s of a 60-row Breast Cancer sample when compiled after)
    precompile(domain, list(dict.fromkeys(m.clique for m in measured)), rows)
    model = MirrorDescent().estimate(domain, loss, known_total=max(1.0, minimum_variance_unbiased_total(loss)),
                                     iters=iters)
    sampled = synthetic_data(model, rows, seed=int(seed)).to_dict()
    return pd.DataFrame({a: np.asarray(sampled[a], dtype=np.int64) for a in attrs}, columns=attrs)


# --- what to measure (issue 48): post-processing of what the sites released ----------------------
#
# AIM chooses each marginal with an exponential mechanism on the private data; a federated server
# has no data to score, and a selection query to every site would cost budget and its scores are
# biased when sites differ (FLAIM, Maddock et al. 2023). Here the choice is made from the pooled
# noisy sums alone, so it is free: round 1 measures every 1- and 2-way marginal, and the server
# builds MST's maximum spanning tree from the pairs' dependence *as the noisy sums show it*, each
# edge joined with the control column (a tree-augmented naive Bayes: the control column predicts
# every other, and the strongest dependences among the others are kept); round 2 measures those
# cliques. One round alone cannot choose on data: it measures the 1-way marginals and each
# control-column pair (naive Bayes).

MAX_CLIQUE_CELLS = 1_000_000  # a tree edge joined with the control column beyond this stays a pair


def first_round(columns: Sequence[str], anchor: str, rounds: int) -> list[Clique]:
    """Round 1's cliques: in the columns (schema order), the control column and the run's rounds;
    out every 1-way marginal, then every 2-way marginal (rounds >= 2: a later round chooses from
    them) or only the control column's pairs (one round)."""
    ones = [(c,) for c in columns]
    if rounds >= 2:
        return ones + list(itertools.combinations(columns, 2))
    return ones + [tuple(sorted((anchor, c), key=list(columns).index)) for c in columns if c != anchor]


def dependence(pair: Measured, one: Mapping[str, Measured], sizes: Mapping[str, int]) -> float:
    """MST's score of a measured pair on noisy sums: ||y_ab - y_a (x) y_b / N||_1 minus the L1 size
    the pair's noise alone would give (sqrt(2 / pi) sigma cells): how far the pair is from what
    its 1-way marginals predict under independence, beyond noise."""
    a, b = pair.clique
    ya, yb = np.clip(one[a].counts, 0, None), np.clip(one[b].counts, 0, None)
    total = max(1.0, float(ya.sum()))
    independent = np.outer(ya, yb).ravel() / total
    return float(np.abs(pair.counts - independent).sum() - math.sqrt(2 / math.pi) * pair.stddev * pair.counts.size)


def second_round(measured: Sequence[Measured], columns: Sequence[str], anchor: str,
                 sizes: Mapping[str, int]) -> list[Clique]:
    """Round 2's cliques from round 1's pooled sums: the maximum spanning tree of the non-control
    columns by ``dependence``, each edge with the control column added (unless that clique would
    pass ``MAX_CLIQUE_CELLS``), and the control column's pair with each column no edge reaches."""
    import networkx as nx

    by = {m.clique: m for m in measured}
    one = {c[0]: m for c, m in by.items() if len(c) == 1}
    others = [c for c in columns if c != anchor]
    graph = nx.Graph()
    graph.add_nodes_from(others)
    for a, b in itertools.combinations(others, 2):
        pair = by.get((a, b)) or by.get((b, a))
        if pair is not None and a in one and b in one:
            graph.add_edge(a, b, weight=dependence(pair, one, sizes))
    order = list(columns).index
    out: list[Clique] = []
    reached: set[str] = set()
    for a, b in sorted(tuple(sorted(e, key=order)) for e in nx.maximum_spanning_tree(graph).edges()):
        joined = tuple(sorted((anchor, a, b), key=order))
        out.append(joined if int(np.prod([sizes[x] for x in joined])) <= MAX_CLIQUE_CELLS else (a, b))
        reached |= {a, b}
    out += [tuple(sorted((anchor, c), key=order)) for c in others if c not in reached]
    return out


def model_measurements(measured: Sequence[Measured], cliques: Sequence[Clique]) -> list[Measured]:
    """What the model is fitted to: every measurement inside one of the model's ``cliques`` (a
    round-1 pair outside them would join the junction tree into one clique of every column)."""
    homes = [set(c) for c in cliques]
    return [m for m in measured if len(m.clique) == 1 or any(set(m.clique) <= h for h in homes)]
