"""The vote histograms: each one object that owns its scoring and its L2 sensitivity.

A ``Histogram`` states the bound it is noised at (``sensitivity``) and scores the node's rows
against a vote's candidates (``score``). The node (``fedsyn_client.histograms.vote_histogram``)
embeds its records, pads them with zero rows up to its public size bound and hands ``score``
those rows, so a histogram does the bound's work by construction, never the records'. The
server reads the same objects to plan a run (``fedsyn plan``) and to explain the report without
importing the node's code. One registry, ``HISTOGRAMS``; ``register`` adds a plug-in's (on the
nodes, and on the server too if it should predict the noise) and refuses what would break either.
"""

from __future__ import annotations

import inspect
import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from common import voting
from common.config import ConfigError


def num_votes(params: Mapping[str, Any]) -> int:
    """The request's ``num-votes`` (K), checked to be an integer >= 1; raises ``ConfigError``."""
    k = params.get("num-votes")
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ConfigError(f"num-votes = {k!r}; must be an integer >= 1")
    return k


class Histogram(ABC):
    """A vote histogram: what a node computes over a vote's candidates and the L2 sensitivity it
    is noised at. Subclass it, set ``name`` and ``formula``, implement ``sensitivity`` and
    ``score`` (with a keyword ``bound``), and ``register`` an instance. Each bound needs a test
    against its ``score`` (``tests/test_refinement.py``'s ``PURE``, ``tests/test_privacy.py``)."""

    name: str = ""
    formula: str = ""  # the sensitivity in words, as the plan and the report print it
    # whether its values are counts in which one record moves each of sensitivity^2 coordinates by at
    # most 1: then a site may add Skellam noise to it and mask it (issue 73, ``common.skellam``)
    counts: bool = False
    # whether its values are real, the sum of each record's vector of L2 norm at most its
    # sensitivity: its ``score`` then takes a keyword ``rounding`` and, given one, hands it each
    # block of the rows' vectors and sums the integers it returns (a masked round, issue 73:
    # ``common.skellam.round_rows``)
    scaled: bool = False

    @abstractmethod
    def sensitivity(self, params: Mapping[str, Any]) -> float:
        """The L2 sensitivity of one record's change (added or removed) under a request's
        ``params``; raises ``ConfigError`` for bad params (checked before anything is reserved)."""

    @abstractmethod
    def score(self, rows: np.ndarray, codes: list[str], candidates: np.ndarray, candidate_codes: list[str],
              params: Mapping[str, Any], *, bound: int | None) -> np.ndarray:
        """The un-noised histogram, one value per candidate. ``rows``: the records' embeddings
        followed by zero filler rows up to ``bound`` (the node pads them: every row is scored,
        only the first ``len(codes)`` count); ``codes``: the records' codes; ``candidates`` and
        ``candidate_codes``: the vote's texts embedded and their codes; ``bound``: the node's
        public size bound (None: a simulated node, the rows are the records)."""


class KnnVote(Histogram):
    """Paper A.2: each record +1 to its K nearest same-code candidates; sensitivity sqrt(K)."""

    name, formula = "knn-vote", "sqrt(K)"
    counts = True

    def sensitivity(self, params: Mapping[str, Any]) -> float:
        """sqrt(K): a record adds +1 to at most K distinct candidates."""
        return math.sqrt(num_votes(params))

    def score(self, rows: np.ndarray, codes: list[str], candidates: np.ndarray, candidate_codes: list[str],
              params: Mapping[str, Any], *, bound: int | None) -> np.ndarray:
        """``voting.knn_votes`` at K = ``num-votes``."""
        return voting.knn_votes(rows, codes, candidates, candidate_codes, k=num_votes(params), bound=bound)


class ContrastiveVote(Histogram):
    """Issue 34: each record +1 to its K nearest same-code candidates and -1 to its K nearest
    other-code candidates; sensitivity sqrt(2K)."""

    name, formula = "contrastive-vote", "sqrt(2K)"
    counts = True

    def sensitivity(self, params: Mapping[str, Any]) -> float:
        """sqrt(2K): +1 to K candidates of the record's code and -1 to K of the others."""
        return math.sqrt(2 * num_votes(params))

    def score(self, rows: np.ndarray, codes: list[str], candidates: np.ndarray, candidate_codes: list[str],
              params: Mapping[str, Any], *, bound: int | None) -> np.ndarray:
        """``voting.contrastive_votes`` at K = ``num-votes``."""
        return voting.contrastive_votes(rows, codes, candidates, candidate_codes, k=num_votes(params), bound=bound)


class NearestNeighbour(Histogram):
    """Private Evolution's histogram: each record +1 to its nearest same-code candidate; sensitivity 1."""

    name, formula = "nearest-neighbour", "1"
    counts = True

    def sensitivity(self, params: Mapping[str, Any]) -> float:
        """1: +1 to one candidate."""
        return 1.0

    def score(self, rows: np.ndarray, codes: list[str], candidates: np.ndarray, candidate_codes: list[str],
              params: Mapping[str, Any], *, bound: int | None) -> np.ndarray:
        """``voting.knn_votes`` at K = 1 (``num-votes`` is not read)."""
        return voting.knn_votes(rows, codes, candidates, candidate_codes, k=1, bound=bound)


class Similarity(Histogram):
    """POPri's scores: each record's clipped (norm <= 1) cosine similarities, summed; sensitivity 1."""

    name, formula = "similarity", "1"
    scaled = True

    def sensitivity(self, params: Mapping[str, Any]) -> float:
        """1: a record's vector is clipped to norm 1."""
        return 1.0

    def score(self, rows: np.ndarray, codes: list[str], candidates: np.ndarray, candidate_codes: list[str],
              params: Mapping[str, Any], *, bound: int | None,
              rounding: Callable[[np.ndarray], np.ndarray] | None = None) -> np.ndarray:
        """``voting.similarity_scores`` (each record's vector through ``rounding`` if given)."""
        return voting.similarity_scores(rows, codes, candidates, candidate_codes, bound=bound, rounding=rounding)


class CentredSimilarity(Similarity):
    """Issue 74 (Concordia's): each record's own-code cosine similarities minus their mean over its
    code's candidates, clipped to L2 norm 1, summed; sensitivity 1. GRPO's reward and POPri's scores
    where the level of a record's similarities would drown the differences between candidates."""

    name, formula = "centred-similarity", "1"

    def sensitivity(self, params: Mapping[str, Any]) -> float:
        """1: a record's centred vector is clipped to norm 1."""
        return 1.0

    def score(self, rows: np.ndarray, codes: list[str], candidates: np.ndarray, candidate_codes: list[str],
              params: Mapping[str, Any], *, bound: int | None,
              rounding: Callable[[np.ndarray], np.ndarray] | None = None) -> np.ndarray:
        """``voting.similarity_scores(..., centred=True)``."""
        return voting.similarity_scores(rows, codes, candidates, candidate_codes, bound=bound, rounding=rounding,
                                        centred=True)


# name -> the registered histogram; each shipped bound is tested in tests/test_privacy.py
HISTOGRAMS: dict[str, Histogram] = {}


def register(histogram: Histogram, replace: bool = False) -> Histogram:
    """Adds ``histogram`` (an instance of a concrete ``Histogram`` subclass) to ``HISTOGRAMS``
    under its ``name`` and returns it. Raises ``TypeError`` naming the problem and the fix for
    anything else, for a ``score`` without the keyword ``bound`` (its work would follow |D|), an
    empty name or formula, and a name already registered unless ``replace``."""
    if isinstance(histogram, type) and issubclass(histogram, Histogram):
        raise TypeError(f"register({histogram.__name__}) got the class; register an instance: "
                        f"register({histogram.__name__}())")
    if not isinstance(histogram, Histogram):
        raise TypeError(f"register() takes a common.histograms.Histogram instance, not {type(histogram).__name__}; "
                        "subclass Histogram (name, formula, sensitivity, score)")
    kind = type(histogram).__name__
    if inspect.isabstract(type(histogram)):
        missing = ", ".join(sorted(type(histogram).__abstractmethods__))
        raise TypeError(f"histogram {kind} is abstract; implement {missing}")
    bound = inspect.signature(histogram.score).parameters.get("bound")
    if bound is None or bound.kind not in (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD):
        raise TypeError(f"histogram {kind}.score takes no keyword parameter 'bound'; declare it "
                        "(score(self, rows, codes, candidates, candidate_codes, params, *, bound)): the node "
                        "hands it the bound's rows and every row must be scored")
    if histogram.scaled and "rounding" not in inspect.signature(histogram.score).parameters:
        raise TypeError(f"histogram {kind} is scaled but its score takes no keyword parameter 'rounding'; declare "
                        "it and hand it each block of the records' vectors (a masked round rounds them)")
    for attr in ("name", "formula"):
        value = getattr(histogram, attr, None)
        if not isinstance(value, str) or not value.strip():
            raise TypeError(f"histogram {kind} has no {attr}; set the class attribute {attr} "
                            f"({'the name a refinement votes with' if attr == 'name' else 'its sensitivity in words'})")
    if histogram.name in HISTOGRAMS and not replace:
        held = type(HISTOGRAMS[histogram.name]).__name__
        raise TypeError(f"histogram {histogram.name!r} is already registered ({held}); "
                        "choose another name, or pass replace=True to override it")
    HISTOGRAMS[histogram.name] = histogram
    return histogram


def unregister(name: str) -> None:
    """Removes ``name`` from ``HISTOGRAMS`` (a test's plug-in); nothing if it is not there."""
    HISTOGRAMS.pop(name, None)


def histogram(name: str) -> Histogram:
    """The registered histogram ``name``; raises ``ConfigError`` naming the known ones."""
    try:
        return HISTOGRAMS[name]
    except KeyError:
        raise ConfigError(f"histogram {name!r} is not registered; known: {sorted(HISTOGRAMS)}") from None


def maskable(name: str) -> bool:
    """Whether a vote round of the registered histogram ``name`` may be masked (its values are
    counts, ``Histogram.counts``, or may be scaled and rounded, ``Histogram.scaled``); False for an
    unknown name."""
    histogram = HISTOGRAMS.get(name)
    return bool(histogram is not None and (histogram.counts or histogram.scaled))


def rounded(name: str) -> bool:
    """Whether a masked round of the registered histogram ``name`` scales and rounds real values
    (``Histogram.scaled``, not counts): the server divides its sum by ``common.skellam.SCALE``."""
    histogram = HISTOGRAMS.get(name)
    return bool(histogram is not None and histogram.scaled and not histogram.counts)


def masked_units(name: str, params: Mapping[str, Any], length: int) -> tuple[float, int]:
    """(what a masked round's sum of ``name`` is divided by, the most one record adds to any of its
    ``length`` values): (1, 1) for counts; (``common.skellam.SCALE``, the rounded norm) for a scaled
    histogram, whose records' vectors are scaled and rounded (``common.skellam.round_rows``)."""
    if not rounded(name):
        return 1.0, 1
    from common import skellam

    return float(skellam.SCALE), int(math.ceil(skellam.record_norm(sensitivity(name, params), length)))


def sensitivity(name: str, params: Mapping[str, Any]) -> float:
    """L2 sensitivity of the registered histogram ``name`` under a request's ``params``. Raises
    ``ConfigError`` for one not registered here (a plug-in's, known only to the nodes that
    register it: ``name in HISTOGRAMS`` first where that is not an error)."""
    if name not in HISTOGRAMS:
        raise ConfigError(f"histogram {name!r} is not registered here (not shipped); its node states its sensitivity")
    return float(HISTOGRAMS[name].sensitivity(params))


def formula(name: str) -> str:
    """The sensitivity of ``name`` in words (``sqrt(2K)``), or "stated by the node" for one not
    registered here."""
    entry = HISTOGRAMS.get(name)
    return entry.formula if entry else "stated by the node"


for _shipped in (KnnVote(), ContrastiveVote(), NearestNeighbour(), Similarity(), CentredSimilarity()):
    register(_shipped)
