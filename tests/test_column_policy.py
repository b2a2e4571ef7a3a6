"""Issue 60, finding 6: a node's ``measurable-columns`` binds every release, not only marginals.

Under ``table-method = "rows"`` a record's text writes every column of the schema: the node's
profile counts records by their code (the control columns), and DP finetuning and votes read each
record's text. A node whose policy lets only some columns be read must refuse each of these
releases when it reads a column outside the list, with the fixed refusal text, before a record is
read or anything is spent; and everything inside the list still works.
"""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import pandas as pd
import pytest
from flwr.app import ConfigRecord, Context, Message, RecordDict

from common import records as R
from common.dp import MARGINALS, PROFILE, TRAIN, VOTE
from fedsyn_client.policy import Ask, PolicyRefused, policy_from_node_config
from fedsyn_client.refusals import RULE_COLUMNS
from tests.test_table_marginals import _rows_csv  # 40 Breast Cancer rows as an institution's file

ROOT = Path(__file__).resolve().parents[1]
ROWS_PRESET = tomllib.loads((ROOT / "presets" / "table-breast-cancer.toml").read_text())  # table-method "rows"
CODES = ["diagnosis=malignant", "diagnosis=benign"]
EVERY_COLUMN = ",".join(c["name"] for c in json.loads(ROWS_PRESET["table-schema"])["columns"])
REFUSED = f"refused: policy: {RULE_COLUMNS}"


def _node(tmp_path: Path, tier: str, measurable: str) -> tuple[Context, dict, Path]:
    """A deployed-style node of a rows-method Breast Cancer run: (its Flower context, its run
    config, its ledger's path)."""
    from fedsyn_client import node as node_module

    tmp_path.mkdir(parents=True, exist_ok=True)
    path = _rows_csv(tmp_path)
    rc = {**ROWS_PRESET, "dataset": str(path), "epsilon": 8.0, "num-votes": 2}
    config = {"tier": tier, "data-path": str(path), "max-records": 50, "epsilon": 8.0,
              "state-dir": str(tmp_path / "state"), "table-schema": rc["table-schema"], "control-columns": "diagnosis",
              "accounting": "basic", "measurable-columns": measurable,
              "vote-window": 2 * int(rc["max-length"])}  # the preset's max-length 72: its operator pins 144
    node_module._policy.cache_clear()
    node_module._open.cache_clear()
    return Context(run_id=5, node_id=9, node_config=config, state=RecordDict(), run_config=rc), rc, \
        tmp_path / "state" / "ledger.json"


def _message(kind: str) -> Message:
    conf = {"codes": CODES, "delta": 1e-5, "server-round": 0 if kind == PROFILE else 1}
    content = RecordDict()
    if kind == VOTE:
        conf.update({"histogram": "knn-vote", "num-votes": 2, "epsilon-share": 1.0})
        content[R.CANDIDATES] = ConfigRecord({"texts": ["mean radius is 12.0, mean area is 400"] * 2, "codes": CODES})
    content[R.CONFIG] = ConfigRecord(conf)
    kinds = {PROFILE: R.MSG_PROFILE, VOTE: R.MSG_VOTE, TRAIN: R.MSG_TRAIN}
    return Message(content=content, message_type=kinds[kind], dst_node_id=9)


def _ask(context: Context, kind: str) -> Message:
    from fedsyn_client.client_app import app as client_app
    from tests.fakes import set_task_identity

    set_task_identity()
    return client_app(_message(kind), context)


def _spent(ledger: Path) -> float:
    from fedsyn_client.ledger import PrivacyLedger

    return PrivacyLedger(ledger).spent() if ledger.exists() else 0.0


def _authorise(context: Context, rc: dict, kind: str) -> None:
    """``release.authorise`` of a ``kind`` request at this node (what every handler runs first)."""
    from common.config import RunConfig
    from fedsyn_client.node import node_policy
    from fedsyn_client.release import authorise, run_key
    from tests.fakes import set_task_identity

    set_task_identity()
    msg, cfg = _message(kind), RunConfig.from_flower(rc)
    authorise(msg, context, node_policy(run_key(msg, context), dict(context.node_config), cfg), cfg, kind)


def test_finding6_a_rows_profile_whose_control_column_is_outside_the_list_is_refused(tmp_path):
    context, _, ledger = _node(tmp_path, "weak", "mean radius,mean area")
    reply = _ask(context, PROFILE)
    assert reply.has_error() and reply.error.code == R.ERR_POLICY and reply.error.reason == REFUSED
    assert _spent(ledger) == 0.0 and not ledger.exists()  # decided before the data or the ledger is opened


def test_finding6_a_vote_on_a_rows_table_with_a_column_outside_the_list_is_refused(tmp_path):
    # the code's column is in the list, but each record's text writes "mean texture" and the others too
    context, _, ledger = _node(tmp_path, "weak", "diagnosis,mean radius,mean area")
    reply = _ask(context, VOTE)
    assert reply.has_error() and reply.error.code == R.ERR_POLICY and reply.error.reason == REFUSED
    assert not ledger.exists()


def test_finding6_dp_sgd_on_a_rows_table_with_a_column_outside_the_list_is_refused(tmp_path):
    context, rc, ledger = _node(tmp_path, "strong", "diagnosis,mean radius,mean area")
    with pytest.raises(PolicyRefused) as refused:
        _authorise(context, rc, TRAIN)
    assert refused.value.reply == REFUSED
    # the node's log names the problem and the fix
    assert "mean texture" in str(refused.value) and "table-method 'marginals'" in str(refused.value)
    reply = _ask(context, TRAIN)  # through the handler: refused before the weights or the records are read
    assert reply.has_error() and reply.error.code == R.ERR_POLICY and reply.error.reason == REFUSED
    assert not ledger.exists()


def test_finding6_the_tier_query_refuses_a_run_whose_phases_read_a_column_outside_the_list(tmp_path):
    from common.config import RunConfig
    from fedsyn_client.node import node_policy
    from fedsyn_client.release import TIER, authorise, run_key
    from tests.fakes import set_task_identity

    context, rc, _ = _node(tmp_path, "strong", "diagnosis")
    set_task_identity()
    msg = Message(content=RecordDict({R.CONFIG: ConfigRecord({"codes": CODES, "delta": 1e-5})}),
                  message_type=R.MSG_TIER, dst_node_id=9)
    cfg = RunConfig.from_flower(rc)
    with pytest.raises(PolicyRefused, match="a train release reads columns"):
        authorise(msg, context, node_policy(run_key(msg, context), dict(context.node_config), cfg), cfg, TIER)


def test_finding6_everything_inside_the_list_still_works(tmp_path):
    context, rc, ledger = _node(tmp_path, "weak", EVERY_COLUMN)
    profile = _ask(context, PROFILE)
    assert not profile.has_error(), profile.error.reason
    vote = _ask(context, VOTE)
    assert not vote.has_error(), vote.error.reason
    assert _spent(ledger) > 0
    strong, rc, _ = _node(tmp_path / "strong", "strong", EVERY_COLUMN)
    _authorise(strong, rc, TRAIN)  # DP-SGD is authorised (its training is tests/test_training.py's)
    # and a profile needs only the code's columns
    narrow, _, _ = _node(tmp_path / "narrow", "weak", "diagnosis")
    assert not _ask(narrow, PROFILE).has_error()


# ------------------------------------------------------------------ a table with a free-text column
FREE_TEXT_SCHEMA = json.dumps({"columns": [
    {"name": "sentiment", "type": "categorical", "categories": ["negative", "positive"]},
    {"name": "words", "type": "integer", "min": 1, "max": 60},
    {"name": "review", "type": "text"}]})


def _free_text_policy(measurable: str):
    from common.rows import canonical, load_schema

    policy = policy_from_node_config({"tier": "strong", "data-path": "x.csv", "max-records": 10, "epsilon": 8.0,
                                      "table-schema": FREE_TEXT_SCHEMA, "control-columns": "sentiment",
                                      "measurable-columns": measurable})
    return policy, canonical(load_schema(FREE_TEXT_SCHEMA))


def _phase_ask(schema: str, phase: str, measured: tuple[str, ...] = ()) -> Ask:
    return Ask(text_column="text", control_columns=("sentiment",), epsilon=8.0,
               vocabulary=("sentiment=negative", "sentiment=positive"), phases=((phase, 4.0),), delta=1e-5,
               model="smollm2-135m", embedder="all-MiniLM-L6-v2", finetune="lora", table_schema=schema,
               measured=measured)


def test_finding6_the_free_text_column_is_read_only_where_the_list_names_it():
    """With a free-text column, DP finetuning and votes read that column and the code's: the list
    may name it (marginals still never count it), and without it the language model's phases are
    refused while the marginals of the listed columns are not."""
    policy, schema = _free_text_policy("sentiment,words")
    assert policy.reads(VOTE) == ("sentiment", "review") and policy.reads(TRAIN) == ("sentiment", "review")
    for phase in (TRAIN, VOTE):
        with pytest.raises(PolicyRefused, match=r"reads columns \['review'\].*free-text column"):
            policy.authorise(_phase_ask(schema, phase))
    policy.authorise(_phase_ask(schema, MARGINALS, ("sentiment", "words")))
    with_text, _ = _free_text_policy("sentiment,review")
    for phase in (TRAIN, VOTE):
        with_text.authorise(_phase_ask(schema, phase))
    with pytest.raises(PolicyRefused, match="marginals release reads columns"):
        with_text.authorise(_phase_ask(schema, MARGINALS, ("sentiment", "words")))


def test_finding6_node_check_says_which_releases_the_list_allows(tmp_path):
    from fedsyn_client.node import check_node

    path = _rows_csv(tmp_path)
    config = {"tier": "weak", "data-path": str(path), "max-records": 100, "epsilon": 8.0,
              "state-dir": str(tmp_path / "state"), "table-schema": ROWS_PRESET["table-schema"],
              "control-columns": "diagnosis", "measurable-columns": "diagnosis,mean radius"}
    line = check_node(config)
    assert "a table-method 'rows' run's profile (the code's columns): allowed" in line
    assert "its DP finetuning and votes (each record's text writes every column): refused (mean texture" in line
    line = check_node({**config, "measurable-columns": "", "state-dir": str(tmp_path / "all")})
    assert "profile (the code's columns): allowed" in line and "every column): allowed" in line


def test_finding6_a_column_outside_the_list_decides_no_records_place_in_a_release(tmp_path):
    """A row with a value outside the schema in a column the policy does not let be read (``mean area``
    out of its range) was left out of every release, the marginals of the listed columns included:
    whether a record counted followed a column no release may read. The view is read with the listed
    columns and the code's alone, and a marginal of a listed column counts the row."""
    import numpy as np

    from common.rows import load_schema
    from fedsyn_client import node as node_module
    from fedsyn_client.histograms import marginals_histogram
    from fedsyn_client.policy import policy_from_node_config

    path = _rows_csv(tmp_path)
    frame = pd.read_csv(path)
    frame.loc[0, "mean area"] = 10 ** 9  # far outside the schema's range: in no bin
    frame.to_csv(path, index=False)
    base = {"tier": "weak", "data-path": str(path), "max-records": 50, "epsilon": 8.0, "accounting": "basic",
            "table-schema": ROWS_PRESET["table-schema"], "control-columns": "diagnosis"}
    every = node_module._data(policy_from_node_config({**base, "state-dir": str(tmp_path / "a")}), None)
    listed_policy = policy_from_node_config({**base, "state-dir": str(tmp_path / "b"),
                                             "measurable-columns": "diagnosis,mean radius"})
    listed = node_module._data(listed_policy, None)
    assert len(every) == 39 and len(listed) == 40  # only the policy that reads mean area leaves the row out
    schema = node_module.readable_schema(load_schema(ROWS_PRESET["table-schema"]), listed_policy)
    assert schema.names == ("diagnosis", "mean radius")
    compute, _ = marginals_histogram(listed, [("mean radius",)], schema, ("diagnosis",), 8, bound=50)
    assert np.sum(compute()) == 40
