"""Pre-flight holds: the epsilon a node keeps for a run it said it can finish (``PrivacyLedger.hold``).

A hold makes two runs started at once see each other: the second one's pre-flight finds the
budget held and is refused before anything is spent, instead of both spending part and neither
finishing. It never lets a run spend more: every release is still checked against the budget.

A hold ends when its run asks for its ledger at the end, or lapses: ``HOLD_UNCONFIRMED_SECONDS``
after it was made unless a release of its run confirms it, then ``HOLD_SECONDS`` after the run's
last release (a crashed run keeps it meanwhile, so it can be resumed). Only the hash of the
run's ``hold-token`` is kept; only the same token renews or ends a hold.

Holds cannot lock a node: a tier query costs the server nothing, so at most
``max_unconfirmed`` holds no release has confirmed live at a time (policy key
``max-unconfirmed-holds``, default 1). Beyond that a run's pre-flight is answered but holds
nothing: a server asking under fresh run keys keeps at most one run's epsilon held, never the
whole budget run by run.

Functions on the ledger's data dict; the ledger calls them under its lock.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable
from typing import Any

HOLD_SECONDS = 6 * 3600.0  # a confirmed hold lapses this long after its run's last release
# A hold no release has confirmed lapses soon: a tier query alone must not lock a node's budget
# for hours. Long enough for phase 1 before a weak node's first release on the default run.
HOLD_UNCONFIRMED_SECONDS = 1800.0
MAX_UNCONFIRMED_HOLDS = 1


def token_hash(token: str) -> str:
    """What the ledger keeps of a run's hold token."""
    return hashlib.sha256(f"fedsyn-hold:{token}".encode()).hexdigest()


def live(data: dict[str, Any], now: float) -> dict[str, dict[str, Any]]:
    """The holds that have not lapsed at ``now`` (the lapsed ones are dropped from ``data``)."""
    data["holds"] = {r: h for r, h in data.get("holds", {}).items() if float(h["until"]) >= now}
    return data["holds"]


def take(data: dict[str, Any], run_id: str, needed: float, token: str, now: float, max_unconfirmed: int) -> bool:
    """Hold ``needed`` for ``run_id`` (its pre-flight found it can pay); returns whether it holds.

    Asking again never stretches an unconfirmed hold (only a release does), a hold made with
    another token is left alone, and no new unconfirmed hold is made while ``max_unconfirmed``
    of other runs live.
    """
    holds, digest = live(data, now), token_hash(token)
    mine = holds.get(run_id)
    if not math.isfinite(needed) or (mine is not None and mine.get("token") != digest):
        return False
    if mine is None and sum(not h.get("confirmed") for h in holds.values()) >= max_unconfirmed:
        return False
    confirmed = bool(mine and mine.get("confirmed"))
    until = now + HOLD_SECONDS if confirmed else (float(mine["until"]) if mine else now + HOLD_UNCONFIRMED_SECONDS)
    holds[run_id] = {"epsilon": float(needed), "token": digest, "confirmed": confirmed, "until": until}
    return True


def confirm(data: dict[str, Any], run_id: str, now: float) -> None:
    """A release of ``run_id``: its hold (if any) now lasts while the run releases."""
    hold = data.get("holds", {}).get(run_id)
    if hold is not None:
        hold.update(confirmed=True, until=now + HOLD_SECONDS)


def end(data: dict[str, Any], run_id: str | None, token: str) -> list[str]:
    """End ``run_id``'s hold if ``token`` made it, or every hold (None); the runs whose holds ended."""
    holds = data.setdefault("holds", {})
    ended = [r for r in list(holds) if run_id is None or (r == run_id and holds[r].get("token") == token_hash(token))]
    for r in ended:
        holds.pop(r)
    return ended


def held(data: dict[str, Any], spent: Callable[[str], float], now: float, except_run: str | None = None) -> float:
    """Epsilon that live holds of runs other than ``except_run`` may still spend (``spent(run)``:
    what a run has spent already)."""
    return float(sum(max(float(h["epsilon"]) - spent(run_id), 0.0) for run_id, h in data.get("holds", {}).items()
                     if run_id != except_run and float(h["until"]) >= now))
