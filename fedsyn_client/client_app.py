"""The fedsyn ClientApp: one handler per message type, all noise added here, on the node.

Every handler follows the same order: read configs -> authorise the release against
the node's own ledger (before any work) -> compute -> add noise -> record the release
on disk -> reply. A weak node never imports the training stack.
"""

from __future__ import annotations

import math
import traceback
from collections.abc import Callable
from functools import lru_cache

import numpy as np
from flwr.app import Context, Error, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from common.logs import get_logger
from common import records as R
from common.config import ConfigError, RunConfig
from common.dp import STRONG, analytic_gaussian_sigma, dpsgd_epsilon, dpsgd_noise_multiplier, gaussian_release
from common.ledger import BudgetExceeded, Release
from fedsyn_client.audit import audit_mod
from fedsyn_client.node import Node, NodeSetupError, get_node
from fedsyn_client.voting import knn_votes

log = get_logger(__name__)
app = ClientApp(mods=[audit_mod])

# Error codes in replies (Flower reserves small ints; these are app-level).
ERR_BUDGET = 1001  # refused: would exceed the node's privacy budget
ERR_CONFIG = 1002  # the node's or the run's configuration is unusable
ERR_INTERNAL = 1003  # anything else; details stay in the node's log
_TOL = 1e-6


def _handler(fn: Callable[[Message, Context, Node, RunConfig], RecordDict]) -> Callable[[Message, Context], Message]:
    """Wrap a handler: build the node, turn known failures into error replies.

    Unexpected exceptions reply with the exception type only: a message could quote a
    private record, so the traceback stays in the node's log.
    """

    def wrapped(msg: Message, context: Context) -> Message:
        try:
            cfg = RunConfig.from_flower(context.run_config)
            node = get_node(context.run_id, dict(context.node_config), cfg)
            return Message(fn(msg, context, node, cfg), reply_to=msg)
        except BudgetExceeded as err:
            log.warning("%s", err)
            return Message(Error(ERR_BUDGET, str(err)), reply_to=msg)
        except (ConfigError, NodeSetupError) as err:
            log.error("%s", err)
            return Message(Error(ERR_CONFIG, str(err)), reply_to=msg)
        except Exception as err:  # noqa: BLE001 - a node must answer, never crash the run
            log.error("handler %s failed:\n%s", fn.__name__, traceback.format_exc())
            return Message(Error(ERR_INTERNAL, f"{type(err).__name__} on the node (see the node's log)"), reply_to=msg)

    wrapped.__name__ = fn.__name__
    return wrapped


def _check_delta(node: Node, delta: float) -> None:
    if not 0 < delta < 1:
        raise ConfigError(f"delta = {delta} from the server is not in (0, 1)")
    if delta >= 1.0 / len(node.data):
        log.warning("delta = %g >= 1/%d records on this node: the guarantee is weak; choose a smaller delta",
                    delta, len(node.data))


def _authorise(node: Node, run_id: str, phase: str, epsilon: float, voters: str) -> None:
    """Refuse (before any work) a release beyond the node's total or per-phase budget."""
    node.ledger.check(epsilon, phase)
    allowed = node.phase_epsilon(phase, voters)
    already = node.ledger.spent(run_id=run_id, phase=phase)
    if math.isfinite(allowed) and already + epsilon > allowed + _TOL:
        raise BudgetExceeded(
            f"{phase}: refused, this run's {phase} budget is epsilon = {allowed:g} and {already:.4g} "
            f"is spent; the request needs {epsilon:.4g} more"
        )


def _release_reply(node: Node, release: Release) -> R.ConfigRecord:
    node.ledger.record(release)
    return R.release_record(release.to_dict(), node.ledger.spent(), node.epsilon_budget)


# --------------------------------------------------------------------------- stage 0
@app.query("tier")
@_handler
def tier(msg: Message, context: Context, node: Node, cfg: RunConfig) -> RecordDict:
    """Reply with this node's tier and whether all its records' codes are in the vocabulary."""
    vocabulary = list(msg.content.config_records[R.CONFIG]["codes"])
    unknown = set(node.data.codes) - set(vocabulary)
    if unknown:
        # The codes themselves stay here: only the fact that the check failed leaves.
        log.error("%d records have codes outside the public vocabulary: %s", 
                  sum(c in unknown for c in node.data.codes), sorted(unknown))
    return R.tier_reply(node.tier, not unknown, node.epsilon_budget)


# --------------------------------------------------------------------------- stage 1
@lru_cache(maxsize=8)
def _noise_multiplier(epsilon: float, delta: float, q: float, steps: int) -> float:
    return dpsgd_noise_multiplier(epsilon, delta, q, steps)


@app.train()
@_handler
def train(msg: Message, context: Context, node: Node, cfg: RunConfig) -> RecordDict:
    """Algorithm A.3 on this node: tau DP-SGD steps from the global weights, reply the new weights."""
    if node.tier != STRONG:
        raise NodeSetupError("train was sent to a weak node; weak nodes do not finetune")
    from common.models import load_generator  # the training stack: strong nodes only
    from common.weights import load_trainable_state, prepare_model
    from fedsyn_client.training import TrainSettings, dp_train

    conf = msg.content.config_records[R.CONFIG]
    delta, server_round = float(conf["delta"]), int(conf["server-round"])
    _check_delta(node, delta)
    run_key = f"run-{context.run_id}"
    eps_train = node.phase_epsilon("train", cfg.voters)
    q = min(1.0, cfg.batch_size / len(node.data))
    nm = _noise_multiplier(eps_train, delta, q, cfg.num_server_rounds * cfg.local_steps) if cfg.private else 0.0
    history = node.ledger.accountant_history(run_key)
    eps_before = dpsgd_epsilon(history, delta) if cfg.private else 0.0
    cost = (dpsgd_epsilon(history + [[nm, q, cfg.local_steps]], delta) - eps_before) if cfg.private else math.inf
    _authorise(node, str(context.run_id), "train", cost, cfg.voters)

    model, tokenizer = load_generator(cfg.model, seed=cfg.seed)
    model = prepare_model(model, cfg.finetune, cfg.lora_rank, seed=cfg.seed)
    load_trainable_state(model, R.state_from_arrays(msg.content.array_records[R.ARRAYS]))
    settings = TrainSettings(
        local_steps=cfg.local_steps, batch_size=cfg.batch_size, learning_rate=cfg.learning_rate,
        max_length=cfg.max_length, max_grad_norm=cfg.max_grad_norm, noise_multiplier=nm,
        private=cfg.private, seed=cfg.seed * 100_003 + server_round * 101 + int(context.node_id % 100_000),
    )
    result = dp_train(model, tokenizer, node.data.texts, node.data.codes, settings, delta, history)
    release = Release(
        phase="train", mechanism="dp-sgd", epsilon=(result.epsilon - eps_before) if cfg.private else math.inf,
        delta=delta, run_id=str(context.run_id), round=server_round, noise_multiplier=nm, sample_rate=q,
        steps=result.steps, max_grad_norm=cfg.max_grad_norm,
    )
    node.ledger.record(release, accountant=(run_key, result.accountant_history))
    rel = R.release_record(release.to_dict(), node.ledger.spent(), node.epsilon_budget)
    # The local loss is computed on private records without noise: it stays in this log.
    log.info("round %d: %d DP-SGD steps, local loss %.4f, epsilon_train so far %.4g",
             server_round, result.steps, result.mean_loss, result.epsilon)
    metrics = MetricRecord({R.WEIGHT_KEY: 1.0, "steps": float(result.steps),
                            "epsilon-train": float(result.epsilon if cfg.private else -1.0)})
    return RecordDict({R.ARRAYS: R.arrays_from_state(result.state), R.METRICS: metrics, R.RELEASE: rel})


# --------------------------------------------------------------------------- stage 2
@app.query("profile")
@_handler
def profile(msg: Message, context: Context, node: Node, cfg: RunConfig) -> RecordDict:
    """Algorithm 1 stage 2: per-code counts + analytic Gaussian noise (L2 sensitivity 1)."""
    conf = msg.content.config_records[R.CONFIG]
    vocabulary, delta = list(conf["codes"]), float(conf["delta"])
    _check_delta(node, delta)
    eps = node.phase_epsilon("profile", cfg.voters)
    _authorise(node, str(context.run_id), "profile", eps, cfg.voters)
    counts = node.data.code_counts(vocabulary)  # raises on a code outside the vocabulary
    # One record is in exactly one bucket: adding/removing it moves one count by 1.
    sigma = analytic_gaussian_sigma(eps, delta, 1.0)
    noisy = gaussian_release(counts, sigma, np.random.default_rng())
    release = Release(phase="profile", mechanism="gaussian", epsilon=eps, delta=delta,
                      run_id=str(context.run_id), sigma=sigma, sensitivity=1.0)
    return R.vector_reply(R.PROFILE, noisy, _release_reply(node, release))


# --------------------------------------------------------------------------- stage 4
@app.query("vote")
@_handler
def vote(msg: Message, context: Context, node: Node, cfg: RunConfig) -> RecordDict:
    """Algorithm A.2: kNN votes of local records for same-code candidates + Gaussian noise (sqrt(K))."""
    from common.models import embed, load_embedder

    cand = msg.content.config_records[R.CANDIDATES]
    texts, codes = list(cand["texts"]), list(cand["codes"])
    conf = msg.content.config_records[R.CONFIG]
    k, delta = int(conf["num-votes"]), float(conf["delta"])
    if len(texts) != len(codes):
        raise ConfigError(f"{len(texts)} candidate texts but {len(codes)} codes")
    if k < 1:
        raise ConfigError(f"num-votes = {k}; must be >= 1")
    _check_delta(node, delta)
    eps = node.phase_epsilon("vote", cfg.voters)
    _authorise(node, str(context.run_id), "vote", eps, cfg.voters)
    embedder = load_embedder(cfg.embedder)
    local_emb = _local_embeddings(node, cfg.embedder)
    votes = knn_votes(local_emb, node.data.codes, embed(embedder, texts), codes, k)
    sensitivity = math.sqrt(k)  # each record adds +1 to at most K distinct candidates
    sigma = analytic_gaussian_sigma(eps, delta, sensitivity)
    noisy = gaussian_release(votes, sigma, np.random.default_rng())
    release = Release(phase="vote", mechanism="gaussian", epsilon=eps, delta=delta,
                      run_id=str(context.run_id), sigma=sigma, sensitivity=sensitivity)
    return R.vector_reply(R.VOTES, noisy, _release_reply(node, release))


def _local_embeddings(node: Node, embedder_name: str) -> np.ndarray:
    """Embeddings of the node's records, computed once per process (records never change)."""
    cache = _EMBEDDING_CACHE.setdefault(embedder_name, {})
    key = node.ledger.fingerprint
    if key not in cache:
        from common.models import embed, load_embedder

        cache[key] = embed(load_embedder(embedder_name), node.data.texts, progress=True)
    return cache[key]


_EMBEDDING_CACHE: dict[str, dict[str, np.ndarray]] = {}
