"""A new release phase and a new histogram through the registries alone (issue 62).

The test adds a toy phase (``common.phases.register``), a toy histogram
(``common.histograms.register``) and the node's release of it (``fedsyn_client.client_app.serves``),
touching no module of the packages, then sends the phase's message to the real ClientApp and runs
``fedsyn plan``: the node noises it by the sigma the plan prints, books it in its ledger under the
phase's name, and refuses it beyond the node's cap for it (the node config's cap key follows the
registered phases).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest
from flwr.app import ConfigRecord, Message, RecordDict

from common import histograms, records as R
from common.calibration import Planned, basic_delta
from common.config import RunConfig
from common.dp import GAUSSIAN, analytic_gaussian_sigma
from common.phases import Phase, Pricing, register, unregister
from fedsyn_client import client_app, node as node_module
from fedsyn_client.histograms import vote_histogram
from fedsyn_client.ledger import PrivacyLedger
from fedsyn_client.node import Node
from fedsyn_client.release import GaussianHistogram, Request, release
from tests.fakes import client_node, set_task_identity

APP = Path(__file__).resolve().parents[1]
VOCAB = ["topic=x", "topic=y"]
TOY_EPSILON, BUDGET, DELTA = 1.0, 8.0, 1e-5


class FirstOfCode(histograms.Histogram):
    """Each record adds 1 to the first candidate of its code: L2 sensitivity 1."""

    name = "toy-first-of-code"
    formula = "1"

    def sensitivity(self, params: Mapping[str, Any]) -> float:
        return 1.0

    def score(self, rows: np.ndarray, codes: list[str], candidates: np.ndarray, candidate_codes: list[str],
              params: Mapping[str, Any], *, bound: int | None) -> np.ndarray:
        SEEN["rows"] = len(rows)
        first = {c: i for i, c in reversed(list(enumerate(candidate_codes)))}
        out = np.zeros(len(candidate_codes))
        np.add.at(out, [first[c] for c in codes if c in first], 1.0)
        return out


class Toy(Phase):
    """Every node releases the toy histogram once, at a fixed epsilon."""

    name = "toy"
    message = "query.toy"
    reply = "toy"

    def share(self, cfg: RunConfig, tier: str) -> float:
        return TOY_EPSILON

    def asked(self, cfg: RunConfig, asks_votes: bool) -> bool:
        return True

    def planned(self, pricing: Pricing) -> Planned | None:
        return Planned(self.name, GAUSSIAN, TOY_EPSILON, pricing.delta, 1.0)

    def wording(self, cfg: RunConfig, votes: tuple[int, float, str] | None, formulas: str) -> str:
        return "analytic Gaussian on the toy histogram, L2 sensitivity 1"


SEEN: dict[str, int] = {}


def toy_release(msg: Message, node: Node, cfg: RunConfig, req: Request) -> RecordDict:
    """The node's release of the toy phase: the toy histogram over the candidates, noised."""
    cand = msg.content.config_records[R.CANDIDATES]
    texts, codes = [str(t) for t in cand["texts"]], [str(c) for c in cand["codes"]]
    compute, sensitivity = vote_histogram(FirstOfCode.name, node.records(req.vocabulary), texts, codes, req.params,
                                          cfg, bound=node.bound)
    noisy, statement = release(node, req, GaussianHistogram(FirstOfCode.name, compute, sensitivity))
    return R.vector_reply(Toy.reply, noisy, statement)


@pytest.fixture
def toy():
    histograms.register(FirstOfCode())
    register(Toy())
    client_app.serves(Toy.name)(toy_release)
    try:
        yield
    finally:
        client_app.app._registered_funcs.pop("query.toy", None)
        client_app.RELEASES.pop(Toy.name, None)
        unregister(Toy.name)
        histograms.unregister(FirstOfCode.name)


def _send(tmp_path: Path, **node_config: Any) -> Message:
    node_module._policy.cache_clear()
    node_module._open.cache_clear()
    data = tmp_path / "notes.csv"
    pd.DataFrame([{"text": f"record {i} about {'xy'[i % 2]}", "topic": "xy"[i % 2]} for i in range(12)]).to_csv(
        data, index=False)
    config = {"tier": "weak", "data-path": str(data), "max-records": 40, "state-dir": str(tmp_path / "state"),
              "epsilon": BUDGET, "accounting": "basic", **node_config}
    rc = RunConfig(dataset=str(data), test_fraction=0.0, epsilon=BUDGET, max_length=16).to_flower()
    node = client_node(client_app.app, 5, config, rc, run_id=3)
    set_task_identity()
    content = RecordDict({R.CONFIG: ConfigRecord({"codes": VOCAB, "delta": DELTA}),
                          R.CANDIDATES: ConfigRecord({"texts": ["a", "b", "c"], "codes": ["topic=y", "topic=x",
                                                                                          "topic=x"]})})
    return node(Message(content=content, message_type=Toy.message, dst_node_id=5))


def test_a_toy_phase_and_histogram_run_through_the_real_clientapp_and_fedsyn_plan(toy, tmp_path, capsys):
    reply = _send(tmp_path)
    assert not reply.has_error(), reply.error.reason if reply.has_error() else ""
    statement = dict(reply.content.config_records[R.RELEASE])
    sigma = analytic_gaussian_sigma(TOY_EPSILON, basic_delta(DELTA, TOY_EPSILON, BUDGET, DELTA), 1.0)
    assert statement["phase"] == Toy.name and statement["histogram"] == FirstOfCode.name
    assert statement["sigma"] == pytest.approx(sigma) and statement["sensitivity"] == 1.0
    assert len(reply.content.metric_records[Toy.reply][Toy.reply]) == 3  # one noisy count per candidate
    assert SEEN["rows"] == 40  # handed the node's bound's rows (max-records), not its 12 records
    [entry] = PrivacyLedger(tmp_path / "state" / "ledger.json").releases
    assert (entry["phase"], entry["epsilon"], entry["status"]) == (Toy.name, TOY_EPSILON, "confirmed")

    from fedsyn_server.cli import main

    assert main(["plan", str(APP), "--run-config", "epsilon=8.0"]) == 0
    out = capsys.readouterr().out
    assert f"toy: epsilon 1, delta 1e-05, Gaussian sigma {sigma:.3g} (sensitivity 1; basic; " in out


def test_the_node_configs_cap_key_follows_a_registered_phase(toy, tmp_path):
    reply = _send(tmp_path, **{"max-epsilon-toy": 0.5})
    assert reply.has_error() and reply.error.code == R.ERR_POLICY
    assert not (tmp_path / "state" / "ledger.json").exists() or not json.loads(
        (tmp_path / "state" / "ledger.json").read_text()).get("releases")
