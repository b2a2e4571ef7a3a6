"""Privacy tests: calibrated noise through the real handlers, sensitivity, an empirical audit."""

from __future__ import annotations

import math

import numpy as np
import pytest
from flwr.app import ConfigRecord, Message, RecordDict
from scipy import stats

from common import records as R
from common.config import RunConfig
from common.dp import analytic_gaussian_sigma, gaussian_release
from common.voting import knn_votes
from fedsyn_client.client_app import app as client_app
from tests.fakes import client_node, set_task_identity, write_topic_csv

TOPICS = {"a": "apples and pears grow in the orchard", "b": "the train left the station late",
          "c": "the court heard the appeal today"}


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> str:
    return write_topic_csv(tmp_path_factory.mktemp("pdata") / "d.csv", TOPICS, 12, "{base}, item {i}")


def _query(node, message_type: str, content: RecordDict) -> np.ndarray:
    set_task_identity()
    reply = node(Message(content=content, message_type=message_type, dst_node_id=1))
    assert not reply.has_error(), reply.error.reason
    return R.read_vector(reply.content, R.PROFILE if message_type == R.MSG_PROFILE else R.VOTES)


def test_profile_noise_through_the_handler_has_the_calibrated_sigma(dataset, tmp_path):
    rc = RunConfig(dataset=dataset, test_fraction=0.0, strong_fraction=0.0).to_flower()
    vocab = [f"topic={t}" for t in TOPICS]
    true = None
    noise = []
    for run_id in range(1500):  # a fresh ledger each time: one profile release per node
        node = client_node(client_app, 1, {"partition-id": 0, "num-partitions": 1,
                                           "state-dir": str(tmp_path / str(run_id))}, rc, run_id=run_id)
        noisy = _query(node, R.MSG_PROFILE, RecordDict({R.CONFIG: ConfigRecord({"codes": vocab, "delta": 1e-5})}))
        true = np.array([12, 12, 12])
        noise.append(noisy - true)
    noise = np.concatenate(noise)
    sigma = analytic_gaussian_sigma(2.0, 1e-5, 1.0)
    # 4,500 draws: the std estimate has ~1.1% standard error, so 5% is > 4 standard
    # errors from the truth (no flaky failures) and a sigma 10% off fails.
    assert abs(noise.std() / sigma - 1) < 0.05
    assert abs(noise.mean()) < 4 * sigma / math.sqrt(noise.size)


# histogram -> (the node's L2 sensitivity at K = 3, the sum of the true votes of 36 records)
VOTE_SENSITIVITY = {"knn-vote": (math.sqrt(3), 36 * 3), "contrastive-vote": (math.sqrt(6), 36 * 3 - 36 * 3)}


@pytest.mark.parametrize("histogram", sorted(VOTE_SENSITIVITY))
def test_vote_noise_through_the_handler_has_sigma_for_its_sensitivity(dataset, tmp_path, histogram):
    sensitivity, true_sum = VOTE_SENSITIVITY[histogram]
    rc = RunConfig(dataset=dataset, test_fraction=0.0, strong_fraction=0.0, num_votes=3).to_flower()
    cands = [f"{base} synthetic {j}" for base in TOPICS.values() for j in range(4)]
    codes = [f"topic={t}" for t in TOPICS for _ in range(4)]
    content = RecordDict({R.CANDIDATES: ConfigRecord({"texts": cands, "codes": codes}),
                          R.CONFIG: ConfigRecord({"codes": [f"topic={t}" for t in TOPICS], "num-votes": 3,
                                                  "histogram": histogram, "delta": 1e-5})})
    draws = []
    for run_id in range(300):
        node = client_node(client_app, 1, {"partition-id": 0, "num-partitions": 1,
                                           "state-dir": str(tmp_path / str(run_id))}, rc, run_id=10_000 + run_id)
        draws.append(_query(node, R.MSG_VOTE, content))
    draws = np.stack(draws)
    # every local record votes +1 three times (and, contrastive, -1 three times)
    assert draws.mean(axis=0).sum() == pytest.approx(true_sum, abs=5 * math.sqrt(12) * draws.std() / math.sqrt(300))
    noise = (draws - draws.mean(axis=0)).ravel() * math.sqrt(300 / 299)
    sigma = analytic_gaussian_sigma(6.0, 1e-5, sensitivity)
    assert abs(noise.std() / sigma - 1) < 0.05  # 3,600 draws: ~1.2% standard error


def _clopper_pearson(k: int, n: int, alpha: float = 0.05) -> tuple[float, float]:
    lo = stats.beta.ppf(alpha / 2, k, n - k + 1) if k > 0 else 0.0
    hi = stats.beta.ppf(1 - alpha / 2, k + 1, n - k) if k < n else 1.0
    return lo, hi


def empirical_epsilon_lower_bound(eps: float, delta: float, k: int, trials: int, seed: int) -> float:
    """Distinguishing game on the vote release: D vs D + one record, best threshold test.

    Returns a 95%-confidence lower bound on epsilon from the observed error rates
    (FPR, FNR): eps >= log((1 - delta - FNR) / FPR).
    """
    rng = np.random.default_rng(seed)
    syn = rng.normal(size=(30, 16))
    syn /= np.linalg.norm(syn, axis=1, keepdims=True)
    syn_codes = ["x"] * 30
    loc = rng.normal(size=(20, 16))
    loc /= np.linalg.norm(loc, axis=1, keepdims=True)
    extra = syn[:1] + 0.01  # the target record: its K votes are known to the attacker
    v0 = knn_votes(loc, ["x"] * 20, syn, syn_codes, k)
    v1 = knn_votes(np.vstack([loc, extra]), ["x"] * 21, syn, syn_codes, k)
    sigma = analytic_gaussian_sigma(eps, delta, math.sqrt(k))
    direction = (v1 - v0) / np.linalg.norm(v1 - v0)  # the optimal (likelihood-ratio) statistic
    s0 = np.array([gaussian_release(v0, sigma, rng) @ direction for _ in range(trials)])
    s1 = np.array([gaussian_release(v1, sigma, rng) @ direction for _ in range(trials)])
    best = 0.0
    for t in np.quantile(np.r_[s0, s1], np.linspace(0.5, 0.9999, 200)):
        fpr_hi = _clopper_pearson(int((s0 > t).sum()), trials)[1]
        tpr_lo = _clopper_pearson(int((s1 > t).sum()), trials)[0]
        if tpr_lo - delta > 0 and fpr_hi > 0:
            best = max(best, math.log((tpr_lo - delta) / fpr_hi))
    return best


@pytest.mark.parametrize("eps", [1.0, 6.0])
def test_empirical_audit_of_the_vote_release_stays_below_epsilon(eps):
    lb = empirical_epsilon_lower_bound(eps, 1e-5, k=4, trials=20_000, seed=1)
    print(f"vote release, configured eps={eps}: empirical lower bound {lb:.3f}")
    assert lb < eps
    assert lb > 0.3 * eps if eps <= 1 else lb > 0  # the attack is strong enough to mean something


def test_the_audit_catches_a_mechanism_with_too_little_noise():
    """The same game against sigma that is 3x too small must exceed the claimed epsilon."""
    import tests.test_privacy as mod

    real = mod.analytic_gaussian_sigma
    try:
        mod.analytic_gaussian_sigma = lambda e, d, s: real(e, d, s) / 3
        lb = empirical_epsilon_lower_bound(1.0, 1e-5, k=4, trials=20_000, seed=2)
    finally:
        mod.analytic_gaussian_sigma = real
    assert lb > 1.0
