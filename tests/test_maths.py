"""Allocation, kNN voting and A.4 resampling as pure functions."""

import math

import numpy as np
import pytest

from common.voting import knn_votes
from strategies.allocation import aggregate_profiles, allocate, allocate_exactly
from strategies.resampling import resample_by_code, sample_size, sample_without_replacement


def _unit(rows):
    a = np.asarray(rows, dtype=float)
    return a / np.linalg.norm(a, axis=1, keepdims=True)


# ----------------------------------------------------------------- allocation
def test_allocation_follows_profile_and_clamps_negatives():
    alloc = allocate(np.array([30.0, 10.0, -4.0, 60.0]), 200)
    assert alloc.tolist() == [60, 20, 0, 120]


def test_an_exact_allocation_sums_to_what_was_asked():
    """`fedsyn generate -n 3` on a 5-code profile wrote 5 texts (one per code after rounding)."""
    profile = np.array([10.0, 11.0, 9.0, 10.0, 10.0])
    assert allocate(profile, 3).sum() == 5  # the paper's rounding: each 0.6 rounds up
    assert allocate_exactly(profile, 3).tolist() == [1, 1, 0, 1, 0]  # largest remainders, ties by index
    rng = np.random.default_rng(0)
    for _ in range(200):
        p, n = rng.normal(5, 5, size=rng.integers(1, 9)), int(rng.integers(1, 50))
        got = allocate_exactly(p, n)
        assert got.sum() == n and (got >= 0).all()
        assert np.abs(got - allocate(p, n)).max() <= 1  # never further than the paper's rounding by more than 1


def test_allocation_rounds_like_the_paper():
    alloc = allocate(np.array([1.0, 1.0, 1.0]), 10)  # 3.33 each
    assert alloc.tolist() == [3, 3, 3]


def test_allocation_all_noise_is_uniform():
    assert allocate(np.array([-1.0, -2.0]), 10).tolist() == [5, 5]


def test_aggregate_profiles_sums_nodes():
    assert aggregate_profiles([np.array([1.0, 2.0]), np.array([0.5, -1.0])]).tolist() == [1.5, 1.0]
    with pytest.raises(ValueError):
        aggregate_profiles([])


# ----------------------------------------------------------------- voting
def test_each_record_votes_for_its_k_nearest_same_code_candidates():
    syn = _unit([[1, 0], [0.9, 0.1], [0, 1], [1, 0.05], [0.1, 1]])
    syn_codes = ["a", "a", "a", "b", "b"]
    local = _unit([[1, 0.01]])
    v = knn_votes(local, ["a"], syn, syn_codes, k=2)
    # nearest two among code-a candidates only: 0 and 1; candidate 3 is as close but code b
    assert v.tolist() == [1, 1, 0, 0, 0]


def test_k_larger_than_candidates_votes_for_all_of_them():
    syn = _unit([[1, 0], [0, 1], [1, 1]])
    v = knn_votes(_unit([[1, 0], [0, 1]]), ["a", "a"], syn, ["a", "a", "b"], k=5)
    assert v.tolist() == [2, 2, 0]


def test_records_without_candidates_of_their_code_do_not_vote():
    syn = _unit([[1, 0]])
    assert knn_votes(_unit([[1, 0]]), ["z"], syn, ["a"], k=1).tolist() == [0]


@pytest.mark.parametrize("k", [1, 3, 5])
def test_vote_sensitivity_is_at_most_sqrt_k(k):
    rng = np.random.default_rng(k)
    syn, syn_codes = _unit(rng.normal(size=(40, 8))), list(rng.choice(["a", "b"], size=40))
    local, local_codes = _unit(rng.normal(size=(30, 8))), list(rng.choice(["a", "b"], size=30))
    base = knn_votes(local, local_codes, syn, syn_codes, k)
    for extra in range(10):
        rec = _unit(rng.normal(size=(1, 8)))
        code = ["a", "b"][extra % 2]
        plus = knn_votes(np.vstack([local, rec]), local_codes + [code], syn, syn_codes, k)
        diff = plus - base
        assert np.linalg.norm(diff) <= math.sqrt(k) + 1e-12
        assert diff.min() >= 0 and diff.max() <= 1  # distinct candidates
    # and every record uses all its K votes when enough candidates exist
    assert base.sum() == 30 * k


def test_votes_and_scores_in_blocks_equal_the_whole_similarity_matrix(monkeypatch):
    """Issue 24: the node scores records in blocks so memory is O(texts), not O(records x texts);
    the histograms must not change (brute force over the whole matrix is the reference)."""
    from common import voting

    rng = np.random.default_rng(3)
    syn, syn_codes = _unit(rng.normal(size=(50, 6))), list(rng.choice(["a", "b"], size=50))
    local, local_codes = _unit(rng.normal(size=(97, 6))), list(rng.choice(["a", "b", "c"], size=97))
    want_votes, want_scores = np.zeros(50, dtype=np.int64), np.zeros(50)
    for row, code in zip(local, local_codes):
        same = [j for j, c in enumerate(syn_codes) if c == code]
        if not same:
            continue
        sims = np.array([row @ syn[j] for j in same])
        for j in np.argsort(-sims)[:3]:
            want_votes[same[j]] += 1
        want_scores[same] += sims / max(1.0, np.linalg.norm(sims))
    monkeypatch.setattr(voting, "BLOCK_PAIRS", 7 * 25)  # blocks of 7 rows, the last one short
    assert voting.knn_votes(local, local_codes, syn, syn_codes, 3).tolist() == want_votes.tolist()
    assert np.allclose(voting.similarity_scores(local, local_codes, syn, syn_codes), want_scores)


def test_profile_sensitivity_is_one():
    from common.data import TextData

    data = TextData(["x", "y", "z"], ["a", "b", "a"])
    more = TextData(["x", "y", "z", "w"], ["a", "b", "a", "b"])
    diff = more.code_counts(["a", "b"]) - data.code_counts(["a", "b"])
    assert np.linalg.norm(diff) == 1.0


# ----------------------------------------------------------------- resampling (A.4)
@pytest.mark.parametrize("n,rate,m", [(0, 0.2, 0), (1, 0.2, 1), (4, 0.2, 1), (10, 0.2, 2), (10, 1.0, 10), (7, 0.5, 3)])
def test_sample_size(n, rate, m):
    assert sample_size(n, rate) == m


def test_draws_are_distinct_and_follow_weights():
    rng = np.random.default_rng(0)
    counts = np.zeros(4)
    for _ in range(4000):
        idx = sample_without_replacement(np.array([1.0, 0.0, 3.0, 0.0]), 0.25, rng)  # M = 1
        counts[idx] += 1
    assert counts[1] == counts[3] == 0
    assert counts[2] / counts[0] == pytest.approx(3.0, rel=0.15)


def test_zero_weights_draw_uniformly_and_run_out_gracefully():
    rng = np.random.default_rng(1)
    idx = sample_without_replacement(np.array([-1.0, 0.0, 0.0, 0.0]), 1.0, rng)
    assert sorted(idx.tolist()) == [0, 1, 2, 3]
    # one positive item: drawn first, then the rest uniformly
    firsts = {int(sample_without_replacement(np.array([0.0, 5.0, 0.0]), 1.0, rng)[0]) for _ in range(20)}
    assert firsts == {1}


def test_resample_by_code_keeps_codes_separate_and_sizes():
    codes = ["a"] * 10 + ["b"] * 5
    votes = np.r_[np.arange(10.0), np.zeros(5)]
    sel = resample_by_code(codes, votes, 0.2, seed=3)
    picked = [codes[i] for i in sel]
    assert picked.count("a") == 2 and picked.count("b") == 1
    assert len(set(sel.tolist())) == len(sel)
    assert np.array_equal(sel, resample_by_code(codes, votes, 0.2, seed=3))
    with pytest.raises(ValueError):
        resample_by_code(codes, votes[:3], 0.2, seed=0)


def test_resampling_prefers_voted_texts():
    codes = ["a"] * 100
    votes = np.zeros(100)
    votes[:10] = 50.0
    sel = resample_by_code(codes, votes, 0.1, seed=0)
    assert set(sel.tolist()) == set(range(10))


def test_a_worker_embeds_a_rounds_candidates_once_for_all_its_simulated_nodes(monkeypatch):
    """Issue 24: per-node fixed costs are paid once per worker. The candidates of a vote round
    are the same public texts for every node one worker serves; other texts are embedded anew."""
    from common import models
    from fedsyn_client import histograms

    calls = []
    monkeypatch.setattr(models, "load_embedder", lambda name: name)
    monkeypatch.setattr(models, "embed", lambda m, texts, max_tokens=None, precision="fp32": calls.append(list(texts))
                        or np.full((len(texts), 3), float(len(calls))))
    monkeypatch.setattr(histograms, "_CANDIDATES", {})
    first = histograms.candidate_embeddings(["a", "b"], "e", 64)
    assert histograms.candidate_embeddings(["a", "b"], "e", 64) is first and len(calls) == 1
    assert histograms.candidate_embeddings(["a\0b"], "e", 64)[0, 0] == 2.0  # not the same list
    assert histograms.candidate_embeddings(["a", "b"], "e", 128)[0, 0] == 3.0  # nor the same window
    assert histograms.candidate_embeddings(["a", "b"], "e", 128, "auto")[0, 0] == 4.0  # nor the same precision
    assert len(calls) == 4


def test_embedder_label_agreement_is_chance_for_a_blind_embedder_and_one_for_a_perfect_one():
    from benchmarks.embedder_label import chance_agreement, neighbour_agreement

    labels = np.array(["a"] * 30 + ["b"] * 10)
    # a perfect embedder: each label's rows are one direction (plus a little noise to break ties)
    rng = np.random.default_rng(0)
    centre = {"a": np.array([1.0, 0, 0]), "b": np.array([0, 1.0, 0])}
    emb = np.array([centre[label] + 0.01 * rng.normal(size=3) for label in labels])
    emb /= np.linalg.norm(emb, axis=1, keepdims=True)
    assert neighbour_agreement(emb, labels) == 1.0
    blind = rng.normal(size=(4000, 8))
    blind /= np.linalg.norm(blind, axis=1, keepdims=True)
    many = rng.choice(["a", "b"], size=4000, p=[0.75, 0.25])
    assert chance_agreement(many) == pytest.approx(0.75 ** 2 + 0.25 ** 2, abs=0.02)
    assert neighbour_agreement(blind, many) == pytest.approx(chance_agreement(many), abs=0.03)
