"""Issue 25: a table's rows as text and back (``common.rows``), as pure functions."""

from __future__ import annotations

import datetime as dt
import json

import numpy as np
import pytest

from common import rows as R

SCHEMA = {"columns": [
    {"name": "age", "type": "integer", "min": 18, "max": 99},
    {"name": "age group", "type": "categorical", "categories": ["young", "old"]},
    {"name": "sex", "type": "categorical", "categories": ["F", "M"]},
    {"name": "income", "type": "float", "min": 0, "max": 1e6, "decimals": 1},
    {"name": "admitted", "type": "date", "min": "2020-01-01", "max": "2024-12-31"},
]}
ROW = {"age": 54, "age group": "old", "sex": "F", "income": 31250.0, "admitted": dt.date(2023, 5, 17)}


@pytest.fixture
def schema() -> R.Schema:
    return R.schema_from_dict(SCHEMA)


def test_every_type_round_trips_in_every_drawn_order(schema):
    rng = np.random.default_rng(0)
    texts = [R.serialise(ROW, schema, rng) for _ in range(40)]
    assert all(R.parse(t, schema) == ROW for t in texts)
    firsts = {t.split(" is ")[0] for t in texts}
    assert firsts == set(schema.names)  # the order is permuted per record: every column comes first sometimes
    assert "income is 31250.0" in texts[0] and "admitted is 2023-05-17" in texts[0]
    assert list(R.parse(texts[0], schema)) == list(schema.names)  # parsed rows keep the schema's order


def test_a_longer_name_is_not_read_as_a_shorter_one_and_a_final_full_stop_is_allowed(schema):
    text = "age group is young, age is 30, sex is M, income is 0.5, admitted is 2020-01-01."
    assert R.parse(text, schema) == {"age": 30, "age group": "young", "sex": "M", "income": 0.5,
                                     "admitted": dt.date(2020, 1, 1)}


@pytest.mark.parametrize("text, reason", [
    ("", R.NO_COLUMN),
    ("The patient was admitted.", R.NO_COLUMN),
    ("Note: age is 30, age group is young, sex is M, income is 1.0, admitted is 2021-02-03", R.NO_COLUMN),
    ("age is 30, age group is young, sex is M, income is 1.0", R.MISSING),
    ("age is 30, age is 31, age group is young, sex is M, income is 1.0, admitted is 2021-02-03", R.REPEATED),
    ("age is 30, age group is middle, sex is M, income is 1.0, admitted is 2021-02-03", R.UNKNOWN_CATEGORY),
    ("age is thirty, age group is young, sex is M, income is 1.0, admitted is 2021-02-03", R.NOT_A_NUMBER),
    ("age is 30.5, age group is young, sex is M, income is 1.0, admitted is 2021-02-03", R.NOT_A_NUMBER),
    ("age is 30, age group is young, sex is M, income is nan, admitted is 2021-02-03", R.NOT_A_NUMBER),
    ("age is 130, age group is young, sex is M, income is 1.0, admitted is 2021-02-03", R.OUT_OF_RANGE),
    ("age is 30, age group is young, sex is M, income is 1.0, admitted is 2019-12-31", R.OUT_OF_RANGE),
    ("age is 30, age group is young, sex is M, income is 1.0, admitted is 2021-02-30", R.NOT_A_DATE),
    ("age is 30, age group is young, sex is M, income is 1.0, admitted is 2021-02-03 and more text",
     R.NOT_A_DATE),
])
def test_malformed_generations_are_refused_with_a_fixed_reason(schema, text, reason):
    with pytest.raises(R.RowError) as err:
        R.parse(text, schema)
    assert err.value.reason == reason


def test_parse_many_keeps_the_rows_and_counts_the_rest_by_reason(schema):
    good = R.serialise(ROW, schema, np.random.default_rng(1))
    rows, failed = R.parse_many([good, "nothing", good.replace("sex is F", "sex is X"), good], schema)
    assert rows == [ROW, ROW] and failed == {R.NO_COLUMN: 1, R.UNKNOWN_CATEGORY: 1}


def test_a_value_outside_the_schema_is_not_written(schema):
    for bad in ({**ROW, "sex": "X"}, {**ROW, "age": 12}, {**ROW, "income": float("inf")},
                {**ROW, "admitted": "2030-01-01"}):
        with pytest.raises(R.RowError):
            R.serialise(bad, schema, np.random.default_rng(0))


@pytest.mark.parametrize("columns, says", [
    ([], "at least one column"),
    ([{"type": "integer"}], "non-empty string 'name'"),
    ([{"name": "a, b", "type": "integer"}], "may not contain ','"),
    ([{"name": "this is it", "type": "integer"}], "the word 'is'"),
    ([{"name": "x", "type": "text"}], "allowed: categorical, integer, float, date"),
    ([{"name": "x", "type": "categorical"}], "categories' listed"),
    ([{"name": "x", "type": "categorical", "categories": ["a", "a"]}], "categories' listed"),
    ([{"name": "x", "type": "categorical", "categories": ["a, b"]}], "may not be empty, contain ', '"),
    ([{"name": "x", "type": "integer", "categories": ["1"]}], "only a categorical column"),
    ([{"name": "x", "type": "integer", "min": 5, "max": 1}], "min 5.0 > max 1.0"),
    ([{"name": "x", "type": "date", "min": "yesterday"}], "ISO dates"),
    ([{"name": "x", "type": "float", "decimals": 12}], "'decimals'"),
    ([{"name": "x", "type": "integer"}, {"name": "x", "type": "float"}], "repeat"),
    ([{"name": "x", "type": "integer", "mean": 3}], "unknown keys"),
])
def test_an_unusable_schema_names_the_problem_and_the_fix(columns, says):
    with pytest.raises(R.SchemaError) as err:
        R.schema_from_dict({"columns": columns})
    assert says in str(err.value)


def test_the_schema_comes_from_inline_json_or_a_file_and_round_trips(schema, tmp_path):
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(schema.to_dict()))
    assert R.load_schema(str(path)) == schema == R.load_schema(json.dumps(SCHEMA))
    with pytest.raises(R.SchemaError, match="cannot read the file"):
        R.load_schema(str(tmp_path / "missing.json"))
    with pytest.raises(R.SchemaError, match="not valid JSON"):
        R.load_schema("{columns: x}")
