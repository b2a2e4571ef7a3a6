"""benchmarks/refinement_diagnostics.py on a hand-made run folder with a known answer."""

from __future__ import annotations

import csv
import json
import math

import pytest

from benchmarks import refinement_diagnostics as D
from common.codes import make_code
from common.io import atomic_write_jsonl
from tests.test_evaluation import TOPICS, make_texts


@pytest.fixture()
def run_dir(tmp_path):
    """A knn-vote-like run: half the pool carries a wrong topic label; votes favour the
    on-topic half perfectly, and the final set kept exactly the on-topic texts."""
    run = tmp_path / "runs" / "dp-knn-vote__partitioning=iid__seed=2"
    run.mkdir(parents=True)
    pool_df, real_df = make_texts(10, seed=0), make_texts(15, seed=1)
    pool = []
    for i, row in enumerate(pool_df.to_dict("records")):
        on_topic = i % 2 == 0
        topic = row["topic"] if on_topic else TOPICS[(TOPICS.index(row["topic"]) + 1) % len(TOPICS)]
        pool.append({"text": row["text"], "control_code": make_code({"topic": topic}, ["topic"]),
                     "votes": 10.0 + i if on_topic else float(i % 3), "selected": on_topic})
    atomic_write_jsonl(run / "pool.jsonl", pool)
    atomic_write_jsonl(run / "heldout.jsonl", [{"text": r["text"], "control_code": make_code(r, ["topic"])}
                                         for r in real_df.to_dict("records")])
    (run / "config.json").write_text(json.dumps({"control-columns": "topic", "sampling-rate": 0.5}))
    return run


def test_diagnose_run_known_answer(run_dir):
    from common.models import load_embedder

    d = D.diagnose_run(run_dir, load_embedder())
    assert (d["n_pool"], d["n_kept"]) == (40, 20)
    assert d["fidelity_pool"] == pytest.approx(0.5, abs=0.05)
    assert d["fidelity_kept"] >= 0.95 and d["fidelity_dropped"] <= 0.05
    assert d["votes_auc"] >= 0.95 and d["votes_on_topic"] > d["votes_off_topic"]
    # The kept texts all carry their true topic; equal-weight draws from the pool half do not.
    assert d["accuracy_kept"] >= 0.9 and d["accuracy_uniform_same_pool"] < d["accuracy_kept"] - 0.2
    assert all(math.isnan(d[f]) for f in D.ROUND_FIELDS)  # knn-vote writes no refinement_rounds.jsonl


def test_popri_rounds_give_the_paired_effect_and_the_pairs_fidelity(run_dir):
    """A POPri-like run: round 1 (the pre-DPO pool) is half off-topic, its noisy scores rank the
    on-topic texts first, every pair chose an on-topic text over an off-topic one, and the
    regenerated final set is all on topic."""
    from common.io import read_jsonl
    from common.models import load_embedder

    pool = read_jsonl(run_dir / "pool.jsonl")
    rounds = [{"round": 1, "text": r["text"], "control_code": r["control_code"], "score": r["votes"],
               "role": None} for r in pool]
    on, off = [i for i, r in enumerate(pool) if r["selected"]], [i for i, r in enumerate(pool) if not r["selected"]]
    for i, j in zip(on, off):
        rounds[i]["role"], rounds[j]["role"] = "chosen", "rejected"
    atomic_write_jsonl(run_dir / "refinement_rounds.jsonl", rounds + [{**r, "round": 2} for r in rounds])
    atomic_write_jsonl(run_dir / "pool.jsonl", [{**pool[i], "votes": None, "selected": True} for i in on])

    d = D.diagnose_run(run_dir, load_embedder())
    assert d["fidelity_pool"] >= 0.95 and d["fidelity_round1"] == pytest.approx(0.5, abs=0.05)
    assert d["scores_auc_round1"] >= 0.95
    assert d["fidelity_chosen"] >= 0.95 and d["fidelity_rejected"] <= 0.05
    # what no refinement would have kept from the same model is worse than the final set
    assert d["accuracy_none_same_model"] < d["accuracy_kept"] - 0.2


def test_main_writes_csv_and_table(run_dir, tmp_path, capsys):
    out = tmp_path / "diag.csv"
    assert D.main([str(run_dir.parent), "--out", str(out)]) == 0
    rows = list(csv.DictReader(out.open()))
    assert [(r["method"], r["partitioning"], r["seed"]) for r in rows] == [("dp-knn-vote", "iid", "2")]
    assert "| iid | dp-knn-vote | 1 |" in capsys.readouterr().out
    assert out.with_suffix(".png").stat().st_size > 0  # the fidelity plot
    (tmp_path / "empty").mkdir()
    assert D.main([str(tmp_path / "empty")]) == 1  # no finished run: an error, not an empty table
