"""The node's ledger and the run config's validation."""

import dataclasses
import math
import time
from pathlib import Path

import pytest

from common.config import ConfigError, RunConfig
from fedsyn_client.holds import HOLD_UNCONFIRMED_SECONDS
from fedsyn_client.ledger import PrivacyLedger, Release
from fedsyn_client.refusals import BudgetExceeded


def _rel(eps, phase="profile", run_id="1", **public):
    public = public or {"sigma": 1.0, "sensitivity": 1.0}
    return Release(phase=phase, mechanism="gaussian", epsilon=eps, delta=1e-5, run_id=run_id, public=public)


def _release(led, rel, budget=math.inf, **kw):
    entry = led.reserve(rel, budget, **kw)
    led.confirm(entry)
    return entry


def test_ledger_persists_and_refuses_past_budget(tmp_path):
    led = PrivacyLedger.open(tmp_path, budget=8.0)
    _release(led, _rel(2.0))
    _release(led, _rel(6.0, "vote"))
    assert led.spent() == 8.0 and led.remaining() == 0.0 and led.delta_spent() == pytest.approx(2e-5)
    again = PrivacyLedger.open(tmp_path, budget=8.0)  # a node restart
    assert again.spent() == 8.0 and len(again.releases) == 2
    with pytest.raises(BudgetExceeded, match="0 left"):
        again.reserve(_rel(0.5), math.inf)
    assert len(PrivacyLedger.open(tmp_path, budget=8.0).releases) == 2  # nothing recorded


def test_a_preflight_hold_refuses_a_second_run_until_the_first_ends_or_lapses(tmp_path, monkeypatch):
    import fedsyn_client.ledger as ledger_module

    led = PrivacyLedger.open(tmp_path, budget=8.0)
    assert led.hold("A", 8.0).shortfall == 0.0  # run A can finish: 8 held for it
    refused = led.hold("B", 8.0)  # run B, started beside it, lacks all 8: refused, holds nothing
    assert refused.shortfall == pytest.approx(8.0)
    # the reply's numbers are the ones the decision was made on
    assert (refused.remaining, refused.held, refused.ref) == (0.0, pytest.approx(8.0), led.ref)
    assert led.remaining("B") == 0.0 and led.remaining("A") == 8.0
    with pytest.raises(BudgetExceeded, match="8 held for other runs"):
        led.reserve(_rel(2.0, run_id="B"), math.inf)  # a server that ignores the refusal still cannot spend it
    _release(led, _rel(2.0, run_id="A"))
    assert led.hold("A", 8.0).shortfall == 0.0  # A asked again (a resume): its own spending counts as paid
    assert led.summary()["epsilon_held"] == pytest.approx(6.0)
    led.release_hold("A")  # A's end-of-run ledger query: the 6 it did not spend are free again
    assert led.hold("B", 6.0).shortfall == 0.0 and led.remaining("C") == 0.0
    later = time.time() + HOLD_UNCONFIRMED_SECONDS + 1  # B's hold lapses (its server died)...
    monkeypatch.setattr(ledger_module.time, "time", lambda: later)
    assert led.remaining("C") == 6.0 and led.hold("C", 6.0).shortfall == 0.0  # ...and C may take it
    # unlimited: never short
    assert PrivacyLedger.open(tmp_path / "unlimited", budget=math.inf).hold("D", math.inf).shortfall == 0.0


def test_the_ledger_ref_is_random_kept_across_opens_and_resets(tmp_path):
    from fedsyn_client.ledger import reset_ledger

    ref = PrivacyLedger.open(tmp_path / "a", budget=8.0).ref
    assert len(ref) == 32 and PrivacyLedger.open(tmp_path / "a", budget=8.0).ref == ref
    assert PrivacyLedger.open(tmp_path / "b", budget=8.0).ref != ref
    reset_ledger(tmp_path / "a", "new data")
    assert PrivacyLedger.open(tmp_path / "a", budget=8.0).ref == ref  # the same institution


def test_a_new_budget_is_an_operators_act_not_a_node_config_edit(tmp_path):
    from fedsyn_client.ledger import LedgerError, set_budget

    _release(PrivacyLedger.open(tmp_path, budget=2.0), _rel(2.0))
    with pytest.raises(LedgerError, match="--set-budget 4"):  # the node config alone changes nothing
        PrivacyLedger.open(tmp_path, budget=4.0)
    assert PrivacyLedger.open(tmp_path, budget=2.0).budget == 2.0
    with pytest.raises(ValueError, match="reason"):
        set_budget(tmp_path, 4.0, "")
    assert set_budget(tmp_path, 4.0, "board approved 4") == 2.0
    led = PrivacyLedger.open(tmp_path, budget=4.0)
    _release(led, _rel(2.0, run_id="2"))
    assert led.spent() == 4.0
    change = led.summary()["budget_changes"][0]
    assert (change["from"], change["to"], change["reason"]) == (2.0, 4.0, "board approved 4")


def test_one_ledger_per_node_whatever_the_data(tmp_path):
    _release(PrivacyLedger.open(tmp_path, budget=2.0, data_fingerprint="a" * 64), _rel(2.0))
    other = PrivacyLedger.open(tmp_path, budget=2.0, data_fingerprint="b" * 64)  # the data file changed
    assert other.spent() == 2.0
    assert [d["fingerprint"] for d in other.summary()["data"]] == ["a" * 64, "b" * 64]
    assert PrivacyLedger.open(tmp_path, budget=2.0, ledger_id="second").spent() == 0.0  # an explicit other ledger


def test_reservations_stay_charged_whatever_happens(tmp_path):
    led = PrivacyLedger.open(tmp_path, budget=4.0)
    crashed = led.reserve(_rel(2.0), math.inf)  # never confirmed: a crash between reserve and confirm
    failed = led.reserve(_rel(2.0, "vote"), math.inf)
    led.fail(failed, "ValueError after the reservation")  # a failure is not a refund
    with pytest.raises(BudgetExceeded):
        led.reserve(_rel(1.0, "vote"), math.inf)
    assert led.spent() == 4.0
    assert {r["id"]: r["status"] for r in led.releases} == {crashed: "reserved", failed: "failed"}
    assert not hasattr(led, "cancel")


def test_a_reservation_cut_off_by_a_dead_process_is_taken_over_by_the_identical_request_only(tmp_path):
    """Issue 24: a ClientApp killed between reserve and confirm released nothing (confirmation
    precedes the reply). The same request again takes the reservation over: one entry, one
    charge, released once. Anything else stays refused: another request (a server probing with
    other inputs), an owner still alive (a round in flight), an owner on another machine or boot
    (unknown), other terms, a DP-SGD round."""
    import json
    import subprocess
    import sys

    led = PrivacyLedger.open(tmp_path, budget=20.0)
    _release(led, _rel(2.0))
    # Reserve in a child process that then dies (an actor killed mid-vote).
    code = ("import sys, math; from fedsyn_client.ledger import PrivacyLedger, Release; "
            "led = PrivacyLedger.open(sys.argv[1], budget=20.0); "
            "print(led.reserve(Release(phase='vote', mechanism='gaussian', epsilon=6.0, delta=1e-5, run_id='1', "
            "round=1, public={'sigma': 1.0, 'sensitivity': 1.0}), math.inf, digest='D'))")
    dead = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, check=True)
    orphan = dead.stdout.strip()
    vote = dataclasses.replace(_rel(6.0, "vote"), round=1)
    for other in (dataclasses.replace(vote, epsilon=5.0), dataclasses.replace(vote, public={"sigma": 0.5})):
        with pytest.raises(BudgetExceeded, match="in progress or was cut off"):
            led.reserve(other, math.inf, digest="D")  # other terms
    with pytest.raises(BudgetExceeded, match="in progress or was cut off"):
        led.reserve(vote, math.inf, digest="E")  # another request
    with pytest.raises(BudgetExceeded, match="in progress or was cut off"):
        led.reserve(vote, math.inf)  # no digest: no claim
    assert led.reserve(vote, math.inf, digest="D") == orphan  # the same request: taken over, nothing charged twice
    assert led.spent() == 8.0 and len(led.releases) == 2
    with pytest.raises(BudgetExceeded, match="in progress or was cut off"):
        led.reserve(vote, math.inf, digest="D")  # its new owner (this process) is alive: a round in flight
    data = json.loads(led.path.read_text())
    (entry,) = [r for r in data["releases"] if r["id"] == orphan]
    assert entry["takeovers"] == 1 and entry["claim"]["pid"] == __import__("os").getpid()
    boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    for elsewhere in ("another-machine/pid:[1]", f"{boot}/pid:[1]"):  # another host; another container's PIDs
        entry["claim"].update(pid=999999999, boot=elsewhere)  # a PID this process cannot see: unknown, not dead
        led.path.write_text(json.dumps(data))
        with pytest.raises(BudgetExceeded, match="in progress or was cut off"):
            led.reserve(vote, math.inf, digest="D")
    led.confirm(orphan)
    assert [s["phase"] for s in led.run_statements("1")] == ["profile", "vote"]
    # DP-SGD is never taken over: its Poisson batches would be a fresh draw of a data-dependent crash.
    code = code.replace("phase='vote', mechanism='gaussian'", "phase='train', mechanism='dp-sgd'")
    subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, check=True)
    train = Release(phase="train", mechanism="dp-sgd", epsilon=6.0, delta=1e-5, run_id="1", round=1,
                    public={"sigma": 1.0, "sensitivity": 1.0})
    with pytest.raises(BudgetExceeded, match="in progress or was cut off"):
        led.reserve(train, math.inf, digest="D")
    assert all("claim" not in s and "takeovers" not in s for s in led.run_statements("1"))  # never sent


def test_run_phase_and_step_budgets(tmp_path):
    led = PrivacyLedger.open(tmp_path, budget=10.0)
    _release(led, _rel(2.0), budget=2.0)
    with pytest.raises(BudgetExceeded, match="round 0 of this run was released on this node"):
        led.reserve(_rel(0.1), 2.0)  # once per run, phase and round
    with pytest.raises(BudgetExceeded, match="this run's profile budget"):
        led.reserve(dataclasses.replace(_rel(0.1), round=1), 2.0)
    _release(led, _rel(2.0, run_id="2"), budget=2.0)  # another run has its own share
    step = Release(phase="train", mechanism="dp-sgd", epsilon=0.0, delta=0.0, run_id="1", public={"steps": 4})
    _release(led, dataclasses.replace(step, round=1), budget=6.0, steps=(4, 8))
    _release(led, dataclasses.replace(step, round=2), budget=6.0, steps=(4, 8))
    with pytest.raises(BudgetExceeded, match="calibrated for 8 steps"):
        led.reserve(dataclasses.replace(step, round=3), 6.0, steps=(4, 8))
    assert led.spent(run_id="1", phase="profile") == 2.0 and led.spent(phase="profile") == 4.0


def test_non_private_release_refused_under_finite_budget(tmp_path):
    led = PrivacyLedger.open(tmp_path, budget=8.0)
    with pytest.raises(BudgetExceeded, match="non-private"):
        led.reserve(_rel(math.inf), math.inf)
    inf = PrivacyLedger.open(tmp_path / "x", budget=math.inf)
    _release(inf, _rel(math.inf))
    assert math.isinf(inf.spent())


def test_summary_pld_is_below_basic_and_counts_dpsgd(tmp_path):
    from common.dp import analytic_gaussian_sigma

    led = PrivacyLedger.open(tmp_path, budget=20.0)
    for eps in (2.0, 6.0):
        _release(led, _rel(eps, sigma=analytic_gaussian_sigma(eps, 1e-5, 1.0), sensitivity=1.0, run_id=str(eps)))
    entry = led.reserve(Release(phase="train", mechanism="dp-sgd", epsilon=6.0, delta=1e-5, run_id="t",
                                public={"steps": 24}), 6.0, steps=(24, 24))
    led.confirm(entry, {"noise_multiplier": 0.63, "sample_rate": 0.03, "steps": 24})
    summary = led.summary()
    assert summary["epsilon_spent"] == 14.0 and summary["delta_spent"] == pytest.approx(3e-5)
    assert 0 < summary["epsilon_pld"] < 14.0


def test_reset_is_an_operator_act_with_a_reason(tmp_path):
    from fedsyn_client.ledger import reset_ledger

    _release(PrivacyLedger.open(tmp_path, budget=8.0), _rel(2.0))
    with pytest.raises(ValueError, match="reason"):
        reset_ledger(tmp_path, "  ")
    archive = reset_ledger(tmp_path, "new data export 2026-11")
    led = PrivacyLedger.open(tmp_path, budget=8.0)
    assert led.spent() == 0.0 and archive.exists()
    assert led.summary()["resets"][0]["reason"] == "new data export 2026-11"
    assert led.summary()["resets"][0]["previous_epsilon_spent"] == 2.0


def test_format_1_ledgers_are_carried_over(tmp_path):
    import json

    old = {"fingerprint": "f" * 64, "budget": 8.0, "releases": [
        {"phase": "profile", "mechanism": "gaussian", "epsilon": 2.0, "delta": 1e-5, "run_id": "9"}]}
    (tmp_path / f"ledger-{'f' * 16}.json").write_text(json.dumps(old))
    assert PrivacyLedger.open(tmp_path, budget=8.0).spent() == 2.0


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
    ("contrastive-weight", -1.0, "the paper's loss"),
    ("coverage-floor", 1.5, r"\[0, 1\]"),
    ("bogus-key", 1, "unknown run-config key"),
])
def test_invalid_config_names_key_value_and_allowed(key, value, fragment):
    with pytest.raises(ConfigError, match=fragment) as err:
        RunConfig.from_flower({key: value})
    assert key in str(err.value)


def test_inf_epsilon_and_paper_delta():
    cfg = RunConfig.from_flower({"epsilon": "inf", "delta": "paper"})
    assert not cfg.private and math.isinf(cfg.budget().main)
    assert cfg.resolve_delta(num_records=10) == pytest.approx(1 / (20 * math.log(10)))


def test_fedsyn_ledger_command_shows_and_resets(tmp_path, capsys):
    import json

    from fedsyn_server.cli import main

    led = PrivacyLedger.open(tmp_path, budget=8.0)
    _release(led, _rel(2.0, run_id="42"))
    assert main(["ledger", str(tmp_path)]) == 0
    table = capsys.readouterr().out
    assert "epsilon = 8" in table and "remaining        epsilon = 6" in table and "profile" in table
    assert main(["ledger", str(tmp_path), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["epsilon_spent"] == 2.0 and summary["releases"][0]["run_id"] == "42"
    assert led.hold("43", 5.0).shortfall == 0.0  # a run under way (or one that crashed) holds 5
    assert main(["ledger", str(tmp_path)]) == 0
    assert "remaining        epsilon = 1 (5 held for runs under way: 43)" in capsys.readouterr().out
    assert main(["ledger", str(tmp_path), "--release-holds"]) == 0
    assert "ended 1 hold(s): runs 43" in capsys.readouterr().out and led.remaining() == 6.0
    assert main(["ledger", str(tmp_path), "--reset"]) == 2  # a reset needs a reason
    assert main(["ledger", str(tmp_path), "--reset", "--reason", "new export"]) == 0
    assert PrivacyLedger.open(tmp_path, budget=8.0).spent() == 0.0
    assert main(["ledger", str(tmp_path / "nowhere")]) == 2


def test_admission_rules_read_only_the_ledgers_data_and_name_the_rule_that_refused():
    """``fedsyn_client.admission`` without a file: each rule refuses on the ledger's own numbers."""
    from fedsyn_client import admission, refusals

    now = time.time()
    entry = {"status": admission.CONFIRMED, "run_id": "a", "phase": "vote", "round": 1, "epsilon": 3.0, "time": now,
             "public": {}, "binding": {"sigma": 1.0}}
    data = {"budget": 8.0, "releases": [entry, {**entry, "status": admission.CANCELLED, "run_id": "old"}],
            "holds": {"b": {"epsilon": 4.0, "until": now + 60}}}
    assert admission.spent(data["releases"]) == 3.0  # a cancelled entry never counts
    assert admission.remaining(data, "a") == pytest.approx(1.0)  # run b holds 4 of the 5 left
    assert admission.remaining(data, "b") == pytest.approx(5.0)

    def rule(**kw) -> str:
        args = {"phase": "vote", "epsilon": 1.0, "run_id": "a", "rnd": 2, "run_phase_budget": 6.0, **kw}
        with pytest.raises(BudgetExceeded) as err:
            admission.admit(data, **args)
        return err.value.rule

    assert rule(epsilon=2.0) == refusals.BUDGET  # 2 > the 1 left beside b's hold
    assert rule(cap=(3.5, 0.0)) == refusals.BUDGET_CAP
    assert rule(binding={"sigma": 2.0}) == refusals.BUDGET_BOUND
    assert rule(rnd=1) == refusals.BUDGET_ROUND
    assert rule(run_phase_budget=3.5) == refusals.BUDGET_PHASE
    assert rule(steps=(2, 1)) == refusals.BUDGET_STEPS
    assert admission.admit(data, "vote", 1.0, "a", 2, 6.0, binding={"sigma": 1.0}) == {"sigma": 1.0}
    assert admission.admit(data, "profile", 1.0, "a", 1, 2.0) is None  # the phase's first: it binds


def test_a_run_without_dp_keeps_its_binding_through_the_ledger_file(tmp_path):
    """A run at epsilon = inf binds its phase to epsilon inf, which the ledger file writes as "inf":
    its round 2 was refused as "bound to other terms (epsilon differ)" (found by the canary audit's
    non-private control run, issue 63). Compared as written, the same terms are the same."""
    ledger = PrivacyLedger.open(tmp_path, math.inf)
    binding = {"epsilon": math.inf, "delta": 1e-5, "vocabulary": ("topic=x",), "rounds": 2}
    for rnd in (1, 2):
        rel = Release(phase="train", mechanism="dpsgd", epsilon=math.inf, delta=1e-5, run_id="r", round=rnd)
        ledger.reserve(rel, math.inf, binding=binding)
    with pytest.raises(BudgetExceeded, match="epsilon differ"):
        ledger.reserve(Release(phase="train", mechanism="dpsgd", epsilon=math.inf, delta=1e-5, run_id="r", round=3),
                       math.inf, binding={**binding, "epsilon": 6.0})


def test_node_check_explains_a_ledger_that_composes_above_its_budget(tmp_path):
    """Issue 75: a ledger whose releases compose above the budget at the policy's delta (made under
    another rule or delta: here one stated at epsilon 1 whose sigma gives far more) refused every
    request without node-check's reader learning why; node-check now names it and the two fixes."""
    from fedsyn_client.node import check_node
    from fedsyn_client.refusals import NodeSetupError
    from tests.test_sovereign import _csv

    state = tmp_path / "state"
    _release(PrivacyLedger.open(state, budget=3.0), _rel(1.0, sigma=0.3, sensitivity=1.0))
    config = {"tier": "weak", "data-path": _csv(tmp_path / "d.csv"), "epsilon": 3.0, "state-dir": str(state),
              "max-records": 25}
    with pytest.raises(NodeSetupError, match=r"composes to epsilon = [0-9.]+ at the policy's delta = 1e-05 .*above "
                                             r"its budget 3 .*--set-budget .*--reset"):
        check_node(config)
    fine = tmp_path / "fine"
    _release(PrivacyLedger.open(fine, budget=3.0), _rel(1.0, sigma=6.0, sensitivity=1.0))
    assert "at the policy's delta by pld; 1 by the stated epsilons" in check_node({**config, "state-dir": str(fine)})
