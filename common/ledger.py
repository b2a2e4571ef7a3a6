"""The node's own privacy ledger: every release, on the node's disk, before the reply leaves.

An institution does not have to trust the server's bookkeeping: the node refuses any
request that would take it past its budget, and the ledger survives restarts (it is
keyed by a fingerprint of the node's dataset, so running the app twice on the same
data spends twice).
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from common.io import atomic_write_json, read_json

# Float slack so that a budget spent exactly (e.g. 6 + 2 = 8) is not refused by rounding.
_TOLERANCE = 1e-6


class BudgetExceeded(RuntimeError):
    """A release would take the node past its epsilon budget (nothing was released)."""


@dataclass(frozen=True)
class Release:
    """One privacy-relevant release by a node (what left, with what noise, at what cost)."""

    phase: str  # "train" | "profile" | "vote"
    mechanism: str  # "gaussian" | "dp-sgd"
    epsilon: float  # basic-composition cost of this release (inf = no DP)
    delta: float
    run_id: str = ""
    round: int = 0
    sigma: float | None = None  # gaussian: noise std
    sensitivity: float | None = None  # gaussian: L2 sensitivity
    noise_multiplier: float | None = None  # dp-sgd
    sample_rate: float | None = None  # dp-sgd: Poisson rate q = B/|D|
    steps: int | None = None  # dp-sgd steps in this release
    max_grad_norm: float | None = None  # dp-sgd clipping bound
    time: float = field(default_factory=time.time)

    def to_dict(self) -> dict[str, Any]:
        """Plain dict without the unset (None) fields."""
        return {k: v for k, v in asdict(self).items() if v is not None}


class PrivacyLedger:
    """A node's budget and releases, persisted as JSON at ``<state-dir>/ledger-<fp>.json``."""

    def __init__(self, path: Path, fingerprint: str, budget: float, data: dict[str, Any]) -> None:
        self.path = path
        self.fingerprint = fingerprint
        self.budget = budget
        self._data = data

    @classmethod
    def open(cls, state_dir: str | Path, fingerprint: str, budget: float) -> PrivacyLedger:
        """Load the ledger for this dataset fingerprint (or start an empty one).

        ``budget`` is the node's total epsilon. A ledger that already exists keeps its
        releases; a different budget given here replaces the old one (the user gave a new
        budget explicitly), and that change is recorded.
        """
        path = Path(state_dir) / f"ledger-{fingerprint[:16]}.json"
        if path.exists():
            data = read_json(path)
            if data.get("fingerprint") != fingerprint:
                raise RuntimeError(f"ledger {path} belongs to another dataset; remove it or use another state-dir")
            old = float(data["budget"])
            if old != budget:
                data.setdefault("budget_changes", []).append({"from": old, "to": budget, "time": time.time()})
        else:
            data = {"fingerprint": fingerprint, "releases": [], "accountants": {}}
        data["budget"] = budget
        ledger = cls(path, fingerprint, budget, data)
        ledger._save()
        return ledger

    # ----------------------------------------------------------------- queries
    @property
    def releases(self) -> list[dict[str, Any]]:
        """All releases ever made on this dataset, oldest first."""
        return list(self._data["releases"])

    def spent(self, run_id: str | None = None, phase: str | None = None) -> float:
        """Epsilon spent by basic composition (sum over releases), optionally of one run/phase."""
        return float(sum(
            float(r["epsilon"]) for r in self._data["releases"]
            if (run_id is None or r.get("run_id") == run_id) and (phase is None or r["phase"] == phase)
        ))

    def remaining(self) -> float:
        """Budget left (may be inf)."""
        return self.budget - self.spent() if math.isfinite(self.budget) else math.inf

    def check(self, epsilon: float, what: str) -> None:
        """Raise ``BudgetExceeded`` (saying how much is left) if ``epsilon`` does not fit."""
        if math.isinf(epsilon) and math.isfinite(self.budget):
            raise BudgetExceeded(
                f"{what}: refused, a non-private release (epsilon = inf) exceeds this node's budget "
                f"epsilon = {self.budget:g}"
            )
        if epsilon > self.remaining() + _TOLERANCE:
            raise BudgetExceeded(
                f"{what}: refused, needs epsilon = {epsilon:.4g} but this node has "
                f"{max(self.remaining(), 0.0):.4g} left of its budget {self.budget:g} "
                f"(spent {self.spent():.4g} in {len(self._data['releases'])} releases)"
            )

    # ----------------------------------------------------------------- updates
    def record(self, release: Release, accountant: tuple[str, list] | None = None) -> None:
        """Check and append ``release``, then persist atomically (call before replying).

        ``accountant`` = (key, history) stores a DP-SGD accountant history in the same
        write, so a crash never leaves a release without its accountant state or back.
        """
        self.check(release.epsilon, release.phase)
        self._data["releases"].append(release.to_dict())
        if accountant is not None:
            key, history = accountant
            self._data["accountants"][key] = [list(h) for h in history]
        self._save()

    def accountant_history(self, key: str) -> list[list[float]]:
        """The DP-SGD accountant history stored under ``key`` (one per run), or []."""
        return [list(h) for h in self._data["accountants"].get(key, [])]

    def _save(self) -> None:
        atomic_write_json(self.path, self._data)
