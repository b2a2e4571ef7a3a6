"""Issue 31, rule by rule: after a request is authorised, whether it releases or fails depends only
on public inputs and faults, never on the records; what a node holds or replays is bound to what
was computed. (The property over generated request sequences is ``tests/test_neighbours.py``.)"""

from __future__ import annotations

import pytest

from common import records as R
from fedsyn_client import claims
from fedsyn_client.ledger import PrivacyLedger
from tests.neighbours import BUDGET, CODES, Step, play, write_pair

X, Y, Z = CODES


def _conf(codes, key="a", rnd=1, **extra) -> tuple:
    return tuple(sorted({"codes": list(codes), "resume-key": key, "server-round": rnd, "delta": 1e-5, **extra}.items()))


def _vote(rnd: int, share: float, **rc) -> Step:
    return Step(R.MSG_VOTE, rc=tuple(rc.items()), tier="weak", candidates=(("a text about x", X), ("z z z", Z)),
                conf=_conf((X, Y, Z), rnd=rnd, histogram="nearest-neighbour", **{"epsilon-share": share}))


@pytest.fixture
def pair(tmp_path):
    return write_pair(tmp_path, "y")


def test_a_later_training_round_under_other_data_terms_is_refused_before_the_records(pair, tmp_path, monkeypatch):
    """Round 1 fixes the view; round 2 asking another vocabulary or max-length is refused with the
    fixed text, charged nothing, and the records are not read for it."""
    from fedsyn_client import node as node_module

    first = Step(R.MSG_TRAIN, conf=_conf((X,)))
    for other in (Step(R.MSG_TRAIN, conf=_conf((Y,), rnd=2)),
                  Step(R.MSG_TRAIN, rc=(("max-length", 24),), conf=_conf((X,), rnd=2))):
        state = tmp_path / f"s-{len(other.rc)}"
        play([first], pair[0], state)
        reads = []
        original = node_module.Node.records
        monkeypatch.setattr(node_module.Node, "records", lambda self, v: reads.append(v) or original(self, v))
        (seen,) = play([other], pair[0], state)
        monkeypatch.setattr(node_module.Node, "records", original)
        assert seen.error == (R.ERR_BUDGET, "refused: budget: reservation bound to other terms")
        # round 1's charge only: a strong node's epsilon but its profile's (1.0), halved for its votes (voters = "all")
        assert reads == [] and PrivacyLedger(state / "ledger.json").spent() == pytest.approx((BUDGET - 1.0) / 2)


def test_q_and_the_noise_multiplier_are_the_first_rounds(pair, tmp_path):
    state = tmp_path / "s"
    seen = play([Step(R.MSG_TRAIN, conf=_conf((X, Y, Z))), Step(R.MSG_TRAIN, conf=_conf((X, Y, Z), rnd=2))],
                pair[0], state)
    assert [o.kind for o in seen] == ["release", "release"]
    stored = PrivacyLedger(state / "ledger.json").accountant_state("run-a")
    # Opacus' accountant merges steps of the same (noise multiplier, q): two rounds, one entry
    assert stored["history"] == [[stored["noise_multiplier"], stored["sample_rate"], 4]]
    assert stored["sample_rate"] == pytest.approx(4 / 100)  # B / max-records: public, whatever the file holds


def test_an_epsilon_the_accountant_cannot_reach_is_refused_before_the_reservation(pair, tmp_path):
    state = tmp_path / "s"
    (seen,) = play([Step(R.MSG_TRAIN, rc=(("epsilon", 1.0 + 1e-7), ("epsilon-profile", 1.0)), conf=_conf((X,)))],
                   pair[0], state)
    assert seen.error == (R.ERR_CONFIG, "request: invalid (see the node's log)")
    assert not (state / "ledger.json").exists() or PrivacyLedger(state / "ledger.json").spent() == 0.0


def test_vote_rounds_share_one_split_per_run(pair, tmp_path):
    seen = play([_vote(1, 0.5), _vote(2, 0.25), _vote(2, 0.5), _vote(3, 0.5)], pair[0], tmp_path / "s")
    assert [o.kind for o in seen] == ["release", "error", "release", "error"]
    assert seen[1].error == (R.ERR_BUDGET, "refused: budget: reservation bound to other terms")
    assert seen[3].error[0] == R.ERR_BUDGET  # two halves: the vote's share of the budget is spent


def test_a_changed_run_config_term_is_another_request(pair, tmp_path):
    """The stored reply of a vote is replayed for the same request only: the same message under
    another run-config term its computation reads (the seed) is not the request that reply answered.
    (Another embedder window never reaches the ledger: the node's policy pins it, issue 75.)"""
    state = tmp_path / "s"
    first, again, other, window = play([_vote(1, 1.0), _vote(1, 1.0), _vote(1, 1.0, seed=7),
                                        _vote(1, 1.0, **{"max-length": 24})], pair[0], state)
    assert first.kind == again.kind == "release" and first.structure == again.structure
    assert other.error == (R.ERR_BUDGET, "refused: budget: released before for another request")
    assert window.error == (R.ERR_POLICY, "refused: policy: vote window not the node's")


def test_an_empty_data_file_is_served_and_node_check_tells_the_operator(tmp_path, capsys):
    from fedsyn_server.cli import main

    empty = tmp_path / "empty.csv"
    empty.write_text("text,topic,size\n")
    seen = play([Step(R.MSG_PROFILE, conf=_conf((X, Y, Z), rnd=0), tier="weak"), _vote(1, 1.0)], str(empty),
                tmp_path / "s")
    assert [o.kind for o in seen] == ["release", "release"]
    config = f'tier="weak" data-path="{empty}" max-records=100 state-dir="{tmp_path / "s2"}" epsilon=8'
    assert main(["node-check", "--node-config", config]) == 1
    assert "no records" in capsys.readouterr().err


def test_an_embedder_that_cannot_load_is_refused_before_the_reservation(pair, tmp_path):
    state = tmp_path / "s"
    step = Step(R.MSG_VOTE, rc=(("embedder", "/nonexistent/embedder"),), tier="weak", candidates=(("a", X),),
                conf=_conf((X,), histogram="knn-vote", **{"num-votes": 1}))
    from tests import neighbours

    original = neighbours._send

    def with_policy(step_, data, state_, arrays, table):  # the node allows that embedder; it is not installed
        from flwr.app import ConfigRecord, Message, RecordDict

        import fedsyn_client.client_app as ca
        from tests.fakes import client_node, set_task_identity

        rc = {**neighbours.base_run_config(data), **dict(step_.rc)}
        config = {"tier": "weak", "data-path": data, "max-records": 100, "state-dir": str(state_), "epsilon": BUDGET,
                  "embedder": "/nonexistent/embedder", "vote-window": 32}  # the harness's max-length 16
        node = client_node(ca.app, 5, config, rc, run_id=1)
        set_task_identity()
        content = RecordDict({R.CONFIG: ConfigRecord(dict(step_.conf)),
                              R.CANDIDATES: ConfigRecord({"texts": ["a"], "codes": [X]})})
        return node(Message(content=content, message_type=step_.message, dst_node_id=5))

    neighbours._send = with_policy
    try:
        (seen,) = play([step], pair[0], state)
    finally:
        neighbours._send = original
    assert seen.error == (R.ERR_CONFIG, "node: not ready (see the node's log)")
    assert PrivacyLedger(state / "ledger.json").spent() == 0.0


def test_tier_queries_under_fresh_keys_hold_one_run_at_most(tmp_path):
    led = PrivacyLedger.open(tmp_path, budget=16.0)
    assert led.hold("spam-1", 8.0, "t").shortfall == 0.0
    assert led.hold("spam-2", 8.0, "t").shortfall == 0.0  # it fits, but another unconfirmed hold lives
    assert led.remaining("honest") == 8.0 and led.hold("honest", 8.0, "h").shortfall == 0.0
    assert set(led.summary()["holds"]) == {"spam-1"}
    assert PrivacyLedger.open(tmp_path / "two", budget=16.0).hold("a", 8.0, max_unconfirmed=2).shortfall == 0.0


def test_a_takeover_fails_closed_when_the_holder_cannot_be_seen(monkeypatch):
    entry = {"claim": claims.claim("D")}
    assert not claims.cut_off(entry, "D")  # this process: alive
    entry["claim"]["pid"] = 2 ** 22 + 12345  # no such PID: gone
    monkeypatch.setattr(claims.os, "kill", lambda pid, sig: (_ for _ in ()).throw(ProcessLookupError()))
    assert claims.cut_off(entry, "D")
    for hidden in (PermissionError, OSError):  # another user's process; /proc unreadable
        def kill(pid, sig, err=hidden):
            if err is OSError:
                raise OSError("unreadable")
        monkeypatch.setattr(claims.os, "kill", kill)
        monkeypatch.setattr(claims.Path, "read_text", lambda self: (_ for _ in ()).throw(PermissionError()))
        assert claims.process_start(entry["claim"]["pid"]) is None and not claims.cut_off(entry, "D")


def test_the_audit_folder_is_checked_first_and_a_failing_write_is_a_fixed_text(pair, tmp_path, monkeypatch):
    from fedsyn_client import audit

    blocked = tmp_path / "audit"
    blocked.write_text("a file where the folder should be")
    monkeypatch.setenv("FEDSYN_AUDIT_DIR", str(blocked))
    profile = Step(R.MSG_PROFILE, conf=_conf((X,), rnd=0), tier="weak")
    (seen,) = play([profile], pair[0], tmp_path / "s")
    # refused as a node fact before authorisation (nothing spent); the refusal itself cannot be audited
    # either, so the mod withholds it too: every reply leaves audited, or as the fixed failure text
    assert seen.error == (R.ERR_INTERNAL, "failed on the node (see the node's log); a reserved release stays spent")
    assert not (tmp_path / "s" / "ledger.json").exists()
    # a write that fails after the release (a full disk): the reply is withheld, the release stays charged
    monkeypatch.setenv("FEDSYN_AUDIT_DIR", str(tmp_path / "audit-ok"))
    monkeypatch.setattr(audit, "jsonl_line", lambda obj: (_ for _ in ()).throw(OSError(28, "No space left", "/x")))
    (seen,) = play([profile], pair[0], tmp_path / "s2")
    assert seen.error == (R.ERR_INTERNAL, "failed on the node (see the node's log); a reserved release stays spent")
    # pld: its PLD epsilon
    assert PrivacyLedger(tmp_path / "s2" / "ledger.json").spent() == pytest.approx(1.0, abs=1e-3)
