"""ClientApp handlers: each refusal and bad request is an error reply, not a crash or a leak."""

from __future__ import annotations

import re

import pandas as pd
import pytest
from flwr.app import ArrayRecord, ConfigRecord, Message, RecordDict

from common import records as R
from common.config import RunConfig
from common.records import ERR_BUDGET, ERR_CONFIG, ERR_POLICY
from fedsyn_client.client_app import app
from tests.fakes import client_node, set_task_identity


@pytest.fixture(scope="module")
def csv_path(tmp_path_factory) -> str:
    rows = [{"text": f"record {i} about {t}", "topic": t} for t in ("x", "y") for i in range(10)]
    path = tmp_path_factory.mktemp("c") / "d.csv"
    pd.DataFrame(rows).to_csv(path, index=False)
    return str(path)


def _node(csv_path, tmp_path, tier="weak", **cfg):
    rc = RunConfig(model="tiny-gpt2", dataset=csv_path, test_fraction=0.0, **cfg).to_flower()
    nc = {"tier": tier, "data-path": csv_path, "max-records": 100, "state-dir": str(tmp_path), "epsilon": 8.0,
          "accounting": "basic"}  # the arithmetic below: a release costs exactly its epsilon
    return client_node(app, 5, nc, rc)


def _send(node, message_type, content) -> Message:
    set_task_identity()
    return node(Message(content=content, message_type=message_type, dst_node_id=5))


def _profile_request(codes):
    return RecordDict({R.CONFIG: ConfigRecord({"codes": codes, "delta": 1e-5})})


def _tier(node, phases=None) -> dict:
    conf = {"codes": ["topic=x", "topic=y"], **({"phases": phases} if phases is not None else {})}
    reply = _send(node, R.MSG_TIER, RecordDict({R.CONFIG: ConfigRecord(conf)}))
    assert not reply.has_error(), reply.error
    out = dict(reply.content.config_records[R.TIER])
    assert len(out.pop("ledger-ref")) == 32  # the ledger's random name, the same in every run
    return out


def test_tier_reply_states_tier_budget_and_the_ledger_preflight_only(csv_path, tmp_path):
    node = _node(csv_path, tmp_path)
    assert _tier(node) == {"tier": "weak", "epsilon-budget": 8.0, "epsilon-needed": 8.0,
                           "epsilon-remaining": 8.0, "epsilon-shortfall": 0.0, "epsilon-held": 0.0,
                           "records-bound": 100.0,  # the policy's public max-records, never the count
                           "min-honest-nodes": 1.0}  # its trust (issue 73): public, its own choice
    assert _tier(node, ["profile"])["epsilon-needed"] == 2.0  # a run that sends no votes needs less
    assert _tier(node, ["train", "profile"])["epsilon-needed"] == 2.0  # a weak node does not train
    # this run's profile is paid for: the run can still be finished
    assert not _send(node, R.MSG_PROFILE, _profile_request(["topic=x", "topic=y"])).has_error()
    assert _tier(node) == {"tier": "weak", "epsilon-budget": 8.0, "epsilon-needed": 8.0,
                           "epsilon-remaining": 6.0, "epsilon-shortfall": 0.0, "epsilon-held": 0.0,
                           "records-bound": 100.0, "min-honest-nodes": 1.0}
    # a run started beside it needs 8 and finds the 6 held for this one: refused before it spends
    rc = RunConfig(model="tiny-gpt2", dataset=csv_path, test_fraction=0.0).to_flower()
    later = client_node(app, 5, {"tier": "weak", "data-path": csv_path, "max-records": 100, "state-dir": str(tmp_path),
                                 "epsilon": 8.0},
                        rc, run_id=8)
    beside = _tier(later)
    assert beside["epsilon-shortfall"] == pytest.approx(8.0) and beside["epsilon-held"] == pytest.approx(6.0)
    # once the first run has ended (its ledger query), the next one finds 6
    assert not _send(node, R.MSG_LEDGER, _profile_request(["topic=x", "topic=y"])).has_error()
    assert _tier(later)["epsilon-shortfall"] == pytest.approx(2.0)


def test_the_preflight_statement_does_not_depend_on_the_records(tmp_path):
    answers = []
    for n in (3, 30):
        path = tmp_path / f"d{n}.csv"
        pd.DataFrame([{"text": f"r {i}", "topic": "x" if i % 3 else "y"} for i in range(n)]).to_csv(path, index=False)
        answers.append(_tier(_node(str(path), tmp_path / f"s{n}")))
    assert answers[0] == answers[1]


def test_profile_is_released_once_per_run_a_repeat_is_replayed_free_and_more_is_refused(csv_path, tmp_path):
    from fedsyn_client.ledger import PrivacyLedger

    node = _node(csv_path, tmp_path)
    first = _send(node, R.MSG_PROFILE, _profile_request(["topic=x", "topic=y"]))
    assert not first.has_error()
    rel = first.content.config_records[R.RELEASE]
    assert rel["phase"] == "profile" and rel["sensitivity"] == 1.0 and rel["epsilon"] == 2.0
    spent = PrivacyLedger.open(tmp_path, 8.0).spent()
    # the same request again (a lost reply, a resumed run): the same bytes, nothing spent
    again = _send(node, R.MSG_PROFILE, _profile_request(["topic=x", "topic=y"]))
    assert not again.has_error()
    assert (list(again.content.metric_records[R.PROFILE][R.PROFILE])
            == list(first.content.metric_records[R.PROFILE][R.PROFILE]))
    assert dict(again.content.config_records[R.RELEASE]) == dict(rel)
    assert PrivacyLedger.open(tmp_path, 8.0).spent() == spent == 2.0
    # another request under the same run, phase and round: refused, not a second release
    other = _profile_request(["topic=x", "topic=y"])
    other.config_records[R.CONFIG]["delta"] = 5e-6
    differs = _send(node, R.MSG_PROFILE, other)
    assert differs.error.code == ERR_BUDGET
    assert differs.error.reason == "refused: budget: released before for another request"
    # a second profile in the same run (another round): beyond the run's profile budget
    more = _profile_request(["topic=x", "topic=y"])
    more.config_records[R.CONFIG]["server-round"] = 1
    refused = _send(node, R.MSG_PROFILE, more)
    assert refused.error.code == ERR_BUDGET and refused.error.reason == "refused: budget: phase"
    assert PrivacyLedger.open(tmp_path, 8.0).spent() == 2.0


def test_train_on_a_weak_node_is_refused_by_its_policy(csv_path, tmp_path):
    node = _node(csv_path, tmp_path)
    reply = _send(node, R.MSG_TRAIN, RecordDict({R.ARRAYS: ArrayRecord(), R.CONFIG: ConfigRecord(
        {"server-round": 1, "delta": 1e-5, "codes": ["topic=x", "topic=y"]})}))
    assert reply.has_error() and reply.error.code == ERR_POLICY
    assert reply.error.reason == "refused: policy: phase not for this node"


def test_bad_vote_requests_are_refused_before_any_budget_is_spent(csv_path, tmp_path):
    node = _node(csv_path, tmp_path)
    vocab = ["topic=x", "topic=y"]
    bad_len = RecordDict({R.CANDIDATES: ConfigRecord({"texts": ["a", "b"], "codes": ["topic=x"]}),
                          R.CONFIG: ConfigRecord({"codes": vocab, "num-votes": 2, "delta": 1e-5})})
    assert _send(node, R.MSG_VOTE, bad_len).error.code == ERR_CONFIG
    bad_delta = RecordDict({R.CANDIDATES: ConfigRecord({"texts": ["a"], "codes": ["topic=x"]}),
                            R.CONFIG: ConfigRecord({"codes": vocab, "num-votes": 2, "delta": 2.0})})
    assert _send(node, R.MSG_VOTE, bad_delta).error.code == ERR_POLICY
    bad_k = RecordDict({R.CANDIDATES: ConfigRecord({"texts": ["a"], "codes": ["topic=x"]}),
                        R.CONFIG: ConfigRecord({"codes": vocab, "num-votes": 0, "delta": 1e-5})})
    assert _send(node, R.MSG_VOTE, bad_k).error.code == ERR_CONFIG
    good = RecordDict({R.CANDIDATES: ConfigRecord({"texts": ["record about x", "y"], "codes": ["topic=x", "topic=y"]}),
                       R.CONFIG: ConfigRecord({"codes": vocab, "num-votes": 2, "delta": 1e-5})})
    reply = _send(node, R.MSG_VOTE, good)
    assert not reply.has_error()
    assert len(R.read_vector(reply.content, R.VOTES)) == 2  # nothing was spent by the bad requests


def test_node_config_epsilon_caps_the_run(csv_path, tmp_path):
    nc = {"tier": "weak", "data-path": csv_path, "max-records": 100, "state-dir": str(tmp_path), "epsilon": 4.0}
    over = RunConfig(model="tiny-gpt2", dataset=csv_path, test_fraction=0.0, epsilon=8.0).to_flower()
    refused = _send(client_node(app, 5, nc, over), R.MSG_PROFILE, _profile_request(["topic=x", "topic=y"]))
    assert refused.has_error() and refused.error.code == ERR_POLICY
    assert refused.error.reason == "refused: policy: epsilon above the node's budget"  # a fixed text, no number
    within = RunConfig(model="tiny-gpt2", dataset=csv_path, test_fraction=0.0, epsilon=4.0,
                       epsilon_profile=1.0).to_flower()
    reply = _send(client_node(app, 5, nc, within), R.MSG_PROFILE, _profile_request(["topic=x", "topic=y"]))
    rel = reply.content.config_records[R.RELEASE]
    assert rel["epsilon-budget"] == 4.0 and rel["epsilon"] == pytest.approx(1.0, abs=1e-3)  # pld: its PLD epsilon


def test_missing_tier_in_deployment_names_the_fix(csv_path, tmp_path, caplog):
    rc = RunConfig(model="tiny-gpt2", dataset=csv_path).to_flower()
    node = client_node(app, 5, {"data-path": csv_path, "max-records": 100, "epsilon": 8.0}, rc)
    reply = _send(node, R.MSG_PROFILE, _profile_request(["topic=x", "topic=y"]))
    assert reply.has_error() and reply.error.reason == "node: not ready (see the node's log)"
    assert 'tier="strong"' in caplog.text  # the fix is in the node's own log


def test_a_weak_node_never_imports_the_training_stack():
    import subprocess
    import sys

    code = ("import sys, fedsyn_client.client_app, common.voting, common.models; "
            "print(sorted(m for m in ('opacus', 'peft', 'fedsyn_client.training', 'common.weights') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_node_check_names_the_file_and_reason_before_a_supernode_starts(tmp_path, capsys):
    from fedsyn_server.cli import main

    good, empty = tmp_path / "good.csv", tmp_path / "empty.csv"
    pd.DataFrame([{"text": f"record {i}", "topic": "x"} for i in range(4)]).to_csv(good, index=False)
    empty.write_text("text,topic\n")
    conf = 'tier="weak" data-path="{}" max-records=100 state-dir="{}" epsilon=8'
    assert main(["node-check", "--allow-any-fab", "--node-config", conf.format(good, tmp_path / "s")]) == 0
    out = capsys.readouterr().out
    assert re.search(r"node ready: tier=weak records=[1-4] budget epsilon=8", out) and "the file holds 4" in out
    assert main(["node-check", "--node-config", conf.format(empty, tmp_path / "s2")]) == 1
    err = capsys.readouterr().err
    assert f"data-path '{empty}' has no records" in err and "\n" not in err.strip()
    assert not (tmp_path / "s2").exists()  # nothing opened for a node that cannot start
    assert main(["node-check", "--node-config", conf.format(tmp_path / "none.csv", tmp_path / "s3")]) == 1
    assert "does not exist" in capsys.readouterr().err
