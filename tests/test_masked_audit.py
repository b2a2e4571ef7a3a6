"""``fedsyn audit`` of the masked releases (issue 73): the share's noise against colluding peers and
the sum of a simulated round, judged under Skellam's own claim; and the planted bug it must catch,
a site's share at sigma / t instead of sigma / sqrt(t)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from common import skellam
from common.auditing import shape_check, sigma_upper, skellam_claim_epsilon

# ------------------------------------------------------------------------------ the maths


@pytest.mark.parametrize("mu", [0.003, 0.5, 3.0, 40.0])
def test_skellam_shape_passes_skellam_noise_at_any_mu(mu):
    rng = np.random.default_rng(int(mu * 1000))
    fails = 0
    for _ in range(40):
        check = shape_check(skellam.sample(mu, 600, rng), skellam.sample(mu, 600, rng), skellam_mu=mu, rng=rng)
        fails += bool(check.failures(0.01))
    assert fails <= 4  # three tests at 1% each: ~1.2 of 40 expected
    # the normal-theory checks reject the same valid noise where mu is small: why the audit needs these
    if mu < 1:
        assert shape_check(skellam.sample(mu, 600, rng), skellam.sample(mu, 600, rng)).failures(1e-3)


def test_skellam_shape_rejects_what_is_not_the_stated_skellam():
    rng = np.random.default_rng(7)
    smaller = shape_check(skellam.sample(1.5, 2000, rng), skellam.sample(1.5, 2000, rng), skellam_mu=3.0, rng=rng)
    assert any("not Skellam" in f for f in smaller.failures(1e-4))
    by_record = shape_check(skellam.sample(3.0, 2000, rng), skellam.sample(6.0, 2000, rng), skellam_mu=4.5, rng=rng)
    assert any("scale differs" in f for f in by_record.failures(1e-4))
    biased = shape_check(skellam.sample(3.0, 2000, rng) + 1, skellam.sample(3.0, 2000, rng) + 1, skellam_mu=3.0,
                         rng=rng)
    assert any("not centred" in f for f in biased.failures(1e-4))
    real = shape_check(rng.normal(0, 2.4, 200), rng.normal(0, 2.4, 200), skellam_mu=3.0, rng=rng)
    assert len(real.failures(1e-4)) == 3  # not integers: not Skellam at all
    assert shape_check(np.zeros(4), np.zeros(4), skellam_mu=0.0).failures(1e-4) == []
    assert shape_check(np.array([0.0, 1.0]), np.zeros(2), skellam_mu=0.0).failures(1e-4)


def test_sigma_upper_covers_skellams_sigma_with_its_kurtosis():
    """At mu = 0.5 (excess kurtosis 1) the chi-squared bound alone misses sigma more often than its
    confidence says; widened by the stated kurtosis it holds."""
    rng = np.random.default_rng(3)
    mu, sigma = 0.5, 1.0
    draws = [skellam.sample(mu, 300, rng) for _ in range(3000)]
    plain = sum(sigma_upper(d, 0.99) < sigma for d in draws) / len(draws)
    widened = sum(sigma_upper(d, 0.99, 1 / (2 * mu)) < sigma for d in draws) / len(draws)
    assert widened <= 0.015 < plain


def test_skellams_claim_is_its_own_pld_and_below_the_gaussians_where_mu_is_small():
    from common.auditing import gaussian_epsilon

    sigma = math.sqrt(2 * 3.0)
    moved = np.array([0.0, 1.0, -1.0, 0.0])
    assert skellam_claim_epsilon(sigma, moved, 1e-5) == pytest.approx(skellam.epsilon(3.0, 2, 1e-5))
    assert skellam_claim_epsilon(sigma, moved, 1e-5) < gaussian_epsilon(sigma, math.sqrt(2), 1e-5)
    assert skellam_claim_epsilon(sigma, np.array([2.0, 0.0]), 1e-5) is None  # a move of 2: the Gaussian's
    assert skellam_claim_epsilon(sigma, np.zeros(3), 1e-5) == 0.0


# --------------------------------------------------------------------------- the node, for real
@pytest.fixture(scope="module")
def masked_site(tmp_path_factory):
    """A deployed weak node of 60 news records that counts on 3 sites (its key and two peers')."""
    from common.tables import load_table
    from fedsyn_client.masked_audit import site_keys

    folder = tmp_path_factory.mktemp("masked-site")
    load_table("bbc-news")[["text", "topic"]].sample(60, random_state=0).to_csv(folder / "site.csv", index=False)
    keys = site_keys(folder / "operator-keys", 3)
    (folder / "peers.txt").write_text(f"{keys[1][1]}\n{keys[2][1]}\n")
    return {"tier": "weak", "data-path": str(folder / "site.csv"), "max-records": 1000,
            "state-dir": str(folder / "state"), "epsilon": 8.0, "min-honest-nodes": 3,
            "identity-key": str(keys[0][0]), "peer-keys": str(folder / "peers.txt")}


def _audit(site, capsys, *release: str) -> tuple[int, dict[str, list[str]], str]:
    """``fedsyn audit --sum`` at max-records 40 and 60 draws: (exit code, its table's rows by release, its text)."""
    from tests.test_privacy_audit import _audit as audit

    code, text = audit(site, capsys, *release, sums=True)
    rows = {line.split()[0]: line.split() for line in text.splitlines()
            if line.startswith(("profile", "vote:")) and line.split()[-1] in ("ok", "FAILS")}  # the table's rows
    return code, rows, text


def test_the_masked_releases_meet_their_share_and_sum_statements(masked_site, capsys):
    """At t = 3: the share alone (two colluding peers) meets ``epsilon_alone``, the sum of three
    simulated sites the release's epsilon; counts and the scaled similarity scores alike. The
    lower bounds are informative (above half the statement)."""
    code, rows, text = _audit(masked_site, capsys, "profile/share", "profile/sum", "vote:knn-vote/share",
                              "vote:similarity/sum")
    assert code == 0, text
    assert set(rows) == {"profile/share", "profile/sum", "vote:knn-vote/share", "vote:similarity/sum"}
    for row in rows.values():
        stated, lower = float(row[1]), float(row[2])
        assert row[-1] == "ok" and stated / 2 < lower <= stated, row
    # alone against colluding peers a share promises less than the sum under the site's trust
    assert float(rows["profile/share"][1]) > float(rows["profile/sum"][1])
    assert not Path(masked_site["state-dir"]).exists()  # the node's own state (its ledger) is never opened


def test_a_share_at_sigma_over_t_is_caught_in_the_share_and_in_the_sum(masked_site, capsys, monkeypatch):
    """The planted bug: the site adds Skellam(mu / t^2), sigma / t, while stating mu / t (sigma /
    sqrt(t)): the sum then carries a 1/t share of the variance it states. Both audits fail it."""
    from fedsyn_client import secagg_node

    t = masked_site["min-honest-nodes"]
    true_sample = skellam.sample
    monkeypatch.setattr(secagg_node.skellam, "sample", lambda mu, n, rng: true_sample(mu / t, n, rng))
    code, rows, text = _audit(masked_site, capsys, "profile/share", "profile/sum")
    assert code == 1 and rows["profile/share"][-1] == "FAILS" and rows["profile/sum"][-1] == "FAILS", text
    assert "profile/share FAILS: it loses epsilon" in text and "profile/sum FAILS: it loses epsilon" in text
