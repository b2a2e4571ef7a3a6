"""How a node composes its releases: one object per rule, looked up by name (issue 62).

A node's budget is one (epsilon, delta), its policy's, and its rule says how its releases spend
it. Opacus keeps one ``IAccountant`` per rule in a registry; so do we, for the two ways a node
may spend its budget (``common.calibration`` holds their maths):

- ``Basic`` (``basic``, the paper's): each phase meets its share on its own, epsilons add up,
  and so do deltas, each release's a declared split of the policy's.
- ``Pld`` (``pld``, the default): every release the node ever made is composed by a
  privacy-loss distribution at the policy's delta; a release is noised so that the composition
  grows by its share, and charged that growth.

A request names its rule by the string its policy holds (``accounting``); the node, ``fedsyn
plan`` and the report look it up here (``rule``) and call it wherever a release is priced,
noised, bound, charged and admitted. A new rule is a subclass and ``register``: nothing else
branches on a rule's name.
"""

from __future__ import annotations

import functools
import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, ClassVar

from common.calibration import (
    Base,
    Planned,
    base_epsilon,
    basic_delta,
    calibrate_basic,
    calibrate_pld,
    ledger_epsilon,
    pld_charge,
    pld_noise,
    pld_skellam_mu,
    skellam_charge,
)
from common.dp import DPSGD, dpsgd_epsilon, dpsgd_noise_multiplier
from common.skellam import Rounded, Shift


class Accounting(ABC):
    """One rule by which a node composes its releases; stateless (the ledger holds the state)."""

    name: ClassVar[str]
    # whether a release is priced on the node's earlier releases (the ledger's, read under its
    # lock): the rule's charges are then not its requests' epsilons but what it adds to them
    composes_ledger: ClassVar[bool]

    @abstractmethod
    def noises(self, planned: tuple[Planned, ...], delta: float) -> tuple[float, ...]:
        """The noise of each planned phase in the plan's order (sigma, or DP-SGD's noise
        multiplier), none of them infinite-share; a DP-SGD phase of unknown q gets NaN."""

    @abstractmethod
    def release_delta(self, requested: float, epsilon: float, budget: float, policy_delta: float) -> float:
        """The delta a release of ``epsilon`` states, given what its request asked and the
        node's budget (``budget``, ``policy_delta``)."""

    @abstractmethod
    def composed_at(self, requested: float, policy_delta: float) -> float:
        """The delta a DP-SGD phase's noise is solved and accounted at."""

    @abstractmethod
    def terms(self, policy_delta: float) -> dict[str, Any]:
        """What a release's public statement and its binding say of the rule ({}: nothing, the
        paper's rule, so its statements stay as they were)."""

    def binding(self) -> dict[str, Any]:
        """What a phase's first reservation binds of the rule: its name where it states itself."""
        return {"accounting": self.name} if self.terms(0.0) else {}

    @abstractmethod
    def gaussian_multiplier(self, earlier: Base, phase: Planned, policy_delta: float) -> float | None:
        """A Gaussian phase's noise multiplier (sigma at sensitivity 1) on the node's ``earlier``
        releases; None where each release solves its own sigma from its (epsilon, delta)."""

    @abstractmethod
    def gaussian_charge(self, base: Base, sigma: float, sensitivity: float, policy_delta: float,
                        asked: float) -> float | None:
        """What a Gaussian release of ``sigma`` costs after ``base``; None: its request's epsilon."""

    @abstractmethod
    def skellam_mu(self, earlier: Base, epsilon: float, shift: Shift, delta: float, policy_delta: float) -> float:
        """The Skellam mu one release of ``epsilon`` and ``shift`` (``common.skellam``: moved
        coordinates, or a rounded vector) needs in the sum (issue 73), after the node's ``earlier``
        releases; ``delta``: the release's own (basic)."""

    @abstractmethod
    def skellam_charge(self, base: Base, mu: float, shift: Shift, policy_delta: float) -> float | None:
        """What a Skellam release of ``mu`` costs after ``base``; None: its request's epsilon."""

    @abstractmethod
    def dpsgd_noise(self, base: Base, phase: Planned, delta: float) -> float:
        """The noise multiplier of a whole DP-SGD ``phase`` (its share, q and steps) at ``delta``."""

    @abstractmethod
    def dpsgd_epsilon(self, history: list[list[float]], delta: float, base: Base) -> float:
        """A DP-SGD phase's epsilon after ``history`` [(noise multiplier, q, steps), ...] at
        ``delta`` (what its noise was solved for), the node's earlier releases being ``base``."""

    @abstractmethod
    def ledger_epsilon(self, entries: Sequence[dict[str, Any]], delta: float) -> float | None:
        """Every counted ledger entry composed at the policy's ``delta``, what admission holds to
        the budget; None where the budget is the sum of the stated epsilons (and deltas)."""


class Basic(Accounting):
    """The paper's rule: each phase meets its share on its own (a Gaussian round by the analytic
    Gaussian mechanism, DP-SGD by Opacus' RDP accountant); epsilons and deltas add up."""

    name = "basic"
    composes_ledger = False

    def noises(self, planned: tuple[Planned, ...], delta: float) -> tuple[float, ...]:  # noqa: D102 - documented on Accounting
        return calibrate_basic(planned)

    def release_delta(self, requested: float, epsilon: float, budget: float,  # noqa: D102 - documented on Accounting
                      policy_delta: float) -> float:
        return basic_delta(requested, epsilon, budget, policy_delta)

    def composed_at(self, requested: float, policy_delta: float) -> float:  # noqa: D102 - documented on Accounting
        return float(requested)

    def terms(self, policy_delta: float) -> dict[str, Any]:  # noqa: D102 - documented on Accounting
        return {}

    def gaussian_multiplier(self, earlier: Base, phase: Planned,  # noqa: D102 - documented on Accounting
                            policy_delta: float) -> float | None:
        return None

    def gaussian_charge(self, base: Base, sigma: float, sensitivity: float, policy_delta: float,  # noqa: D102 - documented on Accounting
                        asked: float) -> float | None:
        return None

    def skellam_mu(self, earlier: Base, epsilon: float, shift: Shift, delta: float,  # noqa: D102 - documented on Accounting
                   policy_delta: float) -> float:
        from common.skellam import solve_mu

        return solve_mu(epsilon, shift, shift.delta if isinstance(shift, Rounded) else delta)

    def skellam_charge(self, base: Base, mu: float, shift: Shift,  # noqa: D102 - documented on Accounting
                       policy_delta: float) -> float | None:
        return None

    def dpsgd_noise(self, base: Base, phase: Planned, delta: float) -> float:  # noqa: D102 - documented on Accounting
        return rdp_noise(phase.share, delta, phase.sample_rate, phase.steps)

    def dpsgd_epsilon(self, history: list[list[float]], delta: float, base: Base) -> float:  # noqa: D102 - documented on Accounting
        return dpsgd_epsilon(history, delta)

    def ledger_epsilon(self, entries: Sequence[dict[str, Any]], delta: float) -> float | None:  # noqa: D102 - documented on Accounting
        return None


class Pld(Accounting):
    """Every release of the node, across every run in its ledger, composed by a privacy-loss
    distribution at the policy's delta (``common.calibration``): the same budget, less noise."""

    name = "pld"
    composes_ledger = True

    def noises(self, planned: tuple[Planned, ...], delta: float) -> tuple[float, ...]:  # noqa: D102 - documented on Accounting
        return calibrate_pld(planned, delta)

    def release_delta(self, requested: float, epsilon: float, budget: float,  # noqa: D102 - documented on Accounting
                      policy_delta: float) -> float:
        return float(requested)  # stated; every release is composed at the policy's delta

    def composed_at(self, requested: float, policy_delta: float) -> float:  # noqa: D102 - documented on Accounting
        return float(policy_delta)

    def terms(self, policy_delta: float) -> dict[str, Any]:  # noqa: D102 - documented on Accounting
        return {"accounting": self.name, "composed_delta": policy_delta}

    def gaussian_multiplier(self, earlier: Base, phase: Planned,  # noqa: D102 - documented on Accounting
                            policy_delta: float) -> float | None:
        return pld_noise(earlier, phase, policy_delta)

    def gaussian_charge(self, base: Base, sigma: float, sensitivity: float, policy_delta: float,  # noqa: D102 - documented on Accounting
                        asked: float) -> float | None:
        return math.inf if sigma == 0 else pld_charge(base, sigma, sensitivity, policy_delta, asked)

    def skellam_mu(self, earlier: Base, epsilon: float, shift: Shift, delta: float,  # noqa: D102 - documented on Accounting
                   policy_delta: float) -> float:
        return pld_skellam_mu(earlier, epsilon, shift, policy_delta)

    def skellam_charge(self, base: Base, mu: float, shift: Shift,  # noqa: D102 - documented on Accounting
                       policy_delta: float) -> float | None:
        return math.inf if mu == 0 else skellam_charge(base, mu, shift, policy_delta)

    def dpsgd_noise(self, base: Base, phase: Planned, delta: float) -> float:  # noqa: D102 - documented on Accounting
        return pld_noise(base, phase, delta) or rdp_noise(phase.share, delta, phase.sample_rate, phase.steps)

    def dpsgd_epsilon(self, history: list[list[float]], delta: float, base: Base) -> float:  # noqa: D102 - documented on Accounting
        if any(float(h[0]) == 0 for h in history):
            return math.inf
        steps = tuple((DPSGD, float(nm), float(q), int(n), 0.0) for nm, q, n in history)
        return base_epsilon(tuple(base) + steps, delta) - base_epsilon(tuple(base), delta)

    def ledger_epsilon(self, entries: Sequence[dict[str, Any]], delta: float) -> float | None:  # noqa: D102 - documented on Accounting
        return ledger_epsilon(entries, delta)


@functools.lru_cache(maxsize=64)
def rdp_noise(epsilon: float, delta: float, q: float, steps: int) -> float:
    """``common.dp.dpsgd_noise_multiplier``, remembered: Opacus' search takes a second or so, and a
    node's public check and its first round ask it the same."""
    return dpsgd_noise_multiplier(epsilon, delta, q, steps)


RULES: dict[str, Accounting] = {}
DEFAULT = Pld.name


def register(accounting: Accounting) -> Accounting:
    """Make ``accounting`` known by its name (to run configs, policies and ``fedsyn plan``); a
    name already taken is refused: a rule replaced under a node would change what it spent."""
    if not isinstance(accounting, Accounting):
        raise TypeError(f"{accounting!r} is not an Accounting rule: subclass common.accounting.Accounting")
    if accounting.name in RULES:
        raise ValueError(f"an accounting rule named {accounting.name!r} is registered already")
    RULES[accounting.name] = accounting
    return accounting


def rule(name: str) -> Accounting:
    """The registered rule called ``name``; ``ValueError`` naming the known ones."""
    try:
        return RULES[name]
    except KeyError:
        raise ValueError(f"unknown accounting rule {name!r}; one of {sorted(RULES)}") from None


register(Basic())
register(Pld())


def calibrate(planned: Sequence[Planned], accounting: str = DEFAULT, delta: float | None = None) -> list[float]:
    """The noise of each planned phase, in the plan's order, under the rule named ``accounting``
    (``fedsyn plan`` and the report price with the nodes' own). ``delta``: the policy's, at which a
    composing rule composes the plan (None: the largest phase delta, a run's per-release delta,
    which in simulation is the policy's). An infinite share (no DP) gets 0 noise everywhere."""
    at = float(delta) if delta is not None else max((p.delta for p in planned), default=0.0)
    if any(math.isinf(p.share) for p in planned):
        return [0.0] * len(planned)
    return list(rule(accounting).noises(tuple(planned), at))
