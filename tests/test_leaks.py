"""Canary leak test: a real `flwr run` where every outgoing reply is audited on the node."""

from __future__ import annotations

import json
import uuid

import pytest

from common.io import read_jsonl
from fedsyn_server.flwr_runner import run_app

# What each reply may carry: record key -> (kind, allowed value keys)
ALLOWED = {
    # ledger-ref: a random name of the ledger; epsilon-held: what other runs hold (ledger facts, not records);
    # records-bound: the policy's public max-records (0 for a simulated node), never the count;
    # min-honest-nodes: the site's own trust (issue 73), a policy fact
    "query.tier": {"tier": ("config", {"tier", "epsilon-budget", "epsilon-needed", "epsilon-remaining",
                                       "epsilon-shortfall", "ledger-ref", "epsilon-held", "records-bound",
                                       "min-honest-nodes"})},
    "train": {"arrays": ("array", None), "metrics": ("metric", {"weight", "steps"}), "release": ("config", None)},
    "query.profile": {"profile": ("metric", {"profile"}), "release": ("config", None)},
    "query.vote": {"votes": ("metric", {"votes"}), "release": ("config", None)},
    "query.ledger": {"ledger": ("config", {"releases", "epsilon-spent", "epsilon-budget", "epsilon-run",
                                           "ledger-ref"})},
}
# A release statement: nothing from which the record count follows (no sampling rate, noise
# multiplier, accountant epsilon or count), no time stamp.
# "accounting" and "sigma_basic": a pld release (the default) names its rule and the sigma basic
# composition would have used, both functions of public values (issue 47); "composed_delta": the delta a
# pld ledger composes every release at, the node policy's (issue 60), the same for every file
RELEASE_KEYS = {"phase", "mechanism", "epsilon", "delta", "run_id", "round", "sigma", "sensitivity", "histogram",
                "steps", "max_grad_norm", "covers", "epsilon-spent", "epsilon-budget", "accounting", "sigma_basic",
                "composed_delta"}
# a masked release's statement (issue 73): its Skellam terms and both guarantees, all public
MASKED_KEYS = {"coordinates", "mu", "mu_share", "honest", "epsilon_alone", "secure_aggregation"}
# a masked round's step replies: one JSON payload of keys, shares, masked vectors and signatures
MASKED = {"secagg": ("config", {"payload"}), "release": ("config", None)}


@pytest.mark.flwr
@pytest.mark.parametrize("honest", [1, pytest.param(3, marks=pytest.mark.session(
    covered_by="tests/test_secagg_curious.py (every step's reply through the real ClientApp, neighbours alike) "
               "and this test at t = 1"))])
def test_no_canary_or_record_text_leaves_any_node(tmp_path, monkeypatch, honest):
    import pandas as pd

    topics = {"alpha": "markets rallied as the bank cut rates", "beta": "the team won the cup final",
              "gamma": "the band released a new album"}
    canaries = [f"CANARY-{uuid.uuid4().hex}" for _ in range(6)]
    rows = [{"text": f"{base}, report {i} from the desk.", "topic": t}
            for t, base in topics.items() for i in range(40)]
    rows += [{"text": f"{c} secret patient note {j}", "topic": "alpha"} for j, c in enumerate(canaries)]
    data = tmp_path / "private.csv"
    pd.DataFrame(rows).to_csv(data, index=False)
    audit = tmp_path / "audit"
    monkeypatch.setenv("FEDSYN_AUDIT_DIR", str(audit))

    res = run_app({"model": "tiny-gpt2", "dataset": str(data), "test-fraction": 0.0, "num-server-rounds": 1,
                   "local-steps": 2, "batch-size": 4, "num-synthetic": 15, "max-new-tokens": 8,
                   "out-dir": str(tmp_path / "out"), "run-name": "canary", "epsilon": 8.0,
                   "strong-fraction": 0.34, "min-honest-nodes": honest}, federation_config="num-supernodes=3",
                  timeout=1200)
    assert res.ok, f"{res.status}\n{res.output[-4000:]}"

    lines = [row for f in sorted(audit.glob("node-*.jsonl")) for row in read_jsonl(f)]
    assert {ln["message_type"] for ln in lines} == set(ALLOWED)
    assert len({ln["node_id"] for ln in lines}) == 3
    blob = json.dumps(lines)
    for c in canaries:
        assert c not in blob
    for r in rows:
        assert r["text"] not in blob
    pool_size = json.loads((tmp_path / "out" / "canary" / "metrics.json").read_text())["pool_size"]
    for ln in lines:
        assert "error" not in ln, ln
        spec = ALLOWED[ln["message_type"]]
        if "secagg" in ln["records"]:  # a step of a masked round: a payload, and the mask step's statement
            spec = {k: v for k, v in MASKED.items() if k in ln["records"]}
        assert set(ln["records"]) == set(spec)
        for key, rec in ln["records"].items():
            kind, keys = spec[key]
            assert rec["kind"] == kind
            if key == "release":
                assert set(rec["values"]) <= RELEASE_KEYS | MASKED_KEYS
            elif keys is not None:
                assert set(rec["values"]) == keys
        if "secagg" in ln["records"]:
            continue  # its payload's bytes are in the blob checked above; no vector of the site's own
        if ln["message_type"] == "query.profile":
            prof = ln["records"]["profile"]["values"]["profile"]
            assert len(prof) == 3 and all(isinstance(v, float) for v in prof)
            assert any(v != round(v) for v in prof)  # noised
        if ln["message_type"] == "query.ledger":
            for statement in json.loads(ln["records"]["ledger"]["values"]["releases"]):
                assert set(statement) <= RELEASE_KEYS | MASKED_KEYS | {"status"}, statement
        if ln["message_type"] == "query.vote":
            assert len(ln["records"]["votes"]["values"]["votes"]) == pool_size
        if ln["message_type"] == "train":
            assert all(a["dtype"].startswith("float") or "float" in a["dtype"]
                       for a in ln["records"]["arrays"]["arrays"].values())
