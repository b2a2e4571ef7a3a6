"""Issue 60: one record added to a node's file changes its own record and nothing else, on every
path a node reads: a table's columns (finding 1), every file format (finding 2), a row's position
(finding 4). Each test loads the file through the node's own loader (``load_node_data``) with and
without the record and checks that the other records come out exactly as they were."""

from __future__ import annotations

import gzip
import json
import re
from collections import Counter
from pathlib import Path

import pandas as pd
import pytest

from common.data import TextData, load_node_data
from common.rows import schema_from_dict

STARS = schema_from_dict({"columns": [
    {"name": "stars", "type": "categorical", "categories": ["1", "2", "3"]},
    {"name": "label", "type": "categorical", "categories": ["bad", "good"]},
    {"name": "age", "type": "integer", "min": 0, "max": 120}]})


def _rows(n: int = 200) -> list[dict[str, object]]:
    return [{"stars": str(1 + i % 3), "label": ("bad", "good")[i % 2], "age": 20 + i % 50} for i in range(n)]


def _write(path: Path, rows: list[dict[str, object]]) -> str:
    """``rows`` written in the format ``path``'s suffix names (CSV, JSON Lines, gzipped JSON Lines, Parquet)."""
    name = path.name
    if name.endswith(".csv"):
        pd.DataFrame(rows).to_csv(path, index=False)
    elif name.endswith(".parquet"):
        pd.DataFrame(rows).to_parquet(path)
    else:
        # raw separators as JSON allows them, a lone surrogate as the escape it must be in UTF-8
        text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
        text = re.sub("[\ud800-\udfff]", lambda m: f"\\u{ord(m.group()):04x}", text)
        if name.endswith(".gz"):
            path.write_bytes(gzip.compress(text.encode("utf-8")))
        else:
            path.write_text(text, encoding="utf-8")
    return str(path)


def _records(data: TextData) -> Counter:
    return Counter(zip(data.texts, data.codes))


def _assert_one_record_apart(small: TextData, large: TextData) -> None:
    """``large`` holds every record of ``small`` unchanged, and at most one more."""
    a, b = _records(small), _records(large)
    assert not a - b, f"records of the smaller file changed: {list((a - b).items())[:3]}"
    assert sum((b - a).values()) <= 1


@pytest.mark.parametrize("suffix", [".csv", ".jsonl", ".jsonl.gz", ".parquet"])
@pytest.mark.parametrize("odd", ["", None, "2.5", 2.0, "07"])
def test_finding1_an_odd_value_in_a_categorical_column_leaves_every_other_rows_code(tmp_path, suffix, odd):
    """A categorical ``stars`` of "1"/"2"/"3": one added row with an empty, missing, numeric or
    zero-padded ``stars`` once made pandas type the whole column as float, every "2" became "2.0"
    and every row dropped out of its code. Each value is read by itself now."""
    rows = _rows()
    if suffix == ".parquet" and odd is not None and not isinstance(odd, str):
        odd = str(odd)  # a Parquet column has one type; its writer decides it, not the loader
    added = [*rows, {"stars": odd, "label": "good", "age": 33}]
    for name, content in (("without", rows), ("with", added)):
        _write(tmp_path / f"{name}{suffix}", content)
    small = load_node_data(str(tmp_path / f"without{suffix}"), "", ["stars"], STARS)
    large = load_node_data(str(tmp_path / f"with{suffix}"), "", ["stars"], STARS)
    assert len(small) == 200
    _assert_one_record_apart(small, large)


@pytest.mark.parametrize("suffix", [".jsonl", ".jsonl.gz"])
@pytest.mark.parametrize("text", ["great film\u2028truly", "one\u2029two\x85three", "great film \ud83d",
                                  10 ** 30, -(10 ** 25)])
def test_finding2_one_record_never_makes_a_json_lines_file_unreadable(tmp_path, suffix, text):
    """A record with a line or paragraph separator inside a string, a lone surrogate escape, or an
    integer beyond 64 bits: the file is read, with the other records as they were."""
    rows = [{"text": f"review {i}", "topic": "x" if i % 2 else "y"} for i in range(30)]
    added = [*rows[:10], {"text": text, "topic": "x"}, *rows[10:]]
    for name, content in (("without", rows), ("with", added)):
        _write(tmp_path / f"{name}{suffix}", content)
    small = load_node_data(str(tmp_path / f"without{suffix}"), "text", ["topic"])
    large = load_node_data(str(tmp_path / f"with{suffix}"), "text", ["topic"])
    assert len(small) == 30
    _assert_one_record_apart(small, large)
    for t in large.texts:
        t.encode("utf-8")  # every text is valid UTF-8: fingerprints, snapshots and tokenizers read it


def test_finding2_a_big_integer_in_a_table_column_is_that_rows_alone(tmp_path):
    rows = _rows(40)
    added = [*rows, {"stars": "2", "label": "good", "age": 10 ** 30}]
    for name, content in (("without", rows), ("with", added)):
        _write(tmp_path / f"{name}.jsonl.gz", content)
    small = load_node_data(str(tmp_path / "without.jsonl.gz"), "", ["stars"], STARS)
    large = load_node_data(str(tmp_path / "with.jsonl.gz"), "", ["stars"], STARS)
    assert len(small) == 40
    _assert_one_record_apart(small, large)


@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_finding4_a_row_inserted_anywhere_leaves_every_other_rows_text(tmp_path, where):
    """A table row's text (its columns in a per-record order) was drawn from the row's position in
    the file: one row inserted at the top rewrote 478 of 500 other rows' texts. It is a function of
    the row alone now, so the other rows' texts (what DP-SGD trains on, what the votes embed) stay."""
    rows = _rows(500)
    at = {"first": 0, "middle": 250, "last": 500}[where]
    added = [*rows[:at], {"stars": "3", "label": "bad", "age": 99}, *rows[at:]]
    for name, content in (("without", rows), ("with", added)):
        _write(tmp_path / f"{name}.csv", content)
    small = load_node_data(str(tmp_path / "without.csv"), "", ["stars"], STARS)
    large = load_node_data(str(tmp_path / "with.csv"), "", ["stars"], STARS)
    _assert_one_record_apart(small, large)
    assert len({t.split(" is ")[0] for t in small.texts}) > 1  # the order still varies between records


@pytest.mark.parametrize("size,bound", [(40, 100), (100, 100), (100, 99), (300, 100), (2000, 100)])
@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_finding3_one_record_added_changes_the_view_by_at_most_one_record(size, bound, where):
    """Above ``max-records`` the view was a uniform subsample of exactly the bound: with a record
    added, another left the view with probability about 1 - M/(N + 1), a substitution, while every
    release is calibrated for add/remove. Over 200 node secrets, at sizes below, at and above the
    bound and the record added anywhere: the view gains it, or loses one record, or stays; and the
    profile (counts per code) moves by at most 1 in L2, the sensitivity it states."""
    import numpy as np

    from fedsyn_client.view import bounded

    codes = ("topic=x", "topic=y")
    base = TextData([f"record {i}" for i in range(size)], [codes[i % 2] for i in range(size)])
    at = {"first": 0, "middle": size // 2, "last": size}[where]
    added = TextData([*base.texts[:at], "the added record", *base.texts[at:]],
                     [*base.codes[:at], "topic=y", *base.codes[at:]])
    changes = Counter()
    for secret in range(200):
        small, large = _records(bounded(base, bound, secret)), _records(bounded(added, bound, secret))
        assert sum(small.values()) <= bound and sum(large.values()) <= bound
        gained, lost = large - small, small - large
        assert sum(gained.values()) + sum(lost.values()) <= 1, (secret, gained, lost)
        profile = [np.array([sum(n for (_, c), n in view.items() if c == code) for code in codes])
                   for view in (small, large)]
        assert np.linalg.norm(profile[1] - profile[0]) <= 1.0
        changes["gained" if gained else "lost" if lost else "same"] += 1
    assert changes["gained"] > 0  # the added record does join some views


def test_finding3_a_view_keeps_a_share_of_a_file_set_by_its_bound():
    """What the per-record rule costs, for the operator's node-check line: M (1 - (1 - 2/M)^N) / 2N."""
    from fedsyn_client.view import bounded, view_retention

    data = TextData([f"r{i}" for i in range(500)], ["topic=x"] * 500)
    kept = [len(bounded(data, 5000, s)) / 500 for s in range(20)]
    assert abs(sum(kept) / len(kept) - view_retention(500, 5000)) < 0.02
    assert view_retention(1, 100) == pytest.approx(1.0) and 0.43 < view_retention(100, 100) < 0.44
    assert abs(view_retention(10**5, 10**4) * 10**5 - 5000) < 1  # far above the bound: half of it
    assert bounded(data, 5000, 1) == bounded(data, 5000, 1)  # one secret, one view, run after run
    assert bounded(data, 5000, 1) != bounded(data, 5000, 2)
