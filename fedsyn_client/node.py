"""A node's standing facts: its tier, its data, its budget and its ledger.

Simulation: tier and data follow from ``partition-id`` / ``num-partitions`` and the run
config (``common.federation``); the ledger lives in a temp dir per run and node.
Deployment: ``flower-supernode --node-config 'tier="strong" data-path="/data/x.csv"
state-dir="/var/lib/fedsyn" epsilon=8'``. The node-config ``epsilon`` is the
institution's own budget and wins over the run config's: the server cannot raise it.
"""

from __future__ import annotations

import math
import tempfile
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from common.logs import get_logger
from common.config import RunConfig
from common.data import TextData, dataset_fingerprint, load_node_data
from common.dp import STRONG, TIERS, split_budget
from common.federation import simulation_node_data
from common.ledger import PrivacyLedger

log = get_logger(__name__)


class NodeSetupError(RuntimeError):
    """The node's configuration or data is unusable (message says what and how to fix)."""


@dataclass
class Node:
    """Everything a handler needs about this node."""

    tier: str
    data: TextData
    ledger: PrivacyLedger
    epsilon_budget: float
    epsilon_profile: float
    epsilon_main: float  # train (strong) or vote (weak); see ``phase_epsilon``

    def phase_epsilon(self, phase: str, voters: str) -> float:
        """The epsilon this node spends on ``phase`` ('train' | 'profile' | 'vote').

        Appendix B: strong = train + profile, weak = vote + profile. When strong nodes
        also vote (``voters = all``) their non-profile share is split evenly between
        training and voting, so the total stays the same for every node.
        """
        if phase == "profile":
            return self.epsilon_profile
        if self.tier == STRONG and voters == "all":
            return self.epsilon_main / 2
        return self.epsilon_main


def node_config_value(node_config: dict[str, Any], key: str, default: Any = None) -> Any:
    """A node-config value, with ``-`` and ``_`` spellings both accepted."""
    return node_config.get(key, node_config.get(key.replace("-", "_"), default))


def get_node(run_id: int, node_config: dict[str, Any], cfg: RunConfig) -> Node:
    """Build (once per process and run) this node's ``Node`` from its configs."""
    key = tuple(sorted((str(k), str(v)) for k, v in node_config.items()))
    return _get_node(run_id, key, cfg)


@lru_cache(maxsize=16)
def _get_node(run_id: int, node_config_items: tuple[tuple[str, str], ...], cfg: RunConfig) -> Node:
    node_config = dict(node_config_items)
    if "partition-id" in node_config and "data-path" not in node_config:
        num = int(node_config["num-partitions"])
        pid = int(node_config["partition-id"])
        tier, data = simulation_node_data(cfg, pid, num)
        default_state = Path(tempfile.gettempdir()) / "fedsyn-sim" / f"run-{run_id}" / f"node-{pid}"
    else:
        tier = str(node_config_value(node_config, "tier", "")).strip().lower()
        if tier not in TIERS:
            raise NodeSetupError(f"node-config tier = {tier!r} is invalid; set tier=\"strong\" or tier=\"weak\"")
        path = node_config_value(node_config, "data-path")
        if not path:
            raise NodeSetupError('node-config data-path is missing; set data-path="/path/to/records.csv"')
        data = load_node_data(str(path), cfg.text_column, list(cfg.control_columns))
        default_state = Path.home() / ".fedsyn" / "state"
    if len(data) == 0:
        raise NodeSetupError("this node has no records")
    state_dir = Path(str(node_config_value(node_config, "state-dir", default_state)))
    budget = float(node_config_value(node_config, "epsilon", cfg.epsilon))
    split = split_budget(budget, cfg.epsilon_profile) if math.isfinite(budget) else split_budget(math.inf, 0)
    ledger = PrivacyLedger.open(state_dir, dataset_fingerprint(data), budget)
    log.info("node ready: tier=%s records=%d budget=%s ledger=%s", tier, len(data), budget, ledger.path)
    return Node(tier, data, ledger, budget, split.profile, split.main)
