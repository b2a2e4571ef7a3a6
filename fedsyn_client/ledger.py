"""The node's own privacy ledger: every release, on the node's disk, before the reply leaves.

An institution does not have to trust the server's bookkeeping. The ledger belongs to the
node, not to a view of its data: one ledger per state directory (or per explicit
``ledger-id``), so editing the data file or changing columns never resets it. Starting
over is an operator's act (``fedsyn ledger STATE_DIR --reset --reason ...``), recorded.

Every read-check-write holds an exclusive file lock, so concurrent ClientApp processes
(Flower starts one per message) or two SuperNodes on one state dir cannot both pass a
check: epsilon is *reserved* under the lock before any work starts, then *confirmed*
with the mechanism's details, or marked *failed*. Once reserved, a release stays charged
whatever happens: a failure that were free would let a server probe the records with
inputs that fail on one condition and not on another. A crash leaves the reservation counted.
A Gaussian release (profile, vote) whose process provably died before confirming (same machine
and boot, the process gone) is *taken over* by the identical request (same digest, same terms)
instead of being refused forever: confirmation precedes every reply, so nothing of the dead
attempt left the node, and the round is released once, on the one charge (a Ray worker or an
OOM-killed ClientApp mid-vote). Its computation is a deterministic function of the request and
the records (only the noise, drawn last, is random), so a second crash repeats the first one's
bit and tells nothing new. DP-SGD is not taken over: its Poisson batches are fresh each try, so
repeated crashes would sample a data-dependent event for free; a cut-off training round stays
spent, as before.

The ledger is the node's memory of what its records lost, so the node refuses to serve when
it is damaged, when it is missing from a state dir that has released before (its stored
replies or archives are there), or when the node config's budget differs from the ledger's:
a budget changes only by ``fedsyn ledger STATE_DIR --set-budget EPS --reason ...``.

Each entry: ``id``, ``status`` (reserved | confirmed | failed | cancelled: legacy), ``run_id``, ``phase``,
``round``, ``mechanism``, ``epsilon``, ``delta``, ``time``; ``public`` (data-independent
parameters the server also sees: sigma, sensitivity, histogram) and ``private`` (details
that may depend on the records, e.g. DP-SGD's sampling rate: they never leave the node; a
DP-SGD reservation holds its noise multiplier and q from before its first step, so the ledger
composes it from then on). ``policy`` (issue 60): the rule and delta the node's last release was
budgeted by, for ``summary``.

This module keeps the file, its lock and the operator's acts. The rules a release must pass
before it is reserved are ``fedsyn_client.admission``; pre-flight holds ``fedsyn_client.holds``;
takeovers of a dead process's reservation ``fedsyn_client.claims``.
"""

from __future__ import annotations

import fcntl
import math
import os
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from common.calibration import ledger_epsilon
from common.dp import GAUSSIAN, SKELLAM, composed_epsilon, preflight
from common.io import atomic_write_json, read_json
from fedsyn_client import admission, holds, refusals
from fedsyn_client.admission import CONFIRMED, FAILED, RESERVED, Rule
from fedsyn_client.claims import claim, cut_off
from fedsyn_client.holds import MAX_UNCONFIRMED_HOLDS
from fedsyn_client.refusals import BudgetExceeded, NodeSetupError

FORMAT = 2
_KEYS = ("format", "budget", "releases", "accountants", "budget_changes", "resets", "data")


class LedgerError(NodeSetupError):
    """The ledger is damaged, missing where it existed, or disagrees with the node config; the
    message names the file and what the operator does. The node serves nothing until then."""


@dataclass(frozen=True)
class Release:
    """One privacy-relevant release by a node: what it costs and how it was noised."""

    phase: str  # common.dp.PHASES
    mechanism: str  # common.dp.GAUSSIAN | common.dp.DPSGD
    epsilon: float  # basic-composition cost (inf = no DP)
    delta: float
    run_id: str = ""
    round: int = 0
    public: dict[str, Any] = field(default_factory=dict)  # data-independent: may be sent to the server
    private: dict[str, Any] = field(default_factory=dict)  # the terms the ledger composes it by; never sent

    def statement(self) -> dict[str, Any]:
        """What the node tells the server about this release: no field depends on the records."""
        return {"phase": self.phase, "mechanism": self.mechanism, "epsilon": float(self.epsilon),
                "delta": float(self.delta), "run_id": self.run_id, "round": int(self.round), **self.public}


def ledger_path(state_dir: str | Path, ledger_id: str = "") -> Path:
    """``<state-dir>/ledger.json``, or ``ledger-<ledger-id>.json`` for an explicit id."""
    if ledger_id and not all(c.isalnum() or c in "-_." for c in ledger_id):
        raise ValueError(f"ledger-id {ledger_id!r} may only contain letters, digits, '-', '_' and '.'")
    return Path(state_dir).expanduser() / (f"ledger-{ledger_id}.json" if ledger_id else "ledger.json")


@dataclass(frozen=True)
class Preflight:
    """What ``PrivacyLedger.hold`` decided, and the ledger facts it decided on (one locked read)."""

    shortfall: float  # epsilon the run lacks; 0: it can finish, and what it needs is now held for it
    remaining: float  # budget left for the run (may be inf): not spent, not held for another run
    held: float  # epsilon held for other live runs and not yet spent by them
    ref: str  # the ledger's random name (``PrivacyLedger.ref``)


class PrivacyLedger:
    """A node's budget and releases at ``ledger_path(state_dir, ledger_id)``; always read from disk."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock_path = path.with_name(path.name + ".lock")

    # ----------------------------------------------------------------- opening
    @classmethod
    def open(cls, state_dir: str | Path, budget: float, ledger_id: str = "",
             data_fingerprint: str = "", delta: float | None = None) -> PrivacyLedger:
        """Open the node's ledger with its total ``budget`` and ``delta`` (the node policy's), or
        create it.

        Raises ``LedgerError`` when the stored budget differs, or the delta its releases were
        composed at (a budget's epsilon and delta change only by ``set_budget``: a larger delta
        would lower every epsilon spent), when the file is damaged, or when it is missing from a
        state dir that released before (``traces``). ``data_fingerprint`` is informational only: a
        change of data is logged in the ledger, it never opens a new one.
        """
        ledger = cls(ledger_path(state_dir, ledger_id))
        ledger.path.parent.mkdir(parents=True, exist_ok=True)
        if not ledger.path.exists():
            trace = ledger.traces()
            if trace:
                raise LedgerError(
                    f"the ledger {ledger.path} is missing but this state dir has released before ({trace[0]}); the "
                    f"node will not start a fresh one. Restore it from a backup, or start over on purpose: "
                    f"fedsyn ledger {state_dir} --reset --reason '...' --budget {budget:g}")
        with ledger._locked() as data:
            if data["budget"] is not None and float(data["budget"]) != float(budget):
                raise LedgerError(
                    f"node-config epsilon = {budget:g} but the ledger {ledger.path} has budget {data['budget']:g}; a "
                    f"budget changes only on purpose: fedsyn ledger {state_dir} --set-budget {budget:g} --reason '...'")
            pinned = (data.get("policy") or {}).get("delta")
            if delta is not None and pinned is not None and float(pinned) != float(delta):
                raise LedgerError(
                    f"node-config delta = {delta:g} but the ledger {ledger.path} composes its releases at delta = "
                    f"{float(pinned):g}; a budget's delta changes only on purpose: fedsyn ledger {state_dir} "
                    f"--set-budget {float(data['budget']):g} --delta {delta:g} --reason '...'")
            data["budget"] = budget
            if data_fingerprint and (not data["data"] or data["data"][-1]["fingerprint"] != data_fingerprint):
                data["data"].append({"fingerprint": data_fingerprint, "since": time.time()})
            data.setdefault("ref", uuid.uuid4().hex)  # ledgers written before refs get one now
        return ledger

    def traces(self) -> list[str]:
        """What shows that this state dir had a ledger: stored replies, archived ledgers."""
        replies = self.path.with_name(f"{self.path.stem}-replies")
        found = [str(p) for p in sorted(replies.glob("*/*.npz"))[:1]]
        return found + [str(p) for p in sorted(self.path.parent.glob(f"{self.path.stem}.*.archived.json"))[:1]]

    def _load(self) -> dict[str, Any]:
        if self.path.exists():
            try:
                data = read_json(self.path)
            except (OSError, ValueError) as err:
                raise self._damaged(f"unreadable: {err}") from None
            if not isinstance(data, dict) or data.get("format") != FORMAT:
                raise self._damaged(f"not a fedsyn ledger of format {FORMAT}")
            missing = [k for k in _KEYS if k not in data]
            if missing or not isinstance(data["releases"], list):
                raise self._damaged(f"missing {missing or ['releases']}")
            return data
        data = {"format": FORMAT, "budget": None, "budget_changes": [], "resets": [], "data": [],
                "releases": [], "accountants": {}, "created": time.time(), "ref": uuid.uuid4().hex}
        data["releases"] += _legacy_releases(self.path.parent) if self.path.name == "ledger.json" else []
        return data

    def _damaged(self, what: str) -> LedgerError:
        return LedgerError(f"the ledger {self.path} is damaged ({what}); this node serves nothing until it is fixed: "
                           f"restore it from a backup, or archive it and start over on purpose with "
                           f"fedsyn ledger {self.path.parent} --reset --reason '...' --budget EPSILON")

    @contextmanager
    def _locked(self) -> Iterator[dict[str, Any]]:
        """Exclusive lock, fresh data; saved atomically on a clean exit."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self._lock_path, "a+") as lock:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
            try:
                data = self._load()
                yield data
                atomic_write_json(self.path, data)
            finally:
                fcntl.flock(lock.fileno(), fcntl.LOCK_UN)

    # ----------------------------------------------------------------- queries
    @property
    def ref(self) -> str:
        """A random name of this ledger, made when it was created; independent of the data.

        Replies carry it so the server can tell that two node ids are one institution's ledger
        (Flower gives a restarted SuperNode a new node id) and report its releases once.
        """
        return str(self._load().get("ref", ""))

    @property
    def budget(self) -> float:
        """The node's total epsilon (may be inf)."""
        return float(self._load()["budget"])

    @property
    def releases(self) -> list[dict[str, Any]]:
        """All entries ever made in this ledger, oldest first (cancelled ones included)."""
        return list(self._load()["releases"])

    def spent(self, run_id: str | None = None, phase: str | None = None) -> float:
        """Epsilon spent (basic composition, reservations included), optionally of one run/phase."""
        return admission.spent(self._load()["releases"], run_id, phase)

    def delta_spent(self) -> float:
        """Sum of the deltas of every counted release (basic composition)."""
        return admission.delta_spent(self._load()["releases"])

    def composed(self, delta: float) -> float:
        """Epsilon of every counted release composed by PLD at ``delta`` (the policy's): what the
        node has spent under ``pld`` (``common.calibration.ledger_epsilon``)."""
        return ledger_epsilon(admission.counted(self._load()["releases"]), delta)

    def remaining(self, run_id: str | None = None) -> float:
        """Budget left (may be inf) for ``run_id``: not spent, and not held for another run."""
        return admission.remaining(self._load(), run_id)

    def run_statements(self, run_id: str) -> list[dict[str, Any]]:
        """What the server may know of this run's releases: each counted release's statement."""
        return [{**_statement(r), "status": r["status"]} for r in admission.counted(self._load()["releases"])
                if r["run_id"] == run_id]

    def run_entries(self, run_id: str, phase: str = "", rnd: int = -1) -> list[dict[str, Any]]:
        """This run's counted entries, oldest first, less the one for ``phase`` round ``rnd`` (the
        release being priced: a retried round is priced on what came before it)."""
        return _run_entries(self._load(), run_id, phase, rnd)

    def entries_before(self, run_id: str, phase: str, rnd: int) -> list[dict[str, Any]]:
        """Every counted entry of every run, oldest first, made before this run's ``phase`` round
        ``rnd`` (all of them if it has none): what the release is priced on under ``pld``, the
        same for a retry of a round whose process died as for the round itself."""
        return _entries_before(self._load(), run_id, phase, rnd)

    def charged(self, entry_id: str) -> float:
        """The epsilon entry ``entry_id`` is charged (as priced under the lock)."""
        return float(_entry(self._load(), entry_id)["epsilon"])

    def accountant_state(self, key: str) -> dict[str, Any]:
        """The DP-SGD accountant state stored under ``key`` (one per run), or {}."""
        return dict(self._load()["accountants"].get(key, {}))

    def check(self, epsilon: float, what: str) -> None:
        """Raise ``BudgetExceeded`` (saying how much is left) if ``epsilon`` does not fit."""
        admission.check(self._load(), epsilon, what)

    # ----------------------------------------------------------------- updates
    def hold(self, run_id: str, needed: float, token: str = "",
             max_unconfirmed: int = MAX_UNCONFIRMED_HOLDS) -> Preflight:
        """The pre-flight, atomically: if this node can pay the ``needed`` epsilon of run
        ``run_id`` (what it already spent in that run counts), hold it for that run (shortfall
        0; ``fedsyn_client.holds``: when, how long, and at most ``max_unconfirmed`` unconfirmed
        holds); else hold nothing (the shortfall, ``common.dp.preflight``). The reply's numbers
        come from the same locked read as the decision, so they agree with it.

        ``token`` is the run's secret (the server's ``hold-token``); only its hash is kept, and
        only a request with the same token renews or ends the hold, so a server that guesses
        another run's key can neither keep nor end that run's hold.
        """
        with self._locked() as data:
            now = time.time()
            holds.live(data, now)
            short = preflight(needed, admission.spent(data["releases"], run_id), admission.remaining(data, run_id))
            if short <= 0:
                holds.take(data, run_id, needed, token, now, max_unconfirmed)
            return Preflight(short, admission.remaining(data, run_id), admission.held(data, run_id),
                             str(data.get("ref", "")))

    def release_hold(self, run_id: str | None = None, token: str = "") -> list[str]:
        """End ``run_id``'s hold if ``token`` is the one it was made with (the run finished, or
        was refused), or every hold (None: the operator's ``fedsyn ledger --release-holds``);
        what they did not spend is free again. Returns the runs whose holds ended."""
        with self._locked() as data:
            return holds.end(data, run_id, token)

    def held(self, run_id: str | None = None) -> float:
        """Epsilon held for live runs other than ``run_id`` and not yet spent by them."""
        return admission.held(self._load(), run_id)

    def reserve(self, release: Release, run_phase_budget: float, steps: tuple[int, int] | None = None,
                cap: tuple[float, float] | None = None, binding: dict[str, Any] | None = None,
                digest: str = "", charge: Callable[[list[dict[str, Any]]], float] | None = None,
                rule: Rule | None = None) -> str:
        """Under the lock: try ``release`` on ``fedsyn_client.admission``'s rules (the total budget,
        this run's budget for its phase, the policy's cap for the phase, the run's terms, one release
        per round), then record it as reserved and let it confirm its run's hold. Returns the entry id.

        ``steps`` = (steps of this release, steps this run's phase may take) bounds DP-SGD
        rounds, whose epsilon is reserved for the whole phase at its first round.
        ``cap`` = (the policy's epsilon cap for the phase, its window in days; 0 = the ledger's
        life) counts every run's releases of the phase, whatever their run key.
        ``binding``: what the phase's noise was calibrated for; the phase's first reservation in
        the run stores it, and a later round of the run under other terms is refused.
        ``digest``: the request's digest; a Gaussian reservation of this run, phase and round made
        for the same digest and terms by a process that died before confirming is taken over (its
        id returned, nothing charged again).
        ``charge``: how the release is priced from the ledger's earlier entries (the ``pld`` rule,
        ``common.calibration.pld_charge``); priced again under the lock, on what the ledger holds
        then (``charged`` reads the price). ``rule``: the node's policy (accounting, delta) the
        budget is checked by (``admission.check``); None: epsilons add up, deltas unchecked.
        Raises ``BudgetExceeded`` (nothing recorded) when it does not fit.
        """
        with self._locked() as data:
            if charge is not None:
                release = replace(release, epsilon=charge(_entries_before(data, release.run_id, release.phase,
                                                                          release.round)))
            orphan = next((r for r in data["releases"] if r["status"] == RESERVED and r["run_id"] == release.run_id
                           and r["phase"] == release.phase and int(r.get("round", 0)) == int(release.round)), None)
            if (orphan is not None and digest and release.mechanism == GAUSSIAN and cut_off(orphan, digest)
                    and _statement(orphan) == release.statement()):
                orphan.update(claim=claim(digest), takeovers=int(orphan.get("takeovers", 0)) + 1)
                return str(orphan["id"])
            entry = {"id": uuid.uuid4().hex, "status": RESERVED, "time": time.time(), **release.statement(),
                     "public": dict(release.public), **({"private": dict(release.private)} if release.private else {}),
                     **({"claim": claim(digest)} if digest else {})}
            bound = admission.admit(data, release.phase, release.epsilon, release.run_id, release.round,
                                    run_phase_budget, steps, cap, binding, rule,
                                    {**entry, **({"binding": dict(binding)} if binding is not None else {})})
            if binding is not None and bound is None:
                entry["binding"] = dict(binding)
            holds.confirm(data, release.run_id, time.time())
            if rule is not None:
                data["policy"] = {"accounting": rule.accounting.name, "delta": rule.delta}
            data["releases"].append(entry)
        return str(entry["id"])

    def note(self, entry_id: str, private: dict[str, Any], rule: Rule | None = None) -> None:
        """Store the terms a reservation is composed by, learnt after it (a simulated node's DP-SGD
        q, from its partition), before anything of the release is computed; under ``pld`` the
        ledger's composition with them is checked against the budget again (a release reserved in
        the meantime may have taken the room): ``BudgetExceeded`` if it no longer fits, and the
        caller fails the reservation (it stays charged)."""
        with self._locked() as data:
            entry = _entry(data, entry_id)
            entry["private"] = {**(entry.get("private") or {}), **private}
            budget = float(data["budget"])
            if rule is None or not math.isfinite(budget):
                return
            after = rule.accounting.ledger_epsilon(admission.counted(data["releases"]), rule.delta)
            if after is not None and after > budget + admission.TOLERANCE:
                raise BudgetExceeded(refusals.BUDGET, (
                    f"{entry['phase']}: refused after the reservation, every release of this node composed with its "
                    f"terms at delta = {rule.delta:g} reaches epsilon = {after:.4g}, above its budget {budget:g}"))

    def confirm(self, entry_id: str, private: dict[str, Any] | None = None,
                accountant: tuple[str, dict[str, Any]] | None = None) -> None:
        """Mark a reservation released (call before the reply leaves), with its private details.

        ``accountant`` = (key, state) stores a DP-SGD accountant state in the same write, so
        a crash never leaves a release without its accountant state or back.
        """
        with self._locked() as data:
            entry = _entry(data, entry_id)
            entry.update(status=CONFIRMED, private={**(entry.get("private") or {}), **(private or {})})
            if accountant is not None:
                data["accountants"][accountant[0]] = accountant[1]

    def fail(self, entry_id: str, reason: str) -> None:
        """Mark a reservation failed: it stays charged (``reason`` is for the operator only)."""
        with self._locked() as data:
            _entry(data, entry_id).update(status=FAILED, reason=reason[:200])

    # ----------------------------------------------------------------- reading
    def summary(self) -> dict[str, Any]:
        """Budget, spent (basic; and by PLD: at the policy's delta the node last released under,
        ``epsilon_composed``, else at the cumulative delta), delta spent, every entry."""
        data = self._load()
        entries = admission.counted(data["releases"])
        delta = admission.delta_spent(data["releases"])
        basic = admission.spent(data["releases"])
        policy = data.get("policy") or {}
        return {
            "ledger": str(self.path), "budget": data["budget"], "epsilon_spent": basic,
            "epsilon_pld": composed_epsilon([{**r.get("public", {}), **(r.get("private", {}) if r["status"] == CONFIRMED
                                                                          else {}), **r} for r in entries]),
            **({"policy": policy, "epsilon_composed": ledger_epsilon(entries, float(policy["delta"]))}
               if policy.get("delta") else {}),
            **({"epsilon_alone": ledger_epsilon(alone(entries), float(policy["delta"]))}
               if policy.get("delta") and any(r.get("mechanism") == SKELLAM for r in entries) else {}),
            "delta_spent": delta, "epsilon_remaining": admission.remaining(data), "epsilon_held": admission.held(data),
            "holds": data.get("holds", {}),
            "budget_changes": data["budget_changes"], "resets": data["resets"], "data": data["data"],
            "releases": data["releases"],
        }


def alone(entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``entries`` as they stand if every other site of each masked round colludes with the server
    (issue 73): each masked release's noise is then its own share alone (``mu_share``), not the sum's."""
    out = []
    for r in entries:
        public = r.get("public") or {}
        if r.get("mechanism") == SKELLAM and public.get("mu_share") is not None:
            r = {**r, "public": {**public, "mu": float(public["mu_share"])}}
        out.append(r)
    return out


def reset_ledger(state_dir: str | Path, reason: str, ledger_id: str = "", budget: float | None = None) -> Path | None:
    """The operator's act of starting over (e.g. with new data): archive the ledger, start an
    empty one that records why, when, and what the old one had spent. Returns the archive.

    A damaged ledger is archived as it is (its bytes) and a missing one is recorded as missing
    (returns None); both need ``budget``, since the old one cannot be read.
    """
    if not reason.strip():
        raise ValueError("a reset needs a reason (--reason), kept in the new ledger")
    ledger = PrivacyLedger(ledger_path(state_dir, ledger_id))
    ledger.path.parent.mkdir(parents=True, exist_ok=True)
    with open(ledger._lock_path, "a+") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        try:
            stamp = time.strftime('%Y%m%d-%H%M%S')
            archive = ledger.path.with_name(f"{ledger.path.stem}.{stamp}.archived.json")
            for n in range(1, 10_000):  # two resets in one second keep both archives
                if not archive.exists():
                    break
                archive = ledger.path.with_name(f"{ledger.path.stem}.{stamp}-{n}.archived.json")
            try:
                data = ledger._load() if ledger.path.exists() else None
            except LedgerError:
                data = None
            if data is None and budget is None:
                raise ValueError(f"the ledger {ledger.path} is {'damaged' if ledger.path.exists() else 'missing'}: "
                                 "say the node's budget with --budget EPSILON")
            previous: Any = (admission.spent(data["releases"]) if data is not None
                             else "unknown (ledger damaged or missing)")
            kept: Path | None = archive
            if data is not None:
                atomic_write_json(archive, data)
            elif ledger.path.exists():
                os.replace(ledger.path, archive)
            else:
                kept = None
            old = data or {}
            atomic_write_json(ledger.path, {
                "format": FORMAT, "budget": float(budget) if budget is not None else old["budget"], "releases": [],
                "ref": old.get("ref") or uuid.uuid4().hex, "accountants": {}, "budget_changes": [], "data": [],
                "created": time.time(), "resets": old.get("resets", []) + [{
                    "time": time.time(), "reason": reason.strip(), "previous_epsilon_spent": previous,
                    "archive": str(kept) if kept else None, "user": os.environ.get("USER", "")}]})
        finally:
            fcntl.flock(lock.fileno(), fcntl.LOCK_UN)
    return kept


def set_budget(state_dir: str | Path, budget: float, reason: str, ledger_id: str = "",
               delta: float | None = None) -> float:
    """The operator's act of changing a node's total epsilon (and, given ``delta``, the delta its
    releases are composed at), recorded with ``reason``; returns the old budget. The node config's
    ``epsilon`` and ``delta`` must then say the same, or the node refuses."""
    if not reason.strip():
        raise ValueError("a budget change needs a reason (--reason), kept in the ledger")
    if not budget > 0:
        raise ValueError(f"--set-budget {budget:g}: a budget must be > 0 (or inf)")
    ledger = PrivacyLedger(ledger_path(state_dir, ledger_id))
    if not ledger.path.exists():
        raise FileNotFoundError(f"no ledger at {ledger.path} (is {state_dir} the node's state-dir?)")
    if delta is not None and not 0 < delta < 1:
        raise ValueError(f"--delta {delta:g}: a delta is in (0, 1)")
    with ledger._locked() as data:
        old = float(data["budget"])
        pinned = (data.get("policy") or {}).get("delta")
        change = {"from": old, "to": float(budget), "time": time.time(), "reason": reason.strip(),
                  "user": os.environ.get("USER", "")}
        if delta is not None:
            change.update(delta_from=pinned, delta_to=float(delta))
            data["policy"] = {**(data.get("policy") or {}), "delta": float(delta)}
        data["budget_changes"].append(change)
        data["budget"] = float(budget)
    return old


# --------------------------------------------------------------------------- helpers
def _run_entries(data: dict[str, Any], run_id: str, phase: str, rnd: int) -> list[dict[str, Any]]:
    return [r for r in admission.counted(data["releases"]) if r["run_id"] == run_id
            and not (r["phase"] == phase and int(r.get("round", 0)) == int(rnd))]


def _entries_before(data: dict[str, Any], run_id: str, phase: str, rnd: int) -> list[dict[str, Any]]:
    entries = admission.counted(data["releases"])
    at = next((i for i, r in enumerate(entries) if r["run_id"] == run_id and r["phase"] == phase
               and int(r.get("round", 0)) == int(rnd)), len(entries))
    return entries[:at]


def _entry(data: dict[str, Any], entry_id: str) -> dict[str, Any]:
    for r in data["releases"]:
        if r.get("id") == entry_id:
            return r
    raise KeyError(f"no ledger entry {entry_id}")


def _statement(entry: dict[str, Any]) -> dict[str, Any]:
    keys = ("phase", "mechanism", "run_id", "round")
    # the file stores a non-finite epsilon (no DP) as the string "inf": statements carry floats
    return {**{k: entry[k] for k in keys}, "epsilon": float(entry["epsilon"]), "delta": float(entry["delta"]),
            **entry.get("public", {})}


def _legacy_releases(state_dir: Path) -> list[dict[str, Any]]:
    """Releases of format-1 ledgers (``ledger-<fingerprint>.json``, one per data view) in the
    same state dir, carried over so that moving to one ledger per node never forgets a spend."""
    out = []
    for path in sorted(state_dir.glob("ledger-*.json")):
        try:
            old = read_json(path)
        except (OSError, ValueError):
            continue
        if old.get("format") is None and "fingerprint" in old:
            for r in old.get("releases", []):
                out.append({"id": uuid.uuid4().hex, "status": CONFIRMED, "run_id": str(r.get("run_id", "")),
                            "phase": r["phase"], "round": int(r.get("round", 0)), "mechanism": r["mechanism"],
                            "epsilon": float(r["epsilon"]), "delta": float(r["delta"]), "time": r.get("time", 0.0),
                            "public": {}, "private": {}, "imported_from": path.name})
    return out
