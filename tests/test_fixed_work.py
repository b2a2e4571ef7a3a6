"""Issue 45: a vote does the work of the node's public size bound, whatever its file holds.

The vote embeds every record; its time grew with |D| and with the records' lengths, and Flower
reports each reply's ClientApp time to the server. Under ``max-records`` the records are embedded
as exactly that many rows, each padded to the vote window (``fedsyn_client.histograms``), so the
work is the same for 50 records or 1,000 (5,000 in the benchmark), short or long. (DP-SGD's: ``tests/test_training.py``.)
"""

from __future__ import annotations

import numpy as np
import pytest

from common.config import RunConfig
from common.data import TextData
from common.models import MINILM, embed, load_embedder
from fedsyn_client import histograms


def _tokens_through(monkeypatch, records: TextData, bound: int, window: int) -> list[tuple[int, ...]]:
    embedder = load_embedder(MINILM)
    shapes: list[tuple[int, ...]] = []
    forward = embedder.forward

    def counted(features, *a, **k):
        shapes.append(tuple(features["input_ids"].shape))
        return forward(features, *a, **k)

    with monkeypatch.context() as patch:
        patch.setattr(embedder, "forward", counted)
        histograms._EMBEDDING_CACHE.clear()
        vectors = histograms.local_embeddings(records, MINILM, window, bound)
    assert vectors.shape[0] == len(records)
    return shapes


def test_a_votes_work_is_the_bounds_for_50_or_1000_records_short_or_long(monkeypatch):
    short = TextData([f"note {i}" for i in range(50)], ["topic=a"] * 50)
    many = TextData([f"a longer note about the markets, number {i}, " * 3 for i in range(1000)], ["topic=a"] * 1000)
    long = TextData([*short.texts[:49], "word " * 5000], ["topic=a"] * 50)
    work = [_tokens_through(monkeypatch, d, bound=1000, window=32) for d in (short, many, long)]
    assert work[0] == work[1] == work[2]
    assert sum(s[0] for s in work[0]) == 1000 and all(s[1] == 32 for s in work[0])


def test_padding_to_the_window_changes_no_vector():
    embedder = load_embedder(MINILM)
    texts = ["short", "a somewhat longer text about football and markets", "x " * 100]
    loose = embed(embedder, texts, max_tokens=32)
    fixed = embed(embedder, texts, max_tokens=32, fixed_width=True)
    assert np.abs(loose - fixed).max() < 1e-5


def test_a_histogram_gets_the_bound_and_a_plug_in_without_it_still_works():
    cfg = RunConfig(max_length=16)
    records = TextData(["note one", "note two"], ["topic=a", "topic=b"])
    compute, sensitivity = histograms.vote_histogram("knn-vote", records, ["cand a", "cand b"], ["topic=a", "topic=b"],
                                                     {"num-votes": 1}, cfg, bound=7)
    assert sensitivity == pytest.approx(1.0) and compute().shape == (2,)
    seen = {}

    def old_style(records, texts, codes, params, cfg):
        seen["called"] = True
        return (lambda: np.zeros(len(texts))), 1.0

    histograms.VOTE_HISTOGRAMS["old-style"] = old_style
    try:
        histograms.vote_histogram("old-style", records, ["c"], ["topic=a"], {}, cfg, bound=7)
    finally:
        del histograms.VOTE_HISTOGRAMS["old-style"]
    assert seen == {"called": True}
