"""The strategy's phase flow over a fake Grid, with the real ClientApp handlers as nodes."""

from __future__ import annotations

import json
import math
import shutil

import numpy as np
import pytest
from flwr.app import Error, Message

from common import records as R
from common.config import RunConfig
from fedsyn_client.client_app import app as client_app
from fedsyn_server.server_app import build_strategy
from strategies.membership import RunRefused
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
                    num_votes=2, test_fraction=0.1,
                    # the paper's tiers (strong nodes train, weak ones vote), which these tests were written
                    # on; the default "all" runs in test_pld_ledger, the voters="all" cases here and flwr_run;
                    # and the paper's accounting, whose charges are exactly each phase's epsilon (the
                    # default "pld" runs in test_pld_ledger, test_calibration, flwr_run and deployment)
                    voters="weak", accounting="basic").to_flower()
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
    strategy.session.stable_seconds = 0.0
    grid = FakeGrid(nodes)
    return strategy.start(grid, server_model.initial_arrays()), grid, bench


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
        assert [res.pool_codes[i] for i in res.selected].count(code) == sample_size(n, RunConfig().sampling_rate)
    assert len(res.votes) == len(res.pool_texts)
    # both writers wrote each code's pool (pretrained-share 0.5) and each kept text says which
    assert res.finetuned and res.pretrained_share == 0.5
    for code, n in res.allocation.items():
        written = [w for w, c in zip(res.pool_writers, res.pool_codes) if c == code]
        assert written == ["pretrained"] * ((n + 1) // 2) + ["finetuned"] * (n // 2)
    # every node stayed within budget; the strong node's DP-SGD epsilon came from the accountant
    for nid, rels in res.releases.items():
        spent = sum(float(r["epsilon"]) for r in rels)
        assert spent <= 8.0 + 1e-6
        phases = [r["phase"] for r in rels]
        assert phases == (["profile", "train", "train"] if nid == 100 else ["profile", "vote"])  # the profile first
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
            assert not ({"sample_rate", "noise_multiplier", "num_examples"}
                        & set(reply.content.config_records[R.RELEASE]))
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


def test_the_strategy_is_a_phase_loop_not_flowers_fl_loop(dataset):
    """Issue 62: ``start`` is the phase loop; Flower's ``Strategy.start`` (N rounds of train and a
    federated evaluation, an un-noised statistic) is not inherited, and no evaluation stub is left."""
    from flwr.serverapp.strategy import Strategy

    strategy, _, _ = build_strategy(RunConfig.from_flower(run_config(dataset)), load_model=False)
    assert not isinstance(strategy, Strategy) and not hasattr(strategy, "configure_evaluate")
    assert isinstance(strategy.text.aggregator, Strategy)  # phase 1 is still any Flower strategy's


def test_second_run_on_spent_budget_is_refused_up_front(dataset, tmp_path):
    rc = run_config(dataset, **{"epsilon": 4.0, "epsilon-profile": 1.0})
    run(rc, nodes_for(rc, 3, tmp_path))
    before = {n: json.loads((tmp_path / f"node{n}" / "ledger.json").read_text()) for n in range(3)}
    set_task_identity()
    strategy, _, model = build_strategy(RunConfig.from_flower(rc))
    strategy.session.stable_seconds = 0.0
    grid = FakeGrid(nodes_for(rc, 3, tmp_path, run_id=8))
    with pytest.raises(RunRefused) as refused:
        strategy.start(grid, model.initial_arrays())
    # the error names every node and its shortfall, and the way out
    for nid in (100, 101, 102):
        assert f"node {nid}: its ledger lacks epsilon = 4" in str(refused.value)
    assert "on-node-shortfall" in str(refused.value)
    # nothing but the pre-flight question was asked, and no ledger changed
    assert {m.metadata.message_type for m in grid.sent} == {R.MSG_TIER}
    assert all(json.loads((tmp_path / f"node{n}" / "ledger.json").read_text()) == before[n] for n in range(3))


def test_a_node_that_cannot_finish_stops_the_run_unless_the_run_goes_on_without_it(dataset, tmp_path):
    rc = run_config(dataset, **{"epsilon": 4.0, "epsilon-profile": 1.0})
    # node 101 (weak) took part in an earlier run on the same ledger; 100 and 102 are fresh
    run(rc, nodes_for(rc, 3, tmp_path / "before"))
    (tmp_path / "now" / "node1").mkdir(parents=True)
    shutil.copy(tmp_path / "before" / "node1" / "ledger.json", tmp_path / "now" / "node1" / "ledger.json")
    with pytest.raises(RunRefused, match=r"1 node\(s\) cannot finish it \(node 101: .*lacks epsilon = 4"):
        run(rc, nodes_for(rc, 3, tmp_path / "now", run_id=8))
    res, grid, _ = run({**rc, "on-node-shortfall": "continue-without"}, nodes_for(rc, 3, tmp_path / "now", run_id=9))
    assert sorted(res.tiers) == [100, 102] and len(res.selected) > 0
    assert not [m for m in grid.sent if m.metadata.dst_node_id == 101 and m.metadata.message_type != R.MSG_TIER]
    assert any("node 101 left out" in d for d in res.degradations)
    # node 102 was the only voter: its vote round is complete, so no other degradation
    assert len(res.degradations) == 1, res.degradations


@pytest.mark.parametrize("refinement", ["uniform", "none"])
def test_refinements_without_votes_send_no_vote_request(dataset, tmp_path, refinement):
    rc = run_config(dataset, refinement=refinement, **{"num-server-rounds": 0})
    res, grid, _ = run(rc, nodes_for(rc, 2, tmp_path))
    assert not [m for m in grid.sent if m.metadata.message_type in (R.MSG_VOTE, R.MSG_TRAIN)]
    assert res.votes is None
    assert set(res.pool_writers) == {"pretrained"} and not res.finetuned  # no phase 1: one writer, θ⁰
    if refinement == "none":
        assert len(res.selected) == len(res.pool_texts) == pytest.approx(24 * RunConfig().sampling_rate, abs=3)


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
    assert res.pool_writers == ["pretrained"] * len(res.pool_texts) and res.pretrained_share == 1.0
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


def test_failures_are_recorded_under_the_node_that_failed_and_its_lost_releases_counted(dataset, tmp_path):
    from fedsyn_server.privacy_report import privacy_report

    rc = run_config(dataset, **{"num-server-rounds": 1})
    nodes = nodes_for(rc, 4, tmp_path)  # 100 strong; 101, 102, 103 weak
    strong, weak, silent = nodes[100], nodes[101], nodes[103]

    def unavailable(m):  # Flower's own error reply: it comes from the SuperLink (node id 1)
        if m.metadata.message_type in (R.MSG_VOTE, R.MSG_LEDGER):
            reply = Message(Error(0, "Node Unavailable"), reply_to=m)
            reply.metadata.__dict__["_src_node_id"] = 1
            return reply
        return weak(m)

    def dies_in_training(m):  # releases its round, then the process dies before replying
        if m.metadata.message_type in (R.MSG_TRAIN, R.MSG_LEDGER):
            if m.metadata.message_type == R.MSG_TRAIN:
                strong(m)
            return None
        return strong(m)

    nodes[101], nodes[100] = unavailable, dies_in_training
    nodes[103] = lambda m: None if m.metadata.message_type in (R.MSG_VOTE, R.MSG_LEDGER) else silent(m)
    res, _, _ = run(rc, nodes)
    assert 1 not in {f["node_id"] for f in res.failures}
    assert {(f["node_id"], f["phase"]) for f in res.failures} == {
        (100, "train"), (100, "ledger"), (101, "vote"), (101, "ledger"), (103, "vote"), (103, "ledger")}
    report = {n["node_id"]: n for n in privacy_report(RunConfig.from_flower(rc), res)["nodes"]}
    # weak nodes profiled (stated), then voted or not: their vote is counted as spent, never 0
    for nid in (101, 103):
        node = report[nid]
        assert [(r["phase"], r.get("status")) for r in node["releases"]] == [
            ("profile", None), ("vote", "unknown, counted as spent")]
        # basic (issue 60): the profile's delta its share 2/8 of the policy's, the vote of unknown outcome counted whole
        assert node["epsilon_spent"] == pytest.approx(8.0) and node["delta"] == pytest.approx(1.25e-5)
    # the strong node's whole training epsilon is counted, and its profile it stated
    assert report[100]["epsilon_spent"] == pytest.approx(8.0)
    assert [r["phase"] for r in report[100]["releases"]] == ["profile", "train"]
    # and each phase that ran on fewer nodes than it asked is named
    assert any(d.startswith("phase 1 round 1: 0 of 1 nodes answered") for d in res.degradations)
    assert any(d.startswith("vote round 1: 1 of 3 nodes answered (missing: 101, 103)") for d in res.degradations)


def test_input_errors_end_the_run_with_one_line_that_names_the_problem(dataset, tmp_path):
    from flwr.app import Context, RecordDict

    from fedsyn_server import server_app

    set_task_identity()
    cases = {"epsilon": (-1.0, "ConfigError: invalid run config: epsilon = -1.0; allowed: a float > 0"),
             "dataset": (str(tmp_path / "nope.csv"), "FileNotFoundError: dataset file '" + str(tmp_path / "nope.csv"))}
    for key, (value, message) in cases.items():
        rc = {**run_config(dataset), key: value, "out-dir": str(tmp_path / "out")}
        ctx = Context(run_id=3, node_id=0, node_config={}, state=RecordDict(), run_config=rc)
        with pytest.raises(server_app.RunFailed) as err:
            server_app.main(FakeGrid({}), ctx)
        assert "\n" not in str(err.value) and err.value.__cause__ is None
        assert str(err.value).startswith(message), str(err.value)
    assert not (tmp_path / "out").exists()  # nothing was written


def test_a_planned_phase_that_no_node_answered_fails_the_run_after_writing_its_outputs(dataset, tmp_path):
    from flwr.app import Context, RecordDict

    from fedsyn_server import server_app

    rc = {**run_config(dataset, **{"num-server-rounds": 1}), "out-dir": str(tmp_path), "run-name": "r"}
    nodes = nodes_for(rc, 3, tmp_path / "state")
    strong = nodes[100]
    nodes[100] = lambda m: None if m.metadata.message_type == R.MSG_TRAIN else strong(m)  # trains never answered
    set_task_identity()
    ctx = Context(run_id=7, node_id=0, node_config={}, state=RecordDict(), run_config=rc)
    with pytest.raises(server_app.RunFailed, match="RunSkipped: a planned phase got no node at all: phase 1 skipped"):
        server_app.main(FakeGrid(nodes), ctx)
    metrics = json.loads((tmp_path / "r" / "metrics.json").read_text())
    assert metrics["degraded"] and metrics["skipped"] == [
        "phase 1 skipped: no strong node answered any round; generating with the pretrained model"]
    assert (tmp_path / "r" / "synthetic.jsonl").exists()  # what the run made is kept


def test_a_strong_node_killed_mid_round_rejoins_with_a_new_node_id_and_pays_nothing_twice(dataset, tmp_path):
    """SIGKILL after it released round 1 (reply lost); Flower gives the restarted SuperNode a new
    node id. It is admitted before round 2 (tier query), trains on, and the report counts its
    one ledger once, under both ids."""
    from fedsyn_client.ledger import PrivacyLedger
    from fedsyn_server.privacy_report import privacy_report

    rc = run_config(dataset, **{"num-server-rounds": 3})
    nodes = nodes_for(rc, 3, tmp_path)  # 100 strong; 101, 102 weak
    strong, dead = nodes[100], []

    def killed_in_round_1(m):
        if dead:
            return None
        if m.metadata.message_type == R.MSG_TRAIN:
            strong(m)  # the release is made and booked, then the process dies before replying
            dead.append(m)
            restarted = {"partition-id": 0, "num-partitions": 3, "state-dir": str(tmp_path / "node0")}
            nodes[200] = client_node(client_app, 200, restarted, rc)
            return None
        return strong(m)

    nodes[100] = killed_in_round_1
    res, grid, _ = run(rc, nodes)
    assert res.tiers[200] == "strong" and res.ledger_refs[200] == res.ledger_refs[100]
    trained = [m.metadata.dst_node_id for m in grid.sent if m.metadata.message_type == R.MSG_TRAIN]
    assert trained == [100, 200, 200], trained  # once its ledger answers under 200, the dead id is not asked
    assert sorted(res.train_metrics) == [2, 3]  # round 1 had no reply; rounds 2 and 3 aggregated the new id
    book = PrivacyLedger.open(tmp_path / "node0", 8.0).run_statements("7")
    assert [(r["phase"], r["round"], r["epsilon"] > 0) for r in book] == [
        ("profile", 0, True), ("train", 1, True), ("train", 2, False), ("train", 3, False)]
    report = privacy_report(RunConfig.from_flower(rc), res)["nodes"]
    entry = next(n for n in report if 200 in n["node_ids"])
    assert entry["node_ids"] == [100, 200] and entry["source"] == "node ledger"
    assert entry["epsilon_spent"] == pytest.approx(sum(r["epsilon"] for r in book))
    assert not [n for n in report if n["node_id"] == 100]  # not counted a second time from its replies
    assert [(f["node_id"], f["phase"]) for f in entry["failures"]] == [(100, "train")]
    assert any("phase 1 round 1: 0 of 1 nodes answered" in d for d in res.degradations)


def test_a_run_whose_votes_no_node_can_cast_is_refused_before_anything_is_spent(dataset, tmp_path):
    """Both weak nodes' data is unusable: the run would train and profile, then find no voter and
    fail. Stage 0 refuses it instead, and the strong node's hold for it is ended."""
    from fedsyn_client.ledger import PrivacyLedger

    rc = run_config(dataset, **{"num-server-rounds": 1, "voters": "weak"})

    def broken_weak_nodes(rc: dict, state) -> dict:
        nodes = nodes_for(rc, 3, state)  # 100 strong; 101, 102 weak
        for nid in (101, 102):
            nodes[nid] = lambda m: Message(Error(R.ERR_CONFIG, "data unavailable: data-path 'x.csv' cannot be used"),
                                           reply_to=m)
        return nodes

    with pytest.raises(RunRefused, match=r"the votes have no weak node .*node 101: error 1002: data unavailable"):
        run(rc, broken_weak_nodes(rc, tmp_path))
    ledger = PrivacyLedger.open(tmp_path / "node0", 8.0)
    assert ledger.spent() == 0.0 and ledger.held() == 0.0 and ledger.remaining() == 8.0
    rc_all = {**rc, "voters": "all"}  # the default: the strong node votes too, so the run goes on, degraded
    res, grid, _ = run(rc_all, broken_weak_nodes(rc_all, tmp_path / "all"))
    assert res.vote_rounds[0]["voters"] == [100] and not res.skipped and res.degradations
    assert set(res.pool_writers) == {"pretrained", "finetuned"}  # a voter judges: both writers


def test_non_finite_weights_from_a_node_or_an_aggregator_never_reach_the_global_model(dataset, tmp_path):
    rc = run_config(dataset, aggregator="tests.fakes.NanAggregate")
    nodes = nodes_for(rc, 3, tmp_path)
    res, grid, _ = run(rc, nodes)
    assert sum("non-finite weights" in d for d in res.degradations) == 2  # both rounds' aggregates kept out
    assert all(np.isfinite(a).all() for a in res.arrays.to_numpy_ndarrays())

    rc = run_config(dataset)
    nodes = nodes_for(rc, 3, tmp_path / "liar")
    real = nodes[100]

    def poisoned(m):  # a strong node whose reply carries NaN weights
        reply = real(m)
        if m.metadata.message_type == R.MSG_TRAIN and not reply.has_error():
            state = R.state_from_arrays(reply.content.array_records[R.ARRAYS])
            first = next(iter(state))
            state[first] = np.full_like(state[first], np.nan)
            reply.content.array_records[R.ARRAYS] = R.arrays_from_state(state)
        return reply

    nodes[100] = poisoned
    res, _, _ = run(rc, nodes)
    assert [(f["node_id"], f["phase"], f["reason"]) for f in res.failures] == [
        (100, "train", "malformed reply: non-finite weights")] * 2
    assert all(np.isfinite(a).all() for a in res.arrays.to_numpy_ndarrays())


def test_no_node_in_time_is_one_line_naming_the_fix_and_nothing_is_asked(dataset):
    from fedsyn_server.server_app import INPUT_ERRORS
    from strategies.membership import NodesMissing

    rc = run_config(dataset, **{"node-timeout": 0.6, "min-nodes": 2})
    strategy, _, _ = build_strategy(RunConfig.from_flower(rc), load_model=False)
    grid = FakeGrid({})
    with pytest.raises(NodesMissing,
                       match=r"timed out after 0.6s waiting for nodes \(have 0, min-nodes=2\).*lower min-nodes"):
        strategy.preflight(grid)
    assert not grid.sent and NodesMissing in INPUT_ERRORS  # the ServerApp logs it as one line, no traceback


def test_codes_the_strong_node_never_saw_are_written_by_the_pretrained_weights(dataset, tmp_path):
    rc = run_config(dataset, partitioning="strong-codes:sport", epsilon=math.inf, **{"coverage-floor": 0.5})
    res, _, _ = run(rc, nodes_for(rc, 3, tmp_path))
    assert res.pretrained_codes == ["topic=politics", "topic=tech"]
    sport = res.allocation["topic=sport"]
    assert res.generation["pretrained"]["requested"] == (res.allocation["topic=politics"] + res.allocation["topic=tech"]
                                                         + (sport + 1) // 2)  # sport: the default share of 0.5
    for code, n in res.allocation.items():  # one pool, grouped by code as before
        assert res.pool_codes.count(code) == n
        written = [w for w, c in zip(res.pool_writers, res.pool_codes) if c == code]
        assert written.count("pretrained") == (n if code != "topic=sport" else (n + 1) // 2)
    assert res.pool_codes == sorted(res.pool_codes, key=list(res.allocation).index)
