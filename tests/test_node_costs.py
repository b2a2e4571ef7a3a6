"""Issue 75: the server may not set a deployed node's costs.

Through the real ClientApp in-process: a vote is computed under the one window and precision the
node's operator pins (node-config ``vote-window``, ``vote-precision``), so the server cannot make the
node build and keep a records' matrix per ``max-length`` (finding 1: 121 values, 153.6 MB and about
35 minutes each at 100,000 records); a request under other terms, or with more candidates than
``max-candidates``, is refused before any work (no matrix built, nothing reserved). State of other
terms (views of the node's file under an earlier node config, matrices at another window) is removed
when it is superseded, and another node's state in the same folder is left alone.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pandas as pd
import pytest
from flwr.app import ConfigRecord, Message, RecordDict

from common import records as R
from common.config import RunConfig
from common.records import ERR_POLICY
from fedsyn_client import node as node_module, policy as policy_module
from fedsyn_client.client_app import app
from fedsyn_client.ledger import PrivacyLedger
from fedsyn_client.policy import PolicyError, computing_alike, policy_from_node_config
from tests.fakes import client_node, set_task_identity

VOCAB = ["topic=x", "topic=y"]
BUDGET = 3.0


def _csv(path: Path, n: int = 20) -> str:
    rows = [{"text": f"record {i} of {path.stem} about {'xy'[i % 2]}", "topic": "xy"[i % 2]} for i in range(n)]
    pd.DataFrame(rows).to_csv(path, index=False)
    return str(path)


def _rc(data: str, max_length: int = 16, **over) -> dict:
    base = RunConfig(model="tiny-gpt2", dataset=data, test_fraction=0.0, epsilon=BUDGET, num_server_rounds=1,
                     local_steps=1, batch_size=4, max_length=max_length, voters="weak").to_flower()
    base.update(over)
    return base


def _fresh() -> None:
    """What a new ClientApp process would see: no cached policy or node."""
    node_module._policy.cache_clear()
    node_module._open.cache_clear()


def _vote(data: str, state: Path, rc: dict, candidates: int = 4, run_id: int = 1, **nc) -> Message:
    texts = [f"a candidate about {'xy'[i % 2]} number {i}" for i in range(candidates)]
    return _vote_with(data, state, ConfigRecord({"texts": texts, "codes": [VOCAB[i % 2] for i in range(candidates)]}),
                      rc, run_id, **nc)


def _vote_with(data: str, state: Path, candidates: ConfigRecord, rc: dict, run_id: int = 1, **nc) -> Message:
    """A vote request carrying ``candidates`` to a weak node of ``data`` with node config ``nc``."""
    _fresh()
    config = {"tier": "weak", "data-path": data, "max-records": 30, "state-dir": str(state), "epsilon": BUDGET, **nc}
    node = client_node(app, 5, config, rc, run_id=run_id)
    set_task_identity()
    content = RecordDict({
        R.CONFIG: ConfigRecord({"codes": VOCAB, "delta": 1e-5, "server-round": 1, "epsilon-share": 0.1,
                                "num-votes": 2}),
        R.CANDIDATES: candidates})
    return node(Message(content=content, message_type=R.MSG_VOTE, dst_node_id=5))


def _spent(state: Path) -> float:
    return PrivacyLedger.open(state, budget=BUDGET).spent() if (state / "ledger.json").exists() else 0.0


def test_a_vote_under_another_window_is_refused_before_any_matrix_is_built(tmp_path):
    data, state = _csv(tmp_path / "d.csv"), tmp_path / "state"
    # the default pin (what node-check builds: 2 x the default max-length) against a run at max-length 16
    refused = _vote(data, state, _rc(data, 16))
    assert refused.error.code == ERR_POLICY and refused.error.reason == "refused: policy: vote window not the node's"
    assert not list(state.glob("emb-*.bin")) and _spent(state) == 0.0
    # every max-length the server might walk through: refused alike, nothing kept (finding 1 built one each)
    for max_length in (8, 24, 40, 128):
        again = _vote(data, state, _rc(data, max_length, **{"max-length": max_length}))
        assert again.error.reason == "refused: policy: vote window not the node's", max_length
    assert not list(state.glob("emb-*.bin")) and _spent(state) == 0.0
    # the operator pins the run's window: served, one matrix
    served = _vote(data, state, _rc(data, 16), **{"vote-window": 32})
    assert not served.has_error(), served.error.reason if served.has_error() else ""
    assert len(list(state.glob("emb-*.bin"))) == 1 and 0 < _spent(state) <= BUDGET
    # the tier query says so first, before a run spends anything
    _fresh()
    node = client_node(app, 5, {"tier": "weak", "data-path": data, "max-records": 30, "state-dir": str(state),
                                "epsilon": BUDGET}, _rc(data, 16), run_id=2)
    set_task_identity()
    tier = node(Message(content=RecordDict({R.CONFIG: ConfigRecord({"codes": VOCAB})}), message_type=R.MSG_TIER,
                        dst_node_id=5))
    assert tier.error.reason == "refused: policy: vote window not the node's"


def test_a_vote_at_a_precision_computing_otherwise_is_refused(tmp_path, monkeypatch):
    data, state = _csv(tmp_path / "d.csv"), tmp_path / "state"
    # on a CPU without native bf16 auto is fp32: either reads the same matrix, so both are served
    monkeypatch.setattr("common.devices.native_bf16", lambda device: False)
    assert computing_alike("auto") == computing_alike("fp32") == ("auto", "fp32")
    monkeypatch.setattr("common.devices.native_bf16", lambda device: True)  # hardware where auto is bf16
    assert computing_alike("auto") == ("auto",) and computing_alike("fp32") == ("fp32",)
    refused = _vote(data, state, _rc(data, 16, precision="fp32"), **{"vote-window": 32})
    assert refused.error.reason == "refused: policy: vote precision not the node's"
    assert not list(state.glob("emb-*.bin")) and _spent(state) == 0.0


def test_a_vote_with_more_candidates_than_the_cap_is_refused_before_any_work(tmp_path, monkeypatch):
    data, state = _csv(tmp_path / "d.csv"), tmp_path / "state"
    embedded: list[int] = []
    real = node_module.embed_slots
    monkeypatch.setattr(node_module, "embed_slots", lambda *a, **k: embedded.append(1) or real(*a, **k))
    pinned = {"vote-window": 32, "max-candidates": 6}
    refused = _vote(data, state, _rc(data, 16), candidates=7, **pinned)
    assert refused.error.code == ERR_POLICY
    assert refused.error.reason == "refused: policy: candidates above the node's cap"
    assert not embedded and not list(state.glob("emb-*.bin")) and _spent(state) == 0.0
    assert not _vote(data, state, _rc(data, 16), candidates=6, **pinned).has_error()
    assert embedded == [1]
    assert policy_from_node_config({"tier": "weak", "data-path": data, "epsilon": 1, "max-records": 5}
                                   ).max_candidates == policy_module.DEFAULT_MAX_CANDIDATES


def test_the_vote_terms_are_checked_when_the_node_starts():
    base = {"tier": "weak", "data-path": "d.csv", "epsilon": 1, "max-records": 5}
    assert policy_from_node_config(base).vote_windows == (policy_module.DEFAULT_VOTE_WINDOW,)
    assert policy_from_node_config({**base, "max-length": 16}).vote_windows == (32,)  # never above the cap's window
    for bad, said in (({"vote-window": 33}, "even integer"), ({"vote-window": 8}, "even integer"),
                      ({"max-length": 16, "vote-window": 64}, "above 2 x max-length"),
                      ({"vote-precision": "bf16"}, "vote-precision"), ({"max-candidates": 0}, "max-candidates")):
        with pytest.raises(PolicyError, match=said):
            policy_from_node_config({**base, **bad})


def test_state_of_other_terms_is_removed_when_superseded_and_another_nodes_is_kept(tmp_path):
    data, state = _csv(tmp_path / "d.csv"), tmp_path / "state"
    other = _csv(tmp_path / "other.csv")  # another node's file, sharing the state folder (its own ledger)
    assert not _vote(other, state, _rc(other, 16), **{"vote-window": 32, "ledger-id": "other"}).has_error()
    theirs = set(state.glob("*-*.bin"))
    assert len(theirs) == 2  # its view and its matrix
    assert not _vote(data, state, _rc(data, 16), **{"vote-window": 32}).has_error()
    first = set(state.glob("*-*.bin")) - theirs
    assert len(first) == 2
    # the operator pins another window (and the cap it needs): the old matrix goes, the view stays
    assert not _vote(data, state, _rc(data, 24, **{"max-length": 24}), run_id=2, **{"vote-window": 48}).has_error()
    second = set(state.glob("*-*.bin")) - theirs
    assert len(second) == 2 and [p for p in first if p.name.startswith("view-")][0] in second
    assert not (first & second) - {p for p in first if p.name.startswith("view-")}
    # another max-records: a new view of the same file; the old one and its matrix go
    assert not _vote(data, state, _rc(data, 24, **{"max-length": 24}), run_id=3,
                     **{"vote-window": 48, "max-records": 40}).has_error()
    third = set(state.glob("*-*.bin")) - theirs
    assert len(third) == 2 and not third & second
    assert theirs <= set(state.glob("*-*.bin"))  # the other node's view and matrix were never touched
    # the ledger, its seed and the stored replies are not state of other terms
    assert (state / "ledger.json").exists() and (state / "ledger-other.json").exists()


def _ask(data: str, state: Path, rc: dict, message_type: str, tier: str = "weak", conf: dict | None = None,
         arrays: Any = None, **nc) -> Message:
    from flwr.app import ArrayRecord

    _fresh()
    config = {"tier": tier, "data-path": data, "max-records": 30, "state-dir": str(state), "epsilon": BUDGET,
              "vote-window": 32, **nc}
    node = client_node(app, 5, config, rc, run_id=1)
    set_task_identity()
    content = RecordDict({R.CONFIG: ConfigRecord({"codes": VOCAB, "delta": 1e-5, "server-round": 1, **(conf or {})}),
                          R.ARRAYS: ArrayRecord() if arrays is None else arrays})
    return node(Message(content=content, message_type=message_type, dst_node_id=5))


@pytest.mark.parametrize("run_key,value,node_key,rule", [
    ("local-steps", 9, "max-local-steps", "local-steps above the node's cap"),
    ("batch-size", 9, "max-batch-size", "batch-size above the node's cap"),
    ("num-server-rounds", 9, "max-rounds", "rounds above the node's cap"),
])
def test_dp_sgd_work_above_the_policys_caps_is_refused_before_anything_is_reserved(tmp_path, run_key, value,
                                                                                     node_key, rule):
    data, state = _csv(tmp_path / "d.csv"), tmp_path / "state"
    rc = _rc(data, 16, **{run_key: value})
    for kind in (R.MSG_TIER, R.MSG_TRAIN):  # the tier query says it first; a training round alone too
        reply = _ask(data, state, rc, kind, tier="strong", **{node_key: value - 1})
        assert reply.error.code == ERR_POLICY and reply.error.reason == f"refused: policy: {rule}", kind
    assert _spent(state) == 0.0
    # at the cap the same request passes the policy (the tier query answers)
    assert not _ask(data, state, rc, R.MSG_TIER, tier="strong", **{node_key: value}).has_error()


def test_a_round_below_one_over_max_rounds_of_its_phase_is_refused(tmp_path):
    """A phase's rounds split its budget by epsilon-share: the share's floor 1/max-rounds bounds how many
    rounds of a vote's work one run can ask, however small the server makes each."""
    data, state = _csv(tmp_path / "d.csv"), tmp_path / "state"
    for share, refused in ((0.25, True), (1 / 3, False)):
        reply = _ask(data, state, _rc(data, 16), R.MSG_PROFILE, conf={"epsilon-share": share}, **{"max-rounds": 3})
        assert reply.has_error() is refused, share
        if refused:
            assert reply.error.reason == "refused: policy: rounds above the node's cap"
            assert _spent(state) == 0.0
    assert 0 < _spent(state) <= BUDGET


def test_a_vote_at_the_candidate_cap_embeds_at_most_the_cap_of_window_sized_texts(tmp_path, monkeypatch):
    """The work of a vote at its caps: however long the server makes each candidate (a megabyte here),
    the node tokenizes at most ``max-candidates`` texts of the pinned window's bytes; a tokenizer reads
    a whole text before it truncates, so uncut candidates were the server's to size (failed before)."""
    from common import models
    from fedsyn_client import fixed_work, histograms

    data, state = _csv(tmp_path / "d.csv"), tmp_path / "state"
    seen: list[tuple[int, int]] = []  # (texts, longest in bytes) of each call embedding the candidates
    real = models.embed

    def embed(embedder, texts, *a, **kw):
        if not kw.get("fixed_width"):  # the records' matrix is built at fixed width (its own bound)
            seen.append((len(texts), max(len(t.encode("utf-8")) for t in texts)))
        return real(embedder, texts, *a, **kw)

    monkeypatch.setattr(models, "embed", embed)
    histograms._CANDIDATES.clear()
    huge = ConfigRecord({"texts": ["x y " * 250_000] * 6, "codes": [VOCAB[i % 2] for i in range(6)]})
    reply = _vote_with(data, state, huge, _rc(data, 16), **{"vote-window": 32, "max-candidates": 6})
    assert not reply.has_error(), reply.error
    assert seen and all(n <= 6 and longest <= fixed_work.row_bytes(32) for n, longest in seen), seen


def test_a_training_round_at_the_step_cap_does_that_many_steps_in_bounded_passes(tmp_path, monkeypatch):
    """The work of a training round at its caps: ``max-local-steps`` DP-SGD steps, not one more, each
    run in passes of at most ``TOKENS_PER_PASS`` tokens however large the Poisson batch (the batch is
    the server's ``batch-size`` up to ``max-batch-size``, on a bound of ``max-records`` slots)."""
    from fedsyn_client import training
    from fedsyn_server.synthesis import ServerModel

    data, state = _csv(tmp_path / "d.csv"), tmp_path / "state"
    steps: list[int] = []
    widths: list[int] = []
    real_step, real_loss = training._private_step, training._loss
    monkeypatch.setattr(training, "_private_step", lambda *a, **k: steps.append(1) or real_step(*a, **k))
    monkeypatch.setattr(training, "_loss",
                        lambda gsm, part, *a, **k: widths.append(int(part[0].numel())) or real_loss(gsm, part, *a, **k))
    rc = _rc(data, 16, **{"local-steps": 3, "batch-size": 30})
    arrays = ServerModel(RunConfig.from_flower(rc)).initial_arrays()
    reply = _ask(data, state, rc, R.MSG_TRAIN, tier="strong", conf={"epsilon-share": 1.0},
                 **{"max-local-steps": 3, "max-batch-size": 30}, arrays=arrays)
    assert not reply.has_error(), reply.error
    assert len(steps) == 3
    assert widths and max(widths) <= training.TOKENS_PER_PASS
