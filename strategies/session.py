"""What every run shares, whatever its phases: stage 0, stage 5, the nodes, the checkpoint.

``RunSession`` holds one run's state (``FedSynResult``, the checkpoint's ``Progress``, the run key)
and the machinery every orchestration uses by composition: stage 0 (``begin``: the tiers and the
pre-flight, after restoring a checkpoint), stage 5 (``finish``: every node's ledger), the
``Courier`` that sends and books, the ``Membership`` of the run, ``checkpoint`` and ``request``
(what every request carries). It runs no phase of its own: the phases between stage 0 and 5 are
the orchestration's (``strategies.fedsyn``: a text run; ``strategies.marginals``: a table run).

``Orchestration`` is the face both orchestrations show the ServerApp: ``start`` (the one entry),
``preflight`` (stage 0 alone), ``end_holds``, and the session's settings and result.
"""

from __future__ import annotations

import json
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, RecordDict
from flwr.serverapp import Grid

from common import records as R
from common.config import RunConfig
from common.logs import get_logger
from strategies.checkpoint import Checkpoint, Progress, save_checkpoint
from strategies.membership import Membership
from strategies.messaging import Courier
from strategies.result import FedSynResult
from strategies.stages import Stage

log = get_logger("fedsyn")


class RoundUnanswered(RuntimeError):
    """A round no node answered: the run stops before it, with its checkpoint, to be resumed."""


class RunSession:
    """One run's state and shared machinery (see the module docstring).

    ``phases`` returns the phases this run will ask of nodes (each node takes those of its
    tier); the pre-flight and every later tier query send it. ``result``, ``progress``,
    ``courier`` and ``members`` are replaced when a checkpoint is restored: read them here,
    never keep them.
    """

    def __init__(self, cfg: RunConfig, vocabulary: list[str], delta: float, phases: Callable[[], list[str]],
                 stable_seconds: float = 3.0) -> None:
        self.cfg, self.vocabulary, self.phases = cfg, list(vocabulary), phases
        self.delta = delta  # per release; each node caps it by its own policy
        self.stable_seconds = stable_seconds
        # Every request carries it: nodes book budgets and store replies per run key, so a
        # resumed run (same key) is answered the same bytes for what was released before.
        self.resume_key = ""
        self.checkpoint_dir: Path | None = None  # where to checkpoint (None: nowhere)
        self.progress = Progress(resume_key="", config=cfg.to_flower())
        self.result = FedSynResult()
        self.courier = Courier(cfg, delta, self.result)
        self.members = self._membership()
        self.grid: Grid | None = None  # the run's Grid, from stage 0 on

    def run_grid(self) -> Grid:
        """The run's Grid: ``begin`` (stage 0) sets it before any phase that asks nodes runs."""
        if self.grid is None:
            raise RuntimeError("the run's Grid is not set: a phase ran before stage 0 (RunSession.begin)")
        return self.grid

    def _membership(self) -> Membership:
        return Membership(self.cfg, self.courier, self.result, request=self.request, plan=self.phases,
                          hold_token=lambda: self.progress.hold_token, end_holds=self.end_holds)

    # ------------------------------------------------------------ stage 0
    def begin(self, grid: Grid, resume: Checkpoint | None) -> float:
        """Stage 0, after restoring ``resume`` (a loaded checkpoint of this run) if given: every
        node's tier and pre-flight. Returns the run's start time."""
        if resume is not None:
            self._restore(resume)
        self.progress.resume_key = self.resume_key
        t0, self.grid = time.time(), grid
        log.info("%s", Stage.TIERS)
        self.result.tiers = self.members.discover(grid, self.stable_seconds)
        self.result.timings["tiers"] = time.time() - t0
        return t0

    def preflight(self, grid: Grid) -> FedSynResult:
        """Stage 0 alone: every node's tier and budget and whether its ledger and policy cover this
        run, then every hold is ended; nothing is spent. Raises ``RunRefused`` as ``begin`` would."""
        self.result.tiers = self.members.discover(grid, self.stable_seconds)
        self.end_holds(grid)
        return self.result

    # ------------------------------------------------------------ stage 5
    def finish(self, grid: Grid, t0: float) -> FedSynResult:
        """Stage 5: every ledger this run touched, under the ids its nodes have now (a resumed
        simulation's nodes are new processes with new ids; the old ids' ledgers answer under them,
        by ledger ref); returns the result."""
        res, live = self.result, set(grid.get_node_ids())
        log.info("%s", Stage.LEDGERS)
        self._ledgers(grid, sorted(((set(res.tiers) | set(res.releases)) - self.members.replaced) & live))
        res.timings["total"] = time.time() - t0
        return res

    def _ledgers(self, grid: Grid, node_ids: list[int]) -> None:
        """Ask every node for this run's releases from its own ledger (costs no privacy).

        The report then shows what each node actually charged, including a release whose
        reply was lost; a node that does not answer keeps the releases seen in its replies.
        """
        replies = self.courier.ask(grid, node_ids, R.MSG_LEDGER, "ledger", RecordDict({R.CONFIG: self.request(
            **{"hold-token": self.progress.hold_token})}))
        for nid, msg in replies.items():
            try:
                rec = msg.content.config_records[R.LEDGER]
                if rec.get("ledger-ref"):
                    self.result.ledger_refs[nid] = str(rec["ledger-ref"])
                self.result.ledgers[nid] = {"releases": json.loads(str(rec["releases"])),
                                            "epsilon-spent": R.number(rec["epsilon-spent"]),
                                            "epsilon-budget": R.number(rec["epsilon-budget"])}
            except (KeyError, TypeError, ValueError) as err:
                self.courier.fail(nid, "ledger", f"malformed reply ({type(err).__name__})")

    def end_holds(self, grid: Grid, node_ids: Iterable[int] | None = None) -> None:
        """Ask ``node_ids`` (default: the nodes taking part) for their ledger (free), which ends
        the epsilon they hold for this run: for a run that is refused or broke off."""
        try:
            self._ledgers(grid, sorted(self.members.active() if node_ids is None else node_ids))
        except Exception as err:  # noqa: BLE001 - best effort: holds lapse on their own
            log.warning("could not end the nodes' holds for this run (%s); they lapse on their own", err)

    # ------------------------------------------------------------ what every request carries
    def request(self, **extra: Any) -> ConfigRecord:
        """The part every request carries: the public vocabulary, the delta per release, the run key."""
        key = {"resume-key": self.resume_key} if self.resume_key else {}
        return ConfigRecord({"codes": self.vocabulary, "delta": self.delta, **key, **extra})

    # ------------------------------------------------------------ checkpoints
    def checkpoint(self, stage: str | None = None) -> None:
        """Mark ``stage`` done and save where the run stands (if a checkpoint folder is set)."""
        if stage:
            self.progress.completed.append(stage)
        if self.checkpoint_dir is not None:
            save_checkpoint(self.checkpoint_dir, self.progress, self.result, self.result.arrays)

    def _restore(self, ck: Checkpoint) -> None:
        """Continue from ``ck``: its results, progress and run key; tiers are asked again."""
        self.result, self.progress, self.resume_key = ck.result, ck.progress, ck.progress.resume_key
        self.courier = Courier(self.cfg, self.delta, self.result)
        self.members = self._membership()
        self.result.arrays, self.result.tiers, self.result.budgets = ck.arrays, {}, {}
        log.info("resuming run %s: done %s, phase-1 round %d, %d vote rounds", self.resume_key,
                 ck.progress.completed or "nothing", ck.progress.train_round, len(ck.progress.vote_totals))


class Orchestration(ABC):
    """A run's phases over a ``RunSession``: what the ServerApp builds, configures and starts.

    Subclasses build ``self.session`` and say their ``phases``, ``summary`` and ``start``; the
    rest (stage 0 alone, ending holds) is the session's, and so are the settings the ServerApp sets
    (``strategy.session.resume_key``, ``checkpoint_dir``, ``stable_seconds``) and the run's result.
    """

    session: RunSession

    @abstractmethod
    def start(self, grid: Grid, initial_arrays: ArrayRecord | None = None,
              resume: Checkpoint | None = None) -> FedSynResult:
        """Run every stage over ``grid`` (``initial_arrays``: the pretrained trainable weights, None
        where no language model takes part); with ``resume`` (a loaded checkpoint of this run)
        continue where it stopped. Returns everything the run produced."""

    @abstractmethod
    def phases(self) -> list[str]:
        """The phases this run will ask of nodes (``common.dp.PHASES``; each node takes its tier's)."""

    @abstractmethod
    def summary(self) -> None:
        """Log the run's shape."""

    def preflight(self, grid: Grid) -> FedSynResult:
        """Stage 0 alone (run config ``plan-only``, for ``fedsyn plan``): every node's tier and
        budget and whether its ledger and policy cover this run, then every hold is ended;
        nothing is spent. Raises ``RunRefused`` as ``start`` would (its holds ended too)."""
        self.summary()
        return self.session.preflight(grid)

    def end_holds(self, grid: Grid, node_ids: Iterable[int] | None = None) -> None:
        """End the epsilon the nodes hold for this run (``RunSession.end_holds``)."""
        self.session.end_holds(grid, node_ids)
