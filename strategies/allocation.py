"""Stage 2 allocation: how many synthetic samples each control code gets (Algorithm 1), for stage 3's pool."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def aggregate_profiles(noisy_profiles: Sequence[np.ndarray | Sequence[float]]) -> np.ndarray:
    """Global noisy profile P~ = sum_i P~_i over the nodes' noisy count vectors."""
    if not noisy_profiles:
        raise ValueError("no profiles to aggregate")
    return np.sum(np.stack([np.asarray(p, dtype=np.float64) for p in noisy_profiles]), axis=0)


def allocate(noisy_profile: np.ndarray, num_synthetic: int) -> np.ndarray:
    """Samples per code: ``s_j = round(s * P~_j / sum P~)`` with negative counts clamped to 0.

    Input: the global noisy profile (one float per code) and s. Output: int array of
    s_j. Rounding is the paper's (half to even, so sum s_j may differ from s by a few).
    If every clamped count is 0 (all noise), there is no signal: allocate uniformly,
    which is the profile-free baseline, rather than generate nothing.
    """
    p = np.clip(np.asarray(noisy_profile, dtype=np.float64), 0.0, None)
    if p.size == 0:
        return np.zeros(0, dtype=np.int64)
    total = p.sum()
    share = p / total if total > 0 else np.full(p.size, 1.0 / p.size)
    return np.rint(num_synthetic * share).astype(np.int64)


def allocate_exactly(noisy_profile: np.ndarray, num_synthetic: int) -> np.ndarray:
    """As ``allocate``, but the counts sum to exactly ``num_synthetic`` (largest remainders).

    For a user who asks for N texts (``fedsyn generate -n N``): the paper's per-code rounding can
    give N ± (number of codes). Each code gets the floor of its share, and the codes with the
    largest remainders one more each (ties: the lower index), until the total is N.
    """
    p = np.clip(np.asarray(noisy_profile, dtype=np.float64), 0.0, None)
    if p.size == 0:
        return np.zeros(0, dtype=np.int64)
    share = p / p.sum() if p.sum() > 0 else np.full(p.size, 1.0 / p.size)
    exact = num_synthetic * share
    counts = np.floor(exact).astype(np.int64)
    extra = num_synthetic - int(counts.sum())
    counts[np.argsort(-(exact - counts), kind="stable")[:extra]] += 1
    return counts
