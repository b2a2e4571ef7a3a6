"""The message schema: which record keys each message type carries, built and read in one place.

| message           | down (server -> node)                              | up (node -> server)                        |
|-------------------|----------------------------------------------------|--------------------------------------------|
| ``query.tier``    | config: codes, delta, phases                       | tier: tier, epsilon-budget, epsilon-needed,|
|                   |                                                    | epsilon-remaining, epsilon-shortfall       |
| ``train``         | arrays, config: codes, delta, server-round         | arrays, metrics: weight, steps; release    |
| ``query.profile`` | config: codes, delta                               | profile: counts (noisy); release           |
| ``query.vote``    | candidates: texts, codes; config: codes, delta,    | votes: votes (noisy); release              |
|                   | histogram, epsilon-share, server-round, [num-votes]|                                            |
| ``query.ledger``  | config: codes                                      | ledger: this run's release statements      |

Every request's config also carries ``resume-key`` (the run key: a resumed run repeats its
original run's), under which a node books its budgets and stores its replies, so a repeated
request is answered with the same bytes at no privacy cost.

Only noised statistics travel up. The tier reply's budget figures are statements about the
node's ledger (what earlier runs spent), never about its records. ``release`` is the node's *statement* of a release:
phase, mechanism, epsilon, delta, round and data-independent parameters (a Gaussian's
sigma and sensitivity, DP-SGD's steps), plus the node's ledger total and budget. It never
carries a sampling rate, noise multiplier or count, from which |D| would follow.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, MetricRecord, RecordDict

MSG_TIER = "query.tier"
MSG_TRAIN = "train"
MSG_PROFILE = "query.profile"
MSG_VOTE = "query.vote"
MSG_LEDGER = "query.ledger"
MSG_MARGINALS = "query.marginals"

ARRAYS = "arrays"  # Flower strategies' default ArrayRecord key
CONFIG = "config"  # Flower strategies' default ConfigRecord key
METRICS = "metrics"
TIER = "tier"
PROFILE = "profile"
VOTES = "votes"
CANDIDATES = "candidates"
MARGINALS = "marginals"  # a marginals reply's vector; a request's cliques under CLIQUES in its config
CLIQUES = "cliques"
RELEASE = "release"
# secure aggregation (issue 73): a release request's config names the step and the round's session;
# the step's payload (and its reply's) is one JSON text under SECAGG
SECAGG = "secagg"
SECAGG_STEP, SECAGG_SESSION = "secagg-step", "secagg-session"
ADVERTISE, SHARE, MASK, CONFIRM, REVEAL = "advertise", "share", "mask", "confirm", "reveal"
SECAGG_STEPS = (ADVERTISE, SHARE, MASK, CONFIRM, REVEAL)
LEDGER = "ledger"
# Error codes in replies (Flower reserves small ints; these are app-level).
ERR_BUDGET = 1001  # refused: would exceed the node's privacy budget
ERR_CONFIG = 1002  # the node's or the run's configuration is unusable
ERR_INTERNAL = 1003  # anything else; details stay in the node's log
ERR_POLICY = 1004  # refused: the request asks for more than the node's policy allows
ERR_WEIGHTS = 1005  # refused: the request's weights are not finite, absurd, or not the model's
# A node that answers with one of these spent nothing on that request: each is raised before
# the ledger reserves. ERR_INTERNAL may come after a reservation, which then stays spent.
# Each error's reason is one of a few fixed texts (``fedsyn_client.refusals``): no exception
# name, number or path; the detail stays in the node's log.
ERR_NOTHING_SPENT = (ERR_BUDGET, ERR_CONFIG, ERR_POLICY, ERR_WEIGHTS)
ERR_REFUSED = (ERR_BUDGET, ERR_POLICY)  # the node refuses the run's terms: it cannot finish the run

# Phase-1 replies are averaged with this weight. It is 1.0 for every node (paper A.3:
# Delta = 1/N sum Delta_i) because a node's true example count is an un-noised statistic.
WEIGHT_KEY = "weight"


def arrays_from_state(state: dict[str, np.ndarray]) -> ArrayRecord:
    """Trainable weights (name -> array) to an ``ArrayRecord``, keeping key order."""
    return ArrayRecord(array_dict=OrderedDict((k, Array(np.asarray(v))) for k, v in state.items()))


def state_from_arrays(record: ArrayRecord) -> dict[str, np.ndarray]:
    """The inverse of ``arrays_from_state``."""
    return OrderedDict(zip(record.keys(), record.to_numpy_ndarrays()))


def number(value: Any) -> float:
    """A ConfigRecord value that the message schema makes a number (int or float), as a float.

    Flower types every ConfigRecord value as the union of all it may hold (str, bytes, lists...);
    ``float`` raises ``TypeError`` / ``ValueError`` on a value that is not a number, exactly as
    before, so a reader's ``except (KeyError, TypeError, ValueError)`` still catches a malformed reply."""
    return float(value)


def release_record(release: dict[str, Any], spent: float, budget: float) -> ConfigRecord:
    """A release's public description plus the node's ledger totals, for the report."""
    payload = dict(release)
    payload.update({"epsilon-spent": float(spent), "epsilon-budget": float(budget)})
    return ConfigRecord(payload)


def tier_reply(tier: str, budget: float, needed: float, remaining: float, shortfall: float,
               ledger_ref: str = "", held: float = 0.0, records_bound: int = 0, honest: int = 1) -> RecordDict:
    """Content of a ``query.tier`` reply: the node's tier, its (policy) budget, its pre-flight
    statement (epsilon this run still needs of it, epsilon left in its ledger for this run, of
    which ``held`` is held for other runs under way, and the shortfall, 0 when the node can
    finish the run) and its ledger's random name (``PrivacyLedger.ref``). All of it is about the
    ledger, none of it about the records. ``records_bound``: the node policy's public max-records
    (0 for a simulated node), so that ``fedsyn plan`` can show each node's noise and time at it;
    ``honest``: its min-honest-nodes (issue 73), the sites it counts on: above 1 it adds a share of
    the noise and the server must mask its rounds (its own choice, public)."""
    return RecordDict({TIER: ConfigRecord({
        "tier": tier, "epsilon-budget": float(budget), "epsilon-needed": float(needed),
        "epsilon-remaining": float(remaining), "epsilon-shortfall": float(shortfall), "ledger-ref": ledger_ref,
        "epsilon-held": float(held), "records-bound": float(records_bound), "min-honest-nodes": float(honest)})})


def vector_reply(key: str, values: np.ndarray, release: ConfigRecord) -> RecordDict:
    """Content of a profile or vote reply: one noisy float vector under ``key``."""
    return RecordDict({key: MetricRecord({key: [float(v) for v in values]}), RELEASE: release})


def cliques_value(cliques: list[tuple[str, ...]]) -> str:
    """A marginals request's cliques as one config value (JSON: a list of lists of column names)."""
    return json.dumps([list(c) for c in cliques])


def read_cliques(params: dict[str, Any]) -> list[tuple[str, ...]]:
    """The cliques of a marginals request's config; ``ValueError`` when absent or malformed (a
    list of non-empty lists of distinct column names)."""
    try:
        raw = json.loads(str(params[CLIQUES]))
    except (KeyError, ValueError):
        raise ValueError("the marginals request carries no cliques (a JSON list of lists of column names)") from None
    if not isinstance(raw, list) or not raw or not all(
            isinstance(c, list) and c and all(isinstance(a, str) for a in c) and len(set(c)) == len(c) for c in raw):
        raise ValueError("the marginals request's cliques are not a non-empty list of lists of distinct column names")
    return [tuple(c) for c in raw]


def read_vector(content: RecordDict, key: str) -> np.ndarray:
    """The noisy vector of a profile or vote reply."""
    return np.asarray(content.metric_records[key][key], dtype=np.float64)
