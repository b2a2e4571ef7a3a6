"""The AIM baseline (``benchmarks/baselines/aim.py``): its budget schedule and workload, pure, and
one real run on mbi."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

from benchmarks.baselines import aim as A, mst as M
from common.rows import schema_from_dict

# --- the budget ----------------------------------------------------------------------------------


def _run_schedule(rho: float, d: int, anneal_when) -> tuple[list[tuple[float, float]], float, float]:
    """The schedule run to exhaustion: the rounds' (sigma, epsilon), the rho the initialisation
    spent, and the schedule's own running total at the end."""
    sigma, eps, used = A.initial_budget(rho, d)
    init = used
    rounds: list[tuple[float, float]] = []
    last = False
    while not last:
        sigma, eps, used, last = A.next_round(rho, used, sigma, eps)
        rounds.append((sigma, eps))
        if anneal_when(len(rounds)):
            sigma, eps = A.anneal(sigma, eps)
        assert len(rounds) < 10_000
    return rounds, init, used


@pytest.mark.parametrize("rho", [0.015, 1.2297, 20.7])
@pytest.mark.parametrize("d", [1, 4, 9])
@pytest.mark.parametrize("rule", ["never", "every", "every third", "late"])
def test_the_budget_schedule_never_spends_more_than_rho(rho, d, rule):
    anneal_when = {"never": lambda t: False, "every": lambda t: True,
                   "every third": lambda t: t % 3 == 0, "late": lambda t: t > 5 * d}[rule]
    rounds, init, used = _run_schedule(rho, d, anneal_when)
    # recompute what was spent from the noise and selection parameters actually used:
    # d Gaussian 1-way measurements at the first sigma, then 1 / (2 sigma^2) + eps^2 / 8 a round
    first_sigma = math.sqrt(16 * d / (2 * 0.9 * rho))
    assert init == pytest.approx(d * 0.5 / first_sigma**2, rel=1e-12)
    spent = init + sum(A.round_rho(s, e) for s, e in rounds)
    assert spent <= rho * (1 + 1e-12)  # the float sum may round an ulp either way
    assert spent == pytest.approx(rho, rel=1e-9)  # ... and the whole budget is used
    assert used == rho  # the schedule's own total lands on rho exactly
    if rule == "never":
        # no annealing: T = 16 d rounds of rho / T minus the initialisation's 0.9 d of them,
        # the last round taking the remainder (between one and two rounds' worth)
        assert len(rounds) in (16 * d - math.ceil(0.9 * d) - 1, 16 * d - math.ceil(0.9 * d))
    if rule == "every":
        assert len(rounds) < 16 * d / 2  # each annealing quadruples a round's cost


def test_the_schedule_starts_as_the_reference_and_the_last_round_takes_the_rest():
    rho, d = 1.0, 4
    sigma, eps, used = A.initial_budget(rho, d)
    # private-pgm aim.py: sigma = sqrt(T / (2 * 0.9 rho)), epsilon = sqrt(8 * 0.1 rho / T), T = 16 d
    assert sigma == pytest.approx(math.sqrt(64 / 1.8)) and eps == pytest.approx(math.sqrt(0.8 / 64))
    assert A.round_rho(sigma, eps) == pytest.approx(rho / 64)
    # an ordinary round costs rho / T
    s2, e2, used2, last = A.next_round(rho, used, sigma, eps)
    assert (s2, e2, last) == (sigma, eps, False) and used2 == pytest.approx(used + rho / 64)
    # less than two rounds left: this round takes all of it, 90 % noise and 10 % selection
    left = 1.5 * A.round_rho(sigma, eps)
    s3, e3, used3, last = A.next_round(rho, rho - left, sigma, eps)
    assert last and used3 == rho
    assert 0.5 / s3**2 == pytest.approx(0.9 * left) and e3**2 / 8 == pytest.approx(0.1 * left)
    assert A.anneal(sigma, eps) == (sigma / 2, eps * 2)
    with pytest.raises(ValueError):
        A.initial_budget(0.0, 3)


# --- the workload --------------------------------------------------------------------------------

def test_the_candidates_are_the_workloads_downward_closure_weighted_as_the_reference():
    attrs = ["a", "b", "c", "d"]
    work = A.workload(attrs, 2)
    assert [cl for cl, _ in work] == [("a", "b"), ("a", "c"), ("a", "d"), ("b", "c"), ("b", "d"), ("c", "d")]
    cands = A.candidate_weights(work, attrs)
    assert list(cands)[:4] == [("a",), ("b",), ("c",), ("d",)] and len(cands) == 10
    # a 1-way marginal shares one attribute with the 3 pairs holding it; a pair shares 2 with
    # itself and 1 with each of the 4 pairs that overlap it
    assert cands[("a",)] == 3.0 and cands[("b", "d")] == 6.0
    assert A.workload(["only"], 2) == [(("only",), 1.0)]  # more degree than columns: all of them
    with pytest.raises(ValueError):
        A.workload(attrs, 0)


def test_the_selection_follows_the_quality_score():
    answers = {("a",): np.array([50.0, 50.0]), ("a", "b"): np.array([40.0, 10.0, 10.0, 40.0])}
    estimates = {("a",): np.array([50.0, 50.0]), ("a", "b"): np.array([25.0, 25.0, 25.0, 25.0])}
    sizes = {("a",): 2, ("a", "b"): 4}
    weights = {("a",): 1.0, ("a", "b"): 2.0}
    # the 1-way marginal is already right, the pair is 60 off: a huge epsilon picks the pair
    picks = {A.select_marginal(weights, answers, estimates, sizes, 1.0, 1e6, np.random.default_rng(s))
             for s in range(5)}
    assert picks == {("a", "b")}


# --- one real run --------------------------------------------------------------------------------

E2E_SCHEMA = schema_from_dict({"columns": [
    {"name": "y", "type": "categorical", "categories": ["a", "b"]},
    {"name": "x", "type": "integer", "min": 0, "max": 100},
    {"name": "z", "type": "float", "min": 0, "max": 10, "decimals": 1},
    {"name": "k", "type": "categorical", "categories": ["u", "v", "w"]},
]})


def _dependent_records(n: int = 400) -> pd.DataFrame:
    rng = np.random.default_rng(11)
    y = rng.choice(["a", "b"], n)
    return pd.DataFrame({
        "y": y,
        "x": np.where(y == "a", rng.integers(70, 101, n), rng.integers(0, 31, n)),  # x high iff y == "a"
        "z": np.round(rng.uniform(0, 10, n), 1),  # independent of both
        "k": rng.choice(["u", "v", "w"], n),
    })


@pytest.fixture(scope="module")
def aim_run():
    # its time is a benchmark's (benchmarks/README.md, "python -m benchmarks.tables"), not this test's
    real = _dependent_records()
    return real, A.aim_synthesise(real, E2E_SCHEMA, epsilon=8.0, delta=1e-5, rows=400, seed=7)


def test_aim_keeps_the_dependence_and_stays_inside_the_schema(aim_run):
    real, syn = aim_run
    assert list(syn.columns) == list(E2E_SCHEMA.names) and len(syn) == 400
    means = syn.groupby("y")["x"].mean()
    assert means["a"] > means["b"] + 30, means  # real: about 85 against 15
    assert (syn.loc[syn.y == "a", "x"] >= 60).mean() > 0.8 and (syn.loc[syn.y == "b", "x"] <= 40).mean() > 0.8
    for column in E2E_SCHEMA.columns:
        for value in syn[column.name]:
            column.write(value)  # raises for an undeclared category or a value out of range
    assert syn["x"].dtype == np.int64 and syn["z"].dtype == np.float64
    assert syn["y"].dtype == real["y"].dtype and syn["k"].dtype == real["k"].dtype
    assert np.allclose(syn["z"], np.round(syn["z"], 1))
    assert 3 < syn["z"].mean() < 7


def test_aim_is_reproducible_from_its_seed(aim_run):
    real, first = aim_run
    again = A.aim_synthesise(real, E2E_SCHEMA, epsilon=8.0, delta=1e-5, rows=400, seed=7)
    pd.testing.assert_frame_equal(first, again)
    other = A.aim_synthesise(real, E2E_SCHEMA, epsilon=8.0, delta=1e-5, rows=400, seed=8)
    assert not other.equals(first)


def test_aim_refuses_what_mst_refuses():
    frame = _dependent_records(20)
    for eps, delta in [(0.0, 1e-5), (1.0, 0.0), (1.0, 1.0)]:
        with pytest.raises(ValueError, match="epsilon"):
            A.aim_synthesise(frame, E2E_SCHEMA, eps, delta, 10, seed=0)
    with pytest.raises(ValueError, match="rows"):
        A.aim_synthesise(frame, E2E_SCHEMA, 1.0, 1e-5, 0, seed=0)
    unranged = schema_from_dict({"columns": [{"name": "y", "type": "categorical", "categories": ["a"]},
                                             {"name": "w", "type": "float", "min": 0}]})
    with pytest.raises(ValueError, match="declared ranges"):
        A.aim_synthesise(pd.DataFrame({"y": ["a"], "w": [1.0]}), unranged, 1.0, 1e-5, 10, seed=0)
    # the same checks, discretisation and budget conversion as MST: one home for them
    assert A.prepare is M.prepare
