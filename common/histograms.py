"""The shipped vote histograms' L2 sensitivities: one home for the bound each is noised at.

The node noises each histogram it releases at this sensitivity (``fedsyn_client.histograms``
builds the histogram and reads its bound here); the server reads the same bound to plan a run
(``fedsyn plan``) and to explain the report, without importing the node's code. A histogram a
plug-in registers only on its nodes has no entry here: the node's builder states its own bound,
and the server says it cannot predict the noise.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

from common.config import ConfigError


def num_votes(params: Mapping[str, Any]) -> int:
    """The request's ``num-votes`` (K), checked to be an integer >= 1; raises ``ConfigError``."""
    k = params.get("num-votes")
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ConfigError(f"num-votes = {k!r}; must be an integer >= 1")
    return k


# name -> (L2 sensitivity of one record's change, given the request's params; the formula in words).
# Each bound is tested against the histogram's computation in tests/test_privacy.py.
SENSITIVITIES: dict[str, tuple[Callable[[Mapping[str, Any]], float], str]] = {
    # each record adds +1 to at most K distinct candidates
    "knn-vote": (lambda p: math.sqrt(num_votes(p)), "sqrt(K)"),
    # +1 to K candidates of its code and -1 to K of the others
    "contrastive-vote": (lambda p: math.sqrt(2 * num_votes(p)), "sqrt(2K)"),
    # +1 to its one nearest candidate of its code
    "nearest-neighbour": (lambda p: 1.0, "1"),
    # its cosine similarities to the candidates, clipped to norm <= 1
    "similarity": (lambda p: 1.0, "1"),
}


def sensitivity(name: str, params: Mapping[str, Any]) -> float:
    """L2 sensitivity of the shipped histogram ``name`` under a request's ``params``. Raises
    ``ConfigError`` for a histogram not shipped (a plug-in's, known only to the nodes that register
    it: ``name in SENSITIVITIES`` first where that is not an error)."""
    if name not in SENSITIVITIES:
        raise ConfigError(f"histogram {name!r} is not shipped; its node states its sensitivity")
    return float(SENSITIVITIES[name][0](params))


def formula(name: str) -> str:
    """The sensitivity of ``name`` in words (``sqrt(2K)``), or "stated by the node" for a plug-in's."""
    entry = SENSITIVITIES.get(name)
    return entry[1] if entry else "stated by the node"
