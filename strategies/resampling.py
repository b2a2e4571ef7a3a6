"""Stage 4 (refine), after the votes: resampling the synthetic pool by its noisy votes (paper Algorithm A.4)."""

from __future__ import annotations

import math

import numpy as np


def sample_size(n: int, rate: float) -> int:
    """``M = min(n, max(1, floor(rate * n)))`` of Algorithm A.4 (0 when n = 0)."""
    return min(n, max(1, math.floor(rate * n)))


def sample_without_replacement(weights: np.ndarray, rate: float, rng: np.random.Generator,
                               size: int | None = None) -> np.ndarray:
    """Algorithm A.4 for one control code: draw M indices without replacement.

    Input: the code's noisy votes (clamped at 0 here), the sampling rate r and a
    generator; ``size`` draws that many instead of M (at most all). Output: M positions
    into ``weights``, in draw order. Each draw picks i
    with probability w_i / W over the remaining items, or uniformly when W = 0 (also
    when the positive-weight items run out mid-way). Written by hand because numpy's
    ``choice(replace=False, p=...)`` refuses once fewer than M items have p > 0, which
    is exactly the case A.4 defines.
    """
    w = np.clip(np.asarray(weights, dtype=np.float64), 0.0, None)
    n = w.size
    remaining = list(range(n))
    chosen: list[int] = []
    for _ in range(min(n, sample_size(n, rate) if size is None else size)):
        rw = w[remaining]
        total = rw.sum()  # recomputed, not decremented, so float drift never makes W < 0
        pos = rng.choice(len(remaining), p=rw / total) if total > 0 else rng.integers(len(remaining))
        chosen.append(remaining.pop(int(pos)))
    return np.asarray(chosen, dtype=np.int64)


def resample_by_code(codes: list[str], votes: np.ndarray | None, rate: float, seed: int,
                     among: np.ndarray | None = None) -> np.ndarray:
    """Apply A.4 per control code over the whole pool; returns selected pool indices.

    ``votes = None`` is the ``uniform`` baseline (paper Table A.14): every weight equal.
    Codes are processed in sorted order and each gets its own child generator, so the
    selection of one code does not depend on the size of another.

    ``among`` (a boolean per text): each code still keeps M = ``sample_size(n_c, rate)`` of its
    n_c texts, drawn by A.4 among its ``among`` texts first and, only when those are fewer than
    M, the rest among its others (``strategies.writers``: the code's better-voted writer).
    """
    codes_arr = np.asarray(codes)
    if votes is not None and len(votes) != len(codes):
        raise ValueError(f"{len(votes)} votes for {len(codes)} synthetic texts")
    seeds = np.random.SeedSequence(seed)
    selected: list[np.ndarray] = []
    unique = sorted(set(codes))
    for code, child in zip(unique, seeds.spawn(len(unique))):
        idx = np.flatnonzero(codes_arr == code)
        w = np.ones(idx.size) if votes is None else np.asarray(votes, dtype=np.float64)[idx]
        rng = np.random.default_rng(child)
        if among is None or np.asarray(among)[idx].all():
            selected.append(idx[sample_without_replacement(w, rate, rng)])
            continue
        first = np.asarray(among, dtype=bool)[idx]
        m = sample_size(idx.size, rate)
        kept = idx[first][sample_without_replacement(w[first], rate, rng, size=m)]
        rest = idx[~first][sample_without_replacement(w[~first], rate, rng, size=m - kept.size)]
        selected.append(np.concatenate([kept, rest]))
    return np.concatenate(selected) if selected else np.zeros(0, dtype=np.int64)
