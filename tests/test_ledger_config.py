"""The node's ledger and the run config's validation."""

import math

import pytest

from common.config import ConfigError, RunConfig
from common.ledger import BudgetExceeded, PrivacyLedger, Release


def _rel(eps, phase="profile"):
    return Release(phase=phase, mechanism="gaussian", epsilon=eps, delta=1e-5, sigma=1.0, sensitivity=1.0)


def test_ledger_persists_and_refuses_past_budget(tmp_path):
    led = PrivacyLedger.open(tmp_path, "f" * 64, budget=8.0)
    led.record(_rel(2.0))
    led.record(_rel(6.0, "vote"))
    assert led.spent() == 8.0 and led.remaining() == 0.0
    again = PrivacyLedger.open(tmp_path, "f" * 64, budget=8.0)  # a node restart
    assert again.spent() == 8.0 and len(again.releases) == 2
    with pytest.raises(BudgetExceeded, match="0 left"):
        again.record(_rel(0.5))
    assert len(PrivacyLedger.open(tmp_path, "f" * 64, budget=8.0).releases) == 2  # nothing recorded


def test_a_new_budget_must_be_given_explicitly_and_is_logged(tmp_path):
    PrivacyLedger.open(tmp_path, "a" * 64, budget=2.0).record(_rel(2.0))
    led = PrivacyLedger.open(tmp_path, "a" * 64, budget=4.0)
    led.record(_rel(2.0))
    assert led.spent() == 4.0
    assert led._data["budget_changes"][0]["to"] == 4.0


def test_ledger_is_per_dataset(tmp_path):
    PrivacyLedger.open(tmp_path, "a" * 64, budget=2.0).record(_rel(2.0))
    assert PrivacyLedger.open(tmp_path, "b" * 64, budget=2.0).spent() == 0.0


def test_non_private_release_refused_under_finite_budget(tmp_path):
    led = PrivacyLedger.open(tmp_path, "c" * 64, budget=8.0)
    with pytest.raises(BudgetExceeded, match="non-private"):
        led.record(_rel(math.inf))
    inf = PrivacyLedger.open(tmp_path / "x", "c" * 64, budget=math.inf)
    inf.record(_rel(math.inf))
    assert math.isinf(inf.spent())


def test_spent_by_run_and_phase(tmp_path):
    led = PrivacyLedger.open(tmp_path, "d" * 64, budget=10.0)
    led.record(Release(phase="train", mechanism="dp-sgd", epsilon=1.5, delta=1e-5, run_id="1",
                       noise_multiplier=1.0, sample_rate=0.1, steps=3))
    led.record(_rel(2.0))
    assert led.spent(run_id="1", phase="train") == 1.5 and led.spent(phase="profile") == 2.0


def test_default_config_is_valid_and_round_trips():
    import tomllib
    from pathlib import Path

    raw = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]
    cfg = RunConfig.from_flower(raw)
    assert RunConfig.from_flower(cfg.to_flower()) == cfg
    assert set(raw) == set(cfg.to_flower())  # every knob has a default in pyproject.toml
    assert cfg.budget().main == 6.0 and cfg.resolve_delta(2) == 1e-5


@pytest.mark.parametrize("key,value,fragment", [
    ("batch-size", 0, "batch-size"),
    ("epsilon", -1.0, "epsilon"),
    ("epsilon-profile", 9.0, "epsilon-profile"),
    ("refinement", "magic", "knn-vote"),
    ("voters", "some", "weak"),
    ("finetune", "half", "lora"),
    ("delta", "often", "paper"),
    ("partitioning", "dirichlet:-1", "partitioning"),
    ("sampling-rate", 0.0, "sampling-rate"),
    ("num-server-rounds", 1.5, "num-server-rounds"),
    ("bogus-key", 1, "unknown run-config key"),
])
def test_invalid_config_names_key_value_and_allowed(key, value, fragment):
    with pytest.raises(ConfigError, match=fragment) as err:
        RunConfig.from_flower({key: value})
    assert key in str(err.value)


def test_inf_epsilon_and_paper_delta():
    cfg = RunConfig.from_flower({"epsilon": "inf", "delta": "paper"})
    assert not cfg.private and math.isinf(cfg.budget().main)
    assert cfg.resolve_delta(10) == pytest.approx(1 / (20 * math.log(10)))
