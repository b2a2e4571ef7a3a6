"""The one release path on a node: authorise -> reserve -> compute + noise -> confirm -> reply.

Every message goes through ``authorise`` before it touches data (the ClientApp's handler
wrapper calls it for every message type, so a new one cannot skip it), and every message
that releases something derived from the records (training, profile, vote, and any histogram
a refinement adds) goes through ``release``, so a new mechanism gets the same protection by
construction:

1. **authorise** against the node's policy (``NodePolicy.authorise``: data view, vocabulary,
   delta, per-phase caps, the models it runs) -- before any record is read; then the
   mechanism's own data-independent checks of the request (``Mechanism.check``: e.g. incoming
   weights finite, bounded and the model's); a request this node already answered (same run
   key, phase, round and content) gets its stored reply, at no cost (``fedsyn_client.replies``);
2. **reserve** epsilon in the ledger under its file lock (total budget, this run's budget for
   the phase, the policy's cap for the phase across runs; DP-SGD also its step budget and the
   terms its noise was calibrated for);
3. **compute and noise** in the mechanism (``Mechanism.release``);
4. **confirm** in the ledger with the private details, and store the noised reply for a
   repeated request. A failure after the reservation is marked *failed* and stays charged:
   were it free, a server could ask for a release that fails on a condition of the records
   and learn the condition at no cost. Its reply is one fixed text, whatever failed;
5. **reply** with the release's *statement*: phase, mechanism, epsilon, delta and only
   data-independent parameters (sigma and sensitivity of a Gaussian, DP-SGD's steps) --
   never a sampling rate, noise multiplier or count from which |D| follows.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
from flwr.app import ConfigRecord, Context, Message

from common import records as R
from common.accounting import DEFAULT as DEFAULT_ACCOUNTING, Accounting, rule as accounting_rule
from common.calibration import Planned, basic_delta, release_base, rounds_of
from common.config import ConfigError, RunConfig
from common.dp import GAUSSIAN, PHASES, analytic_gaussian_sigma, gaussian_release
from common.logs import get_logger
from common.phases import phase as phase_named, phases
from common.rows import canonical
from fedsyn_client import refusals
from fedsyn_client.admission import Rule
from fedsyn_client.ledger import Release
from fedsyn_client.node import Node
from fedsyn_client.policy import Ask, NodePolicy
from fedsyn_client.refusals import BudgetExceeded, NodeSetupError
from fedsyn_client.replies import check_run_key, request_digest

log = get_logger(__name__)
TIER, LEDGER = "tier", "ledger"  # the message kinds that release nothing


@dataclass(frozen=True)
class Request:
    """A request as this node read and authorised it."""

    run_id: str
    phase: str  # a release's phase, or TIER / LEDGER
    epsilon: float  # what this release costs (basic composition)
    delta: float
    phase_budget: float  # this run's epsilon for the phase (node-side split, capped by the policy)
    vocabulary: tuple[str, ...]
    round: int = 0
    params: dict[str, Any] = field(default_factory=dict)  # the message's other config values
    digest: str = ""  # of the whole request, to answer a repeat with the stored reply
    needs: dict[str, float] = field(default_factory=dict)  # TIER: this run's epsilon per planned phase
    cap: tuple[float, float] | None = None  # the policy's cap for the phase and its window (days)
    accounting: str = DEFAULT_ACCOUNTING  # the node's rule (policy accounting): how the release is priced and noised
    # the node's budget (policy epsilon, delta), set by ``release``: under pld every release is
    # composed at this delta, under basic a release's delta is its split of it (``under_policy``)
    policy_epsilon: float = math.inf
    policy_delta: float = 0.0

    @property
    def rule(self) -> Accounting:
        """The node's accounting rule (``common.accounting``) this request is priced by."""
        return accounting_rule(self.accounting)


def run_key(msg: Message, context: Context) -> str:
    """The run a request belongs to on this node: its ``resume-key`` (a resumed run repeats
    the original run's) or the Flower run id. Budgets per run and stored replies use it."""
    conf = msg.content.config_records[R.CONFIG] if R.CONFIG in msg.content.config_records else {}
    return check_run_key(str(conf.get("resume-key") or context.run_id))


def authorise(msg: Message, context: Context, policy: NodePolicy, cfg: RunConfig, kind: str) -> Request:
    """Read a request of ``kind`` (a phase, ``TIER`` or ``LEDGER``) and authorise it against the
    node's policy; nothing is read from the records.

    The run's epsilon for a phase is the appendix-B split of the run's per-node epsilon
    (checked to be within the node's budget), capped by the policy's per-phase cap. An
    ``epsilon-share`` in (0, 1] asks for that part of it *and* of delta (a refinement with
    several vote rounds): the rounds of a phase never compose to more than (epsilon, delta).
    The tier query is authorised for every phase it plans for this node's tier.
    Raises ``PolicyRefused`` or ``ConfigError``.
    """
    key = run_key(msg, context)
    if kind == LEDGER:  # the node's own book of this run: free, and touches no record
        return Request(run_id=key, phase=LEDGER, epsilon=0.0, delta=0.0, phase_budget=0.0, vocabulary=())
    conf: dict[str, Any] = dict(msg.content.config_records[R.CONFIG]) if R.CONFIG in msg.content.config_records else {}
    vocabulary = tuple(str(c) for c in conf.get("codes", []))
    needs = {p.name: p.share(cfg, policy.tier) for p in phases()}
    if kind == TIER:
        planned = {p: needs[p] for p in (str(x) for x in conf.get("phases", PHASES)) if p in needs and needs[p] > 0}
    else:
        if "delta" not in conf:
            raise ConfigError(f"the {kind} request carries no delta")
        planned = {kind: needs[kind]}
    policy.authorise(Ask(text_column=cfg.text_column, control_columns=cfg.control_columns, epsilon=cfg.epsilon,
                         vocabulary=vocabulary, phases=tuple(planned.items()), delta=conf.get("delta"),
                         model=cfg.model, embedder=cfg.embedder, finetune=cfg.finetune,
                         table_schema=canonical(cfg.schema()), max_length=cfg.max_length,
                         vote_window=cfg.vote_window, vote_precision=cfg.precision, local_steps=cfg.local_steps,
                         batch_size=cfg.batch_size, rounds=cfg.num_server_rounds,
                         measured=measured_columns(cfg, conf, policy)
                         if kind != TIER and phase_named(kind).reads == "measured"
                         else ()))  # a marginals request's cliques name the columns it counts
    if kind == TIER:
        return Request(run_id=key, phase=TIER, epsilon=float(sum(planned.values())), delta=0.0, phase_budget=0.0,
                       vocabulary=vocabulary, params=conf, needs=planned)
    share = conf.get("epsilon-share", 1.0)
    if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 < share <= 1:
        raise ConfigError(f"epsilon-share = {share!r}; must be in (0, 1]")
    policy.check_share(float(share))
    budget, cap = planned[kind], policy.cap(kind)
    # delta is split like epsilon: however many rounds a server asks for, the phase's rounds
    # together cost at most (epsilon, delta) of the phase; a delta per round would grow with them
    return Request(run_id=key, phase=kind, epsilon=budget * share, delta=float(conf["delta"]) * share,
                   phase_budget=budget, vocabulary=vocabulary, round=int(conf.get("server-round", 0)),
                   params={k: v for k, v in conf.items() if k not in ("codes", "delta", "resume-key")},
                   digest=request_digest(msg.content, computation_terms(cfg)),
                   cap=(cap, policy.cap_window_days) if cap is not None else None, accounting=policy.accounting)


def measured_columns(cfg: RunConfig, conf: dict[str, Any], policy: NodePolicy) -> tuple[str, ...]:
    """The columns a marginals request's cliques name, checked against the run's schema (``ConfigError``
    for a malformed request) and the policy's ``max-marginal-cells`` (``PolicyRefused``): nothing read,
    nothing spent."""
    from common.marginals import cells, column_sizes

    schema = cfg.schema()
    if schema is None or not cfg.marginals:
        raise ConfigError("a marginals request in a run that is not a table by marginals (table-method 'marginals', "
                          "or 'auto' with a table-schema)")
    try:
        cliques = R.read_cliques(conf)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    sizes = column_sizes(schema, cfg.marginal_bins)
    unknown = sorted({a for c in cliques for a in c} - set(sizes))
    if unknown:
        raise ConfigError(f"the marginals request names columns {unknown} that are not counted columns of the run's "
                          "table-schema (a free-text column never is)")
    total = sum(cells(c, sizes) for c in cliques)
    policy.check_cells(total)
    return tuple(a for a in schema.names if any(a in c for c in cliques))


# The run-config terms a node's computation reads (besides the message): a request under other
# terms is another request, so it never gets a stored reply or takes over a dead reservation.
COMPUTATION_TERMS = ("model", "finetune", "lora_rank", "lora_layers", "embedder", "vote_window", "max_length",
                     "text_column", "control_columns", "table_schema", "table_method", "marginal_bins",
                     "marginal_share", "prompt", "zero_shot_template", "batch_size", "local_steps",
                     "num_server_rounds", "learning_rate", "max_grad_norm", "contrastive_weight", "precision",
                     "seed", "epsilon", "epsilon_profile", "voters", "accounting", "dataset", "partitioning",
                     "strong_fraction", "test_fraction", "min_honest_nodes")


def computation_terms(cfg: RunConfig) -> dict[str, Any]:
    """The values of ``COMPUTATION_TERMS`` in ``cfg`` (JSON-ready)."""
    return {k: (list(v) if isinstance(v := getattr(cfg, k), tuple) else v) for k in COMPUTATION_TERMS}


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

    def binding(self, request: Request) -> dict[str, Any] | None:
        """What this release's noise is calibrated for, when later rounds share its
        reservation (DP-SGD): a later round under other terms is refused. None: no binding."""
        return None

    def check(self, request: Request) -> None:
        """Data-independent checks of the request's inputs, before the reservation (e.g. the
        incoming weights); raise a ``Refusal``. Nothing here may read a record."""

    def calibrate(self, request: Request, before: list[dict[str, Any]]) -> None:
        """Fix the noise under the ``pld`` rule from ``before``, this run's earlier ledger entries
        (public values only); called before ``charge`` and ``public``. By default nothing."""

    def charge(self, request: Request, before: list[dict[str, Any]]) -> float | None:
        """The epsilon this release costs after ``before`` under the ``pld`` rule (the ledger prices
        it again under its lock), or None when ``cost`` prices it."""
        return None

    def terms(self, request: Request, reserved: bool) -> dict[str, Any]:
        """The private terms the ledger composes this release by, where ``public`` does not hold
        them (DP-SGD's noise multiplier and q): before the reservation (``reserved`` False) what
        needs no record, stored with it; after it, what does (read before anything is computed).
        {} by default (a Gaussian's sigma is public)."""
        return {}

    @abstractmethod
    def release(self, request: Request) -> Output:
        """Compute on the records and noise the result (called after the reservation)."""


class GaussianHistogram(Mechanism):
    """A vector of L2 ``sensitivity`` released with analytic Gaussian noise (Balle & Wang)."""

    name = GAUSSIAN

    def __init__(self, histogram: str, compute: Callable[[], np.ndarray], sensitivity: float,
                 prepare: Callable[[], object] | None = None) -> None:
        self.histogram, self.compute, self.sensitivity = histogram, compute, float(sensitivity)
        self.prepare = prepare  # loads what the computation needs (an embedder): a public fact
        self.noise_multiplier: float | None = None  # fixed by ``calibrate`` under pld: the phase's, every round's

    def check(self, request: Request) -> None:
        """What the computation needs is loaded before the reservation: a model that is not
        installed is a fact of the node, refused (and not charged) before the data is opened."""
        if self.prepare is not None:
            try:
                self.prepare()
            except Exception as err:  # noqa: BLE001 - any failure to load is the node's set-up
                raise NodeSetupError(f"{self.histogram}: cannot load what it needs: {type(err).__name__}: "
                                     f"{str(err)[:300]}") from None

    def binding(self, request: Request) -> dict[str, Any]:
        """A run's rounds of a phase share one split: the first round fixes each round's (epsilon,
        delta), hence their number, and under pld the noise multiplier all of them use; a round asking
        another share, or priced on another history, under the same run key is refused."""
        bound = {"epsilon": float(request.epsilon), "delta": float(request.delta)}
        if self.noise_multiplier is None:  # each release solves its own sigma (basic)
            return bound
        # the multiplier, not sigma: a phase's rounds may measure vectors of other sensitivities
        # (a marginals run's round 2 asks fewer marginals than round 1) at one noise multiplier
        return {**bound, "accounting": request.accounting, "noise_multiplier": self.noise_multiplier}

    def calibrate(self, request: Request, before: list[dict[str, Any]]) -> None:
        """Under pld, the phase's T = 1 / epsilon-share rounds share one sigma, solved at its first
        round so that they and every earlier release of the node (other runs' too, a DP-SGD phase
        at its q) compose at the policy's delta to the earlier ones' epsilon plus the phase's:
        exact composition instead of epsilon / T per round, and never at a delta that grows with
        the releases (issue 60). Later rounds keep the multiplier the first one bound."""
        if not math.isfinite(request.epsilon):
            return  # no DP: no noise, priced inf as under basic
        mine = [e for e in before if e["run_id"] == request.run_id and e["phase"] == request.phase]
        bound = next((e["binding"] for e in mine if (e.get("binding") or {}).get("noise_multiplier")), None)
        if bound is not None:  # other runs' releases since round 1 do not move the phase's noise
            self.noise_multiplier = float(bound["noise_multiplier"])
            return
        rounds = rounds_of(request.epsilon / request.phase_budget) if request.phase_budget > 0 else 1
        earlier = release_base([e for e in before if not (e["run_id"] == request.run_id
                                                          and e["phase"] == request.phase)])
        # solved at sensitivity 1: the composition depends on sigma / sensitivity alone, so every
        # round of the phase gets the same multiplier whatever its vector's sensitivity
        phase = Planned(request.phase, GAUSSIAN, request.epsilon * rounds, request.delta * rounds, 1.0, rounds=rounds)
        self.noise_multiplier = request.rule.gaussian_multiplier(earlier, phase, request.policy_delta)
        if self.noise_multiplier is not None and math.isinf(self.noise_multiplier):
            # no finite noise meets the share on this ledger (a share below the accountant's resolution,
            # or nothing left of the policy's delta): refused before the reservation, as a budget is;
            # reserved, it would fail on an infinite sigma. The ledger and request decide it, no record.
            raise no_finite_noise(request, request.epsilon)

    @property
    def sigma(self) -> float | None:
        """Under pld, this round's sigma (the phase's multiplier times this vector's sensitivity);
        None under basic, where ``public`` solves it per request."""
        return None if self.noise_multiplier is None else self.noise_multiplier * self.sensitivity

    def charge(self, request: Request, before: list[dict[str, Any]]) -> float | None:  # noqa: D102 - documented on Mechanism
        if self.sigma is None:  # its request's epsilon prices it
            return None
        return request.rule.gaussian_charge(release_base(before), self.sigma, self.sensitivity, request.policy_delta,
                                            request.delta)

    def public(self, request: Request) -> dict[str, Any]:  # noqa: D102 - documented on Mechanism
        if self.sigma is None:  # basic: ``release`` has split delta already
            basic = analytic_gaussian_sigma(request.epsilon, request.delta, self.sensitivity)
            return {"histogram": self.histogram, "sensitivity": self.sensitivity, "sigma": basic}
        # the report shows each release's sigma under both rules (issue 47): both are public, and
        # so is the delta the node composes at (its policy's, issue 60)
        split = basic_delta(request.delta, request.epsilon, request.policy_epsilon, request.policy_delta)
        return {"histogram": self.histogram, "sensitivity": self.sensitivity, "sigma": self.sigma,
                "accounting": request.accounting,
                "sigma_basic": analytic_gaussian_sigma(request.epsilon, split, self.sensitivity),
                "composed_delta": request.policy_delta}

    def release(self, request: Request) -> Output:  # noqa: D102 - documented on Mechanism
        sigma = self.public(request)["sigma"]
        return Output(gaussian_release(self.compute(), sigma, np.random.default_rng()))


def no_finite_noise(request: Request, share: float) -> BudgetExceeded:
    """The refusal, before any reservation, of a release whose ``share`` no finite noise spends on
    this node's ledger (the ledger and the request decide it, never a record)."""
    return BudgetExceeded(refusals.BUDGET, (
        f"{request.phase}: refused, no finite noise spends epsilon = {share:.4g} on this node's "
        f"ledger under {request.accounting} at delta = {request.policy_delta:g} (the share is below the "
        "accountant's resolution, or nothing is left of the delta)"))


def release(node: Node, request: Request, mechanism: Mechanism) -> tuple[Any, ConfigRecord]:
    """Reserve, run ``mechanism``, confirm, store; return (noised payload, the release's statement).

    A request this node already answered gets the stored reply and costs nothing.
    """
    stored = node.replies.get(request.run_id, request.phase, request.round, request.digest)
    if stored is not None:
        log.info("%s round %d of run %s was released before: replaying the same reply (no privacy cost)",
                 request.phase, request.round, request.run_id)
        return stored[0], ConfigRecord(stored[1])
    request = under_policy(request, node.policy.epsilon, node.policy.delta)
    mechanism.check(request)
    epsilon, delta = mechanism.cost(request)
    priced, early = None, {}
    if request.rule.composes_ledger:  # the ledger's earlier releases price it (public values), again under the lock
        before = node.ledger.entries_before(request.run_id, request.phase, request.round)
        mechanism.calibrate(request, before)
        priced = mechanism.charge(request, before)
        early = mechanism.terms(request, reserved=False)
    rel = Release(phase=request.phase, mechanism=mechanism.name, epsilon=epsilon if priced is None else priced,
                  delta=delta, run_id=request.run_id, round=request.round, public=mechanism.public(request),
                  private=early)
    rule = Rule(request.rule, request.policy_delta)
    entry = node.ledger.reserve(rel, request.phase_budget, steps=mechanism.steps(request), cap=request.cap,
                                binding=mechanism.binding(request), digest=request.digest,
                                charge=None if priced is None else (lambda entries: mechanism.charge(request, entries)),  # type: ignore[arg-type, return-value]  # priced: the charge is a float
                                rule=rule)
    if priced is not None:
        rel = replace(rel, epsilon=node.ledger.charged(entry))
    try:
        late = mechanism.terms(request, reserved=True) if request.rule.composes_ledger and not early else {}
        if late:  # composed before anything is computed: a budget this no longer fits fails the round
            node.ledger.note(entry, late, rule)
        out = mechanism.release(request)
        if not _finite(out.payload):  # never computed from a non-finite value, never released as one
            raise FloatingPointError("the noised release is not finite")
    except BaseException as err:
        node.ledger.fail(entry, f"{type(err).__name__} after the reservation")
        if not isinstance(err, Exception):  # an interrupt or exit stays one (still charged)
            raise
        raise ReleaseFailed(f"{request.phase} round {request.round} failed after its reservation "
                            f"(charged): {type(err).__name__}: {err}") from err
    node.ledger.confirm(entry, out.private, out.accountant)
    statement = statement_record(node, rel)
    node.replies.put(request.run_id, request.phase, request.round, request.digest, out.payload, dict(statement))
    return out.payload, statement


def under_policy(request: Request, epsilon: float, delta: float) -> Request:
    """``request`` under the node's budget (``epsilon``, ``delta``, its policy's): under basic its
    delta becomes its declared split of the policy's (``common.calibration.basic_delta``), so the
    deltas of the node's releases add up within it as their epsilons do; under pld the request's
    delta stays what it asked (stated), and every release is composed at the policy's."""
    split = request.rule.release_delta(request.delta, request.epsilon, epsilon, delta)
    return replace(request, delta=split, policy_epsilon=float(epsilon), policy_delta=float(delta))


class ReleaseFailed(RuntimeError):
    """A release failed after its reservation (it stays charged); the server gets one fixed text."""


def _finite(payload: Any) -> bool:
    values = payload.values() if isinstance(payload, dict) else [payload]
    return all(np.isfinite(np.asarray(v)).all() for v in values)


def statement_record(node: Node, rel: Release) -> ConfigRecord:
    """The release's statement plus the node's ledger totals (data-independent), for the report."""
    return R.release_record(rel.statement(), node.ledger.spent(), node.policy.epsilon)
