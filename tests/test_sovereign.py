"""Issue 8 as attacks: a curious server's crafted requests and run configs against the real handlers.

Each test is one finding of the issue, written as the attack; each failed on the main
before sovereign nodes (the ledger keyed by a data fingerprint, delta from the server,
no lock, the server's budget, a vocabulary yes/no, q in the reply, an endless calibration).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from flwr.app import ArrayRecord, ConfigRecord, Message, RecordDict

from common import records as R
from common.config import RunConfig
from common.records import ERR_BUDGET, ERR_CONFIG, ERR_POLICY
from fedsyn_client.client_app import app
from fedsyn_client.ledger import PrivacyLedger
from tests.fakes import FakeGrid, client_node, set_task_identity

VOCAB = ["topic=x", "topic=y"]
BUDGET = 3.0  # the institution's total epsilon


def _csv(path: Path, n: int = 20, topics=("x", "y")) -> str:
    rows = [{"text": f"record {i} of {path.stem} about {t}", "topic": t, "source": "wire"}
            for i in range(n) for t in topics[i % len(topics):][:1]]
    pd.DataFrame(rows).to_csv(path, index=False)
    return str(path)


@pytest.fixture
def data(tmp_path) -> str:
    return _csv(tmp_path / "records.csv")


def _rc(data: str, **over) -> dict:
    base = RunConfig(model="tiny-gpt2", dataset=data, test_fraction=0.0, epsilon=BUDGET, epsilon_profile=2.0,
                     num_server_rounds=1, local_steps=2, batch_size=4, max_length=16, voters="weak",
                     accounting="basic").to_flower()  # the simulated nodes' rule: see _node
    base.update(over)
    return base


def _node(data: str, state: Path, rc: dict, run_id: int, tier: str = "weak", **nc):
    # "basic" (the paper's: a release costs exactly its epsilon), which these tests' arithmetic was
    # written on; the default "pld" is tested in test_pld_ledger, test_calibration and the neighbours
    config = {"tier": tier, "data-path": data, "max-records": 100, "state-dir": str(state), "epsilon": BUDGET,
              "accounting": "basic", "vote-window": 32, **nc}  # votes at the run's 2 x max-length 16
    return client_node(app, 5, config, rc, run_id=run_id)


def _ask(node, message_type: str, **conf) -> Message:
    set_task_identity()
    conf.setdefault("codes", VOCAB)
    conf.setdefault("delta", 1e-5)
    return node(Message(content=RecordDict({R.CONFIG: ConfigRecord(conf)}), message_type=message_type, dst_node_id=5))


def _spent(state: Path) -> float:
    return PrivacyLedger.open(state, budget=BUDGET).spent()


def _fresh_process() -> None:
    """What a new ClientApp process would see: no cached node."""
    from fedsyn_client import node

    node._policy.cache_clear()
    node._open.cache_clear()


# --------------------------------------------------------------------------- finding 1
def test_changing_the_data_view_does_not_open_a_fresh_ledger(data, tmp_path):
    state = tmp_path / "state"
    assert not _ask(_node(data, state, _rc(data), run_id=1), R.MSG_PROFILE).has_error()
    # The attack: the same records seen through other columns (or the same columns reordered).
    for columns in ("topic,source", "source,topic"):
        reply = _ask(_node(data, state, _rc(data, **{"control-columns": columns}), run_id=2), R.MSG_PROFILE)
        assert reply.error.code == ERR_POLICY and reply.error.reason == "refused: policy: columns not allowed"
    # A second run through the node's own view is refused by the budget left (3 - 2 = 1 < 2).
    again = _ask(_node(data, state, _rc(data), run_id=3), R.MSG_PROFILE)
    assert again.error.code == ERR_BUDGET and again.error.reason == "refused: budget"
    assert _spent(state) == 2.0


def test_appending_a_record_does_not_reset_the_budget(data, tmp_path):
    state = tmp_path / "state"
    assert not _ask(_node(data, state, _rc(data), run_id=1), R.MSG_PROFILE).has_error()
    with open(data, "a") as f:
        f.write("one more record about x,x,wire\n")
    _fresh_process()
    reply = _ask(_node(data, state, _rc(data), run_id=2), R.MSG_PROFILE)
    assert reply.error.code == ERR_BUDGET
    assert _spent(state) == 2.0 <= BUDGET
    assert len(PrivacyLedger.open(state, budget=BUDGET).summary()["data"]) == 2  # the change is logged


# --------------------------------------------------------------------------- finding 2
@pytest.mark.parametrize("message_type,tier", [(R.MSG_PROFILE, "weak"), (R.MSG_TRAIN, "strong")])
def test_the_server_cannot_raise_delta(data, tmp_path, message_type, tier):
    state = tmp_path / "state"
    node = _node(data, state, _rc(data), run_id=1, tier=tier)
    set_task_identity()
    content = RecordDict({R.CONFIG: ConfigRecord({"codes": VOCAB, "delta": 0.36, "server-round": 1}),
                          R.ARRAYS: ArrayRecord()})
    reply = node(Message(content=content, message_type=message_type, dst_node_id=5))
    assert reply.error.code == ERR_POLICY and "delta" in reply.error.reason
    assert _spent(state) == 0.0
    # The institution may accept a larger delta on purpose; then it is used.
    ok = _ask(_node(data, tmp_path / "s2", _rc(data), run_id=1, delta=0.01), R.MSG_PROFILE, delta=0.01)
    # under basic (this harness's rule) a release's delta is its share of the policy's: 2 of epsilon 3 (issue 60)
    assert ok.content.config_records[R.RELEASE]["delta"] == pytest.approx(0.01 * 2.0 / BUDGET)


def test_paper_delta_counts_records_not_nodes(tmp_path):
    from common.dp import paper_delta
    from fedsyn_server.server_app import build_strategy

    data = _csv(tmp_path / "public.csv", n=200)
    strategy, bench, _ = build_strategy(RunConfig.from_flower(_rc(data, delta="paper")))
    assert strategy.session.delta == paper_delta(len(bench.train)) < 1e-3  # 2 nodes would give 0.36


# --------------------------------------------------------------------------- finding 3
_WORKER = textwrap.dedent("""
    import json, sys, time
    from pathlib import Path
    from flwr.app import ConfigRecord, Message, RecordDict
    from common import records as R
    from common.config import RunConfig
    from fedsyn_client.client_app import app
    from tests.fakes import client_node, set_task_identity

    data, state, run_id, barrier = sys.argv[1], sys.argv[2], int(sys.argv[3]), Path(sys.argv[4])
    rc = RunConfig(model="tiny-gpt2", dataset=data, test_fraction=0.0, epsilon=3.0,
                   epsilon_profile=2.0).to_flower()
    node = client_node(app, 5, {"tier": "weak", "data-path": data, "max-records": 100, "state-dir": state,
                                "epsilon": 3.0, "accounting": "basic"}, rc,
                       run_id=run_id)
    set_task_identity()
    ask = lambda t: node(Message(content=RecordDict({R.CONFIG: ConfigRecord(
        {"codes": ["topic=x", "topic=y"], "delta": 1e-5})}), message_type=t, dst_node_id=5))
    assert not ask(R.MSG_TIER).has_error()  # the node is set up and has read its ledger
    (barrier / f"ready-{run_id}").touch()
    while len(list(barrier.glob("ready-*"))) < 2:
        time.sleep(0.01)
    reply = ask(R.MSG_PROFILE)
    print(json.dumps({"released": not reply.has_error()}))
""")


def test_two_concurrent_runs_cannot_both_pass_the_budget_check(data, tmp_path):
    state, barrier = tmp_path / "state", tmp_path / "barrier"
    barrier.mkdir()
    root = Path(__file__).resolve().parents[1]
    procs = [subprocess.Popen([sys.executable, "-c", _WORKER, data, str(state), str(run_id), str(barrier)],
                              cwd=root, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for run_id in (1, 2)]
    try:
        outs = [p.communicate(timeout=180) for p in procs]
    finally:
        for p in procs:
            p.kill()
    released = [json.loads(out.strip().splitlines()[-1])["released"] for out, err in outs]
    assert sorted(released) == [False, True], outs  # budget 3 fits one profile of 2, not two
    ledger = PrivacyLedger.open(state, budget=BUDGET)
    assert ledger.spent() == 2.0 and len([r for r in ledger.releases if r["status"] == "confirmed"]) == 1


# --------------------------------------------------------------------------- finding 4
def test_the_server_cannot_set_or_raise_the_budget(data, tmp_path):
    state = tmp_path / "state"
    no_budget = client_node(app, 5, {"tier": "weak", "data-path": data, "max-records": 100, "state-dir": str(state)},
                            _rc(data), run_id=1)
    reply = _ask(no_budget, R.MSG_TIER)
    assert reply.error.code == ERR_CONFIG and reply.error.reason == "node: not ready (see the node's log)"
    assert not state.exists()  # refused before a ledger (or a record) was touched
    assert not _ask(_node(data, state, _rc(data), run_id=2), R.MSG_PROFILE).has_error()
    for epsilon in (1000.0, "inf"):
        raised = _ask(_node(data, state, _rc(data, epsilon=epsilon), run_id=3), R.MSG_PROFILE)
        assert raised.error.code == ERR_POLICY
        assert raised.error.reason == "refused: policy: epsilon above the node's budget"
    ledger = PrivacyLedger.open(state, budget=BUDGET)
    assert ledger.budget == BUDGET and not ledger.summary()["budget_changes"] and ledger.spent() == 2.0


# --------------------------------------------------------------------------- finding 5
def test_no_free_yes_no_about_which_codes_occur(tmp_path, caplog):
    """Dropping a code from the vocabulary gets the same kind of answer whether or not a record has it."""
    both, only_x = _csv(tmp_path / "both.csv"), _csv(tmp_path / "onlyx.csv", topics=("x",))
    shapes = []
    for data in (both, only_x):
        for vocab in (VOCAB, ["topic=x"]):
            state = tmp_path / f"s-{Path(data).stem}-{len(vocab)}"
            tier = _ask(_node(data, state, _rc(data), run_id=1), R.MSG_TIER, codes=vocab)
            prof = _ask(_node(data, state, _rc(data), run_id=1), R.MSG_PROFILE, codes=vocab)
            assert not tier.has_error() and not prof.has_error()
            tier_reply = {k: v for k, v in tier.content.config_records[R.TIER].items() if k != "ledger-ref"}  # random
            shapes.append((vocab == VOCAB, tier_reply,
                           len(R.read_vector(prof.content, R.PROFILE)),
                           sorted(prof.content.config_records[R.RELEASE].keys())))
    assert shapes[0] == shapes[2] and shapes[1] == shapes[3]  # same answers with and without topic=y records
    assert re.search(r"\d+ of \d+ records have a code outside the run's vocabulary", caplog.text)  # the node's own log
    # A pinned vocabulary refuses any other, whatever the records hold.
    for data in (both, only_x):
        pinned = _ask(_node(data, tmp_path / "p", _rc(data), run_id=9, **{"control-codes": ",".join(VOCAB)}),
                      R.MSG_TIER, codes=["topic=x"])
        assert pinned.error.code == ERR_POLICY and "vocabulary" in pinned.error.reason


# --------------------------------------------------------------------------- findings 6 and 7
def _run_strategy(tmp_path, nodes_cfg: dict[int, tuple[str, str]], rc: dict, drop_vote_reply: int | None = None):
    """The real strategy over a fake Grid with real ClientApp nodes (deployment-style configs)."""
    from fedsyn_server.privacy_report import privacy_report
    from fedsyn_server.server_app import build_strategy

    nodes = {}
    for nid, (tier, data) in nodes_cfg.items():
        fn = client_node(app, nid, {"tier": tier, "data-path": data, "max-records": 100,
                                    "state-dir": str(tmp_path / f"state{nid}"), "epsilon": 8.0,
                                    "vote-window": 2 * int(rc["max-length"])}, rc, run_id=11)
        if nid == drop_vote_reply:  # the node releases its vote, but the reply is lost on the way
            fn = (lambda real: lambda m: None if m.metadata.message_type == R.MSG_VOTE and real(m) else real(m))(fn)
        nodes[nid] = fn
    set_task_identity()
    cfg = RunConfig.from_flower(rc)
    strategy, _, model = build_strategy(cfg)
    strategy.session.stable_seconds = 0.0
    grid = FakeGrid(nodes)
    res = strategy.start(grid, model.initial_arrays())
    return res, privacy_report(cfg, res), grid


def test_the_report_does_not_reveal_record_counts(tmp_path):
    public = _csv(tmp_path / "public.csv", n=30)
    small, large = _csv(tmp_path / "small.csv", n=12), _csv(tmp_path / "large.csv", n=60)
    rc = _rc(public, epsilon=8.0, **{"num-server-rounds": 2, "control-codes": ",".join(VOCAB), "num-synthetic": 8,
                                     "max-new-tokens": 4, "test-fraction": 0.1, "num-votes": 2})
    res, report, grid = _run_strategy(tmp_path, {1: ("strong", small), 2: ("strong", large),
                                                 3: ("weak", small), 4: ("weak", large)}, rc)
    assert not res.failures
    entries = {n["node_id"]: n for n in report["nodes"]}
    for a, b in ((1, 2), (3, 4)):
        # ids and the ledger's random name differ by construction; nothing else may
        strip = lambda e: {k: v for k, v in e.items() if k not in ("node_id", "node_ids", "ledger_ref")}  # noqa: E731
        assert strip(entries[a]) == strip(entries[b])  # 12 vs 60 records: nothing tells them apart
    for reply in grid.replies:  # nor anything the server received
        for key in (R.RELEASE, R.LEDGER):
            if key in reply.content.config_records:
                text = json.dumps(dict(reply.content.config_records[key]))
                assert "sample_rate" not in text and "noise_multiplier" not in text
    # finding 7: the report's delta is the sum of each release's delta as the node stated it
    strong = entries[1]
    assert [r["phase"] for r in strong["releases"]] == ["profile", "train", "train"]
    assert strong["delta"] == pytest.approx(sum(r["delta"] for r in strong["releases"])) == pytest.approx(2e-5)
    # the nodes' default pld rule charges the PLD composition: the budget, a hair under
    assert strong["epsilon_spent"] == pytest.approx(8.0, abs=2e-3) and strong["epsilon_pld"] <= 8.0


def test_a_release_whose_reply_was_lost_is_in_the_report(tmp_path):
    public = _csv(tmp_path / "public.csv", n=30)
    rc = _rc(public, epsilon=8.0, **{"num-server-rounds": 0, "control-codes": ",".join(VOCAB), "num-synthetic": 8,
                                     "max-new-tokens": 4, "num-votes": 2})
    # node 3 answers, so the round is done; node 2 released its votes but the server never got them
    res, report, _ = _run_strategy(tmp_path, {1: ("strong", public), 2: ("weak", public), 3: ("weak", public)}, rc,
                                   drop_vote_reply=2)
    weak = next(n for n in report["nodes"] if n["node_id"] == 2)
    assert (2, "vote") in {(f["node_id"], f["phase"]) for f in res.failures}
    assert weak["source"] == "node ledger"
    assert [r["phase"] for r in weak["releases"]] == ["profile", "vote"]
    assert weak["epsilon_spent"] == pytest.approx(8.0, abs=2e-3)  # pld, the nodes' default: a hair under


def test_train_without_phase_1_is_refused_not_an_endless_calibration(data, tmp_path):
    node = _node(data, tmp_path / "state", _rc(data, **{"num-server-rounds": 0}), run_id=1, tier="strong")
    replies = []
    set_task_identity()
    content = RecordDict({R.CONFIG: ConfigRecord({"codes": VOCAB, "delta": 1e-5, "server-round": 1}),
                          R.ARRAYS: ArrayRecord()})
    worker = threading.Thread(target=lambda: replies.append(node(Message(content=content, message_type=R.MSG_TRAIN,
                                                                         dst_node_id=5))), daemon=True)
    worker.start()
    worker.join(timeout=60)
    assert replies, "the train handler did not answer within 60 s"
    assert replies[0].error.code == ERR_CONFIG and replies[0].error.reason == "request: invalid (see the node's log)"


def test_per_phase_caps_and_a_policy_file(data, tmp_path):
    policy = tmp_path / "policy.toml"
    policy.write_text('tier = "weak"\nepsilon = 3.0\nmax-epsilon-profile = 1.0\n')
    config = {"data-path": data, "max-records": 100, "state-dir": str(tmp_path / "state"), "policy-file": str(policy),
              "accounting": "basic"}
    capped = _ask(client_node(app, 5, config, _rc(data), run_id=1), R.MSG_PROFILE)  # the run asks 2 for profile
    assert capped.error.code == ERR_POLICY and capped.error.reason == "refused: policy: phase cap"
    within = _ask(client_node(app, 5, config, _rc(data, **{"epsilon-profile": 1.0}), run_id=2), R.MSG_PROFILE)
    assert within.content.config_records[R.RELEASE]["epsilon"] == 1.0
    bad = _ask(client_node(app, 5, {**config, "policy-file": str(tmp_path / "missing.toml")}, _rc(data), run_id=3),
               R.MSG_TIER)
    assert bad.error.code == ERR_CONFIG and "missing.toml" not in bad.error.reason  # no path leaves the node


def test_a_node_whose_data_cannot_be_loaded_says_so_without_quoting_records(data, tmp_path, caplog):
    broken = tmp_path / "notes.jsonl"
    broken.write_text('{"text": "patient 7 secret note", "topic": "x"}\n{"text": "patient 8 secret, "topic": "y"}\n')
    node = client_node(app, 5, {"tier": "weak", "data-path": str(broken), "max-records": 100,
                                "state-dir": str(tmp_path / "s"), "epsilon": 8.0, "vote-window": 32}, _rc(data),
                         run_id=4)
    with caplog.at_level("ERROR"):
        reply = _ask(node, R.MSG_TIER)
    assert reply.error.code == ERR_CONFIG
    assert reply.error.reason == "data: unreadable on this node"  # no path, line or field count
    assert "notes.jsonl' line 2" in caplog.text  # the node's own log says which file and line


# --------------------------------------------------------------------------- idempotent releases
def _spent(state: Path) -> float:
    return PrivacyLedger.open(state, BUDGET).spent()


def test_a_repeated_vote_is_replayed_across_runs_with_its_key_and_a_changed_one_is_refused(data, tmp_path):
    rc = _rc(data, **{"num-votes": 1})
    votes = {"histogram": "knn-vote", "epsilon-share": 0.5, "server-round": 1, "num-votes": 1, "resume-key": "k1"}
    cand = ConfigRecord({"texts": ["the x", "the y"], "codes": VOCAB})

    def vote(node, texts=None, **over):
        set_task_identity()
        content = RecordDict({R.CANDIDATES: ConfigRecord({**cand, **({"texts": texts} if texts else {})}),
                              R.CONFIG: ConfigRecord({"codes": VOCAB, "delta": 1e-5, **votes, **over})})
        return node(Message(content=content, message_type=R.MSG_VOTE, dst_node_id=5))

    first = vote(_node(data, tmp_path, rc, run_id=1))
    assert not first.has_error(), first.error
    spent = _spent(tmp_path)
    # the server was restarted: a new Flower run id, the same resume key and request -> the same bytes, free
    again = vote(_node(data, tmp_path, rc, run_id=2))
    assert list(again.content.metric_records[R.VOTES][R.VOTES]) == list(first.content.metric_records[R.VOTES][R.VOTES])
    assert _spent(tmp_path) == spent
    # other candidates under the same key and round would be a second release under the first one's name
    changed = vote(_node(data, tmp_path, rc, run_id=2), texts=["another x", "another y"])
    assert changed.error.code == ERR_BUDGET
    assert changed.error.reason == "refused: budget: released before for another request"
    # the next round is a new release, booked under the same run
    second = vote(_node(data, tmp_path, rc, run_id=2), **{"server-round": 2})
    assert not second.has_error() and _spent(tmp_path) == pytest.approx(2 * spent)
    for bad in ("../etc", "a b", "x" * 81):  # a key names a folder on the node's disk
        refused = vote(_node(data, tmp_path, rc, run_id=3), **{"resume-key": bad, "server-round": 3})
        assert refused.error.code == ERR_CONFIG and refused.error.reason == "request: invalid (see the node's log)"
    assert _spent(tmp_path) == pytest.approx(2 * spent)


def _trainer(data: str, state: Path, rc: dict):
    """``train(rnd)``: a phase-1 request for round ``rnd`` from the initial weights to a strong node."""
    from fedsyn_server.synthesis import ServerModel

    arrays = ServerModel(RunConfig.from_flower(rc)).initial_arrays()

    def train(rnd: int) -> Message:
        set_task_identity()
        content = RecordDict({R.CONFIG: ConfigRecord({"codes": VOCAB, "delta": 1e-5, "server-round": rnd}),
                              R.ARRAYS: arrays})
        return _node(data, state, rc, run_id=1, tier="strong")(
            Message(content=content, message_type=R.MSG_TRAIN, dst_node_id=5))

    return train


def test_a_repeated_training_round_is_replayed_and_only_the_latest_round_is_kept(data, tmp_path):
    train = _trainer(data, tmp_path, _rc(data, **{"num-server-rounds": 2}))

    first = train(1)
    assert not first.has_error(), first.error
    spent, weights = _spent(tmp_path), first.content.array_records[R.ARRAYS].to_numpy_ndarrays()
    again = train(1)
    assert all((a == b).all() for a, b in zip(again.content.array_records[R.ARRAYS].to_numpy_ndarrays(), weights))
    assert _spent(tmp_path) == spent
    assert not train(2).has_error()
    stored = sorted(p.name for p in (tmp_path / "ledger-replies" / "1").iterdir())
    assert stored == ["train-2.npz"]  # a resumed run re-asks at most the round that was cut off


def test_a_strong_node_killed_mid_round_rejoins_later_rounds_without_paying_twice(data, tmp_path, monkeypatch):
    from fedsyn_client import training
    from fedsyn_client.ledger import PrivacyLedger as Ledger

    train = _trainer(data, tmp_path, _rc(data, **{"num-server-rounds": 3}))

    # SIGKILL during round 1: the reservation is never confirmed nor cancelled
    def killed(*args, **kwargs):
        raise RuntimeError("SIGKILL")

    with monkeypatch.context() as m:
        m.setattr(Ledger, "fail", lambda self, entry_id, reason: None)
        m.setattr(training, "dp_train", killed)
        assert train(1).has_error()
    assert [(r["phase"], r["status"]) for r in _ledger_entries(tmp_path)] == [("train", "reserved")]
    spent = _spent(tmp_path)
    assert spent == pytest.approx(1.0)  # epsilon_train = 3 - 2 (profile): the lost round stays counted
    # the node restarts and the server goes on with round 2: it rejoins at no further cost
    assert not train(2).has_error()
    assert _spent(tmp_path) == pytest.approx(spent)
    assert not train(3).has_error()
    # the lost round's steps stay taken: 3 rounds x tau steps is all the calibration covers
    refused = train(4)
    assert refused.error.code == ERR_BUDGET and refused.error.reason == "refused: budget: steps"


def _ledger_entries(state: Path) -> list[dict]:
    return json.loads((state / "ledger.json").read_text())["releases"]


def test_the_reply_store_forgets_runs_older_than_its_window_and_only_those(tmp_path):
    """``ReplyStore.prune``: a run's folder goes once its newest reply is older than keep_days;
    a newer run, the run being written and a store kept forever (0) stay."""
    import os
    import time

    from fedsyn_client.replies import ReplyStore

    def store(keep_days):
        return ReplyStore(tmp_path / f"replies-{keep_days}", keep_days)

    for keep in (0.0, 30.0):
        s = store(keep)
        for key in ("a", "b", "c"):
            s.put(key, "vote", 1, "d", np.zeros(3), {"epsilon": 1.0})
        now = time.time()
        for key, age in (("a", 40), ("b", 10)):
            for f in [s.root / key, *(s.root / key).iterdir()]:
                os.utime(f, (now - age * 86400, now - age * 86400))
        # "c" is the run being written: kept whatever its age
        old_c = now - 90 * 86400
        for f in [s.root / "c", *(s.root / "c").iterdir()]:
            os.utime(f, (old_c, old_c))
        gone = s.prune(now, keep=s.root / "c")
        left = sorted(p.name for p in s.root.iterdir())
        if keep:
            assert gone == ["a"] and left == ["b", "c"]
            assert s.get("a", "vote", 1, "d") is None and s.get("b", "vote", 1, "d") is not None
        else:
            assert gone == [] and left == ["a", "b", "c"]


# ------------------------------------------------------------- issue 45: the node's public size and length
@pytest.mark.parametrize("message_type,tier", [(R.MSG_TRAIN, "strong"), (R.MSG_VOTE, "weak"), (R.MSG_TIER, "weak")])
def test_a_max_length_above_the_nodes_cap_is_refused_before_anything_is_spent(data, tmp_path, message_type, tier):
    """The server moves a round's memory and time with max-length: the node caps it (node-config
    max-length), and a request above the cap is refused with a fixed text before any reservation."""
    state = tmp_path / "state"
    node = _node(data, state, _rc(data, **{"max-length": 64}), run_id=1, tier=tier, **{"max-length": 32})
    set_task_identity()
    content = RecordDict({R.CONFIG: ConfigRecord({"codes": VOCAB, "delta": 1e-5, "server-round": 1}),
                          R.ARRAYS: ArrayRecord()})
    reply = node(Message(content=content, message_type=message_type, dst_node_id=5))
    assert reply.error.code == ERR_POLICY and reply.error.reason == "refused: policy: max-length above the node's cap"
    assert not (state / "ledger.json").exists() or _spent(state) == 0.0


def test_max_records_is_required_and_the_view_is_chosen_once_per_record(tmp_path):
    from fedsyn_client.node import check_node, open_node
    from fedsyn_client.policy import PolicyError, policy_from_node_config
    from fedsyn_client.view import bounded, view_seed

    data = _csv(tmp_path / "many.csv", n=60)
    with pytest.raises(PolicyError, match="max-records is missing"):
        policy_from_node_config({"tier": "weak", "data-path": data, "epsilon": 3.0})
    config = {"tier": "weak", "data-path": data, "epsilon": 3.0, "state-dir": str(tmp_path / "s"), "max-records": 25}
    assert "the file holds 60, of which each release uses the same" in check_node(config)
    policy = policy_from_node_config(config)
    node = open_node(policy, RunConfig(dataset=data))
    assert 0 < len(node.data) <= 25 and node.bound == 25
    rows = pd.read_csv(data)
    assert set(node.data.texts) <= set(rows["text"])
    seed = view_seed(tmp_path / "s")
    assert seed == view_seed(tmp_path / "s")  # kept in the node's state: the same view run after run
    again = bounded(node.data.__class__(list(rows["text"]), [f"topic={t}" for t in rows["topic"]]), 25, seed)
    assert again.texts == node.data.texts
    other = bounded(again.__class__(list(rows["text"]), [f"topic={t}" for t in rows["topic"]]), 25, seed + 1)
    assert other.texts != node.data.texts  # another node's secret, another view
    assert ((tmp_path / "s" / "view-seed").stat().st_mode & 0o777) == 0o600


@pytest.mark.parametrize("message_type,tier,over,rule", [
    (R.MSG_TRAIN, "strong", {"model": "smollm2-135m"}, "model not allowed"),
    (R.MSG_VOTE, "weak", {"embedder": "sentence-transformers/all-MiniLM-L6-v2"}, "embedder not allowed"),
])
def test_a_model_or_embedder_outside_the_nodes_pins_is_refused_before_anything_is_spent(data, tmp_path, message_type,
                                                                                      tier, over, rule):
    """Issue 21 in process: the institution pins what it runs (node-config model / embedder); a run
    asking for another is refused with a fixed text before the ledger opens."""
    state = tmp_path / "state"
    pins = {"model": "tiny-gpt2", "embedder": "all-MiniLM-L6-v2"}
    node = _node(data, state, _rc(data, **over), run_id=1, tier=tier, **pins)
    set_task_identity()
    content = RecordDict({R.CONFIG: ConfigRecord({"codes": VOCAB, "delta": 1e-5, "server-round": 1}),
                          R.ARRAYS: ArrayRecord()})
    reply = node(Message(content=content, message_type=message_type, dst_node_id=5))
    assert (reply.error.code, reply.error.reason) == (ERR_POLICY, f"refused: policy: {rule}")
    assert not (state / "ledger.json").exists() or _spent(state) == 0.0
