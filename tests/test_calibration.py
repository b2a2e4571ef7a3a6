"""Issue 47's calibration (common.calibration) against dp_accounting, composed here by hand.

Each expected value is computed in the test with dp_accounting's own PLD accountant and events,
not through the project's composition helpers, so a mistake in those cannot hide here. Since
issue 60 every composition is read at the node's policy delta (``DELTA``), never at the sum of the
phases' deltas.
"""

from __future__ import annotations

import math

import pytest
from dp_accounting import dp_event
from dp_accounting.pld import pld_privacy_accountant

from common.accounting import Basic, Pld, calibrate
from common.calibration import Planned
from common.dp import DPSGD, GAUSSIAN

BASIC, PLD = Basic.name, Pld.name

DELTA = 1e-5
PROFILE = Planned("profile", GAUSSIAN, 2.0, DELTA, sensitivity=1.0)
WEAK = [PROFILE, Planned("vote", GAUSSIAN, 6.0, DELTA, sensitivity=math.sqrt(8))]
STRONG = [PROFILE, Planned("train", DPSGD, 6.0, DELTA, sample_rate=32 / 1000, steps=6)]
PE = [PROFILE, Planned("vote", GAUSSIAN, 6.0, DELTA, sensitivity=math.sqrt(2), rounds=3)]
ALL_VOTERS = [PROFILE, Planned("train", DPSGD, 3.0, DELTA, sample_rate=32 / 1000, steps=6),
              Planned("vote", GAUSSIAN, 3.0, DELTA, sensitivity=math.sqrt(8))]


def independent_epsilon(plan: list[Planned], noises: list[float], delta: float = DELTA) -> float:
    """The plan's PLD epsilon at the policy's ``delta``, built from dp_accounting alone (its
    default discretisation, finer than the project's)."""
    acc = pld_privacy_accountant.PLDAccountant()
    for phase, noise in zip(plan, noises):
        if phase.mechanism == DPSGD:
            step = dp_event.PoissonSampledDpEvent(phase.sample_rate, dp_event.GaussianDpEvent(noise))
            acc.compose(dp_event.SelfComposedDpEvent(step, phase.steps))
        else:
            acc.compose(dp_event.GaussianDpEvent(noise / phase.sensitivity), phase.rounds)
    return acc.get_epsilon(delta)


@pytest.mark.parametrize("plan", [WEAK, STRONG, PE, ALL_VOTERS], ids=["weak", "strong", "pe-3-rounds", "voters-all"])
def test_the_pld_rule_spends_between_97_and_100_percent_of_the_budget(plan):
    budget = sum(p.share for p in plan)
    noises = calibrate(plan, PLD)
    # every phase composes with all before it, a vote after DP-SGD too (q is public: B / max-records)
    assert 0.97 * budget <= independent_epsilon(plan, noises) <= budget


def test_a_strong_voters_sigma_composes_with_its_dpsgd():
    # the issue's default split with voters = "all": priced apart from DP-SGD, the vote's sigma
    # was 3.93 and the node's ledger composed to 5.5 of 8 (at 3 delta; 4.0 at the policy's)
    pld, basic = calibrate(ALL_VOTERS, PLD), calibrate(ALL_VOTERS, BASIC)
    assert basic[2] == pytest.approx(3.93, abs=0.01)
    assert pld[2] < 0.5 * basic[2]
    assert independent_epsilon(ALL_VOTERS, [basic[0], basic[1], basic[2]]) < 0.75 * 8


def test_charges_add_up_to_the_runs_pld_composition_and_a_dpsgd_phase_composes_by_its_terms():
    from common.calibration import OPAQUE, base_epsilon, pld_charge, release_base

    train = [{"mechanism": DPSGD, "phase": "train", "public": {"steps": 3}, "delta": DELTA, "round": 1, "epsilon": 3.0,
              "status": "confirmed", "binding": {"rounds": 2, "local_steps": 3}},
             {"mechanism": DPSGD, "phase": "train", "public": {"steps": 3}, "delta": 0.0, "round": 2, "epsilon": 0.0,
              "status": "confirmed", "private": {"noise_multiplier": 0.6, "sample_rate": 0.032, "steps": 3}}]
    entries = [{"mechanism": GAUSSIAN, "phase": "profile", "public": {"sigma": 2.0, "sensitivity": 1.0}, "delta": DELTA,
                "epsilon": 2.0},
               *train,
               {"mechanism": GAUSSIAN, "phase": "vote", "public": {"sigma": 3.0, "sensitivity": 2.0}, "delta": DELTA,
                "epsilon": 1.0},
               {"mechanism": GAUSSIAN, "phase": "vote", "public": {"sigma": 0.0, "sensitivity": 2.0}, "delta": DELTA,
                "epsilon": math.inf}]
    # the whole phase (R x tau steps at round 1's delta) from any confirmed round's terms; a sigma of
    # 0 (no DP) is a release at epsilon inf
    assert release_base(entries) == ((2.0, 1.0, DELTA), (DPSGD, 0.6, 0.032, 6, DELTA), (3.0, 2.0, DELTA),
                                     (OPAQUE, math.inf, 0.0))
    acc = pld_privacy_accountant.PLDAccountant()
    acc.compose(dp_event.GaussianDpEvent(2.0))
    acc.compose(dp_event.SelfComposedDpEvent(dp_event.PoissonSampledDpEvent(0.032, dp_event.GaussianDpEvent(0.6)), 6))
    acc.compose(dp_event.GaussianDpEvent(1.5))
    # composed at the policy's delta, however many releases asked for theirs (issue 60)
    assert base_epsilon(release_base(entries[:4]), DELTA) == pytest.approx(acc.get_epsilon(DELTA), abs=1e-3)
    assert base_epsilon(release_base(entries), DELTA) == math.inf
    # a phase none of whose rounds released (no noise multiplier stored): counted by its charge, at
    # no delta (nothing of it left the node); released but without terms: by its (epsilon, delta)
    unconfirmed = [entries[0], {**train[0], "status": "failed"}, entries[3]]
    assert release_base(unconfirmed) == ((2.0, 1.0, DELTA), (OPAQUE, 3.0, 0.0), (3.0, 2.0, DELTA))
    assert release_base([{**train[0]}]) == ((OPAQUE, 3.0, DELTA),)
    base, charges = (), []
    for sigma, sensitivity in [(2.0, 1.0), (3.0, 2.0), (3.0, 2.0)]:
        charges.append(pld_charge(base, sigma, sensitivity, DELTA))
        base += ((sigma, sensitivity, DELTA),)
    acc = pld_privacy_accountant.PLDAccountant()
    for event in (dp_event.GaussianDpEvent(2.0), dp_event.GaussianDpEvent(1.5), dp_event.GaussianDpEvent(1.5)):
        acc.compose(event)
    assert sum(charges) == pytest.approx(acc.get_epsilon(DELTA), abs=1e-2)
    assert charges[1] > charges[2] > 0  # the same release costs less the more came before it


@pytest.mark.parametrize("plan", [WEAK, STRONG, PE, ALL_VOTERS], ids=["weak", "strong", "pe-3-rounds", "voters-all"])
def test_the_pld_rule_never_adds_noise_and_the_profile_keeps_its_sigma(plan):
    basic, pld = calibrate(plan, BASIC), calibrate(plan, PLD)
    assert all(p <= b * (1 + 1e-3) for p, b in zip(pld, basic))
    # the last phase composed with those before it takes the slack: at least 10% less noise here
    assert pld[-1] < 0.9 * basic[-1]
    assert pld[0] == pytest.approx(basic[0], rel=1e-3)  # one Gaussian is exact under both rules


def test_the_basic_rule_is_todays_calibration_and_the_issues_figures():
    from dp_accounting.gaussian_mechanism import get_sigma_gaussian

    basic = calibrate(WEAK, BASIC)
    assert basic[1] == pytest.approx(math.sqrt(8) * get_sigma_gaussian(6.0, DELTA), rel=1e-9)
    # issue 47: 0.764 -> 0.610 composed at 2 delta; 0.629 at the policy's (issue 60)
    assert basic[1] / math.sqrt(8) == pytest.approx(0.764, abs=1e-3)
    assert calibrate(WEAK, PLD)[1] / math.sqrt(8) == pytest.approx(0.629, abs=2e-3)
    assert calibrate(STRONG, BASIC)[1] == pytest.approx(0.5617, abs=2e-3)  # Opacus' RDP, as phase 1 today
    assert independent_epsilon(WEAK, basic, 2 * DELTA) == pytest.approx(6.28, abs=0.01)  # 8 charged, 6.28 spent


def test_a_plan_without_dp_has_no_noise_and_an_unknown_rule_is_refused():
    free = [Planned("profile", GAUSSIAN, math.inf, DELTA), Planned("vote", GAUSSIAN, math.inf, DELTA)]
    assert calibrate(free, PLD) == [0.0, 0.0]
    with pytest.raises(ValueError, match="unknown accounting rule"):
        calibrate(WEAK, "advanced")


@pytest.mark.parametrize("rule", [BASIC, PLD])
def test_a_dpsgd_phase_of_unknown_q_has_no_noise_here_and_what_follows_is_priced_alone(rule):
    # a deployment's plan: q is B / the node's max-records, which the server's plan may not know
    unknown = [PROFILE, Planned("train", DPSGD, 3.0, DELTA, steps=6), ALL_VOTERS[2]]
    noises = calibrate(unknown, rule)
    assert math.isnan(noises[1])
    alone = calibrate([ALL_VOTERS[2]], rule)[0]
    assert noises[2] == pytest.approx(alone, rel=1e-12)
    if rule == PLD:  # an upper bound: at the node's q the vote composes with both and gets less noise
        assert calibrate(ALL_VOTERS, PLD)[2] < alone
