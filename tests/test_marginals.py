"""Issue 48's pure pieces: a site's marginal counts over the public bins, and the server's sum of
the sites' noisy marginals fitted by a graphical model (``strategies.graphical_model``)."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

from common.marginals import marginal_counts
from strategies.graphical_model import fit_and_sample, sum_marginals

SIZES = {"a": 3, "b": 4, "c": 2}


def _table(n: int, seed: int) -> pd.DataFrame:
    """b follows a (b = a, or 3 one time in five), c is independent: a 2-way dependence to recover."""
    rng = np.random.default_rng(seed)
    a = rng.integers(0, 3, n)
    b = np.where(rng.random(n) < 0.8, a, 3)
    return pd.DataFrame({"a": a, "b": b, "c": rng.integers(0, 2, n)})


def test_a_sites_marginal_is_private_pgms_datavector_and_its_length_is_the_schemas():
    from mbi import Dataset, Domain

    codes = _table(200, 0)
    data = Dataset({k: codes[k].to_numpy() for k in SIZES}, Domain(list(SIZES), list(SIZES.values())))
    for clique in [("a",), ("b", "a"), ("a", "b", "c")]:
        assert np.array_equal(marginal_counts(codes, clique, SIZES), np.asarray(data.project(clique).datavector()))
    empty = marginal_counts(codes.iloc[:0], ("a", "b"), SIZES)
    assert empty.shape == (12,) and not empty.any()  # an empty view answers the same shape
    plus_one = pd.concat([codes, codes.iloc[:1]])  # one record more changes one cell by one
    diff = marginal_counts(plus_one, ("a", "c"), SIZES) - marginal_counts(codes, ("a", "c"), SIZES)
    assert sorted(diff) == [0.0] * 5 + [1.0]


def test_the_server_sums_the_sites_marginals_and_their_noise_variances():
    one = {("a",): np.array([1.0, 2.0, 3.0]), ("a", "c"): np.ones(6)}
    two = {("a",): np.array([10.0, 0.0, 1.0])}
    [measured] = sum_marginals([one, two], [3.0, 4.0])
    assert measured.clique == ("a",) and measured.counts.tolist() == [11.0, 2.0, 4.0] and measured.stddev == 5.0
    with pytest.raises(ValueError, match="different shapes"):
        sum_marginals([one, {("a",): np.ones(4)}], [1.0, 1.0])
    with pytest.raises(ValueError, match="noise levels"):
        sum_marginals([one], [1.0, 2.0])


def test_the_pooled_model_of_three_sites_recovers_their_union():
    sites = [_table(400, s) for s in range(3)]
    cliques = [("a",), ("b",), ("c",), ("a", "b")]
    rng = np.random.default_rng(9)
    sigma = 2.0
    answers = [{c: marginal_counts(t, c, SIZES) + rng.normal(0, sigma, int(np.prod([SIZES[x] for x in c])))
                for c in cliques} for t in sites]
    measured = sum_marginals(answers, [sigma] * 3)
    assert measured[0].stddev == pytest.approx(sigma * math.sqrt(3))
    rows = fit_and_sample(SIZES, measured, 1200, seed=0, iters=500)
    assert list(rows) == ["a", "b", "c"] and len(rows) == 1200
    union = pd.concat(sites)
    truth = marginal_counts(union, ("a", "b"), SIZES) / len(union)
    drawn = marginal_counts(rows, ("a", "b"), SIZES) / len(rows)
    assert 0.5 * np.abs(truth - drawn).sum() < 0.05  # the dependence of b on a survives
