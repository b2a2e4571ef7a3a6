"""Noise for a node's planned releases, by the rule its ledger composes them with (issue 47).

A node's run releases, in the plan's order, its profile (one Gaussian, sensitivity 1), its
DP-SGD phase (Poisson-subsampled Gaussian steps) and/or its vote rounds (T Gaussians of one
sigma), each phase with its appendix-B share of the node's epsilon and its own delta. Two rules:

- ``basic`` (the paper's, and this project's before issue 47): each phase meets its share on its
  own, a Gaussian round by the analytic Gaussian mechanism at (share / T, delta / T), DP-SGD by
  Opacus' RDP accountant; the node is charged the sum of the shares. Composed by a PLD
  accountant, such a node has spent well under its budget (60–80% in the default run).
- ``pld``: the phases are solved in the plan's order, each for the noise that brings the PLD
  composition of it and the run's releases before it (DP-SGD included) to their epsilon plus its
  share, at their summed delta. The profile, first, has the same sigma as under ``basic`` (one
  Gaussian is exact either way). A node's ledger prices each release by the growth of the PLD
  epsilon it causes (``pld_charge``), so a run's charges add up to its PLD composition.

Everything here reads public inputs only (shares, deltas, sensitivities, T, steps, and DP-SGD's
q = B / max-records with the noise multiplier solved from it): never a record count. A deployed
node's q is its public bound's (``max-records`` is required and the server may learn it); a
simulated node's is its partition's, which the server chose. So a vote after DP-SGD may compose
with it, and its stated sigma, a function of q, says nothing the server could not know. The solver searches the noise because the
composed epsilon falls as the noise grows and ``dp_accounting`` has no inverse for a composition
of several mechanisms (Brent's method from scipy on a bracket, kept on the side that fits).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from common.dp import (DPSGD, GAUSSIAN, analytic_gaussian_sigma, dpsgd_epsilon, dpsgd_event, dpsgd_noise_multiplier,
                       gaussian_event, pld_accountant, pld_epsilon)

BASIC, PLD = "basic", "pld"
RULES = (BASIC, PLD)
# The search stops when the noise is known to this relative width; it keeps the side whose
# composition is within the target, so a node never spends more than its share.
NOISE_TOLERANCE = 1e-4


@dataclass(frozen=True)
class Planned:
    """One phase a node plans to release in a run, on public inputs only.

    ``share``: the phase's epsilon (appendix B); ``delta``: the phase's delta (all its rounds
    together). A Gaussian phase is ``rounds`` releases of one sigma at L2 ``sensitivity``; a
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

    def events(self, noise: float) -> list[Any]:
        """The ``dp_accounting`` events of this phase at ``noise`` (Gaussian: each round's sigma;
        DP-SGD: the noise multiplier)."""
        if self.mechanism == DPSGD:
            return [dpsgd_event(noise, self.sample_rate, self.steps)]
        return [gaussian_event(noise, self.sensitivity)] * self.rounds

    def basic_noise(self) -> float:
        """The noise that meets ``share`` on its own (the ``basic`` rule)."""
        if self.mechanism == DPSGD:
            return dpsgd_noise_multiplier(self.share, self.delta, self.sample_rate, self.steps)
        return analytic_gaussian_sigma(self.share / self.rounds, self.delta / self.rounds, self.sensitivity)


def _events(planned: Sequence[Planned], noises: Sequence[float]) -> list[Any]:
    """The ``dp_accounting`` events of ``planned`` at ``noises``, in order."""
    return [e for p, n in zip(planned, noises) for e in p.events(n)]


def composed(planned: Sequence[Planned], noises: Sequence[float]) -> float:
    """Epsilon of ``planned`` at ``noises`` composed by PLD at the sum of their deltas."""
    return pld_epsilon(_events(planned, noises), sum(p.delta for p in planned))


def solve_noise(before: Sequence[Planned], before_noises: Sequence[float], phase: Planned, target: float) -> float:
    """The least noise (within ``NOISE_TOLERANCE``) for ``phase`` such that the PLD composition of
    ``before`` at ``before_noises`` and ``phase`` stays within ``target`` epsilon; inf if even an
    unbounded noise cannot (``before`` alone exceeds it)."""
    # the earlier phases composed once; each noise tried composes the phase onto a copy (the same
    # events in the same order as ``composed``, so the same figure)
    prefix = _prefix(tuple(before), tuple(before_noises))
    delta = sum(p.delta for p in before) + phase.delta

    def epsilon(noise: float) -> float:
        return float(pld_accountant(phase.events(noise), start=prefix).get_epsilon(delta))

    def fits(noise: float) -> bool:
        return epsilon(noise) <= target

    # a Gaussian phase starts from the noise that meets its own share (near the answer, and
    # instant); DP-SGD from 1, since Opacus' RDP calibration takes seconds where a PLD takes 0.3
    hi = phase.basic_noise() if phase.mechanism != DPSGD else 1.0
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
    noise = brentq(lambda x: epsilon(x) - target, lo, hi, xtol=width)
    while not fits(noise):
        noise = min(noise + width, hi)
    return noise


@functools.lru_cache(maxsize=32)
def _prefix(before: tuple[Planned, ...], noises: tuple[float, ...]) -> Any:
    return pld_accountant(_events(before, noises))


def calibrate(planned: Sequence[Planned], rule: str = PLD) -> list[float]:
    """The noise of each planned phase, in the plan's order, under ``rule`` (``basic`` or
    ``pld``, see the module docstring). An infinite share (no DP) gets 0 noise. A DP-SGD phase
    of unknown q (``sample_rate`` 0: a deployment's plan, where q is the node's) gets NaN, and under
    pld the phases after it are priced without it and those before: an upper bound on the noise
    the node solves with its q."""
    return list(_calibrate(tuple(planned), rule))


@functools.lru_cache(maxsize=64)  # a node solves the same plan at every release of a run
def _calibrate(planned: tuple[Planned, ...], rule: str) -> tuple[float, ...]:
    if rule not in RULES:
        raise ValueError(f"unknown accounting rule {rule!r}; one of {RULES}")
    if any(math.isinf(p.share) for p in planned):
        return (0.0,) * len(planned)
    if rule == BASIC:
        return tuple(math.nan if p.q_unknown else p.basic_noise() for p in planned)
    # what the nodes do (fedsyn_client.release): each phase on every release of the run before
    # it, so the prediction and the ledger agree
    noises: list[float] = []
    base: Base = ()
    for phase in planned:
        if phase.q_unknown:
            noises.append(math.nan)
            base = ()
            continue
        noise = pld_noise(base, phase)
        noises.append(noise)
        if phase.mechanism == DPSGD:
            base = base + ((DPSGD, noise, phase.sample_rate, phase.steps, phase.delta),)
        else:
            base = base + ((noise, phase.sensitivity, phase.delta / phase.rounds),) * phase.rounds
    return tuple(noises)


# ----------------------------------------------------------------- a node's ledger under ``pld``
# What a node's ledger knows of a run's earlier releases, for pricing the next one, oldest first:
# a Gaussian release as (sigma, sensitivity, delta), from its statement; a DP-SGD phase as
# ("dp-sgd", noise multiplier, q, all R x tau steps, delta): the whole phase, as its first round
# reserved it, whatever number of rounds ran. A ledger written before DP-SGD composed with what
# follows stores a DP-SGD phase's base of 3-tuples only, which still reads.
Base = tuple[tuple[Any, ...], ...]


def release_base(entries: Sequence[dict[str, Any]]) -> Base:
    """The public terms of the run's counted ledger ``entries`` (oldest first) as a ``Base``.
    Entries without a sigma (no DP) are skipped. A DP-SGD phase whose terms the entries do not
    hold (no round confirmed yet, or a ledger from before the first round stored its binding)
    cannot be composed: what came before it is dropped too, and what follows is priced on its
    own (basic composition with it, a valid bound, as before issue 47's joint rule)."""
    base: list[tuple[Any, ...]] = []
    done: set[str] = set()
    for e in entries:
        if e.get("mechanism") == DPSGD:
            if e["phase"] not in done:
                done.add(e["phase"])
                terms = _dpsgd_terms([x for x in entries if x.get("mechanism") == DPSGD and x["phase"] == e["phase"]])
                base = [*base, terms] if terms is not None else []
        elif e.get("mechanism") == GAUSSIAN:
            public = e.get("public", {})
            sigma = float(public.get("sigma", e.get("sigma", 0.0)) or 0.0)
            if sigma > 0:
                base.append((sigma, float(public.get("sensitivity", e.get("sensitivity", 1.0))), float(e["delta"])))
    return tuple(base)


def _dpsgd_terms(entries: Sequence[dict[str, Any]]) -> tuple[Any, ...] | None:
    """A DP-SGD phase's ("dp-sgd", noise multiplier, q, R x tau, delta) from its ledger entries:
    the first reservation's binding (rounds, steps) and delta, a confirmed round's multiplier and q
    (every round of a run uses the first round's)."""
    first = next((e for e in entries if e.get("binding")), None)
    terms = next((e["private"] for e in entries if (e.get("private") or {}).get("noise_multiplier")), None)
    if first is None or terms is None or not terms.get("sample_rate"):
        return None
    steps = int(first["binding"]["rounds"]) * int(first["binding"]["local_steps"])
    return (DPSGD, float(terms["noise_multiplier"]), float(terms["sample_rate"]), steps, float(first["delta"]))


def _base_planned(base: Base) -> tuple[list[Planned], list[float]]:
    planned, noises = [], []
    for b in base:
        if b[0] == DPSGD:
            _, noise, q, steps, delta = b
            planned.append(Planned("before", DPSGD, 0.0, float(delta), sample_rate=float(q), steps=int(steps)))
        else:
            noise, sensitivity, delta = b
            planned.append(Planned("before", GAUSSIAN, 0.0, float(delta), float(sensitivity)))
        noises.append(float(noise))
    return planned, noises


@functools.lru_cache(maxsize=256)
def base_epsilon(base: Base) -> float:
    """PLD epsilon of ``base`` at the sum of its deltas (0 for none)."""
    planned, noises = _base_planned(base)
    return composed(planned, noises) if planned else 0.0


@functools.lru_cache(maxsize=64)
def pld_noise(base: Base, phase: Planned) -> float:
    """The noise of ``phase`` (its sigma, or DP-SGD's noise multiplier) such that the PLD
    composition of ``base`` and the whole phase is within ``base_epsilon(base) + phase.share``:
    the phase spends its share on top of what the run's earlier releases already cost."""
    if math.isinf(phase.share):
        return 0.0
    planned, noises = _base_planned(base)
    return solve_noise(planned, noises, phase, base_epsilon(base) + phase.share)


@functools.lru_cache(maxsize=256)
def pld_charge(base: Base, sigma: float, sensitivity: float, delta: float) -> float:
    """What a Gaussian release of ``sigma`` costs after ``base``: the growth of the run's PLD
    epsilon (never below 0). A run's charges then add up to its PLD composition (or more), so
    a ledger that adds charges stays a valid bound while spending by the tighter rule."""
    after = base + ((sigma, sensitivity, delta),)
    return max(0.0, base_epsilon(after) - base_epsilon(base))


def rounds_of(share: float) -> int:
    """The number of equal rounds an ``epsilon-share`` splits a phase into (1/share, rounded)."""
    return max(1, round(1.0 / share))


def dpsgd_phase_epsilon(history: list[list[float]], delta: float, base: Base | None) -> float:
    """Phase 1's epsilon after ``history`` [(noise multiplier, q, steps), ...]: Opacus' RDP accountant
    (basic), or under pld the growth of the PLD composition of ``base`` and the steps so far, at
    the base's deltas plus the phase's ``delta`` (what the noise was solved for)."""
    if base is None:
        return dpsgd_epsilon(history, delta)
    if any(float(h[0]) == 0 for h in history):
        return math.inf
    planned, noises = _base_planned(base)
    events = _events(planned, noises) + [dpsgd_event(float(nm), float(q), int(n)) for nm, q, n in history]
    return pld_epsilon(events, sum(p.delta for p in planned) + delta) - base_epsilon(base)
