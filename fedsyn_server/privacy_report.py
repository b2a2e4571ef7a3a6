"""The privacy report of a run (``privacy_report.json``): per node, what it spent, from its own ledger.

The maths of the report lives here, apart from the file writing in ``outputs``: which node
ids are one ledger (a restarted SuperNode), what a node that never confirmed its ledger is
counted as having spent, and the basic and PLD totals (``common.dp.composed_epsilon``, the
same composition the node's ledger uses).
"""

from __future__ import annotations

import math
from typing import Any

from common import histograms
from common.config import RunConfig
from common.dp import MARGINALS, STRONG, TIERS, composed_epsilon
from common.phases import phases
from strategies.refinement import planned_votes
from strategies.result import FedSynResult
from strategies.writers import writers_summary


def privacy_report(cfg: RunConfig, res: FedSynResult) -> dict[str, Any]:
    """Per node: budget, this run's releases as the node stated them, and their totals.

    Each node's releases come from its own ledger (the end-of-run ``query.ledger``), or,
    if it did not answer, from the statements in its replies plus every request whose
    reply never came, counted as spent at what the request asked (``unknown_releases``).
    The basic total sums the
    stated epsilons (as the paper), delta sums the stated deltas. The PLD total composes
    the Gaussian releases (their sigma and sensitivity are data-independent) with a PLD
    accountant and adds DP-SGD's stated epsilon by basic composition: a node never tells
    the server DP-SGD's sampling rate, which would reveal its record count. A ``pld`` node
    states the delta it composes every release at (its policy's, ``composed_delta``): the PLD
    total is read there, and is never above the node's charges, which add up to its own
    composition at that delta (issue 60).
    """
    nodes = []
    ids = sorted(set(res.tiers) | set(res.releases) | set(res.ledgers))
    for nid, same in _by_ledger(ids, res).items():
        book = res.ledgers.get(nid)
        statements = book["releases"] if book else [_release_view(r) for r in res.releases.get(nid, [])]
        failures = [f for f in res.failures if f["node_id"] in same]
        if not book:
            statements += unknown_releases(cfg, res.tiers.get(nid, ""), statements, failures)
        basic = float(sum(float(r["epsilon"]) for r in statements))
        total_delta = float(sum(float(r["delta"]) for r in statements))
        # a pld node composes every release at its policy's delta and states it (issue 60)
        at = max((float(r.get("composed_delta") or 0.0) for r in statements), default=0.0) or None
        last = res.releases.get(nid, [{}])[-1]
        budget = (book or {}).get("epsilon-budget", res.budgets.get(nid, last.get("epsilon-budget", math.nan)))
        nodes.append({
            "node_id": nid, "node_ids": same, "ledger_ref": res.ledger_refs.get(nid, ""),
            "tier": res.tiers.get(nid, "unknown"),
            "source": "node ledger" if book else ("replies (the node did not confirm its ledger); requests without "
                                                  "a reply are counted as spent"),
            "epsilon_budget": float(budget),
            "epsilon_spent": basic,
            "epsilon_spent_all_runs": float((book or {}).get("epsilon-spent", last.get("epsilon-spent", basic))),
            "delta": total_delta, "composed_delta": at,
            "epsilon_basic_composition": basic, "epsilon_pld": composed_epsilon(statements, at),
            "releases": statements,
            "failures": failures,
        })
    return {
        "private": cfg.private,
        "warning": None if cfg.private else "NO DIFFERENTIAL PRIVACY: epsilon = inf, no noise was added anywhere",
        "unit": "one record of one node (sample-level DP, add/remove)",
        "mechanisms": _mechanisms(cfg),
        "epsilon_split": _split(cfg),
        "nodes": nodes,
        # which weights wrote the kept texts, per code: chosen by the released votes, so free in epsilon
        "writers": {**writers_summary(res), "epsilon": 0.0,
                    "note": "post-processing of the released votes (strategies.writers): no epsilon beyond them"},
    }



def _split(cfg: RunConfig) -> dict[str, Any]:
    """How each node's epsilon is divided among the phases (``common.dp.phase_epsilon``)."""
    if not cfg.marginals:
        return {"epsilon": cfg.epsilon, "epsilon_profile": cfg.epsilon_profile, "voters": cfg.voters}
    marginals = cfg.phase_epsilon(STRONG, MARGINALS)  # every tier's is the same
    if cfg.free_text is None:
        return {"epsilon": cfg.epsilon, "marginals": marginals}
    return {"epsilon": cfg.epsilon, "marginals": marginals, "free_text": cfg.free_text,
            "train_or_vote": cfg.epsilon - marginals, "epsilon_profile": 0.0, "voters": cfg.voters}


def _mechanisms(cfg: RunConfig) -> dict[str, str]:
    """Each phase a node of some tier releases in this run, its mechanism in words (the phase's
    own, ``common.phases``): a text run's three, a marginals run's one (and the text's two with a
    free-text column, whose sampled rows allocate the texts: no profile)."""
    votes = planned_votes(cfg)
    formulas = ", ".join(f"{name} {histograms.formula(name)}" for name in histograms.HISTOGRAMS)
    return {p.name: p.wording(cfg, votes, formulas) for p in phases() if any(p.share(cfg, t) > 0 for t in TIERS)}


def _by_ledger(ids: list[int], res: FedSynResult) -> dict[int, list[int]]:
    """Each report entry's node id -> every node id it covers. A SuperNode restarted after a
    crash gets a new node id from Flower but keeps its ledger (same ``ledger_refs``); when the
    new id answered the ledger query, its book holds the old id's releases too, so the old id
    is folded into it rather than counted twice."""
    refs = res.ledger_refs
    booked = {refs[n]: n for n in ids if n in res.ledgers and refs.get(n)}
    entries: dict[int, list[int]] = {}
    for nid in ids:
        owner = booked.get(refs.get(nid, ""), nid) if nid not in res.ledgers else nid
        entries.setdefault(owner, []).append(nid)
    return {owner: sorted(same) for owner, same in sorted(entries.items())}


def unknown_releases(cfg: RunConfig, tier: str, stated: list[dict[str, Any]],
                     failures: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Statements for the release requests of a node that failed without saying what it spent.

    The node may have released and lost the reply, so each counts as spent at the epsilon and
    delta the request asked, capped so that a phase never counts more than this run's epsilon
    for it (DP-SGD reserves its whole phase at round 1: later rounds add nothing). Marked
    ``"status": "unknown, counted as spent"``; never 0, never more than the node could spend.
    """
    out: list[dict[str, Any]] = []
    for f in failures:
        if f.get("spent") != "unknown":
            continue
        phase = f["phase"]
        cap = cfg.phase_epsilon(tier, phase) if tier else math.inf
        counted = sum(float(r["epsilon"]) for r in stated + out if r["phase"] == phase)
        epsilon = min(float(f["epsilon_requested"]), max(cap - counted, 0.0))
        if epsilon > 0 or not cfg.private:
            out.append({"phase": phase, "mechanism": "unknown", "epsilon": epsilon,
                        "delta": float(f["delta_requested"]), "round": f.get("round", 0),
                        "status": "unknown, counted as spent", "reason": f["reason"]})
    return out


def _release_view(r: dict[str, Any]) -> dict[str, Any]:
    view = {k: v for k, v in r.items() if k not in ("epsilon-spent", "epsilon-budget")}
    view["epsilon"] = float(view["epsilon"])
    return view
