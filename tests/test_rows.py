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
    ([{"name": "x", "type": "text"}], "free text alone"),
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


# ----------------------------------------------------------------- a table's rows as records
def _frame():
    import pandas as pd

    return pd.DataFrame([
        {"age": 54, "age group": "old", "sex": "F", "income": 31250.0, "admitted": "2023-05-17"},
        {"age": 23, "age group": "young", "sex": "M", "income": 12.5, "admitted": "2021-01-02"},
        {"age": 40, "age group": "old", "sex": "X", "income": 1.0, "admitted": "2021-01-02"},  # not in the schema
        {"age": 140, "age group": "old", "sex": "M", "income": 1.0, "admitted": "2021-01-02"},  # out of range
        {"age": 33, "age group": None, "sex": "M", "income": 1.0, "admitted": "2021-01-02"},  # missing
    ])


def test_table_records_carry_the_code_and_write_the_other_columns_in_a_per_record_order(schema):
    from common.data import schema_vocabulary, table_text_data

    data = table_text_data(_frame(), schema, ["sex"], seed=3)
    assert data.codes == ["sex=F", "sex=M"]  # the rows outside the schema are left out, on the node
    generated = R.Schema(tuple(c for c in schema.columns if c.name != "sex"))
    assert [R.parse(t, generated) for t in data.texts] == [
        {"age": 54, "age group": "old", "income": 31250.0, "admitted": dt.date(2023, 5, 17)},
        {"age": 23, "age group": "young", "income": 12.5, "admitted": dt.date(2021, 1, 2)}]
    assert "sex is" not in " ".join(data.texts)  # the code carries it
    assert table_text_data(_frame(), schema, ["sex"], seed=3) == data  # the same file, the same texts
    orders = {t.split(" is ")[0] for seed in range(12) for t in table_text_data(_frame(), schema, ["sex"], seed).texts}
    assert len(orders) > 1
    assert schema_vocabulary(schema, ["age group", "sex"]) == [
        "age group=young|sex=F", "age group=young|sex=M", "age group=old|sex=F", "age group=old|sex=M"]


def test_the_vocabulary_and_the_view_come_from_the_schema_never_from_the_records(schema):
    """A category only one node's records have (``X``) changes neither the vocabulary nor what
    the node can release: its rows are left out, as rows of a code outside the vocabulary are."""
    from common.data import schema_vocabulary, table_text_data

    with_x = table_text_data(_frame(), schema, ["sex"])
    without_x = table_text_data(_frame().drop(index=2), schema, ["sex"])
    assert with_x == without_x and schema_vocabulary(schema, ["sex"]) == ["sex=F", "sex=M"]


def test_a_node_serves_only_its_own_schema(schema, tmp_path):
    """The run's schema is an ask: a deployed node compares it with the schema in its node config
    and refuses any other (another column, another category, another range) before reading data."""
    from fedsyn_client.policy import Ask, PolicyRefused, policy_from_node_config

    path = tmp_path / "schema.json"
    path.write_text(json.dumps(SCHEMA))
    policy = policy_from_node_config({"tier": "weak", "data-path": "x.csv", "max-records": 100, "epsilon": 8,
                                      "control-columns": "sex",
                                      "table-schema": str(path)})
    ask = dict(text_column="text", control_columns=("sex",), epsilon=8.0, vocabulary=("sex=F", "sex=M"),
               phases=(("profile", 2.0),))
    policy.authorise(Ask(**ask, table_schema=R.canonical(schema)))
    wider = json.loads(json.dumps(SCHEMA))
    wider["columns"][0]["max"] = 120  # a wider range: a record the node left out would now be read
    other = [wider, {"columns": SCHEMA["columns"] + [{"name": "zip", "type": "integer"}]}, None]
    for asked in other:
        with pytest.raises(PolicyRefused) as err:
            policy.authorise(Ask(**ask, table_schema=R.canonical(R.schema_from_dict(asked)) if asked else ""))
        assert err.value.reply == "refused: policy: columns not allowed"


def test_the_run_config_carries_a_schema_inline_only(schema, tmp_path):
    """A deployed node reads the run config: it must never open a path the server chose."""
    from common.config import ConfigError, RunConfig
    from fedsyn_server.flwr_args import relative_paths

    inline = json.dumps(SCHEMA)
    assert RunConfig.from_flower({"table-schema": inline, "control-columns": "sex"}).schema() == schema
    (tmp_path / "s.json").write_text(inline)
    with pytest.raises(ConfigError, match="inline JSON"):
        RunConfig.from_flower({"table-schema": str(tmp_path / "s.json"), "control-columns": "sex"})
    fixed = relative_paths({"table-schema": "s.json"}, tmp_path)  # what fedsyn run sends instead
    assert RunConfig.from_flower({**fixed, "control-columns": "sex"}).schema() == schema
    with pytest.raises(ConfigError, match="categorical columns of table-schema"):
        RunConfig.from_flower({"table-schema": inline, "control-columns": "income"})


# ----------------------------------------------------------------- the server: rows in, typed table out
def test_a_table_runs_generation_writes_the_names_and_asks_the_model_for_values_only(monkeypatch, schema):
    """The server writes each column's name in a per-record order; the model continues with the
    value under the column's grammar, cut at the first comma or line break. A value that is not
    whole is drawn again alone; one that stays bad makes the row unusable: asked again, then
    dropped and counted."""
    from common.config import RunConfig
    from fedsyn_server.synthesis import REGENERATE, VALUE_RETRIES, ServerModel, ValueRule

    server = ServerModel(RunConfig(model="tiny-gpt2", table_schema=json.dumps(SCHEMA), table_method="rows",
                                   control_columns=("sex",)))
    good = {"age": " 40\nand more", "age group": " old, then", "income": " 12.5", "admitted": " 2022-02-02 "}
    calls = []

    def samples(prompts, max_new_tokens, seed, rules=None):
        calls.append(len(prompts))
        assert len(rules) == len(prompts) and all(isinstance(r, ValueRule) for r in rules)
        out = []
        for p, rule in zip(prompts, rules):
            name = p.rsplit(", ", 1)[-1].split("\n")[-1].removesuffix(" is")
            assert rule.column.name == name  # each prompt is constrained by its own column
            if name == "age group" and "sex: M" in p:
                out.append((" ancient", False))  # never a category of the schema: the row is lost
            elif name == "income" and len(calls) % 2:
                out.append((" 12.", False))  # cut at the token limit: the next draw of this value fixes it
            else:
                out.append((good[name], False))
        return out

    monkeypatch.setattr(server, "_samples", samples)
    texts, codes = server.generate({"sex=F": 2, "sex=M": 1}, seed=0)
    generated = R.generated_part(schema, ["sex"])
    row = {"age": 40, "age group": "old", "income": 12.5, "admitted": dt.date(2022, 2, 2)}
    assert [R.parse(t, generated) for t in texts] == [row] * 2 and codes == ["sex=F", "sex=F"]
    report = server.generation_report()
    # the M row and M's spare (a spare per code, issue 61) in the first attempt, then the row alone
    assert report["dropped"] == 1 and report["rejected"] == {"row: unknown category": 2 + REGENERATE}
    assert max(calls) == 3 + 2 and VALUE_RETRIES >= 1 and report["spares"] == {"written": 2, "used": 0}


def test_a_rows_variation_keeps_its_first_half_of_columns_and_draws_the_rest(schema):
    """Tab-PE's variation on a row: the first half of its columns in its written order stay as
    they are; the others are drawn again, and the child is still a row of the schema."""
    from common.config import RunConfig
    from fedsyn_server.synthesis import ServerModel

    server = ServerModel(RunConfig(model="tiny-gpt2", table_schema=json.dumps(SCHEMA), table_method="rows",
                                   control_columns=("sex",)))
    generated = R.generated_part(schema, ["sex"])
    parent = "income is 12.5, age is 40, admitted is 2022-02-02, age group is old"
    children = server.variation([parent] * 4, ["sex=F"] * 4, seed=1)
    for child in children:
        assert child.startswith("income is 12.5, age is 40, ")
        assert R.parse(child, generated)["income"] == 12.5
    assert server.variation(["not a row"], ["sex=F"], seed=1)[0].count(" is ") == len(generated.columns)


def test_the_final_set_is_written_as_a_typed_table(schema, tmp_path):
    import pandas as pd

    from fedsyn_server.outputs import write_table

    text = "income is 12.5, age is 40, admitted is 2022-02-02, age group is old"
    paths = write_table(tmp_path, schema, [(text, "sex=F"), (text.replace("40", "41"), "sex=M"),
                                           ("not a row", "sex=M")])  # never written
    table = pd.read_parquet(paths["table_parquet"])
    assert list(table.columns) == list(schema.names) and len(table) == 2
    assert table["age"].tolist() == [40, 41] and table["sex"].tolist() == ["F", "M"]
    assert table["admitted"].tolist() == [dt.date(2022, 2, 2)] * 2 and table["income"].dtype == float
    assert pd.read_csv(paths["table_csv"])["age group"].tolist() == ["old", "old"]


def test_the_breast_cancer_preset_is_a_table_run_of_public_schema_and_shipped_data():
    import tomllib

    from common.config import RunConfig
    from common.federation import benchmark
    from fedsyn_server.flwr_runner import APP_DIR

    cfg = RunConfig.from_flower(tomllib.loads((APP_DIR / "presets" / "table-breast-cancer.toml").read_text()))
    bench = benchmark(cfg)
    assert bench.vocabulary == ["diagnosis=malignant", "diagnosis=benign"]  # the schema's order, not counted
    assert len(bench.train) + len(bench.test) == 569  # every row is inside the schema's ranges
    generated = R.generated_part(cfg.schema(), cfg.control_columns)
    assert all(set(R.parse(t, generated)) == set(generated.names) for t in bench.train.texts)


# ----------------------------------------------------------------- constrained decoding: the values' grammar
def _language(column: R.Column, alphabet: str, length: int) -> tuple[set[str], set[str]]:
    """Brute force: every text up to ``length`` characters that is a written value of ``column``
    (the number forms -?(0|[1-9]d*)(.d{1,decimals})? inside the range, never a negative zero),
    and all their prefixes."""
    import itertools
    import re

    decimals = column.decimals if column.type == "float" else 0
    form = re.compile(r"-?(0|[1-9]\d*)" + (rf"(\.\d{{1,{decimals}}})?" if decimals else ""))
    whole = set()
    for n in range(1, length + 1):
        for chars in itertools.product(alphabet, repeat=n):
            text = "".join(chars)
            if (form.fullmatch(text) and column.min <= float(text) <= column.max
                    and not (text[0] == "-" and float(text) == 0)):
                whole.add(text)
    return whole, {t[:k] for t in whole for k in range(len(t) + 1)}


@pytest.mark.parametrize("column", [R.Column("n", "integer", (), -12, 130),
                                    R.Column("x", "float", (), 0, 2.5, 1),
                                    R.Column("y", "float", (), -1.5, 0.25, 2)])
def test_the_grammar_accepts_exactly_the_starts_of_in_range_values(column):
    """``could_start`` is exact: every text over the number alphabet up to 5 characters is
    accepted if and only if it begins a written, in-range value; ``complete`` iff it is one."""
    import itertools

    alphabet = "0123456789.-"
    whole, starts = _language(column, alphabet, 5)
    for n in range(0, 5):
        for chars in itertools.product(alphabet, repeat=n):
            text = "".join(chars)
            assert column.could_start(text) == (text in starts), text
            assert column.complete(text) == (text in whole), text


def test_the_grammar_of_dates_and_categories():
    day = R.Column("d", "date", (), "2020-02-10", "2021-06-30")
    assert all(day.could_start(t) for t in ["", "2", "2020", "2020-", "2020-1", "2021-06-3", "2020-02-29"])
    assert not any(day.could_start(t) for t in ["2019", "2022", "2021-07", "2020-13", "2020-00", "2020-02-0",
                                                "2021-06-31", "20-", "2020-1-1"])
    assert day.complete("2020-02-29") and not day.complete("2021-02-29") and not day.complete("2020-02")
    cat = R.Column("c", "categorical", ("no", "not known"))
    assert cat.could_start("no") and cat.could_start("not k") and not cat.could_start("nope")
    assert cat.complete("no") and not cat.complete("not") and cat.characters() == frozenset("notkw ")
    assert [c.widest() for c in R.schema_from_dict(SCHEMA).columns] == [2, 5, 1, 9, 10]


def test_grammar_constraint_masks_to_the_rule_and_ends_with_the_models_end_mass():
    """One decoding step: only tokens that keep the text a start of a value keep their scores;
    once the value is whole, eos carries the log-sum of the end tokens (eos, ',' and line
    breaks); a row past eos stays ended."""
    import torch

    from common.models import load_generator
    from fedsyn_server.generation import GrammarConstraint, end_tokens, generate_samples
    from fedsyn_server.synthesis import ValueRule

    model, tok = load_generator("tiny-gpt2", seed=0)
    column = R.Column("n", "integer", (), 0, 120)
    prompt = tok("n is", return_tensors="pt")["input_ids"]
    so_far = tok(" 12", return_tensors="pt")["input_ids"]
    ids = torch.cat([torch.cat([prompt, so_far], 1), torch.cat([prompt, so_far], 1)])
    ids[1, -1] = tok.eos_token_id
    scores = torch.randn(2, len(tok))
    out = GrammarConstraint(tok, [ValueRule(column)] * 2, prompt.shape[1])(ids, scores)
    kept = {i for i in torch.nonzero(torch.isfinite(out[0])).flatten().tolist() if i != tok.eos_token_id}
    assert kept and all(column.could_start("12" + tok.decode([i])) for i in kept)
    assert tok.convert_tokens_to_ids("0") in kept and tok.convert_tokens_to_ids("5") not in kept  # 120 ok, 125 not
    assert torch.equal(out[0, list(kept)], scores[0, list(kept)])
    ends = list(end_tokens(tok))
    assert tok.convert_tokens_to_ids(",") in ends
    assert torch.isclose(out[0, tok.eos_token_id], torch.logsumexp(scores[0, ends], 0))
    assert torch.isfinite(out[1]).sum() == 1 and out[1, tok.eos_token_id] == 0

    # and in a whole generation, every continuation is a value (the model is random)
    prompts = ["n is" for _ in range(24)]
    texts = generate_samples(model, tok, prompts, max_new_tokens=8, seed=3, rules=[ValueRule(column)] * 24)
    assert all(column.complete(t) for t, _ in texts), texts
