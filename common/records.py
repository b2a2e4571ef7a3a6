"""The message schema: which record keys each message type carries, built and read in one place.

| message           | down (server -> node)                        | up (node -> server)                          |
|-------------------|----------------------------------------------|----------------------------------------------|
| ``query.tier``    | config: codes                                 | tier: tier, vocabulary-ok, epsilon-budget    |
| ``train``         | arrays, config: server-round, delta           | arrays, metrics: weight, ...; release        |
| ``query.profile`` | config: codes, delta                          | profile: counts (noisy); release             |
| ``query.vote``    | candidates: texts, codes; config: K, delta    | votes: votes (noisy); release                |

Only noised statistics travel up; ``release`` describes the noise (phase, mechanism, sigma,
sensitivity, epsilon, delta) so the server can write the privacy report.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, MetricRecord, RecordDict

MSG_TIER = "query.tier"
MSG_TRAIN = "train"
MSG_PROFILE = "query.profile"
MSG_VOTE = "query.vote"

ARRAYS = "arrays"  # Flower strategies' default ArrayRecord key
CONFIG = "config"  # Flower strategies' default ConfigRecord key
METRICS = "metrics"
TIER = "tier"
PROFILE = "profile"
VOTES = "votes"
CANDIDATES = "candidates"
RELEASE = "release"
# Phase-1 replies are averaged with this weight. It is 1.0 for every node (paper A.3:
# Delta = 1/N sum Delta_i) because a node's true example count is an un-noised statistic.
WEIGHT_KEY = "weight"


def arrays_from_state(state: dict[str, np.ndarray]) -> ArrayRecord:
    """Trainable weights (name -> array) to an ``ArrayRecord``, keeping key order."""
    return ArrayRecord(array_dict=OrderedDict((k, Array(np.asarray(v))) for k, v in state.items()))


def state_from_arrays(record: ArrayRecord) -> dict[str, np.ndarray]:
    """The inverse of ``arrays_from_state``."""
    return OrderedDict(zip(record.keys(), record.to_numpy_ndarrays()))


def release_record(release: dict[str, Any], spent: float, budget: float) -> ConfigRecord:
    """A release's public description plus the node's ledger totals, for the report."""
    payload = dict(release)
    payload.update({"epsilon-spent": float(spent), "epsilon-budget": float(budget)})
    return ConfigRecord(payload)


def tier_reply(tier: str, vocabulary_ok: bool, budget: float) -> RecordDict:
    """Content of a ``query.tier`` reply."""
    return RecordDict({TIER: ConfigRecord({"tier": tier, "vocabulary-ok": vocabulary_ok,
                                           "epsilon-budget": float(budget)})})


def vector_reply(key: str, values: np.ndarray, release: ConfigRecord) -> RecordDict:
    """Content of a profile or vote reply: one noisy float vector under ``key``."""
    return RecordDict({key: MetricRecord({key: [float(v) for v in values]}), RELEASE: release})


def read_vector(content: RecordDict, key: str) -> np.ndarray:
    """The noisy vector of a profile or vote reply."""
    return np.asarray(content.metric_records[key][key], dtype=np.float64)
