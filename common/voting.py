"""The node's vote maths (stage 4, paper Algorithm A.2 and its kin), in common so the histogram
objects (``common.histograms``) own it; pure numpy, computed only on a node.

Every histogram here does the work of ``bound`` rows, whatever |D| (issue 60): the records are
followed by zero filler rows up to the node's public bound, every row is scored against every
candidate in fixed-shape blocks, and which candidates a row may pick (its own code's, or the other
codes') is a mask, as is whether the row counts at all (a record, or filler). Nothing loops over
the records or their codes, so neither the time nor the memory of a vote follows |D| or how the
records spread over the codes. Without a bound (a simulated node) the rows are the records alone.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np

# Similarities are computed for at most this many (row, text) pairs at a time: memory stays
# O(texts) per block instead of O(rows x texts), so a node of 10^5 rows voting on 10^4 texts
# needs a few hundred MB, not 16 GB (docs/scale.md). Every pair is still scored once.
BLOCK_PAIRS = 1 << 22
FILLER = -2  # a filler row's code: no candidate's (a record's code no candidate has is -1)


TILE = 64  # rows multiplied at a time (``_similarities``); the blocks below are whole tiles


def _blocks(n_rows: int, n_cols: int) -> Iterator[slice]:
    step = max(TILE, BLOCK_PAIRS // max(1, n_cols) // TILE * TILE)  # whole tiles: a row's tile never moves
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


def padded(emb: np.ndarray, bound: int | None) -> np.ndarray:
    """``emb`` (one row per record) followed by zero rows up to ``bound`` rows: the filler a vote
    scores and masks out. None, or a bound the rows already reach: ``emb`` as it is."""
    emb = np.asarray(emb, dtype=np.float64)
    if bound is None or len(emb) >= bound:
        return emb
    out = np.zeros((bound, emb.shape[1] if emb.ndim == 2 else 0), dtype=np.float64)
    out[:len(emb)] = emb
    return out


def _scored(local_emb: np.ndarray, local_codes: list[str], syn_emb: np.ndarray, syn_codes: list[str],
            bound: int | None) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """(cosine similarities, own-code mask, counts mask) for each block of the rows.

    The rows are the records (one per code of ``local_codes``, the first rows of ``local_emb``) and
    filler up to ``bound`` (zero rows, code ``FILLER``): each block is rows x every candidate, the
    own-code mask says which candidates share the row's code, and the counts mask is True for a
    record's row, False for filler. Every row is scored the same way, record or filler."""
    n, n_syn = len(local_codes), len(syn_codes)
    syn_t = np.asarray(syn_emb, dtype=np.float64).T
    local = np.asarray(local_emb, dtype=np.float64)
    if local.size == 0:  # no record: the rows are filler alone, of the candidates' width
        local = np.zeros((0, syn_t.shape[0]))
    rows = max(n, len(local), bound or 0)
    loc = padded(local, rows)
    position = {code: j for j, code in enumerate(dict.fromkeys(syn_codes))}
    syn_code = np.fromiter((position[c] for c in syn_codes), dtype=np.int64, count=n_syn)
    # one lookup per row, record or filler: the same work for every |D| under the bound
    slots = list(local_codes) + [None] * (rows - n)
    row_code = np.fromiter((FILLER if c is None else position.get(c, -1) for c in slots), dtype=np.int64, count=rows)
    real = np.arange(rows) < n
    for block in _blocks(rows, n_syn):
        yield _similarities(loc[block], syn_t), row_code[block, None] == syn_code[None, :], real[block]


def _similarities(loc: np.ndarray, syn_t: np.ndarray) -> np.ndarray:
    """``loc @ syn_t``, each row's values the same bits whatever block it is in and however many
    rows follow it: BLAS picks its kernel by the matrix's shape (gemv for one row, and OpenBLAS'
    gemm rounds a row differently at 17 rows than at 64), so the rows are multiplied in tiles of
    ``TILE`` rows, the last one padded with zero rows, and every tile has the same shape."""
    out = np.empty((len(loc), syn_t.shape[1]))
    for start in range(0, len(loc), TILE):
        tile = loc[start:start + TILE]
        if len(tile) < TILE:
            tile = np.vstack([tile, np.zeros((TILE - len(tile), loc.shape[1]))])
        out[start:start + TILE] = (tile @ syn_t)[:min(TILE, len(loc) - start)]
    return out


def _nearest(sims: np.ndarray, allowed: np.ndarray, counts: np.ndarray, k: int) -> np.ndarray:
    """How many counted rows have each candidate among their ``k`` nearest *allowed* candidates
    (fewer when a row has fewer allowed), as a float vector of whole numbers, one per candidate.

    Each row takes its ``min(k, candidates)`` best of the row with the disallowed ones at -inf,
    then keeps those that are allowed and counted: a mask over a fixed shape, never a subset of
    the rows. A row counts each candidate at most once: argpartition picks distinct columns."""
    kk = min(k, sims.shape[1])
    top = np.argpartition(np.where(allowed, -sims, np.inf), kk - 1, axis=1)[:, :kk]
    hit = np.take_along_axis(allowed, top, axis=1) & counts[:, None]
    return np.bincount(top.ravel(), weights=hit.ravel().astype(np.float64), minlength=sims.shape[1])


def knn_votes(local_emb: np.ndarray, local_codes: list[str], syn_emb: np.ndarray, syn_codes: list[str], k: int,
              bound: int | None = None) -> np.ndarray:
    """Un-noised vote vector v_i over the synthetic texts (one int count per text).

    Input: L2-normalised embeddings of the local records and of the synthetic texts,
    each with its control code, K, and the node's public ``bound`` (the rows the work is; None:
    the records). For every code, each local record votes +1 for its K nearest synthetic texts
    *of the same code* by cosine similarity (fewer when that code has fewer than K texts). Each
    record therefore adds at most K distinct +1s, so adding or removing one record changes v by
    at most sqrt(K) in L2: the sensitivity the vote mechanism is calibrated for. Records whose
    code has no synthetic text cast no vote; filler rows are scored and cast none.
    """
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    votes = np.zeros(len(syn_codes), dtype=np.float64)
    if len(syn_codes):
        for sims, own, counts in _scored(local_emb, local_codes, syn_emb, syn_codes, bound):
            votes += _nearest(sims, own, counts, k)
    return votes.astype(np.int64)  # whole numbers far below 2^53: exact


def contrastive_votes(local_emb: np.ndarray, local_codes: list[str], syn_emb: np.ndarray, syn_codes: list[str],
                      k: int, bound: int | None = None) -> np.ndarray:
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
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    votes = np.zeros(len(syn_codes), dtype=np.float64)
    if len(syn_codes):
        for sims, own, counts in _scored(local_emb, local_codes, syn_emb, syn_codes, bound):
            votes += _nearest(sims, own, counts, k) - _nearest(sims, ~own, counts, k)
    return votes.astype(np.int64)


def similarity_scores(local_emb: np.ndarray, local_codes: list[str], syn_emb: np.ndarray, syn_codes: list[str],
                      bound: int | None = None,
                      rounding: Callable[[np.ndarray], np.ndarray] | None = None,
                      centred: bool = False) -> np.ndarray:
    """Un-noised POPri scores over the synthetic texts (POPri's SIMILARITY, per record).

    Input as for ``knn_votes``. Each local record's vector holds its cosine similarity to
    every synthetic text *of its own code* (0 elsewhere), clipped to L2 norm 1; the scores
    are the sum of these vectors. Adding or removing one record therefore changes the
    scores by at most 1 in L2. (POPri clips each *client's* mean vector: its privacy unit is
    the client; ours is a record, and a mean would divide by the private record count.)
    Filler rows are scored and weighted 0. ``rounding`` (a masked round, issue 73): each block of
    the rows' vectors is handed to it (``common.skellam.round_rows``: scaled, rounded at random)
    and the integers it returns are summed instead (int64).

    ``centred`` (issue 74, Concordia's choice): each record's own-code similarities minus their mean
    over its code's candidates, then clipped to norm 1 (sensitivity still 1). A record's mean cosine
    is the same for every candidate of its code, so it ranks nothing; left in, it takes most of the
    norm the clip allows, and the differences between candidates, which are the signal, shrink by
    the clip while the noise does not. Centred scores also sum to about 0 per code, so A.4's clamp
    at 0 keeps the texts the records prefer.
    """
    if rounding is not None:
        total = np.zeros(len(syn_codes), dtype=np.int64)
        if len(syn_codes):
            for vectors in _clipped_similarities(local_emb, local_codes, syn_emb, syn_codes, bound, centred):
                total += np.asarray(rounding(vectors), dtype=np.int64).sum(axis=0)  # integers: any order, one sum
        return total
    scores = np.zeros(len(syn_codes), dtype=np.float64)
    if len(syn_codes):
        for vectors in _clipped_similarities(local_emb, local_codes, syn_emb, syn_codes, bound, centred):
            # row by row, in row order: a filler row adds 0.0, which changes no sum. Not ``.sum(axis=0)``:
            # numpy 2.4 reduces axis 0 pairwise, so the filler rows would regroup the records' sums
            for row in vectors:
                scores += row
    return scores


def _clipped_similarities(local_emb: np.ndarray, local_codes: list[str], syn_emb: np.ndarray, syn_codes: list[str],
                          bound: int | None, centred: bool = False) -> Iterator[np.ndarray]:
    """Each block's per-row vectors of ``similarity_scores``: a record's own-code similarities
    (``centred``: minus their mean) clipped to norm 1, a filler row's zeros."""
    for sims, own, counts in _scored(local_emb, local_codes, syn_emb, syn_codes, bound):
        mine = np.where(own, sims, 0.0)
        if centred:  # every row, record or filler, does the same work: the mean of its own-code values
            mine = np.where(own, mine - mine.sum(axis=1, keepdims=True) / np.maximum(1, own.sum(axis=1, keepdims=True)),
                            0.0)
        norms = np.linalg.norm(mine, axis=1, keepdims=True)
        yield np.where(counts[:, None], mine / np.maximum(1.0, norms), 0.0)
