"""Issue 47 on a node: under ``accounting = "pld"`` the ledger prices each release by a
privacy-loss distribution, and the noise is solved so that the run spends its budget by it.

Every composition here is recomputed with ``dp_accounting`` directly from the ledger's entries,
not through the project's code (``common.calibration``), at the node's policy delta (issue 60:
never at the sum of the releases' deltas)."""

from __future__ import annotations

import math

import pytest
from dp_accounting import dp_event
from dp_accounting.pld import pld_privacy_accountant
from flwr.app import ConfigRecord, Message, RecordDict

from common import records as R
from common.config import RunConfig
from common.dp import analytic_gaussian_sigma, dpsgd_noise_multiplier
from common.records import ERR_BUDGET
from fedsyn_client.ledger import PrivacyLedger
from fedsyn_client.policy import PolicyError, policy_from_node_config as load_policy
from tests import test_strategy
from tests.fakes import set_task_identity
from tests.test_sovereign import BUDGET, VOCAB, _csv, _node, _rc

# test_strategy's data set: a fixture, bound to its name here so that pytest finds it for this module's tests
dataset = test_strategy.dataset

DELTA = 1e-5
EPS_PROFILE = 2.0  # _rc's epsilon-profile; a weak node's vote gets BUDGET - EPS_PROFILE


def _pld(events: list, delta: float) -> float:
    acc = pld_privacy_accountant.PLDAccountant(value_discretization_interval=1e-4)
    for e in events:
        acc.compose(e)
    return float(acc.get_epsilon(delta))


def _entries(state) -> list[dict]:
    return [r for r in PrivacyLedger.open(state, budget=BUDGET).releases if r["status"] != "cancelled"]


def _profile(node) -> Message:
    set_task_identity()
    return node(Message(content=RecordDict({R.CONFIG: ConfigRecord({"codes": VOCAB, "delta": DELTA})}),
                        message_type=R.MSG_PROFILE, dst_node_id=5))


def _vote(node, rnd: int, share: float) -> Message:
    set_task_identity()
    conf = {"codes": VOCAB, "delta": DELTA, "histogram": "knn-vote", "epsilon-share": share, "server-round": rnd,
            "num-votes": 1}
    content = RecordDict({R.CANDIDATES: ConfigRecord({"texts": ["the x", "the y"], "codes": VOCAB}),
                          R.CONFIG: ConfigRecord(conf)})
    return node(Message(content=content, message_type=R.MSG_VOTE, dst_node_id=5))


@pytest.fixture
def data(tmp_path) -> str:
    return _csv(tmp_path / "records.csv")


def test_a_weak_nodes_vote_rounds_spend_its_budget_by_pld_and_a_round_more_is_refused(data, tmp_path):
    state = tmp_path / "state"
    node = _node(data, state, _rc(data, **{"num-votes": 1}), run_id=1, accounting="pld")
    assert not _profile(node).has_error()
    for rnd in (1, 2, 3):
        reply = _vote(node, rnd, 1 / 3)
        assert not reply.has_error(), reply.error
    entries = _entries(state)
    profile, votes = entries[0], entries[1:]
    # the profile comes first: one Gaussian is exact either way, so its sigma is basic's
    assert profile["public"]["sigma"] == pytest.approx(analytic_gaussian_sigma(EPS_PROFILE, DELTA, 1.0), rel=1e-3)
    sigma = votes[0]["public"]["sigma"]
    assert {v["public"]["sigma"] for v in votes} == {sigma}  # one sigma for the phase's rounds
    # basic: epsilon / 3 per round at its split of the policy's delta (issue 60: a third of a third)
    basic = analytic_gaussian_sigma((BUDGET - EPS_PROFILE) / 3, DELTA * (BUDGET - EPS_PROFILE) / 3 / BUDGET, 1.0)
    assert sigma < 0.9 * basic  # less noise for the same budget
    # each statement says its rule, its sigma under the other one and the delta it composes at (public)
    assert {(v["public"]["accounting"], v["public"]["composed_delta"]) for v in votes} == {("pld", DELTA)}
    assert [v["public"]["sigma_basic"] for v in votes] == pytest.approx([basic] * 3, rel=1e-12)
    composed = _pld([dp_event.GaussianDpEvent(profile["public"]["sigma"])]
                    + [dp_event.GaussianDpEvent(sigma)] * 3, DELTA)
    charged = sum(r["epsilon"] for r in entries)
    assert 0.97 * BUDGET <= composed <= BUDGET + 1e-3 and charged == pytest.approx(composed, abs=1e-2)
    assert charged <= BUDGET + 1e-6
    # round 1 pays more than round 3: the rounds compose exactly, not epsilon / T each
    assert votes[0]["epsilon"] > votes[2]["epsilon"] > 0
    refused = _vote(node, 4, 1 / 3)
    assert refused.error.code == ERR_BUDGET and len(_entries(state)) == 4


def test_fedsyn_ledger_prints_the_composition_at_the_policys_delta(data, tmp_path, capsys):
    """Issue 75: the operator's table gives what admission holds to the budget, the composition at
    the policy's delta, not at the releases' summed delta (which grows with every release)."""
    from common.calibration import ledger_epsilon
    from fedsyn_server.cli import main

    state = tmp_path / "state"
    node = _node(data, state, _rc(data, **{"num-votes": 1}), run_id=1, accounting="pld")
    assert not _profile(node).has_error()
    for rnd in (1, 2):
        assert not _vote(node, rnd, 1 / 2).has_error()
    composed = ledger_epsilon(_entries(state), DELTA)
    assert main(["ledger", str(state)]) == 0
    spent = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("spent"))
    assert f"{composed:.4g} (PLD at the policy's delta = {DELTA:.3g})" in spent, spent
    assert composed <= BUDGET + 1e-6


def test_a_strong_nodes_dpsgd_noise_is_solved_with_its_profile_by_pld(data, tmp_path, caplog):
    """The noise multiplier (private: it depends on q) is solved on the node so that its profile
    and all of phase 1's steps compose by PLD to the budget; the charge stays epsilon_train. The
    training log says the ledger's epsilon, within the phase's budget (issue 75: it said Opacus' RDP
    figure, 5.218 of 3 in the default run)."""
    import logging
    import re

    from fedsyn_server.synthesis import ServerModel

    state, rc = tmp_path / "state", _rc(data, voters="weak")  # the strong node trains with all but its profile
    node = _node(data, state, rc, run_id=1, tier="strong", accounting="pld")
    assert not _profile(node).has_error()
    set_task_identity()
    content = RecordDict({R.CONFIG: ConfigRecord({"codes": VOCAB, "delta": DELTA, "server-round": 1}),
                          R.ARRAYS: ServerModel(RunConfig.from_flower(rc)).initial_arrays()})
    with caplog.at_level(logging.INFO):
        reply = node(Message(content=content, message_type=R.MSG_TRAIN, dst_node_id=5))
    assert not reply.has_error(), reply.error
    profile, train = _entries(state)
    said = [re.search(r"phase-1 epsilon so far ([0-9.e+-]+) of ([0-9.e+-]+) at delta ([0-9.e+-]+)", r.getMessage())
            for r in caplog.records]
    said = [m for m in said if m]
    assert len(said) == 1, [r.getMessage() for r in caplog.records]
    logged, of, at = (float(x) for x in said[0].groups())
    assert logged == pytest.approx(train["private"]["epsilon_pld"], rel=1e-3) and logged <= of + 1e-3
    assert of == pytest.approx(BUDGET - EPS_PROFILE) and at == pytest.approx(DELTA)
    assert train["epsilon"] == pytest.approx(BUDGET - EPS_PROFILE) and "noise_multiplier" not in train["public"]
    nm, q, steps = (train["private"][k] for k in ("noise_multiplier", "sample_rate", "steps"))
    assert nm < dpsgd_noise_multiplier(BUDGET - EPS_PROFILE, DELTA, q, steps)  # Opacus' RDP, the basic rule
    step = dp_event.PoissonSampledDpEvent(q, dp_event.GaussianDpEvent(nm))
    composed = _pld([dp_event.GaussianDpEvent(profile["public"]["sigma"]), dp_event.SelfComposedDpEvent(step, steps)],
                    DELTA)
    assert 0.97 * BUDGET <= composed <= BUDGET + 1e-3


def test_a_dpsgd_phase_no_finite_noise_spends_is_refused_before_its_reservation(data, tmp_path, monkeypatch):
    """Issue 75: as a Gaussian release is, a DP-SGD phase whose share no finite noise spends on the
    node's ledger (the rule's solve says inf) is refused as a budget before anything is reserved;
    it was reserved, charged, and failed on an infinite noise multiplier."""
    from common.accounting import Pld
    from fedsyn_server.synthesis import ServerModel

    state, rc = tmp_path / "state", _rc(data, voters="weak")
    node = _node(data, state, rc, run_id=1, tier="strong", accounting="pld")
    assert not _profile(node).has_error()
    monkeypatch.setattr(Pld, "dpsgd_noise", lambda self, base, phase, delta: math.inf)
    set_task_identity()
    content = RecordDict({R.CONFIG: ConfigRecord({"codes": VOCAB, "delta": DELTA, "server-round": 1}),
                          R.ARRAYS: ServerModel(RunConfig.from_flower(rc)).initial_arrays()})
    reply = node(Message(content=content, message_type=R.MSG_TRAIN, dst_node_id=5))
    assert reply.has_error() and reply.error.code == ERR_BUDGET, reply.error
    assert [e["phase"] for e in _entries(state)] == ["profile"]  # nothing of phase 1 reserved or charged


def test_a_changed_node_config_delta_needs_the_operators_set_budget(data, tmp_path, capsys):
    """Issue 75: delta is pinned in the ledger as epsilon is. A larger node-config delta would lower
    every epsilon the ledger has spent (they are composed at it), so the node does not serve under it
    until the operator changes the budget on purpose; the change is kept and shown."""
    from fedsyn_server.cli import main

    state = tmp_path / "state"
    assert not _profile(_node(data, state, _rc(data), run_id=1, accounting="pld")).has_error()
    wider = _node(data, state, _rc(data), run_id=2, accounting="pld", delta=1e-4)
    reply = _profile(wider)
    assert reply.has_error() and len(_entries(state)) == 1  # not served, nothing spent
    assert main(["ledger", str(state), "--delta", "1e-4", "--reason", "r"]) == 2  # only with --set-budget
    assert main(["ledger", str(state), "--set-budget", str(2 * BUDGET), "--delta", "1e-4",
                 "--reason", "the board accepted delta 1e-4"]) == 0
    assert "delta=0.0001" in capsys.readouterr().out
    again = _node(data, state, _rc(data), run_id=2, accounting="pld", delta=1e-4, epsilon=2 * BUDGET)
    assert not _profile(again).has_error()
    assert main(["ledger", str(state)]) == 0
    shown = capsys.readouterr().out
    assert f"budget change    {BUDGET:g} -> {2 * BUDGET:g}, delta 1e-05 -> 0.0001" in shown, shown
    assert "(PLD at the policy's delta = 0.0001)" in shown


def test_pld_is_the_default_basic_can_be_pinned_and_a_misspelt_rule_stops_the_node(data, tmp_path):
    base = {"tier": "weak", "data-path": data, "max-records": 100, "epsilon": BUDGET}
    assert load_policy(base).accounting == "pld" and RunConfig().accounting == "pld"
    assert load_policy({**base, "accounting": "basic"}).accounting == "basic"
    with pytest.raises(PolicyError, match="accounting = 'rdp' must be one of basic, pld"):
        load_policy({**base, "accounting": "rdp"})
    node = _node(data, tmp_path / "s", _rc(data, **{"num-votes": 1}), run_id=1, accounting="basic")
    assert not _profile(node).has_error() and not _vote(node, 1, 0.5).has_error()
    entries = _entries(tmp_path / "s")
    assert [r["epsilon"] for r in entries] == pytest.approx([EPS_PROFILE, (BUDGET - EPS_PROFILE) / 2])
    # basic adds deltas too (issue 60): each release's is its part of the node's epsilon, of the policy's
    assert [r["delta"] for r in entries] == pytest.approx([DELTA * EPS_PROFILE / BUDGET, DELTA / 6])
    assert math.isclose(entries[1]["public"]["sigma"],
                        analytic_gaussian_sigma((BUDGET - EPS_PROFILE) / 2, DELTA / 6, 1.0))


def test_a_basic_runs_charges_stay_and_a_pld_release_over_the_budget_is_refused_before_the_records(data, tmp_path,
                                                                                                  monkeypatch):
    """A ledger written under basic (another run, or today's code) keeps its charges when the node
    switches to pld; a release the budget cannot take is refused before any record is read."""
    from fedsyn_client import node as node_module

    state = tmp_path / "state"
    assert not _profile(_node(data, state, _rc(data), run_id=1, accounting="basic")).has_error()  # charged 2 of 3
    assert PrivacyLedger.open(state, budget=BUDGET).spent() == pytest.approx(EPS_PROFILE)
    read = []
    monkeypatch.setattr(node_module.Node, "code_counts", lambda self, *a, **k: read.append(1) or (_ for _ in ()).throw(
        AssertionError("a record was read")))
    refused = _profile(_node(data, state, _rc(data), run_id=2, accounting="pld"))
    assert refused.error.code == ERR_BUDGET and not read
    assert PrivacyLedger.open(state, budget=BUDGET).spent() == pytest.approx(EPS_PROFILE)


def test_a_whole_run_under_pld_spends_each_nodes_budget_by_pld_and_never_more(dataset, tmp_path):
    """Issue 47's first test, on the tiny model: the run under accounting = pld, then every node's
    ledger composed as one by dp_accounting here (a strong node's votes after its DP-SGD too), at
    the nodes' policy delta (the run's, in simulation; issue 60)."""
    from tests.test_strategy import nodes_for, run, run_config

    rc = run_config(dataset, accounting="pld", voters="all", **{"refinement": "pe-contrastive", "refinement-rounds": 2})
    res, _, _ = run(rc, nodes_for(rc, 3, tmp_path))
    assert not res.failures and len(res.vote_rounds) == 2
    for pid, tier in enumerate(("strong", "weak", "weak")):
        entries = [r for r in PrivacyLedger.open(tmp_path / f"node{pid}", budget=8.0).releases]
        assert {r["public"].get("accounting") for r in entries} == {"pld"}
        events = []
        for r in entries:
            if r["mechanism"] == "dp-sgd":
                p = r["private"]
                step = dp_event.PoissonSampledDpEvent(p["sample_rate"], dp_event.GaussianDpEvent(p["noise_multiplier"]))
                events.append(dp_event.SelfComposedDpEvent(step, p["steps"]))
            else:
                events.append(dp_event.GaussianDpEvent(r["public"]["sigma"] / r["public"]["sensitivity"]))
        spent = _pld(events, RunConfig.from_flower(rc).resolve_delta(0))
        charged = sum(r["epsilon"] for r in entries)
        assert 0.97 * 8.0 <= spent <= 8.0 + 1e-3 and charged <= 8.0 + 1e-6, (tier, spent, charged)
    # the server asked the profile before phase 1, so the strong node's DP-SGD was solved on the
    # profile's Gaussian: less noise than the same (epsilon, delta) solved alone
    from common.calibration import Planned, pld_noise
    from common.dp import DPSGD, TRAIN, VOTE

    strong = PrivacyLedger.open(tmp_path / "node0", budget=8.0).releases
    # profile, DP-SGD, then (voters = "all", the default) its votes, composed with DP-SGD
    phases = [r["phase"] for r in strong[1:]]
    assert strong[0]["phase"] == "profile" and set(phases) == {TRAIN, VOTE}
    assert phases == sorted(phases, key=lambda p: p == VOTE)  # every DP-SGD release before the first vote
    train, cfg = strong[1], RunConfig.from_flower(rc)
    alone = pld_noise((), Planned(TRAIN, DPSGD, train["epsilon"], train["delta"],
                                  sample_rate=train["private"]["sample_rate"],
                                  steps=cfg.num_server_rounds * cfg.local_steps), cfg.resolve_delta(0))
    assert train["private"]["noise_multiplier"] < 0.97 * alone
