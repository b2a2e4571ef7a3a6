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
as infinite loss.

A real-valued histogram (POPri's similarity scores) is masked too (``Rounded``): each record's
vector, clipped to its L2 sensitivity s, is multiplied by the public ``SCALE`` and rounded at
random to integers (``round_rows``), so the sum is an integer vector again and the server divides
it by ``SCALE``. The rounding may lengthen a record's vector; a rounded vector longer than the
public ``rounded_norm`` is replaced by the scaled vector rounded towards zero (never longer than
SCALE s), in the same work for every row, so that one record moves the sum by at most that norm in
L2, always (and, being integers, by at most its square in L1). Such a shift is not one
coordinate's, so its privacy is bounded by the Renyi DP of the Skellam mechanism (Agarwal, Kairouz &
Liu 2021, Theorem 3.5; ``rdp``), a proven upper bound, converted to (epsilon, delta) by
``dp_accounting`` (``rdp_epsilon``). Not the conditional rounding of the paper (round again until the
norm fits): the number of tries would depend on the records, and their time with it.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from common.secagg.ring import poisson_tail

VALUE_DISCRETIZATION = 1e-3  # the project's PLD discretisation (common.dp.pld_accountant's)
MU_TOLERANCE = 1e-4  # a solved mu is within this relative width of the least that fits
# A real-valued vector is multiplied by SCALE before rounding: rounding then lengthens a record's
# vector (norm SCALE s) by about sqrt(d / 4) of d values, 0.7 % at 2,400 candidates, and the ring
# still holds 2^31 records x SCALE x 1,000 sites (``common.secagg.ring.MAX_BITS``)
SCALE = 2 ** 12
ROUNDING_FAILURE = 2.0 ** -20  # how rarely a row's rounding falls back to rounding towards zero
# integer Renyi orders (Theorem 3.5 holds for integer alpha > 1): fine where the optimum lies at
# fedsyn's epsilons, sparse beyond
ORDERS = tuple(range(2, 65)) + tuple(range(72, 257, 8)) + (320, 384, 512, 768, 1024)


@dataclass(frozen=True)
class Rounded:
    """A real-valued release, scaled and rounded (``round_rows``): one record moves the integer
    vector by at most ``norm`` in L2 (and norm^2 in L1). Its Renyi DP bound is converted to
    (epsilon, delta) at ``delta``, the part of the node's delta the release sets aside for it."""

    norm: float
    delta: float


# what one record moves in a masked release: a count histogram's moved coordinates, or a rounded one
Shift = int | Rounded


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


def epsilon(mu: float, shift: Shift, delta: float) -> float:
    """Epsilon at ``delta`` of one Skellam(``mu``) release: on a count histogram of ``shift`` moved
    coordinates (its PLD), or a ``Rounded`` one (its Renyi bound); inf for mu = 0."""
    if mu <= 0:
        return math.inf
    if isinstance(shift, Rounded):
        return rdp_epsilon(((float(mu), shift.norm),), delta)
    return float(pld(float(mu), int(shift)).get_epsilon_for_delta(delta))


def solve_mu(target: float, shift: Shift, delta: float) -> float:
    """The least mu (within ``MU_TOLERANCE``, on the side that fits) such that one Skellam
    release of ``shift`` (``epsilon``) costs at most ``target`` at ``delta``; inf for a target of 0."""
    from common.dp import analytic_gaussian_sigma

    if not target > 0:
        return math.inf
    if math.isinf(target):
        return 0.0
    # near the answer: a Gaussian of the same variance (2 mu = sigma^2) at the same sensitivity
    l2 = shift.norm if isinstance(shift, Rounded) else math.sqrt(shift)
    hi = max(analytic_gaussian_sigma(target, delta, l2) ** 2 / 2, 1e-3)
    while epsilon(hi, shift, delta) > target:
        hi *= 1.5
    lo = hi / 1.5
    while lo > 1e-3 and epsilon(lo, shift, delta) <= target:
        lo, hi = lo / 1.5, lo
    while hi - lo > MU_TOLERANCE * hi:
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if epsilon(mid, shift, delta) <= target else (mid, hi)
    return hi


# ----------------------------------------------------------------- real values, scaled and rounded
def rdp(mu: float, norm: float) -> tuple[float, ...]:
    """The Renyi DP at each of ``ORDERS`` of Skellam(``mu``) noise (variance v = 2 mu per value) on
    an integer vector one record moves by at most ``norm`` in L2 and ``norm``^2 in L1 (Agarwal,
    Kairouz & Liu 2021, Theorem 3.5, for integer alpha > 1):
    eps(alpha) <= alpha D2^2 / (2 v) + min(((2 alpha - 1) D2^2 + 6 D1) / (4 v^2), 3 D1 / (2 v))."""
    if not mu > 0:
        return (math.inf,) * len(ORDERS)
    v, d2, d1 = 2.0 * float(mu), float(norm) ** 2, float(norm) ** 2
    return tuple(a * d2 / (2 * v) + min(((2 * a - 1) * d2 + 6 * d1) / (4 * v * v), 3 * d1 / (2 * v)) for a in ORDERS)


def rdp_epsilon(releases: Iterable[tuple[float, float]], delta: float) -> float:
    """Epsilon at ``delta`` of the composition of Skellam ``releases`` [(mu, norm), ...] on rounded
    vectors: their Renyi DP adds up (``rdp``), and ``dp_accounting`` converts it (Balle et al. 2020's
    bound); inf for no delta or a release without noise."""
    from dp_accounting.rdp.rdp_privacy_accountant import compute_epsilon

    total = np.zeros(len(ORDERS))
    for mu, norm in releases:
        total += np.asarray(rdp(mu, norm))
    if not delta > 0 or not np.all(np.isfinite(total)):
        return math.inf
    return float(compute_epsilon(ORDERS, total.tolist(), float(delta))[0])


def rounded_norm(norm: float, length: int, failure: float = ROUNDING_FAILURE) -> float:
    """The L2 bound of a vector of ``length`` values and L2 ``norm`` (already scaled) once rounded at
    random: its squared norm grows by at most length / 4 in expectation, and beyond
    sqrt(2 ln(1/failure)) (norm + sqrt(length) / 2) with probability below ``failure`` (the bound Agarwal et
    al. 2021's conditional rounding keeps); never more than norm + sqrt(length)."""
    norm, length = float(norm), max(1, int(length))
    expected = norm ** 2 + length / 4 + math.sqrt(2 * math.log(1 / failure)) * (norm + math.sqrt(length) / 2)
    return math.sqrt(min(expected, (norm + math.sqrt(length)) ** 2))


def record_norm(sensitivity: float, length: int) -> float:
    """The public L2 bound of one record's scaled and rounded vector of ``length`` values and L2
    ``sensitivity``: ``rounded_norm`` of ``SCALE`` x sensitivity. The node rounds within it and the
    server sizes its ring by it, so both read it here."""
    return rounded_norm(SCALE * float(sensitivity), length)


def round_rows(rows: np.ndarray, sensitivity: float, norm: float, rng: np.random.Generator,
               scale: float = SCALE) -> np.ndarray:
    """``rows`` (records x values, each clipped here to L2 ``sensitivity``) times ``scale``, each
    value rounded down or up at random with the probabilities that keep it unbiased (int64). A row
    whose rounding is longer than ``norm`` in L2 (``rounded_norm``: rarely) is the scaled row rounded
    towards zero instead, which is never longer than scale x sensitivity: so every row's squared
    norm is at most ``norm``^2, whatever the rows. Every row takes the same work (filler rows too:
    a zero row rounds to zeros)."""
    x = np.nan_to_num(np.asarray(rows, dtype=np.float64), nan=0.0, posinf=0.0, neginf=0.0)
    lengths = np.linalg.norm(x, axis=1, keepdims=True)
    z = x * (float(scale) * np.minimum(1.0, float(sensitivity) / np.maximum(lengths, 1e-300)))
    low = np.floor(z)
    up = np.asarray(rng.random(z.shape) < (z - low), dtype=np.float64)
    rounded = (low + up).astype(np.int64)
    fits = np.einsum("ij,ij->i", rounded, rounded) <= math.floor(float(norm) ** 2)
    return np.where(fits[:, None], rounded, np.trunc(z).astype(np.int64))
