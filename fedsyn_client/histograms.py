"""The histograms a node releases with Gaussian noise, each with its L2 sensitivity.

The profile is ``TextData.code_counts`` (L2 sensitivity 1). A vote request names a histogram; the node computes it on its own records and the one
release path (``fedsyn_client.release``) adds noise at that sensitivity. A new refinement
that needs another statistic registers it in ``VOTE_HISTOGRAMS`` with its sensitivity
(and a test of that bound); it then gets the node's policy, ledger and noise for free.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from common.config import ConfigError, RunConfig
from common.data import TextData, dataset_fingerprint
from fedsyn_client.voting import knn_votes

Compute = Callable[[], np.ndarray]


def knn_vote_histogram(records: TextData, texts: list[str], codes: list[str], params: Mapping[str, Any],
                       cfg: RunConfig) -> tuple[Compute, float]:
    """Paper A.2: each record gives +1 to its K nearest same-code candidates; sensitivity sqrt(K)."""
    k = params.get("num-votes")
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ConfigError(f"num-votes = {k!r}; must be an integer >= 1")

    def compute() -> np.ndarray:
        from common.models import embed, load_embedder

        return knn_votes(local_embeddings(records, cfg.embedder), records.codes,
                         embed(load_embedder(cfg.embedder), texts), codes, k)

    # each record adds +1 to at most K distinct candidates: the L2 norm of its change is sqrt(K)
    return compute, math.sqrt(k)


VOTE_HISTOGRAMS: dict[str, Callable[..., tuple[Compute, float]]] = {"knn-vote": knn_vote_histogram}


def vote_histogram(name: str, records: TextData, texts: list[str], codes: list[str], params: Mapping[str, Any],
                   cfg: RunConfig) -> tuple[Compute, float]:
    """(compute, L2 sensitivity) of the registered histogram ``name`` over the candidates."""
    try:
        build = VOTE_HISTOGRAMS[name]
    except KeyError:
        raise ConfigError(f"histogram {name!r} is unknown on this node; known: {sorted(VOTE_HISTOGRAMS)}") from None
    return build(records, texts, codes, params, cfg)


def local_embeddings(records: TextData, embedder_name: str) -> np.ndarray:
    """Embeddings of the node's records, computed once per process (records never change)."""
    cache = _EMBEDDING_CACHE.setdefault(embedder_name, {})
    key = dataset_fingerprint(records)
    if key not in cache:
        from common.models import embed, load_embedder

        cache[key] = embed(load_embedder(embedder_name), records.texts, progress=True)
    return cache[key]


_EMBEDDING_CACHE: dict[str, dict[str, np.ndarray]] = {}
