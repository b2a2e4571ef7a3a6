"""Issue 48: a table by federated marginals, end to end (the real ServerApp and ClientApp, a fake
Grid, Breast Cancer over two sites), and the node's side of it as an attack surface: what a
marginals request may ask, what the policy lets be measured, what is charged."""

from __future__ import annotations

import json
import math
import tomllib
from pathlib import Path

import pandas as pd
import pytest
from flwr.app import ConfigRecord, Context, Message, RecordDict

from common import records as R
from common.config import ConfigError, RunConfig
from common.dp import MARGINALS, PROFILE, STRONG, TRAIN, VOTE, WEAK

ROOT = Path(__file__).resolve().parents[1]
PRESET = tomllib.loads((ROOT / "presets" / "table-breast-cancer.toml").read_text())


def marginals_config(**extra) -> dict:
    """The Breast Cancer preset as a marginals run: every site's epsilon 8, 60 rows."""
    return {**PRESET, "table-method": "marginals", "epsilon": 8.0, "strong-fraction": 0.5, "num-synthetic": 120,
            "sampling-rate": 0.5, **extra}


@pytest.fixture(scope="module")
def table_run(tmp_path_factory):
    """One whole marginals run, two rounds, over three simulated sites, of which the third never
    answers a marginals request (it crashed, or its link is down)."""
    from fedsyn_client.client_app import app as client_app
    from fedsyn_server import server_app
    from tests.fakes import FakeGrid, client_node, set_task_identity

    root = tmp_path_factory.mktemp("marginals")
    # two rounds (the adaptive path); no held-out rows, so no evaluation (benchmarks/tables.py scores it)
    rc = marginals_config(**{"out-dir": str(root / "out"), "run-name": "r", "marginal-rounds": 2, "test-fraction": 0.0,
                             "node-timeout": 5.0})
    nodes = {100 + p: client_node(client_app, 100 + p, {"partition-id": p, "num-partitions": 3,
                                                         "state-dir": str(root / "state" / f"node{p}")}, rc, run_id=3)
             for p in range(3)}
    live = nodes[102]
    nodes[102] = lambda msg: None if msg.metadata.message_type == R.MSG_MARGINALS else live(msg)
    grid = FakeGrid(nodes)
    set_task_identity()
    server_app._main(grid, Context(run_id=3, node_id=0, node_config={}, state=RecordDict(), run_config=rc))
    return root / "out" / "r", grid


def test_every_site_answers_the_marginals_and_nothing_else_is_asked(table_run):
    run_dir, grid = table_run
    asked = [(m.metadata.message_type, m.metadata.dst_node_id) for m in grid.sent]
    assert {t for t, _ in asked} == {R.MSG_TIER, R.MSG_MARGINALS, R.MSG_LEDGER}  # no training, profile or vote
    rounds = [m for m in grid.sent if m.metadata.message_type == R.MSG_MARGINALS]
    assert sorted(m.metadata.dst_node_id for m in rounds) == [100, 100, 101, 101, 102, 102]  # strong and weak alike
    first = R.read_cliques(dict(rounds[0].content.config_records[R.CONFIG]))
    assert len(first) == 7 + 21  # round 1: every 1-way and 2-way marginal of the 7 columns
    second = R.read_cliques(dict(rounds[-1].content.config_records[R.CONFIG]))
    assert len(second) == 5 and all("diagnosis" in c and len(c) == 3 for c in second)  # a tree of 6, with the label


def test_the_rows_are_the_schemas_and_every_site_spent_exactly_its_epsilon(table_run):
    run_dir, _ = table_run
    table = pd.read_parquet(run_dir / "synthetic.parquet")
    schema = RunConfig.from_flower(marginals_config()).schema()
    assert list(table.columns) == list(schema.names) and len(table) == 60
    for column in schema.columns:
        values = table[column.name]
        if column.type == "categorical":
            assert set(values) <= set(column.categories)
        else:
            assert values.between(column.min, column.max).all()
    report = json.loads((run_dir / "privacy_report.json").read_text())
    spent = {node["node_id"]: node for node in report["nodes"]}
    for nid in (100, 101):
        releases = spent[nid]["releases"]
        assert [r["phase"] for r in releases] == [MARGINALS, MARGINALS]
        # the default pld rule: the charges are the two rounds' PLD composition, within the budget
        assert 8.0 - 2e-3 <= sum(r["epsilon"] for r in releases) <= 8.0 + 1e-9
        assert [r["sensitivity"] for r in releases] == pytest.approx([math.sqrt(28), math.sqrt(5)])
        # round 2 asks fewer marginals (another sensitivity) at the phase's one noise multiplier
        z = [r["sigma"] / r["sensitivity"] for r in releases]
        assert z[0] == pytest.approx(z[1], rel=1e-9)
    assert spent[102]["releases"] == []  # its own ledger: it never released (its ledger answered at the end)
    assert "marginals" in report["mechanisms"] and report["epsilon_split"]["marginals"] == 8.0


def test_a_site_that_never_answers_is_left_out_of_each_sum_and_the_run_says_so(table_run):
    run_dir, _ = table_run
    metrics = json.loads((run_dir / "metrics.json").read_text())
    said = " ".join(metrics["degradations"])
    assert "marginals round 1: 2 of 3 nodes answered (missing: 102)" in said and "marginals round 2: 2 of 3" in said
    assert {f["node_id"] for f in metrics["failures"]} == {102} and metrics["final_size"] == 60


def test_a_table_run_composes_the_run_and_holds_text_stages_only_for_a_free_text_column():
    """Issue 62: a marginals run is no text strategy with placeholders, nor a Flower Strategy whose
    ``start`` would run Flower's loop; it samples the one final size (floor: 245 x 0.3 -> 73)."""
    from flwr.serverapp.strategy import Strategy

    from strategies.marginals import MarginalsStrategy
    from strategies.refinement import build_refinement, final_size

    cfg = RunConfig.from_flower(marginals_config(**{"num-synthetic": 245, "sampling-rate": 0.3}))
    table = MarginalsStrategy(cfg, ["a", "b"], delta=1e-5)
    assert table.text is None and table.phases() == [MARGINALS] and not isinstance(table, Strategy)
    assert final_size(cfg) == 73  # round() would give 74
    with pytest.raises(ValueError, match="no language model"):
        MarginalsStrategy(cfg, ["a", "b"], delta=1e-5, refinement=build_refinement("knn-vote"))


def test_a_marginals_run_gives_every_tier_its_whole_epsilon_for_the_marginals_alone():
    cfg = RunConfig.from_flower(marginals_config())
    for tier in (STRONG, WEAK):
        assert cfg.phase_epsilon(tier, MARGINALS) == 8.0
        assert [cfg.phase_epsilon(tier, p) for p in (TRAIN, PROFILE, VOTE)] == [0.0, 0.0, 0.0]
    text = RunConfig()
    assert text.phase_epsilon(WEAK, MARGINALS) == 0.0 and text.phase_epsilon(WEAK, VOTE) == 6.0


def test_a_marginals_run_needs_a_schema_with_declared_ranges_before_anything_is_sent():
    with pytest.raises(ConfigError, match="table-method.*needs a table-schema"):
        RunConfig.from_flower({"table-method": "marginals"})
    schema = json.dumps({"columns": [{"name": "y", "type": "categorical", "categories": ["a", "b"]},
                                     {"name": "age", "type": "integer"}]})
    with pytest.raises(ConfigError, match="'age'.*'min' and a 'max'"):
        RunConfig.from_flower({"table-method": "marginals", "table-schema": schema, "control-columns": "y"})
    # the default for a table is the marginals too, and its error names the way out
    with pytest.raises(ConfigError, match="'age'.*'min' and a 'max'.*table-method = 'rows'"):
        RunConfig.from_flower({"table-schema": schema, "control-columns": "y"})
    rows = RunConfig.from_flower({"table-method": "rows", "table-schema": schema, "control-columns": "y"})
    assert not rows.marginals  # the LLM's rows need no range


def test_a_table_run_is_by_marginals_unless_it_asks_for_rows_and_a_text_run_never_is():
    """``table-method = "auto"`` (the default) resolves from the public config alone, so the server and
    every node read the same method: marginals with a table-schema, none without."""
    schema = marginals_config()["table-schema"]
    assert RunConfig().table_method == "auto" and not RunConfig().marginals
    assert RunConfig.from_flower({"table-schema": schema, "control-columns": "diagnosis"}).marginals
    assert not RunConfig.from_flower({"table-schema": schema, "control-columns": "diagnosis",
                                      "table-method": "rows"}).marginals
    with pytest.raises(ConfigError, match="table-method = 'marginals'.*'auto' \\(the default\\) for a text run"):
        RunConfig.from_flower({"table-method": "marginals"})


def _rows_csv(tmp_path: Path) -> Path:
    """40 Breast Cancer rows as an institution's file."""
    from sklearn.datasets import load_breast_cancer

    data = load_breast_cancer(as_frame=True).frame.head(40)
    frame = data.assign(diagnosis=data["target"].map({0: "malignant", 1: "benign"}),
                        **{"mean area": data["mean area"].round().astype(int)})
    path = tmp_path / "rows.csv"
    frame.to_csv(path, index=False)
    return path


def _ask(tmp_path, cliques: str, policy: dict | None = None, **rc_extra) -> tuple[Message, Path]:
    """One marginals request to a deployed-style weak node holding 40 Breast Cancer rows."""
    from fedsyn_client import node as node_module
    from fedsyn_client.client_app import app as client_app
    from tests.fakes import client_node, set_task_identity

    path = _rows_csv(tmp_path)
    rc = marginals_config(dataset=str(path), **rc_extra)
    node_module._policy.cache_clear()
    node_module._open.cache_clear()
    node = client_node(client_app, 9, {"tier": "weak", "data-path": str(path), "max-records": 100, "epsilon": 8.0,
                                       "state-dir": str(tmp_path / "state"), "table-schema": rc["table-schema"],
                                       "control-columns": "diagnosis", "accounting": "basic", **(policy or {})},
                            rc, run_id=2)
    set_task_identity()
    conf = {"codes": ["diagnosis=malignant", "diagnosis=benign"], "delta": 1e-5, "cliques": cliques,
            "epsilon-share": 0.5, "server-round": 1}
    reply = node(Message(content=RecordDict({R.CONFIG: ConfigRecord(conf)}), message_type=R.MSG_MARGINALS,
                         dst_node_id=9))
    return reply, tmp_path / "state" / "ledger.json"


def _spent(ledger: Path) -> float:
    from fedsyn_client.ledger import PrivacyLedger

    return PrivacyLedger(ledger).spent() if ledger.exists() else 0.0


def test_a_deployed_site_releases_its_marginals_at_half_its_epsilon_per_round(tmp_path):
    reply, ledger = _ask(tmp_path, '[["diagnosis"], ["diagnosis", "mean area"]]')
    assert not reply.has_error()
    values = R.read_vector(reply.content, R.MARGINALS)
    assert values.shape == (2 + 2 * 16,)
    statement = dict(reply.content.config_records[R.RELEASE])
    assert statement["phase"] == MARGINALS and statement["sensitivity"] == pytest.approx(math.sqrt(2))
    assert _spent(ledger) == pytest.approx(4.0)


@pytest.mark.parametrize("cliques, policy, extra, code", [
    ('[["diagnosis"], ["salary"]]', None, {}, R.ERR_CONFIG),  # a column outside the schema
    ('[["diagnosis", "diagnosis"]]', None, {}, R.ERR_CONFIG),  # a column twice
    ('{"a": 1}', None, {}, R.ERR_CONFIG),  # not a list of cliques
    ('[["mean area", "mean radius", "mean texture", "mean perimeter", "mean concavity", "mean smoothness"]]', None,
     {"marginal-bins": 1024}, R.ERR_POLICY),  # 1024^6 cells: above the node's max-marginal-cells
    ('[["diagnosis", "mean area"]]', {"measurable-columns": "diagnosis,mean radius"}, {}, R.ERR_POLICY),
    ('[["diagnosis"]]', {"max-epsilon-marginals": 2.0}, {}, R.ERR_POLICY),  # a cap below the run's 8
], ids=["unknown-column", "repeated-column", "malformed", "too-many-cells", "not-measurable", "capped"])
def test_a_marginals_request_the_site_does_not_allow_is_refused_before_anything_is_spent(tmp_path, cliques, policy,
                                                                                          extra, code):
    reply, ledger = _ask(tmp_path, cliques, policy, **extra)
    assert reply.has_error() and reply.error.code == code
    assert _spent(ledger) == 0.0


def test_a_text_runs_node_refuses_a_marginals_request(tmp_path):
    """A server cannot ask a text run's node for marginals: the phase has no budget there."""
    from fedsyn_client.client_app import app as client_app
    from tests.fakes import client_node, set_task_identity
    from tests.test_strategy import TOPICS, run_config, write_topic_csv

    rc = run_config(write_topic_csv(tmp_path / "news.csv", TOPICS, 5))
    node = client_node(client_app, 4, {"partition-id": 0, "num-partitions": 1, "state-dir": str(tmp_path / "s")}, rc)
    set_task_identity()
    conf = {"codes": sorted(f"topic={t}" for t in TOPICS), "delta": 1e-5, "cliques": '[["topic"]]'}
    reply = node(Message(content=RecordDict({R.CONFIG: ConfigRecord(conf)}), message_type=R.MSG_MARGINALS,
                         dst_node_id=4))
    assert reply.has_error() and reply.error.code in R.ERR_NOTHING_SPENT


def test_plan_shows_each_rounds_marginals_and_their_noise_per_site(capsys):
    from common.dp import analytic_gaussian_sigma
    from fedsyn_server.cli import main

    preset = str(ROOT / "presets" / "table-marginals.toml")
    assert main(["plan", str(ROOT), "--run-config", preset, "--federation-config", "num-supernodes=3"]) == 0
    out = capsys.readouterr().out
    one = analytic_gaussian_sigma(8.0, 1e-5, 13 ** 0.5)  # 7 one-way + 6 pairs of the diagnosis
    assert out.count(f"round 1: 13 1- and 2-way marginals, Gaussian sigma {one:.3g} per cell") == 3  # every site
    assert "samples 60 rows; no language model" in out and "writers:" not in out


def test_the_second_table_loads_offline_and_every_row_is_inside_its_presets_schema():
    from common.data import table_text_data
    from common.tables import load_table

    pytest.importorskip("statsmodels")
    preset = tomllib.loads((ROOT / "presets" / "table-fair-marginals.toml").read_text())
    cfg = RunConfig.from_flower(preset)
    frame = load_table("fair-affairs")
    assert len(frame) == 6366 and list(frame.columns) == list(cfg.schema().names)
    assert (frame["affair"] == "yes").sum() == 2053  # Fair (1978): about a third report any time in affairs
    records = table_text_data(frame, cfg.schema(), cfg.control_columns)
    assert len(records) == 6366  # no row falls outside the public schema


def test_node_check_says_which_columns_a_marginals_run_may_count(tmp_path):
    from fedsyn_client.node import check_node

    path = _rows_csv(tmp_path)
    config = {"tier": "weak", "data-path": str(path), "max-records": 100, "epsilon": 8.0,
              "state-dir": str(tmp_path / "state"), "table-schema": PRESET["table-schema"],
              "control-columns": "diagnosis",
              "measurable-columns": "diagnosis,mean radius"}
    assert "a marginals run may count diagnosis, mean radius (node-config measurable-columns)" in check_node(config)
    unranged = json.loads(PRESET["table-schema"])
    del unranged["columns"][1]["max"]
    line = check_node({**config, "table-schema": json.dumps(unranged), "measurable-columns": "",
                       "state-dir": str(tmp_path / "other")})
    assert "count diagnosis, mean radius, mean texture" in line and "mean radius declare no min and max" in line


def test_a_marginals_run_at_t_equals_k_measures_every_round_as_one_masked_sum(tmp_path):
    """Issue 73 in-process: two simulated sites that each count on both (run config
    ``min-honest-nodes = 2``): each marginals round is the five steps of a masked round, no site's own
    vector reaches the server, every site's ledger books Skellam releases within its budget, and the
    typed table is written."""
    from fedsyn_client.client_app import app as client_app
    from fedsyn_server import server_app
    from tests.fakes import FakeGrid, client_node, set_task_identity

    rc = marginals_config(**{"out-dir": str(tmp_path / "out"), "run-name": "r", "marginal-rounds": 2,
                             "test-fraction": 0.0, "min-honest-nodes": 2})
    nodes = {100 + p: client_node(client_app, 100 + p, {"partition-id": p, "num-partitions": 2,
                                                         "state-dir": str(tmp_path / "state" / f"node{p}")},
                                  rc, run_id=4) for p in range(2)}
    grid = FakeGrid(nodes)
    set_task_identity()
    server_app._main(grid, Context(run_id=4, node_id=0, node_config={}, state=RecordDict(), run_config=rc))
    steps = [str(m.content.config_records[R.CONFIG].get(R.SECAGG_STEP, "")) for m in grid.sent
             if m.metadata.message_type == R.MSG_MARGINALS]
    assert steps.count(R.SECAGG_STEPS[0]) == 2 * 2 and set(steps) == set(R.SECAGG_STEPS)  # two rounds, two sites
    assert not any(R.MARGINALS in r.content.array_records or R.MARGINALS in r.content.metric_records
                   for r in grid.replies)  # only masked vectors left the sites
    assert (tmp_path / "out" / "r" / "synthetic.parquet").exists()
    report = json.loads((tmp_path / "out" / "r" / "privacy_report.json").read_text())
    for node in report["nodes"]:
        assert [r["mechanism"] for r in node["releases"] if r["phase"] == MARGINALS] == ["skellam"] * 2
        assert node["epsilon_spent"] <= node["epsilon_budget"] + 1e-6
