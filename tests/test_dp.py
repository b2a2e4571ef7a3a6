"""The DP mechanisms: calibration against an independent solve, noise, accounting."""

import math

import numpy as np
import pytest
from scipy import optimize, stats

from common.dp import (
    analytic_gaussian_sigma,
    dpsgd_epsilon,
    dpsgd_noise_multiplier,
    gaussian_event,
    gaussian_release,
    paper_delta,
    phase_epsilon,
    pld_epsilon,
    split_budget,
)


def _balle_wang_sigma(eps: float, delta: float, sens: float) -> float:
    """Independent solve of Balle & Wang (2018) Theorem 8 for sigma:
    Phi(D/(2s) - eps*s/D) - e^eps * Phi(-D/(2s) - eps*s/D) = delta."""
    def gap(log_s):
        s = math.exp(log_s)
        a, b = sens / (2 * s), eps * s / sens
        return stats.norm.cdf(a - b) - math.exp(eps) * stats.norm.cdf(-a - b) - delta
    return math.exp(optimize.brentq(gap, math.log(1e-6), math.log(1e6), xtol=1e-14, rtol=1e-14))


@pytest.mark.parametrize("eps", [0.1, 0.5, 1.0, 2.0, 6.0, 8.0, 20.0])
@pytest.mark.parametrize("delta", [1e-9, 1e-5, 1e-3])
@pytest.mark.parametrize("sens", [1.0, math.sqrt(5), 10.0])
def test_sigma_matches_independent_solve(eps, delta, sens):
    ours = analytic_gaussian_sigma(eps, delta, sens)
    assert ours == pytest.approx(_balle_wang_sigma(eps, delta, sens), rel=1e-6)


def test_sigma_edge_cases():
    assert analytic_gaussian_sigma(math.inf, 1e-5, 3.0) == 0.0
    with pytest.raises(ValueError, match="epsilon"):
        analytic_gaussian_sigma(0.0, 1e-5, 1.0)
    with pytest.raises(ValueError, match="delta"):
        analytic_gaussian_sigma(1.0, 1.5, 1.0)
    # more privacy -> more noise
    assert analytic_gaussian_sigma(1.0, 1e-5, 1) > analytic_gaussian_sigma(2.0, 1e-5, 1)


@pytest.mark.parametrize("sigma", [0.7, 3.0])
def test_gaussian_release_has_the_calibrated_std(sigma):
    rng = np.random.default_rng(0)
    base = np.arange(5, dtype=float)
    draws = np.stack([gaussian_release(base, sigma, rng) - base for _ in range(4000)]).ravel()
    # 20,000 draws: the sample std is within ~1% of sigma; a sigma off by 10% fails.
    assert abs(draws.std() / sigma - 1) < 0.03
    assert abs(draws.mean()) < 0.05 * sigma
    assert np.array_equal(gaussian_release(base, 0.0, rng), base)


def test_dpsgd_calibration_meets_target_over_all_steps():
    q, steps, delta = 0.01, 60, 1e-5
    nm = dpsgd_noise_multiplier(6.0, delta, q, steps)
    eps = dpsgd_epsilon([[nm, q, steps]], delta)
    assert 5.9 <= eps <= 6.0 + 0.01
    # Split into rounds, the same history composes to the same epsilon (no reset per round).
    assert dpsgd_epsilon([[nm, q, steps // 3]] * 3, delta) == pytest.approx(eps, rel=1e-9)
    assert dpsgd_noise_multiplier(math.inf, delta, q, steps) == 0.0


def test_split_budget_is_appendix_b():
    s = split_budget(8.0, 2.0)
    assert (s.total, s.profile, s.main) == (8.0, 2.0, 6.0)
    assert split_budget(4.0, 1.0).main == 3.0
    with pytest.raises(ValueError):
        split_budget(2.0, 2.0)
    assert math.isinf(split_budget(math.inf, 2.0).main)


def test_tight_accounting_is_below_basic_composition():
    d = 1e-5
    events = [gaussian_event(analytic_gaussian_sigma(2.0, d, 1), 1.0),
              gaussian_event(analytic_gaussian_sigma(6.0, d, 2), 2.0)]
    tight = pld_epsilon(events, 2 * d)
    assert 0 < tight < 8.0
    # A single release: the PLD epsilon at the same delta is (up to discretisation) the release's.
    assert pld_epsilon(events[:1], d) == pytest.approx(2.0, abs=0.02)
    assert pld_epsilon([], d) == 0.0


@pytest.mark.parametrize("tier,voters,expected", [
    ("strong", "weak", {"train": 6.0, "profile": 2.0, "vote": 0.0}),
    ("weak", "weak", {"train": 0.0, "profile": 2.0, "vote": 6.0}),
    ("strong", "all", {"train": 3.0, "profile": 2.0, "vote": 3.0}),
    ("weak", "all", {"train": 0.0, "profile": 2.0, "vote": 6.0}),
])
def test_phase_epsilon_sums_to_the_node_total(tier, voters, expected):
    got = {p: phase_epsilon(8.0, 2.0, tier, voters, p) for p in expected}
    assert got == expected and sum(got.values()) == 8.0


def test_noise_calibration_refuses_zero_steps_instead_of_looping():
    with pytest.raises(ValueError, match="steps >= 1"):
        dpsgd_noise_multiplier(6.0, 1e-5, 0.1, 0)


def test_paper_delta():
    assert paper_delta(10) == pytest.approx(1 / (20 * math.log(10)))


@pytest.mark.parametrize("epsilon,q", [(6.0, 32 / 1000), (1.0, 0.001), (0.5, 0.5), (30.0, 0.01)])
def test_the_rdp_orders_reach_the_optimum_no_accountant_warning(epsilon, q):
    import warnings

    from common.dp import dpsgd_epsilon, dpsgd_noise_multiplier

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # Opacus warns when the best order is at the end of the grid
        nm = dpsgd_noise_multiplier(epsilon, 1e-5, q, 24)
        assert dpsgd_epsilon([[nm, q, 24]], 1e-5) <= epsilon + 0.01
