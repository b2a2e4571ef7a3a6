"""Issue 48: a table with a free-text column in one run. The structured columns are federated
marginals; the language model writes the text column from each sampled row's code (DP-finetuned on
the strong sites, voted on by the weak ones). The schema's text column is public and the node's own
schema must list it; a marginal never counts it, and the text's phases never read the row."""

from __future__ import annotations

import json
import math
import tomllib
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from flwr.app import ConfigRecord, Context, Message, RecordDict

from common import records as R
from common.config import ConfigError, RunConfig
from common.dp import MARGINALS, PROFILE, STRONG, TRAIN, VOTE, WEAK, phase_epsilon
from common.rows import FREE_TEXT_SEP, RowError, SchemaError, parse, record_row, schema_from_dict, serialise

ROOT = Path(__file__).resolve().parents[1]
PRESET = tomllib.loads((ROOT / "presets" / "table-movie-reviews.toml").read_text())
SCHEMA = json.loads(PRESET["table-schema"])


def test_a_free_text_column_is_written_after_the_row_and_read_back_whole():
    schema = schema_from_dict(SCHEMA)
    assert schema.text_column == "review" and schema.structured().names == ("sentiment", "source", "words")
    # free text may hold what separates a row's columns: it is never inside the "name is value" list
    row = {"sentiment": "negative", "source": "viewer", "words": 9, "review": "dull, and it is long\n\nso  long"}
    for seed in range(5):
        text = serialise(row, schema, np.random.default_rng(seed))
        head, _, free = text.partition(FREE_TEXT_SEP)
        assert free == "dull, and it is long so long"  # one line: a line break cannot end the row early
        assert "review" not in head
        assert parse(text, schema) == {**row, "review": free}
    with pytest.raises(RowError):
        serialise({**row, "review": "  "}, schema, np.random.default_rng(0))  # an empty text is no row
    codes = {"sentiment": "negative", "source": "viewer"}
    assert record_row("words is 9" + FREE_TEXT_SEP + "a film", codes, schema)["review"] == "a film"


@pytest.mark.parametrize("columns, says", [
    ([{"name": "a", "type": "text"}, {"name": "b", "type": "text"}, {"name": "c", "type": "integer"}],
     "at most one 'text' column"),
    ([{"name": "a", "type": "text", "min": 1}, {"name": "c", "type": "integer"}], "no 'min'/'max'"),
    ([{"name": "a", "type": "text", "categories": ["x"]}, {"name": "c", "type": "integer"}], "only a categorical"),
    ([{"name": "a", "type": "categorical", "categories": ["x\ny"]}, {"name": "b", "type": "text"}], "line break"),
])
def test_an_unusable_free_text_schema_names_the_problem(columns, says):
    with pytest.raises(SchemaError, match=says):
        schema_from_dict({"columns": columns})


@pytest.mark.parametrize("tier, voters", [(STRONG, "weak"), (WEAK, "weak"), (STRONG, "all"), (WEAK, "all")])
def test_every_tier_spends_its_epsilon_once_across_marginals_and_text(tier, voters):
    got = {p: phase_epsilon(8.0, 2.0, tier, voters, p, marginals=0.25) for p in (MARGINALS, TRAIN, PROFILE, VOTE)}
    assert got[MARGINALS] == 2.0 and got[PROFILE] == 0.0  # no profile: the sampled rows allocate the texts
    assert math.isclose(sum(got.values()), 8.0)
    assert (got[TRAIN] > 0) == (tier == STRONG) and (got[VOTE] > 0) == (tier == WEAK or voters == "all")
    cfg = RunConfig.from_flower({**PRESET, "marginal-share": 0.25, "voters": voters})
    assert {p: cfg.phase_epsilon(tier, p) for p in got} == got
    alone = RunConfig.from_flower({**PRESET, "table-schema": json.dumps({"columns": SCHEMA["columns"][:3]})})
    assert alone.free_text is None and alone.phase_epsilon(tier, MARGINALS) == 8.0 and not alone.trains


def test_a_free_text_column_needs_the_marginals_method_and_a_share_in_range():
    with pytest.raises(ConfigError, match="'marginals' for a table with a free-text column"):
        RunConfig.from_flower({**PRESET, "table-method": "rows"})
    for share in (0.0, 1.0, 1.5):
        with pytest.raises(ConfigError, match="marginal-share"):
            RunConfig.from_flower({**PRESET, "marginal-share": share})


def test_the_table_loads_offline_and_every_row_is_inside_its_presets_schema():
    from common.data import free_text_part, table_text_data
    from common.tables import load_table

    cfg = RunConfig.from_flower(PRESET)
    frame = load_table("movie-review-table")
    assert len(frame) == 4000 and list(frame.columns) == list(cfg.schema().names)
    records = table_text_data(frame, cfg.schema(), cfg.control_columns)
    assert len(records) == 4000
    free = free_text_part(records)
    assert free.texts[:50] == [" ".join(t.split()) for t in frame["review"][:50]]
    assert set(records.codes) == {f"sentiment={s}|source={w}" for s in ("negative", "positive")
                                  for w in ("critic", "viewer")}


def _node(tmp_path, rc, node_config=None):
    from fedsyn_client.client_app import app as client_app
    from tests.fakes import client_node, set_task_identity

    set_task_identity()
    nc = {"partition-id": 0, "num-partitions": 4, "state-dir": str(tmp_path / "state"), **(node_config or {})}
    return client_node(client_app, 7, nc, rc)


def test_a_marginal_never_counts_the_free_text_and_nothing_is_spent(tmp_path):
    from fedsyn_client.policy import NodePolicy
    from fedsyn_client.release import measured_columns

    rc = {**PRESET, "epsilon": 8.0}
    node = _node(tmp_path, rc)
    codes = RunConfig.from_flower(rc)
    conf = {"codes": [f"sentiment={s}|source={w}" for s in ("negative", "positive") for w in ("critic", "viewer")],
            "delta": 1e-5, "cliques": '[["sentiment", "review"]]', "epsilon-share": 1.0, "server-round": 1}
    reply = node(Message(content=RecordDict({R.CONFIG: ConfigRecord(conf)}), message_type=R.MSG_MARGINALS,
                         dst_node_id=7))
    assert reply.has_error() and reply.error.code in R.ERR_NOTHING_SPENT
    with pytest.raises(ConfigError, match="free-text column never is"):  # what the node's own log says
        measured_columns(codes, conf, NodePolicy(tier="weak", epsilon=1.0))
    assert measured_columns(codes, {**conf, "cliques": '[["sentiment", "words"]]'}, NodePolicy(tier="weak", epsilon=1.0)
                            ) == ("sentiment", "words")


def test_the_text_phases_read_the_free_text_alone_and_the_marginals_the_row_alone(tmp_path):
    """What the language model's phases see of a record is its text column; what a marginal counts
    is its row: a change of the text moves no count, a change of the row no text."""
    from common.data import TextData
    from common.marginals import column_sizes, joined_marginals
    from fedsyn_client.histograms import node_codes
    from fedsyn_client.node import Node

    cfg = RunConfig.from_flower(PRESET)
    schema = cfg.schema()
    rows = [{"sentiment": "negative", "source": "critic", "words": 3, "review": "bad bad film"},
            {"sentiment": "positive", "source": "viewer", "words": 2, "review": "loved it"}]
    rng = np.random.default_rng(0)
    data = TextData([serialise(r, _generated(schema, cfg), rng) for r in rows],
                    [f"sentiment={r['sentiment']}|source={r['source']}" for r in rows])
    node = Node.__new__(Node)
    node.data, node._views, node._positions = data, {}, {}
    node.policy = type("P", (), {"max_records": 0})()
    vocab = tuple(sorted(set(data.codes)))
    assert sorted(node.records(vocab, free_text=True).texts) == ["bad bad film", "loved it"]
    assert all(FREE_TEXT_SEP in t for t in node.records(vocab).texts)
    sizes = column_sizes(schema, cfg.marginal_bins)
    assert list(sizes) == ["sentiment", "source", "words"]
    counts = joined_marginals(node_codes(data, schema, cfg.control_columns, cfg.marginal_bins),
                              [("sentiment",), ("words",)], sizes)
    other = TextData([t.replace("loved it", "a different, longer text is here") for t in data.texts], data.codes)
    assert np.array_equal(counts, joined_marginals(node_codes(other, schema, cfg.control_columns, cfg.marginal_bins),
                                                   [("sentiment",), ("words",)], sizes))


def _generated(schema, cfg):
    from common.rows import generated_part

    return generated_part(schema, cfg.control_columns)


@pytest.fixture(scope="module")
def text_table_run(tmp_path_factory):
    """One whole run of the free-text table over three simulated sites (one strong) with a tiny
    model: marginals, DP finetuning, votes, rows with texts attached. The server dies once the
    first vote round is released (its reply lost) and the run is resumed under a new Flower run."""
    from fedsyn_client.client_app import app as client_app
    from fedsyn_server import server_app
    from tests.fakes import FakeGrid, client_node, set_task_identity
    from tests.test_resume import DyingGrid, ServerKilled

    root = tmp_path_factory.mktemp("text-table")
    rc = {**PRESET, "out-dir": str(root / "out"), "run-name": "r", "model": "tiny-gpt2", "num-server-rounds": 1,
          "local-steps": 1, "batch-size": 4, "max-length": 24, "max-new-tokens": 8, "num-synthetic": 40,
          "sampling-rate": 0.5, "num-votes": 2, "strong-fraction": 0.34, "test-fraction": 0.05, "epsilon": 8.0,
          "node-timeout": 60.0}

    def serve(config, run_id, grid_type, *args):
        nodes = {100 + p: client_node(client_app, 100 + p, {"partition-id": p, "num-partitions": 3,
                                                             "state-dir": str(root / "state" / f"node{p}")},
                                      config, run_id=run_id) for p in range(3)}
        grid = grid_type(nodes, *args)
        set_task_identity()
        server_app._main(grid, Context(run_id=run_id, node_id=0, node_config={}, state=RecordDict(), run_config=config))
        return grid

    with pytest.raises(ServerKilled):
        serve(rc, 5, DyingGrid, lambda m: m.metadata.message_type == R.MSG_VOTE, True)
    grid = serve({**rc, "resume": str(root / "out" / "r")}, 6, FakeGrid)
    return root / "out" / "r", grid, root / "state"


def test_a_resumed_run_asks_only_what_was_left_and_pays_nothing_twice(text_table_run):
    _, grid, state = text_table_run
    asked = [m.metadata.message_type for m in grid.sent]
    assert R.MSG_MARGINALS not in asked and R.MSG_TRAIN not in asked and R.MSG_PROFILE not in asked
    # the vote rounds are numbered after the marginals round (the checkpoint keeps both in one list)
    assert [m.content.config_records[R.CONFIG]["server-round"] for m in grid.sent
            if m.metadata.message_type == R.MSG_VOTE][:1] == [2]
    for p in range(3):
        releases = [r for r in json.loads((state / f"node{p}" / "ledger.json").read_text())["releases"]
                    if r["status"] != "cancelled"]
        phases = sorted((r["phase"], r["round"]) for r in releases)
        assert phases.count(("marginals", 1)) == 1 and len(phases) == len(set(phases))  # nothing paid twice
        assert not any(phase == PROFILE for phase, _ in phases)  # the rows allocated the texts
        assert sum(r["epsilon"] for r in releases) <= 8.0 + 1e-9


def test_one_run_writes_the_table_with_a_text_of_each_rows_own_code(text_table_run):
    run_dir, _, _ = text_table_run
    table = pd.read_parquet(run_dir / "synthetic.parquet")
    assert list(table.columns) == ["sentiment", "source", "words", "review"] and len(table) == 20
    assert table["review"].str.len().gt(0).all() and not table["review"].str.contains("\n").any()
    records = [json.loads(line) for line in (run_dir / "synthetic.jsonl").read_text().splitlines()]
    assert len(records) == 20
    for record, row in zip(records, table.to_dict("records")):  # the record's code is its row's
        assert record["control_code"] == f"sentiment={row['sentiment']}|source={row['source']}"
        assert record["text"].endswith(FREE_TEXT_SEP + row["review"]) and record["writer"] != "marginals"
    report = json.loads((run_dir / "privacy_report.json").read_text())
    assert report["epsilon_split"]["marginals"] == 4.0 and report["epsilon_split"]["train_or_vote"] == 4.0
    for node in report["nodes"]:
        phases = {r["phase"] for r in node["releases"]}
        assert PROFILE not in phases and MARGINALS in phases
        assert node["epsilon_basic_composition"] <= 8.0 + 1e-9


def test_the_texts_label_fidelity_against_its_row_is_reported(text_table_run):
    run_dir, _, _ = text_table_run
    scores = json.loads((run_dir / "evaluation.json").read_text())
    assert set(scores["table"]["column_fidelity"]) == {"sentiment", "source", "words"}  # the text is scored as text
    fidelity = scores["utility"]["sentiment"]["label_fidelity"]
    assert 0.0 <= fidelity <= 1.0


def test_plan_shows_the_marginals_and_the_texts_phases_at_their_shares_and_no_profile(capsys):
    from fedsyn_server.cli import main

    preset = str(ROOT / "presets" / "table-movie-reviews.toml")
    assert main(["plan", str(ROOT), "--run-config", preset, "--federation-config", "num-supernodes=4"]) == 0
    out = capsys.readouterr().out
    assert out.count("marginals: epsilon 4 in 1 round(s)") == 4  # every site, half of its 8
    assert out.count("train: epsilon 4,") == 2 and out.count("vote: epsilon 4 in") == 2
    assert "profile:" not in out and "each with a text of its code in free-text column 'review'" in out


def test_plan_prices_the_texts_phases_under_pld_on_the_marginals_released_before_them(capsys):
    """Issue 47 on a free-text table: a node prices its DP-SGD (strong) or its votes (weak) under
    pld on the marginals it released first; the plan says the same figure (``calibrate``), not
    the phase solved alone."""
    import re

    from common.accounting import calibrate
    from common.calibration import Planned, pld_noise
    from common.dp import GAUSSIAN, MARGINALS, VOTE
    from fedsyn_server.cli import main
    from fedsyn_server.plan import pld_noises

    preset = str(ROOT / "presets" / "table-movie-reviews.toml")
    assert main(["plan", str(ROOT), "--run-config", preset, "--federation-config", "num-supernodes=4"]) == 0
    out = capsys.readouterr().out
    vote = re.search(r"vote: epsilon 4 in (\d+) round\(s\), delta ([0-9.e-]+), .*?= ([0-9.]+); basic; ([0-9.]+) "
                     r"under accounting = pld", out)
    rounds, delta, sens, shown = int(vote.group(1)), float(vote.group(2)), float(vote.group(3)), float(vote.group(4))
    marginals = Planned(MARGINALS, GAUSSIAN, 4.0, delta, 1.0, rounds=1)
    vote_phase = Planned(VOTE, GAUSSIAN, 4.0, delta, sens, rounds=rounds)
    composed = calibrate([marginals, vote_phase])[1]
    assert shown == pytest.approx(composed, rel=2e-3, abs=1e-3)
    assert composed < 0.97 * pld_noise((), vote_phase)  # composing with the marginals buys less noise
    # a DP-SGD phase of unknown q (a deployment) resets the base: the phases after it are priced alone,
    # an upper bound on what the node solves with its q
    from common.dp import DPSGD, TRAIN
    unknown_q = Planned(TRAIN, DPSGD, 4.0, delta, steps=6)
    noises = pld_noises([marginals, unknown_q, vote_phase])
    assert TRAIN not in noises and noises[VOTE] == pytest.approx(pld_noise((), vote_phase))
