"""Issue 61: a deployed node embeds its records once per snapshot, and a vote reads the matrix.

The matrix is ``max-records`` rows for one (snapshot, embedder, window, text column); a vote that
uses it must score exactly what embedding the records there and then would have given, a changed
data file must rebuild it, and a matrix written for another snapshot, embedder or window must never
be read.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pandas as pd
import pytest

from common.config import RunConfig
from common.devices import uses_bf16
from common.models import MINILM, MINILM_VADER
from common.voting import padded
from fedsyn_client import node as node_module, record_matrix
from fedsyn_client.histograms import local_embeddings, vote_histogram
from fedsyn_client.policy import policy_from_node_config

BOUND, WINDOW = 24, 16
PRECISION = RunConfig().precision  # "auto": bf16 where the CPU has it, as a default run embeds
VOCABULARY = ("topic=a", "topic=b")


def _write(path, n: int, extra: str = "") -> None:
    texts = [f"record {i}: the {'markets' if i % 3 else 'match'} this week {extra}" for i in range(n)]
    pd.DataFrame({"text": texts, "topic": [("a", "b", "c")[i % 3] for i in range(n)]}).to_csv(path, index=False)


def _node(tmp_path, **extra):
    """A deployed weak node over ``d.csv`` (opened afresh: no process cache)."""
    config = {"tier": "weak", "data-path": str(tmp_path / "d.csv"), "epsilon": 3.0, "state-dir": str(tmp_path / "s"),
              "max-records": BOUND, "control-columns": "topic", **extra}
    node_module._open.cache_clear()
    return node_module.open_node(policy_from_node_config(config), RunConfig())


@pytest.fixture
def builds(monkeypatch):
    """The number of times a matrix was built (embedded), counted."""
    done: list[int] = []
    real = record_matrix.embed_slots
    monkeypatch.setattr(node_module, "embed_slots", lambda *a, **k: done.append(1) or real(*a, **k))
    return done


def test_the_matrix_scores_what_embedding_the_records_then_would(tmp_path, builds):
    _write(tmp_path / "d.csv", 30)
    node = _node(tmp_path)
    records = node.records(VOCABULARY)
    assert 0 < len(records) < len(node.data)  # topic=c is outside the vocabulary: rows gathered, not all
    rows = node.embedded(VOCABULARY, False, MINILM, WINDOW, PRECISION)()
    direct = padded(local_embeddings(records, MINILM, WINDOW, BOUND, PRECISION), BOUND)
    assert rows.shape == (BOUND, 384) and np.abs(rows - direct).max() < 1e-6
    assert not rows[len(records):].any()  # the rows past the vocabulary's records are zero
    cfg = RunConfig(max_length=WINDOW // 2)
    texts = ["the match ended in a draw", "markets fell on monday", "a new phone"]
    codes = ["topic=a", "topic=b", "topic=a"]
    for name in ("knn-vote", "contrastive-vote", "nearest-neighbour", "similarity", "centred-similarity"):
        cached, _ = vote_histogram(name, records, texts, codes, {"num-votes": 2}, cfg, bound=BOUND,
                                   embedded=node.embedded(VOCABULARY, False, MINILM, cfg.vote_window, cfg.precision))
        fresh, _ = vote_histogram(name, records, texts, codes, {"num-votes": 2}, cfg, bound=BOUND)
        assert np.allclose(cached(), fresh(), atol=1e-9), name
    assert len(builds) == 1  # one build serves every vote of the node


def test_a_matrix_is_kept_read_back_and_rebuilt_when_the_data_file_changes(tmp_path, builds):
    _write(tmp_path / "d.csv", 30)
    first = _node(tmp_path).matrix(False, MINILM, WINDOW, PRECISION)
    files = list((tmp_path / "s").glob("emb-*.bin"))
    assert len(files) == 1 and (os.stat(files[0]).st_mode & 0o777) == 0o600
    head, _, body = files[0].read_bytes().partition(b"\n")
    assert len(body) == BOUND * 384 * 4 and json.loads(head)["rows"] == BOUND  # the bound's size, records or not
    again = _node(tmp_path).matrix(False, MINILM, WINDOW, PRECISION)  # a fresh process reads it: no build
    assert len(builds) == 1 and np.array_equal(first, again)
    _write(tmp_path / "d.csv", 31, extra="(edited)")  # a changed file: a new snapshot, a new matrix
    os.utime(tmp_path / "d.csv", ns=(1, 1))
    changed = _node(tmp_path).matrix(False, MINILM, WINDOW, PRECISION)
    assert len(builds) == 2 and not np.array_equal(first, changed)
    assert len(list((tmp_path / "s").glob("emb-*.bin"))) == 1  # replaced in place


def test_a_matrix_of_another_snapshot_embedder_or_window_is_never_used(tmp_path, builds):
    _write(tmp_path / "d.csv", 30)
    node = _node(tmp_path)
    node.matrix(False, MINILM, WINDOW, PRECISION)
    first = set((tmp_path / "s").glob("emb-*.bin"))
    node.matrix(False, MINILM, 2 * WINDOW, PRECISION)  # another window: built, not the first one's rows
    assert not first & set((tmp_path / "s").glob("emb-*.bin"))  # and it supersedes the first (issue 75)
    node.matrix(False, MINILM_VADER, WINDOW, PRECISION)  # another embedder
    node.matrix(True, MINILM, WINDOW, PRECISION)  # another text (a table's free-text column)
    assert len(builds) == 4 and len(list((tmp_path / "s").glob("emb-*.bin"))) == 3  # one per embedder and text
    # another precision: a matrix of its own where "auto" means bf16 on this hardware, the same one where not
    own = int(uses_bf16("cpu", PRECISION))
    node.matrix(False, MINILM, WINDOW, "fp32")
    assert len(builds) == 4 + own and len(list((tmp_path / "s").glob("emb-*.bin"))) == 3
    # another snapshot's matrix copied onto this one's file: its stamp differs, so it is built again
    (tmp_path / "e.csv").write_bytes((tmp_path / "d.csv").read_bytes())
    _write(tmp_path / "d.csv", 12)
    other = _node(tmp_path, **{"data-path": str(tmp_path / "e.csv")})
    other.matrix(False, MINILM, WINDOW, PRECISION)
    bf16 = uses_bf16("cpu", PRECISION)
    mine = record_matrix.matrix_path(tmp_path / "s", other.snapshot.path, MINILM, WINDOW, False, bf16)
    node = _node(tmp_path)
    target = record_matrix.matrix_path(tmp_path / "s", node.snapshot.path, MINILM, WINDOW, False, bf16)
    target.write_bytes(mine.read_bytes())
    built = len(builds)
    node.matrix(False, MINILM, WINDOW, PRECISION)
    assert len(builds) == built + 1
    # a stamp that names another embedder's weights (the same name, other files): not read
    stamp = json.loads(target.read_bytes().partition(b"\n")[0])["stamp"]
    assert record_matrix.read_matrix(target, stamp) is not None
    assert record_matrix.read_matrix(target, {**stamp, "embedder": {**stamp["embedder"], "files": "0"}}) is None
    assert record_matrix.read_matrix(target, {**stamp, "window": WINDOW + 1}) is None
    target.write_bytes(target.read_bytes()[:-4])  # damaged: not read
    assert record_matrix.read_matrix(target, stamp) is None


def test_node_check_builds_the_matrix_and_a_vote_then_embeds_no_record(tmp_path, monkeypatch, builds):
    from fedsyn_client.node import check_node

    _write(tmp_path / "d.csv", 30)
    config = {"tier": "weak", "data-path": str(tmp_path / "d.csv"), "epsilon": 3.0, "state-dir": str(tmp_path / "s"),
              "max-records": BOUND, "control-columns": "topic", "audit-dir": str(tmp_path / "audit")}
    node_module._open.cache_clear()
    ready = check_node(config)
    assert "records embedded at a window of 128 tokens (auto) for all-MiniLM-L6-v2 (24 x 384)" in ready
    assert builds == [1]
    node = _node(tmp_path)

    def no_build(*a, **k):
        raise AssertionError("a vote embedded the records after node-check")

    monkeypatch.setattr(node_module, "embed_slots", no_build)
    assert node.embedded(VOCABULARY, False, MINILM, RunConfig().vote_window, PRECISION)().shape == (BOUND, 384)


def test_a_matrix_holds_the_bound_whatever_the_records(tmp_path):
    from common.models import load_embedder

    embedder = load_embedder(MINILM)
    few = record_matrix.embed_slots(["one record"], embedder, WINDOW, 10, progress=False)
    assert few.shape == (10, 384) and few[0].any() and not few[1:].any()
    with pytest.raises(ValueError, match="above the bound"):
        record_matrix.embed_slots(["a"] * 11, embedder, WINDOW, 10, progress=False)
    keep = np.array([3, 1])
    rows = record_matrix.gathered(np.arange(40, dtype=np.float32).reshape(10, 4), keep)
    assert rows.shape == (10, 4) and rows[0].tolist() == [12, 13, 14, 15] and rows[1].tolist() == [4, 5, 6, 7]
    assert not rows[2:].any()
