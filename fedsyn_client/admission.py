"""What a release must pass before the ledger reserves it, and the budget sums those rules use.

Every rule reads only the ledger's own data (what was spent, what is held, what the node's
policy caps): a refusal says which rule and by how much, and nothing in it depends on the
records. The rules, in the order they are tried:

1. the node's total budget (epsilon, delta), less what other live runs hold (``check``): under
   ``pld`` the composition of every counted release and this one at the policy's delta, under
   ``basic`` the sums of their epsilons and of their deltas (issue 60);
2. the policy's cap on the phase across runs, over its window (``cap``);
3. the terms the run's phase was calibrated for at its first reservation (``binding``);
4. one release per run, phase and round, ever;
5. the run's budget for the phase;
6. the steps the phase's noise was calibrated for (DP-SGD).

Functions on the ledger's data dict, like ``fedsyn_client.holds``; ``PrivacyLedger.reserve``
calls ``admit`` under its lock, so a refusal records nothing.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

from common.accounting import Accounting
from common.io import jsonable
from fedsyn_client import holds, refusals
from fedsyn_client.refusals import BudgetExceeded

# An entry's status: reserved before the work, then confirmed (released) or failed (stays
# charged); cancelled is a legacy status, and such an entry never counts.
RESERVED, CONFIRMED, FAILED, CANCELLED = "reserved", "confirmed", "failed", "cancelled"
# Float slack so that a budget spent exactly (e.g. 6 + 2 = 8) is not refused by rounding.
TOLERANCE = 1e-6
# The same for deltas, relative to the policy's (a split of 1e-5 in thirds adds up to a hair more).
DELTA_TOLERANCE = 1e-9


@dataclass(frozen=True)
class Rule:
    """How the node's policy budgets a release: its ``accounting`` rule (``common.accounting``) and
    its ``delta``, the node's (with the ledger's epsilon budget, the node's (epsilon, delta))."""

    accounting: Accounting
    delta: float


def counted(releases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The entries that count against the budget: all but legacy cancelled ones."""
    return [r for r in releases if r.get("status") != CANCELLED]


def spent(releases: list[dict[str, Any]], run_id: str | None = None, phase: str | None = None) -> float:
    """Epsilon of the counted entries (basic composition), optionally of one run and/or phase."""
    return float(sum(float(r["epsilon"]) for r in counted(releases)
                     if (run_id is None or r.get("run_id") == run_id) and (phase is None or r["phase"] == phase)))


def held(data: dict[str, Any], except_run: str | None = None) -> float:
    """Epsilon that live holds of runs other than ``except_run`` may still spend."""
    return holds.held(data, lambda run_id: spent(data["releases"], run_id), time.time(), except_run)


def remaining(data: dict[str, Any], run_id: str | None = None) -> float:
    """Budget left for ``run_id`` (inf for an infinite budget): not spent, not held for another run."""
    budget = float(data["budget"])
    return budget - spent(data["releases"]) - held(data, run_id) if math.isfinite(budget) else math.inf


def delta_spent(releases: list[dict[str, Any]]) -> float:
    """Delta of the counted entries (basic composition)."""
    return float(sum(float(r["delta"]) for r in counted(releases)))


def check(data: dict[str, Any], epsilon: float, what: str, run_id: str | None = None, rule: Rule | None = None,
          candidate: dict[str, Any] | None = None) -> None:
    """Raise ``BudgetExceeded`` (saying how much is left) if a release does not fit the budget.

    ``rule`` None (a caller that knows no policy) or ``basic``: ``epsilon`` against what the
    stated epsilons leave, and under ``basic`` the ``candidate`` entry's delta against what the
    stated deltas leave of the policy's. ``pld``: the composition of every counted entry and the
    ``candidate`` (the entry the release would make) at the policy's delta.
    """
    budget = float(data["budget"])
    if math.isinf(epsilon) and math.isfinite(budget):
        raise BudgetExceeded(refusals.BUDGET, f"{what}: refused, a non-private release (epsilon = inf) exceeds this "
                             f"node's budget epsilon = {budget:g}")
    if not math.isfinite(budget):
        return
    other = held(data, run_id)
    entries = counted(data["releases"])
    now = rule.accounting.ledger_epsilon(entries, rule.delta) if rule is not None and candidate is not None else None
    if now is not None:  # the rule composes the ledger: its composition with the candidate is what is spent
        assert rule is not None and candidate is not None  # `now` is computed only with both
        after = rule.accounting.ledger_epsilon([*entries, candidate], rule.delta)
        assert after is not None  # a rule that composes the ledger composes it with the candidate too
        if after > budget - other + TOLERANCE:
            raise BudgetExceeded(refusals.BUDGET, (
                f"{what}: refused, every release of this node composed with it at the policy's delta = {rule.delta:g} "
                f"would reach epsilon = {after:.4g}, above its budget {budget:g} (composed now: {now:.4g} in "
                f"{len(entries)} releases" + (f", {other:.4g} held for other runs under way" if other else "") + ")"))
        return
    left = remaining(data, run_id)
    if epsilon > left + TOLERANCE:
        raise BudgetExceeded(refusals.BUDGET,
            f"{what}: refused, needs epsilon = {epsilon:.4g} but this node has {max(left, 0.0):.4g} left of its "
            f"budget {budget:g} (spent {spent(data['releases']):.4g} in {len(counted(data['releases']))} releases"
            + (f", {other:.4g} held for other runs under way" if other else "") + ")")
    if rule is not None and candidate is not None:
        used, delta = delta_spent(data["releases"]), float(candidate["delta"])
        if used + delta > rule.delta * (1 + DELTA_TOLERANCE):
            raise BudgetExceeded(refusals.BUDGET, (
                f"{what}: refused, needs delta = {delta:.4g} but the releases of this node have spent {used:.4g} of "
                f"the policy's delta = {rule.delta:g} (under accounting = basic deltas add up)"))


def admit(data: dict[str, Any], phase: str, epsilon: float, run_id: str, rnd: int, run_phase_budget: float,
          steps: tuple[int, int] | None = None, cap: tuple[float, float] | None = None,
          binding: dict[str, Any] | None = None, rule: Rule | None = None,
          candidate: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """Try the rules above on a release of ``epsilon`` for ``phase``, round ``rnd`` of run ``run_id``.

    ``run_phase_budget``: what this run may spend on the phase. ``steps`` = (steps of this
    release, steps the run's phase may take). ``cap`` = (the policy's epsilon cap for the phase,
    its window in days; 0 = the ledger's life). ``binding``: the terms this release's noise was
    calibrated for. ``rule`` and ``candidate``: the node's policy and the entry the release would
    make, for the budget's rule (``check``). Returns the terms the run's phase is already bound to
    (None: this is its first reservation, which binds it); raises ``BudgetExceeded`` naming the
    rule that refused.
    """
    check(data, epsilon, phase, run_id, rule, candidate)
    if cap is not None:
        since = time.time() - cap[1] * 86400.0 if cap[1] > 0 else -math.inf
        used = sum(float(r["epsilon"]) for r in counted(data["releases"])
                   if r["phase"] == phase and float(r.get("time", 0.0)) >= since)
        if used + epsilon > cap[0] + TOLERANCE:
            raise BudgetExceeded(refusals.BUDGET_CAP, (
                f"{phase}: refused, the policy caps {phase} at epsilon = {cap[0]:g} across runs "
                f"and {used:.4g} is spent; the request needs {epsilon:.4g} more"))
    run = [r for r in counted(data["releases"]) if r["run_id"] == run_id and r["phase"] == phase]
    bound = next((r["binding"] for r in run if "binding" in r), None)
    # compared as the ledger file holds them: JSON writes an epsilon of inf (a run without DP) as "inf"
    # and a tuple as a list, so the terms read back from it are compared with the request's so written
    written, asked = (jsonable(bound), jsonable(binding)) if binding is not None and bound is not None else ({}, {})
    if written != asked:
        differs = sorted(k for k in set(written) | set(asked) if written.get(k) != asked.get(k))
        raise BudgetExceeded(refusals.BUDGET_BOUND, (
            f"{phase}: refused, this run's {phase} reservation was made for other terms "
            f"({', '.join(differs)} differ); a changed run is a new run (a new resume-key)"))
    # One release per run, phase and round, ever: a repeat of a released request is answered from
    # the stored reply before it gets here; anything else under the same name (a second server
    # process, a round still in flight after `flwr stop`) is refused.
    same = [r for r in run if int(r.get("round", 0)) == int(rnd)]
    if same:
        state = "is in progress or was cut off" if same[0]["status"] == RESERVED else "was released"
        raise BudgetExceeded(refusals.BUDGET_ROUND, f"{phase}: refused, round {rnd} of this "
                             f"run {state} on this node; a release is made once per round")
    already = float(sum(float(r["epsilon"]) for r in run))
    if math.isfinite(run_phase_budget) and already + epsilon > run_phase_budget + TOLERANCE:
        raise BudgetExceeded(refusals.BUDGET_PHASE,
            f"{phase}: refused, this run's {phase} budget is epsilon = {run_phase_budget:g} "
            f"and {already:.4g} is spent; the request needs {epsilon:.4g} more")
    taken = sum(int(r.get("public", {}).get("steps", 0)) for r in run)
    if steps is not None and taken + steps[0] > steps[1]:
        raise BudgetExceeded(refusals.BUDGET_STEPS,
            f"{phase}: refused, this run's {phase} is calibrated for {steps[1]} steps and "
            f"{taken} are taken; {steps[0]} more would exceed its epsilon")
    return bound
