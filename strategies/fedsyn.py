"""The resource-adaptive strategy: every phase of Algorithm 1, top to bottom, over the Grid.

The stages are ``strategies.stages.Stage`` (the numbers the README's table and the logs use).

``FedSynStrategy.run`` is the one place to read the server's logic:

0. tiers      -- ask every node its tier and whether its ledger and policy cover what this run
                 will ask of it (pre-flight, no privacy spent); a run some node cannot finish
                 is refused here, before anything is spent (or goes on without that node)
1. finetune   -- R rounds of DP federated finetuning on strong nodes (A.3), aggregated
                 by a plug-in Flower strategy
2. profile    -- every node sends its noisy per-code counts
3. generate   -- the server allocates the pool by the noisy profile and generates it with two
                 writers, the pretrained weights and the finetuned ones (``strategies.writers``)
4. refine     -- the refinement plug-in runs its own rounds (``refinement.refine(ctx)``): for
                 knn-vote one round of noisy kNN votes (A.2) and A.4 resampling, which keeps
                 per code whichever writer the votes favour; each vote round is ``_vote``, one
                 federated round on the voters
5. ledgers    -- every node states this run's releases from its own ledger (free), for the report

Who takes part, and as what, is ``strategies.membership.Membership``: stage 0 (``discover``)
and the nodes that connect later (a new site, or a restarted SuperNode: Flower gives it a new
node id), asked the tier query before every phase-1 round, the profile and every vote round
(``admit``). The pre-flight *holds* each node's epsilon for this run until stage 5 (or a
refusal) ends it, so a run started beside it is refused at stage 0.

After every stage and phase-1 round and vote round the run is checkpointed (``strategies.
checkpoint``); a resumed run skips the stages it finished and takes finished vote rounds
from the checkpoint. Stage 0 and 5 are always run again: they are free, and the nodes
(their ids) may have changed.

Nodes that fail are logged, recorded in ``result.failures`` under the node that failed, and
left out; the run goes on with the rest and says so: every phase that ran on fewer nodes than
it asked, or not at all, is a named *degradation* (log, ``result.degradations``, metrics.json).
Sending, matching replies and that bookkeeping live in ``strategies.messaging.Courier``; this
module holds the phase logic only. The server only ever asks for noised statistics: every
request type here has a noise mechanism on the node.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from common.logs import get_logger
from common import records as R
from common.config import RunConfig
from common.dp import PHASES, PROFILE, TRAIN, VOTE
from strategies.allocation import aggregate_profiles, allocate
from strategies.checkpoint import Checkpoint, Progress, save_checkpoint
from strategies.coverage import finetune_coverage, pretrained_codes
from strategies.membership import Membership
from strategies.messaging import Courier, SubGrid
from strategies.refinement import FINETUNED, PRETRAINED, Generator, Refinement, RefinementContext
from strategies.result import FedSynResult
from strategies.stages import Stage
from strategies.writers import effective_share, generate_pool, pretrained_counts, writers_of

log = get_logger("fedsyn")


class RoundUnanswered(RuntimeError):
    """A vote round no voter answered: the run stops before it, with its checkpoint, to be resumed."""


# (round, arrays) -> metrics of the global model on held-out data, or None.
EvaluateFn = Callable[[int, ArrayRecord], dict[str, float] | None]


class FedSynStrategy(Strategy):
    """Resource-adaptive federated DP synthetic text (paper Algorithm 1) as a Flower strategy.

    Phase 1 training is delegated to an aggregator (any Flower strategy); this class's
    ``configure_train``/``aggregate_train`` forward to it, restricted to strong nodes.
    """

    def __init__(
        self, cfg: RunConfig, vocabulary: list[str], make_aggregator: Callable[[int], Strategy], refinement: Refinement,
        generator: Generator, delta: float, evaluate_fn: EvaluateFn | None = None,
        stable_seconds: float = 3.0,
    ) -> None:
        self.cfg, self.vocabulary = cfg, list(vocabulary)
        # The aggregator is built once the strong-node count is known (stage 0), so that
        # its minimum node counts match the federation.
        self.make_aggregator, self.refinement = make_aggregator, refinement
        self.aggregator: Strategy = make_aggregator(1)
        self.generator, self.evaluate_fn = generator, evaluate_fn
        self.delta = delta  # per release; each node caps it by its own policy
        self.stable_seconds = stable_seconds
        # Every request carries it: nodes book budgets and store replies per run key, so a
        # resumed run (same key) is answered the same bytes for what was released before.
        self.resume_key = ""
        self.checkpoint_dir: Path | None = None  # where to checkpoint (None: nowhere)
        self.progress = Progress(resume_key="", config=cfg.to_flower())
        self._vote_round = 0
        self.result = FedSynResult()
        self.courier = Courier(cfg, delta, self.result)
        self.members = self._membership()
        self._grid: Grid | None = None

    def _membership(self) -> Membership:
        return Membership(self.cfg, self.courier, self.result, request=self._request, plan=self._plan,
                          hold_token=lambda: self.progress.hold_token, end_holds=self.end_holds)

    # ------------------------------------------------------------ Strategy API
    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid) -> Iterable[Message]:
        """Phase-1 messages for strong nodes, built by the aggregator."""
        return self.aggregator.configure_train(server_round, arrays, config, SubGrid(grid, self.members.strong))

    def aggregate_train(self, server_round: int, replies: Iterable[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Aggregate phase-1 replies with the aggregator."""
        return self.aggregator.aggregate_train(server_round, replies)

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid) -> Iterable[Message]:
        """No federated evaluation: a loss on private data would be an un-noised statistic."""
        return []

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        """Nothing to aggregate (see ``configure_evaluate``)."""
        return None

    def summary(self) -> None:
        """Log the run's shape."""
        c = self.cfg
        log.info("fedsyn: R=%d tau=%d B=%d eps=%s refinement=%s (T=%d) voters=%s s=%d r=%g K=%d aggregator=%s",
                 c.num_server_rounds, c.local_steps, c.batch_size, c.epsilon, self.refinement.name, c.refinement_rounds,
                 c.voters, c.num_synthetic, c.sampling_rate, c.num_votes, type(self.aggregator).__name__)
        if not c.private:
            log.warning("epsilon = inf: NO DIFFERENTIAL PRIVACY. Nodes release exact counts, exact votes "
                        "and non-private weights; use this only as a baseline on public data.")

    # ------------------------------------------------------------- the phases
    def run(self, grid: Grid, initial_arrays: ArrayRecord | None, resume: Checkpoint | None = None) -> FedSynResult:
        """Run stages 0-5 of Algorithm 1 and return everything produced; with ``resume`` (a
        loaded checkpoint of this run) continue where it stopped."""
        t0 = self._begin(grid, resume)                                  # stage 0
        self._write_texts(grid, initial_arrays)                         # stages 2, 1, 3, 4
        return self._finish(grid, t0)                                   # stage 5

    def _begin(self, grid: Grid, resume: Checkpoint | None) -> float:
        """Stage 0, after restoring ``resume`` (a loaded checkpoint of this run) if given: every
        node's tier and pre-flight. Returns the run's start time."""
        self.summary()
        if resume is not None:
            self._restore(resume)
        self.progress.resume_key = self.resume_key
        t0, self._grid = time.time(), grid
        log.info("%s", Stage.TIERS)
        self.result.tiers = self.members.discover(grid, self.stable_seconds)
        self.result.timings["tiers"] = time.time() - t0
        return t0

    def preflight(self, grid: Grid) -> FedSynResult:
        """Stage 0 alone (run config ``plan-only``, for ``fedsyn plan``): every node's tier and
        budget and whether its ledger and policy cover this run, then every hold is ended;
        nothing is spent. Raises ``RunRefused`` as ``run`` would (its holds ended too)."""
        self.summary()
        self.result.tiers = self.members.discover(grid, self.stable_seconds)
        self.end_holds(grid)
        return self.result

    def _write_texts(self, grid: Grid, initial_arrays: ArrayRecord | None) -> None:
        """Stages 2, 1, 3, 4: allocate (the profile), finetune, generate, refine; each skipped when
        the checkpoint has it done. ``strategies.marginals`` runs them for a table's free-text column.

        The profile is asked before phase 1 (Algorithm 1 lists them the other way; neither reads
        the other's output): a run whose profile cannot be had stops before the strong sites spend
        on DP-SGD, and under ``accounting = "pld"`` a strong site's DP-SGD is solved on its profile
        Gaussian (the default's multiplier 0.509 -> 0.441), where after it the profile would start a
        new composition."""
        res, done = self.result, self.progress.completed
        self.aggregator = self.make_aggregator(len(self.members.strong))

        if Stage.PROFILE.label not in done:
            log.info("%s", Stage.PROFILE)
            self._allocate(grid)                                        # stage 2
            self._checkpoint(Stage.PROFILE.label)

        t = time.time()                                                 # stage 1
        if Stage.FINETUNE.label not in done:
            log.info("%s", Stage.FINETUNE)
            res.arrays = self._finetune(grid, res.arrays if res.arrays is not None else initial_arrays)
            self._checkpoint(Stage.FINETUNE.label)
            res.timings["finetune"] = time.time() - t

        t = time.time()                                                 # stage 3
        if Stage.GENERATE.label not in done:
            log.info("%s", Stage.GENERATE)
            # θ⁰ (initial_arrays) writes pretrained-share of each code (all of a coverage-floor code), res.arrays the rest
            res.pretrained_share, res.writers_note = effective_share(
                self.cfg.pretrained_share, finetuned=res.finetuned,
                votes=self.refinement.asks_votes and bool(self.members.voters))
            log.info("writers: %s", res.writers_note)
            pool = generate_pool(self.generator, res.allocation,
                                 pretrained_counts(res.allocation, res.pretrained_share, res.pretrained_codes),
                                 initial_arrays, res.arrays, seed=self.cfg.seed, finetuned=res.finetuned)
            res.pool_texts, res.pool_codes, res.pool_writers, res.generation = (pool.texts, pool.codes, pool.writers,
                                                                                pool.report)
            self._checkpoint(Stage.GENERATE.label)
            res.timings["generate"] = time.time() - t

        t = time.time()                                                 # stage 4
        if Stage.REFINE.label not in done:
            log.info("%s", Stage.REFINE)
            self.generator.load(res.arrays)
            self._vote_round = self._rounds_before_refine()
            res.vote_rounds = res.vote_rounds[:len(self.progress.vote_totals)]
            writer = FINETUNED if res.finetuned else PRETRAINED
            refined = self.refinement.refine(RefinementContext(
                cfg=self.cfg, texts=list(res.pool_texts), codes=list(res.pool_codes), allocation=dict(res.allocation),
                profile=res.profile, vocabulary=list(self.vocabulary), generator=self.generator, vote=self._vote,
                rng=np.random.default_rng(self.cfg.seed), writers=list(res.pool_writers), writer=writer))
            writers = (refined.writers if refined.writers is not None
                       else writers_of(refined.texts, res.pool_texts, res.pool_writers, writer))
            if len(writers) != len(refined.texts):
                raise ValueError(f"refinement {self.refinement.name!r} returned {len(refined.texts)} texts but "
                                 f"{len(writers)} writers")
            res.pool_texts, res.pool_codes, res.pool_writers, res.votes = (refined.texts, refined.codes, writers,
                                                                           refined.votes)
            res.selected, res.refinement = np.asarray(refined.selected, dtype=np.int64), refined.notes
            res.refinement_history = refined.history
            if refined.trained_generator:
                res.arrays, res.generator_refined = self.generator.weights(), True
            self._checkpoint(Stage.REFINE.label)
            res.timings["refine"] = time.time() - t
        log.info("final synthetic set: %d of %d texts (%s, %d vote rounds)", len(res.selected), len(res.pool_texts),
                 self.refinement.name, len(res.vote_rounds))

    # ------------------------------------------------------------ stage 2
    def _allocate(self, grid: Grid) -> None:
        """Stage 2: the pool's size per code, from the nodes' noisy profile (``_profile``)."""
        self.members.admit(grid, "before the profile")
        self._profile(grid, self.members.active())

    def _profile(self, grid: Grid, nodes: dict[int, str]) -> None:
        """Stage 2: every node's noisy per-code counts; their sum allocates the pool (stage 3)."""
        res, t = self.result, time.time()
        profile_replies = self.courier.ask(grid, sorted(nodes), R.MSG_PROFILE, PROFILE, RecordDict(
            {R.CONFIG: self._request()}))
        res.node_profiles = self.courier.vectors(profile_replies, R.PROFILE, len(self.vocabulary), PROFILE)
        self.courier.coverage("profile", res.node_profiles, nodes)
        if not res.node_profiles:
            raise RuntimeError("no node returned a profile; nothing to allocate (see failures above)")
        res.profile = aggregate_profiles(list(res.node_profiles.values()))
        res.allocation = dict(zip(self.vocabulary, (int(a) for a in allocate(res.profile, self.refinement.pool_size(self.cfg)))))
        log.info("noisy profile %s -> allocation %s", np.round(res.profile, 1).tolist(), res.allocation)
        if self.cfg.coverage_floor > 0 and self.cfg.prompt != "zero-shot":
            strong = [p for n, p in res.node_profiles.items() if res.tiers.get(n) == "strong"]
            rho = finetune_coverage(strong, list(res.node_profiles.values()))
            res.pretrained_codes = pretrained_codes(self.vocabulary, rho, self.cfg.coverage_floor)
            log.info("phase-1 coverage %s: %s written by the pretrained weights (coverage-floor %g)",
                     np.round(rho, 2).tolist(), res.pretrained_codes or "no code", self.cfg.coverage_floor)
        res.timings["profile"] = time.time() - t

    # ------------------------------------------------------------ stage 1
    def _finetune(self, grid: Grid, arrays: ArrayRecord | None) -> ArrayRecord | None:
        """Stage 1 (A.3): the strong nodes' DP-SGD rounds from ``arrays``, averaged by the aggregator;
        returns the finetuned weights (``arrays`` unchanged when phase 1 is skipped)."""
        rounds = self.cfg.num_server_rounds
        skip = ("prompt = zero-shot (pretrained baseline)" if self.cfg.prompt == "zero-shot"
                else "no strong node" if not self.members.strong else "num-server-rounds = 0" if rounds == 0 else "")
        if arrays is None or skip:
            self.result.finetuned = False
            if not self.members.strong and TRAIN in self._plan():  # the run asked for training and gets none
                self.courier.degrade("phase 1 skipped: no strong node in the run; generating with the pretrained model",
                              skipped=True)
            else:
                log.warning("phase 1 skipped (%s): generating with the pretrained model", skip or "no weights")
            return arrays
        start = self.progress.train_round + 1
        trained = start > 1  # rounds finished before a resume count
        if self.evaluate_fn and start == 1:
            self._evaluate(0, arrays)
        for rnd in range(start, rounds + 1):
            self.members.admit(grid, f"before phase-1 round {rnd}")
            log.info("[phase 1] round %d/%d on %d strong nodes", rnd, rounds, len(self.members.strong))
            messages = list(self.configure_train(rnd, arrays, self._request(), grid))
            replies = list(grid.send_and_receive(messages, timeout=self.cfg.node_timeout))
            good = self.courier.collect(replies, messages, TRAIN, rnd)
            self.courier.coverage(f"phase 1 round {rnd}", good, (m.metadata.dst_node_id for m in messages))
            if not good:
                continue
            trained = True
            new_arrays, metrics = self.aggregate_train(rnd, list(good.values()))
            if new_arrays is not None and not all(np.isfinite(a).all() for a in new_arrays.to_numpy_ndarrays()):
                self.courier.degrade(f"phase 1 round {rnd}: the aggregator returned non-finite weights; kept the "
                                     "previous ones")
                new_arrays = None
            if new_arrays is not None:
                arrays = new_arrays
            if metrics is not None:
                self.result.train_metrics[rnd] = {k: float(v) for k, v in metrics.items() if not isinstance(v, list)}
            if self.evaluate_fn:
                self._evaluate(rnd, arrays)
            self.result.arrays, self.progress.train_round = arrays, rnd
            self._checkpoint()
        self.result.finetuned = trained
        if not trained:
            self.courier.degrade("phase 1 skipped: no strong node answered any round; generating with the pretrained model",
                          skipped=True)
        return arrays

    def _evaluate(self, rnd: int, arrays: ArrayRecord) -> None:
        metrics = self.evaluate_fn(rnd, arrays) if self.evaluate_fn else None
        if metrics:
            self.result.eval_metrics[rnd] = metrics
            log.info("[phase 1] round %d held-out %s", rnd, {k: round(v, 4) for k, v in metrics.items()})

    # ------------------------------------------------------------ stage 4 (the refinements' ctx.vote)
    def _vote(self, texts: list[str], codes: list[str], histogram: str = "knn-vote", epsilon_share: float = 1.0,
              **params: Any) -> np.ndarray:
        """One vote round (the refinements' ``ctx.vote``): every voter releases the named histogram
        of its records over the candidates at ``epsilon_share`` of its vote budget; returns the sum.

        Each node authorises the round against its own budget for the phase, so the rounds of
        one run can never add up to more than its epsilon_vote. Voters that fail are left out.
        """
        if not texts:
            return np.zeros(0)
        if len(texts) != len(codes):
            raise ValueError(f"{len(texts)} candidate texts but {len(codes)} codes")
        res = self.result
        self._vote_round += 1
        rnd = self._vote_round
        if rnd <= len(self.progress.vote_totals):  # finished before the run was resumed: not asked again
            log.info("vote round %d: taken from the checkpoint", rnd)
            return np.asarray(self.progress.vote_totals[rnd - 1], dtype=np.float64)
        self.members.admit(self._grid, f"before vote round {rnd}")
        voters = self.members.voters
        if not voters:
            self.courier.degrade(f"vote round {rnd}: no voters (voters={self.cfg.voters} and no weak node); votes are all zero",
                          skipped=True)
        failed_before = len(res.failures)
        replies = self.courier.ask(self._grid, voters, R.MSG_VOTE, VOTE, RecordDict({
            R.CANDIDATES: ConfigRecord({"texts": list(texts), "codes": list(codes)}),
            R.CONFIG: self._request(**params, **{"histogram": histogram, "epsilon-share": float(epsilon_share),
                                                 "server-round": rnd}),
        }))
        res.node_votes = self.courier.vectors(replies, R.VOTES, len(texts), VOTE)
        self.courier.coverage(f"vote round {rnd}", res.node_votes, voters)
        refused = {f["node_id"] for f in res.failures[failed_before:] if f.get("code") in R.ERR_REFUSED}
        if voters and not res.node_votes and not set(voters) <= refused:
            # Not a round done with zero votes: later rounds would build on it and a resume could not
            # ask it again. The checkpoint stands before this round; a resume asks it anew (a voter
            # that released and lost its reply answers with the stored one, at no cost). A round every
            # voter refused (budget, policy) is answered: a resume would be refused the same way.
            raise RoundUnanswered(f"vote round {rnd}: no voter answered (see failures above); the run stops "
                                  "before this round with its checkpoint: resume it when the voters are back "
                                  "(flwr run . --run-config <run-dir>/resume.toml)")
        total = (np.sum([np.asarray(v) for v in res.node_votes.values()], axis=0)
                 if res.node_votes else np.zeros(len(texts)))
        res.vote_rounds.append({"round": rnd, "histogram": histogram, "epsilon_share": float(epsilon_share),
                                "candidates": len(texts), "voters": sorted(res.node_votes)})
        self.progress.vote_totals.append([float(v) for v in total])
        self._checkpoint()
        return total

    # ------------------------------------------------------------ stage 5
    def _finish(self, grid: Grid, t0: float) -> FedSynResult:
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
        replies = self.courier.ask(grid, node_ids, R.MSG_LEDGER, "ledger", RecordDict({R.CONFIG: self._request(
            **{"hold-token": self.progress.hold_token})}))
        for nid, msg in replies.items():
            try:
                rec = msg.content.config_records[R.LEDGER]
                if rec.get("ledger-ref"):
                    self.result.ledger_refs[nid] = str(rec["ledger-ref"])
                self.result.ledgers[nid] = {"releases": json.loads(str(rec["releases"])),
                                            "epsilon-spent": float(rec["epsilon-spent"]),
                                            "epsilon-budget": float(rec["epsilon-budget"])}
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
    def _rounds_before_refine(self) -> int:
        """How many rounds of ``progress.vote_totals`` precede the refinement's (a table's marginals
        rounds, ``strategies.marginals``): its vote rounds are numbered after them."""
        return 0

    def _plan(self) -> list[str]:
        """The phases this run will ask of nodes (each node takes those of its tier)."""
        return [p for p in PHASES if (p != TRAIN or self.cfg.trains) and (p != VOTE or self.refinement.asks_votes)]

    def _request(self, **extra: Any) -> ConfigRecord:
        """The part every request carries: the public vocabulary, the delta per release, the run key."""
        key = {"resume-key": self.resume_key} if self.resume_key else {}
        return ConfigRecord({"codes": self.vocabulary, "delta": self.delta, **key, **extra})

    # ------------------------------------------------------------ checkpoints
    def _checkpoint(self, stage: str | None = None) -> None:
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
