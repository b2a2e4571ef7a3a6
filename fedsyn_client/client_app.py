"""The fedsyn ClientApp: one handler per message type, all noise added here, on the node.

Every handler is wrapped by ``_handler(kind)``, which reads the node's policy (no data),
authorises the request against it (``release.authorise``), and only then opens the node's
records and ledger: a handler cannot skip the policy. Releases go through the one release path
(``release.release``), which reserves epsilon in the node's ledger, runs the mechanism
(compute + noise), confirms, and states the release. A weak node never imports the training
stack.

What the server learns when a node does not release: one of the fixed texts of
``fedsyn_client.refusals`` (which rule refused), never an exception's name or message, a
number or a path; the detail goes to this node's log.
"""

from __future__ import annotations

import json
import logging
import traceback
from collections.abc import Callable, Mapping
from typing import Any

from flwr.app import ConfigRecord, Context, Error, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from common import records as R
from common.config import ConfigError, RunConfig
from common.dp import MARGINALS, PROFILE, STRONG, TRAIN, VOTE
from common.logs import get_logger, plain_console
from common.marginals import cells, column_sizes
from common.models import load_embedder
from common.phases import phase as phase_named, phases
from fedsyn_client import refusals, secagg_node
from fedsyn_client.audit import audit_dir, audit_mod, check_audit_dir
from fedsyn_client.histograms import marginals_histogram, vote_histogram
from fedsyn_client.node import Node, node_policy, open_node, readable_schema
from fedsyn_client.placement import record_placement
from fedsyn_client.refusals import NodeSetupError, Refusal, public_reason
from fedsyn_client.release import LEDGER, TIER, GaussianHistogram, ReleaseFailed, Request, authorise, release, run_key

log = get_logger(__name__)
plain_console()  # no escape codes in streamed logs and log files
app = ClientApp(mods=[audit_mod])
Handler = Callable[[Message, Node, RunConfig, Request], RecordDict]


def _handler(kind: str) -> Callable[[Handler], Callable[[Message, Context], Message]]:
    """Wrap a handler of ``kind`` (a phase, ``TIER`` or ``LEDGER``): policy, ``authorise``, then
    the node's data; every failure becomes an error reply with a fixed text."""

    def wrap(fn: Handler) -> Callable[[Message, Context], Message]:
        def wrapped(msg: Message, context: Context) -> Message:
            try:
                cfg = RunConfig.from_flower(context.run_config)
                policy = node_policy(run_key(msg, context), dict(context.node_config), cfg)
                check_audit_dir(audit_dir(context))
                if policy.simulated:
                    record_placement(policy.state_dir, kind, policy.partition[0])
                request = authorise(msg, context, policy, cfg, kind)
                return Message(fn(msg, open_node(policy, cfg), cfg, request), reply_to=msg)
            except Refusal as err:  # the node's own set-up is an error for its operator; a refusal is a warning
                log.log(logging.ERROR if isinstance(err, NodeSetupError) else logging.WARNING, "%s refused (%s): %s",
                        kind, err.reply, err)
                return _error(msg, err.code, err.reply)
            except ConfigError as err:
                log.error("%s: invalid request: %s", kind, err)
                return _error(msg, R.ERR_CONFIG, refusals.REQUEST)
            except ReleaseFailed as err:
                log.error("%s\n%s", err, traceback.format_exc())
                return _error(msg, R.ERR_INTERNAL, refusals.FAILED)
            except Exception:  # noqa: BLE001 - a node must answer, never crash the run
                log.error("handler %s failed:\n%s", fn.__name__, traceback.format_exc())
                return _error(msg, R.ERR_INTERNAL, refusals.FAILED)

        wrapped.__name__ = fn.__name__
        return wrapped

    return wrap


def _error(msg: Message, code: int, reason: str) -> Message:
    return Message(Error(code, public_reason(reason)), reply_to=msg)


# The node's release for each phase (``common.phases``), by name: what it computes on its records.
RELEASES: dict[str, Handler] = {}


def serves(name: str) -> Callable[[Handler], Handler]:
    """Make the decorated handler this node's release for the registered phase ``name``: served on
    the app under the phase's message type, behind ``_handler`` (policy, authorise, then the data).
    A phase registered from outside the packages is served the same way (``tests/test_toy_phase.py``)."""

    def add(fn: Handler) -> Handler:
        category, _, action = phase_named(name).message.partition(".")
        route = getattr(app, category)  # Flower's message categories: train, evaluate, query
        (route(action) if action else route())(_handler(name)(fn))
        RELEASES[name] = fn
        return fn

    return add


# --------------------------------------------------------------------------- stage 0
@app.query("tier")
@_handler(TIER)
def tier(msg: Message, node: Node, cfg: RunConfig, req: Request) -> RecordDict:
    """Reply with this node's tier, budget and pre-flight statement once the run's view,
    vocabulary, delta, models and per-phase epsilons are allowed by the policy.

    The pre-flight statement says whether the node's ledger can pay for every phase the
    server plans to ask of it (``phases``), so a run that some node cannot finish is refused
    before anything is spent. It is about the ledger (what earlier runs spent or hold), never
    about the records: no yes/no on which codes occur. A node that can finish the run holds the
    epsilon for it (``PrivacyLedger.hold``, under the run's ``hold-token``) until the run's
    end-of-run ledger query; the ledger still authorises every release.
    """
    pre = node.ledger.hold(req.run_id, req.epsilon, str(req.params.get("hold-token", "")),
                           node.policy.max_unconfirmed_holds)
    if pre.shortfall > 0:
        log.warning("pre-flight: this run needs epsilon = %.4g of this node but its ledger has %.4g left (budget "
                    "%g, %.4g of it held for other runs under way); this node cannot finish the run, and any release "
                    "beyond the budget will be refused", req.epsilon, max(pre.remaining, 0.0), node.policy.epsilon,
                    pre.held)
    return R.tier_reply(node.tier, node.policy.epsilon, req.epsilon, pre.remaining, pre.shortfall, pre.ref, pre.held,
                        node.policy.max_records, node.policy.min_honest_nodes)


# --------------------------------------------------------------------------- stage 1
@serves(TRAIN)
def train(msg: Message, node: Node, cfg: RunConfig, req: Request) -> RecordDict:
    """Algorithm A.3 on this node: tau DP-SGD steps from the global weights, reply the new weights."""
    if node.tier != STRONG or cfg.num_server_rounds < 1:  # authorise refuses both; kept as a last guard
        raise ConfigError("train was sent to a weak node, or in a run without phase 1")
    from fedsyn_client.train_release import DpSgdRound, accountant_key  # the training stack: strong nodes only

    state = node.ledger.accountant_state(accountant_key(req.run_id))
    free_text = cfg.free_text is not None  # a table's free-text column: DP-SGD reads that column alone
    mechanism = DpSgdRound(cfg, lambda: node.records(req.vocabulary, free_text),
                           msg.content.array_records.get(R.ARRAYS),  # type: ignore[arg-type]  # None: refused as bad weights by its check
                           state, msg.metadata.dst_node_id,
                           phase_reserved=node.ledger.spent(run_id=req.run_id, phase=TRAIN) > 0,
                           bound=node.bound)
    weights, statement = release(node, req, mechanism)
    # Uniform weight (A.3): a true example count would be an un-noised statistic.
    metrics = MetricRecord({R.WEIGHT_KEY: 1.0, "steps": float(cfg.local_steps)})
    return RecordDict({R.ARRAYS: R.arrays_from_state(weights), R.METRICS: metrics, R.RELEASE: statement})


# --------------------------------------------------------------------------- stage 2
@serves(PROFILE)
def profile(msg: Message, node: Node, cfg: RunConfig, req: Request) -> RecordDict:
    """Algorithm 1 stage 2: per-code counts + analytic Gaussian noise (L2 sensitivity 1)."""
    # One record is in exactly one bucket: adding/removing it moves one count by 1.
    # (records are restricted to the vocabulary, so every one is counted exactly once)
    counts = lambda: node.code_counts(req.vocabulary)  # noqa: E731 - one closure, two paths
    if R.SECAGG_STEP in req.params:  # a masked round (issue 73)
        return secagg_node.serve(msg, node, req, "code-counts", counts, 1.0, len(req.vocabulary))
    mechanism = GaussianHistogram("code-counts", counts, 1.0)
    noisy, statement = release(node, req, mechanism)
    return R.vector_reply(R.PROFILE, noisy, statement)


# --------------------------------------------------------------------------- stage 4
@serves(VOTE)
def vote(msg: Message, node: Node, cfg: RunConfig, req: Request) -> RecordDict:
    """A vote round: a registered histogram of the records over the candidates + Gaussian noise
    at its L2 sensitivity (default ``knn-vote``, Algorithm A.2, sensitivity sqrt(K))."""
    cand = msg.content.config_records.get(R.CANDIDATES)
    if cand is None:
        raise ConfigError("the vote request carries no candidates")
    texts, codes = [str(t) for t in cand["texts"]], [str(c) for c in cand["codes"]]  # type: ignore[union-attr]  # lists (flwr types a value as any scalar or list)
    if len(texts) != len(codes):
        raise ConfigError(f"{len(texts)} candidate texts but {len(codes)} codes")
    node.policy.check_candidates(len(texts))  # a vote's work grows with them: the policy bounds it, not the server
    name = str(req.params.get("histogram", "knn-vote"))
    free_text = cfg.free_text is not None  # a table's free text alone
    records = node.records(req.vocabulary, free_text)
    # a deployed node's records come embedded from its matrix (built once per snapshot, issue 61)
    embedded = node.embedded(req.vocabulary, free_text, cfg.embedder, cfg.vote_window, cfg.precision)
    compute, sensitivity = vote_histogram(name, records, texts, codes, req.params, cfg, bound=node.bound,
                                          embedded=embedded)
    if R.SECAGG_STEP in req.params:  # a masked round (issue 73)
        return secagg_node.serve(msg, node, req, name, compute, sensitivity, len(texts),
                                 prepare=lambda: load_embedder(cfg.embedder))
    noisy, statement = release(node, req, GaussianHistogram(name, compute, sensitivity,
                                                            prepare=lambda: load_embedder(cfg.embedder)))
    return R.vector_reply(R.VOTES, noisy, statement)


# --------------------------------------------------------------------------- a table by marginals
@serves(MARGINALS)
def marginals(msg: Message, node: Node, cfg: RunConfig, req: Request) -> RecordDict:
    """A marginals round (issue 48): the counts of the requested cliques' marginals over the public
    schema's bins + Gaussian noise at L2 sensitivity sqrt(number of cliques). ``authorise`` has
    checked the cliques against the schema and the policy's measurable columns."""
    table = cfg.schema()
    assert table is not None  # a marginals request is a table run's
    schema = readable_schema(table, node.policy)  # the columns the node's view was read with
    cliques = R.read_cliques(req.params)
    compute, sensitivity = marginals_histogram(node.records(req.vocabulary), cliques, schema, cfg.control_columns,
                                               cfg.marginal_bins, bound=node.bound)
    if R.SECAGG_STEP in req.params:  # a masked round (issue 73)
        length = sum(cells(c, column_sizes(schema, cfg.marginal_bins)) for c in cliques)
        return secagg_node.serve(msg, node, req, MARGINALS, compute, sensitivity, length)
    noisy, statement = release(node, req, GaussianHistogram(MARGINALS, compute, sensitivity))
    return R.vector_reply(R.MARGINALS, noisy, statement)


# --------------------------------------------------------------------------- after the run
@app.query("ledger")
@_handler(LEDGER)
def ledger(msg: Message, node: Node, cfg: RunConfig, req: Request) -> RecordDict:
    """This run's releases as the node's ledger has them (statements only; free): the
    server's privacy report is built from the node's own book, including releases whose
    reply was lost. Ends the run's hold when the request carries the run's ``hold-token``."""
    conf: Mapping[str, Any] = msg.content.config_records.get(R.CONFIG, {})
    statements = node.ledger.run_statements(req.run_id)
    node.ledger.release_hold(req.run_id, str(conf.get("hold-token", "")))
    return RecordDict({R.LEDGER: ConfigRecord({
        "releases": json.dumps(statements, allow_nan=True),
        "epsilon-spent": float(node.ledger.spent()), "epsilon-budget": float(node.policy.epsilon),
        "epsilon-run": float(sum(s["epsilon"] for s in statements)) if statements else 0.0,
        "ledger-ref": node.ledger.ref,
    })})


# every registered phase has its release here: a phase the node cannot serve is a set-up error, found
# at import, not a request answered by Flower's "no function registered"
_unserved = [p.name for p in phases() if p.name not in RELEASES]
if _unserved:
    raise RuntimeError(f"phases {_unserved} have no release on the node (fedsyn_client.client_app.serves)")
