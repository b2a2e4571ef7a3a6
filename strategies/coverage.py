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
Only the pool (stage 3) is split; a refinement that writes new texts (PE's variations, POPri)
writes them with the weights phase 1 and the refinement left.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from flwr.app import ArrayRecord

from strategies.refinement import Generator


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


def generate_by_coverage(generator: Generator, allocation: Mapping[str, int], pretrained: Sequence[str],
                         base: ArrayRecord | None, tuned: ArrayRecord | None,
                         seed: int) -> tuple[list[str], list[str], dict[str, Any]]:
    """The pool: the ``pretrained`` codes' texts from weights ``base`` (θ⁰), the others' from
    ``tuned``; returns (texts, codes, report), grouped by code in allocation order, the
    generator left on ``tuned``. The report is the tuned half's ``generation_report`` with the
    pretrained half's under ``"pretrained"`` and the codes under ``"pretrained_codes"``."""
    split = [c for c in pretrained if allocation.get(c, 0) > 0]
    if not split or base is None:
        generator.load(tuned)
        texts, codes = generator.generate(allocation, seed=seed)
        return texts, codes, generator.generation_report()
    generator.load(base)
    old_texts, old_codes = generator.generate({c: n for c, n in allocation.items() if c in split}, seed=seed)
    old_report = generator.generation_report()
    generator.load(tuned)
    new_texts, new_codes = generator.generate({c: (0 if c in split else n) for c, n in allocation.items()}, seed=seed)
    report = {**generator.generation_report(), "pretrained": old_report, "pretrained_codes": list(split)}
    by_code: dict[str, list[str]] = {c: [] for c in allocation}
    for text, code in zip([*old_texts, *new_texts], [*old_codes, *new_codes]):
        by_code[code].append(text)
    return ([t for c in allocation for t in by_code[c]], [c for c in allocation for _ in by_code[c]], report)
