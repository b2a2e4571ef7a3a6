"""Stop and resume: the ServerApp killed between phases and mid-round, then resumed.

Real ServerApp logic (``server_app._main``) and real ClientApp nodes over a fake Grid that
can "kill" the server: it raises ``ServerKilled`` before a message is delivered (between
phases) or after the node answered but before the reply arrives (mid-round).
"""

from __future__ import annotations

import json
import shutil
from collections import Counter
from pathlib import Path

import pytest
from flwr.app import Context, RecordDict

from common import records as R
from fedsyn_client.client_app import app as client_app
from fedsyn_server import server_app
from tests.fakes import FakeGrid, client_node, set_task_identity
from tests.test_strategy import TOPICS, run_config, write_topic_csv


class ServerKilled(BaseException):
    """The ServerApp process died (not an Exception: nothing in the app may catch it)."""


class DyingGrid(FakeGrid):
    """Dies at the first message ``when(msg)`` matches: before delivering it, or (``after``)
    once the node has answered, so the node released but the server never sees the reply."""

    def __init__(self, nodes, when, after: bool = False) -> None:
        super().__init__(nodes)
        self.when, self.after = when, after

    def send_and_receive(self, messages, *, timeout=None):
        messages = list(messages)
        for m in messages:
            if self.when(m):
                if self.after:
                    self.nodes[m.metadata.dst_node_id](m)
                raise ServerKilled(m.metadata.message_type)
        return super().send_and_receive(messages, timeout=timeout)


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> str:
    return write_topic_csv(tmp_path_factory.mktemp("data") / "news.csv", TOPICS, 30)


def _nodes(rc: dict, state: Path, run_id: int) -> dict:
    return {100 + p: client_node(client_app, 100 + p, {"partition-id": p, "num-partitions": 3,
                                                        "state-dir": str(state / f"node{p}")}, rc, run_id=run_id)
            for p in range(3)}


def _serve(rc: dict, grid: FakeGrid, run_id: int) -> None:
    set_task_identity()
    server_app._main(grid, Context(run_id=run_id, node_id=0, node_config={}, state=RecordDict(), run_config=rc))


def _ledger(state: Path, p: int) -> list[dict]:
    return [r for r in json.loads((state / f"node{p}" / "ledger.json").read_text())["releases"]
            if r["status"] != "cancelled"]


def _kinds(grid: FakeGrid) -> Counter:
    return Counter(m.metadata.message_type for m in grid.sent)


def test_a_run_killed_mid_round_and_between_phases_resumes_without_releasing_twice(dataset, tmp_path):
    rc = {**run_config(dataset, **{"num-server-rounds": 3, "refinement": "pe", "refinement-rounds": 2}),
          "out-dir": str(tmp_path / "out"), "run-name": "r"}
    run_dir, state = tmp_path / "out" / "r", tmp_path / "state"
    train_round = lambda m: m.metadata.message_type == R.MSG_TRAIN and m.content.config_records[R.CONFIG].get(  # noqa: E731
        "server-round") == 2
    # 1. killed mid-round: the strong node released phase-1 round 2, the server never got it
    with pytest.raises(ServerKilled):
        _serve(rc, DyingGrid(_nodes(rc, state, 7), train_round, after=True), run_id=7)
    assert (run_dir / "checkpoint" / "state.json").exists() and (run_dir / "resume.toml").exists()
    # `flwr run . --run-config <run-dir>/resume.toml` reads it as Flower does: the run's config plus resume
    from flwr.common.config import parse_config_args

    from common.config import RunConfig

    given = RunConfig.from_flower(parse_config_args([str(run_dir / "resume.toml")]))
    assert given == RunConfig.from_flower({**rc, "resume": str(run_dir)})
    assert not (run_dir / "synthetic.jsonl").exists()
    # 2. resumed (a new Flower run id), then killed between the two vote rounds of PE
    resume = {**rc, "resume": str(run_dir)}
    second_vote = lambda m: m.metadata.message_type == R.MSG_VOTE and m.content.config_records[R.CONFIG][  # noqa: E731
        "server-round"] == 2
    grid = DyingGrid(_nodes(resume, state, 8), second_vote)
    with pytest.raises(ServerKilled):
        _serve(resume, grid, run_id=8)
    assert [m.content.config_records[R.CONFIG]["server-round"] for m in grid.sent
            if m.metadata.message_type == R.MSG_TRAIN] == [2, 3]  # round 1 was not asked again
    # 3. resumed again: only what was left is asked
    grid = FakeGrid(_nodes(resume, state, 9))
    _serve(resume, grid, run_id=9)
    assert _kinds(grid)[R.MSG_TRAIN] == 0 and _kinds(grid)[R.MSG_PROFILE] == 0 and _kinds(grid)[R.MSG_VOTE] == 2
    assert len((run_dir / "synthetic.jsonl").read_text().splitlines()) > 0
    # PE's round 1 was replayed from the checkpoint, not re-asked: its texts are still in the run's history
    history = [json.loads(line) for line in (run_dir / "refinement_rounds.jsonl").read_text().splitlines()]
    assert Counter(r["round"] for r in history) == {1: len(history) // 2, 2: len(history) // 2}
    # every node's ledger holds one release per phase and round: nothing was paid twice
    assert sorted((r["phase"], r["round"]) for r in _ledger(state, 0)) == [
        ("profile", 0), ("train", 1), ("train", 2), ("train", 3)]
    for p in (1, 2):
        assert sorted((r["phase"], r["round"]) for r in _ledger(state, p)) == [("profile", 0), ("vote", 1), ("vote", 2)]
        assert sum(r["epsilon"] for r in _ledger(state, p)) == pytest.approx(8.0)
    report = json.loads((run_dir / "privacy_report.json").read_text())
    assert [n["epsilon_spent"] for n in report["nodes"]] == pytest.approx([8.0, 8.0, 8.0])
    assert all(n["source"] == "node ledger" for n in report["nodes"])


def test_a_resumed_run_gives_the_uninterrupted_runs_outputs(dataset, tmp_path):
    # one phase-1 round: a node keeps only each run's latest training reply, and this test
    # replays the whole run from the start
    rc = {**run_config(dataset, **{"num-server-rounds": 1}), "out-dir": str(tmp_path / "out")}
    whole = {**rc, "run-name": "whole"}
    _serve(whole, FakeGrid(_nodes(whole, tmp_path / "state", 7)), run_id=7)
    # The same run (same key, same releases: every node answers from the replies it stored),
    # killed between its profile and phase 1 and resumed, must end with the same outputs.
    shutil.copytree(tmp_path / "state", tmp_path / "copy")
    cut = {**rc, "run-name": "cut"}
    with pytest.raises(ServerKilled):
        _serve(cut, DyingGrid(_nodes(cut, tmp_path / "copy", 7), lambda m: m.metadata.message_type == R.MSG_TRAIN),
               run_id=7)
    _serve({**cut, "resume": str(tmp_path / "out" / "cut")}, FakeGrid(_nodes(cut, tmp_path / "copy", 11)), run_id=11)
    for name in ("synthetic.jsonl", "pool.jsonl", "profile.json"):
        assert (tmp_path / "out" / "cut" / name).read_text() == (tmp_path / "out" / "whole" / name).read_text(), name
    for p in range(3):  # and nothing more was released
        assert _ledger(tmp_path / "copy", p) == _ledger(tmp_path / "state", p)


def test_resuming_with_another_config_is_refused_with_the_fix(dataset, tmp_path):
    rc = {**run_config(dataset, **{"num-server-rounds": 1}), "out-dir": str(tmp_path / "out"), "run-name": "r"}
    with pytest.raises(ServerKilled):
        _serve(rc, DyingGrid(_nodes(rc, tmp_path / "s", 7), lambda m: m.metadata.message_type == R.MSG_TRAIN), 7)
    other = {**rc, "resume": str(tmp_path / "out" / "r"), "epsilon": 4.0}
    with pytest.raises(server_app.ConfigError, match=r"differs .* in epsilon \(4.0, was 8.0\).*resume.toml"):
        _serve(other, FakeGrid({}), run_id=8)
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        _serve({**rc, "resume": str(tmp_path / "nowhere")}, FakeGrid({}), run_id=9)


def test_the_checkpoint_round_trips_and_a_crash_while_saving_leaves_a_consistent_one(tmp_path):
    import math

    import numpy as np

    from strategies.checkpoint import FOLDER, Progress, load_checkpoint, save_checkpoint
    from strategies.result import FedSynResult

    res = FedSynResult(tiers={101: "weak"}, budgets={101: math.inf}, profile=np.array([1.5, -0.5]),
                       selected=np.array([2, 0]), node_votes={101: [0.5, 1.0]}, pool_texts=["a", "b"])
    progress = Progress(resume_key="7", config={"epsilon": math.inf}, completed=["finetune"], train_round=2)
    first = R.arrays_from_state({"w": np.arange(3, dtype=np.float32)})
    save_checkpoint(tmp_path, progress, res, first)
    # the next save dies after writing its weights, before its state.json
    from common.io import atomic_write_npz

    atomic_write_npz(tmp_path / FOLDER / "weights-half-written.npz", {"w": np.ones(3, dtype=np.float32)})
    ck = load_checkpoint(tmp_path, FedSynResult)
    assert ck.arrays["w"].numpy().tolist() == [0.0, 1.0, 2.0]  # the weights its state names
    assert ck.progress == progress and ck.result.tiers == {101: "weak"} and ck.result.budgets == {101: math.inf}
    assert ck.result.profile.tolist() == [1.5, -0.5] and ck.result.selected.dtype == np.int64
    assert ck.result.node_votes == {101: [0.5, 1.0]} and ck.result.pool_texts == ["a", "b"]
    save_checkpoint(tmp_path, progress, res, first)  # a complete save removes stray weights
    assert len(list((tmp_path / FOLDER).glob("weights-*.npz"))) == 1


def test_a_vote_round_no_voter_answered_is_not_done_and_a_resume_under_new_node_ids_finishes(dataset, tmp_path):
    """Issue 24: the voters' processes died during the vote (no answer at all). The run stops
    before that round instead of checkpointing it as done with zero votes; the resumed run (a new
    simulation: new node ids, same ledgers) asks the new ids only, asks the round again, and every
    ledger ends with one release per phase and round."""
    rc = {**run_config(dataset, **{"num-server-rounds": 1}), "out-dir": str(tmp_path / "out"), "run-name": "r"}
    state, run_dir = tmp_path / "state", tmp_path / "out" / "r"
    nodes = _nodes(rc, state, 7)
    for nid in (101, 102):  # the weak nodes: their votes never come back
        answer = nodes[nid]
        nodes[nid] = lambda m, answer=answer: None if m.metadata.message_type == R.MSG_VOTE else answer(m)
    with pytest.raises(server_app.RunFailed, match="RoundUnanswered: vote round 1: no voter answered"):
        set_task_identity()
        server_app.main(FakeGrid(nodes), Context(run_id=7, node_id=0, node_config={}, state=RecordDict(),
                                                 run_config=rc))
    progress = json.loads((run_dir / "checkpoint" / "state.json").read_text())["progress"]
    assert "generate" in progress["completed"] and "refine" not in progress["completed"]
    assert progress["vote_totals"] == []
    resumed = {**rc, "resume": str(run_dir)}
    new = {200 + p: client_node(client_app, 200 + p, {"partition-id": p, "num-partitions": 3,
                                                       "state-dir": str(state / f"node{p}")}, resumed, run_id=9)
           for p in range(3)}
    grid = FakeGrid(new)
    _serve(resumed, grid, run_id=9)
    assert {m.metadata.dst_node_id for m in grid.sent} <= set(new)  # never the dead simulation's ids
    assert _kinds(grid)[R.MSG_VOTE] == 2 and _kinds(grid)[R.MSG_TRAIN] == 0 and _kinds(grid)[R.MSG_PROFILE] == 0
    assert (run_dir / "synthetic.jsonl").exists()
    assert sorted((r["phase"], r["round"]) for r in _ledger(state, 0)) == [("profile", 0), ("train", 1)]
    for p in (1, 2):
        assert sorted((r["phase"], r["round"]) for r in _ledger(state, p)) == [("profile", 0), ("vote", 1)]
    report = json.loads((run_dir / "privacy_report.json").read_text())
    assert sorted(n["node_id"] for n in report["nodes"]) == [200, 201, 202]
    assert all(n["source"] == "node ledger" and n["epsilon_spent"] == pytest.approx(8.0) for n in report["nodes"])
