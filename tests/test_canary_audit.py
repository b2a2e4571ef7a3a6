"""One-run auditing by canaries (issue 63): the bound's maths (Steinke, Nasr & Jagielski 2023), the
canaries and their scores, and ``fedsyn audit --canaries`` on a real simulated run."""

from __future__ import annotations

import math

import numpy as np
import pytest

from common.auditing import canary_guess, one_run_epsilon, one_run_p_value


def test_p_value_is_the_binomial_tail_without_delta_and_grows_with_it():
    from scipy.stats import binom

    q = math.exp(1) / (1 + math.exp(1))
    assert one_run_p_value(100, 40, 30, 1.0, 0.0) == pytest.approx(binom.sf(29, 40, q))
    assert one_run_p_value(100, 40, 30, 1.0, 1e-3) > one_run_p_value(100, 40, 30, 1.0, 0.0)
    assert one_run_p_value(100, 40, 30, 2.0, 0.0) > one_run_p_value(100, 40, 30, 1.0, 0.0)  # increasing in eps
    with pytest.raises(ValueError, match="correct <= guesses <= m"):
        one_run_p_value(10, 20, 5, 1.0, 0.0)


def test_more_right_guesses_prove_more():
    bounds = [one_run_epsilon(1000, 200, v, 1e-5) for v in (100, 130, 160, 200)]
    assert bounds[0] == 0.0 and bounds == sorted(bounds) and 4.0 < bounds[-1] < 4.5
    assert one_run_epsilon(1000, 400, 400, 1e-5) > bounds[-1]  # more guesses, a higher ceiling


def test_the_bound_is_valid_on_randomised_response():
    """An epsilon-DP mechanism (randomised response on each canary's membership bit, epsilon 1): its
    bound exceeds 1 in at most the 5% the confidence allows."""
    rng = np.random.default_rng(0)
    keep = math.exp(1) / (1 + math.exp(1))
    over = 0
    for _ in range(300):
        included = rng.random(200) < 0.5
        released = np.where(rng.random(200) < keep, included, ~included)  # each bit flipped w.p. 1/(1+e)
        guess = canary_guess(released + rng.random(200) * 1e-3, included, 100, 0.0, 0.95)
        over += guess.epsilon_lower > 1.0
    assert over <= 0.05 * 300 + 6  # 5% and a binomial margin


def test_guesses_count_the_top_in_and_the_bottom_out():
    included = np.array([True, True, False, False, True, False])
    scores = np.array([6.0, 5.0, 1.0, 2.0, 4.0, 3.0])  # the three in score highest
    g = canary_guess(scores, included, 2, 0.0)
    assert (g.guesses, g.correct) == (4, 4) and g.epsilon_lower == one_run_epsilon(6, 4, 4, 0.0)
    assert canary_guess(-scores, included, 2, 0.0).correct == 0
    with pytest.raises(ValueError, match="equal-length"):
        canary_guess(scores[:3], included, 1, 0.0)


def test_canaries_have_an_in_distribution_prefix_and_a_random_suffix():
    from fedsyn_server.canary_audit import PREFIX_WORDS, SUFFIX_WORDS, make_canaries, synthetic_scores

    greek = "alpha beta gamma delta epsilon zeta theta iota kappa lambda sigma omega".split()
    texts = [f"record {i} about markets and football and elections in the {' '.join(greek[i % 6:])}" for i in range(20)]
    codes = ["topic=x", "topic=y"] * 10
    canaries = make_canaries(texts, codes, 30, np.random.default_rng(3))
    assert len(canaries) == 30 and len({c.suffix for c in canaries}) == 30
    for c in canaries:
        prefix = c.text[: -len(c.suffix) - 1]
        assert any(prefix.split() == t.split()[:PREFIX_WORDS] for t in texts)
        assert len(c.suffix.split()) == SUFFIX_WORDS and c.code in codes
    scores = synthetic_scores(canaries, ["nothing here", f"it said {canaries[4].suffix} twice"])
    assert scores[4] == 1.0 and scores.max() == 1.0 and np.sum(scores == 1.0) == 1


def test_the_cli_takes_a_node_or_canaries(capsys):
    from fedsyn_server.cli import main

    assert main(["audit"]) == 2 and "one" in capsys.readouterr().err
    assert main(["audit", "--canaries", "10", "--node-config", 'tier="weak"']) == 2


@pytest.mark.session(covered_by="tests/test_canary_audit.py (its maths and canaries) and "
                                "tests/test_flwr_run.py (the same tiny run)")
@pytest.mark.flwr
def test_a_canary_run_audits_the_whole_pipeline(tmp_path):
    from fedsyn_server.canary_audit import run_canary_audit

    audit = run_canary_audit(60, {"model": "tiny-gpt2", "num-server-rounds": 1, "local-steps": 2, "batch-size": 4,
                                  "num-synthetic": 20, "max-new-tokens": 8, "test-fraction": 0.02},
                             out_dir=tmp_path, timeout=1200)
    assert set(audit.guesses) == {"synthetic set", "DP model"} and 0 < audit.included < 60
    assert math.isfinite(audit.stated_epsilon) and audit.stated_epsilon > 0 and not audit.failed
    assert all(g.guesses == 12 for g in audit.guesses.values())
    assert (tmp_path / "canaries.json").exists()
