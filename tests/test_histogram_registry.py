"""Issue 62: a vote histogram is one object (``common.histograms.Histogram``) that owns its
sensitivity and is handed the bound's rows; ``register`` refuses what would break either."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np
import pytest

from common import histograms
from common.config import ConfigError, RunConfig
from common.data import TextData
from common.histograms import HISTOGRAMS, Histogram, num_votes, register, unregister
from fedsyn_client.histograms import vote_histogram


class CodeCount(Histogram):
    """A toy: each record +1 to every candidate of its own code, clipped to norm 1 (sensitivity 1)."""

    name, formula = "toy-code-count", "1"

    def sensitivity(self, params: Mapping[str, Any]) -> float:
        return 1.0

    def score(self, rows: np.ndarray, codes: list[str], candidates: np.ndarray, candidate_codes: list[str],
              params: Mapping[str, Any], *, bound: int | None) -> np.ndarray:
        self.rows = rows.shape
        slots = list(codes) + [None] * (len(rows) - len(codes))  # filler rows match no candidate
        own = np.array([[c == d for d in candidate_codes] for c in slots], dtype=np.float64)
        norms = np.maximum(1.0, np.linalg.norm(own, axis=1, keepdims=True))
        return (own / norms).sum(axis=0)


@pytest.fixture
def toy():
    obj = register(CodeCount())
    yield obj
    unregister(obj.name)


def test_a_registered_histogram_votes_through_the_node_and_the_plan_reads_it(toy, monkeypatch):
    from fedsyn_client import histograms as node_side

    # fixed embeddings: the test is about the registry, not the embedder
    monkeypatch.setattr(node_side, "local_embeddings", lambda records, *a: np.ones((len(records), 4)))
    monkeypatch.setattr(node_side, "candidate_embeddings", lambda texts, *a: np.ones((len(texts), 4)))
    records = TextData(["x", "y", "z"], ["a", "a", "b"])
    compute, sensitivity = vote_histogram("toy-code-count", records, ["p", "q", "r"], ["a", "b", "a"], {},
                                          RunConfig(), bound=10)
    assert sensitivity == 1.0 and not hasattr(toy, "rows")  # nothing scored before compute (the reservation)
    votes = compute()
    assert toy.rows == (10, 4)  # the bound's rows, padded by the node
    np.testing.assert_allclose(votes, [2 / math.sqrt(2), 1.0, 2 / math.sqrt(2)])
    assert histograms.sensitivity("toy-code-count", {}) == 1.0 and histograms.formula("toy-code-count") == "1"
    assert histograms.histogram("toy-code-count") is toy


def test_an_unknown_histogram_is_named_with_the_known_ones():
    known = r"known: \['centred-similarity', 'contrastive-vote'"
    with pytest.raises(ConfigError, match=r"'nope' is unknown on this node; " + known):
        vote_histogram("nope", TextData(["x"], ["a"]), ["y"], ["a"], {}, RunConfig())
    with pytest.raises(ConfigError, match="known: "):
        histograms.histogram("nope")
    with pytest.raises(ConfigError, match="not registered"):
        histograms.sensitivity("nope", {})
    assert histograms.formula("nope") == "stated by the node"


def test_bad_params_are_refused_before_anything_is_computed():
    with pytest.raises(ConfigError, match="num-votes"):
        vote_histogram("knn-vote", TextData(["x"], ["a"]), ["y"], ["a"], {"num-votes": 0}, RunConfig())
    assert num_votes({"num-votes": 2}) == 2


class _Base(Histogram):
    name, formula = "toy-bad", "1"

    def sensitivity(self, params: Mapping[str, Any]) -> float:
        return 1.0


class NoBound(_Base):
    def score(self, rows, codes, candidates, candidate_codes, params):  # type: ignore[override]
        return np.zeros(len(candidate_codes))


class OnlyKwargs(_Base):
    def score(self, rows, codes, candidates, candidate_codes, params, **kw):  # type: ignore[override]
        return np.zeros(len(candidate_codes))


class Good(_Base):
    def score(self, rows, codes, candidates, candidate_codes, params, *, bound):
        return np.zeros(len(candidate_codes))


class NoName(Good):
    name = ""


class NoFormula(Good):
    formula = " "


class Abstract(_Base):  # no score
    pass


@pytest.mark.parametrize("bad, words", [
    (object(), "not object"),
    (lambda *a: None, "not function"),
    (Good, "got the class; register an instance"),
    (NoBound(), "no keyword parameter 'bound'"),
    (OnlyKwargs(), "no keyword parameter 'bound'"),
    (NoName(), "has no name"),
    (NoFormula(), "has no formula"),
])
def test_register_refuses_what_is_not_a_histogram_that_takes_the_bound(bad, words):
    with pytest.raises(TypeError, match=words):
        register(bad)
    assert "toy-bad" not in HISTOGRAMS and "" not in HISTOGRAMS


def test_register_refuses_an_abstract_histogram_and_a_taken_name():
    abstract = Good()
    abstract.__class__ = Abstract  # an abstract instance, which ABC's own check cannot build
    with pytest.raises(TypeError, match="is abstract; implement score"):
        register(abstract)
    shipped = HISTOGRAMS["knn-vote"]

    class Impostor(Good):
        name = "knn-vote"

    with pytest.raises(TypeError, match="'knn-vote' is already registered .*replace=True"):
        register(Impostor())
    assert HISTOGRAMS["knn-vote"] is shipped
    replaced = register(Impostor(), replace=True)
    try:
        assert HISTOGRAMS["knn-vote"] is replaced
    finally:
        register(shipped, replace=True)
    assert HISTOGRAMS["knn-vote"] is shipped


def test_the_shipped_histograms_state_their_bounds():
    params = {"num-votes": 3}
    assert {n: (h.sensitivity(params), h.formula) for n, h in HISTOGRAMS.items()} == {
        "knn-vote": (math.sqrt(3), "sqrt(K)"), "contrastive-vote": (math.sqrt(6), "sqrt(2K)"),
        "nearest-neighbour": (1.0, "1"), "similarity": (1.0, "1"), "centred-similarity": (1.0, "1")}
