"""The strategy's phase flow over a fake Grid, with the real ClientApp handlers as nodes."""

from __future__ import annotations

import math

import numpy as np
import pytest
from flwr.app import Error, Message

from common import records as R
from common.config import RunConfig
from fedsyn_client.client_app import app as client_app
from fedsyn_server.server_app import build_strategy
from strategies.resampling import sample_size
from tests.fakes import FakeGrid, client_node, set_task_identity, write_topic_csv

TOPICS = {
    "sport": "The striker scored twice as the team won the league match at the stadium",
    "tech": "The new smartphone chip runs software faster and the laptop battery lasts longer",
    "politics": "The minister told parliament the government will hold an election vote",
}


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> str:
    return write_topic_csv(tmp_path_factory.mktemp("data") / "news.csv", TOPICS, 30)


def run_config(dataset: str, **over) -> dict:
    cfg = RunConfig(model="tiny-gpt2", dataset=dataset, num_server_rounds=2, local_steps=2, batch_size=4,
                    max_length=32, num_synthetic=24, max_new_tokens=8, strong_fraction=0.34,
                    num_votes=2, test_fraction=0.1).to_flower()
    cfg.update(over)
    return cfg


def nodes_for(rc: dict, n: int, state_dir=None, run_id: int = 7) -> dict:
    out = {}
    for pid in range(n):
        nc = {"partition-id": pid, "num-partitions": n}
        if state_dir is not None:
            nc["state-dir"] = str(state_dir / f"node{pid}")
        out[100 + pid] = client_node(client_app, 100 + pid, nc, rc, run_id=run_id)
    return out


def run(rc: dict, nodes: dict):
    set_task_identity()
    strategy, bench, server_model = build_strategy(RunConfig.from_flower(rc))
    strategy.stable_seconds = 0.0
    grid = FakeGrid(nodes)
    return strategy.run(grid, server_model.initial_arrays()), grid, bench


def test_full_flow_with_real_node_handlers(dataset, tmp_path):
    rc = run_config(dataset)
    res, grid, bench = run(rc, nodes_for(rc, 3, tmp_path))
    assert res.tiers == {100: "strong", 101: "weak", 102: "weak"}
    assert not res.failures
    # phase 1 went to the strong node only, R times
    trains = [m for m in grid.sent if m.metadata.message_type == R.MSG_TRAIN]
    assert [m.metadata.dst_node_id for m in trains] == [100, 100]
    assert sorted(res.train_metrics) == [1, 2] and sorted(res.eval_metrics) == [0, 1, 2]
    # profile from all, votes from weak nodes only
    assert sorted(res.node_profiles) == [100, 101, 102] and sorted(res.node_votes) == [101, 102]
    # the pool follows the allocation, the final set is A.4's size per code
    assert len(res.pool_texts) == sum(res.allocation.values())
    for code, n in res.allocation.items():
        assert res.pool_codes.count(code) == n
        assert [res.pool_codes[i] for i in res.selected].count(code) == sample_size(n, 0.5)
    assert len(res.votes) == len(res.pool_texts)
    # every node stayed within budget; the strong node's DP-SGD epsilon came from the accountant
    for nid, rels in res.releases.items():
        spent = sum(float(r["epsilon"]) for r in rels)
        assert spent <= 8.0 + 1e-6
        phases = [r["phase"] for r in rels]
        assert phases == (["train", "train", "profile"] if nid == 100 else ["profile", "vote"])
    train_eps = sum(float(r["epsilon"]) for r in res.releases[100] if r["phase"] == "train")
    assert 5.0 < train_eps <= 6.0 + 1e-6


def test_replies_carry_no_private_text(dataset, tmp_path):
    rc = run_config(dataset)
    res, grid, _ = run(rc, nodes_for(rc, 3, tmp_path))
    private = [f"{base} number {i}." for base in TOPICS.values() for i in range(30)]
    for reply in grid.replies:
        blob = repr(reply.content)
        assert not any(p in blob for p in private)
        assert set(reply.content.config_records) <= {R.TIER, R.RELEASE, R.LEDGER}
        if R.RELEASE in reply.content.config_records:  # nothing from which |D| follows
            assert not {"sample_rate", "noise_multiplier", "num_examples"} & set(reply.content.config_records[R.RELEASE])
        for key, rec in reply.content.metric_records.items():
            assert key in {R.METRICS, R.PROFILE, R.VOTES}
            if key == R.PROFILE:
                assert len(rec[key]) == 3 and any(v != int(v) for v in rec[key])  # noised floats


def test_failing_and_silent_nodes_do_not_stop_the_run(dataset, tmp_path):
    rc = run_config(dataset)
    nodes = nodes_for(rc, 3, tmp_path)
    nodes[900] = lambda m: Message(Error(1003, "boom"), reply_to=m)  # always errors
    nodes[901] = lambda m: None  # never answers
    res, _, _ = run(rc, nodes)
    failed = {(f["node_id"], f["phase"]) for f in res.failures}
    assert {(900, "tiers"), (901, "tiers")} <= failed
    assert len(res.selected) > 0 and sorted(res.tiers) == [100, 101, 102]


def test_second_run_on_spent_budget_is_refused_by_the_nodes(dataset, tmp_path):
    rc = run_config(dataset, **{"epsilon": 4.0, "epsilon-profile": 1.0})
    run(rc, nodes_for(rc, 3, tmp_path))
    set_task_identity()
    strategy, _, model = build_strategy(RunConfig.from_flower(rc))
    strategy.stable_seconds = 0.0
    with pytest.raises(RuntimeError, match="no node returned a profile"):
        strategy.run(FakeGrid(nodes_for(rc, 3, tmp_path, run_id=8)), model.initial_arrays())
    # every node refused on its own ledger, and said how much budget is left
    refusals = [f for f in strategy.result.failures if "refused" in f["reason"] and "left" in f["reason"]]
    assert {(f["node_id"], f["phase"]) for f in refusals} >= {(100, "train"), (100, "profile"), (101, "profile")}


@pytest.mark.parametrize("refinement", ["uniform", "none"])
def test_refinements_without_votes_send_no_vote_request(dataset, tmp_path, refinement):
    rc = run_config(dataset, refinement=refinement, **{"num-server-rounds": 0})
    res, grid, _ = run(rc, nodes_for(rc, 2, tmp_path))
    assert not [m for m in grid.sent if m.metadata.message_type in (R.MSG_VOTE, R.MSG_TRAIN)]
    assert res.votes is None
    if refinement == "none":
        assert len(res.selected) == len(res.pool_texts) == pytest.approx(12, abs=3)


def test_epsilon_inf_adds_no_noise_and_says_so(dataset, tmp_path):
    rc = run_config(dataset, epsilon="inf", **{"num-server-rounds": 1})
    res, _, _ = run(rc, nodes_for(rc, 2, tmp_path))
    prof = np.asarray(res.node_profiles[101])
    assert np.array_equal(prof, np.round(prof))  # exact counts: no noise
    assert all(math.isinf(float(r["epsilon"])) for rels in res.releases.values() for r in rels)


def test_zero_shot_baseline_skips_phase_1_and_prompts_with_an_instruction(dataset, tmp_path):
    from common.codes import zero_shot_prompt

    rc = run_config(dataset, prompt="zero-shot")
    res, grid, _ = run(rc, nodes_for(rc, 3, tmp_path))
    assert not [m for m in grid.sent if m.metadata.message_type == R.MSG_TRAIN]
    assert not res.train_metrics and res.votes is not None
    assert zero_shot_prompt("topic=sport|stars=4", "Write about {fields}:\n") == "Write about topic: sport, stars: 4:\n"


def test_a_malformed_profile_reply_is_a_node_failure(dataset, tmp_path):
    from flwr.app import ConfigRecord as CR

    rc = run_config(dataset, **{"num-server-rounds": 0})
    nodes = nodes_for(rc, 2, tmp_path)
    real = nodes[101]

    def liar(m):  # a node whose profile has the wrong length
        if m.metadata.message_type == R.MSG_PROFILE:
            return Message(R.vector_reply(R.PROFILE, np.ones(7), CR({"phase": "profile"})), reply_to=m)
        return real(m)

    nodes[101] = liar
    res, _, _ = run(rc, nodes)
    assert {(f["node_id"], f["phase"]) for f in res.failures} == {(101, "profile")}
    assert sorted(res.node_profiles) == [100] and len(res.selected) > 0
