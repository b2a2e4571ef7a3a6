"""Issue 25: the table metrics (``fedsyn_server.evaluation.tables``) on hand-made cases."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from common.rows import schema_from_dict
from fedsyn_server.evaluation import tables as T

SCHEMA = schema_from_dict({"columns": [
    {"name": "sex", "type": "categorical", "categories": ["F", "M"]},
    {"name": "x", "type": "float"},
    {"name": "y", "type": "float"},
    {"name": "day", "type": "date"},
]})


def _frame(n: int, seed: int, flip: bool = False) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=n)
    sex = np.where(x > 0, "M", "F")
    return pd.DataFrame({"sex": np.where(sex == "M", "F", "M") if flip else sex, "x": x,
                         "y": (-x if flip else x) + 0.01 * rng.normal(size=n),
                         "day": pd.to_datetime("2024-01-01") + pd.to_timedelta(rng.integers(0, 30, n), unit="D")})


def test_marginals_score_one_for_the_same_rows_and_their_distance_otherwise():
    real = _frame(400, 0)
    assert T.column_fidelity(real, real.copy(), SCHEMA) == {"sex": 1.0, "x": 1.0, "y": 1.0, "day": 1.0}
    syn = real.assign(sex="F", x=real["x"] + 100)  # one category only; every x above every real x
    fid = T.column_fidelity(real, syn, SCHEMA)
    assert fid["x"] == 0.0 and fid["y"] == 1.0
    assert fid["sex"] == pytest.approx(1 - 0.5 * (abs((real.sex == "F").mean() - 1) + (real.sex == "M").mean()))


def test_dependence_sees_a_reversed_correlation_and_a_broken_joint():
    real = _frame(400, 0)
    assert all(v == pytest.approx(1.0) for v in T.pair_dependence(real, real.copy(), SCHEMA).values())
    dep = T.pair_dependence(real, _frame(400, 0, flip=True), SCHEMA)
    assert dep["x | y"] == pytest.approx(0.0, abs=1e-3)  # r = +1 real, -1 synthetic
    assert dep["sex | x"] < 0.1  # the sex each x half has is swapped


def test_efficacy_of_a_faithful_and_of_a_label_flipped_table():
    train, test = _frame(400, 1), _frame(200, 2)
    good = T.efficacy(_frame(400, 3), test, SCHEMA, "sex", real_train=train)
    assert good["synthetic"]["accuracy"] > 0.95 and good["real"]["accuracy"] > 0.95
    bad = T.efficacy(_frame(400, 3, flip=True), test, SCHEMA, "sex")
    assert bad["synthetic"]["accuracy"] < 0.1 and bad["real"] is None
    assert T.efficacy(_frame(50, 4).assign(sex="F"), test, SCHEMA, "sex")["synthetic"] is None  # one class


def test_copied_rows_are_closer_than_held_out_rows():
    train, holdout = _frame(300, 5), _frame(300, 6)
    copied = T.closest_record(train.sample(100, random_state=0), train, holdout, SCHEMA)
    assert copied["synthetic_median"] == 0.0 and copied["share_closer_than_holdout_p5"] == 1.0
    fresh = T.closest_record(_frame(300, 7), train, holdout, SCHEMA)
    assert fresh["share_closer_than_holdout_p5"] < 0.2 and fresh["synthetic_median"] > 0


def test_the_whole_evaluation_is_json_ready():
    import json

    out = T.evaluate_table(_frame(200, 8), _frame(100, 9), SCHEMA, "sex", real_train=_frame(200, 10))
    assert json.loads(json.dumps(out))["efficacy"]["target"] == "sex"
    assert 0 <= out["column_fidelity_mean"] <= 1 and 0 <= out["pair_dependence_mean"] <= 1


def test_fedsyn_evaluate_scores_two_table_files_and_counts_rows_outside_the_schema(tmp_path, capsys):
    import json

    from fedsyn_server.cli import main

    syn, real = _frame(120, 11), _frame(80, 12)
    syn.loc[0, "sex"] = "X"  # not a row of the schema: left out and counted
    syn.to_csv(tmp_path / "syn.csv", index=False)
    real.to_parquet(tmp_path / "real.parquet", index=False)
    (tmp_path / "schema.json").write_text(json.dumps(SCHEMA.to_dict()))
    assert main(["evaluate", "--synthetic", str(tmp_path / "syn.csv"), "--real", str(tmp_path / "real.parquet"),
                 "--schema", str(tmp_path / "schema.json")]) == 0
    out = json.loads((tmp_path / "syn.evaluation.json").read_text())
    assert out["rows_outside_schema"] == {"synthetic": 1, "real": 0}
    assert out["table"]["n_synthetic"] == 119 and out["table"]["efficacy"]["target"] == "sex"
    assert out["table"]["efficacy"]["synthetic"]["accuracy"] > 0.9
    assert main(["evaluate", "--synthetic", str(tmp_path / "syn.csv"), "--real", str(tmp_path / "real.parquet"),
                 "--schema", str(tmp_path / "schema.json"), "--target", "x"]) == 2
    assert "must be a categorical column" in capsys.readouterr().err
