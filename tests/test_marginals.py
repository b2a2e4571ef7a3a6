"""Issue 48's pure pieces: a site's marginal counts over the public bins, and the server's sum of
the sites' noisy marginals fitted by a graphical model (``strategies.graphical_model``)."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

from common.marginals import joined_marginals, marginal_counts, split_marginals
from strategies.graphical_model import (
    first_round,
    fit_and_sample,
    model_measurements,
    second_round,
    sum_marginals,
)

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


def test_a_sites_joined_marginals_move_by_sqrt_k_for_one_record_and_split_back():
    codes = _table(300, 1)
    cliques = [("a",), ("b",), ("c",), ("a", "b"), ("b", "c")]
    joined = joined_marginals(codes, cliques, SIZES)
    assert joined.shape == (3 + 4 + 2 + 12 + 8,)
    plus_one = joined_marginals(pd.concat([codes, codes.iloc[[7]]]), cliques, SIZES)
    assert np.linalg.norm(plus_one - joined) == pytest.approx(math.sqrt(len(cliques)))  # the stated sensitivity
    back = split_marginals(joined, cliques, SIZES)
    assert all(np.array_equal(back[c], marginal_counts(codes, c, SIZES)) for c in cliques)
    with pytest.raises(ValueError, match="cells"):
        split_marginals(joined[:-1], cliques, SIZES)


def test_round_one_asks_every_pair_when_a_second_round_chooses_else_the_control_columns_pairs():
    columns = ["y", "a", "b", "c"]
    two = first_round(columns, "y", rounds=2)
    assert two[:4] == [("y",), ("a",), ("b",), ("c",)] and len(two) == 4 + 6
    one = first_round(columns, "y", rounds=1)
    assert one[4:] == [("y", "a"), ("y", "b"), ("y", "c")]


def test_round_two_keeps_the_dependence_the_noisy_sums_show_and_joins_it_with_the_control_column():
    """a and b depend on each other, c on nothing: round 2 measures (y, a, b), and the model is fitted
    to the 1-way marginals and the pairs inside its cliques only (a pair outside would join the tree)."""
    rng = np.random.default_rng(3)
    codes = _table(4000, 2).assign(y=rng.integers(0, 2, 4000))
    sizes = {**SIZES, "y": 2}
    columns = ["y", "a", "b", "c"]
    cliques = first_round(columns, "y", rounds=2)
    noisy = {c: marginal_counts(codes, c, sizes) + rng.normal(0, 5.0, marginal_counts(codes, c, sizes).shape)
             for c in cliques}
    measured = sum_marginals([noisy], [5.0])
    chosen = second_round(measured, columns, "y", sizes)
    assert ("y", "a", "b") in chosen and len(chosen) == 2  # a tree over a, b, c has two edges
    fitted = model_measurements(measured, chosen)
    assert {m.clique for m in fitted if len(m.clique) == 1} == {(c,) for c in columns}
    assert all(any(set(m.clique) <= set(c) for c in chosen) for m in fitted if len(m.clique) > 1)
    assert len(fitted) < len(measured)  # the pair that is in no clique of the model is left out
