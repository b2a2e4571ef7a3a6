"""Noise for a node's planned releases, by the rule its ledger composes them with (issues 47, 60).

A node's budget is (epsilon, delta): its policy's. A run releases, in the plan's order, its
profile (one Gaussian, sensitivity 1), its DP-SGD phase (Poisson-subsampled Gaussian steps)
and/or its vote rounds (T Gaussians of one sigma), each phase with its appendix-B share of the
node's epsilon. Two rules:

- ``basic`` (the paper's): each phase meets its share on its own, a Gaussian round by the
  analytic Gaussian mechanism at (share / T, delta / T), DP-SGD by Opacus' RDP accountant; the
  node adds epsilons *and* deltas, and budgets both: a release's delta is its declared split of
  the policy's delta (``basic_delta``: the policy's delta times the release's part of the
  node's epsilon, or less if the request asks less), so the deltas of a spent budget sum to at
  most the policy's.
- ``pld``: every release of the node, across every run in its ledger, is composed by a
  privacy-loss distribution at the policy's delta, never at a delta that grows with the
  releases (``ledger_epsilon``). A phase's noise is solved so that the composition of
  everything the ledger holds and the whole phase stays within the composition before it plus
  the phase's share; a release is charged the growth of that composition (``pld_charge``), so a
  ledger's charges add up to its composition at the policy's delta, and admission checks the
  composition itself.

Gaussian releases compose exactly into one Gaussian (their noise multipliers' inverse squares
add), so the composition is one Gaussian and one event per DP-SGD phase, however long the ledger.
A release whose terms the ledger cannot read (a legacy entry, a DP-SGD phase none of whose rounds
has its noise multiplier) is counted by its statement, (epsilon, delta), by basic composition
with the rest: its delta is taken from the policy's before the PLD is read.

Everything here reads public inputs only (shares, delta, sensitivities, T, steps, and DP-SGD's
q = B / max-records with the noise multiplier solved from it): never a record count. A deployed
node's q is its public bound's (``max-records`` is required and the server may learn it); a
simulated node's is its partition's, which the server chose. So a vote after DP-SGD may compose
with it, and its stated sigma, a function of q, says nothing the server could not know. The solver
searches the noise because the
composed epsilon falls as the noise grows and ``dp_accounting`` has no inverse for a composition
of several mechanisms (Brent's method from scipy on a bracket, kept on the side that fits).
"""

from __future__ import annotations

import copy
import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from common.dp import (
    DPSGD,
    GAUSSIAN,
    SKELLAM,
    SKELLAM_ROUNDED,
    analytic_gaussian_sigma,
    dpsgd_event,
    dpsgd_noise_multiplier,
    pld_accountant,
)
from common.skellam import Rounded, Shift, rdp_epsilon

# The search stops when the noise is known to this relative width; it keeps the side whose
# composition is within the target, so a node never spends more than its share.
NOISE_TOLERANCE = 1e-4
# A release the ledger counts by its statement (see ``release_base``).
OPAQUE = "opaque"


@dataclass(frozen=True)
class Planned:
    """One phase a node plans to release in a run, on public inputs only.

    ``share``: the phase's epsilon (appendix B); ``delta``: the phase's delta under ``basic``
    (all its rounds together; under ``pld`` every phase is composed at the policy's delta
    instead). A Gaussian phase is ``rounds`` releases of one sigma at L2 ``sensitivity``; a
    DP-SGD phase is ``steps`` steps at Poisson rate ``sample_rate``.
    """

    phase: str
    mechanism: str
    share: float
    delta: float
    sensitivity: float = 1.0
    rounds: int = 1
    sample_rate: float = 0.0
    steps: int = 0

    @property
    def q_unknown(self) -> bool:
        """A DP-SGD phase whose sampling rate the planner does not know (0: a deployment's plan,
        where q is B / the node's max-records): no noise can be solved for it here."""
        return self.mechanism == DPSGD and not self.sample_rate

    def terms(self, noise: float) -> Base:
        """This phase at ``noise`` (Gaussian: each round's sigma; DP-SGD: the noise multiplier) as
        ``Base`` terms, the form a ledger's releases take."""
        if self.mechanism == DPSGD:
            return ((DPSGD, float(noise), float(self.sample_rate), int(self.steps), float(self.delta)),)
        return ((float(noise), float(self.sensitivity), float(self.delta) / self.rounds),) * self.rounds

    def basic_noise(self) -> float:
        """The noise that meets ``share`` at ``delta`` on its own (the ``basic`` rule)."""
        if self.mechanism == DPSGD:
            return dpsgd_noise_multiplier(self.share, self.delta, self.sample_rate, self.steps)
        return analytic_gaussian_sigma(self.share / self.rounds, self.delta / self.rounds, self.sensitivity)


# ----------------------------------------------------------------- what a ledger composes
# A node's releases, oldest first, as the PLD sees them: a Gaussian release as (sigma,
# sensitivity, delta), from its statement; a DP-SGD phase as ("dp-sgd", noise multiplier, q, all
# R x tau steps, delta): the whole phase, as its first round reserved it, whatever number of
# rounds ran; a release whose terms are unknown as ("opaque", epsilon, delta), its statement.
# A Skellam release under secure aggregation (issue 73) as ("skellam", mu, coordinates, delta): the
# noise the sum carries under the site's trust, on a count histogram of that many moved coordinates;
# on a real-valued vector scaled and rounded, as ("skellam-rounded", mu, norm, delta): these compose
# with one another by their Renyi DP, converted at their summed delta, and with the rest by basic
# composition, that delta taken from the policy's like an opaque release's (``_parts``).
# The deltas of the first three kinds are what the requests asked (informational: the PLD is read
# at the policy's delta); an opaque release's delta is spent. A DP-SGD state stored before issue 60
# holds Gaussian and DP-SGD terms only, which still read.
Base = tuple[tuple[Any, ...], ...]


@dataclass(frozen=True)
class _Parts:
    """A ``Base`` reduced to what its composition needs: the Gaussians' summed squared inverse
    noise multipliers (they compose exactly into one Gaussian), the DP-SGD phases (noise
    multiplier, q, steps), and the opaque releases' summed epsilon and delta."""

    mu2: float = 0.0
    dpsgd: tuple[tuple[float, float, int], ...] = ()
    epsilon: float = 0.0
    delta: float = 0.0
    skellam: tuple[tuple[float, int], ...] = ()  # (mu, coordinates) of each Skellam release


def _parts(base: Base) -> _Parts:
    mu2, dpsgd, eps, delta, sk = 0.0, [], 0.0, 0.0, []
    rounded, rounded_delta = [], 0.0
    for b in base:
        if b[0] == DPSGD:
            dpsgd.append((float(b[1]), float(b[2]), int(b[3])))
        elif b[0] == SKELLAM:
            sk.append((float(b[1]), int(b[2])))
        elif b[0] == SKELLAM_ROUNDED:
            rounded.append((float(b[1]), float(b[2])))
            rounded_delta += float(b[3])
        elif b[0] == OPAQUE:
            eps, delta = eps + float(b[1]), delta + float(b[2])
        else:
            mu2 += (float(b[1]) / float(b[0])) ** 2
    if rounded:  # one (epsilon, delta) for all of them: their Renyi DP composes before it is converted
        eps, delta = eps + rdp_epsilon(sorted(rounded), rounded_delta), delta + rounded_delta
    return _Parts(mu2, tuple(dpsgd), eps, delta, tuple(sorted(sk)))


def _gaussian(mu2: float) -> Any:
    from dp_accounting import dp_event

    return dp_event.GaussianDpEvent(1.0 / math.sqrt(mu2))


@functools.lru_cache(maxsize=64)
def _prefix(mu2: float, dpsgd: tuple[tuple[float, float, int], ...]) -> Any:
    """A PLD accountant with the Gaussian (``mu2``: its squared inverse multiplier; 0: none) and
    the DP-SGD phases composed, for a noise search to copy (a DP-SGD phase takes about a second)."""
    return pld_accountant(([_gaussian(mu2)] if mu2 > 0 else []) + [dpsgd_event(*d) for d in dpsgd])


def _compose(parts: _Parts, delta: float) -> float:
    """Epsilon of ``parts`` at ``delta``: the PLD of the composable releases at what the opaque
    ones leave of ``delta``, plus the opaque epsilons (basic composition of the two); inf when
    nothing is left of ``delta``."""
    if parts.mu2 == 0 and not parts.dpsgd and not parts.skellam:
        return parts.epsilon if parts.delta <= delta else math.inf
    left = delta - parts.delta
    if not left > 0:
        return math.inf
    if any(mu <= 0 for mu, _ in parts.skellam):  # no noise: no bound
        return math.inf
    acc = _prefix(0.0, parts.dpsgd)  # the DP-SGD phases composed once; the Gaussian onto a copy
    if parts.mu2 > 0:
        acc = copy.deepcopy(acc)
        acc.compose(_gaussian(parts.mu2))
    if not parts.skellam:
        return float(acc.get_epsilon(left)) + parts.epsilon
    return float(_with_skellam(acc, parts.skellam).get_epsilon_for_delta(left)) + parts.epsilon


def _with_skellam(acc: Any, releases: tuple[tuple[float, int], ...]) -> Any:
    """The privacy-loss distribution of ``acc`` (a PLD accountant) composed with the Skellam
    ``releases``. ``dp_accounting`` has no event for the Skellam mechanism, so its PLD is built from
    the two probability mass functions (``common.skellam.pld``) and composed onto the accountant's
    own distribution, which the library keeps as ``_pld`` (0.4-0.6): there is no public way to
    compose a PLD of one's own with an accountant's."""
    from collections import Counter

    from common import skellam

    pld = acc._pld  # noqa: SLF001 - see the docstring
    for (mu, count), times in sorted(Counter(releases).items()):
        one = skellam.pld(mu, count)
        pld = pld.compose(one if times == 1 else one.self_compose(times))
    return pld


def composition_delta(base: Base, delta: float) -> float:
    """The delta a composition of ``base`` is read at: ``delta``, the policy's, however many
    releases asked for their own (issue 60: the sum of their deltas grows with the releases, and a
    node's budget is one (epsilon, delta)). One home for the rule: ``tests/test_delta_budget.py``
    plants the summed one here and sees its harness catch it."""
    return delta


def clear_caches() -> None:
    """Forget every memoised composition and noise (a test that plants another rule)."""
    for cached in (base_epsilon, pld_noise, pld_charge, calibrate_pld, _prefix, pld_skellam_mu):
        cached.cache_clear()


@functools.lru_cache(maxsize=512)
def base_epsilon(base: Base, delta: float) -> float:
    """Epsilon of ``base`` composed at ``delta`` (the policy's; 0 for no release)."""
    return _compose(_parts(base), composition_delta(base, delta))


def composed(planned: Sequence[Planned], noises: Sequence[float], delta: float) -> float:
    """Epsilon of ``planned`` at ``noises`` composed by PLD at ``delta`` (the policy's)."""
    return base_epsilon(tuple(t for p, n in zip(planned, noises) for t in p.terms(n)), delta)


def solve_noise(base: Base, phase: Planned, target: float, delta: float) -> float:
    """The least noise (within ``NOISE_TOLERANCE``) for ``phase`` such that ``base`` and the whole
    phase compose at ``delta`` to at most ``target`` epsilon; inf if even an unbounded noise
    cannot (``base`` alone exceeds it)."""
    parts = _parts(base)
    left, room = composition_delta(base + phase.terms(1.0), delta) - parts.delta, target - parts.epsilon
    if not left > 0 or room < 0:
        return math.inf
    if phase.mechanism == DPSGD:
        prefix = _prefix(parts.mu2, parts.dpsgd)

        def event(noise: float) -> Any:
            return dpsgd_event(noise, phase.sample_rate, phase.steps)
    else:
        # the phase's T rounds join the earlier Gaussians in one Gaussian; DP-SGD composed once
        prefix = _prefix(0.0, parts.dpsgd)

        def event(noise: float) -> Any:
            return _gaussian(parts.mu2 + phase.rounds * (phase.sensitivity / noise) ** 2)

    def excess(noise: float) -> float:  # the composition's epsilon over the target (<= 0 fits)
        acc = copy.deepcopy(prefix)
        acc.compose(event(noise))
        if parts.skellam:  # masked releases before it (issue 73) compose as their own PLDs
            return float(_with_skellam(acc, parts.skellam).get_epsilon_for_delta(left)) - room
        return float(acc.get_epsilon(left)) - room

    def fits(noise: float) -> bool:
        return excess(noise) <= 0

    # a Gaussian phase starts from the noise that meets its own share (near the answer, and
    # instant); DP-SGD from 1, since Opacus' RDP calibration takes seconds where a PLD takes 0.3
    hi = (analytic_gaussian_sigma(phase.share / phase.rounds, delta / phase.rounds, phase.sensitivity)
          if phase.mechanism != DPSGD and math.isfinite(phase.share) and phase.share > 0 else 1.0)
    if not fits(hi):
        lo = hi
        while not fits(hi):
            lo, hi = hi, hi * 2
            if hi > 1e6:
                return math.inf
    else:
        lo = hi / 2
        while fits(lo):
            lo, hi = lo / 2, lo
            if lo < 1e-6:
                return lo
    # Brent's method on the bracket (a few PLD evaluations where bisection takes ~14: a DP-SGD
    # phase's PLD takes about a second on a CPU), then a step up until the answer fits
    from scipy.optimize import brentq

    width = NOISE_TOLERANCE * hi
    noise = brentq(excess, lo, hi, xtol=width)
    while not fits(noise):
        noise = min(noise + width, hi)
    return noise


def calibrate_basic(planned: Sequence[Planned]) -> tuple[float, ...]:
    """Each planned phase's noise under ``basic``: each meets its share at its delta on its own
    (``Planned.basic_noise``); a DP-SGD phase of unknown q gets NaN. Infinite shares: see
    ``common.accounting.calibrate``."""
    return tuple(math.nan if p.q_unknown else p.basic_noise() for p in planned)


@functools.lru_cache(maxsize=64)  # a node solves the same plan at every release of a run
def calibrate_pld(planned: tuple[Planned, ...], delta: float) -> tuple[float, ...]:
    """Each planned phase's noise under ``pld``, as the nodes solve it (``fedsyn_client.release``):
    each phase on every release before it, composed at ``delta`` (the policy's). A DP-SGD phase of
    unknown q gets NaN, and the phases after it are priced without it and those before: an upper
    bound on the noise the node solves with its q."""
    noises: list[float] = []
    base: Base = ()
    for phase in planned:
        if phase.q_unknown:
            noises.append(math.nan)
            base = ()
            continue
        noise = pld_noise(base, phase, delta)
        noises.append(noise)
        base = base + phase.terms(noise)
    return tuple(noises)


# ----------------------------------------------------------------- a node's ledger under ``pld``
def release_base(entries: Sequence[dict[str, Any]]) -> Base:
    """The terms of counted ledger ``entries`` (oldest first, any number of runs) as a ``Base``.

    A Gaussian release with a sigma composes by it; a DP-SGD phase (one per run and phase) by its
    noise multiplier and q (stored at its reservation, or by a confirmed round) over all the R x
    tau steps its first reservation bound. What has no such terms is opaque, counted by its
    statement: a legacy entry; a DP-SGD phase without a noise multiplier at (epsilon, delta) if a
    round of it was released, at (epsilon, 0) if none was (nothing of it left the node: the charge
    stays, a margin against a failure that were free); a release without DP at epsilon inf.
    """
    base: list[tuple[Any, ...]] = []
    done: set[tuple[str, str]] = set()
    for e in entries:
        if e.get("mechanism") == DPSGD:
            key = (str(e.get("run_id", "")), str(e["phase"]))
            if key not in done:
                done.add(key)
                base.append(_dpsgd_terms([x for x in entries if x.get("mechanism") == DPSGD
                                          and (str(x.get("run_id", "")), str(x["phase"])) == key]))
            continue
        epsilon = float(e["epsilon"])
        public = e.get("public", {})
        if e.get("mechanism") == SKELLAM and math.isfinite(epsilon) and float(public.get("mu", 0.0) or 0.0) > 0:
            if "norm" in public:  # a real-valued vector, scaled and rounded
                base.append((SKELLAM_ROUNDED, float(public["mu"]), float(public["norm"]), float(public["rdp_delta"])))
            else:
                base.append((SKELLAM, float(public["mu"]), int(public["coordinates"]), float(e["delta"])))
            continue
        sigma = float(public.get("sigma", e.get("sigma", 0.0)) or 0.0)
        if not math.isfinite(epsilon):
            base.append((OPAQUE, math.inf, 0.0))
        elif e.get("mechanism") == GAUSSIAN and sigma > 0:
            base.append((sigma, float(public.get("sensitivity", e.get("sensitivity", 1.0))), float(e["delta"])))
        else:
            base.append((OPAQUE, epsilon, float(e["delta"])))
    return tuple(base)


def _dpsgd_terms(entries: Sequence[dict[str, Any]]) -> tuple[Any, ...]:
    """A DP-SGD phase's ("dp-sgd", noise multiplier, q, steps, delta) from its ledger entries: the
    noise multiplier and q of any entry holding them (every round uses the first round's), over
    the first reservation's binding (rounds x local steps), or over the steps taken where a ledger
    from before the binding was stored has none. Opaque when no entry holds a noise multiplier."""
    epsilon = sum(float(e["epsilon"]) for e in entries)
    if not math.isfinite(epsilon):
        return (OPAQUE, math.inf, 0.0)
    first = next((e for e in entries if e.get("binding")), None)
    terms = next((e["private"] for e in entries if (e.get("private") or {}).get("noise_multiplier")
                  and (e.get("private") or {}).get("sample_rate")), None)
    if terms is None:
        released = any(e.get("status") == "confirmed" for e in entries)
        return (OPAQUE, epsilon, sum(float(e["delta"]) for e in entries) if released else 0.0)
    if first is not None:
        steps = int(first["binding"]["rounds"]) * int(first["binding"]["local_steps"])
    else:
        steps = sum(int((e.get("private") or {}).get("steps", e.get("public", {}).get("steps", 0))) for e in entries)
    delta = float((first or entries[0])["delta"])
    return (DPSGD, float(terms["noise_multiplier"]), float(terms["sample_rate"]), steps, delta)


def ledger_epsilon(entries: Sequence[dict[str, Any]], delta: float) -> float:
    """Epsilon of every counted ledger entry composed at ``delta`` (the policy's): what a node
    under ``pld`` has spent."""
    return base_epsilon(release_base(entries), float(delta))


@functools.lru_cache(maxsize=64)
def pld_noise(base: Base, phase: Planned, delta: float | None = None) -> float:
    """The noise of ``phase`` (its sigma, or DP-SGD's noise multiplier) such that ``base`` and
    the whole phase compose at ``delta`` (the policy's; None: the phase's own) within
    ``base_epsilon(base, delta) + phase.share``: the phase spends its share on top of what the
    ledger's releases already cost. A base that alone is unbounded (a release without DP in an
    unlimited ledger) is left out."""
    if math.isinf(phase.share):
        return 0.0
    delta = phase.delta if delta is None else float(delta)
    spent = base_epsilon(base, delta)
    if not math.isfinite(spent):
        base, spent = (), 0.0
    return solve_noise(base, phase, spent + phase.share, delta)


@functools.lru_cache(maxsize=256)
def pld_charge(base: Base, sigma: float, sensitivity: float, delta: float, asked: float = 0.0) -> float:
    """What a Gaussian release of ``sigma`` costs after ``base``: the growth of its composition
    at ``delta`` (the policy's; never below 0). A ledger's charges then add up to its composition
    (or more), while admission checks the composition itself. ``asked``: the delta the release's
    request asked, kept with its terms like a ledger entry's (the composition does not read it)."""
    after = base + ((sigma, sensitivity, asked),)
    return max(0.0, base_epsilon(after, delta) - base_epsilon(base, delta))


def skellam_terms(mu: float, shift: Shift, delta: float) -> tuple[Any, ...]:
    """A Skellam release's ``Base`` term: Skellam(``mu``) in the sum, on a count histogram of
    ``shift`` moved coordinates (``delta``: what the request asked) or a ``Rounded`` vector (its own
    delta)."""
    if isinstance(shift, Rounded):
        return (SKELLAM_ROUNDED, float(mu), float(shift.norm), float(shift.delta))
    return (SKELLAM, float(mu), int(shift), float(delta))


@functools.lru_cache(maxsize=256)
def pld_skellam_mu(base: Base, share: float, shift: Shift, delta: float) -> float:
    """The least mu (within ``common.skellam.MU_TOLERANCE``, on the side that fits) of one Skellam
    release of ``shift`` such that ``base`` and it compose at ``delta`` (the policy's) within
    ``base_epsilon(base, delta) + share``; inf when no noise fits (``base`` alone leaves nothing of
    ``delta``), 0 for an infinite share (no DP). A base unbounded on its own is left out."""
    from common.skellam import MU_TOLERANCE, solve_mu

    if math.isinf(share):
        return 0.0
    spent = base_epsilon(base, delta)
    if not math.isfinite(spent):
        base, spent = (), 0.0
    alone_at = shift.delta if isinstance(shift, Rounded) else delta
    if not base and not isinstance(shift, Rounded):
        return solve_mu(share, shift, delta)
    if not alone_at > 0:
        return math.inf

    def fits(mu: float) -> bool:
        return base_epsilon(base + (skellam_terms(mu, shift, 0.0),), delta) <= spent + share

    hi = max(solve_mu(share, shift, alone_at), 1e-3)  # what fits alone: composed, more or less may fit
    while not fits(hi):
        hi *= 2
        if hi > 1e15:
            return math.inf
    lo = hi / 2
    while fits(lo):
        lo, hi = lo / 2, lo
        if lo < 1e-6:
            return hi
    while hi - lo > MU_TOLERANCE * hi:
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if fits(mid) else (mid, hi)
    return hi


def skellam_charge(base: Base, mu: float, shift: Shift, delta: float) -> float:
    """What a Skellam release of ``mu`` and ``shift`` costs after ``base``: the growth of the
    composition at ``delta`` (the policy's; never below 0), as ``pld_charge`` for a Gaussian."""
    return max(0.0, base_epsilon(base + (skellam_terms(mu, shift, 0.0),), delta) - base_epsilon(base, delta))


def rounds_of(share: float) -> int:
    """The number of equal rounds an ``epsilon-share`` splits a phase into (1/share, rounded)."""
    return max(1, round(1.0 / share))


def basic_delta(requested: float, epsilon: float, budget: float, policy_delta: float) -> float:
    """A release's delta under ``basic``: the policy's delta times the release's part of the
    node's epsilon ``budget``, or the ``requested`` delta where that is less. So the deltas of
    releases whose epsilons fit the budget fit the policy's delta, across every run (issue 60).
    An unlimited budget, or a release without DP, keeps the requested delta."""
    if not (math.isfinite(budget) and math.isfinite(epsilon)) or budget <= 0:
        return float(requested)
    return min(float(requested), float(policy_delta) * float(epsilon) / float(budget))
