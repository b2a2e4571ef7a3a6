"""Issue 21 as attacks: a curious server probes a node through every channel that is not a release.

Each test plays one finding against the real ClientApp handlers. The common check: two data
sets that differ in one record (or in size) must give byte-identical error and refusal replies,
each one of the node's fixed texts, and the ledger must charge at least what the accountant says.
"""

from __future__ import annotations

import json
import math
import re
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from flwr.app import ArrayRecord, ConfigRecord, Message, RecordDict

from common import records as R
from common.config import RunConfig
from common.dp import dpsgd_epsilon
from common.histograms import HISTOGRAMS, Histogram
from fedsyn_client import node as node_module
from fedsyn_client.client_app import app
from fedsyn_client.holds import HOLD_UNCONFIRMED_SECONDS
from fedsyn_client.ledger import LedgerError, PrivacyLedger
from fedsyn_client.refusals import FIXED_REPLIES
from tests.fakes import client_node, set_task_identity
from tests.neighbours import initial_arrays

VOCAB = ["topic=x", "topic=y"]
BUDGET = 3.0


def _csv(path: Path, n: int) -> str:
    pd.DataFrame([{"text": f"record {i} about {'xy'[i % 2]}", "topic": "xy"[i % 2]} for i in range(n)]).to_csv(
        path, index=False)
    return str(path)


@pytest.fixture
def twins(tmp_path) -> tuple[str, str]:
    """Two data sets that differ in one record: 20 and 21 records."""
    return _csv(tmp_path / "d20.csv", 20), _csv(tmp_path / "d21.csv", 21)


def _rc(data: str, **over) -> dict:
    base = RunConfig(model="tiny-gpt2", dataset=data, test_fraction=0.0, epsilon=BUDGET, epsilon_profile=2.0,
                     num_server_rounds=2, local_steps=2, batch_size=4, max_length=16).to_flower()
    base.update(over)
    return base


def _fresh() -> None:
    node_module._policy.cache_clear()
    node_module._open.cache_clear()


def _send(data: str, state: Path, message_type: str, rc: dict | None = None, tier: str = "weak", arrays=None,
          candidates=None, run_id: int = 1, node_config: dict | None = None, **conf) -> Message:
    _fresh()
    # "basic": these tests' arithmetic (a release costs exactly its epsilon); "pld" is test_pld_ledger's
    config = {"tier": tier, "data-path": data, "max-records": 100, "state-dir": str(state), "epsilon": BUDGET,
              "accounting": "basic", "vote-window": 32, **(node_config or {})}  # votes at the run's 2 x 16 tokens
    node = client_node(app, 5, config, rc or _rc(data), run_id=run_id)
    set_task_identity()
    conf.setdefault("codes", VOCAB)
    conf.setdefault("delta", 1e-5)
    content = RecordDict({R.CONFIG: ConfigRecord(conf)})
    if arrays is not None:
        content[R.ARRAYS] = arrays
    if candidates is not None:
        content[R.CANDIDATES] = ConfigRecord(candidates)
    return node(Message(content=content, message_type=message_type, dst_node_id=5))


def _spent(state: Path) -> float:
    return PrivacyLedger(state / "ledger.json").spent() if (state / "ledger.json").exists() else 0.0


def _same_fixed_error(a: Message, b: Message) -> str:
    """Both replies are errors with one fixed text and the same code; returns the text."""
    assert a.has_error() and b.has_error()
    assert (a.error.code, a.error.reason) == (b.error.code, b.error.reason)
    assert a.error.reason in FIXED_REPLIES
    assert not re.search(r"\d|/|Error|Exception", a.error.reason), a.error.reason
    return a.error.reason


# --------------------------------------------------------------------------- 1. failures are charged and uniform
def test_a_failure_after_the_reservation_is_charged_and_says_nothing_of_its_cause(twins, tmp_path, monkeypatch):
    """A histogram that fails with one exception on |D| > 20 and another below: a free yes/no before."""

    class Probe(Histogram):
        name, formula = "probe", "1"

        def sensitivity(self, params):
            return 1.0

        def score(self, rows, codes, candidates, candidate_codes, params, *, bound):
            raise (ValueError if len(codes) > 20 else KeyError)(f"{len(codes)} records")

    monkeypatch.setitem(HISTOGRAMS, "probe", Probe())
    replies = []
    for i, data in enumerate(twins):
        state = tmp_path / f"s{i}"
        replies.append(_send(data, state, R.MSG_VOTE, histogram="probe", candidates={"texts": ["a", "b"],
                                                                                      "codes": VOCAB}))
        assert _spent(state) == pytest.approx(1.0)  # the vote's epsilon (3 - 2) stays spent
        statuses = [r["status"] for r in PrivacyLedger.open(state, BUDGET).releases]
        assert statuses == ["failed"]
    assert replies[0].error.code == R.ERR_INTERNAL
    assert _same_fixed_error(*replies) == "failed on the node (see the node's log); a reserved release stays spent"


# --------------------------------------------------------------------------- 2. refusals carry no numbers
ATTACKS = {
    "columns": dict(rc_over={"control-columns": "text2"}),
    "epsilon": dict(rc_over={"epsilon": 30.0}),
    "vocabulary": dict(conf={"codes": []}),
    "delta": dict(conf={"delta": 0.5}),
    "model": dict(rc_over={"model": "/tmp/evil-model"}, message=R.MSG_TRAIN, tier="strong"),
    "finetune": dict(node_config={"finetune": "lora"}, rc_over={"finetune": "full"}, message=R.MSG_TRAIN,
                     tier="strong"),
    "embedder": dict(rc_over={"embedder": "/tmp/evil-embedder"}, message=R.MSG_VOTE),
    # the contrastive histogram's K is checked like kNN-vote's, before anything is reserved
    "contrastive-k": dict(conf={"histogram": "contrastive-vote", "num-votes": 0}, message=R.MSG_VOTE),
    "cap": dict(node_config={"max-epsilon-profile": 1.0}),
    "budget": dict(node_config={"epsilon": 1.0}, rc_over={"epsilon": 1.0, "epsilon-profile": 0.5}, twice=True),
    "key": dict(conf={"resume-key": "../other"}),
}


@pytest.mark.parametrize("attack", sorted(ATTACKS))
def test_refusals_are_one_fixed_text_whatever_the_records(attack, twins, tmp_path):
    spec = ATTACKS[attack]
    replies = []
    for i, data in enumerate(twins):
        state = tmp_path / f"s{i}"
        args = dict(rc=_rc(data, **spec.get("rc_over", {})), tier=spec.get("tier", "weak"),
                    node_config=spec.get("node_config"), **spec.get("conf", {}))
        if spec.get("message") == R.MSG_VOTE:
            args["candidates"] = {"texts": ["a", "b"], "codes": VOCAB}
            args.setdefault("num-votes", 1)
        if spec.get("message") == R.MSG_TRAIN:
            args["arrays"], args["server-round"] = ArrayRecord(), 1
        message = spec.get("message", R.MSG_PROFILE)
        if spec.get("twice"):  # the first release spends the budget; the second is refused by it
            assert not _send(data, state, message, **args).has_error()
            args["server-round"] = 1
        before = _spent(state)
        replies.append(_send(data, state, message, **args))
        assert _spent(state) == before  # a refusal spends nothing
    _same_fixed_error(*replies)


def test_a_data_file_error_names_file_and_line_in_the_log_only(tmp_path, caplog):
    replies = []
    for i, bad_line in enumerate((2, 5)):  # the files differ in where (and whether) they break
        path = tmp_path / f"notes{i}.jsonl"
        lines = [json.dumps({"text": f"note {j}", "topic": "x"}) for j in range(6)]
        lines[bad_line] = '{"text": "broken'
        path.write_text("\n".join(lines) + "\n")
        replies.append(_send(str(path), tmp_path / f"s{i}", R.MSG_TIER, rc=_rc(str(path))))
    assert _same_fixed_error(*replies) == "data: unreadable on this node"
    assert "notes0.jsonl" in caplog.text


# --------------------------------------------------------------------------- 3. a resume cannot train past its charge
@pytest.mark.parametrize("over", [{"epsilon": BUDGET * 10}, {"num-server-rounds": 6}, {"batch-size": 2}])
def test_a_resume_under_other_terms_is_refused_and_the_ledger_covers_the_accountant(twins, tmp_path, over):
    data, state = twins[0], tmp_path / "s"
    node_config = {"epsilon": 100.0}
    rc = _rc(data)
    arrays = initial_arrays(rc)
    first = _send(data, state, R.MSG_TRAIN, rc=rc, tier="strong", arrays=arrays, node_config=node_config,
                  **{"server-round": 1, "resume-key": "run-a"})
    assert not first.has_error(), first.error
    resumed = _send(data, state, R.MSG_TRAIN, rc=_rc(data, **over), tier="strong", arrays=arrays,
                    node_config=node_config, **{"server-round": 2, "resume-key": "run-a"})
    assert resumed.error.code == R.ERR_BUDGET
    assert resumed.error.reason == "refused: budget: reservation bound to other terms"
    # the run's own second round, on its own terms, goes on
    assert not _send(data, state, R.MSG_TRAIN, rc=rc, tier="strong", arrays=arrays, node_config=node_config,
                     **{"server-round": 2, "resume-key": "run-a"}).has_error()
    ledger = PrivacyLedger.open(state, 100.0)
    charged = ledger.spent(run_id="run-a", phase="train")
    state_ = ledger.accountant_state("run-run-a")
    assert dpsgd_epsilon(state_["history"], state_["delta"]) <= charged + 1e-6


# --------------------------------------------------------------------------- 4. finite in, finite out
@pytest.mark.parametrize("poison", ["nan", "inf", "huge", "shape"])
def test_bad_weights_are_refused_before_anything_is_spent(twins, tmp_path, poison):
    data, state = twins[0], tmp_path / "s"
    rc = _rc(data)
    state_dict = R.state_from_arrays(initial_arrays(rc))
    name = next(iter(state_dict))
    arr = state_dict[name].copy()
    if poison == "shape":
        arr = arr[..., :1]
    else:
        arr.flat[0] = {"nan": np.nan, "inf": np.inf, "huge": 1e30}[poison]
    state_dict[name] = arr
    reply = _send(data, state, R.MSG_TRAIN, rc=rc, tier="strong", arrays=R.arrays_from_state(state_dict),
                  **{"server-round": 1})
    assert (reply.error.code, reply.error.reason) == (R.ERR_WEIGHTS, "refused: bad weights")
    assert _spent(state) == 0.0


def test_a_record_that_overflows_gets_a_zero_gradient_and_the_weights_stay_finite():
    import torch

    from common.models import load_generator
    from common.weights import prepare_model
    from fedsyn_client.training import TrainSettings, dp_train

    model, tok = load_generator("tiny-gpt2", seed=0)
    model = prepare_model(model, "full", 1)
    trap = tok(" zebra", add_special_tokens=False)["input_ids"][0]
    with torch.no_grad():  # weights the server may not send (they are checked), but a record may hit
        model.get_input_embeddings().weight[trap] = 3e38
    texts = [f"record {i} about x" for i in range(7)] + ["zebra zebra zebra"]
    settings = TrainSettings(local_steps=3, batch_size=8, learning_rate=1e-3, max_length=16, max_grad_norm=1.0,
                             noise_multiplier=1.0)
    result = dp_train(model, tok, texts, ["topic=x"] * 8, settings, 1e-5, [])
    assert all(np.isfinite(v).all() for v in result.state.values())


def test_non_finite_per_record_statistics_become_a_fixed_value():
    import torch

    from common.voting import finite_rows, similarity_scores
    from fedsyn_client.training import zero_nonfinite_samples

    p = torch.nn.Parameter(torch.zeros(3, 2))
    p.grad_sample = torch.tensor([[[1.0, 2.0]] * 3, [[math.nan, 0.0]] * 3, [[math.inf, 1.0]] * 3])
    assert zero_nonfinite_samples([p]) == 2
    assert p.grad_sample[0].eq(torch.tensor([[1.0, 2.0]] * 3)).all() and p.grad_sample[1:].eq(0).all()
    emb = np.array([[1.0, 0.0], [np.nan, 1.0], [1e308 * 10, 0.0]])
    clean = finite_rows(emb)
    assert np.isfinite(clean).all() and (clean[1:] == 0).all() and (clean[0] == [1, 0]).all()
    scores = similarity_scores(clean, ["a", "a", "a"], np.array([[1.0, 0.0]]), ["a"])
    assert np.isfinite(scores).all() and scores[0] == pytest.approx(1.0)


# --------------------------------------------------------------------------- 7. holds and keys
def test_a_guessed_key_can_neither_end_nor_renew_another_runs_hold(twins, tmp_path):
    data, state = twins[0], tmp_path / "s"
    assert not _send(data, state, R.MSG_TIER, **{"resume-key": "victim", "hold-token": "secret"}).has_error()
    held = PrivacyLedger.open(state, BUDGET).summary()["holds"]["victim"]
    assert not held["confirmed"] and held["until"] <= time.time() + HOLD_UNCONFIRMED_SECONDS  # lapses soon
    assert "secret" not in json.dumps(held)  # only the token's hash is kept
    for token in ("", "guess"):
        assert not _send(data, state, R.MSG_LEDGER, **{"resume-key": "victim", "hold-token": token}).has_error()
        assert "victim" in PrivacyLedger.open(state, BUDGET).summary()["holds"]
    for token in ("guess", "secret"):  # asking again, even with the token, never stretches an unconfirmed hold
        _send(data, state, R.MSG_TIER, **{"resume-key": "victim", "hold-token": token})
        assert PrivacyLedger.open(state, BUDGET).summary()["holds"]["victim"]["until"] == held["until"]
    assert not _send(data, state, R.MSG_LEDGER, **{"resume-key": "victim", "hold-token": "secret"}).has_error()
    assert "victim" not in PrivacyLedger.open(state, BUDGET).summary()["holds"]


def test_per_phase_caps_count_every_run_key(twins, tmp_path):
    data, state = twins[0], tmp_path / "s"
    config = {"epsilon": 10.0, "max-epsilon-profile": 3.0}
    rc = _rc(data, **{"epsilon": 10.0, "epsilon-profile": 2.0})
    assert not _send(data, state, R.MSG_PROFILE, rc=rc, node_config=config, **{"resume-key": "a"}).has_error()
    second = _send(data, state, R.MSG_PROFILE, rc=rc, node_config=config, **{"resume-key": "b"})
    assert (second.error.code, second.error.reason) == (R.ERR_BUDGET, "refused: budget: phase cap")
    assert PrivacyLedger.open(state, 10.0).spent() == 2.0


def test_a_deleted_ledger_beside_released_replies_is_refused_not_restarted(twins, tmp_path):
    data, state = twins[0], tmp_path / "s"
    assert not _send(data, state, R.MSG_PROFILE).has_error()
    (state / "ledger.json").unlink()
    reply = _send(data, state, R.MSG_PROFILE, **{"server-round": 1})
    assert (reply.error.code, reply.error.reason) == (R.ERR_CONFIG, "node: not ready (see the node's log)")
    assert not (state / "ledger.json").exists()
    with pytest.raises(LedgerError, match="missing"):
        PrivacyLedger.open(state, BUDGET)


def test_a_run_whose_replies_expired_is_refused_not_answered_again(twins, tmp_path):
    """A node keeps a run's replies keep-replies-days (30 by default) after its last release, so its
    store does not grow for years. A curious server that replays an expired run's request gets the
    fixed refusal (the ledger keeps the release for good), never fresh noise, and nothing more is
    charged: the same for twin data sets."""
    import os

    replies = []
    for i, data in enumerate(twins):
        state = tmp_path / f"s{i}"
        config = {"epsilon": 10.0}
        assert not _send(data, state, R.MSG_PROFILE, node_config=config, **{"resume-key": "old"}).has_error()
        old = state / "ledger-replies" / "old"
        month_ago = time.time() - 31 * 86400
        for f in [old, *old.iterdir()]:
            os.utime(f, (month_ago, month_ago))
        assert not _send(data, state, R.MSG_PROFILE, node_config=config, **{"resume-key": "new"}).has_error()
        assert not old.exists() and (state / "ledger-replies" / "new").is_dir()
        spent = _spent(state)
        replies.append(_send(data, state, R.MSG_PROFILE, node_config=config, **{"resume-key": "old"}))
        assert _spent(state) == spent == 4.0
    assert _same_fixed_error(*replies) == "refused: budget: round released before"


# --------------------------------------------------------------------------- a policy means what it says
@pytest.mark.parametrize("extra,fragment", [
    ({"epsilom": 3}, "epsilom"), ({"max-eps-vote": 1}, "max-eps-vote"),
    ({"max-epsilon-train": -5}, "max-epsilon-train"), ({"max-epsilon-vote": 9}, "max-epsilon-vote"),
    ({"finetune": "lora,qlora"}, "finetune"), ({"model": ""}, "model"),
    ({"keep-replies-days": -1}, "keep-replies-days"),
])
def test_a_misspelt_or_inconsistent_node_config_stops_the_node(twins, tmp_path, capsys, extra, fragment):
    from fedsyn_server.cli import main

    config = " ".join(f'{k}="{v}"' if isinstance(v, str) else f"{k}={v}" for k, v in
                      {"tier": "weak", "data-path": twins[0], "max-records": 100, "state-dir": str(tmp_path / "s"),
                       "epsilon": 8.0, **extra}.items())
    assert main(["node-check", "--node-config", config]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and fragment in err
    assert not (tmp_path / "s").exists()


def test_node_check_never_changes_a_budget_and_a_damaged_ledger_is_one_line(twins, tmp_path, capsys):
    from fedsyn_server.cli import main

    state = tmp_path / "s"
    base = f'tier="weak" data-path="{twins[0]}" max-records=100 state-dir="{state}"'
    assert main(["node-check", "--allow-any-fab", "--node-config", base + " epsilon=8"]) == 0
    capsys.readouterr()
    assert main(["node-check", "--node-config", base + " epsilon=80"]) == 1
    assert "--set-budget 80" in capsys.readouterr().err
    assert PrivacyLedger.open(state, 8.0).summary()["budget_changes"] == []
    for damage in ('{"format": 2, "budget"', "[]", "{}"):
        (state / "ledger.json").write_text(damage)
        assert main(["node-check", "--node-config", base + " epsilon=8"]) == 1
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "ledger.json" in err and "damaged" in err
        assert main(["ledger", str(state)]) == 1
        assert "damaged" in capsys.readouterr().err
    assert main(["ledger", str(state), "--reset", "--reason", "restored from nothing"]) == 2  # needs --budget
    capsys.readouterr()
    assert main(["ledger", str(state), "--reset", "--reason", "restored from nothing", "--budget", "8"]) == 0
    summary = PrivacyLedger.open(state, 8.0).summary()
    assert summary["resets"][-1]["previous_epsilon_spent"].startswith("unknown")
    assert Path(summary["resets"][-1]["archive"]).read_text() == "{}"
    assert main(["node-check", "--allow-any-fab", "--node-config", base + " epsilon=8"]) == 0
