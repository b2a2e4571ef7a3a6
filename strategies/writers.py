"""Who writes the pool: the pretrained weights θ⁰ and the finetuned ones, and the votes choose (issue 46).

Phase 1 adds on average but not always (docs/results.md): where DP finetuning did not help, a
pool written only by the finetuned model pays for it. The pretrained model with the zero-shot
instruction is a DP-free writer every run already has, so each code's pool is written by both:
``pretrained-share`` of it by θ⁰, the rest by the finetuned weights, each text tagged with its
writer. The same DP votes judge the whole pool, and each code's final texts come from whichever
writer the sites' records favour: ``writer-choice = "mix"`` (default) draws a code's A.4 sample
from its whole pool, text by text by the votes; ``"better"`` draws it among the texts of the writer
whose texts the code's votes rate higher (the mean of the clamped noisy votes). Measured
(docs/results.md#issue-46-the-votes-choose-the-writer), paired on the same pools and votes: the
mix beat the per-code choice on BBC News IID (0.817 against 0.758, 3 seeds) and label-skewed
(0.731 against 0.701) and on movie-review-source IID, and lost only on its label-skewed split (1
seed); a per-code choice gives the classifier a writer's style that goes with the label, and the
mix keeps both writers' variety in every code. A writer's texts need as much choice as a one-writer
pool gives, so the default pool is twice as large (``num-synthetic`` 240, each writer 120) at half
the rate (0.25), which keeps the final 60. Choosing by released votes is post-processing: no ε beyond
the votes the run pays for anyway; the larger pool costs the server twice the generation and each
voter twice the candidates to embed.

The split applies only where it can be judged and where there are two writers:

- phase 1 did not train (``prompt = "zero-shot"``, no strong node, no round answered): the one
  writer is θ⁰, every text is tagged ``pretrained``;
- nobody votes (a refinement that asks no votes, such as ``none`` or ``uniform``, or no voter in
  the run): nothing could choose between the writers, so the pool is the finetuned model's alone,
  the paper's, and ``fedsyn plan`` and the log say so;
- the refinement trains the generator on its samples (POPri, GRPO: ``Refinement.on_policy``): its
  pairs and rollouts must be the trained writer's own, so the pool is the finetuned model's alone;
- a code phase 1 saw too little of (``coverage-floor``, opt-in) is written by θ⁰ alone: the
  special case of a share of 1 for that code, decided from the noisy profiles.

A refinement that writes new texts (PE's variations, POPri's regenerations) writes them with the
weights the generator holds, tagged ``ctx.writer``; a text POPri's or GRPO's trained model wrote is ``refined``.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from flwr.app import ArrayRecord

from strategies.refinement import FINETUNED, PRETRAINED, Generator
from strategies.result import FedSynResult

# The prompt θ⁰ writes with: the zero-shot template filled with the code (common.codes), which the
# pretrained model can follow; the run's ``prompt`` may be the paper's bare code, which it cannot.
PRETRAINED_PROMPT = "instruction"


def effective_share(share: float, *, finetuned: bool, votes: bool, on_policy: bool = False) -> tuple[float, str]:
    """The share of each code's pool θ⁰ writes in this run, and why, from the run-config
    ``share``, whether phase 1 trained the weights (``finetuned``), whether any vote will
    judge the pool (``votes``: the refinement asks votes and the run has a voter) and whether the
    refinement trains the generator on its own samples (``on_policy``, ``Refinement.on_policy``)."""
    if not finetuned:
        return 1.0, "phase 1 did not train: every text is written by the pretrained model"
    if not votes:
        return 0.0, ("no vote judges the pool (no voter, or a refinement without votes): every text is written by "
                     "the finetuned model (pretrained-share does not apply)")
    if on_policy:
        return 0.0, ("the refinement trains the generator on its own samples: every text is written by the finetuned "
                     "model it trains (pretrained-share does not apply)")
    return share, (f"each code's pool {share:.0%} by the pretrained model, {1 - share:.0%} by the finetuned one; "
                   "the votes choose between them")


def better_writer(codes: Sequence[str], writers: Sequence[str], votes: np.ndarray | None,
                  choice: str = "better") -> np.ndarray | None:
    """Which texts a code's A.4 sample is drawn from first (``resample_by_code``'s ``among``): for
    ``choice`` "better", per code the texts of the writer with the higher mean clamped vote (a tie,
    as with no votes, goes to the finetuned model, the paper's writer); None, the whole pool, for
    "mix", no votes, or a pool of one writer."""
    if choice != "better" or votes is None or len(set(writers)) < 2:
        return None
    codes_arr, writers_arr = np.asarray(codes), np.asarray(writers)
    v = np.clip(np.asarray(votes, dtype=np.float64), 0, None)
    mask = np.zeros(len(codes), dtype=bool)
    for code in set(codes):
        mine = codes_arr == code
        means = {w: float(v[mine & (writers_arr == w)].mean()) for w in set(writers_arr[mine])}
        best = max(sorted(means, key=lambda w: (w != FINETUNED, w)), key=means.__getitem__)
        mask |= mine & (writers_arr == best)
    return mask


def pretrained_counts(allocation: Mapping[str, int], share: float, whole: Sequence[str] = ()) -> dict[str, int]:
    """Per code, how many of its ``allocation[c]`` texts θ⁰ writes: ``round(share * n)`` (half up),
    all of them for the codes in ``whole`` (coverage-floor's)."""
    return {c: (n if c in whole else min(n, math.floor(share * n + 0.5))) for c, n in allocation.items()}


@dataclass
class Pool:
    """The generated pool, grouped by code in allocation order, θ⁰'s texts of a code first."""

    texts: list[str]
    codes: list[str]
    writers: list[str]
    report: dict[str, Any] = field(default_factory=dict)


def generate_pool(generator: Generator, allocation: Mapping[str, int], base_counts: Mapping[str, int],
                  base: ArrayRecord | None, tuned: ArrayRecord | None, seed: int, finetuned: bool = True,
                  tuned_writer: str = FINETUNED) -> Pool:
    """The pool of ``allocation``: ``base_counts[c]`` of code c written by ``base`` (θ⁰) with the
    instruction prompt, the rest by ``tuned``, the generator left on ``tuned``. Without phase 1
    (``finetuned`` False) all of it is ``tuned``'s (θ⁰ itself) with the run's prompt, tagged
    pretrained; ``tuned_writer`` tags ``tuned``'s texts otherwise. The report is the finetuned half's
    ``generation_report`` with θ⁰'s under
    ``"pretrained"`` and each writer's written count per code under ``"writers"``."""
    if not finetuned:
        generator.load(tuned)
        texts, codes = generator.generate(allocation, seed=seed)
        return Pool(texts, codes, [PRETRAINED] * len(texts),
                    {**generator.generation_report(), "writers": _written(codes, [PRETRAINED] * len(texts))})
    old = {c: int(base_counts.get(c, 0)) for c, n in allocation.items() if n > 0 and base_counts.get(c, 0) > 0}
    parts: list[tuple[str, list[str], list[str]]] = []
    report: dict[str, Any] = {}
    if old and base is not None:
        generator.load(base)
        parts.append((PRETRAINED, *generator.generate(old, seed=seed, prompt=PRETRAINED_PROMPT)))
        report["pretrained"] = generator.generation_report()
    else:
        old = {}
    generator.load(tuned)
    parts.append((tuned_writer, *generator.generate({c: n - old.get(c, 0) for c, n in allocation.items()}, seed=seed)))
    report = {**generator.generation_report(), **report}
    by_code: dict[str, list[tuple[str, str]]] = {c: [] for c in allocation}
    for writer, texts, codes in parts:
        for text, code in zip(texts, codes):
            by_code[code].append((text, writer))
    rows = [(t, c, w) for c in allocation for t, w in by_code[c]]
    pool = Pool([t for t, _, _ in rows], [c for _, c, _ in rows], [w for _, _, w in rows], report)
    pool.report["writers"] = _written(pool.codes, pool.writers)
    return pool


def _written(codes: Sequence[str], writers: Sequence[str]) -> dict[str, dict[str, int]]:
    counts = Counter(zip(codes, writers))
    return {c: {w: n for (cc, w), n in sorted(counts.items()) if cc == c} for c in dict.fromkeys(codes)}


def writers_of(texts: Sequence[str], pool_texts: Sequence[str], pool_writers: Sequence[str], default: str) -> list[str]:
    """The writer of each of ``texts``: its pool text's writer where it is one of the pool's
    texts, else ``default`` (the weights the generator holds wrote it). For a refinement that
    returns its population without writers (a plug-in written before writers existed)."""
    known = dict(zip(pool_texts, pool_writers))
    return [known.get(t, default) for t in texts]


def kept_shares(codes: Sequence[str], writers: Sequence[str], selected: Sequence[int]) -> dict[str, dict[str, float]]:
    """Per code of the final set (``selected`` positions of the population), the share of its
    kept texts each writer wrote: what the votes chose. Public: a function of the pool and the
    released votes."""
    kept = Counter((codes[i], writers[i]) for i in selected)
    totals = Counter(codes[i] for i in selected)
    names = sorted(set(writers))
    return {c: {w: kept.get((c, w), 0) / totals[c] for w in names} for c in dict.fromkeys(codes) if totals.get(c)}


def pool_writers(res: FedSynResult) -> list[str]:
    """Each population text's writer (``unknown`` for a run checkpointed before writers existed)."""
    return list(res.pool_writers) if len(res.pool_writers) == len(res.pool_texts) else ["unknown"] * len(res.pool_texts)


def writers_summary(res: FedSynResult) -> dict[str, Any]:
    """The writers' part of ``profile.json``, ``evaluation.json`` and the privacy report: the share
    of each code's pool θ⁰ was to write and why, and per code the share of the kept texts each
    writer wrote (what the votes chose; post-processing of released votes, free in ε)."""
    selected = sorted(int(i) for i in (res.selected if res.selected is not None else []))
    return {"pretrained_share": res.pretrained_share, "why": res.writers_note,
            "pool": res.generation.get("writers", {}),
            "kept_share": kept_shares(res.pool_codes, pool_writers(res), selected)}
