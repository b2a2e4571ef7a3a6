"""A node's privacy policy: what the institution allows its records to lose, whatever the server asks.

The server *asks* (run config + message); the node checks the request against its policy
and refuses what does not fit, before it reads a record. Everything that decides how much
a node's records can lose comes from here, never from the server:

| policy field      | node-config key (deployment)            | simulation (no institution)      |
|-------------------|-----------------------------------------|----------------------------------|
| tier              | ``tier``                                | from ``strong-fraction``         |
| data              | ``data-path``                           | the node's partition             |
| text column       | ``text-column`` (default ``text``)      | run config ``text-column``       |
| control columns   | ``control-columns`` (default ``topic``) | run config ``control-columns``   |
| vocabulary        | ``control-codes`` (optional, pins it)   | the benchmark's vocabulary       |
| total epsilon     | ``epsilon`` (**required**)              | run config ``epsilon``           |
| largest delta     | ``delta`` (default 1e-5)                | the run's resolved ``delta``     |
| per-phase caps    | ``max-epsilon-train``/``-profile``/``-vote`` (optional, per run) | none    |
| ledger            | ``state-dir``, ``ledger-id``            | a temp dir per run               |

``policy-file`` names a TOML file with the same keys (node-config keys win), so an
institution can keep its policy under version control.
"""

from __future__ import annotations

import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common.dp import PHASES, TIERS

DEFAULT_DELTA = 1e-5
NODE_KEYS = ("tier", "data-path", "text-column", "control-columns", "control-codes", "epsilon", "delta",
             "max-epsilon-train", "max-epsilon-profile", "max-epsilon-vote", "state-dir", "ledger-id",
             "audit-dir", "policy-file")
_SIMULATION_KEYS = ("partition-id", "num-partitions")  # set by Flower's simulation engine


class PolicyError(ValueError):
    """The node's own configuration is unusable; the message says what to set."""


class PolicyRefused(PermissionError):
    """A request the node's policy does not allow (nothing was read or released)."""


@dataclass(frozen=True)
class NodePolicy:
    """The institution's rules for its node (see the module docstring for the keys)."""

    tier: str
    epsilon: float  # total budget of this node's records, across all runs
    delta: float = DEFAULT_DELTA  # the largest delta this node accepts per release
    text_column: str = "text"
    control_columns: tuple[str, ...] = ("topic",)
    control_codes: tuple[str, ...] = ()  # () = accept the server's public vocabulary
    data_path: str = ""  # "" in simulation (the partition comes from the run config)
    state_dir: str = ""
    ledger_id: str = ""
    phase_caps: tuple[tuple[str, float], ...] = ()  # (phase, max epsilon per run)
    simulated: bool = False
    partition: tuple[int, ...] = ()  # simulation: (partition id, number of partitions)
    warnings: tuple[str, ...] = field(default=(), compare=False)

    # ----------------------------------------------------------------- checks
    def check_run(self, text_column: str, control_columns: Sequence[str], epsilon: float) -> None:
        """Refuse a run whose data view or per-node epsilon this policy does not allow.

        ``epsilon`` is the run's per-node total; it may be lower than the node's budget
        (the node then spends less), never higher. Raises ``PolicyRefused``.
        """
        if text_column != self.text_column or tuple(control_columns) != self.control_columns:
            raise PolicyRefused(
                f"the run asks for text-column={text_column!r} control-columns={','.join(control_columns)!r}, "
                f"but this node's policy is text-column={self.text_column!r} "
                f"control-columns={','.join(self.control_columns)!r}; the operator must use the node's columns "
                f"(or the institution changes its node config)")
        if epsilon > self.epsilon:
            raise PolicyRefused(
                f"the run asks for epsilon = {epsilon:g} per node, above this node's budget epsilon = "
                f"{self.epsilon:g}; run with --run-config 'epsilon={self.epsilon:g}' or less")

    def check_vocabulary(self, codes: Sequence[str]) -> None:
        """Refuse a vocabulary other than the pinned one (when the policy pins one)."""
        if not codes:
            raise PolicyRefused("the request carries an empty control-code vocabulary")
        if self.control_codes and set(codes) != set(self.control_codes):
            raise PolicyRefused(
                f"the request's control-code vocabulary ({len(set(codes))} codes) is not this node's "
                f"pinned vocabulary ({len(self.control_codes)} codes, node-config control-codes); "
                f"the operator must send exactly the node's vocabulary")

    def check_delta(self, delta: Any) -> None:
        """Refuse a delta that is not a number in (0, policy delta]."""
        if isinstance(delta, bool) or not isinstance(delta, (int, float)) or not 0 < delta <= self.delta:
            raise PolicyRefused(
                f"the request asks for delta = {delta!r}; this node accepts 0 < delta <= {self.delta:g} "
                f"per release (node-config delta); run with --run-config 'delta=\"{self.delta:g}\"' or smaller")

    def check_phase(self, phase: str, epsilon_this_run: float) -> None:
        """Refuse a run whose epsilon for ``phase`` exceeds the policy's per-phase cap."""
        cap = dict(self.phase_caps).get(phase)
        if cap is not None and epsilon_this_run > cap + 1e-9:
            raise PolicyRefused(
                f"the run asks for epsilon = {epsilon_this_run:.4g} for {phase}, above this node's cap "
                f"max-epsilon-{phase} = {cap:g}")


# --------------------------------------------------------------------------- building
def is_simulated(node_config: Mapping[str, Any]) -> bool:
    """True for a node started by Flower's simulation engine without its own data file."""
    return all(k in node_config for k in _SIMULATION_KEYS) and not _get(node_config, "data-path")


def policy_from_node_config(node_config: Mapping[str, Any]) -> NodePolicy:
    """The policy of a deployed node, from its ``--node-config`` (and ``policy-file``).

    Raises ``PolicyError`` naming the missing or invalid key and how to set it.
    """
    values: dict[str, Any] = {}
    file = _get(node_config, "policy-file")
    if file:
        values.update(_read_policy_file(Path(str(file)).expanduser()))
    values.update({k: v for k, v in ((k, _get(node_config, k)) for k in NODE_KEYS) if v is not None})
    unknown = sorted(k for k in values if k not in NODE_KEYS)
    if unknown:
        raise PolicyError(f"unknown policy key(s) {unknown} in {file}; allowed: {list(NODE_KEYS)}")

    tier = str(values.get("tier", "")).strip().lower()
    if tier not in TIERS:
        raise PolicyError(f'node-config tier = {tier!r} is invalid; set tier="strong" or tier="weak"')
    data_path = str(values.get("data-path", "")).strip()
    if not data_path:
        raise PolicyError('node-config data-path is missing; set data-path="/path/to/records.csv"')
    if "epsilon" not in values:
        raise PolicyError(
            "node-config epsilon is missing: this node does not let the server choose its privacy budget. "
            "Set the institution's total budget, e.g. --node-config '... epsilon=8.0'")
    epsilon = _float("epsilon", values["epsilon"])
    if not epsilon > 0:
        raise PolicyError(f"node-config epsilon = {epsilon} must be > 0 (or inf to switch DP off on purpose)")
    delta = _float("delta", values.get("delta", DEFAULT_DELTA))
    if not 0 < delta < 1:
        raise PolicyError(f"node-config delta = {delta} must be in (0, 1); the default is {DEFAULT_DELTA:g}")
    columns = _names(values.get("control-columns", "topic"))
    text_column = str(values.get("text-column", "text")).strip()
    if not columns or not text_column or text_column in columns:
        raise PolicyError(f"node-config text-column = {text_column!r} / control-columns = {columns} are invalid: "
                          "one text column and one or more other control columns")
    caps = tuple((p, _float(f"max-epsilon-{p}", values[f"max-epsilon-{p}"]))
                 for p in PHASES if f"max-epsilon-{p}" in values)
    codes = _names(values.get("control-codes", ""))
    notes = () if codes else (
        "node-config control-codes is not set: this node accepts the server's public vocabulary and drops "
        "records whose code is not in it; set control-codes to pin the vocabulary",)
    return NodePolicy(
        tier=tier, epsilon=epsilon, delta=delta, text_column=text_column, control_columns=columns,
        control_codes=codes, data_path=data_path, state_dir=str(values.get("state-dir", "")),
        ledger_id=str(values.get("ledger-id", "")), phase_caps=caps, warnings=notes,
    )


def simulation_policy(tier: str, epsilon: float, delta: float, text_column: str,
                      control_columns: Sequence[str], vocabulary: Sequence[str], state_dir: str,
                      partition: tuple[int, int]) -> NodePolicy:
    """The policy of a simulated node: built from the run config, since no institution exists."""
    return NodePolicy(tier=tier, epsilon=epsilon, delta=delta, text_column=text_column,
                      control_columns=tuple(control_columns), control_codes=tuple(vocabulary),
                      state_dir=state_dir, simulated=True, partition=tuple(partition))


def _get(node_config: Mapping[str, Any], key: str) -> Any:
    return node_config.get(key, node_config.get(key.replace("-", "_")))


def _read_policy_file(path: Path) -> dict[str, Any]:
    try:
        return dict(tomllib.loads(path.read_text(encoding="utf-8")))
    except FileNotFoundError:
        raise PolicyError(f"node-config policy-file {path} does not exist") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as err:
        raise PolicyError(f"node-config policy-file {path} is not valid TOML: {err}") from None


def _float(key: str, raw: Any) -> float:
    try:
        if isinstance(raw, bool):
            raise ValueError
        return float(raw)
    except (TypeError, ValueError):
        raise PolicyError(f"node-config {key} = {raw!r} is not a number") from None


def _names(raw: Any) -> tuple[str, ...]:
    items = raw if isinstance(raw, (list, tuple)) else str(raw).split(",")
    return tuple(s.strip() for s in map(str, items) if s.strip())
