"""Secure aggregation's maths and the Skellam mechanism, without Flower (issue 73).

The ring holds every sum it is sized for; masks cancel and are uniform on their own; Shamir
shares rebuild a secret from its threshold and a sealed share opens for its pair only; a round of
the protocol gives the survivors' sum with and without dropouts; and a server that lies (drops a
site that sent, shows two lists of survivors, forges or swaps a key, replays a step, asks a round
with too few trusted sites or too little noise) is refused. The Skellam PLD is checked against a
brute-force hockey-stick divergence, and t shares sum to the one release's noise.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from cryptography.hazmat.primitives.asymmetric import ec

from common import skellam
from common.secagg import masks, ring, shares
from common.secagg.protocol import (
    FORGED,
    INCONSISTENT,
    REPLAYED,
    UNTRUSTED,
    Participant,
    SecAggRefused,
    Terms,
    route,
    unmask,
)

TERMS = Terms(context=b"run-1|vote|round-1|digest", length=64, bits=40)


# ----------------------------------------------------------------- the ring
def test_ring_round_trips_signed_integers_and_wraps() -> None:
    values = np.array([-(2 ** 38), -1, 0, 1, 2 ** 38 - 1], dtype=np.int64)
    assert np.array_equal(ring.decode(ring.encode(values, 40), 40), values)
    a, b = ring.encode(np.array([2 ** 39 - 1]), 40), ring.encode(np.array([1]), 40)
    assert ring.decode(ring.add(a, b, 40), 40)[0] == -(2 ** 39)  # past the top wraps to the bottom
    assert ring.decode(ring.subtract(b, a, 40), 40)[0] == 1 - (2 ** 39 - 1)
    with pytest.raises(TypeError, match="only integers"):
        ring.encode(np.array([0.5]), 40)


@pytest.mark.parametrize("sites,bound,mu", [(2, 10, 5.0), (16, 100_000, 5e4), (100, 1_000_000, 1e6)])
def test_bits_hold_the_sum_of_every_site_at_its_bound(sites: int, bound: int, mu: float) -> None:
    """The sum of ``sites`` vectors, each at its data bound plus a noise sample at its tail (either
    sign), decodes to itself: it cannot overflow short of a 2^-64 noise sample."""
    bits = ring.bits_for(sites, bound, mu)
    extreme = bound + ring.poisson_tail(mu)
    for sign in (1, -1):
        vec = np.full(3, sign * extreme, dtype=np.int64)
        total = np.zeros(3, dtype=np.uint64)
        for _ in range(sites):
            total = ring.add(total, ring.encode(vec, bits), bits)
        assert np.array_equal(ring.decode(total, bits), vec * sites)
    # one bit fewer and the sum at the tail would wrap: the sizing is not slack by a whole bit
    assert sites * extreme >= 2 ** (bits - 3)


def test_bits_refuse_a_sum_no_ring_holds() -> None:
    with pytest.raises(ValueError, match="needs .* bits, above 62"):
        ring.bits_for(10 ** 6, 10 ** 15, 1.0)


def test_poisson_tail_is_a_chernoff_bound() -> None:
    from scipy.stats import poisson

    for mu in (0.5, 10.0, 1e4):
        m = ring.poisson_tail(mu)
        assert poisson.sf(mu + m - 1, mu) < 2.0 ** -64 or poisson.logsf(mu + m - 1, mu) < -64 * math.log(2)


# ----------------------------------------------------------------- masks
def test_agreement_is_shared_and_bound_to_its_context_and_pair() -> None:
    a, b = masks.KeyPair.generate(), masks.KeyPair.generate()
    seed = masks.agree(a, b.public, masks.PAIR, b"ctx", 1, 2)
    assert seed == masks.agree(b, a.public, masks.PAIR, b"ctx", 2, 1)
    assert seed != masks.agree(a, b.public, masks.PAIR, b"ctx2", 1, 2)
    assert seed != masks.agree(a, b.public, masks.SEAL, b"ctx", 1, 2)
    assert seed != masks.agree(a, b.public, masks.PAIR, b"ctx", 1, 3)


def test_masks_are_uniform_mod_2_to_the_b() -> None:
    values = masks.expand(bytes(range(32)), 200_000, 20)
    assert values.max() < 2 ** 20 and np.array_equal(values, masks.expand(bytes(range(32)), 200_000, 20))
    counts = np.bincount((values >> 16).astype(np.int64), minlength=16)  # the top four bits
    expected = len(values) / 16
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 50  # 15 degrees of freedom: p < 1e-5 past 50


# ----------------------------------------------------------------- Shamir shares, sealed
def test_any_threshold_of_shares_gives_the_secret_back() -> None:
    secret = bytes(range(32))
    parts = shares.split(secret, 3, 5)
    assert shares.combine(parts[:3]) == secret and shares.combine([parts[4], parts[1], parts[2]]) == secret
    try:  # below the threshold: not the secret (mostly refused by the padding check)
        assert shares.combine(parts[:2]) != secret
    except ValueError:
        pass
    assert shares.combine(shares.split(secret, 1, 4)[2:]) == secret


@pytest.mark.parametrize("sites,honest,expected", [(5, 1, 3), (5, 2, 5), (5, 3, 4), (5, 5, 3), (4, 4, 3), (10, 3, 9)])
def test_threshold_exceeds_the_colluders_and_half(sites: int, honest: int, expected: int) -> None:
    needed = shares.threshold(sites, honest)
    assert needed == expected
    if honest > 1:  # above the colluders, half, and (sites + colluders) / 2: two lists cannot both reach it
        assert needed > sites - honest and 2 * needed > sites and 2 * needed > 2 * sites - honest


def test_a_sealed_share_opens_for_its_pair_only() -> None:
    key = bytes(32)
    sealed = shares.seal(key, 1, 2, b"seed", b"key")
    assert shares.unseal(key, 1, 2, sealed) == (b"seed", b"key")
    with pytest.raises(ValueError, match="another pair"):
        shares.unseal(key, 1, 3, sealed)
    with pytest.raises(ValueError, match="does not open"):
        shares.unseal(bytes([1]) + bytes(31), 1, 2, sealed)
    import base64

    raw = bytearray(base64.urlsafe_b64decode(sealed))
    raw[len(raw) // 2] ^= 1  # one bit of the ciphertext (a base64 character's low bits may be padding)
    tampered = base64.urlsafe_b64encode(bytes(raw))
    with pytest.raises(ValueError, match="does not open"):
        shares.unseal(key, 1, 2, tampered)


# ----------------------------------------------------------------- a round of the protocol
def _round(n: int, honest: int = 1, needed: float = 1.0, terms: Terms = TERMS,
           identities: list[ec.EllipticCurvePrivateKey] | None = None, peers=None) -> list[Participant]:
    ids = [10 + 7 * i for i in range(n - 1)] + [2 ** 64 - 5][:n]  # Flower's node ids: any uint64, past 2^63 too
    return [Participant(s, terms, honest, needed, identity=identities[i] if identities else None,
                        peers=peers[i] if peers else None) for i, s in enumerate(ids)]


def _share(sites: list[Participant]):
    adverts = [p.advertise(len(sites)) for p in sites]
    sealed, commits = {}, {}
    for p in sites:
        sealed[p.site], commits[p.site] = p.share(adverts)
    return {a.site: a for a in adverts}, route(sealed), commits


def _vectors(sites: list[Participant], rng: np.random.Generator) -> dict[int, np.ndarray]:
    return {p.site: rng.integers(-1000, 1000, TERMS.length) for p in sites}


def test_a_round_gives_the_sum_and_each_masked_vector_is_uniform() -> None:
    rng = np.random.default_rng(0)
    sites = _round(5)
    adverts, inbox, commits = _share(sites)
    vectors = _vectors(sites, rng)
    masked = {p.site: p.mask(inbox[p.site], vectors[p.site]) for p in sites}
    for p in sites:  # on its own a masked vector is far from its data: uniform over 2^40
        assert np.abs(ring.decode(masked[p.site], TERMS.bits)).mean() > 2 ** 36
    signatures = {p.site: p.confirm(sorted(masked)) for p in sites}
    revealed = {p.site: p.reveal(signatures) for p in sites}
    total = unmask(TERMS, adverts, commits, masked, revealed)
    assert np.array_equal(total, np.sum(list(vectors.values()), axis=0))


def test_a_site_that_drops_after_sharing_is_unmasked_from_the_survivors() -> None:
    rng = np.random.default_rng(1)
    sites = _round(5)
    adverts, inbox, commits = _share(sites)
    vectors = _vectors(sites, rng)
    gone = sites[2]
    masked = {p.site: p.mask(inbox[p.site], vectors[p.site]) for p in sites if p is not gone}
    survivors = [p for p in sites if p is not gone]
    signatures = {p.site: p.confirm(sorted(masked)) for p in survivors}
    revealed = {p.site: p.reveal(signatures) for p in survivors}
    assert all(gone.site in r.keys and gone.site not in r.seeds for r in revealed.values())
    total = unmask(TERMS, adverts, commits, masked, revealed)
    assert np.array_equal(total, np.sum([vectors[p.site] for p in survivors], axis=0))


def test_a_site_lost_after_signing_is_unmasked_from_the_others_shares() -> None:
    rng = np.random.default_rng(4)
    sites = _round(5)
    adverts, inbox, commits = _share(sites)
    vectors = _vectors(sites, rng)
    masked = {p.site: p.mask(inbox[p.site], vectors[p.site]) for p in sites}
    signatures = {p.site: p.confirm(sorted(masked)) for p in sites}
    revealed = {p.site: p.reveal(signatures) for p in sites[:4]}  # the fifth died before revealing
    total = unmask(TERMS, adverts, commits, masked, revealed)
    assert np.array_equal(total, np.sum(list(vectors.values()), axis=0))


def test_a_site_that_refuses_the_survivors_stops_the_round() -> None:
    """A site that does not sign the survivors (it trusts all five; one is gone) keeps its vector
    masked: the others, which would go on, reveal no share of its seed, and none of its key (it
    survived), so the sum is never unmasked."""
    ids = [10, 17, 24, 31, 38]
    sites = [Participant(s, TERMS, 5 if i == 0 else 1, 1.0) for i, s in enumerate(ids)]
    adverts, inbox, commits = _share(sites)
    masked = {p.site: p.mask(inbox[p.site], np.ones(TERMS.length, dtype=np.int64)) for p in sites[:4]}
    with pytest.raises(SecAggRefused) as err:
        sites[0].confirm(sorted(masked))
    assert err.value.reason == UNTRUSTED
    signatures = {p.site: p.confirm(sorted(masked)) for p in sites[1:4]}
    revealed = {p.site: p.reveal(signatures) for p in sites[1:4]}
    assert all(ids[0] not in r.seeds and ids[0] not in r.keys for r in revealed.values())
    assert all(ids[1] in r.seeds for r in revealed.values())  # a survivor that signed is revealed
    with pytest.raises(ValueError, match="needed"):
        unmask(TERMS, adverts, commits, masked, revealed)


def test_a_site_dropped_before_sharing_is_left_out_of_the_masks() -> None:
    rng = np.random.default_rng(2)
    sites = _round(4)
    adverts = [p.advertise(4) for p in sites]
    sealed, commits = {}, {}
    for p in sites[:3]:  # the fourth advertised, then vanished
        sealed[p.site], commits[p.site] = p.share(adverts)
    inbox = route(sealed)
    vectors = _vectors(sites[:3], rng)
    masked = {p.site: p.mask(inbox[p.site], vectors[p.site]) for p in sites[:3]}
    signatures = {p.site: p.confirm(sorted(masked)) for p in sites[:3]}
    revealed = {p.site: p.reveal(signatures) for p in sites[:3]}
    total = unmask(TERMS, {a.site: a for a in adverts}, commits, masked, revealed)
    assert np.array_equal(total, np.sum(list(vectors.values()), axis=0))


def test_too_few_shares_cannot_unmask() -> None:
    sites = _round(5)
    adverts, inbox, commits = _share(sites)
    masked = {p.site: p.mask(inbox[p.site], np.zeros(TERMS.length, dtype=np.int64)) for p in sites}
    signatures = {p.site: p.confirm(sorted(masked)) for p in sites}
    revealed = {p.site: p.reveal(signatures) for p in sites[:2]}  # 2 of a threshold of 3
    with pytest.raises(ValueError, match="needed"):
        unmask(TERMS, adverts, commits, masked, revealed)


# ----------------------------------------------------------------- the curious or lying server
def test_a_site_refuses_survivors_that_leave_it_out() -> None:
    sites = _round(4)
    _, inbox, _ = _share(sites)
    for p in sites:
        p.mask(inbox[p.site], np.zeros(TERMS.length, dtype=np.int64))
    with pytest.raises(SecAggRefused) as err:
        sites[0].confirm([p.site for p in sites[1:]])  # "site 0 dropped": its key shares asked for
    assert err.value.reason == INCONSISTENT


def test_two_lists_of_survivors_cannot_both_be_signed_by_a_threshold() -> None:
    """The server shows half the sites one list (site X dropped) and half another (X survived), to
    get X's key shares from the first and its seed shares from the second: each half's signatures
    fall short of the threshold, so no honest site reveals anything."""
    sites = _round(6, honest=3)
    _, inbox, _ = _share(sites)
    masked = {p.site: p.mask(inbox[p.site], np.zeros(TERMS.length, dtype=np.int64)) for p in sites}
    x = sites[5].site
    full, less = sorted(masked), sorted(s for s in masked if s != x)
    first, second = sites[:3], sites[3:5]
    sig_less = {p.site: p.confirm(less) for p in first}
    sig_full = {p.site: p.confirm(full) for p in second}
    for p in first:
        with pytest.raises(SecAggRefused) as err:
            p.reveal(sig_less)
        assert err.value.reason == INCONSISTENT
    for p in second:
        with pytest.raises(SecAggRefused):
            p.reveal(sig_full)


def _signed(sites: list[Participant], survivors: list[int]) -> dict[int, bytes]:
    """The signatures over ``survivors`` of the sites that sign them (a site may refuse)."""
    out = {}
    for p in sites:
        try:
            out[p.site] = p.confirm(survivors)
        except SecAggRefused:
            continue
    return out


@pytest.mark.parametrize("n,t", [(4, 2), (5, 3), (6, 3), (7, 4), (6, 6)])
def test_colluders_that_sign_two_lists_never_unmask_one_site(n: int, t: int) -> None:
    """The server and the n - t sites it controls (as many as a site at min-honest-nodes t allows)
    show honest site X and some honest sites a list of survivors with X, the other honest sites one
    without X; the colluders sign both lists and give up every share they hold. Whatever the split,
    the server must not rebuild both X's seed (from the first list's reveals) and its mask key (from
    the second's): with both, X's masked vector opens alone, carrying only its own 1/t share of the
    noise. The threshold must exceed (n + colluders) / 2, not only half and the colluders."""
    from common.secagg.protocol import survivors_message

    for split in range(t):  # honest sites besides X shown the list with X
        sites = _round(n, honest=t)
        adverts, inbox, commits = _share(sites)
        masked = {p.site: p.mask(inbox[p.site], np.zeros(TERMS.length, dtype=np.int64)) for p in sites}
        honest, colluders = sites[:t], sites[t:]
        x, with_x, without_x = honest[0], honest[1:1 + split], honest[1 + split:]
        full, less = sorted(masked), sorted(s for s in masked if s != x.site)
        sig_full, sig_less = _signed([x, *with_x], full), _signed(without_x, less)
        for c in colluders:  # they sign both lists: the server holds their keys
            sig_full[c.site] = masks.sign(c.identity, survivors_message(TERMS.context, full))
            sig_less[c.site] = masks.sign(c.identity, survivors_message(TERMS.context, less))
        seed_parts = [c.held[x.site][0] for c in colluders]
        key_parts = [c.held[x.site][1] for c in colluders]
        for group, signatures in (([x, *with_x], sig_full), (without_x, sig_less)):
            for p in group:
                try:
                    revealed = p.reveal(signatures)
                except SecAggRefused:
                    continue
                seed_parts += [revealed.seeds[x.site]] if x.site in revealed.seeds else []
                key_parts += [revealed.keys[x.site]] if x.site in revealed.keys else []
        needed = shares.threshold(n, t)
        assert len(seed_parts) < needed or len(key_parts) < needed, (split, len(seed_parts), len(key_parts), needed)


def test_a_forged_or_swapped_advert_is_refused() -> None:
    sites = _round(3)
    adverts = [p.advertise(3) for p in sites]
    from dataclasses import replace

    forged = [adverts[0], replace(adverts[1], mask_public=masks.KeyPair.generate().public), adverts[2]]
    with pytest.raises(SecAggRefused) as err:
        sites[0].share(forged)
    assert err.value.reason == FORGED


def test_only_listed_peers_count_and_an_invented_site_is_not_one() -> None:
    """Three sites that list each other's SuperNode keys and trust 3: a server that swaps one of
    them for a site of its own (its own key, correctly signed) leaves two counted: refused."""
    keys = [ec.generate_private_key(ec.SECP384R1()) for _ in range(3)]
    listed = {masks.key_id(k.public_key()): k.public_key() for k in keys}
    sites = _round(3, honest=3, identities=keys, peers=[listed] * 3)
    adverts, _, _ = _share(sites)  # all listed: accepted
    impostor = Participant(99, TERMS, 1, 1.0)  # the server's own site, its own identity
    honest = _round(3, honest=3, identities=keys, peers=[listed] * 3)
    ads = [honest[0].advertise(3), honest[1].advertise(3), impostor.advertise(3)]
    with pytest.raises(SecAggRefused) as err:
        honest[0].share(ads)
    assert err.value.reason == UNTRUSTED


def test_too_few_counted_survivors_or_too_little_noise_is_refused() -> None:
    sites = _round(5, honest=4, needed=8.0)
    _, inbox, _ = _share(sites)
    assert all(p.noise == pytest.approx(2.0) for p in sites)  # a quarter of the need each
    masked = {p.site: p.mask(inbox[p.site], np.zeros(TERMS.length, dtype=np.int64)) for p in sites}
    with pytest.raises(SecAggRefused) as err:
        sites[0].confirm(sorted(masked)[:3])  # three survive; it trusts four
    assert err.value.reason in (UNTRUSTED, INCONSISTENT)
    # a site that counts on two, among sites that count on four: the two least noisy it may rely on
    # add half of the most any site needs, which is its own need: refused
    ids = [10, 17, 24, 31]
    mixed = [Participant(s, TERMS, 2 if i == 0 else 4, 8.0) for i, s in enumerate(ids)]
    _, inbox, _ = _share(mixed)
    assert mixed[0].noise == pytest.approx(4.0) and mixed[1].noise == pytest.approx(2.0)
    masked = {p.site: p.mask(inbox[p.site], np.zeros(TERMS.length, dtype=np.int64)) for p in mixed}
    with pytest.raises(SecAggRefused) as err:
        mixed[0].confirm(sorted(masked))
    assert err.value.reason == UNTRUSTED
    mixed[1].confirm(sorted(masked))  # a site that counts on four: 2 + 2 + 2 + 4 >= 8


def test_the_most_needed_noise_is_every_sites_reference() -> None:
    """Sites whose ledgers need different noise all add a share of the largest need, so each
    one's need is met in the sum."""
    sites = [Participant(s, TERMS, 3, need) for s, need in ((1, 2.0), (2, 6.0), (3, 3.0))]
    _share(sites)
    assert all(p.noise == pytest.approx(2.0) for p in sites)


def test_a_step_asked_twice_is_refused() -> None:
    p = _round(2)[0]
    p.advertise(2)
    with pytest.raises(SecAggRefused) as err:
        p.advertise(2)
    assert err.value.reason == REPLAYED


def test_a_round_of_more_sites_than_a_site_will_work_for_is_refused() -> None:
    from common.secagg.protocol import MALFORMED, MAX_SITES

    p = _round(1)[0]
    with pytest.raises(SecAggRefused) as err:
        p.advertise(MAX_SITES + 1)
    assert err.value.reason == MALFORMED
    q = _round(1)[0]
    own = q.advertise(1)
    with pytest.raises(SecAggRefused) as err:  # the server names few sites, then sends more adverts
        q.share([own] * (MAX_SITES + 1))
    assert err.value.reason == MALFORMED


def test_keys_are_fresh_every_round() -> None:
    a, b = _round(1)[0], _round(1)[0]
    assert a.advertise(1).mask_public != b.advertise(1).mask_public


# ----------------------------------------------------------------- Skellam
def _delta_brute(mu: float, count: int, eps: float) -> float:
    """The hockey-stick divergence of Skellam(mu)^count against it shifted by one in each coordinate."""
    from scipy.stats import skellam as sk

    k = np.arange(-200, 201)
    log_p, log_q = sk.logpmf(k, mu, mu), sk.logpmf(k - 1, mu, mu)
    keep = np.isfinite(log_p) & np.isfinite(log_q)
    loss, q = (log_q - log_p)[keep], np.exp(log_q[keep])
    values, weights = loss, q
    for _ in range(count - 1):  # the loss of independent coordinates adds
        values = (values[:, None] + loss[None, :]).ravel()
        weights = (weights[:, None] * q[None, :]).ravel()
        keep = weights > 1e-18
        values, weights = values[keep], weights[keep]
    return float(np.sum(weights * np.maximum(0.0, 1 - np.exp(eps - values))))


@pytest.mark.parametrize("mu,count", [(5.55, 1), (30.0, 2)])
def test_skellam_pld_bounds_the_true_divergence(mu: float, count: int) -> None:
    eps = skellam.epsilon(mu, count, 1e-5)
    assert _delta_brute(mu, count, eps) <= 1e-5 * 1.001  # the PLD's epsilon is valid ...
    assert _delta_brute(mu, count, eps * 0.97) > 1e-5  # ... and tight


def test_solve_mu_is_the_least_that_fits() -> None:
    for target, count in ((1.0, 1), (0.5, 4)):
        mu = skellam.solve_mu(target, count, 1e-5)
        assert skellam.epsilon(mu, count, 1e-5) <= target
        assert skellam.epsilon(mu * 0.99, count, 1e-5) > target


def test_shares_of_honest_sites_sum_to_the_release_noise() -> None:
    rng = np.random.default_rng(3)
    mu, t = 40.0, 4
    total = sum(skellam.sample(skellam.share(mu, t), 200_000, rng) for _ in range(t))
    one = skellam.sample(mu, 200_000, rng)
    assert abs(total.var() / (2 * mu) - 1) < 0.02 and abs(total.mean()) < 0.1
    # the same distribution, not only the same variance: the two histograms agree
    edges = np.arange(-40, 41)
    h1, _ = np.histogram(total, edges)
    h2, _ = np.histogram(one, edges)
    assert np.abs(h1 - h2).sum() / len(total) < 0.02


def test_a_share_alone_is_weaker_and_stated() -> None:
    mu = skellam.solve_mu(1.0, 1, 1e-5)
    alone = skellam.epsilon(skellam.share(mu, 4), 1, 1e-5)
    assert alone > 1.5  # what a site's own share guarantees if every other site colludes


def test_coordinates_of_count_histograms() -> None:
    assert [skellam.coordinates(s) for s in (1.0, math.sqrt(5), math.sqrt(10))] == [1, 5, 10]
    with pytest.raises(ValueError, match="not a count histogram"):
        skellam.coordinates(1.5)


# ----------------------------------------------------------------- real values, scaled and rounded
@pytest.mark.parametrize("mu", [2.0, 10.0, 50.0])
def test_the_renyi_bound_holds_for_every_integer_shift(mu: float) -> None:
    """Theorem 3.5's bound against the Renyi divergence computed from the pmfs, both directions,
    for shifts of 1 to 3 (a rounded vector moves a value by more than 1)."""
    from scipy.special import logsumexp
    from scipy.stats import skellam as sk

    x = np.arange(-600, 601)
    tightest = 0.0
    for shift in (1, 2, 3):
        lp, lq = sk.logpmf(x, mu, mu), sk.logpmf(x - shift, mu, mu)
        keep = (lp > -600) & (lq > -600)
        bound = skellam.rdp(mu, shift)
        for i, a in enumerate(skellam.ORDERS[:8]):
            forward = logsumexp(a * lq[keep] + (1 - a) * lp[keep]) / (a - 1)
            backward = logsumexp(a * lp[keep] + (1 - a) * lq[keep]) / (a - 1)
            assert max(forward, backward) <= bound[i] * (1 + 1e-9)
            tightest = max(tightest, max(forward, backward) / bound[i])
    assert tightest > 0.5  # and not vacuous


def test_every_rounded_row_fits_its_norm_whatever_the_rows() -> None:
    """The sensitivity the release states, checked with the noise off: each record's rounded vector
    (clipped, scaled, rounded) is within the stated norm, for rows the server could provoke (norms
    far above 1, non-finite values, halves that round up together), the fallback included."""
    rng = np.random.default_rng(0)
    d = 400
    norm = skellam.rounded_norm(skellam.SCALE, d)
    rows = np.vstack([rng.normal(size=(50, d)) * 1e6, np.full((5, d), 0.5 / skellam.SCALE + 1e-12),
                      np.full((5, d), 1 / math.sqrt(d)), np.zeros((5, d))])
    rows[0, 3], rows[1, :] = np.nan, np.inf
    out = skellam.round_rows(rows, 1.0, norm, rng)
    assert out.dtype == np.int64
    assert np.all(np.einsum("ij,ij->i", out, out) <= math.floor(norm ** 2))
    assert not out[-5:].any()  # filler rows stay zero
    # a norm that leaves rounding no room (the scaled norm itself): a rounding longer than it (about half
    # of them here) falls back to rounding towards zero, and every row is still within it
    halves = np.full((200, d), 1 / math.sqrt(d))  # norm 1: 204.8 once scaled, rounds to 204 or 205
    tight = skellam.round_rows(halves, 1.0, float(skellam.SCALE), rng)
    assert np.all(np.einsum("ij,ij->i", tight, tight) <= skellam.SCALE ** 2)
    fell_back = np.all(tight == 204, axis=1)
    assert 20 < fell_back.sum() < 180


def test_rounding_is_unbiased_and_rarely_falls_back() -> None:
    rng = np.random.default_rng(1)
    d = 2400
    rows = rng.normal(size=(200, d))
    rows /= np.linalg.norm(rows, axis=1, keepdims=True)
    norm = skellam.rounded_norm(skellam.SCALE, d)
    assert norm < skellam.SCALE * 1.001  # 2,400 candidates lengthen a vector by 0.07 %
    out = skellam.round_rows(rows, 1.0, norm, rng)
    exact = rows * skellam.SCALE
    assert not np.any((out != np.floor(exact)) & (out != np.ceil(exact)))  # never the fallback here
    summed = out.sum(axis=0) / skellam.SCALE
    assert np.abs(summed - rows.sum(axis=0)).max() < 0.02  # within rounding's few ulps of the scale


def test_the_rounded_release_costs_what_its_renyi_bound_says() -> None:
    from common.calibration import base_epsilon, pld_skellam_mu, skellam_charge, skellam_terms
    from common.dp import analytic_gaussian_sigma

    norm = skellam.rounded_norm(skellam.SCALE, 100)
    shift = skellam.Rounded(norm, 1e-6)
    mu = skellam.solve_mu(1.0, shift, 1e-6)
    assert skellam.epsilon(mu, shift, 1e-6) <= 1.0 < skellam.epsilon(mu * 0.99, shift, 1e-6)
    # about a Gaussian's noise of the same variance at the same sensitivity: the RDP conversion costs ~10 %
    ratio = math.sqrt(2 * mu) / analytic_gaussian_sigma(1.0, 1e-6, norm)
    assert 1.0 < ratio < 1.15
    # two rounded releases compose by their Renyi DP, at their summed delta
    two = (skellam_terms(mu, shift, 0.0),) * 2
    assert base_epsilon(two, 1e-5) == pytest.approx(skellam.rdp_epsilon([(mu, norm)] * 2, 2e-6) + 0.0)
    assert base_epsilon(two, 1e-5) < 2.0  # better than adding them
    # on a ledger with a Gaussian before it: the solved mu spends the share, the charge is its growth
    base = ((3.0, 1.0, 1e-6),)
    solved = pld_skellam_mu(base, 0.5, shift, 1e-5)
    growth = skellam_charge(base, solved, shift, 1e-5)
    assert growth <= 0.5 and growth == pytest.approx(0.5, rel=2e-3)
    # a ledger that sets aside all of the policy's delta for it has no bound left
    assert pld_skellam_mu(base, 0.5, skellam.Rounded(norm, 1e-5), 1e-5) == math.inf
