"""Issue 45: a vote does the work of the node's public size bound, whatever its file holds.

The vote embeds every record; its time grew with |D| and with the records' lengths, and Flower
reports each reply's ClientApp time to the server. Under ``max-records`` the records are embedded
as exactly that many rows, each padded to the vote window (``fedsyn_client.histograms``), so the
work is the same for 50 records or 300 (2,000 in the benchmark), short or long. (DP-SGD's: ``tests/test_training.py``.)
"""

from __future__ import annotations

import numpy as np
import pytest

from common.config import RunConfig
from common.data import TextData
from common.models import MINILM, embed, load_embedder
from fedsyn_client import histograms


def _tokens_through(monkeypatch, records: TextData, bound: int, window: int) -> tuple[list[tuple[int, ...]], int]:
    """(the shapes through the embedder, the bytes of text its tokenizer read) of one vote's embedding."""
    embedder = load_embedder(MINILM)
    shapes: list[tuple[int, ...]] = []
    read: list[int] = []
    forward, call = embedder.forward, type(embedder.tokenizer).__call__

    def counted(features, *a, **k):
        shapes.append(tuple(features["input_ids"].shape))
        return forward(features, *a, **k)

    def tokenized(self, text=None, *a, **k):
        read.append(sum(len(t.encode("utf-8")) for t in ([text] if isinstance(text, str) else text)))
        return call(self, text, *a, **k)

    with monkeypatch.context() as patch:
        patch.setattr(embedder, "forward", counted)
        patch.setattr(type(embedder.tokenizer), "__call__", tokenized)
        vectors = histograms.local_embeddings(records, MINILM, window, bound)
    assert vectors.shape[0] == len(records)
    return shapes, sum(read)


def test_a_votes_work_is_the_bounds_for_50_or_300_records_short_or_long(monkeypatch):
    """The rows and width through the embedder, and the bytes its tokenizer reads (records cut to
    8 bytes a token of the window, filler rows, ballast for what short records lack), are the
    bound's: 2,000 news articles took 3.5 s to tokenize where 100 took 0.2 s."""
    short = TextData([f"note {i}" for i in range(50)], ["topic=a"] * 50)
    many = TextData([f"a longer note about the markets, number {i}, " * 3 for i in range(300)], ["topic=a"] * 300)
    long = TextData([*short.texts[:49], "wörd " * 5000], ["topic=a"] * 50)
    work = [_tokens_through(monkeypatch, d, bound=300, window=32) for d in (short, many, long)]
    assert work[0] == work[1] == work[2]
    shapes, read = work[0]
    assert sum(s[0] for s in shapes) == 300 and all(s[1] == 32 for s in shapes)
    assert read == 300 * 8 * 32


def test_a_cut_keeps_whole_characters_and_the_window_a_record_fills():
    from fedsyn_client.fixed_work import ballast, cut, filler

    assert cut("añb", 2) == "a" and cut("añb", 3) == "añ" and cut("abc", 10) == "abc"
    assert len(filler(100).encode()) == 100
    embedder = load_embedder(MINILM)
    text = "The markets rallied on Tuesday as investors weighed the central bank's decision. " * 40
    # 8 bytes a token: the first 32 tokens of an English text are all within its first 256 bytes
    assert np.abs(embed(embedder, [text], max_tokens=32)
                  - embed(embedder, [cut(text, 256)], max_tokens=32)).max() < 1e-5
    seen = []

    class Counting:
        def __call__(self, text, **kw):
            seen.extend([text] if isinstance(text, str) else text)

    assert ballast(Counting(), ["ab", "", "abcd"], 3, 10) == 24
    assert sum(len(t) for t in seen) == 24 and max(len(t) for t in seen) == 10


def test_padding_to_the_window_changes_no_vector():
    embedder = load_embedder(MINILM)
    texts = ["short", "a somewhat longer text about football and markets", "x " * 100]
    loose = embed(embedder, texts, max_tokens=32)
    fixed = embed(embedder, texts, max_tokens=32, fixed_width=True)
    assert np.abs(loose - fixed).max() < 1e-5


def test_a_histogram_is_handed_the_bounds_rows_and_one_without_bound_is_refused():
    """Issue 62: the node pads the records to the bound before a histogram sees them, so a plug-in
    does the bound's work by construction; one whose ``score`` cannot take ``bound`` is refused
    at ``register`` (before, it was called without it and did the records' work)."""
    from common.histograms import Histogram, register, unregister

    cfg = RunConfig(max_length=16)
    records = TextData(["note one", "note two"], ["topic=a", "topic=b"])
    compute, sensitivity = histograms.vote_histogram("knn-vote", records, ["cand a", "cand b"], ["topic=a", "topic=b"],
                                                     {"num-votes": 1}, cfg, bound=7)
    assert sensitivity == pytest.approx(1.0) and compute().shape == (2,)
    seen = {}

    class OldStyle(Histogram):
        name, formula = "old-style", "1"

        def sensitivity(self, params):
            return 1.0

        def score(self, rows, codes, candidates, candidate_codes, params):
            return np.zeros(len(candidate_codes))

    with pytest.raises(TypeError, match="no keyword parameter 'bound'"):
        register(OldStyle())

    class Seeing(OldStyle):
        def score(self, rows, codes, candidates, candidate_codes, params, *, bound):
            seen.update(rows=rows.shape[0], codes=len(codes), bound=bound)
            return np.zeros(len(candidate_codes))

    register(Seeing())
    try:
        compute, _ = histograms.vote_histogram("old-style", records, ["c"], ["topic=a"], {}, cfg, bound=7)
        compute()
    finally:
        unregister("old-style")
    assert seen == {"rows": 7, "codes": 2, "bound": 7}


def test_finding7_a_votes_counting_scores_the_bounds_rows_for_any_records(monkeypatch):
    """Issue 60: after the embedding, the vote's kernel scores ``bound`` rows (the records' vectors,
    then zero rows) against every candidate, for 2 records or 6 of one code (that the result is the
    records' alone, bit for bit: ``tests/test_bound_work.py``)."""
    from common import voting

    seen: list[tuple[int, ...]] = []
    nearest = voting._nearest
    monkeypatch.setattr(voting, "_nearest", lambda sims, *a: seen.append(sims.shape) or nearest(sims, *a))
    cfg = RunConfig(max_length=16)
    cands, codes = ["cand a", "cand b", "cand c"], ["topic=a", "topic=b", "topic=a"]
    for records in (TextData(["note one", "note two"], ["topic=a", "topic=b"]),
                    TextData([f"note {i}" for i in range(6)], ["topic=a"] * 6)):
        seen.clear()
        compute, _ = histograms.vote_histogram("contrastive-vote", records, cands, codes, {"num-votes": 1}, cfg,
                                               bound=7)
        assert compute().shape == (3,)
        assert seen == [(7, 3), (7, 3)]  # own and other codes, every row against every candidate
