"""Issue 60, finding 7: a vote's and a marginals reply's counting do the work of the public bound.

The votes looped over the records present (per code, the rows of that code), and the marginals
built, discretised and counted the records only, so their time followed |D| under one bound
(1.2 ms at |D| = 100 against 63.6 at 10,000 for a contrastive vote). Now both compute every one of
``bound`` rows (records, then filler) in fixed shapes and mask the filler out of the counts. The
results on the records are those of the records alone, bit for bit, and the shapes through the
kernels are the same whatever |D| and however the records spread over the codes.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from common import voting
from common.data import TextData
from common.histograms import HISTOGRAMS as HISTOGRAM_OBJECTS
from fedsyn_client import histograms


def _unit(x: np.ndarray) -> np.ndarray:
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def _inputs(seed: int, n: int, pool: int = 30, dim: int = 8):
    """Random unit embeddings: ``n`` records over codes a, b, c (c has no candidate), ``pool``
    candidates over a and b."""
    rng = np.random.default_rng(seed)
    local, codes = _unit(rng.normal(size=(n, dim))), list(rng.choice(["a", "b", "c"], size=n))
    syn, syn_codes = _unit(rng.normal(size=(pool, dim))), list(rng.choice(["a", "b"], size=pool))
    return local, codes, syn, syn_codes


HISTOGRAMS = {"knn-vote": lambda *a, **kw: voting.knn_votes(*a, 3, **kw),
              "nearest-neighbour": lambda *a, **kw: voting.knn_votes(*a, 1, **kw),
              "contrastive-vote": lambda *a, **kw: voting.contrastive_votes(*a, 3, **kw),
              "similarity": voting.similarity_scores,
              "centred-similarity": lambda *a, **kw: voting.similarity_scores(*a, centred=True, **kw)}


@pytest.mark.parametrize("name", sorted(HISTOGRAMS))
@pytest.mark.parametrize("seed, n", [(0, 0), (1, 1), (2, 17), (3, 60)])
def test_finding7_a_padded_vote_equals_the_records_alone_bit_for_bit(name, seed, n):
    fn = HISTOGRAMS[name]
    local, codes, syn, syn_codes = _inputs(seed, n)
    alone = fn(local, codes, syn, syn_codes)
    for bound in (n, n + 1, 64):
        padded = fn(local, codes, syn, syn_codes, bound=bound)
        assert padded.dtype == alone.dtype and np.array_equal(padded, alone)
        # the caller may pad the embeddings itself (``histograms.vote_histogram`` does), and the
        # registered object scores those rows as the pure function does
        rows = voting.padded(local, bound)
        assert np.array_equal(fn(rows, codes, syn, syn_codes, bound=bound), alone)
        scored = HISTOGRAM_OBJECTS[name].score(rows, codes, syn, syn_codes, {"num-votes": 3}, bound=bound)
        assert scored.dtype == alone.dtype and np.array_equal(scored, alone)


def _reference(local, codes, syn, syn_codes, k):
    """The contrastive votes one record at a time (issue 34's definition)."""
    out = np.zeros(len(syn_codes), dtype=np.int64)
    for row, code in zip(local, codes):
        sims = syn @ row
        own = [j for j, c in enumerate(syn_codes) if c == code]
        other = [j for j, c in enumerate(syn_codes) if c != code]
        for chosen, sign in ((own, 1), (other, -1)):
            for j in sorted(chosen, key=lambda j: -sims[j])[:k]:
                out[j] += sign
    return out


@pytest.mark.parametrize("k", [1, 3, 40])
def test_finding7_the_masked_contrastive_votes_are_issue_34s(k):
    local, codes, syn, syn_codes = _inputs(7, 45)
    want = _reference(local, codes, syn, syn_codes, k)
    assert voting.contrastive_votes(local, codes, syn, syn_codes, k, bound=100).tolist() == want.tolist()


def test_finding7_the_shapes_through_the_vote_are_the_bounds_whatever_the_records(monkeypatch):
    """Every block scores rows x every candidate, and every row takes its top K: the same calls
    and shapes for 0, 3 or 90 records, all of one code or spread over codes without candidates."""
    seen: list[tuple] = []
    nearest = voting._nearest

    def spy(sims, allowed, counts, k):
        seen.append((sims.shape, allowed.shape, counts.shape, k))
        return nearest(sims, allowed, counts, k)

    monkeypatch.setattr(voting, "_nearest", spy)
    monkeypatch.setattr(voting, "BLOCK_PAIRS", 64 * 30)  # blocks of 64 rows (whole tiles): the last one short
    _, _, syn, syn_codes = _inputs(0, 0)
    rng = np.random.default_rng(1)
    shapes = []
    for n, pick in ((0, ["a"]), (3, ["a"]), (150, ["a", "b", "c"]), (150, ["c"])):
        local = _unit(rng.normal(size=(n, 8))) if n else np.zeros((0, 8))
        seen.clear()
        voting.contrastive_votes(local, list(rng.choice(pick, size=n)), syn, syn_codes, 3, bound=150)
        shapes.append(list(seen))
    assert all(s == shapes[0] for s in shapes)
    assert [s[0] for s in shapes[0]] == [(64, 30)] * 4 + [(22, 30)] * 2  # own and other, for each block


@pytest.mark.parametrize("name", sorted(HISTOGRAMS))
def test_finding7_the_sensitivity_holds_with_the_filler(name):
    """Adding one record under the bound moves each histogram by at most its stated sensitivity
    (the filler scores like a record and adds nothing)."""
    from common.histograms import sensitivity

    fn = HISTOGRAMS[name]
    bound = {"knn-vote": math.sqrt(3), "nearest-neighbour": 1.0, "contrastive-vote": math.sqrt(6), "similarity": 1.0,
             "centred-similarity": 1.0}
    assert sensitivity(name, {"num-votes": 3}) == pytest.approx(bound[name])
    local, codes, syn, syn_codes = _inputs(11, 41)
    for i in range(40):  # D = the first 40 records, D' = D plus record 40 with each code in turn
        extra_code = ["a", "b", "c"][i % 3]
        base = fn(local[:40], codes[:40], syn, syn_codes, bound=41)
        plus = fn(local[:41], codes[:40] + [extra_code], syn, syn_codes, bound=41)
        assert np.linalg.norm(plus - base) <= bound[name] + 1e-12


# ------------------------------------------------------------------------------------------ marginals
SCHEMA = json.dumps({"columns": [
    {"name": "label", "type": "categorical", "categories": ["no", "yes"]},
    {"name": "colour", "type": "categorical", "categories": ["red", "green", "blue"]},
    {"name": "size", "type": "float", "min": 0, "max": 10, "decimals": 1},
    {"name": "count", "type": "integer", "min": 0, "max": 20},
    {"name": "day", "type": "date", "min": "2020-01-01", "max": "2020-12-31"}]})
CONTROL = ("label",)
CLIQUES = [("label",), ("colour",), ("size",), ("label", "colour"), ("size", "count"), ("day", "label")]


def _table(seed: int, n: int) -> TextData:
    """``n`` random rows as a node's records (``common.data.table_text_data``), one of them not a
    row of the schema when ``n`` > 2 (its file changed under the node)."""
    import pandas as pd

    from common.data import table_text_data
    from common.rows import load_schema

    rng = np.random.default_rng(seed)
    frame = pd.DataFrame({"label": rng.choice(["no", "yes"], n), "colour": rng.choice(["red", "green", "blue"], n),
                          "size": np.round(rng.uniform(0, 10, n), 1), "count": rng.integers(0, 21, n),
                          "day": [f"2020-{m:02d}-{d:02d}" for m, d in zip(rng.integers(1, 13, n),
                                                                          rng.integers(1, 29, n))]})
    data = table_text_data(frame, load_schema(SCHEMA), CONTROL, allow_empty=True)
    if n > 2:
        data = TextData(["not a row"] + list(data.texts[1:]), list(data.codes))
    return data


@pytest.mark.parametrize("seed, n", [(0, 0), (1, 1), (2, 30), (3, 200)])
def test_finding7_padded_marginals_equal_the_records_alone(seed, n):
    from common.marginals import column_sizes, joined_marginals
    from common.rows import load_schema

    schema = load_schema(SCHEMA)
    records = _table(seed, n)
    alone = joined_marginals(histograms.node_codes(records, schema, CONTROL, 4), CLIQUES, column_sizes(schema, 4))
    for bound in (n, n + 1, 256):
        histograms._CODES.clear()
        compute, _ = histograms.marginals_histogram(records, CLIQUES, schema, CONTROL, 4, bound=bound)
        got = compute()
        assert got.dtype == alone.dtype and np.array_equal(got, alone)
    if n > 2:  # the record that is not a row is counted nowhere
        assert alone[:2].sum() == n - 1


def test_finding7_marginals_discretise_and_count_the_bounds_rows(monkeypatch):
    from common import marginals
    from common.rows import load_schema

    schema = load_schema(SCHEMA)
    discretised, counted = [], []
    real_discretise, real_count = marginals.discretise, histograms.counted_marginals
    monkeypatch.setattr(marginals, "discretise", lambda frame, *a: discretised.append(len(frame)) or
                        real_discretise(frame, *a))
    monkeypatch.setattr(histograms, "counted_marginals", lambda codes, mask, *a: counted.append(
        (len(codes), mask.shape)) or real_count(codes, mask, *a))
    for n in (0, 5, 120):
        histograms._CODES.clear()
        compute, _ = histograms.marginals_histogram(_table(n, n), CLIQUES, schema, CONTROL, 4, bound=120)
        compute()
    assert discretised == [120] * 3 and counted == [(120, (120,))] * 3

