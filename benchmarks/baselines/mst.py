"""MST: the differentially private synthetic-table baseline of McKenna, Miklau and Sheldon (2021),
"Winning the NIST Contest: A scalable and general approach to differentially private synthetic
data" (Journal of Privacy and Confidentiality 11(3)), on Private-PGM (``mbi`` 2.0).

The algorithm (the paper's Algorithm 1, and ``mechanisms/mst.py`` of
github.com/ryan112358/private-pgm, which this follows; written anew here for mbi 2.0's API):

1. (epsilon, delta) -> zCDP rho (``cdp_rho``, the conversion of Canonne, Kamath and Steinke 2020
   that the reference code uses), split in three equal parts.
2. Measure every 1-way marginal with Gaussian noise (rho / 3 over the d marginals together).
3. Compress each column's domain on those *noisy* counts: the values whose noisy count is below
   3 sigma are merged into one value (post-processing; the measurements are re-expressed on the
   compressed domain with mbi's ``LinearMeasurement.compress``).
4. Select a spanning tree of 2-way marginals with Kruskal's algorithm in which every step is an
   exponential mechanism (rho / 3 over the d - 1 steps); an edge's score is the L1 distance
   between the true 2-way marginal and its estimate from the noisy 1-way marginals.
5. Measure the tree's d - 1 2-way marginals with Gaussian noise (rho / 3 together).
6. Estimate a graphical model from all the noisy measurements (mbi's mirror descent), sample
   records from it (mbi's seeded Gumbel-rounding sampler), undo the compression.

Sensitivities are for add/remove-one-record neighbours: one record changes one cell of a marginal
by one (L2 sensitivity 1 per marginal), and an edge's L1 score by at most one.

Around it, the table is discretised over its public schema (``common.marginals``) and (epsilon,
delta) is converted to zCDP (``common.dp.cdp_rho``). A baseline of the benchmarks, not a part of
fedsyn: it runs on the pooled or one site's records (``benchmarks/tables.py``).

jax and mbi are imported inside ``mst_synthesise`` only: the module imports without them.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pandas as pd

from common.dp import cdp_rho
from common.marginals import discretise, domain_size, typed_like, undiscretise
from common.rows import Schema

# Mirror-descent iterations: the reference code's counts (2,500 for the model used in the tree
# selection, 10,000 for the final one). On a tree of 16 x 16 marginals both take seconds on CPU.
SELECT_ITERS = 2500
ESTIMATE_ITERS = 10000


# --- MST's own steps -----------------------------------------------------------------------------

def exponential_mechanism(scores: np.ndarray, epsilon: float, sensitivity: float,
                          rng: np.random.Generator) -> int:
    """The index of one candidate, drawn with probability proportional to
    exp(epsilon * score / (2 * sensitivity)): in the candidates' scores (higher is better), the
    mechanism's epsilon (it is then epsilon^2 / 8-zCDP) and the scores' sensitivity."""
    logits = 0.5 * epsilon / sensitivity * np.asarray(scores, dtype=float)
    logits -= logits.max()  # exp of large scores would overflow; the shift cancels
    probs = np.exp(logits)
    return int(rng.choice(len(probs), p=probs / probs.sum()))


def select_tree(weights: Mapping[tuple[str, str], float], attributes: Sequence[str], rho: float,
                rng: np.random.Generator) -> list[tuple[str, str]]:
    """A spanning tree over ``attributes``, as its ``len(attributes) - 1`` edges: Kruskal's
    algorithm where each step picks among the edges that join two components with the exponential
    mechanism on the edges' ``weights`` (keyed by either order of the pair; sensitivity 1), the
    ``rho`` (zCDP) shared equally by the steps. A huge rho gives the maximum spanning tree."""
    from scipy.cluster.hierarchy import DisjointSet

    attrs = list(attributes)
    if len(attrs) < 2:
        return []

    def weight(a: str, b: str) -> float:
        return float(weights[(a, b)] if (a, b) in weights else weights[(b, a)])

    # eps^2 / 8 zCDP per step (bounded-range exponential mechanism), d - 1 steps
    epsilon = math.sqrt(8 * rho / (len(attrs) - 1))
    components = DisjointSet(attrs)
    candidates = list(itertools.combinations(attrs, 2))
    tree: list[tuple[str, str]] = []
    for _ in range(len(attrs) - 1):
        candidates = [e for e in candidates if not components.connected(*e)]
        pick = candidates[exponential_mechanism(np.array([weight(*e) for e in candidates]), epsilon, 1.0, rng)]
        components.merge(*pick)
        tree.append(pick)
    return tree


def support_mapping(noisy: np.ndarray, threshold: float) -> np.ndarray:
    """MST's domain compression for one column, from its noisy 1-way counts only: in the counts
    and the threshold (3 sigma in the paper), out the map original index -> compressed index:
    the values at or above the threshold keep their order, the others become one last value."""
    supported = np.asarray(noisy) >= threshold
    mapping = np.full(supported.size, int(supported.sum()), dtype=np.int64)
    mapping[supported] = np.arange(int(supported.sum()))
    return mapping


def decompress(codes: np.ndarray, mapping: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Original indices for compressed ones: each compressed index goes back to one of its
    original values, drawn uniformly (a merged value is a set of rare ones)."""
    out = np.empty(len(codes), dtype=np.int64)
    for value in np.unique(codes):
        where = np.flatnonzero(codes == value)
        out[where] = rng.choice(np.flatnonzero(mapping == value), size=where.size)
    return out


def _gaussian(counts: np.ndarray, stddev: float, rng: np.random.Generator) -> np.ndarray:
    return counts + rng.normal(0.0, stddev, size=counts.shape)


def prepare(method: str, frame: pd.DataFrame, schema: Schema, epsilon: float, delta: float, rows: int,
            bins: int) -> tuple[list[str], Any, Any, float]:
    """What a marginal baseline (MST, AIM) starts from, after checking its arguments: the column
    names, mbi's ``Domain`` and ``Dataset`` of the discretised records, and the zCDP rho of
    (epsilon, delta). Switches jax to float64 (process-wide) on the way."""
    if not epsilon > 0 or not 0 < delta < 1:
        raise ValueError(f"{method} needs epsilon > 0 and 0 < delta < 1")
    if rows < 1:
        raise ValueError("rows must be >= 1")
    for column in schema.columns:
        domain_size(column, bins)  # a number or date column without a declared range fails here
    codes = discretise(frame, schema, bins)

    import jax

    # mbi's own import-time advice: its estimators stall in float32 on larger counts, and its
    # many small programs make jax's persistent compilation cache a cost, not a saving
    jax.config.update("jax_enable_x64", True)
    jax.config.update("jax_enable_compilation_cache", False)
    from mbi import Dataset, Domain

    attrs = list(schema.names)
    domain = Domain(attrs, [domain_size(c, bins) for c in schema.columns])
    data = Dataset({a: codes[a].to_numpy(dtype=np.int64) for a in attrs}, domain)
    return attrs, domain, data, cdp_rho(epsilon, delta)


def mst_synthesise(frame: pd.DataFrame, schema: Schema, epsilon: float, delta: float, rows: int, seed: int,
                   bins: int = 16) -> pd.DataFrame:
    """``rows`` synthetic records from MST at (epsilon, delta)-DP: in the private records (the
    schema's columns, typed), the schema (public: its categories and declared ranges define the
    domain), the budget, the number of rows to make, a seed (the same seed and input give the same
    frame) and the bins per number or date column; out a DataFrame with the schema's columns in
    its order, typed like the input, every value inside the schema."""
    attrs, domain, data, rho = prepare("MST", frame, schema, epsilon, delta, rows, bins)
    from mbi import LinearMeasurement
    from mbi.estimation import MirrorDescent, minimum_variance_unbiased_total
    from mbi.extensions import synthetic_data

    rng = np.random.default_rng(seed)
    d = len(attrs)
    # rho / 3 for each of the three steps; k Gaussian measurements of sensitivity 1 at stddev
    # sigma * sqrt(k) cost k / (2 sigma^2 k) = 1 / (2 sigma^2) = rho / 3 together
    sigma = math.sqrt(3.0 / (2.0 * rho))

    # 1. every 1-way marginal
    stddev1 = sigma * math.sqrt(d)
    one_way = [LinearMeasurement(_gaussian(np.asarray(data.project(a).datavector()), stddev1, rng), (a,),
                                 stddev=stddev1) for a in attrs]

    # 2. domain compression on the noisy counts (post-processing). mbi estimates the record total
    # from identity measurements only, which a compressed one no longer is: the total is taken
    # here, from the noisy counts before compression (the same minimum-variance estimate)
    raw_one_way = one_way
    mappings = {m.clique[0]: support_mapping(np.asarray(m.noisy_measurement), 3 * m.stddev) for m in one_way}
    mappings = {a: m for a, m in mappings.items() if not np.array_equal(m, np.arange(domain[a]))}
    small = data.compress(mappings) if mappings else data
    one_way = [m.compress(mappings, domain) for m in one_way]

    # 3. the tree: scores from a model of the noisy 1-way marginals alone
    tree: list[tuple[str, str]] = []
    if d > 1:
        total = minimum_variance_unbiased_total(raw_one_way)
        independent = MirrorDescent().estimate(small.domain, one_way, known_total=total, iters=SELECT_ITERS)
        singles = {a: np.asarray(independent.project((a,)).datavector(), dtype=float) for a in attrs}
        scores = {}
        for a, b in itertools.combinations(attrs, 2):
            # a model of singleton cliques is a product: its 2-way marginal is the outer
            # product (what variable elimination gives, without one compilation per pair)
            estimate = np.outer(singles[a], singles[b]).ravel() / total
            scores[(a, b)] = float(np.abs(np.asarray(small.project((a, b)).datavector()) - estimate).sum())
        tree = select_tree(scores, attrs, rho / 3.0, rng)

    # 4. the tree's 2-way marginals
    stddev2 = sigma * math.sqrt(max(len(tree), 1))
    two_way = [LinearMeasurement(_gaussian(np.asarray(small.project(e).datavector()), stddev2, rng), e,
                                 stddev=stddev2) for e in tree]

    # 5. the model, and records from it
    model = MirrorDescent().estimate(small.domain, one_way + two_way,
                                     known_total=minimum_variance_unbiased_total(raw_one_way + two_way),
                                     iters=ESTIMATE_ITERS)
    sampled = synthetic_data(model, rows, seed=int(rng.integers(2**31 - 1)))
    result = {}
    for a in attrs:
        values = np.asarray(sampled.to_dict()[a], dtype=np.int64)
        result[a] = decompress(values, mappings[a], rng) if a in mappings else values
    out = undiscretise(pd.DataFrame(result, columns=attrs), schema, bins, rng)
    return typed_like(out, frame, schema)
