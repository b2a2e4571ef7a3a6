"""Secure aggregation through the real strategy and the real ClientApp (issue 73).

Four deployment-style sites (their own data, ledgers, SuperNode keys and the peers' public keys)
that each trust all four (min-honest-nodes = K): the profile and every vote round are masked
rounds, the server holds only sums, every site's ledger charges Skellam noise of the whole
release in the sum while adding a quarter of it, and states what its share alone gives. A site
that trusts more sites than the round has refuses, before anything is spent; a site listed by no
peer is not counted.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from common import records as R
from common.config import RunConfig
from fedsyn_client.client_app import app
from tests.fakes import FakeGrid, client_node, set_task_identity, write_topic_csv

TOPICS = {"x": "alpha beta gamma", "y": "delta epsilon zeta"}
VOCAB = ["topic=x", "topic=y"]


def _keys(folder: Path, n: int) -> list[tuple[Path, str]]:
    """``n`` SuperNode key pairs: (private key file, public OpenSSH line)."""
    from fedsyn_client.masked_audit import site_keys

    return site_keys(folder, n)


def _run(tmp_path: Path, honest: int = 4, strangers: int = 0, epsilon: float = 8.0, extra: dict | None = None,
         run_id: int = 21, states: Path | None = None, lost: dict[int, tuple[str, str]] | None = None,
         keep: dict | None = None):
    """The real strategy over a fake Grid with four real ClientApp sites under secure aggregation;
    each lists its three peers' keys, or (``strangers`` > 0) one peer's and that many keys of sites
    that are not in the run. ``states``: where the sites' state folders are (default ``tmp_path``):
    the same sites, with the same views of their records, in another run (``run_id``). ``lost``:
    site -> (message type, step) from which on it never answers again (killed). ``keep``: gets the
    strategy (its session's vote totals)."""
    from fedsyn_server.privacy_report import privacy_report
    from fedsyn_server.server_app import build_strategy

    tmp_path.mkdir(parents=True, exist_ok=True)
    data = write_topic_csv(tmp_path / "data.csv", TOPICS, per_topic=12)
    keys = _keys(tmp_path / "keys", 4)
    others = [pub for _, pub in _keys(tmp_path / "strangers", strangers)]
    rc = RunConfig(model="tiny-gpt2", dataset=data, test_fraction=0.0, epsilon=epsilon, num_server_rounds=1,
                   local_steps=1, batch_size=4, max_length=16, num_synthetic=8, max_new_tokens=4,
                   num_votes=2).to_flower()
    rc.update({"control-codes": ",".join(VOCAB), **(extra or {})})
    nodes = {}
    for i, (tier, nid) in enumerate((("strong", 11), ("strong", 12), ("weak", 13), ("weak", 14))):
        peers = tmp_path / f"peers{i}.txt"  # what the operator lists
        listed = [pub for j, (_, pub) in enumerate(keys) if j != i]
        peers.write_text("\n".join(listed[:1] + others if strangers else listed) + "\n")
        state = str((states or tmp_path) / f"state{nid}")
        config = {"tier": tier, "data-path": data, "max-records": 100, "state-dir": state, "vote-window": 32,
                  "epsilon": epsilon, "min-honest-nodes": honest, "identity-key": str(keys[i][0]),
                  "peer-keys": str(peers)}
        nodes[nid] = client_node(app, nid, config, rc, run_id=run_id)
        if lost and nid in lost:
            nodes[nid] = _killed(nodes[nid], *lost[nid])
    set_task_identity()
    cfg = RunConfig.from_flower(rc)
    strategy, _, model = build_strategy(cfg)
    strategy.session.stable_seconds = 0.0
    grid = FakeGrid(nodes)
    res = strategy.start(grid, model.initial_arrays())
    if keep is not None:
        keep["strategy"] = strategy
    return res, privacy_report(cfg, res), grid, tmp_path


def _killed(node, message_type: str, step: str):
    """``node`` until it gets ``step`` of a ``message_type`` round, then dead: it answers nothing."""
    dead = []

    def serve(msg):
        if msg.metadata.message_type == message_type and \
                msg.content.config_records[R.CONFIG].get(R.SECAGG_STEP) == step:
            dead.append(True)
        return None if dead else node(msg)

    return serve


def _steps(grid: FakeGrid, message_type: str) -> list[str]:
    return [str(m.content.config_records[R.CONFIG].get(R.SECAGG_STEP, "")) for m in grid.sent
            if m.metadata.message_type == message_type]


def test_a_run_at_t_equals_k_masks_every_release_the_server_sums(tmp_path: Path) -> None:
    res, report, grid, folder = _run(tmp_path)
    assert not res.failures, res.failures
    assert res.selected is not None and len(res.selected) > 0
    for kind in (R.MSG_PROFILE, R.MSG_VOTE):
        steps = _steps(grid, kind)
        assert steps and set(steps) == set(R.SECAGG_STEPS)  # every request a step of a masked round
    # the server never received a site's own vector: only masked ones
    for reply in grid.replies:
        assert R.PROFILE not in reply.content.metric_records and R.VOTES not in reply.content.metric_records
    assert res.node_profiles == {} and res.node_votes == {}
    assert all(r.get("masked") for r in res.vote_rounds)
    # each site's statement: Skellam in the sum under its trust, a quarter of it added, the share's own epsilon
    rounds: dict[tuple[str, int], list[dict]] = {}
    for nid, releases in res.releases.items():
        masked = [r for r in releases if r.get("mechanism") == "skellam"]
        assert masked, f"site {nid} made no masked release"
        for r in masked:
            rounds.setdefault((r["phase"], r["round"]), []).append(r)
            assert r["honest"] == 4 and r["mu_share"] >= r["mu"] / 4 * (1 - 1e-9)
            assert r["epsilon_alone"] > r["epsilon"]  # alone, against a colluding rest, it is weaker
    for same in rounds.values():  # each adds a quarter of the most any site of the round needs in the sum
        assert len(same) == 4
        assert all(r["mu_share"] == pytest.approx(max(x["mu"] for x in same) / 4) for r in same)
    # the sites' ledgers compose the masked releases within their budgets
    for entry in report["nodes"]:
        assert entry["epsilon_spent"] <= 8.0 + 1e-6
    # no round's keys stay on a site
    assert not list(folder.glob("state*/secagg/*.json"))


def test_the_masked_sum_is_the_sum_of_the_sites_counts_with_the_noise_off(tmp_path: Path) -> None:
    """epsilon = inf: no noise, so the unmasked profile and vote totals are exactly what the same
    sites release unmasked (min-honest-nodes = 1: each its own vector, the server summing)."""
    extra = {"num-server-rounds": 0, "seed": 3}
    plain, _, grid, _ = _run(tmp_path / "plain", honest=1, epsilon=float("inf"), extra=extra, run_id=31,
                             states=tmp_path)
    masked, _, _, _ = _run(tmp_path / "masked", epsilon=float("inf"), extra=extra, run_id=32, states=tmp_path)
    assert not masked.failures and not plain.failures
    assert not _steps(grid, R.MSG_PROFILE)[0]  # the plain run is not masked
    assert np.array_equal(np.asarray(masked.profile), np.asarray(plain.profile)) and np.sum(plain.profile) > 0


POPRI = {"refinement": "popri", "refinement-rounds": 2, "popri-samples-per-prompt": 3, "popri-rejected-rank": 2}


def test_popris_similarity_scores_are_masked_scaled_and_rounded(tmp_path: Path) -> None:
    """POPri at t = K: its real-valued similarity scores go through secure aggregation, as in the
    paper (each record's vector scaled and rounded, Skellam noise, the sum divided by the scale);
    each site's statement gives the rounded norm and the part of its delta the Renyi bound is read
    at, and its ledger stays within its budget."""
    from common import skellam

    res, report, grid, _ = _run(tmp_path, extra=POPRI)
    assert not res.failures, res.failures
    assert set(_steps(grid, R.MSG_VOTE)) == set(R.SECAGG_STEPS)
    assert [r["histogram"] for r in res.vote_rounds] == ["similarity"] * 2 and all(r["masked"] for r in res.vote_rounds)
    rounds: dict[int, list[dict]] = {}
    for nid in res.releases:
        votes = [r for r in res.releases[nid] if r["phase"] == "vote"]
        assert len(votes) == 2 and all(r["mechanism"] == "skellam" for r in votes)
        for r in votes:
            rounds.setdefault(r["round"], []).append(r)
            assert r["scale"] == skellam.SCALE and skellam.SCALE < r["norm"] < skellam.SCALE * 1.01
            assert 0 < r["rdp_delta"] <= r["delta"] and "coordinates" not in r
            shift = skellam.Rounded(r["norm"], r["rdp_delta"])
            assert r["epsilon_alone"] == pytest.approx(skellam.epsilon(r["mu_share"], shift, r["rdp_delta"]))
    for same in rounds.values():  # the strong sites spend less on votes: their need sets every share
        assert all(r["mu_share"] == pytest.approx(max(x["mu"] for x in same) / 4) for r in same)
    for entry in report["nodes"]:
        assert entry["epsilon_spent"] <= 8.0 + 1e-6


def test_masked_similarity_scores_are_the_plain_ones_with_the_noise_off(tmp_path: Path) -> None:
    """epsilon = inf: the masked and rounded scores are the plain sum of the records' clipped
    similarities, to rounding's 1 / SCALE a record."""
    from common import skellam

    extra = {"num-server-rounds": 0, "seed": 5, **POPRI, "refinement-rounds": 1}
    kept_plain: dict = {}
    kept_masked: dict = {}
    plain, _, _, _ = _run(tmp_path / "plain", honest=1, epsilon=float("inf"), extra=extra, run_id=41,
                          states=tmp_path, keep=kept_plain)
    masked, _, _, _ = _run(tmp_path / "masked", epsilon=float("inf"), extra=extra, run_id=42, states=tmp_path,
                           keep=kept_masked)
    assert not plain.failures and not masked.failures and masked.vote_rounds[0].get("masked")
    a = np.asarray(kept_plain["strategy"].session.progress.vote_totals[0])
    b = np.asarray(kept_masked["strategy"].session.progress.vote_totals[0])
    assert a.shape == b.shape and np.abs(a).max() > 1.0
    assert np.abs(a - b).max() <= 24 / skellam.SCALE  # two voters of 12 records each, each at most one unit off


def test_a_site_that_trusts_more_sites_than_it_lists_is_refused_at_start(tmp_path: Path) -> None:
    from fedsyn_client.policy import PolicyError, policy_from_node_config

    peers = tmp_path / "peers.txt"
    peers.write_text(_keys(tmp_path / "k", 1)[0][1] + "\n")
    key = _keys(tmp_path / "mine", 1)[0][0]
    with pytest.raises(PolicyError, match="min-honest-nodes = 3 needs identity-key .* at least 2 peers"):
        policy_from_node_config({"tier": "weak", "data-path": "x.csv", "max-records": 10, "epsilon": 1.0,
                                 "min-honest-nodes": 3, "identity-key": str(key), "peer-keys": str(peers)})
    bad = tmp_path / "bad.txt"
    bad.write_text("not a key\n")
    with pytest.raises(PolicyError, match="line 1 of .* is not a SuperNode public key"):
        policy_from_node_config({"tier": "weak", "data-path": "x.csv", "max-records": 10, "epsilon": 1.0,
                                 "min-honest-nodes": 2, "identity-key": str(key), "peer-keys": str(bad)})


def test_sites_that_count_too_few_listed_peers_refuse_and_spend_nothing(tmp_path: Path) -> None:
    """Each site trusts 3 but its operator listed one peer of the run (and two keys of sites that
    are not in it): at the share step it counts two, refuses with a fixed text, and nothing is
    reserved, so the run ends with no profile and no release on any ledger."""
    with pytest.raises(RuntimeError, match="masked profile could not be unmasked"):
        _run(tmp_path, honest=3, strangers=2)
    for state in tmp_path.glob("state*"):
        texts = [f.read_text() for f in state.rglob("*") if f.is_file() and f.suffix in (".json", ".jsonl")]
        assert not any('"profile"' in t and '"confirmed"' in t for t in texts)


def test_a_site_killed_after_signing_is_unmasked_from_the_others_shares(tmp_path: Path) -> None:
    """Sites that count on three; site 14 dies after signing the profile's survivors (it never
    reveals): the profile is the sum of all four, from the others' shares of its seed. The run
    goes on without it: each vote round is the masked sum of the three left."""
    res, _, _, _ = _run(tmp_path, honest=3, lost={14: (R.MSG_PROFILE, R.REVEAL)}, extra={"num-server-rounds": 0})
    assert res.selected is not None
    assert not [f for f in res.failures if f["node_id"] != 14], res.failures
    assert all(r["voters"] == [11, 12, 13] for r in res.vote_rounds)
    statements = res.releases[14]
    assert [r["phase"] for r in statements] == ["profile"]  # its masked profile is in the sum, and booked


def test_a_site_killed_after_sharing_is_left_out_and_its_masks_rebuilt(tmp_path: Path) -> None:
    """Site 13 dies before sending its masked profile (after sharing its keys): the survivors'
    shares of its mask key cancel its pairwise masks, and the profile is the three survivors' sum."""
    res, _, _, _ = _run(tmp_path, honest=3, lost={13: (R.MSG_PROFILE, R.MASK)}, extra={"num-server-rounds": 0})
    assert res.selected is not None and res.profile is not None
    assert 13 not in res.releases or not [r for r in res.releases[13] if r["phase"] == "profile"]
    assert any("profile: 3 of 4 nodes answered" in d for d in res.degradations), res.degradations
