"""Tests for common/data.py: loading, codes, splits, simulated partitions, fingerprints."""

from __future__ import annotations

import json
import logging
from collections import Counter

import numpy as np
import pandas as pd
import pytest

from common import data as D, partitioning as P, tables as T
from common.data import TextData

BBC_TOPICS = ["business", "entertainment", "politics", "sport", "tech"]
BBC_VOCAB = [f"topic={t}" for t in BBC_TOPICS]


@pytest.fixture(scope="module")
def bbc() -> TextData:
    return D.to_text_data(T.load_table("bbc-news"), "text", ["topic"])


def _toy(n_per_code: dict[str, int]) -> TextData:
    texts, codes = [], []
    for code, n in n_per_code.items():
        texts += [f"{code} record {i}" for i in range(n)]
        codes += [code] * n
    return TextData(texts, codes)


def _two_column_frame() -> pd.DataFrame:
    return pd.DataFrame(
        {
            "body": ["first text", "second text", "third text", "fourth text"],
            "a": ["x", "x", "z", "z"],
            "b": ["y", "w", "y", "w"],
        }
    )


# ------------------------------------------------------------------------ loading


def test_bbc_news_table():
    df = T.load_table("bbc-news")
    assert len(df) == 2225
    assert list(df.columns) == ["text", "title", "topic"]
    assert sorted(df["topic"].unique()) == BBC_TOPICS
    assert df["topic"].value_counts().to_dict() == {
        "sport": 511, "business": 510, "politics": 417, "tech": 401, "entertainment": 386,
    }
    assert (df["text"].str.strip() != "").all()
    assert all(text.startswith(title + "\n") for text, title in zip(df["text"], df["title"]))
    # Whitespace is normalised: no blank lines, no runs of spaces, no decoding debris.
    assert not df["text"].str.contains("\n\n|  |\ufffd").any()
    assert df["title"].iloc[0] == "Ad sales boost Time Warner profit"  # business/001.txt


def test_rotten_tomatoes_table_is_sentiment_labelled_short_text():
    df = T.load_table("rotten-tomatoes")
    assert list(df.columns) == ["text", "sentiment"]
    assert df["sentiment"].value_counts().to_dict() == {"negative": 4265, "positive": 4265}
    assert (df["text"].str.strip() != "").all() and not df["text"].str.contains("  |\n").any()
    assert df["text"].str.len().median() < 200  # snippets, not IMDB's long reviews
    # Pang & Lee's first positive snippet: label 1 is "positive", not the other way round.
    assert df.loc[df["text"].str.startswith("the rock is destined"), "sentiment"].tolist() == ["positive"]
    data = D.to_text_data(df, "text", ["sentiment"])
    assert sorted(set(data.codes)) == ["sentiment=negative", "sentiment=positive"]


def test_rotten_tomatoes_preset_names_the_shipped_set_and_its_label():
    import tomllib
    from pathlib import Path

    from common.codes import make_prompt

    preset = tomllib.loads((Path(__file__).parents[1] / "presets" / "rotten-tomatoes.toml").read_text())
    assert preset["dataset"] == "rotten-tomatoes" and preset["control-columns"] == "sentiment"
    prompt = make_prompt("sentiment=negative", "instruction", preset["zero-shot-template"])
    assert prompt == "Please write a short movie review with sentiment: negative:\n\n"


def test_movie_review_source_is_labelled_by_who_wrote_it_not_by_the_verdict():
    import tomllib
    from pathlib import Path

    from common.codes import make_prompt

    df = T.load_table("movie-review-source")
    assert list(df.columns) == ["text", "source"]
    assert df["source"].value_counts().to_dict() == {"critic": 4265, "viewer": 4265}
    assert df["text"].str.len().between(4, 267).all() and not df["text"].str.contains("<br|  |\n").any()
    # the viewers' sentences are cased as the critics' snippets are: the case does not give the source away
    viewers = df.loc[df["source"] == "viewer", "text"]
    assert (viewers == viewers.str.lower()).all()
    # the critics are exactly Rotten Tomatoes snippets; the same fixed draw every time
    assert set(df.loc[df["source"] == "critic", "text"]) <= set(T.load_table("rotten-tomatoes")["text"])
    assert T._movie_review_source_table.__wrapped__().equals(df)
    preset = tomllib.loads((Path(__file__).parents[1] / "presets" / "movie-review-source.toml").read_text())
    assert preset["dataset"] == "movie-review-source" and preset["control-columns"] == "source"
    assert make_prompt("source=critic", "instruction", preset["zero-shot-template"]) == \
        "Please write one sentence of a movie review by a source: critic:\n\n"


def test_bbc_news_cache_returns_copies():
    df = T.load_table("bbc-news")
    df.loc[0, "text"] = "mutated"
    df["title"] = "mutated too"
    again = T.load_table()
    assert again.loc[0, "text"] != "mutated" and again.loc[0, "title"] != "mutated too"


@pytest.mark.parametrize("suffix", [".csv", ".jsonl", ".json", ".parquet"])
def test_local_file_round_trip_two_control_columns(tmp_path, suffix):
    df = _two_column_frame()
    path = tmp_path / f"data{suffix}"
    if suffix == ".csv":
        df.to_csv(path, index=False)
    elif suffix == ".jsonl":
        df.to_json(path, orient="records", lines=True)
    elif suffix == ".json":
        df.to_json(path, orient="records")  # a JSON array, not JSON Lines
    else:
        df.to_parquet(path)
    loaded = T.load_table(str(path))
    pd.testing.assert_frame_equal(loaded, df)
    data = D.load_node_data(str(path), "body", ["a", "b"])
    assert data.texts == df["body"].tolist()
    assert data.codes == ["a=x|b=y", "a=x|b=w", "a=z|b=y", "a=z|b=w"]
    vocab = D.code_vocabulary(loaded, ["a", "b"])
    assert vocab == ["a=x|b=w", "a=x|b=y", "a=z|b=w", "a=z|b=y"]
    assert data.code_counts(vocab).tolist() == [1, 1, 1, 1]


def test_jsonl_with_unicode_line_separators_round_trips(tmp_path):
    # SmolLM2 emits U+2028 inside texts; a raw one splits the record for str.splitlines.
    from common.io import atomic_write_jsonl, read_jsonl

    rows = [{"text": "one\u2028two\u2029three\x85four\nfive", "topic": "tech"}, {"text": "plain", "topic": "sport"}]
    path = atomic_write_jsonl(tmp_path / "s.jsonl", rows)
    raw = path.read_text(encoding="utf-8")
    assert len(raw.splitlines()) == 2 and "\\u2028" in raw  # escaped, so every reader sees 2 lines
    assert read_jsonl(path) == rows
    assert T.load_table(str(path))["text"].tolist() == [r["text"] for r in rows]
    old = tmp_path / "old.jsonl"  # written before the escaping: raw separators inside a record
    old.write_text(json.dumps(rows[0], ensure_ascii=False) + "\n", encoding="utf-8")
    assert "\u2028" in old.read_text(encoding="utf-8") and read_jsonl(old) == rows[:1]
    old.write_text('{"text": "cut', encoding="utf-8")
    with pytest.raises(ValueError, match="old.jsonl: line 1 is not JSON"):
        read_jsonl(old)


def test_missing_column_names_it_and_lists_available():
    with pytest.raises(ValueError, match=r"'c'.*available columns.*'body'.*'a'.*'b'"):
        D.to_text_data(_two_column_frame(), "body", ["a", "c"])
    with pytest.raises(ValueError, match="'txt'"):
        D.to_text_data(_two_column_frame(), "txt", ["a"])
    with pytest.raises(ValueError, match="cannot also be a control column"):
        D.to_text_data(_two_column_frame(), "body", ["body"])


def test_empty_texts_and_missing_codes_are_dropped_with_warning(caplog):
    df = pd.DataFrame(
        {"t": ["keep", "", None, "   ", "no code", "also keep"],
         "stars": [4.0, 5.0, 5.0, 5.0, None, 5.0]}
    )
    with caplog.at_level(logging.WARNING, logger="common.data"):
        data = D.to_text_data(df, "t", ["stars"])
    assert data.texts == ["keep", "also keep"]
    # A float column (NaN present) still gives integer-looking codes.
    assert data.codes == ["stars=4", "stars=5"]
    assert "dropped 4 of 6 rows" in caplog.text
    assert D.code_vocabulary(df, ["stars"]) == ["stars=4", "stars=5"]


def test_csv_keeps_na_like_labels(tmp_path):
    path = tmp_path / "countries.csv"
    path.write_text("text,country\nhello,NA\nworld,DE\n")
    assert D.load_node_data(str(path), "text", ["country"]).codes == [
        "country=NA", "country=DE",
    ]


def test_missing_path_and_bad_type(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.csv"):
        T.load_table(str(tmp_path / "nope.csv"))
    with pytest.raises(FileNotFoundError, match="nowhere"):
        T.load_table("./some/nowhere/file")
    bad = tmp_path / "data.txt"
    bad.write_text("x")
    with pytest.raises(ValueError, match="unsupported"):
        T.load_table(str(bad))


def test_unreadable_files_name_the_file_the_problem_and_the_fix(tmp_path):
    (tmp_path / "empty.csv").write_text("")
    (tmp_path / "latin.csv").write_bytes("text,topic\ncaf\xe9 ol\xe9,x\n".encode("latin-1"))
    (tmp_path / "broken.jsonl").write_text('{"text": "a", "topic": "x"}\n\n{"text": "secret b", "topic": \n')
    (tmp_path / "list.jsonl").write_text('{"text": "a", "topic": "x"}\n[1, 2]\n')
    cases = {"empty.csv": "empty.csv' is empty; it needs a header row",
             "latin.csv": r"latin.csv' is not UTF-8 .*iconv -f latin1",
             "broken.jsonl": r"broken.jsonl' line 3 is not valid JSON \(Expecting value at column 31\)",
             "list.jsonl": "list.jsonl' line 2 is not a JSON object"}
    for name, message in cases.items():
        with pytest.raises(T.DatasetFileError, match=message) as err:
            T.load_table(str(tmp_path / name))
        assert "secret" not in str(err.value)  # the file and line, never a record


def test_hf_id_calls_load_dataset_and_wraps_offline_errors(monkeypatch):
    import datasets

    calls = []

    def fake_load(name, config=None, split=None):
        calls.append((name, config, split))
        if name == "offline/thing":
            raise ConnectionError("Couldn't reach the Hub")
        return datasets.Dataset.from_dict({"text": ["a"], "label": [1]})

    monkeypatch.setattr(datasets, "load_dataset", fake_load)
    assert len(T.load_table("owner/name")) == 1
    T.load_table("imdb:test")
    T.load_table("glue:sst2:validation")
    assert calls == [("owner/name", None, "train"), ("imdb", None, "test"),
                     ("glue", "sst2", "validation")]
    with pytest.raises(T.DatasetLoadError, match=r"'offline/thing' could not be loaded.*bbc-news"):
        T.load_table("offline/thing")


# ------------------------------------------------------------------ codes, counts


def test_code_counts_and_unknown_code():
    data = TextData(["a", "b", "c"], ["topic=x", "topic=y", "topic=x"])
    assert data.code_counts(["topic=y", "topic=x", "topic=z"]).tolist() == [1, 2, 0]
    assert data.code_counts(["topic=x", "topic=y"]).dtype == np.int64
    with pytest.raises(ValueError, match="'topic=y'"):
        data.code_counts(["topic=x"])


def test_textdata_basics():
    data = TextData(["a", "b", "c"], ["k=1", "k=2", "k=1"])
    assert len(data) == 3
    assert data.subset([2, 0]) == TextData(["c", "a"], ["k=1", "k=1"])
    assert data.to_records()[1] == {"text": "b", "control_code": "k=2"}
    with pytest.raises(ValueError):
        TextData(["a"], [])


def test_declared_vocabulary():
    df = pd.DataFrame({"t": ["a"], "topic": ["x"]})
    assert D.code_vocabulary(df, ["topic"], declared=["z", "topic=x"]) == ["topic=z", "topic=x"]
    with pytest.raises(ValueError, match="repeats"):
        D.code_vocabulary(df, ["topic"], declared=["x", "topic=x"])
    with pytest.raises(ValueError, match="form"):
        D.code_vocabulary(df, ["topic"], declared=["other=x"])


# ----------------------------------------------------------------------- splitting


def test_train_test_split(bbc):
    train, test = P.train_test_split(bbc, 0.2, seed=3)
    assert len(test) == 445 and len(train) + len(test) == len(bbc)
    # BBC has duplicate articles, so compare multisets: together the sides are the data.
    assert Counter(zip(train.texts, train.codes)) + Counter(zip(test.texts, test.codes)) == (
        Counter(zip(bbc.texts, bbc.codes))
    )
    again = P.train_test_split(bbc, 0.2, seed=3)
    assert again == (train, test)
    assert P.train_test_split(bbc, 0.2, seed=4)[1] != test
    shares = test.code_counts(BBC_VOCAB)
    expected = bbc.code_counts(BBC_VOCAB) * 0.2
    assert np.all(np.abs(shares - expected) <= 1)


def test_train_test_split_disjoint_indices():
    data = _toy({"c=a": 30, "c=b": 10})
    train, test = P.train_test_split(data, 0.25, seed=0)
    assert set(train.texts).isdisjoint(test.texts)
    assert set(train.texts) | set(test.texts) == set(data.texts)
    assert len(test) == 10
    assert np.all(np.abs(test.code_counts(["c=a", "c=b"]) - [7.5, 2.5]) <= 1)


def test_train_test_split_falls_back_when_a_code_is_rare():
    data = _toy({"c=a": 20, "c=b": 1})
    train, test = P.train_test_split(data, 0.2, seed=0)
    assert len(train) + len(test) == 21 and len(test) == 5
    assert P.train_test_split(data, 0.0, seed=0) == (data, TextData([], []))
    with pytest.raises(ValueError, match="test_fraction"):
        P.train_test_split(data, 1.0, seed=0)


# ---------------------------------------------------------------------- partitions


def _assert_exact_cover(parts: list[TextData], data: TextData) -> None:
    texts = [t for p in parts for t in p.texts]
    assert sorted(texts) == sorted(data.texts)  # toy texts are unique: disjoint + cover
    assert all(len(p) > 0 for p in parts)


def test_partition_iid_balanced_and_mixed():
    data = _toy({"c=a": 50, "c=b": 50, "c=c": 3})
    parts = P.partition(data, 4, "iid", ["strong", "weak", "weak", "weak"], seed=1)
    _assert_exact_cover(parts, data)
    sizes = [len(p) for p in parts]
    assert max(sizes) - min(sizes) <= 1
    # Shuffled before sharding: sorted input must not give one code per node.
    assert all(len(set(p.codes)) >= 2 for p in parts)
    assert parts == P.partition(data, 4, "iid", ["strong", "weak", "weak", "weak"], seed=1)
    assert parts != P.partition(data, 4, "iid", ["strong", "weak", "weak", "weak"], seed=2)


def test_partition_dirichlet_skewed(bbc):
    tiers = ["strong", "strong", "weak", "weak", "weak"]
    parts = P.partition(bbc, 5, "dirichlet:0.1", tiers, seed=0)
    assert sum(len(p) for p in parts) == len(bbc) and all(len(p) > 0 for p in parts)
    assert Counter(c for p in parts for c in p.codes) == Counter(bbc.codes)
    top_shares = [p.code_counts(BBC_VOCAB).max() / len(p) for p in parts]
    assert max(top_shares) > 0.5
    assert parts == P.partition(bbc, 5, "dirichlet:0.1", tiers, seed=0)


def test_partition_strong_codes(bbc):
    tiers = ["strong", "weak", "strong", "weak", "weak"]
    parts = P.partition(bbc, 5, "strong-codes:sport,topic=tech", tiers, seed=0)
    assert sum(len(p) for p in parts) == len(bbc)
    assert Counter(c for p in parts for c in p.codes) == Counter(bbc.codes)
    for part, tier in zip(parts, tiers):
        assert len(part) > 0
        if tier == "strong":
            assert set(part.codes) <= {"topic=sport", "topic=tech"}
        else:
            assert set(part.codes).isdisjoint({"topic=sport", "topic=tech"})
    strong_sizes = [len(parts[0]), len(parts[2])]
    assert abs(strong_sizes[0] - strong_sizes[1]) <= 1


@pytest.mark.parametrize(
    "scheme, message",
    [
        ("random", r"unknown partitioning 'random'.*iid.*dirichlet:<alpha>.*strong-codes"),
        ("dirichlet:0", "alpha must be a number > 0"),
        ("dirichlet:-1", "alpha must be a number > 0"),
        ("dirichlet:abc", "alpha must be a number > 0"),
        ("dirichlet", "unknown partitioning"),
        ("iid:3", "unknown partitioning"),
        ("strong-codes:", "lists no codes"),
    ],
)
def test_bad_scheme_strings(scheme, message):
    with pytest.raises(ValueError, match=message):
        P.parse_partitioning(scheme)


def test_parse_partitioning_values():
    assert P.parse_partitioning("iid") == ("iid", None)
    assert P.parse_partitioning(" Dirichlet:0.5 ") == ("dirichlet", 0.5)
    assert P.parse_partitioning("strong-codes:a, b,a") == ("strong-codes", ["a", "b"])


def test_strong_codes_errors():
    data = _toy({"topic=a": 6, "topic=b": 6})
    with pytest.raises(ValueError, match=r"'zzz'.*vocabulary.*topic=a"):
        P.partition(data, 2, "strong-codes:zzz", ["strong", "weak"], seed=0)
    with pytest.raises(ValueError, match="both strong and weak"):
        P.partition(data, 2, "strong-codes:a", ["weak", "weak"], seed=0)
    # A code in the declared vocabulary but with no records: the strong node would be empty.
    with pytest.raises(ValueError, match="empty"):
        P.partition(data, 2, "strong-codes:c", ["strong", "weak"], seed=0,
                    vocabulary=["topic=a", "topic=b", "topic=c"])
    two_cols = TextData(["x", "y"], ["a=1|b=2", "a=2|b=2"])
    with pytest.raises(ValueError, match="not in the vocabulary"):
        P.partition(two_cols, 2, "strong-codes:1", ["strong", "weak"], seed=0)


def test_empty_partition_raises():
    data = _toy({"c=a": 2, "c=b": 1})
    with pytest.raises(ValueError, match="empty"):
        P.partition(data, 5, "iid", ["weak"] * 5, seed=0)
    with pytest.raises(ValueError, match="empty"):
        P.partition(data, 5, "dirichlet:1.0", ["weak"] * 5, seed=0)
    # Enough records, but alpha so small that some node always draws nothing.
    ten = _toy({"c=a": 5, "c=b": 5})
    with pytest.raises(ValueError, match="at least one record"):
        P.partition(ten, 8, "dirichlet:0.01", ["weak"] * 8, seed=0)
    with pytest.raises(ValueError, match="tiers"):
        P.partition(data, 2, "iid", ["weak"], seed=0)


# --------------------------------------------------------------------- fingerprint


def test_fingerprint():
    data = _toy({"c=a": 5, "c=b": 5})
    fp = D.dataset_fingerprint(data)
    assert len(fp) == 64 and int(fp, 16) >= 0
    assert D.dataset_fingerprint(data.subset(list(range(9, -1, -1)))) == fp
    changed = TextData(data.texts[:-1] + ["edited"], data.codes)
    assert D.dataset_fingerprint(changed) != fp
    recoded = TextData(data.texts, data.codes[:-1] + ["c=a"])
    assert D.dataset_fingerprint(recoded) != fp
    assert D.dataset_fingerprint(data.subset(range(9))) != fp


def test_records_are_json_serialisable(bbc):
    json.dumps(bbc.subset(range(3)).to_records())


def test_file_like_names_are_not_hub_ids(tmp_path, monkeypatch):
    import datasets

    def no_hub(*args, **kwargs):
        raise AssertionError("must not reach the hub")

    monkeypatch.setattr(datasets, "load_dataset", no_hub)
    with pytest.raises(FileNotFoundError, match="notes.txt"):
        T.load_table("notes.txt")
    with pytest.raises(FileNotFoundError, match="train.jsonl"):
        T.load_table("train.jsonl")


# --------------------------------------------------------------- issue 45: one record, one code
ODD_VALUES = [4.5, "4.5", "01", "", None, " 4 ", "zwölf", "4.0", 10**20, True, "NA"]


def _write_node_file(path, rows: list[dict]) -> None:
    """``rows`` as the institution's raw file: CSV fields written as given (no pandas typing on
    the way out), JSON Lines as JSON, Parquet through pandas (typed by its writer)."""
    import csv

    if path.suffix == ".csv":
        with path.open("w", newline="") as fh:
            writer = csv.writer(fh)
            writer.writerow(["text", "stars", "city"])
            for r in rows:
                writer.writerow(["" if r[k] is None else r[k] for k in ("text", "stars", "city")])
    elif path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    else:
        pd.DataFrame(rows).to_parquet(path)


@pytest.mark.parametrize("suffix", [".csv", ".jsonl", ".parquet"])
@pytest.mark.parametrize("odd", ODD_VALUES)
def test_an_added_record_never_changes_another_records_code(tmp_path, suffix, odd):
    """pandas types a column from the whole file: one ``4.5`` among 20 ``4``s used to turn every
    ``stars=4`` into ``stars=4.0`` (all 20 records out of their code at once, against noise
    calibrated for one). A record's code is now a function of its own raw value only."""
    base = [{"text": f"note {i}", "stars": 4 if i % 2 else "4", "city": "01" if i % 3 else "Zürich"} for i in range(20)]
    if suffix == ".parquet":
        base = [{**r, "stars": 4} for r in base]
        if not isinstance(odd, (int, float)) or isinstance(odd, bool) or abs(odd) > 2**62:
            pytest.skip("a Parquet column has one type, fixed by its writer")
    path = tmp_path / f"node{suffix}"
    _write_node_file(path, base)
    before = D.load_node_data(str(path), "text", ["stars", "city"])
    city = base[0]["city"] if suffix == ".parquet" else odd
    _write_node_file(path, [*base, {"text": "an added record " + "x" * 5000, "stars": odd, "city": city}])
    after = D.load_node_data(str(path), "text", ["stars", "city"])
    assert after.codes[:20] == before.codes and after.texts[:20] == before.texts
    assert set(before.codes) == {"stars=4|city=01", "stars=4|city=Zürich"}


def test_control_value_writes_each_value_alone():
    assert [D.control_value(v) for v in (4, 4.0, np.float32(4.0), np.int64(4), "4", " 4 ", 4.5, "01", True)] == \
        ["4", "4", "4", "4", "4", "4", "4.5", "01", "true"]
    assert [D.control_value(v) for v in (None, float("nan"), pd.NA, "", "  ")] == [None] * 5
    assert D.control_value(float("inf")) == "inf" and D.control_value(1e20) == "100000000000000000000"
