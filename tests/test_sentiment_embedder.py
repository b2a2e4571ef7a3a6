"""The sentiment-seeing vote embedder (MiniLM + VADER polarity) and the fixed evaluation embedder."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import numpy as np
import pytest

from common import sentiment_embedder
from common.config import RunConfig
from common.models import MINILM_VADER, embed, load_embedder
from common.sentiment_embedder import polarity, with_polarity

GOOD, BAD = "A wonderful, moving film; I loved every minute.", "A dull, ugly, terrible mess; I hated it."


def test_with_polarity_appends_one_scaled_axis_and_renormalises():
    rng = np.random.default_rng(0)
    unit = rng.normal(size=(5, 7)).astype(np.float32)
    unit /= np.linalg.norm(unit, axis=1, keepdims=True)
    scores = np.array([-1.0, -0.5, 0.0, 0.5, 1.0], dtype=np.float32)
    out = with_polarity(unit, scores, weight=2.0)
    assert out.shape == (5, 8) and out.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(out, axis=1), 1.0, atol=1e-6)
    # each row is [v, 2s] / sqrt(1 + 4 s^2): the direction of v is kept, the new axis carries 2s
    np.testing.assert_allclose(out[:, -1], 2 * scores / np.sqrt(1 + 4 * scores**2), atol=1e-6)
    np.testing.assert_allclose(out[2, :-1], unit[2], atol=1e-6)


def test_polarity_reads_sentiment_and_a_text_it_cannot_score_is_neutral(monkeypatch):
    good, bad, neutral = polarity([GOOD, BAD, "The film is ninety minutes long."])
    assert good > 0.5 and bad < -0.5 and abs(neutral) < 0.2

    from vaderSentiment import vaderSentiment as vader

    real = vader.SentimentIntensityAnalyzer.polarity_scores

    def fails_on_one(self, text):  # a record no scorer handles must not make the vote fail
        if text == "boom":
            raise ValueError("boom")
        return real(self, text)

    monkeypatch.setattr(vader.SentimentIntensityAnalyzer, "polarity_scores", fails_on_one)
    out = polarity([GOOD, "boom"])
    assert out[0] > 0.5 and out[1] == 0.0


def test_vader_embedder_sees_polarity_that_minilm_barely_sees():
    """Two reviews of the same film with opposite polarity are nearer in MiniLM than in
    MiniLM + VADER; the vectors are unit rows with one more axis, and the polarity is read
    from the same window of tokens that MiniLM embeds."""
    minilm, vader = load_embedder(), load_embedder(MINILM_VADER)
    assert load_embedder(MINILM_VADER).inner is minilm  # one shared MiniLM, loaded from the package
    texts = [f"The new Batman film: {GOOD}", f"The new Batman film: {BAD}"]
    m, v = embed(minilm, texts), embed(vader, texts)
    assert v.shape == (2, 385) and vader.get_sentence_embedding_dimension() == 385
    np.testing.assert_allclose(np.linalg.norm(v, axis=1), 1.0, atol=1e-5)
    assert float(v[0] @ v[1]) < float(m[0] @ m[1]) - 0.2
    assert v[0, -1] > 0 > v[1, -1]
    # a 6-token window holds "the new batman film :" alone: no polarity, and the shared limit is restored
    limit = minilm.max_seq_length
    cut = embed(vader, texts, max_tokens=7)
    assert cut[0, -1] == cut[1, -1] == 0.0
    np.testing.assert_allclose(cut[0], cut[1], atol=1e-6)
    assert minilm.max_seq_length == limit == vader.max_seq_length


def test_vader_embedder_votes_for_the_text_that_carries_the_polarity():
    """A contrastive vote with MiniLM + VADER rewards the candidate of the record's own code
    whose polarity matches; the histogram runs through the node's registry."""
    from common.data import TextData
    from fedsyn_client.histograms import vote_histogram

    cfg = RunConfig(embedder=MINILM_VADER, control_columns=("sentiment",), num_votes=1)
    records = TextData([f"Batman review: {GOOD}", "Batman review: Brilliant acting, a joy to watch."],
                       ["sentiment=positive", "sentiment=positive"])
    candidates = ["Batman review: a gripping, beautiful film.", "Batman review: a boring, awful film.",
                  "Batman review: a boring, awful film.", "Batman review: a gripping, beautiful film."]
    codes = ["sentiment=positive", "sentiment=positive", "sentiment=negative", "sentiment=negative"]
    compute, sensitivity = vote_histogram("contrastive-vote", records, candidates, codes, {"num-votes": 1}, cfg)
    votes = compute()
    assert sensitivity == pytest.approx(np.sqrt(2))
    # both records: +1 to the positive text of their code, -1 to the nearest other-code text
    np.testing.assert_array_equal(votes, [2.0, 0.0, 0.0, -2.0])


def test_evaluation_embedder_is_its_own_key_and_defaults_to_minilm():
    cfg = RunConfig.from_flower({"embedder": MINILM_VADER})
    assert cfg.eval_embedder == "all-MiniLM-L6-v2" and cfg.embedder == MINILM_VADER
    assert RunConfig.from_flower({"eval-embedder": MINILM_VADER}).eval_embedder == MINILM_VADER


def test_zero_weight_is_minilm_direction():
    vader = sentiment_embedder.SentimentEmbedder(load_embedder(), weight=0.0)
    m, v = embed(load_embedder(), [GOOD]), embed(vader, [GOOD])
    np.testing.assert_allclose(v[:, :-1], m, atol=1e-6)
    assert v[0, -1] == 0.0
