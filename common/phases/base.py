"""A release phase as one object: what every package must know of it, in one place (issue 62).

A phase is a kind of release a node makes in a run: its name (the ledger's, the policy's caps'),
the Flower message the server asks it by and the record its reply holds, its mechanism, which
tiers take part, its epsilon on a node of a tier, what a node prices for it before anything is
spent (``planned``: ``fedsyn plan`` prices the same object), its words in the privacy report, and
what a node's policy must allow before it (the models it runs, the columns it reads).

The node's handlers, ``fedsyn plan``, the privacy report, the policy and the strategy iterate over
``phases()`` instead of naming phases; a new phase is a subclass and ``register``. One file a
phase, as Flower keeps one strategy a file.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

from common.calibration import Planned, basic_delta
from common.config import RunConfig
from common.dp import GAUSSIAN


@dataclass(frozen=True)
class Pricing:
    """What a node of ``tier`` prices a run's phases on, public inputs only: the run config, the
    delta the run asks per release, DP-SGD's q (B / the node's bound; 0 where it is unknown, a
    deployment's plan) and the vote terms the run's refinement declares, (rounds, L2 sensitivity,
    the sensitivity in words), None where no shipped histogram states them.

    For ``fedsyn plan``'s lines also: the node's ``records`` (its bound; None in a deployment's
    plan), the machine's measured ``speed`` (``benchmarks/throughput_cpu.json``), the node's epsilon
    ``budget`` (basic splits the policy's delta by it) and the number of ``marginals`` each marginals
    round asks (the server's choice, ``strategies.marginals.planned_marginals``)."""

    cfg: RunConfig
    tier: str
    delta: float
    sample_rate: float = 0.0
    votes: tuple[int, float, str] | None = None
    records: int | None = None
    speed: Mapping[str, Any] = field(default_factory=dict)
    budget: float = math.inf
    marginals: tuple[int, ...] = ()

    def split(self, epsilon: float) -> float:
        """A release of ``epsilon``'s delta under ``basic``: its part of the policy's (issue 60)."""
        budget = self.cfg.epsilon if not math.isfinite(self.budget) else self.budget
        return basic_delta(self.delta, epsilon, budget, self.delta)

    def basic(self, planned: Planned) -> float:
        """``planned``'s noise under ``basic`` at its split of the delta (NaN for an unknown q)."""
        return math.nan if planned.q_unknown else replace(planned, delta=self.split(planned.share)).basic_noise()


class Phase(ABC):
    """One kind of release: its facts (class attributes) and what follows from a run config."""

    name: ClassVar[str]
    message: ClassVar[str]  # the Flower message type the server asks it by ("query.vote")
    reply: ClassVar[str]  # the key of the reply's record holding the release
    mechanism: ClassVar[str] = GAUSSIAN
    # what the node's policy must allow, as (the request's field, the policy's allowed values)
    requires: ClassVar[tuple[tuple[str, str], ...]] = ()
    # which of a table's columns it reads of each record: "code" (the control columns), "record"
    # (the text and its code: a free-text column and the code's, or every column of a rows run)
    # or "measured" (those its request names, checked on the node)
    reads: ClassVar[str] = "record"
    # the tier a failed node is counted under when the run never learnt its tier
    usual_tier: ClassVar[str] = "weak"

    def share(self, cfg: RunConfig, tier: str) -> float:
        """This phase's epsilon on a node of ``tier`` in a run of ``cfg`` (appendix B's split,
        ``common.dp.phase_epsilon``); 0 where the tier takes no part."""
        return cfg.phase_epsilon(tier, self.name)

    @abstractmethod
    def asked(self, cfg: RunConfig, asks_votes: bool) -> bool:
        """Whether a run of ``cfg`` asks this phase of the nodes (whose tier decides whether
        theirs is > 0); ``asks_votes``: whether the run's refinement asks votes at all."""

    @abstractmethod
    def planned(self, pricing: Pricing) -> Planned | None:
        """The release a node of ``pricing.tier`` plans for this phase (what the node noises by
        and ``fedsyn plan`` prints), or None where it makes none."""

    @abstractmethod
    def wording(self, cfg: RunConfig, votes: tuple[int, float, str] | None, formulas: str) -> str:
        """The phase's mechanism in words, for the privacy report (``formulas``: every shipped
        histogram's sensitivity in words, for a phase that names histograms)."""


    def missing(self, cfg: RunConfig, tiers: set[str]) -> str | None:
        """Why no node of ``tiers`` (those that can take part) can serve this phase in a run of
        ``cfg``, or None when one can (by default any tier can)."""
        return None

    def plan_lines(self, pricing: Pricing, planned: Planned | None, pld: float, after_unknown_q: bool) -> list[str]:
        """``fedsyn plan``'s lines for this phase on a node of ``pricing.tier``: ``planned`` (None:
        the node releases none) under ``basic`` and at ``pld``, the noise the default rule solves
        (sigma at its sensitivity, or DP-SGD's multiplier; NaN where the node solves it), an upper
        bound when ``after_unknown_q`` (a DP-SGD phase of unknown q comes before it)."""
        if planned is None:
            return []
        rounds = f" in {planned.rounds} round(s)" if planned.rounds > 1 else ""
        noise = "DP-SGD noise multiplier" if planned.mechanism != GAUSSIAN else "Gaussian sigma"
        return [f"{self.name}: epsilon {planned.share:g}{rounds}, delta {planned.delta:g}, {noise} "
                f"{pricing.basic(planned):.3g} (sensitivity {planned.sensitivity:g}; basic; "
                f"{'at most ' if after_unknown_q else ''}{pld:.3g} under accounting = pld)"]


_REGISTRY: dict[str, Phase] = {}


def register(phase: Phase) -> Phase:
    """Make ``phase`` one of the run's phases, after those registered before it (the order the
    nodes release them and the plan lists them); a name taken, or a non-Phase, is refused."""
    if not isinstance(phase, Phase):
        raise TypeError(f"{phase!r} is not a Phase: subclass common.phases.Phase")
    if phase.name in _REGISTRY:
        raise ValueError(f"a phase named {phase.name!r} is registered already")
    _REGISTRY[phase.name] = phase
    return phase


def unregister(name: str) -> None:
    """Forget the phase ``name`` (a test's toy phase)."""
    _REGISTRY.pop(name, None)


def phases() -> list[Phase]:
    """Every registered phase, in the nodes' release order."""
    return list(_REGISTRY.values())


def phase(name: str) -> Phase:
    """The registered phase ``name``; ``KeyError`` naming the known ones."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise KeyError(f"unknown phase {name!r}; one of {list(_REGISTRY)}") from None


def is_phase(name: str) -> bool:
    """True for a registered phase's name (a release), False for a free message (tier, ledger)."""
    return name in _REGISTRY
