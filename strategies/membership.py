"""Who takes part in a run, and as what: stage 0's tier query and pre-flight, and nodes that join later.

``Membership.discover`` is stage 0: wait for the nodes, ask each its tier and whether its ledger
and policy cover what this run will ask of it (free; the node *holds* that epsilon for the run),
and refuse a run some node cannot finish before anything is spent (or leave that node out, with
``on-node-shortfall = "continue-without"``). ``Membership.admit`` asks nodes that connected since
(a new site, or a SuperNode restarted after a crash, to which Flower gives a new node id) the same
question before every phase-1 round, the profile and every vote round; a restarted one is
recognised by its ledger's random ``ledger-ref`` and asked in place of its old id.

The orchestrations (``strategies.fedsyn``, ``strategies.marginals``, through their
``strategies.session.RunSession``) read ``strong``, ``voters`` and ``active()`` and never edit
them; replies, failures and degradations are booked by the ``Courier`` both share.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

from flwr.app import ConfigRecord, RecordDict
from flwr.serverapp import Grid

from common import records as R
from common.config import RunConfig
from common.dp import STRONG, WEAK
from common.logs import get_logger
from common.phases import phase as phase_named
from strategies.messaging import Courier
from strategies.result import FedSynResult

log = get_logger("fedsyn")


class RunRefused(RuntimeError):
    """The run cannot be finished by some node (stage 0); nothing was spent."""


class NodesMissing(RuntimeError):
    """Stage 0 found no usable node in time; nothing was spent."""


class Membership:
    """The run's nodes: their tiers (in ``result.tiers``), budgets and ledger refs, the strong
    nodes and voters now, every id asked, and the ids a restarted node replaced."""

    def __init__(self, cfg: RunConfig, courier: Courier, result: FedSynResult, request: Callable[..., ConfigRecord],
                 plan: Callable[[], list[str]], hold_token: Callable[[], str],
                 end_holds: Callable[[Grid, Iterable[int]], None]) -> None:
        self.cfg, self.courier, self.result = cfg, courier, result
        self._request, self._plan, self._hold_token, self._end_holds = request, plan, hold_token, end_holds
        self.strong: list[int] = []
        self.voters: list[int] = []
        self.asked: set[int] = set()  # every node id the tier query went to
        self.answered: dict[int, str] = {}  # the tier of every node that answered, able to finish the run or not
        self.replaced: set[int] = set()  # node ids whose ledger came back under a new id (restarts)

    def active(self) -> dict[int, str]:
        """The nodes taking part now: stage 0's, those admitted since, less the replaced ids."""
        return {n: t for n, t in self.result.tiers.items() if n not in self.replaced}

    # ------------------------------------------------------------ stage 0
    def discover(self, grid: Grid, stable_seconds: float) -> dict[int, str]:
        """Stage 0: tiers, budgets and the pre-flight check; sets ``strong`` and ``voters``.
        Raises ``RunRefused`` when a node that answered cannot finish the run (and
        ``on-node-shortfall`` is "refuse")."""
        node_ids = self._wait_for_nodes(grid, stable_seconds)
        self.asked = set(node_ids)
        nodes, cannot = self._ask_tiers(grid, node_ids)
        if cannot:
            why = "; ".join(f"node {nid}: {reason}" for nid, reason in sorted(cannot.items()))
            if self.cfg.on_node_shortfall == "refuse":
                self._refuse(grid, nodes, f"{len(cannot)} node(s) cannot finish it ({why}). Fix: run with a smaller "
                             "epsilon, or within the node's policy; an institution may reset its ledger "
                             "(`fedsyn ledger STATE_DIR --reset`)")
            for nid, reason in sorted(cannot.items()):
                self.courier.degrade(f"node {nid} left out (on-node-shortfall=continue-without): {reason}")
        self.courier.coverage("tiers", nodes, set(node_ids) - set(cannot))
        if not nodes:
            raise NodesMissing("no usable node answered the tier query (see failures above)")
        uncovered = self._uncovered(nodes)
        if uncovered and self.cfg.on_node_shortfall == "refuse":
            failed = "; ".join(f"node {f['node_id']}: {f['reason']}" for f in self.result.failures
                               if f["phase"] == "tiers")
            self._refuse(grid, nodes, f"{' and '.join(uncovered)} among the nodes that can take part"
                         + (f" (failed: {failed})" if failed else "") + ". Fix: repair the failed nodes or add a node "
                         "of that tier; a run that goes on without the phase ends failed (with its outputs)")
        log.info("nodes: %d strong, %d weak", sum(t == STRONG for t in nodes.values()),
                 sum(t == WEAK for t in nodes.values()))
        self.strong = sorted(n for n, t in nodes.items() if t == STRONG)
        self.voters = sorted(nodes) if self.cfg.voters == "all" else sorted(n for n, t in nodes.items() if t == WEAK)
        return nodes

    def _uncovered(self, nodes: dict[int, str]) -> list[str]:
        """The planned phases no usable node can do: phase 1 needs a strong node, votes a voter."""
        plan, tiers = self._plan(), set(nodes.values())
        missing = (phase_named(name).missing(self.cfg, tiers) for name in plan)
        return [why for why in missing if why is not None]

    def _refuse(self, grid: Grid, holding: dict[int, str], why: str) -> None:
        """Raise ``RunRefused`` at stage 0, after ending the holds of the nodes that could
        finish the run: a refused run keeps no epsilon held."""
        self._end_holds(grid, holding)
        raise RunRefused(f"run refused before anything was spent: {why}; or leave such nodes out with "
                         "--run-config 'on-node-shortfall=\"continue-without\"'")

    def _ask_tiers(self, grid: Grid, node_ids: list[int]) -> tuple[dict[int, str], dict[int, str]]:
        """The tier query to ``node_ids``: returns (tier of each node that can finish the run,
        why each node that answered cannot). Budgets and ledger refs are kept in the result."""
        replies = self.courier.ask(grid, node_ids, R.MSG_TIER, "tiers", RecordDict({R.CONFIG: self._request(
            phases=self._plan(), **{"hold-token": self._hold_token()})}))
        nodes: dict[int, str] = {}
        cannot = {f["node_id"]: f["reason"] for f in self.result.failures
                  if f["phase"] == "tiers" and f.get("code") in R.ERR_REFUSED and f["node_id"] in node_ids}
        for nid, msg in replies.items():
            try:
                rec = msg.content.config_records[R.TIER]
                tier, budget, short = (str(rec["tier"]), R.number(rec["epsilon-budget"]),
                                       R.number(rec["epsilon-shortfall"]))
            except (KeyError, TypeError, ValueError) as err:
                self.courier.fail(nid, "tiers", f"malformed reply ({type(err).__name__})")
                continue
            self.result.budgets[nid], self.answered[nid] = budget, tier
            self.result.bounds[nid] = int(R.number(rec.get("records-bound", 0) or 0))
            self.result.trust[nid] = max(1, int(R.number(rec.get("min-honest-nodes", 1) or 1)))
            if rec.get("ledger-ref"):
                self.result.ledger_refs[nid] = str(rec["ledger-ref"])
            if short > 0:
                held = R.number(rec.get("epsilon-held", 0.0))
                needed, remaining = R.number(rec["epsilon-needed"]), R.number(rec["epsilon-remaining"])
                cannot[nid] = (f"its ledger lacks epsilon = {short:.4g}: this run needs {needed:.4g} "
                               f"of it and {max(remaining, 0.0):.4g} of its budget {budget:g} is left"
                               + (f" ({held:.4g} is held for another run under way: it is freed when that run ends, "
                                  "lapses 6 h after its last request, or `fedsyn ledger STATE_DIR --release-holds` "
                                  "on the node frees it)" if held > 0 else ""))
                continue
            nodes[nid] = tier
        return nodes, cannot

    # ------------------------------------------------------------ later
    def admit(self, grid: Grid, when: str) -> None:
        """Nodes that connected after stage 0 take part from here on, once the tier query
        (free) says they can finish the run: a new site, or a SuperNode restarted after a
        crash, to which Flower gives a new node id. Its ledger ref tells the server (and the
        report) that it is the same institution; its ledger already holds what it spent in
        this run, so it pays nothing twice. One that cannot finish is left out, named."""
        new = sorted(set(grid.get_node_ids()) - self.asked)
        if not new:
            return
        self.asked |= set(new)
        nodes, cannot = self._ask_tiers(grid, new)
        for nid, reason in sorted(cannot.items()):
            self.courier.degrade(f"node {nid} connected {when} and was left out: {reason}")
        refs = self.result.ledger_refs
        for nid, tier in sorted(nodes.items()):
            same = [o for o in sorted(self.result.tiers) if refs.get(nid) and refs.get(o) == refs[nid]]
            log.info("node %d (%s) joined %s%s", nid, tier, when,
                     f", on the ledger of node {same[-1]}: a restarted SuperNode, asked in its place" if same else "")
            self.replaced |= set(same)  # the old id's process is gone; its ledger answers under the new id
            self.strong = [n for n in self.strong if n not in same]
            self.voters = [n for n in self.voters if n not in same]
            self.result.tiers[nid] = tier
            if tier == STRONG:
                self.strong.append(nid)
            if self.cfg.voters == "all" or tier == WEAK:
                self.voters.append(nid)

    def _wait_for_nodes(self, grid: Grid, stable_seconds: float) -> list[int]:
        """Wait for ``min-nodes`` nodes, or (0) for a non-empty node count that stays stable.

        Flower's ``get_node_ids()`` can be empty right after start while SuperNodes connect.
        """
        want, deadline = self.cfg.min_nodes, time.time() + self.cfg.node_timeout
        last: list[int] = []
        stable_since = time.time()
        while time.time() < deadline:
            ids = sorted(grid.get_node_ids())
            if ids != last:
                last, stable_since = ids, time.time()
            if ids and (len(ids) >= want if want else time.time() - stable_since >= stable_seconds):
                return ids
            time.sleep(0.5)
        raise NodesMissing(f"timed out after {self.cfg.node_timeout:g}s waiting for nodes (have {len(last)}, "
                           f"min-nodes={want}); nothing was spent. Fix: start the SuperNodes, or lower min-nodes")
