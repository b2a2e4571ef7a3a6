"""The one release path on a node: authorise -> reserve -> compute + noise -> confirm -> reply.

Every message that releases something derived from the records (training, profile, vote,
and any histogram a refinement adds) goes through ``release``, so a new mechanism gets
the same protection by construction:

1. **authorise** against the node's policy (``read_request``: data view, vocabulary, delta,
   per-phase caps) -- before any record is read; a request this node already answered
   (same run key, phase, round and content) gets its stored reply, at no cost
   (``fedsyn_client.replies``);
2. **reserve** epsilon in the ledger under its file lock (total budget, this run's budget
   for the phase; DP-SGD also its step budget);
3. **compute and noise** in the mechanism (``Mechanism.release``);
4. **confirm** in the ledger with the private details (or cancel on a clean failure), and
   store the noised reply for a repeated request;
5. **reply** with the release's *statement*: phase, mechanism, epsilon, delta and only
   data-independent parameters (sigma and sensitivity of a Gaussian, DP-SGD's steps) --
   never a sampling rate, noise multiplier or count from which |D| follows.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from flwr.app import ConfigRecord, Context, Message

from common import records as R
from common.config import ConfigError, RunConfig
from common.dp import GAUSSIAN, analytic_gaussian_sigma, gaussian_release, phase_epsilon
from common.ledger import Release
from common.logs import get_logger
from fedsyn_client.node import Node
from fedsyn_client.replies import check_run_key, request_digest

log = get_logger(__name__)


@dataclass(frozen=True)
class Request:
    """A release the server asked for, as this node read and authorised it."""

    run_id: str
    phase: str
    epsilon: float  # what this release costs (basic composition)
    delta: float
    phase_budget: float  # this run's epsilon for the phase (node-side split, capped by the policy)
    vocabulary: tuple[str, ...]
    round: int = 0
    params: dict[str, Any] = field(default_factory=dict)  # the message's other config values
    digest: str = ""  # of the whole request, to answer a repeat with the stored reply


def run_key(msg: Message, context: Context) -> str:
    """The run a request belongs to on this node: its ``resume-key`` (a resumed run repeats
    the original run's) or the Flower run id. Budgets per run and stored replies use it."""
    conf = msg.content.config_records[R.CONFIG] if R.CONFIG in msg.content.config_records else {}
    return check_run_key(str(conf.get("resume-key") or context.run_id))


def read_request(msg: Message, context: Context, node: Node, cfg: RunConfig, phase: str) -> Request:
    """Read and authorise a request against the node's policy (nothing is read from the records).

    The run's epsilon for ``phase`` is the appendix-B split of the run's per-node epsilon
    (already checked to be within the node's budget), capped by the policy's per-phase cap.
    An ``epsilon-share`` in (0, 1] asks for that part of it *and* of delta (a refinement with
    several vote rounds): the rounds of a phase never compose to more than (epsilon, delta).
    Raises ``PolicyRefused`` or ``ConfigError``.
    """
    conf = dict(msg.content.config_records[R.CONFIG]) if R.CONFIG in msg.content.config_records else {}
    vocabulary = tuple(str(c) for c in conf.get("codes", []))
    node.policy.check_vocabulary(vocabulary)
    delta = conf.get("delta")
    node.policy.check_delta(delta)
    budget = phase_epsilon(cfg.epsilon, cfg.epsilon_profile, node.tier, cfg.voters, phase)
    node.policy.check_phase(phase, budget)
    if budget == 0:
        raise ConfigError(f"{phase} was sent to a {node.tier} node, which has no {phase} budget in this run "
                          f"(voters={cfg.voters})")
    share = float(conf.get("epsilon-share", 1.0))
    if not 0 < share <= 1:
        raise ConfigError(f"epsilon-share = {share}; must be in (0, 1]")
    # delta is split like epsilon: however many rounds a server asks for, the phase's rounds
    # together cost at most (epsilon, delta) of the phase; a delta per round would grow with them
    return Request(run_id=run_key(msg, context), phase=phase, epsilon=budget * share, delta=float(delta) * share,
                   phase_budget=budget, vocabulary=vocabulary, round=int(conf.get("server-round", 0)),
                   params={k: v for k, v in conf.items() if k not in ("codes", "delta", "resume-key")},
                   digest=request_digest(msg.content))


@dataclass
class Output:
    """What a mechanism produced: the noised payload and its details for the ledger."""

    payload: Any
    private: dict[str, Any] = field(default_factory=dict)  # stays in the node's ledger
    accountant: tuple[str, dict[str, Any]] | None = None  # DP-SGD accountant state to persist


class Mechanism(ABC):
    """A DP mechanism run by ``release``: it computes on the records *and* adds the noise."""

    name: str = ""  # common.dp.GAUSSIAN | common.dp.DPSGD

    def cost(self, request: Request) -> tuple[float, float]:
        """(epsilon, delta) this release is charged; by default the request's."""
        return request.epsilon, request.delta

    def public(self, request: Request) -> dict[str, Any]:
        """Data-independent parameters stated to the server (e.g. sigma, sensitivity)."""
        return {}

    def steps(self, request: Request) -> tuple[int, int] | None:
        """(steps this release takes, steps this run may take in its phase), or None."""
        return None

    @abstractmethod
    def release(self, request: Request) -> Output:
        """Compute on the records and noise the result (called after the reservation)."""


class GaussianHistogram(Mechanism):
    """A vector of L2 ``sensitivity`` released with analytic Gaussian noise (Balle & Wang)."""

    name = GAUSSIAN

    def __init__(self, histogram: str, compute: Callable[[], np.ndarray], sensitivity: float) -> None:
        self.histogram, self.compute, self.sensitivity = histogram, compute, float(sensitivity)

    def public(self, request: Request) -> dict[str, Any]:  # noqa: D102
        return {"histogram": self.histogram, "sensitivity": self.sensitivity,
                "sigma": analytic_gaussian_sigma(request.epsilon, request.delta, self.sensitivity)}

    def release(self, request: Request) -> Output:  # noqa: D102
        sigma = self.public(request)["sigma"]
        return Output(gaussian_release(self.compute(), sigma, np.random.default_rng()))


def release(node: Node, request: Request, mechanism: Mechanism) -> tuple[Any, ConfigRecord]:
    """Reserve, run ``mechanism``, confirm, store; return (noised payload, the release's statement).

    A request this node already answered gets the stored reply and costs nothing.
    """
    stored = node.replies.get(request.run_id, request.phase, request.round, request.digest)
    if stored is not None:
        log.info("%s round %d of run %s was released before: replaying the same reply (no privacy cost)",
                 request.phase, request.round, request.run_id)
        return stored[0], ConfigRecord(stored[1])
    epsilon, delta = mechanism.cost(request)
    rel = Release(phase=request.phase, mechanism=mechanism.name, epsilon=epsilon, delta=delta,
                  run_id=request.run_id, round=request.round, public=mechanism.public(request))
    entry = node.ledger.reserve(rel, request.phase_budget, steps=mechanism.steps(request))
    try:
        out = mechanism.release(request)
    except BaseException as err:
        node.ledger.cancel(entry, f"{type(err).__name__} before anything left the node")
        raise
    node.ledger.confirm(entry, out.private, out.accountant)
    statement = statement_record(node, rel)
    node.replies.put(request.run_id, request.phase, request.round, request.digest, out.payload, dict(statement))
    return out.payload, statement


def statement_record(node: Node, rel: Release) -> ConfigRecord:
    """The release's statement plus the node's ledger totals (data-independent), for the report."""
    return R.release_record(rel.statement(), node.ledger.spent(), node.policy.epsilon)
