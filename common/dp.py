"""Differential-privacy mechanisms shared by server and nodes: one home for the maths.

- ``analytic_gaussian_sigma``: the analytic Gaussian mechanism (Balle & Wang 2018).
- ``gaussian_release``: add that noise to a vector (used for profiles and votes).
- ``dpsgd_noise_multiplier``: calibrate DP-SGD's noise once for the whole of phase 1.
- ``split_budget`` / ``phase_epsilon``: the paper's appendix-B split of a node's epsilon.
- ``pld_epsilon``: compose releases with a PLD accountant (tighter than basic
  composition, which is what the paper reports); ``composed_epsilon`` over statements.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

STRONG = "strong"
WEAK = "weak"
TIERS = (STRONG, WEAK)
# The phases that release something; each is one constant, used by nodes, server and ledger.
TRAIN, PROFILE, VOTE = "train", "profile", "vote"
# A table run by federated marginals (issue 48): every site's epsilon goes to its noisy marginals,
# or a share of it when the table has a free-text column (its text phases take the rest).
MARGINALS = "marginals"
PHASES = (TRAIN, PROFILE, VOTE, MARGINALS)
GAUSSIAN, DPSGD = "gaussian", "dp-sgd"
SKELLAM = "skellam"  # integer noise, each site its share, under secure aggregation (common.skellam)
SKELLAM_ROUNDED = "skellam-rounded"  # the same on a real-valued vector scaled and rounded: a ledger term kind


# RDP orders for DP-SGD's accountant: Opacus' defaults (1.1-63) reach from both ends. At a small
# sampling rate with many steps, or a large epsilon, the best order lies outside them; Opacus
# then warns "optimal order is the largest alpha" and reports a looser epsilon than it could.
RDP_ORDERS = ([1 + x / 100.0 for x in range(1, 10)] + [1 + x / 10.0 for x in range(1, 100)] + list(range(12, 64))
              + list(range(64, 256, 8)) + [2 ** k for k in range(8, 13)])


def analytic_gaussian_sigma(epsilon: float, delta: float, sensitivity: float) -> float:
    """Noise std of the analytic Gaussian mechanism for an L2 ``sensitivity``.

    Input: target (epsilon, delta) with epsilon > 0 (``inf`` gives 0: no noise) and
    0 < delta < 1; the L2 sensitivity of the released vector. Output: sigma such that
    adding N(0, sigma^2 I) is (epsilon, delta)-DP (Balle & Wang 2018, Theorem 8),
    i.e. sensitivity times the exact sigma for sensitivity 1 from ``dp_accounting``.
    """
    from dp_accounting.gaussian_mechanism import get_sigma_gaussian

    if sensitivity < 0:
        raise ValueError(f"sensitivity must be >= 0, got {sensitivity}")
    if math.isinf(epsilon):
        return 0.0
    if not epsilon > 0:
        raise ValueError(f"epsilon must be > 0 (or inf for no DP), got {epsilon}")
    if not 0 < delta < 1:
        raise ValueError(f"delta must be in (0, 1), got {delta}")
    return float(sensitivity * get_sigma_gaussian(epsilon, delta))


def gaussian_release(values: Sequence[float] | np.ndarray, sigma: float, rng: np.random.Generator) -> np.ndarray:
    """Return ``values + N(0, sigma^2 I)`` as float64 (sigma 0 returns a copy unchanged)."""
    arr = np.asarray(values, dtype=np.float64)
    if sigma == 0:
        return arr.copy()
    return arr + rng.normal(0.0, sigma, size=arr.shape)


def poisson_sample_rate(batch_size: int, num_records: int) -> float:
    """DP-SGD's Poisson rate q = min(1, B / |D|), and 1 for an empty dataset (every step is then
    noise only). A node takes it once, at its phase's first round (``fedsyn_client.train_release``)."""
    return min(1.0, batch_size / num_records) if num_records else 1.0


def dpsgd_noise_multiplier(epsilon: float, delta: float, sample_rate: float, steps: int) -> float:
    """Noise multiplier for ``steps`` Poisson-subsampled DP-SGD steps at ``sample_rate``.

    Calibrated once for the whole of phase 1 (R rounds x tau local steps) with Opacus's
    RDP accountant so that the node's epsilon_train is met over all rounds, not per round.
    ``epsilon = inf`` returns 0.0 (no noise).
    """
    if math.isinf(epsilon):
        return 0.0
    if steps < 1 or not 0 < sample_rate <= 1:
        # Opacus' search never ends for 0 steps (any noise meets the target): refuse instead.
        raise ValueError(f"DP-SGD needs steps >= 1 and 0 < sample_rate <= 1, got {steps}, {sample_rate}")
    from opacus.accountants.utils import get_noise_multiplier

    return float(
        get_noise_multiplier(
            target_epsilon=epsilon, target_delta=delta, sample_rate=sample_rate,
            steps=steps, accountant="rdp", epsilon_tolerance=0.005, alphas=RDP_ORDERS,
        )
    )


@dataclass(frozen=True)
class BudgetSplit:
    """A node's total epsilon split by phase (paper appendix B)."""

    total: float
    profile: float
    main: float  # epsilon_train for strong nodes, epsilon_vote for weak nodes


def split_budget(epsilon: float, epsilon_profile: float) -> BudgetSplit:
    """Split a node's total ``epsilon`` into (profile, train-or-vote).

    Strong: eps = eps_train + eps_prof; weak: eps = eps_vote + eps_prof (same eps_prof,
    appendix B). ``epsilon = inf`` gives inf for both parts.
    """
    if math.isinf(epsilon):
        return BudgetSplit(math.inf, math.inf, math.inf)
    if not 0 < epsilon_profile < epsilon:
        raise ValueError(f"epsilon-profile must be in (0, epsilon={epsilon}), got {epsilon_profile}")
    return BudgetSplit(epsilon, epsilon_profile, epsilon - epsilon_profile)


def phase_epsilon(epsilon: float, epsilon_profile: float, tier: str, voters: str, phase: str,
                  marginals: float = 0.0) -> float:
    """A node's epsilon for ``phase`` in one run (appendix B).

    Strong = train + profile, weak = vote + profile. When strong nodes also vote
    (``voters = "all"``) their non-profile share is split evenly between training and
    voting, so every node's total stays ``epsilon``. A phase the tier does not take part
    in gets 0. ``epsilon = inf`` gives inf for every phase it takes part in.

    ``marginals`` is the share of ``epsilon`` a table run by federated marginals (issue 48) gives
    every tier's marginals phase: 1 for a table without free text (nothing for the other phases), a
    share in (0, 1) for one with a free-text column, whose text phases split the rest as above but
    without a profile (the sampled rows allocate the texts, free); 0 for every other run.
    """
    if phase not in PHASES:
        raise ValueError(f"unknown phase {phase!r}; one of {PHASES}")
    if not 0.0 <= marginals <= 1.0:
        raise ValueError(f"marginals share must be in [0, 1], got {marginals}")
    if phase == MARGINALS:
        return epsilon * marginals if marginals else 0.0  # (inf * 0 would be nan)
    if marginals == 1.0:
        return 0.0
    if marginals:  # the text's phases share the rest, with no profile
        profile, main = 0.0, epsilon * (1.0 - marginals)
    else:
        split = split_budget(epsilon, epsilon_profile)
        profile, main = split.profile, split.main
    if phase == PROFILE:
        return profile
    if tier == STRONG:
        if phase == TRAIN:
            return main / 2 if voters == "all" else main
        return main / 2 if voters == "all" else 0.0
    return main if phase == VOTE else 0.0


def preflight(needed: float, spent_this_run: float, remaining: float) -> float:
    """The epsilon a node lacks to finish a run (0 when it can).

    ``needed`` is what the run asks of the node over all its phases, ``spent_this_run``
    what the node's ledger already holds for this run (those releases are paid for), and
    ``remaining`` what the ledger has left. Any of them may be inf: an unlimited budget
    lacks nothing; a non-private run on a finite budget lacks everything.
    """
    if math.isinf(remaining):
        return 0.0
    still = max(needed - spent_this_run, 0.0)
    return math.inf if math.isinf(still) else max(still - remaining, 0.0)


def paper_delta(num_records: int) -> float:
    """The paper's per-phase delta 1 / (2 N log N) for N records (appendix B).

    N is a count of records, so only a *public* N may be used here (in simulation: the
    benchmark's training split, public there); a node's own count is private.
    """
    n = max(num_records, 2)
    return 1.0 / (2 * n * math.log(n))


def gaussian_event(sigma: float, sensitivity: float):
    """The ``dp_accounting`` event of adding N(0, sigma^2) to a vector of L2 ``sensitivity``."""
    from dp_accounting import dp_event

    return dp_event.GaussianDpEvent(sigma / sensitivity)


def dpsgd_event(noise_multiplier: float, sample_rate: float, steps: int):
    """The ``dp_accounting`` event of ``steps`` Poisson-subsampled Gaussian DP-SGD steps."""
    from dp_accounting import dp_event

    step = dp_event.PoissonSampledDpEvent(sample_rate, dp_event.GaussianDpEvent(noise_multiplier))
    return dp_event.SelfComposedDpEvent(step, int(steps))


def pld_epsilon(events: Sequence[Any], delta: float) -> float:
    """Epsilon of the composed ``dp_accounting`` ``events`` by a PLD accountant at ``delta``.

    Tighter than basic composition (the sum of per-release epsilons, what the paper uses).
    No events cost 0.
    """
    if not events:
        return 0.0
    return float(pld_accountant(events).get_epsilon(delta))


def pld_accountant(events: Sequence[Any], start: Any = None):
    """A ``dp_accounting`` PLD accountant (the project's discretisation) with ``events`` composed, in
    order, onto a copy of ``start`` (another such accountant; default: none composed yet). Copying
    a composed prefix is how a noise search prices many last events after the same earlier ones
    without recomputing them (a DP-SGD phase's PLD takes about a second)."""
    import copy

    from dp_accounting.pld import pld_privacy_accountant

    accountant = (copy.deepcopy(start) if start is not None
                  else pld_privacy_accountant.PLDAccountant(value_discretization_interval=1e-3))
    for event in events:
        accountant.compose(event)
    return accountant


def composed_epsilon(releases: Sequence[dict[str, Any]], delta: float | None = None) -> float:
    """Epsilon of ``releases`` together: the one composition of the node's ledger summary and the
    run's privacy report.

    Each release is a dict with ``mechanism``, ``epsilon`` and ``delta``, and the details a PLD
    needs where they are known: ``sigma`` and ``sensitivity`` (Gaussian), or
    ``noise_multiplier``, ``sample_rate`` and ``steps`` (DP-SGD: only the node's own ledger
    has them, since the sampling rate reveals |D|). Those are composed by a PLD accountant; the
    rest are added by basic composition, their deltas with them. ``delta`` None: the PLD is read at
    the sum of the composed releases' deltas (each release's statement a bound on its own, as
    under ``basic``); else at ``delta`` (a ``pld`` node's policy delta) less the rest's deltas, inf
    when nothing is left of it. Never more than the sum of the stated epsilons (a ``pld`` node's
    charges add up to its own composition at its delta).
    """
    if any(not math.isfinite(float(r["epsilon"])) for r in releases):
        return math.inf
    events, pld_delta, rest, rest_delta = [], 0.0, 0.0, 0.0
    for r in releases:
        if r["mechanism"] == GAUSSIAN and r.get("sigma"):
            events.append(gaussian_event(r["sigma"], r["sensitivity"]))
        elif r["mechanism"] == DPSGD and r.get("noise_multiplier"):
            events.append(dpsgd_event(r["noise_multiplier"], r["sample_rate"], r["steps"]))
        else:
            rest, rest_delta = rest + float(r["epsilon"]), rest_delta + float(r["delta"])
            continue
        pld_delta += float(r["delta"])
    basic = float(sum(float(r["epsilon"]) for r in releases))
    if delta is None:
        return min(basic, (pld_epsilon(events, pld_delta) if events else 0.0) + rest)
    left = float(delta) - rest_delta
    if not events:
        return min(basic, rest if left >= 0 else math.inf)
    return min(basic, pld_epsilon(events, left) + rest if left > 0 else math.inf)


def dpsgd_epsilon(history: Sequence[Sequence[float]], delta: float) -> float:
    """Epsilon of a DP-SGD accountant history ``[(noise_multiplier, sample_rate, steps), ...]``.

    Uses Opacus's RDP accountant, the same one that calibrated the noise, so the node
    can check a round's cost against its ledger *before* training.
    """
    if not history:
        return 0.0
    if any(float(h[0]) == 0 for h in history):
        return math.inf
    return float(rdp_accountant(history).get_epsilon(delta, alphas=RDP_ORDERS))


def rdp_accountant(history: Sequence[Sequence[float]]):
    """An Opacus ``RDPAccountant`` restored, through its public ``load_state_dict``, to ``history``."""
    from opacus.accountants import RDPAccountant

    acc = RDPAccountant()
    if history:
        acc.load_state_dict({"history": [(float(nm), float(q), int(s)) for nm, q, s in history],
                             "mechanism": acc.mechanism()})
    return acc


# --- zCDP (the marginal methods account in rho) ----------------------------------------------------

def cdp_delta(rho: float, epsilon: float) -> float:
    """The delta such that rho-zCDP implies (epsilon, delta)-DP: in rho >= 0 and epsilon >= 0, out
    delta in [0, 1] (Canonne, Kamath, Steinke 2020, Proposition 7; the alpha of its bound found by
    bisection on the derivative)."""
    if rho < 0 or epsilon < 0:
        raise ValueError("rho and epsilon must be >= 0")
    if rho == 0:
        return 0.0
    # Any alpha > 1 gives a valid bound, so a search that stops early only costs tightness;
    # alpha >= 1.01 keeps the log1p terms away from their singularity.
    lo, hi = 1.01, (epsilon + 1) / (2 * rho) + 2
    for _ in range(1000):
        alpha = (lo + hi) / 2
        if (2 * alpha - 1) * rho - epsilon + math.log1p(-1.0 / alpha) < 0:
            lo = alpha
        else:
            hi = alpha
    delta = math.exp((alpha - 1) * (alpha * rho - epsilon) + alpha * math.log1p(-1 / alpha)) / (alpha - 1.0)
    return min(delta, 1.0)


def cdp_rho(epsilon: float, delta: float) -> float:
    """The largest zCDP rho that still implies (epsilon, delta)-DP: in epsilon >= 0 and delta in
    (0, 1], out rho >= 0. The same bisection as private-pgm's ``cdp2adp.cdp_rho``."""
    if epsilon < 0 or not delta > 0:
        raise ValueError("epsilon must be >= 0 and delta > 0")
    if delta >= 1:
        return 0.0
    # Invariant: cdp_delta(lo) <= delta < cdp_delta(hi); the answer is the lower end (valid).
    lo, hi = 0.0, epsilon + 1
    for _ in range(1000):
        rho = (lo + hi) / 2
        if cdp_delta(rho, epsilon) <= delta:
            lo = rho
        else:
            hi = rho
    return lo
