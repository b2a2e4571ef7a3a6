"""For every phase, the planner's priced release is the node's (issue 62).

``fedsyn plan`` prices each phase a node of a tier will release (``common.phases``: ``planned``,
composed in the nodes' order by the run's rule, ``fedsyn_server.plan.pld_noises``); the real
ClientApp, sent the same phases in that order under one run key, noises each by the sigma (or
DP-SGD noise multiplier) its ledger solves. They must agree, up to the noise solver's tolerance: a
plan that priced less noise than a node adds would mislead an institution, and one that priced
more would hide a bug in the node's accounting.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from common import records as R
from common.calibration import NOISE_TOLERANCE
from common.config import RunConfig
from common.dp import DPSGD
from common.phases import Pricing, phases
from fedsyn_client.ledger import PrivacyLedger
from fedsyn_server.plan import pld_noises
from strategies.refinement import build_refinement, planned_votes
from tests.neighbours import CANDIDATES, CLIQUES, CODES, MAX_RECORDS, Shape, Step, base_rows, replies, write_rows

DELTA = 1e-5  # the run's per-release delta and every harness node's policy delta (the default)
KEY = "one-run"
# (phase, the node's path, its tier): each shipped phase where it is priced last, after every phase
# its node releases before it (a strong node's vote after its DP-SGD)
CASES = [("profile", "text", "weak"), ("vote", "text", "weak"), ("train", "text", "strong"),
         ("vote", "text", "strong"), ("marginals", "marginals", "weak")]


def _step(phase: str, cfg: RunConfig, tier: str) -> Step:
    """The request the server sends for ``phase`` (round 1) to a node of ``tier``."""
    conf = {"codes": list(CODES), "resume-key": KEY, "server-round": 1, "delta": DELTA}
    if phase == "vote":
        plan = build_refinement(cfg.refinement).vote_plan(cfg)
        params = plan.request()
        conf.update({"histogram": params.pop("histogram"), "epsilon-share": params.pop("epsilon_share"), **params})
        return Step(R.MSG_VOTE, conf=tuple(sorted(conf.items())), tier=tier, candidates=CANDIDATES)
    if phase == "marginals":
        conf.update({"cliques": CLIQUES, "epsilon-share": 1.0 / cfg.marginal_rounds})
    message = {"profile": R.MSG_PROFILE, "train": R.MSG_TRAIN, "marginals": R.MSG_MARGINALS}[phase]
    return Step(message, conf=tuple(sorted(conf.items())), tier=tier)


def test_the_cases_cover_every_registered_phase():
    """A new phase must add its case here (and its request to ``_step``)."""
    assert {p.name for p in phases()} == {phase for phase, _, _ in CASES}


@pytest.mark.parametrize("phase,path,tier", CASES, ids=[f"{p}-{t}" for p, _, t in CASES])
def test_the_planners_price_of_each_phase_is_the_nodes(phase: str, path: str, tier: str, tmp_path: Path):
    shape = Shape(path=path)
    data = write_rows(tmp_path / "records.csv", base_rows(41))
    cfg = RunConfig.from_flower(shape.run_config(data))
    pricing = Pricing(cfg, tier, DELTA, sample_rate=cfg.batch_size / MAX_RECORDS,
                      votes=planned_votes(cfg) if cfg.writes_text else None)
    planned = [p for p in (ph.planned(pricing) for ph in phases()) if p is not None]
    names = [p.phase for p in planned]
    assert phase in names, f"{phase} is not priced for a {tier} node of a {path} run: {names}"
    noises = pld_noises(planned, DELTA)  # the node's own rule: pld, at its policy's delta
    order = names[:names.index(phase) + 1]

    state = tmp_path / "state"
    answers = list(replies([_step(p, cfg, tier) for p in order], data, state, shape))
    for name, reply in zip(order, answers):
        assert not reply.has_error(), f"{name}: {reply.error.reason}"
    [entry] = [e for e in PrivacyLedger(state / "ledger.json").releases if e["phase"] == phase]
    assert entry["public"].get("accounting", "pld") == "pld"
    if planned[names.index(phase)].mechanism == DPSGD:
        node = float(entry["private"]["noise_multiplier"])
    else:
        statement = dict(answers[-1].content.config_records[R.RELEASE])
        # the plan prices a marginals round at sensitivity 1 (its multiplier): the node states sigma
        scale = 1.0 if phase != "marginals" else float(statement["sensitivity"])
        node = float(statement["sigma"]) / scale
    assert node == pytest.approx(noises[phase], rel=10 * NOISE_TOLERANCE)
