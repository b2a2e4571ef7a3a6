"""Tests for fedsyn_server/evaluation/ and the ``fedsyn evaluate`` command line.

Every metric is checked against a case with a known answer: identical sets, disjoint
sets, a label-shuffled synthetic set, a known allocation skew. Metric functions are
tested on small numpy arrays; ``evaluate_sets`` and the CLI on short texts whose topics
use distinct vocabularies, so MiniLM's embeddings separate them.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from common.codes import make_code, parse_code
from fedsyn_server import evaluation as E
from fedsyn_server.cli import main

ROOT = Path(__file__).resolve().parents[1]
needs_mauve = pytest.mark.skipif(not E.mauve_available(), reason="needs the optional extra fedsyn[eval]")

# Each topic draws subjects, verbs and objects from its own vocabulary.
VOCAB = {
    "sport": (["The striker", "The goalkeeper", "The football coach", "The tennis champion", "The rugby captain"],
              ["scored", "celebrated", "defended", "won", "trained for"],
              ["a late goal in the cup final", "the league title", "a penalty at the stadium",
               "the match against the rival club", "the championship trophy"]),
    "food": (["The chef", "The baker", "My grandmother", "The pastry cook", "The restaurant cook"],
             ["baked", "seasoned", "roasted", "simmered", "tasted"],
             ["a loaf of sourdough bread", "the tomato soup with basil", "garlic and onions in butter",
              "a chocolate cake for dessert", "the vegetable stew with spices"]),
    "space": (["The astronaut", "The telescope", "The space agency", "The astronomer", "The rocket"],
              ["observed", "orbited", "launched toward", "photographed", "discovered"],
              ["a distant galaxy", "the rings of Saturn", "a new exoplanet near a red dwarf star",
               "the surface of the Moon", "a comet in the solar system"]),
    "money": (["The central bank", "The investor", "The stock market", "The finance minister", "The company"],
              ["raised", "cut", "invested in", "reported", "borrowed"],
              ["interest rates on loans", "quarterly profits and dividends", "government bonds",
               "shares of the bank", "the inflation forecast"]),
}
TOPICS = sorted(VOCAB)
MOODS = {"pos": "Great news: ", "neg": "Sadly, "}


def make_texts(n_per_topic: int, seed: int, moods: bool = False) -> pd.DataFrame:
    """A frame with ``text``, ``topic`` (and ``mood``): distinct sentences per topic."""
    rng = random.Random(seed)
    rows = []
    for topic in TOPICS:
        subjects, verbs, objects = VOCAB[topic]
        for i in range(n_per_topic):
            text = f"{rng.choice(subjects)} {rng.choice(verbs)} {rng.choice(objects)}."
            row = {"text": text, "topic": topic}
            if moods:
                row["mood"] = "pos" if i % 2 else "neg"
                row["text"] = MOODS[row["mood"]] + text[0].lower() + text[1:]
            rows.append(row)
    return pd.DataFrame(rows)


def codes_of(df: pd.DataFrame, columns: list[str]) -> list[str]:
    return [make_code(r, columns) for r in df[columns].to_dict("records")]


def blobs(n_per: int, centres: np.ndarray, scale: float = 0.3, seed: int = 0) -> tuple[np.ndarray, list[str]]:
    """Gaussian clusters around ``centres``; label ``c<i>`` per cluster."""
    rng = np.random.default_rng(seed)
    x = np.concatenate([c + scale * rng.standard_normal((n_per, centres.shape[1])) for c in centres])
    labels = [f"c{i}" for i in range(len(centres)) for _ in range(n_per)]
    return x, labels


CENTRES = np.eye(4, 16) * 5.0  # four well-separated clusters in 16 dimensions


# ---------------------------------------------------------------- downstream utility


def test_utility_separable_identical_sets():
    x, y = blobs(30, CENTRES)
    u = E.downstream_utility(x, y, x, y)
    assert u["accuracy"] == 1.0 and u["macro_f1"] == 1.0
    assert (u["n_train"], u["n_test"], u["n_classes_train"], u["missing_classes"]) == (120, 120, 4, [])


def test_utility_label_shuffled_is_chance():
    x, y = blobs(50, CENTRES)
    x_test, y_test = blobs(50, CENTRES, seed=1)
    shuffled = list(np.random.default_rng(0).permutation(y))
    u = E.downstream_utility(x, shuffled, x_test, y_test)
    assert u["accuracy"] < 0.45 and u["macro_f1"] < 0.45  # chance is 0.25 with four classes
    assert E.downstream_utility(x, y, x_test, y_test)["accuracy"] == 1.0


def test_utility_single_class_and_missing_class():
    x, y = blobs(20, CENTRES)
    one = E.downstream_utility(x[:20], y[:20], x, y)  # only c0 in the synthetic set
    assert one["accuracy"] == 0.25 and one["n_classes_train"] == 1
    assert one["missing_classes"] == ["c1", "c2", "c3"]
    assert one["macro_f1"] == pytest.approx((2 * 0.25 / 1.25) / 4)  # F1(c0) = 0.4, others 0
    two = E.downstream_utility(x[:40], y[:40], x, y)  # c2, c3 never predicted: F1 = 0
    assert two["missing_classes"] == ["c2", "c3"]
    assert two["macro_f1"] <= 0.5 + 1e-9


def test_label_agreement_known_answers():
    x, y = blobs(30, CENTRES)
    x_syn, y_syn = blobs(10, CENTRES, seed=1)
    agree = E.label_agreement(x_syn, y_syn, x, y)
    assert agree.dtype == bool and agree.shape == (40,) and agree.all()  # on-topic records
    wrong = [f"c{(int(label[1:]) + 1) % 4}" for label in y_syn]  # every label moved to the next cluster
    assert not E.label_agreement(x_syn, wrong, x, y).any()
    # Half the records relabelled: exactly those disagree.
    half = [w if i % 2 else label for i, (label, w) in enumerate(zip(y_syn, wrong))]
    assert (E.label_agreement(x_syn, half, x, y) == np.array([i % 2 == 0 for i in range(40)])).all()
    with pytest.raises(ValueError, match="two classes"):
        E.label_agreement(x_syn, y_syn, x[:30], y[:30])


def test_utility_rejects_mismatched_lengths():
    x, y = blobs(5, CENTRES)
    with pytest.raises(ValueError, match="labels"):
        E.downstream_utility(x, y[:-1], x, y)


# --------------------------------------------------------------- alignment metrics


def test_frechet_known_answers():
    x, _ = blobs(100, CENTRES)
    assert E.frechet_distance(x, x) == pytest.approx(0.0, abs=1e-6)
    shift = np.full(16, 0.5)
    # Same covariance, shifted mean: the distance is exactly |shift|^2.
    assert E.frechet_distance(x, x + shift) == pytest.approx(float(shift @ shift), rel=1e-6)
    # Same mean, covariance scaled by 4: tr(S) + tr(4S) - 2 tr(2S) = tr(S).
    centred = x - x.mean(axis=0)
    expected = float(np.trace(np.cov(centred, rowvar=False)))
    assert E.frechet_distance(centred, 2 * centred) == pytest.approx(expected, rel=1e-5)
    assert E.frechet_distance(x, x + 100.0) > 1e4  # disjoint


def test_frechet_more_dimensions_than_rows():
    # 10 records in 64 dimensions: singular covariances must not give nan or a negative value.
    x = np.random.default_rng(0).standard_normal((10, 64))
    assert E.frechet_distance(x, x) == pytest.approx(0.0, abs=1e-5)
    assert np.isfinite(E.frechet_distance(x, x[::-1] + 1.0))


def test_knn_precision_recall_known_answers():
    x, _ = blobs(30, CENTRES)
    assert E.knn_precision_recall(x, x, k=5) == (1.0, 1.0)
    assert E.knn_precision_recall(x, x + 100.0, k=5) == (0.0, 0.0)
    # Synthetic covers only two of the four real clusters: every synthetic point is
    # realistic (precision 1) but half of the real data is missed (recall 0.5).
    precision, recall = E.knn_precision_recall(x, x[:60], k=5)
    assert (precision, recall) == (1.0, 0.5)
    # Duplicated records (k-NN radius 0) still count as covered.
    dup = np.repeat(x[:3], 10, axis=0)
    assert E.knn_precision_recall(dup, dup, k=5) == (1.0, 1.0)
    # k larger than a set is lowered to its size - 1.
    assert E.knn_precision_recall(x[:3], x[:3], k=50) == (1.0, 1.0)


@needs_mauve
def test_mauve_known_answers():
    x, _ = blobs(50, CENTRES)
    same = E.mauve_score(x, x, seeds=(0, 1))
    assert same["mean"] == pytest.approx(1.0, abs=1e-6) and set(same["per_seed"]) == {"0", "1"}
    far = E.mauve_score(x, x + 100.0, seeds=(0, 1))
    assert far["mean"] < 0.1
    other = E.mauve_score(x, blobs(50, CENTRES, seed=1)[0], seeds=(0,))
    assert other["mean"] > 0.5  # another sample of the same distribution


def test_mauve_missing_package_returns_none(monkeypatch):
    monkeypatch.setitem(sys.modules, "mauve", None)  # makes `import mauve` raise ImportError
    x, _ = blobs(10, CENTRES)
    assert E.mauve_score(x, x) is None


# ------------------------------------------------------------------------ allocation


def test_allocation_error_known_skew():
    syn = ["topic=a"] * 3 + ["topic=b"]
    real = ["topic=a", "topic=b", "topic=c", "topic=c"]
    r = E.allocation_error(syn, real)
    assert list(r["per_code"]) == ["topic=a", "topic=b", "topic=c"]
    a, b, c = (r["per_code"][k] for k in ["topic=a", "topic=b", "topic=c"])
    assert (a["synthetic_share"], a["real_share"], a["abs_error"]) == (0.75, 0.25, 0.5)
    assert (b["abs_error"], c["abs_error"], c["synthetic_count"], c["real_count"]) == (0.0, 0.5, 0, 2)
    assert r["total_variation"] == 0.5 and r["max_abs_error"] == 0.5
    same = E.allocation_error(real, list(reversed(real)))
    assert same["total_variation"] == 0.0 and same["max_abs_error"] == 0.0
    assert E.allocation_error(["x"], ["y"])["total_variation"] == 1.0
    with pytest.raises(ValueError):
        E.allocation_error([], real)


# ---------------------------------------------------------------------- evaluate_sets


@pytest.fixture(scope="module")
def text_sets() -> tuple[pd.DataFrame, pd.DataFrame]:
    return make_texts(25, seed=0), make_texts(20, seed=1)


def test_evaluate_sets_identical(text_sets):
    syn, _ = text_sets
    codes = codes_of(syn, ["topic"])
    r = E.evaluate_sets(syn.text.tolist(), codes, syn.text.tolist(), codes, ["topic"], mauve=E.mauve_available())
    json.dumps(r)  # JSON-able
    u = r["utility"]["topic"]
    assert u["accuracy"] >= 0.95 and u["n_classes_train"] == 4
    assert u["label_fidelity"] >= 0.95
    assert list(r["utility"]) == ["topic"]  # one column: no separate joint entry
    a = r["alignment"]
    assert a["frechet_distance"] == pytest.approx(0.0, abs=1e-4)
    assert (a["knn_precision"], a["knn_recall"]) == (1.0, 1.0)
    if E.mauve_available():
        assert a["mauve"]["mean"] == pytest.approx(1.0, abs=1e-6) and len(a["mauve"]["per_seed"]) == 3
    assert r["allocation"]["total_variation"] == 0.0
    assert r["embedder"] == "all-MiniLM-L6-v2" and r["n_synthetic"] == r["n_real"] == 100


def test_evaluate_sets_label_shuffled(text_sets):
    syn, real = text_sets
    codes, real_codes = codes_of(syn, ["topic"]), codes_of(real, ["topic"])
    shuffled = list(np.random.default_rng(0).permutation(codes))
    args = {"control_columns": ["topic"], "mauve": False}
    good = E.evaluate_sets(syn.text.tolist(), codes, real.text.tolist(), real_codes, **args)
    bad = E.evaluate_sets(syn.text.tolist(), shuffled, real.text.tolist(), real_codes, **args)
    assert good["utility"]["topic"]["accuracy"] >= 0.9
    assert bad["utility"]["topic"]["accuracy"] < 0.6
    assert good["utility"]["topic"]["label_fidelity"] >= 0.9
    assert bad["utility"]["topic"]["label_fidelity"] < 0.5  # a shuffled label is rarely the text's topic
    # Same texts: alignment and allocation cannot tell the sets apart.
    for key in ("frechet_distance", "knn_precision", "knn_recall"):
        assert bad["alignment"][key] == good["alignment"][key]
    assert bad["allocation"] == good["allocation"]
    assert bad["alignment"]["mauve"] is None and "disabled" in bad["alignment"]["notes"][0]
    # One shuffle of four tight clusters can land well above chance (a cluster whose
    # shuffled plurality happens to be its own topic); the mean over shuffles is chance.
    from common.models import embed, load_embedder

    model = load_embedder()
    syn_emb, real_emb = embed(model, syn.text.tolist()), embed(model, real.text.tolist())
    scores = [E.downstream_utility(syn_emb, list(np.random.default_rng(i).permutation(syn.topic)),
                                   real_emb, real.topic.tolist(), seed=i) for i in range(10)]
    assert np.mean([u["accuracy"] for u in scores]) < 0.4  # chance is 0.25
    assert np.mean([u["macro_f1"] for u in scores]) < 0.4


def test_evaluate_sets_two_columns_and_disjoint_topics():
    syn, real = make_texts(16, seed=0, moods=True), make_texts(16, seed=1, moods=True)
    syn = syn[syn.topic.isin(["food", "sport"])]
    real = real[real.topic.isin(["money", "space"])]
    cols = ["topic", "mood"]
    r = E.evaluate_sets(syn.text.tolist(), codes_of(syn, cols), real.text.tolist(), codes_of(real, cols), cols,
                        mauve=False)
    assert list(r["utility"]) == ["topic", "mood", "control_code"]
    assert r["utility"]["topic"]["accuracy"] == 0.0  # no real topic was ever seen
    assert r["utility"]["topic"]["missing_classes"] == ["money", "space"]
    assert r["utility"]["topic"]["label_fidelity"] == 0.0  # a real-trained model knows no food or sport
    assert r["allocation"]["total_variation"] == 1.0
    assert r["alignment"]["knn_precision"] <= 0.1 and r["alignment"]["knn_recall"] <= 0.1
    with pytest.raises(ValueError, match="no column 'colour'"):
        E.evaluate_sets(syn.text.tolist(), codes_of(syn, cols), real.text.tolist(), codes_of(real, cols), ["colour"])


def test_transformer_utility_tiny(text_sets):
    # A couple of optimiser steps on the real MiniLM folder: checks the loop end to end,
    # not the accuracy (finetuning properly is for GPU users).
    syn, real = text_sets
    syn, real = syn.iloc[::6], real.iloc[::6]
    u = E.transformer_utility(syn.text.tolist(), syn.topic.tolist(), real.text.tolist(), real.topic.tolist(),
                              max_steps=2, batch_size=8, max_length=32)
    assert u["n_train"] == len(syn) and u["n_test"] == len(real) and 0.0 <= u["accuracy"] <= 1.0
    single = E.transformer_utility(["a", "b"], ["x", "x"], ["c", "d"], ["x", "y"])
    assert single["accuracy"] == 0.5  # one class: predicted without loading a model


@pytest.mark.slow
def test_transformer_utility_learns(text_sets):
    syn, real = text_sets
    u = E.transformer_utility(syn.text.tolist(), syn.topic.tolist(), real.text.tolist(), real.topic.tolist(),
                              epochs=3, max_length=32)
    assert u["accuracy"] >= 0.8


# --------------------------------------------------------------- files and command line


def write_run_files(folder: Path) -> tuple[Path, Path]:
    """A run's layout: synthetic.jsonl (text, control_code, topic), heldout.jsonl (text, control_code)."""
    syn, real = make_texts(15, seed=0), make_texts(15, seed=1)
    syn_path, real_path = folder / "synthetic.jsonl", folder / "heldout.jsonl"
    syn_rows = [{"text": t, "control_code": c, **parse_code(c)} for t, c in zip(syn.text, codes_of(syn, ["topic"]))]
    real_rows = [{"text": t, "control_code": c} for t, c in zip(real.text, codes_of(real, ["topic"]))]
    syn_path.write_text("".join(json.dumps(r) + "\n" for r in syn_rows))
    real_path.write_text("".join(json.dumps(r) + "\n" for r in real_rows))
    return syn_path, real_path


def test_cli_evaluate_run_outputs(tmp_path, capsys):
    syn_path, real_path = write_run_files(tmp_path)
    # The run's own metrics.json sits next to it and is left alone; two evaluations of two files in
    # one folder each get their own <stem>.evaluation.json, shaped as a run's evaluation.json
    (tmp_path / "metrics.json").write_text(json.dumps({"heldout_loss": {"1": 2.5}}))
    other = tmp_path / "other.jsonl"
    other.write_text(syn_path.read_text())
    for path in (syn_path, other):
        args = ["evaluate", "--synthetic", str(path), "--real", str(real_path)]
        assert main(args if E.mauve_available() else [*args, "--no-mauve"]) == 0
    printed = capsys.readouterr().out
    assert json.loads((tmp_path / "metrics.json").read_text()) == {"heldout_loss": {"1": 2.5}}
    assert json.loads((tmp_path / "other.evaluation.json").read_text())["synthetic_path"] == str(other)
    ev = json.loads((tmp_path / "synthetic.evaluation.json").read_text())
    assert ev["synthetic_path"] == str(syn_path)
    assert ev["control_columns"] == ["topic"]  # derived from control_code
    assert ev["utility"]["topic"]["accuracy"] >= 0.9 and ev["utility"]["topic"]["warnings"] == []
    assert ev["real_path"] == str(real_path) and ev["n_real"] == 60
    assert set(ev["allocation"]["per_code"]) == {f"topic={t}" for t in TOPICS}
    for text in ("Downstream utility", "Frechet distance", "k-NN precision (k=5)", "MAUVE",
                 "topic=sport", "total variation", str(tmp_path / "synthetic.evaluation.json")):
        assert text in printed
    utility_row = next(line for line in printed.splitlines() if line.strip().startswith("topic "))
    assert f"{ev['utility']['topic']['accuracy']:.3f}" in utility_row
    if E.mauve_available():
        assert f"{ev['alignment']['mauve']['mean']:.3f} +/-" in printed


def test_cli_evaluate_csv_two_columns(tmp_path, capsys):
    syn, real = make_texts(12, seed=0, moods=True), make_texts(12, seed=1, moods=True)
    # Control columns only (no control_code), and a text column with another name.
    syn.rename(columns={"text": "body"}).to_csv(tmp_path / "syn.csv", index=False)
    real.rename(columns={"text": "body"}).to_csv(tmp_path / "real.csv", index=False)
    out = tmp_path / "eval" / "m.json"
    code = main(["evaluate", "--synthetic", str(tmp_path / "syn.csv"), "--real", str(tmp_path / "real.csv"),
                 "--text-column", "body", "--control-columns", "topic,mood", "--out", str(out), "--no-mauve",
                 "--seed", "3"])
    assert code == 0
    ev = json.loads(out.read_text())
    assert list(ev["utility"]) == ["topic", "mood", "control_code"]
    assert ev["seed"] == 3 and ev["text_column"] == "body"
    assert "topic=food|mood=neg" in ev["allocation"]["per_code"]
    assert ev["alignment"]["mauve"] is None
    printed = capsys.readouterr().out
    assert "control_code" in printed and "MAUVE skipped (disabled)" in printed


def test_evaluate_files_errors(tmp_path, capsys):
    make_texts(3, seed=0).to_csv(tmp_path / "syn.csv", index=False)
    pd.DataFrame({"text": ["x", "y"], "label": ["a", "b"]}).to_csv(tmp_path / "real.csv", index=False)
    # No control_code anywhere and no columns given: cannot guess.
    with pytest.raises(ValueError, match="pass --control-columns"):
        E.evaluate_files(tmp_path / "syn.csv", tmp_path / "real.csv")
    # A missing control column: the file, the column and the available columns are named.
    with pytest.raises(ValueError, match=r"real\.csv: no control column 'topic'.*'label'"):
        E.evaluate_files(tmp_path / "syn.csv", tmp_path / "real.csv", control_columns="topic")
    with pytest.raises(ValueError, match=r"syn\.csv: no text column 'body'"):
        E.evaluate_files(tmp_path / "syn.csv", tmp_path / "real.csv", text_column="body", control_columns="topic")
    code = main(["evaluate", "--synthetic", str(tmp_path / "syn.csv"), "--real", str(tmp_path / "real.csv"),
                 "--control-columns", "topic"])
    assert code == 2
    err = capsys.readouterr().err
    assert "fedsyn evaluate: error:" in err and "real.csv" in err and "'topic'" in err
    assert main(["evaluate", "--synthetic", str(tmp_path / "nope.jsonl"), "--real", str(tmp_path / "real.csv")]) == 2
    # An existing file that is not an evaluation (a run's metrics.json, a list) is never overwritten.
    for name, text in (("bad.json", "[1, 2]"), ("metrics.json", '{"heldout_loss": {"1": 2.5}}')):
        (tmp_path / name).write_text(text)
        with pytest.raises(ValueError, match="is not an evaluation"):
            E.write_evaluation(tmp_path / name, {"utility": {}})
        assert (tmp_path / name).read_text() == text
    assert json.loads(E.write_evaluation(tmp_path / "other.evaluation.json", {"utility": {}}).read_text()) == {
        "utility": {}}  # an earlier evaluation is replaced


def test_control_code_column_without_the_code(tmp_path):
    # A heldout-style file whose codes lack a requested column is an error naming it.
    (tmp_path / "a.jsonl").write_text(json.dumps({"text": "t", "control_code": "topic=x"}) + "\n")
    with pytest.raises(ValueError, match="no control column 'mood'.*do not contain it"):
        E.evaluate_files(tmp_path / "a.jsonl", tmp_path / "a.jsonl", control_columns=["topic", "mood"])
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(ValueError, match=r"empty\.jsonl: no records"):
        E.evaluate_files(tmp_path / "empty.jsonl", tmp_path / "a.jsonl")


def test_console_script_declared():
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["scripts"]["fedsyn"] == "fedsyn_server.cli:main"
    assert any(req.startswith("mauve-text") for req in project["optional-dependencies"]["eval"])
    with pytest.raises(SystemExit):
        main(["--help"])


def test_degenerate_evaluations_say_why_their_scores_cannot_be_trusted():
    # one value in the control column, 3 test rows: accuracy 1.0 that means nothing
    one = E.utility_warnings(["a"] * 10, ["a"] * 3)
    assert any("one class" in w for w in one) and any("fewer than 5 real test rows ('a': 3)" in w for w in one)
    # synthetic labels the real set lacks (accuracy 0 with "classes 3/3"), and the reverse
    swapped = E.utility_warnings(["x", "y", "z"] * 4, ["a", "b", "c"] * 10)
    assert any("synthetic label(s) ['x', 'y', 'z'] do not occur in the real set" in w for w in swapped)
    assert any("real label(s) ['a', 'b', 'c'] do not occur in the synthetic set" in w for w in swapped)
    assert E.utility_warnings(["a", "b"] * 5, ["a", "b"] * 10) == []


def test_the_report_prints_the_warnings(capsys):
    rng = np.random.default_rng(0)
    res = E.downstream_utility(rng.normal(size=(6, 4)), ["a", "b"] * 3, rng.normal(size=(3, 4)), ["a", "a", "a"])
    assert len(res["warnings"]) == 3  # one class, 3 test rows, "b" absent from the real set
    report = {"n_synthetic": 6, "n_real": 3, "embedder": "e", "classifier": "logreg", "utility": {"topic": res},
              "alignment": {"frechet_distance": 1.0, "knn_precision": 0.5, "knn_recall": 0.5, "knn_k": 2,
                            "mauve": None},
              "allocation": {"per_code": {}, "total_variation": 0.0, "max_abs_error": 0.0}}
    assert "WARNING (topic): the real set has one class" in E.format_report(report)
