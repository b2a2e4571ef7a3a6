"""Which codes phase 1 learned: a code the strong nodes hold too little of is written by θ⁰.

Phase 1 trains on the strong nodes' records only. A code they hold none of (non-IID: the site
with a GPU sees two of five topics) is never the target of a DP step, yet every step moves the
shared weights, so that code's texts drift away from what the pretrained model wrote without
learning anything of the code (docs/results.md: at the defaults, non-IID dp-none is below
zero-shot in every seed). For such a code the pretrained weights θ⁰ are the writer to keep: the
issue's "never below the pretrained model", code by code. Measured non-IID, it brings dp-none back
to zero-shot's mean on BBC and gains nothing on Rotten Tomatoes, so it is opt-in.

The decision reads only the nodes' noisy profiles (stage 2's releases) and which nodes are strong
(stage 0, public), so it is post-processing: it costs no ε and asks no node anything. Run config
``coverage-floor`` sets the threshold (0 = off: every code from the finetuned model, the paper).
Since issue 46 every code's pool is split between the two writers by ``pretrained-share`` and the
votes choose (``strategies.writers``); a coverage-floor code is the special case of a share of 1,
decided before any vote. A refinement that writes new texts (PE's variations, POPri) writes them
with the weights phase 1 and the refinement left.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def finetune_coverage(strong: Sequence[Sequence[float]], everyone: Sequence[Sequence[float]]) -> np.ndarray:
    """ρ_j = (S_j / S) / (N_j / N) per code j, from noisy per-code counts clamped at 0.

    ``strong``: the strong nodes' noisy profiles; ``everyone``: every node's (strong ones
    included). ρ_j is code j's share of the records phase 1 trained on over its share of all
    records: 1 = phase 1 saw the code as often as the data holds it, 0 = never. With no strong
    count at all (S = 0) nothing can be said and every ρ_j is 1 (the paper's behaviour); a code
    with no record anywhere (N_j = 0) gets no text, and ρ_j = 1.
    """
    total = np.clip(np.sum(np.asarray(everyone, dtype=np.float64), axis=0), 0, None)
    seen = np.clip(np.sum(np.asarray(strong, dtype=np.float64), axis=0), 0, None) if len(strong) else 0 * total
    if seen.sum() <= 0 or total.sum() <= 0:
        return np.ones_like(total)
    rho = np.ones_like(total)
    held = total > 0
    rho[held] = (seen[held] / seen.sum()) / (total[held] / total.sum())
    return rho


def pretrained_codes(vocabulary: Sequence[str], coverage: np.ndarray, floor: float) -> list[str]:
    """The codes whose coverage ρ is below ``floor`` (in vocabulary order); none when floor is 0."""
    return [code for code, rho in zip(vocabulary, coverage) if rho < floor]
