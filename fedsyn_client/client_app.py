"""The fedsyn ClientApp: one handler per message type, all noise added here, on the node.

Each handler builds this node (its policy is checked against the run before any record is
read), reads and authorises the request (``release.read_request``), and hands the
computation to the one release path (``release.release``), which reserves epsilon in the
node's ledger, runs the mechanism (compute + noise), confirms, and states the release.
A weak node never imports the training stack.
"""

from __future__ import annotations

import json
import traceback
from collections.abc import Callable

from flwr.app import ConfigRecord, Context, Error, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from common import records as R
from common.config import ConfigError, RunConfig
from common.dp import PHASES, PROFILE, STRONG, TRAIN, VOTE, phase_epsilon
from common.ledger import BudgetExceeded
from common.logs import get_logger
from common.policy import PolicyRefused
from fedsyn_client.audit import audit_mod
from fedsyn_client.histograms import vote_histogram
from fedsyn_client.node import Node, NodeSetupError, get_node
from fedsyn_client.release import GaussianHistogram, read_request, release, run_key

log = get_logger(__name__)
app = ClientApp(mods=[audit_mod])


def _handler(fn: Callable[[Message, Context, Node, RunConfig], RecordDict]) -> Callable[[Message, Context], Message]:
    """Wrap a handler: build the node, turn known failures into error replies.

    Unexpected exceptions reply with the exception type only: a message could quote a
    private record, so the traceback stays in the node's log.
    """

    def wrapped(msg: Message, context: Context) -> Message:
        try:
            cfg = RunConfig.from_flower(context.run_config)
            node = get_node(run_key(msg, context), dict(context.node_config), cfg)
            return Message(fn(msg, context, node, cfg), reply_to=msg)
        except BudgetExceeded as err:
            log.warning("%s", err)
            return Message(Error(R.ERR_BUDGET, str(err)), reply_to=msg)
        except PolicyRefused as err:
            log.warning("refused by this node's policy: %s", err)
            return Message(Error(R.ERR_POLICY, f"refused by the node's policy: {err}"), reply_to=msg)
        except (ConfigError, NodeSetupError) as err:
            log.error("%s", err)
            return Message(Error(R.ERR_CONFIG, str(err)), reply_to=msg)
        except Exception as err:  # noqa: BLE001 - a node must answer, never crash the run
            log.error("handler %s failed:\n%s", fn.__name__, traceback.format_exc())
            return Message(Error(R.ERR_INTERNAL, f"{type(err).__name__} on the node (see the node's log)"), reply_to=msg)

    wrapped.__name__ = fn.__name__
    return wrapped


# --------------------------------------------------------------------------- stage 0
@app.query("tier")
@_handler
def tier(msg: Message, context: Context, node: Node, cfg: RunConfig) -> RecordDict:
    """Reply with this node's tier, budget and pre-flight statement once the run's view,
    vocabulary, delta and per-phase epsilons are allowed by the policy.

    The pre-flight statement says whether the node's ledger can pay for every phase the
    server plans to ask of it (``phases``), so a run that some node cannot finish is refused
    before anything is spent. It is about the ledger (what earlier runs spent or hold), never
    about the records: no yes/no on which codes occur. A node that can finish the run holds the
    epsilon for it (``PrivacyLedger.hold``) until the run's end-of-run ledger query; the ledger
    still authorises every release.
    """
    conf = msg.content.config_records[R.CONFIG] if R.CONFIG in msg.content.config_records else {}
    node.policy.check_vocabulary(tuple(str(c) for c in conf.get("codes", [])))
    if "delta" in conf:
        node.policy.check_delta(conf["delta"])
    planned = [str(p) for p in conf.get("phases", PHASES)]
    needs = {p: phase_epsilon(cfg.epsilon, cfg.epsilon_profile, node.tier, cfg.voters, p) for p in planned if p in PHASES}
    for phase, eps in needs.items():
        if eps > 0:
            node.policy.check_phase(phase, eps)
    needed, key = float(sum(needs.values())), run_key(msg, context)
    pre = node.ledger.hold(key, needed)  # held for this run, so a run started beside it is refused here
    if pre.shortfall > 0:
        log.warning("pre-flight: this run needs epsilon = %.4g of this node but its ledger has %.4g left (budget "
                    "%g, %.4g of it held for other runs under way); this node cannot finish the run, and any release "
                    "beyond the budget will be refused", needed, max(pre.remaining, 0.0), node.policy.epsilon, pre.held)
    return R.tier_reply(node.tier, node.policy.epsilon, needed, pre.remaining, pre.shortfall, pre.ref, pre.held)


# --------------------------------------------------------------------------- stage 1
@app.train()
@_handler
def train(msg: Message, context: Context, node: Node, cfg: RunConfig) -> RecordDict:
    """Algorithm A.3 on this node: tau DP-SGD steps from the global weights, reply the new weights."""
    if node.tier != STRONG:
        raise ConfigError("train was sent to a weak node; weak nodes do not finetune")
    if cfg.num_server_rounds < 1:
        raise ConfigError("train was sent but this run has num-server-rounds = 0 (no phase 1)")
    from fedsyn_client.train_release import DpSgdRound, accountant_key  # the training stack: strong nodes only

    req = read_request(msg, context, node, cfg, TRAIN)
    state = node.ledger.accountant_state(accountant_key(req.run_id))
    mechanism = DpSgdRound(cfg, node.records(req.vocabulary), msg.content.array_records[R.ARRAYS], state,
                           context.node_id, phase_reserved=node.ledger.spent(run_id=req.run_id, phase=TRAIN) > 0)
    weights, statement = release(node, req, mechanism)
    # Uniform weight (A.3): a true example count would be an un-noised statistic.
    metrics = MetricRecord({R.WEIGHT_KEY: 1.0, "steps": float(cfg.local_steps)})
    return RecordDict({R.ARRAYS: R.arrays_from_state(weights), R.METRICS: metrics, R.RELEASE: statement})


# --------------------------------------------------------------------------- stage 2
@app.query("profile")
@_handler
def profile(msg: Message, context: Context, node: Node, cfg: RunConfig) -> RecordDict:
    """Algorithm 1 stage 2: per-code counts + analytic Gaussian noise (L2 sensitivity 1)."""
    req = read_request(msg, context, node, cfg, PROFILE)
    records = node.records(req.vocabulary)
    # One record is in exactly one bucket: adding/removing it moves one count by 1.
    # (records are restricted to the vocabulary, so every one is counted exactly once)
    mechanism = GaussianHistogram("code-counts", lambda: records.code_counts(req.vocabulary), 1.0)
    noisy, statement = release(node, req, mechanism)
    return R.vector_reply(R.PROFILE, noisy, statement)


# --------------------------------------------------------------------------- stage 4
@app.query("vote")
@_handler
def vote(msg: Message, context: Context, node: Node, cfg: RunConfig) -> RecordDict:
    """A vote round: a registered histogram of the records over the candidates + Gaussian noise
    at its L2 sensitivity (default ``knn-vote``, Algorithm A.2, sensitivity sqrt(K))."""
    cand = msg.content.config_records[R.CANDIDATES]
    texts, codes = [str(t) for t in cand["texts"]], [str(c) for c in cand["codes"]]
    if len(texts) != len(codes):
        raise ConfigError(f"{len(texts)} candidate texts but {len(codes)} codes")
    req = read_request(msg, context, node, cfg, VOTE)
    name = str(req.params.get("histogram", "knn-vote"))
    compute, sensitivity = vote_histogram(name, node.records(req.vocabulary), texts, codes, req.params, cfg)
    noisy, statement = release(node, req, GaussianHistogram(name, compute, sensitivity))
    return R.vector_reply(R.VOTES, noisy, statement)


# --------------------------------------------------------------------------- after the run
@app.query("ledger")
@_handler
def ledger(msg: Message, context: Context, node: Node, cfg: RunConfig) -> RecordDict:
    """This run's releases as the node's ledger has them (statements only; free): the
    server's privacy report is built from the node's own book, including releases whose
    reply was lost."""
    key = run_key(msg, context)
    statements = node.ledger.run_statements(key)
    node.ledger.release_hold(key)  # the run is over (or refused): what it did not spend is free again
    return RecordDict({R.LEDGER: ConfigRecord({
        "releases": json.dumps(statements, allow_nan=True),
        "epsilon-spent": float(node.ledger.spent()), "epsilon-budget": float(node.policy.epsilon),
        "epsilon-run": float(sum(s["epsilon"] for s in statements)) if statements else 0.0,
        "ledger-ref": node.ledger.ref,
    })})
