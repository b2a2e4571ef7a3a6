"""Distributed discrete noise: the Skellam mechanism (Agarwal, Kairouz & Liu, NeurIPS 2021).

Under secure aggregation a site adds integer noise to an integer vector, and the server sees only
the sum. Skellam(mu) is Poisson(mu) - Poisson(mu), variance 2 mu, and Skellam(a) + Skellam(b) is
Skellam(a + b) *exactly*: so t honest sites that each add Skellam(mu / t) put exactly Skellam(mu)
in the sum, the noise one trusted aggregator would add. (The distributed discrete Gaussian's sum is
only close to a discrete Gaussian; Skellam's closure is why it is ours.)

Accounting, exact up to ``dp_accounting``'s pessimistic discretisation (a proven upper bound): the
histograms fedsyn masks are counts in which one record moves each of at most ``c`` coordinates by
at most 1 (the profile: c = 1; kNN votes: K; contrastive votes: 2K; marginals: one cell per
marginal), their L2 sensitivity being sqrt(c). With independent noise per coordinate the privacy
loss of a shift is the sum of the coordinates' losses, and each coordinate's loss is that of
Skellam(mu) against Skellam(mu) + 1 (or - 1: the same by symmetry), largest when every one of the
c coordinates moves. So the release's privacy-loss distribution is the one-coordinate PLD composed
c times (``pld``), built from the two probability mass functions, the tails beyond 2^-64 counted
as infinite loss. A real-valued histogram would need a scale and randomized rounding with their
own bound; none is masked yet.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import numpy as np

from common.secagg.ring import poisson_tail

VALUE_DISCRETIZATION = 1e-3  # the project's PLD discretisation (common.dp.pld_accountant's)
MU_TOLERANCE = 1e-4  # a solved mu is within this relative width of the least that fits


def coordinates(sensitivity: float) -> int:
    """The coordinates one record moves by at most 1 in a count histogram of L2 ``sensitivity``
    (sqrt of a whole number for every count histogram fedsyn ships); ``ValueError`` otherwise."""
    c = round(float(sensitivity) ** 2)
    if c < 1 or abs(math.sqrt(c) - float(sensitivity)) > 1e-9 * max(1.0, float(sensitivity)):
        raise ValueError(f"sensitivity {sensitivity:g} is not sqrt(whole number): not a count histogram")
    return c


def sample(mu: float, length: int, rng: np.random.Generator) -> np.ndarray:
    """``length`` independent Skellam(``mu``) draws (int64); zeros for mu = 0."""
    if mu < 0 or not math.isfinite(mu):
        raise ValueError(f"Skellam mu = {mu}; must be finite and >= 0")
    if mu == 0:
        return np.zeros(length, dtype=np.int64)
    return rng.poisson(mu, length).astype(np.int64) - rng.poisson(mu, length).astype(np.int64)


def share(mu: float, honest: int) -> float:
    """The mu each of ``honest`` sites adds so that their sum carries Skellam(``mu``)."""
    if honest < 1:
        raise ValueError(f"honest = {honest}; must be >= 1")
    return float(mu) / int(honest)


@functools.lru_cache(maxsize=256)
def pld(mu: float, count: int) -> Any:
    """The privacy-loss distribution of Skellam(``mu``) noise on a count histogram in which one
    record moves ``count`` coordinates by at most 1 (a ``dp_accounting`` PLD, pessimistic)."""
    from dp_accounting.pld import privacy_loss_distribution as pld_lib
    from scipy.stats import skellam

    if not mu > 0 or count < 1:
        raise ValueError(f"Skellam PLD of mu = {mu}, {count} coordinates")
    m = poisson_tail(mu)  # beyond +-m each Poisson has mass below 2^-64: the rest counts as infinite loss
    k = np.arange(-2 * m, 2 * m + 2)
    lower = skellam.logpmf(k, mu, mu)  # the noise on D
    upper = skellam.logpmf(k - 1, mu, mu)  # on D with the record: shifted by one
    lower_map: dict[Any, float] = {int(a): float(b) for a, b in zip(k, lower) if b > -745}
    upper_map: dict[Any, float] = {int(a): float(b) for a, b in zip(k, upper) if b > -745}
    # the upper distribution's mass outside the grid, as an outcome the lower never gives: it enters
    # the PLD's infinite-loss mass (a pessimistic bound), not silently dropped
    missing = max(0.0, 1.0 - math.fsum(math.exp(v) for v in upper_map.values()))
    upper_map["tail"] = math.log(max(missing, 2.0 ** -64))
    one = pld_lib.from_two_probability_mass_functions(lower_map, upper_map, pessimistic_estimate=True,
                                                      value_discretization_interval=VALUE_DISCRETIZATION)
    return one if count == 1 else one.self_compose(count)


def epsilon(mu: float, count: int, delta: float) -> float:
    """Epsilon at ``delta`` of one Skellam(``mu``) release on a count histogram of ``count``
    moved coordinates; inf for mu = 0."""
    if mu <= 0:
        return math.inf
    return float(pld(float(mu), int(count)).get_epsilon_for_delta(delta))


def solve_mu(target: float, count: int, delta: float) -> float:
    """The least mu (within ``MU_TOLERANCE``, on the side that fits) such that one Skellam
    release on ``count`` coordinates costs at most ``target`` at ``delta``; inf for a target of 0."""
    from common.dp import analytic_gaussian_sigma

    if not target > 0:
        return math.inf
    if math.isinf(target):
        return 0.0
    # near the answer: a Gaussian of the same variance (2 mu = sigma^2) at the same sensitivity
    hi = max(analytic_gaussian_sigma(target, delta, math.sqrt(count)) ** 2 / 2, 1e-3)
    while epsilon(hi, count, delta) > target:
        hi *= 1.5
    lo = hi / 1.5
    while lo > 1e-3 and epsilon(lo, count, delta) <= target:
        lo, hi = lo / 1.5, lo
    while hi - lo > MU_TOLERANCE * hi:
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if epsilon(mid, count, delta) <= target else (mid, hi)
    return hi
