"""Stage 4 on a node: kNN votes of local records for synthetic texts (paper Algorithm A.2)."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

# Similarities are computed for at most this many (record, text) pairs at a time: memory stays
# O(texts) per block instead of O(records x texts), so a node of 10^5 records voting on 10^4
# texts of one code needs ~100 MB, not 16 GB (docs/scale.md). Every pair is still scored once.
BLOCK_PAIRS = 1 << 22


def _blocks(n_rows: int, n_cols: int) -> Iterator[slice]:
    step = max(1, BLOCK_PAIRS // max(1, n_cols))
    for start in range(0, n_rows, step):
        yield slice(start, min(n_rows, start + step))


def finite_rows(emb: np.ndarray) -> np.ndarray:
    """``emb`` with every row that holds a non-finite value replaced by zeros.

    A record (or a candidate) whose embedding overflowed, or that a crafted embedder made NaN,
    must not decide what the node releases: NaN compares as neither near nor far, and would
    pass through clipping and noise as NaN. A zero row is a fixed value that scores 0 against
    everything, so the record's contribution stays within the histogram's sensitivity.
    """
    emb = np.asarray(emb, dtype=np.float64)
    bad = ~np.isfinite(emb).all(axis=1) if emb.ndim == 2 else ~np.isfinite(emb)
    if bad.any():
        emb = emb.copy()
        emb[bad] = 0.0
    return emb


def knn_votes(
    local_emb: np.ndarray, local_codes: list[str], syn_emb: np.ndarray, syn_codes: list[str], k: int
) -> np.ndarray:
    """Un-noised vote vector v_i over the synthetic texts (one int count per text).

    Input: L2-normalised embeddings of the local records and of the synthetic texts,
    each with its control code, and K. For every code, each local record votes +1 for
    its K nearest synthetic texts *of the same code* by cosine similarity (fewer when
    that code has fewer than K texts). Each record therefore adds at most K distinct
    +1s, so adding or removing one record changes v by at most sqrt(K) in L2: the
    sensitivity the vote mechanism is calibrated for. Records whose code has no
    synthetic text cast no vote.
    """
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    votes = np.zeros(len(syn_codes), dtype=np.int64)
    local_codes_arr, syn_codes_arr = np.asarray(local_codes), np.asarray(syn_codes)
    for code in set(local_codes) & set(syn_codes):
        own = np.flatnonzero(syn_codes_arr == code)
        votes += _nearest_counts(local_emb[local_codes_arr == code], syn_emb, own, k)
    return votes


def _nearest_counts(loc: np.ndarray, syn_emb: np.ndarray, candidates: np.ndarray, k: int) -> np.ndarray:
    """How many rows of ``loc`` have each synthetic text among their ``min(k, len(candidates))``
    nearest of ``candidates`` (indices into ``syn_emb``), as one count per synthetic text. A row
    counts each text at most once: argpartition picks distinct columns."""
    counts = np.zeros(len(syn_emb), dtype=np.int64)
    kk, syn = min(k, candidates.size), syn_emb[candidates]
    for rows in _blocks(len(loc), candidates.size):
        sims = loc[rows] @ syn.T  # cosine: rows are unit vectors
        top = np.argpartition(-sims, kk - 1, axis=1)[:, :kk]
        counts += np.bincount(candidates[top.ravel()], minlength=counts.size)
    return counts


def contrastive_votes(
    local_emb: np.ndarray, local_codes: list[str], syn_emb: np.ndarray, syn_codes: list[str], k: int
) -> np.ndarray:
    """Un-noised contrastive vote vector over the synthetic texts (issue 34).

    Input as for ``knn_votes``. Each local record gives +1 to its K nearest synthetic texts *of
    its own code* (as ``knn_votes``) and -1 to its K nearest texts *of every other code*, pooled
    (fewer when there are fewer). A text that sits among another code's records loses what a
    text near its own code's records gains, so the votes reward carrying the code, not only
    looking like some record: MiniLM places texts by subject, and a "positive" review of the
    right film wins kNN votes although it reads negative.

    Each record touches at most K texts with +1 and K other texts with -1 (the two sets are
    disjoint: different codes), so adding or removing one record changes the vector by at most
    sqrt(2K) in L2: the sensitivity the node calibrates for. A record whose code has no text
    still gives its -1s (it says where its code's records are, and no text of its code is there).
    """
    votes = knn_votes(local_emb, local_codes, syn_emb, syn_codes, k)
    local_codes_arr, syn_codes_arr = np.asarray(local_codes), np.asarray(syn_codes)
    for code in set(local_codes):
        other = np.flatnonzero(syn_codes_arr != code)
        if other.size:
            votes -= _nearest_counts(local_emb[local_codes_arr == code], syn_emb, other, k)
    return votes


def similarity_scores(
    local_emb: np.ndarray, local_codes: list[str], syn_emb: np.ndarray, syn_codes: list[str]
) -> np.ndarray:
    """Un-noised POPri scores over the synthetic texts (POPri's SIMILARITY, per record).

    Input as for ``knn_votes``. Each local record's vector holds its cosine similarity to
    every synthetic text *of its own code* (0 elsewhere), clipped to L2 norm 1; the scores
    are the sum of these vectors. Adding or removing one record therefore changes the
    scores by at most 1 in L2. (POPri clips each *client's* mean vector: its privacy unit is
    the client; ours is a record, and a mean would divide by the private record count.)
    """
    scores = np.zeros(len(syn_codes), dtype=np.float64)
    local_codes_arr, syn_codes_arr = np.asarray(local_codes), np.asarray(syn_codes)
    for code in set(local_codes) & set(syn_codes):
        syn_idx = np.flatnonzero(syn_codes_arr == code)
        loc, syn = local_emb[local_codes_arr == code], syn_emb[syn_idx]
        for rows in _blocks(len(loc), syn_idx.size):
            sims = loc[rows] @ syn.T
            norms = np.linalg.norm(sims, axis=1, keepdims=True)
            scores[syn_idx] += (sims / np.maximum(1.0, norms)).sum(axis=0)
    return scores
