"""Plug-in point 2: the refinement stage, which turns the generated pool into the final set.

A ``Refinement`` owns its rounds. The strategy generates the pool (stage 3) and calls
``refine(ctx)`` once; the context gives the method everything it may use:

- the pool (``texts``, ``codes``, and ``writers``: which weights wrote each text,
  ``strategies.writers``), the ``allocation`` and the noisy ``profile``;
- the ``generator`` (``generate``, ``variation``, and its model for training);
- ``vote(texts, codes, histogram=..., epsilon_share=...)``: one federated round on the voters,
  returning the sum of their noised histograms (each node authorises, noises and books it);
- a seeded ``rng``.

A method returns a ``Refined``: the population the final set is drawn from, its writers (a text
of the pool keeps its writer; a text the method wrote is ``ctx.writer``'s), which of it is kept,
and that population's aggregated votes (if any). Built-ins are registered by name in
``common.plugins.REFINEMENTS``; any other class is named by path, ``"package.module:Class"``. See
``docs/writing_a_refinement.md``.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
from flwr.app import ArrayRecord

from common import histograms
from common.config import RunConfig
from common.plugins import REFINEMENTS, load_class
from strategies.allocation import allocate

# The writers a text can come from (issue 46; the rules that choose between them: strategies.writers).
# Here, beside the plug-in interface, because a refinement tags the texts it writes with them.
PRETRAINED = "pretrained"  # θ⁰ with the zero-shot instruction
FINETUNED = "finetuned"  # phase 1's DP-finetuned weights
REFINED = "refined"  # weights a refinement trained (POPri's DPO)


class Generator(ABC):
    """The server's generator as a refinement sees it (implemented by ``fedsyn_server.synthesis``)."""

    model: Any  # the (peft-wrapped) causal LM; a refinement may train its trainable weights
    tokenizer: Any

    @abstractmethod
    def load(self, arrays: ArrayRecord | None) -> Any:
        """Set the trainable weights (None keeps the current ones); returns the model."""

    @abstractmethod
    def weights(self) -> ArrayRecord:
        """The current trainable weights."""

    @abstractmethod
    def prompt(self, code: str) -> str:
        """The generation prompt for a control code."""

    @abstractmethod
    def generate(self, allocation: Mapping[str, int], seed: int,
                 prompt: str | None = None) -> tuple[list[str], list[str]]:
        """``allocation[c]`` samples for each code ``c``; returns (texts, codes), grouped by code.
        ``prompt``: the prompt style to write with (a run-config ``prompt`` value; None: the run's)."""

    @abstractmethod
    def variation(self, texts: list[str], codes: list[str], seed: int) -> list[str]:
        """One variation of each text, conditioned on its code (same order)."""

    def generation_report(self) -> dict[str, Any]:
        """What the last ``generate`` wrote against what it was asked (texts asked again,
        dropped, written per code); {} when the generator keeps no such count."""
        return {}


@dataclass(frozen=True)
class VotePlan:
    """The votes a refinement asks of every voter in one run: ``rounds`` releases of the node-side
    ``histogram`` (``common.histograms.HISTOGRAMS``) under ``params``, each at ``1 / rounds`` of the
    node's epsilon_vote and delta. ``fedsyn plan`` and the privacy report read it from the class,
    so a plug-in that declares it is planned and reported like the shipped methods."""

    rounds: int
    histogram: str
    params: dict[str, Any] = field(default_factory=dict)

    @property
    def share(self) -> float:
        """Each round's part of the phase's epsilon and delta."""
        return 1.0 / self.rounds

    def request(self) -> dict[str, Any]:
        """The keyword arguments of ``ctx.vote`` for one of its rounds."""
        return {"histogram": self.histogram, "epsilon_share": self.share, **self.params}


class VoteFn(Protocol):
    """One vote round on the voters; returns the sum of the nodes' noised histograms."""

    def __call__(self, texts: list[str], codes: list[str], histogram: str = "knn-vote",
                 epsilon_share: float = 1.0, **params: Any) -> np.ndarray: ...


@dataclass
class RefinementContext:
    """What a refinement may use (see the module docstring)."""

    cfg: RunConfig
    texts: list[str]
    codes: list[str]
    allocation: dict[str, int]
    profile: np.ndarray  # the global noisy profile, one value per vocabulary code
    vocabulary: list[str]
    generator: Generator
    vote: VoteFn
    rng: np.random.Generator
    writers: list[str] = field(default_factory=list)  # the pool's writer per text (strategies.writers)
    writer: str = FINETUNED  # the writer of a text the generator writes now (the weights it holds)

    def allocation_for(self, size: int) -> dict[str, int]:
        """The profile's allocation of ``size`` samples (Algorithm 1, stage 2, for stage 3's pool)."""
        return dict(zip(self.vocabulary, (int(a) for a in allocate(self.profile, size))))


@dataclass
class Refined:
    """A refinement's answer: the final population, which of it is kept, its votes."""

    texts: list[str]
    codes: list[str]
    selected: np.ndarray
    votes: np.ndarray | None = None  # aggregated noisy votes of ``texts`` (the last round), if any
    # the writer of each of ``texts``; None: a pool text's own, ``ctx.writer`` for any other
    # (``strategies.writers.writers_of``)
    writers: list[str] | None = None
    notes: dict[str, Any] = field(default_factory=dict)  # per-round diagnostics for metrics.json
    trained_generator: bool = False  # the method trained the generator: the run saves its weights
    # every text a round saw, one row each (``round_rows``), for ``refinement_rounds.jsonl``: what a
    # method did with its votes, which the final population alone no longer shows
    history: list[dict[str, Any]] = field(default_factory=list)


class Refinement(ABC):
    """A refinement method. Subclass it, set ``name``, implement ``refine``."""

    name: str = "base"
    # Whether ``refine`` calls ``ctx.vote``: the server tells the nodes which phases it plans to
    # ask of them, so each can say up front whether its budget covers the run (a method that
    # votes while saying False is still bounded by every node's ledger).
    asks_votes: bool = True
    # Whether the method trains the generator on the generator's own samples (POPri's DPO pairs, GRPO's
    # rollouts): then the stage-3 pool is written wholly by the weights it trains, none of it by the
    # pretrained model (``strategies.writers``), or round 1's pairs would be off-policy.
    on_policy: bool = False

    def vote_plan(self, cfg: RunConfig) -> VotePlan | None:
        """The votes this method asks for in a run of ``cfg``; None: none, or not declared (then
        ``fedsyn plan`` cannot predict their noise, and every node's ledger still bounds them).
        A method's own rounds call ``ctx.vote(texts, codes, **plan.request())`` with it."""
        return None

    def pool_size(self, cfg: RunConfig) -> int:
        """How many texts stage 3 generates (then allocated by the profile); default s."""
        return cfg.num_synthetic

    @abstractmethod
    def refine(self, ctx: RefinementContext) -> Refined:
        """Run the method's rounds on ``ctx`` and return the final set."""


def round_rows(round_: int, texts: list[str], codes: list[str], scores: np.ndarray,
               **columns: list[Any]) -> list[dict[str, Any]]:
    """One row per text of a round: ``round``, ``text``, ``control_code``, ``score`` (the round's
    aggregated noisy statistic of the text) and, per keyword, the method's own column (one value
    per text). Nothing in it is private: the texts are the server's, the scores already noised."""
    s = np.asarray(scores, dtype=np.float64)
    named: dict[str, np.ndarray | list[Any]] = {"score": s, **columns}
    for name, values in named.items():
        if len(values) != len(texts):
            raise ValueError(f"{len(values)} values of {name!r} for {len(texts)} texts")
    return [{"round": int(round_), "text": t, "control_code": c, "score": float(s[i]),
             **{k: v[i] for k, v in columns.items()}} for i, (t, c) in enumerate(zip(texts, codes))]


def final_size(cfg: RunConfig) -> int:
    """The final set's size for ``cfg``: ``max(1, floor(sampling-rate x num-synthetic))``.

    The one rule: every built-in refinement ends with it, and a table run by marginals samples
    that many rows (``strategies.marginals``), so methods compare at the same size. Floor, not
    round: 245 x 0.3 = 73.5 gives 73."""
    return max(1, math.floor(cfg.sampling_rate * cfg.num_synthetic))


def build_refinement(name: str) -> Refinement:
    """The refinement registered as ``name``, or the class at ``"package.module:Class"``.

    Raises ``ValueError`` naming the problem (unknown name, missing module or class, not a
    ``Refinement``) before any message is sent.
    """
    return load_class(name, REFINEMENTS, "refinement", Refinement)()


def planned_votes(cfg: RunConfig) -> tuple[int, float, str] | None:
    """(vote rounds, L2 sensitivity, its formula) that the run's refinement will ask of each voter,
    from its class's ``vote_plan`` and the registered histograms' bounds
    (``common.histograms.HISTOGRAMS``); None where the method declares no plan, cannot be loaded
    here, or votes with a histogram only its nodes register. A prediction for ``fedsyn plan`` and
    the report: each node computes the sensitivity it noises with itself, and its ledger books
    what it released."""
    try:
        plan = build_refinement(cfg.refinement).vote_plan(cfg)
    except ValueError:
        return None
    if plan is None or plan.histogram not in histograms.HISTOGRAMS:
        return None
    return plan.rounds, histograms.sensitivity(plan.histogram, plan.params), histograms.formula(plan.histogram)
