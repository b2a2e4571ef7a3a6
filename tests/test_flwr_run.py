"""The real thing: ``flwr run`` of the app (local SuperLink, Ray simulation, real messages)."""

from __future__ import annotations

import json

import pytest

from common.io import read_jsonl
from fedsyn_server.flwr_runner import run_app


def check_tiny_run_outputs(run_dir) -> list[dict]:
    """Assert a finished tiny three-site run (one strong, BBC News) wrote every output, spent within
    each node's budget, failed nowhere and was scored with MiniLM; returns its synthetic rows."""
    for name in ("synthetic.jsonl", "pool.jsonl", "privacy_report.json", "profile.json", "metrics.json",
                 "config.json", "heldout.jsonl", "evaluation.json", "plots/allocation.png", "plots/votes_per_code.png",
                 "model/adapter_config.json"):
        assert (run_dir / name).exists(), name
    synthetic = read_jsonl(run_dir / "synthetic.jsonl")
    assert synthetic and all({"text", "control_code", "topic"} <= set(r) for r in synthetic)
    report = json.loads((run_dir / "privacy_report.json").read_text())
    assert sorted(n["tier"] for n in report["nodes"]) == ["strong", "weak", "weak"]
    for node in report["nodes"]:
        assert node["epsilon_spent"] <= node["epsilon_budget"] + 1e-6
        assert node["epsilon_pld"] <= node["epsilon_basic_composition"] + 1e-9
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["failures"] == [] and metrics["final_size"] == len(synthetic)
    evaluation = json.loads((run_dir / "evaluation.json").read_text())
    assert 0.0 <= evaluation["utility"]["topic"]["accuracy"] <= 1.0
    assert evaluation["n_synthetic"] == len(synthetic) and evaluation["n_real"] > 0
    assert evaluation["embedder"] == "all-MiniLM-L6-v2"
    return synthetic


@pytest.mark.session(covered_by="tests/test_front_door.py::test_a_new_user_walks_the_readme (the same tiny "
                              "three-site run through `fedsyn run`, and these outputs)")
@pytest.mark.flwr
def test_flwr_run_tiny_model_writes_all_outputs(tmp_path):
    res = run_app({
        "model": "tiny-gpt2", "num-server-rounds": 1, "local-steps": 2, "batch-size": 4,
        "num-synthetic": 20, "max-new-tokens": 8, "out-dir": str(tmp_path), "run-name": "tiny",
        "test-fraction": 0.02, "strong-fraction": 0.34,
        # the weak nodes vote with the sentiment-seeing embedder; the server still scores with MiniLM
        "embedder": "all-MiniLM-L6-v2+vader",
    }, federation_config="num-supernodes=3", timeout=1200)
    assert res.ok, f"{res.status}\n{res.output[-4000:]}"
    run_dir = tmp_path / "tiny"
    assert res.run_dir == run_dir
    check_tiny_run_outputs(run_dir)


@pytest.mark.slow
@pytest.mark.flwr
def test_default_run_with_real_weights_follows_the_noisy_profile(tmp_path):
    """`flwr run .` with every pyproject default (SmolLM2, MiniLM, BBC News, 2 nodes)."""
    from strategies.resampling import sample_size

    state = tmp_path / "node-state"  # the simulated nodes' ledgers, read below
    res = run_app({"out-dir": str(tmp_path), "run-name": "default"}, timeout=2400,
                  env={"FEDSYN_STATE_DIR": str(state)})
    assert res.ok, f"{res.status}\n{res.output[-4000:]}"
    run_dir = tmp_path / "default"
    profile = json.loads((run_dir / "profile.json").read_text())
    assert len(profile["vocabulary"]) == 5
    for code, n in profile["allocation"].items():
        assert profile["final_counts"][code] == (sample_size(n, 0.25) if n else 0)  # the default r
    report = json.loads((run_dir / "privacy_report.json").read_text())
    assert sorted(n["tier"] for n in report["nodes"]) == ["strong", "weak"]
    for node in report["nodes"]:
        assert 7.9 <= node["epsilon_spent"] <= node["epsilon_budget"] + 1e-6
    # issue 60: each node's ledger, every release composed by dp_accounting here at the policy's delta (1e-5),
    # is within its budget and spends at least 97% of it
    from fedsyn_client.ledger import PrivacyLedger
    from tests.test_delta_budget import composed_here

    ledgers = sorted(state.glob("run-*/node-*/ledger.json"))
    assert len(ledgers) == 2
    for path in ledgers:
        composed = composed_here(PrivacyLedger(path).releases, 1e-5)
        assert 0.97 * 8.0 <= composed <= 8.0 + 1e-3, (path, composed)
    texts = [r["text"] for r in read_jsonl(run_dir / "synthetic.jsonl")]
    assert len(texts) >= 50 and sum(len(t.split()) for t in texts) / len(texts) > 15
    assert (run_dir / "evaluation.json").exists() and (run_dir / "model" / "adapter_config.json").exists()


_BOOKED_IN_PROCESS = "tests/test_refinement.py::test_multi_round_refinements_split_epsilon_vote_across_their_rounds"


@pytest.mark.flwr
@pytest.mark.parametrize("refinement", [pytest.param("pe", marks=pytest.mark.session(covered_by=_BOOKED_IN_PROCESS)),
                                        pytest.param("popri", marks=pytest.mark.session(covered_by=_BOOKED_IN_PROCESS)),
                                        pytest.param("examples.top_voted:TopVoted", marks=pytest.mark.session(
                                            covered_by="tests/test_refinement.py::"
                                                       "test_the_docs_example_runs_end_to_end "
                                                       "and test_flwr_run_tiny_model_writes_all_outputs"))])
def test_flwr_run_refinement_plugins_book_every_vote_round(tmp_path, refinement):
    """`flwr run` with each refinement plug-in (tiny model): every vote round is in each weak
    node's own ledger, and the rounds add up to its epsilon_vote."""
    res = run_app({
        "model": "tiny-gpt2", "num-server-rounds": 1, "local-steps": 2, "batch-size": 4,
        "num-synthetic": 24, "max-new-tokens": 8, "out-dir": str(tmp_path), "run-name": "plugin",
        "test-fraction": 0.02, "strong-fraction": 0.34, "refinement": refinement, "refinement-rounds": 2,
        "popri-samples-per-prompt": 3, "popri-rejected-rank": 2,
    }, federation_config="num-supernodes=3", timeout=1200)
    assert res.ok, f"{res.status}\n{res.output[-4000:]}"
    run_dir = tmp_path / "plugin"
    rounds = 1 if ":" in refinement else 2
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["failures"] == [] and len(metrics["refinement"]["vote_rounds"]) == rounds
    report = json.loads((run_dir / "privacy_report.json").read_text())
    weak = [n for n in report["nodes"] if n["tier"] == "weak"]
    assert len(weak) == 2
    for node in weak:
        assert node["source"] == "node ledger"
        votes = [r for r in node["releases"] if r["phase"] == "vote"]
        assert [r["round"] for r in votes] == list(range(1, rounds + 1))
        # the default pld rule charges each release its PLD growth: the sum is the composition, a hair under
        assert sum(r["epsilon"] for r in votes) == pytest.approx(6.0, abs=2e-3)
        assert node["epsilon_spent"] == pytest.approx(8.0, abs=2e-3) and node["epsilon_spent"] <= 8.0 + 1e-9
    assert len(read_jsonl(run_dir / "synthetic.jsonl")) == metrics["final_size"] > 0
    history = run_dir / "refinement_rounds.jsonl"  # built-ins log every round's texts; the plug-in chose not to
    assert history.exists() == (":" not in refinement)
    if history.exists():
        assert sorted({r["round"] for r in read_jsonl(history)}) == [1, 2]
    if refinement == "popri":  # the DPO-finetuned adapter is the run's model
        assert (run_dir / "model" / "adapter_config.json").exists()


@pytest.mark.flwr
def test_fedsyn_run_exits_non_zero_with_one_line_when_the_run_fails(tmp_path):
    import subprocess
    import sys
    import tempfile
    from pathlib import Path

    from fedsyn_server.flwr_runner import APP_DIR, flwr_env, stop_processes_of

    home = Path(tempfile.mkdtemp(prefix="fedsyn-flwr-home-"))
    cmd = [str(Path(sys.executable).with_name("fedsyn")), "run", str(APP_DIR), "--stream",
           "--run-config", f"epsilon=-1 out-dir=\"{tmp_path}\""]
    try:
        proc = subprocess.run(cmd, env=flwr_env(home), capture_output=True, text=True, timeout=600)
    finally:
        stop_processes_of(home)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 1, output[-3000:]
    assert "failed: ConfigError: invalid run config: epsilon = -1.0; allowed: a float > 0" in output
    assert "the run ended finished:failed" in output
    assert not list(tmp_path.iterdir())  # nothing was written


@pytest.mark.flwr
def test_flwr_run_of_the_table_preset_writes_a_typed_table_of_the_schema(tmp_path):
    """``presets/table-breast-cancer.toml`` end to end (with the tiny model, and PE on rows, the
    federated Tab-PE): every written row is a row of the public schema, typed, and the run's
    evaluation has its table section."""
    import tomllib
    from pathlib import Path

    import pandas as pd

    from common.rows import load_schema
    from fedsyn_server.evaluation.tables import table_rows

    preset = tomllib.loads((Path(__file__).parents[1] / "presets" / "table-breast-cancer.toml").read_text())
    preset["table-schema"] = json.dumps(json.loads(preset["table-schema"]))  # one line, as `fedsyn run` sends it
    res = run_app({**preset, "model": "tiny-gpt2", "num-server-rounds": 1, "local-steps": 2, "batch-size": 8,
                   "num-synthetic": 24, "refinement": "pe", "refinement-rounds": 1, "out-dir": str(tmp_path),
                   "run-name": "table"}, timeout=1200)
    assert res.ok, f"{res.status}\n{res.output[-4000:]}"
    run_dir, schema = tmp_path / "table", load_schema(preset["table-schema"])
    table = pd.read_parquet(run_dir / "synthetic.parquet")
    assert list(table.columns) == list(schema.names) and len(table) > 0
    typed, outside = table_rows(table, schema)
    assert outside == 0 and len(typed) == len(table)
    assert set(table["diagnosis"]) <= {"malignant", "benign"}
    assert str(table["mean area"].dtype).startswith("int")
    assert len(pd.read_csv(run_dir / "synthetic.csv")) == len(table)
    evaluation = json.loads((run_dir / "evaluation.json").read_text())["table"]
    assert evaluation["n_synthetic"] == len(table)
    assert set(evaluation["column_fidelity"]) == set(schema.names)
    assert all(0.0 <= v <= 1.0 for v in evaluation["column_fidelity"].values())
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["failures"] == []
    report = json.loads((run_dir / "privacy_report.json").read_text())
    assert all(n["epsilon_spent"] <= n["epsilon_budget"] + 1e-6 for n in report["nodes"])


@pytest.mark.session(covered_by="tests/test_secagg_run.py::test_a_run_at_t_equals_k_masks_every_release_the_"
                              "server_sums (the same masked rounds through the real strategy and ClientApp; the tiny "
                              "flwr run still runs, and the table by marginals at t = K below)")
@pytest.mark.flwr
def test_flwr_run_at_t_equals_k_masks_every_sum_the_server_takes(tmp_path):
    """Issue 73 through ``flwr run``: three simulated sites that each count on all three
    (``min-honest-nodes = 3``): the profile and every vote round are masked rounds, the run ends
    with every output, and each site's releases are Skellam shares charged under its trust."""
    res = run_app({
        "model": "tiny-gpt2", "num-server-rounds": 1, "local-steps": 2, "batch-size": 4,
        "num-synthetic": 20, "max-new-tokens": 8, "out-dir": str(tmp_path), "run-name": "masked",
        "test-fraction": 0.02, "strong-fraction": 0.34, "min-honest-nodes": 3,
    }, federation_config="num-supernodes=3", timeout=1200)
    assert res.ok, f"{res.status}\n{res.output[-4000:]}"
    run_dir = tmp_path / "masked"
    check_tiny_run_outputs(run_dir)
    report = json.loads((run_dir / "privacy_report.json").read_text())
    for node in report["nodes"]:
        masked = [r for r in node["releases"] if r["mechanism"] == "skellam"]
        assert {r["phase"] for r in masked} == {"profile", "vote"}
        assert all(r["honest"] == 3 and r["epsilon_alone"] > r["epsilon"] for r in masked)
    metrics = json.loads((run_dir / "metrics.json").read_text())
    rounds = metrics["refinement"]["vote_rounds"]
    assert rounds and all(r.get("masked") for r in rounds)
    assert "the masked sum of 3 sites unmasked" in res.output


@pytest.mark.flwr
@pytest.mark.session(covered_by="tests/test_table_marginals.py::test_a_marginals_run_at_t_equals_k_measures_every_"
                                "round_as_one_masked_sum (the same run in-process) and "
                                "test_flwr_run_of_the_table_preset_writes_a_typed_table_of_the_schema (through flwr)")
def test_flwr_run_of_a_table_by_marginals_at_t_equals_k(tmp_path):
    """Issue 73: ``presets/table-marginals.toml`` with every site counting on all of them: each
    marginals round is one masked sum, and the typed table is written."""
    import tomllib
    from pathlib import Path

    preset = tomllib.loads((Path(__file__).parents[1] / "presets" / "table-marginals.toml").read_text())
    preset["table-schema"] = json.dumps(json.loads(preset["table-schema"]))
    res = run_app({**preset, "out-dir": str(tmp_path), "run-name": "table", "min-honest-nodes": 2,
                   "marginal-rounds": 2}, federation_config="num-supernodes=2", timeout=1200)
    assert res.ok, f"{res.status}\n{res.output[-4000:]}"
    run_dir = tmp_path / "table"
    assert (run_dir / "synthetic.parquet").exists()
    report = json.loads((run_dir / "privacy_report.json").read_text())
    for node in report["nodes"]:
        assert [r["mechanism"] for r in node["releases"] if r["phase"] == "marginals"] == ["skellam"] * 2
        assert node["epsilon_spent"] <= node["epsilon_budget"] + 1e-6
    assert res.output.count("the masked sum of 2 sites unmasked") >= 2
