"""The real thing: ``flwr run`` of the app (local SuperLink, Ray simulation, real messages)."""

from __future__ import annotations

import json

import pytest

from common.io import read_jsonl
from fedsyn_server.flwr_runner import run_app


@pytest.mark.flwr
def test_flwr_run_tiny_model_writes_all_outputs(tmp_path):
    res = run_app({
        "model": "tiny-gpt2", "num-server-rounds": 1, "local-steps": 2, "batch-size": 4,
        "num-synthetic": 20, "max-new-tokens": 8, "out-dir": str(tmp_path), "run-name": "tiny",
        "test-fraction": 0.02, "strong-fraction": 0.34,
    }, federation_config="num-supernodes=3", timeout=1200)
    assert res.ok, f"{res.status}\n{res.output[-4000:]}"
    run_dir = tmp_path / "tiny"
    assert res.run_dir == run_dir
    for name in ("synthetic.jsonl", "pool.jsonl", "privacy_report.json", "profile.json", "metrics.json",
                 "config.json", "heldout.jsonl", "evaluation.json", "plots/allocation.png", "plots/votes_per_code.png",
                 "model/adapter_config.json"):
        assert (run_dir / name).exists(), name
    synthetic = read_jsonl(run_dir / "synthetic.jsonl")
    assert synthetic and all({"text", "control_code", "topic"} <= set(r) for r in synthetic)
    report = json.loads((run_dir / "privacy_report.json").read_text())
    assert len(report["nodes"]) == 3
    tiers = sorted(n["tier"] for n in report["nodes"])
    assert tiers == ["strong", "weak", "weak"]
    for node in report["nodes"]:
        assert node["epsilon_spent"] <= node["epsilon_budget"] + 1e-6
        assert node["epsilon_pld"] <= node["epsilon_basic_composition"] + 1e-9
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["failures"] == [] and metrics["final_size"] == len(synthetic)
    evaluation = json.loads((run_dir / "evaluation.json").read_text())
    assert 0.0 <= evaluation["utility"]["topic"]["accuracy"] <= 1.0
    assert evaluation["n_synthetic"] == len(synthetic) and evaluation["n_real"] > 0


@pytest.mark.slow
@pytest.mark.flwr
def test_default_run_with_real_weights_follows_the_noisy_profile(tmp_path):
    """`flwr run .` with every pyproject default (SmolLM2, MiniLM, BBC News, 2 nodes)."""
    from strategies.resampling import sample_size

    res = run_app({"out-dir": str(tmp_path), "run-name": "default"}, timeout=2400)
    assert res.ok, f"{res.status}\n{res.output[-4000:]}"
    run_dir = tmp_path / "default"
    profile = json.loads((run_dir / "profile.json").read_text())
    assert len(profile["vocabulary"]) == 5
    for code, n in profile["allocation"].items():
        assert profile["final_counts"][code] == (sample_size(n, 0.5) if n else 0)
    report = json.loads((run_dir / "privacy_report.json").read_text())
    assert sorted(n["tier"] for n in report["nodes"]) == ["strong", "weak"]
    for node in report["nodes"]:
        assert 7.9 <= node["epsilon_spent"] <= node["epsilon_budget"] + 1e-6
    texts = [r["text"] for r in read_jsonl(run_dir / "synthetic.jsonl")]
    assert len(texts) >= 50 and sum(len(t.split()) for t in texts) / len(texts) > 15
    assert (run_dir / "evaluation.json").exists() and (run_dir / "model" / "adapter_config.json").exists()
