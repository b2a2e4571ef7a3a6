"""Stages 1-4 of a text run, over a ``RunSession``: the profile, DP finetuning, the pool, refinement.

``TextStages.write`` runs them in the order the strategy asks them (2, 1, 3, 4; ``strategies.
stages``), each skipped when the checkpoint has it done; what they produce goes into the
session's ``FedSynResult``. A text run (``strategies.fedsyn``) runs them between stage 0 and 5;
a table run by marginals with a free-text column (``strategies.marginals``) holds one for that
column, with its own stage 2 (``allocate``: the sampled rows' codes, no profile asked) and its
vote rounds numbered after its marginals rounds (``rounds_before``).

Phase 1 is delegated to an aggregator (any Flower ``Strategy``): ``configure_train`` and
``aggregate_train`` forward to it, restricted to the strong nodes (``SubGrid``). Only those two of
Flower's Strategy API are used: Flower's own loop (``Strategy.start``) is not (``strategies.fedsyn``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from common import records as R
from common.dp import PROFILE, TRAIN, VOTE
from common.histograms import maskable, masked_units
from common.logs import get_logger
from common.phases import phases as registered_phases
from strategies.allocation import aggregate_profiles, allocate
from strategies.coverage import finetune_coverage, pretrained_codes
from strategies.messaging import SubGrid
from strategies.refinement import FINETUNED, PRETRAINED, Generator, Refinement, RefinementContext
from strategies.secagg_rounds import SecureSum, secure
from strategies.session import RoundUnanswered, RunSession
from strategies.stages import Stage
from strategies.writers import effective_share, generate_pool, pretrained_counts, writers_of

log = get_logger("fedsyn")

# (round, arrays) -> metrics of the global model on held-out data, or None.
EvaluateFn = Callable[[int, ArrayRecord], dict[str, float] | None]


class TextStages:
    """Stages 1-4 of Algorithm 1 over ``session`` (see the module docstring).

    ``make_aggregator(n)``: phase 1's Flower strategy for ``n`` strong nodes (built once stage 0
    has counted them, so that its minimum node counts match the federation); ``refinement``: stage
    4's plug-in; ``generator``: the server's model (None only for stage 0 alone, ``fedsyn plan``,
    which never writes); ``evaluate_fn``: the held-out loss after every
    phase-1 round (None: none). ``allocate``: stage 2 in place of the nodes' profile (it sets the
    result's ``profile`` and ``allocation``; None: ask every node its noisy profile).
    ``rounds_before``: how many rounds of the checkpoint's ``vote_totals`` precede this run's vote
    rounds (a table's marginals rounds): the vote rounds are numbered after them.
    """

    def __init__(self, session: RunSession, make_aggregator: Callable[[int], Strategy], refinement: Refinement,
                 generator: Generator | None, evaluate_fn: EvaluateFn | None = None,
                 allocate: Callable[[], None] | None = None, rounds_before: int = 0) -> None:
        self.session, self.cfg, self.vocabulary = session, session.cfg, session.vocabulary
        self.make_aggregator, self.refinement = make_aggregator, refinement
        self.aggregator: Strategy = make_aggregator(1)
        self.generator, self.evaluate_fn = generator, evaluate_fn
        self.allocate, self.rounds_before = allocate, rounds_before
        self._vote_round = rounds_before

    def phases(self) -> list[str]:
        """The phases these stages ask of nodes (each node takes those of its tier)."""
        return [p.name for p in registered_phases() if p.asked(self.cfg, self.refinement.asks_votes)]

    # ------------------------------------------------------------ phase 1's aggregator
    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        """Phase-1 messages for strong nodes, built by the aggregator."""
        return self.aggregator.configure_train(server_round, arrays, config, SubGrid(grid, self.session.members.strong))

    def aggregate_train(self, server_round: int,
                        replies: Iterable[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Aggregate phase-1 replies with the aggregator."""
        return self.aggregator.aggregate_train(server_round, replies)

    # ------------------------------------------------------------ the stages
    def write(self, grid: Grid, initial_arrays: ArrayRecord | None) -> None:
        """Stages 2, 1, 3, 4 over ``grid`` from ``initial_arrays`` (the pretrained trainable weights):
        allocate (the profile), finetune, generate, refine; each skipped when the checkpoint has it
        done. What they produce is in the session's result.

        The profile is asked before phase 1 (Algorithm 1 lists them the other way; neither reads
        the other's output): a run whose profile cannot be had stops before the strong sites spend
        on DP-SGD, and under ``accounting = "pld"`` a strong site's DP-SGD is solved on its profile
        Gaussian (the default's multiplier 0.509 -> 0.441), where after it the profile would start a
        new composition."""
        if self.generator is None:
            raise RuntimeError("the text stages were built without a generator (stage 0 alone): nothing can be written")
        res, done = self.session.result, self.session.progress.completed
        self.aggregator = self.make_aggregator(len(self.session.members.strong))

        if Stage.PROFILE.label not in done:
            log.info("%s", Stage.PROFILE)
            self._allocate(grid)                                        # stage 2
            self.session.checkpoint(Stage.PROFILE.label)

        t = time.time()                                                 # stage 1
        if Stage.FINETUNE.label not in done:
            log.info("%s", Stage.FINETUNE)
            res.arrays = self._finetune(grid, res.arrays if res.arrays is not None else initial_arrays)
            self.session.checkpoint(Stage.FINETUNE.label)
            res.timings["finetune"] = time.time() - t

        t = time.time()                                                 # stage 3
        if Stage.GENERATE.label not in done:
            log.info("%s", Stage.GENERATE)
            # θ⁰ (initial_arrays) writes pretrained-share of each code (all of a coverage-floor code),
            # res.arrays the rest
            res.pretrained_share, res.writers_note = effective_share(
                self.cfg.pretrained_share, finetuned=res.finetuned,
                votes=self.refinement.asks_votes and bool(self.session.members.voters),
                on_policy=self.refinement.on_policy)
            log.info("writers: %s", res.writers_note)
            pool = generate_pool(self.generator, res.allocation,
                                 pretrained_counts(res.allocation, res.pretrained_share, res.pretrained_codes),
                                 initial_arrays, res.arrays, seed=self.cfg.seed, finetuned=res.finetuned)
            res.pool_texts, res.pool_codes, res.pool_writers, res.generation = (pool.texts, pool.codes, pool.writers,
                                                                                pool.report)
            self.session.checkpoint(Stage.GENERATE.label)
            res.timings["generate"] = time.time() - t

        t = time.time()                                                 # stage 4
        if Stage.REFINE.label not in done:
            log.info("%s", Stage.REFINE)
            self.generator.load(res.arrays)
            self._vote_round = self.rounds_before  # numbered after the rounds the checkpoint holds before them
            res.vote_rounds = res.vote_rounds[:len(self.session.progress.vote_totals)]
            writer = FINETUNED if res.finetuned else PRETRAINED
            assert res.profile is not None, "stage 2 (above, or restored from the checkpoint) sets the profile"
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
            self.session.checkpoint(Stage.REFINE.label)
            res.timings["refine"] = time.time() - t
        assert res.selected is not None, "stage 4 (above, or restored from the checkpoint with it) sets the final set"
        log.info("final synthetic set: %d of %d texts (%s, %d vote rounds)", len(res.selected), len(res.pool_texts),
                 self.refinement.name, len(res.vote_rounds))

    # ------------------------------------------------------------ stage 2
    def _allocate(self, grid: Grid) -> None:
        """Stage 2: the pool's size per code, from the nodes' noisy profile (``_profile``), or from
        the ``allocate`` the orchestration gave in its place."""
        if self.allocate is not None:
            self.allocate()
            return
        self.session.members.admit(grid, "before the profile")
        self._profile(grid, self.session.members.active())

    def _profile(self, grid: Grid, nodes: dict[int, str]) -> None:
        """Stage 2: every node's noisy per-code counts; their sum allocates the pool (stage 3)."""
        res, t = self.session.result, time.time()
        content = RecordDict({R.CONFIG: self.session.request()})
        if secure(res.trust, sorted(nodes)):  # some site shares the noise: the server sees the sum alone
            masked = SecureSum(self.session.courier, res.bounds).run(grid, sorted(nodes), R.MSG_PROFILE, PROFILE,
                                                                      content, len(self.vocabulary))
            self.session.courier.coverage("profile", dict.fromkeys(masked.survivors if masked else ()), nodes)
            if masked is None:
                raise RuntimeError("the masked profile could not be unmasked; nothing to allocate (see failures above)")
            res.node_profiles, res.profile = {}, masked.total
        else:
            profile_replies = self.session.courier.ask(grid, sorted(nodes), R.MSG_PROFILE, PROFILE, content)
            res.node_profiles = self.session.courier.vectors(profile_replies, R.PROFILE, len(self.vocabulary), PROFILE)
            self.session.courier.coverage("profile", res.node_profiles, nodes)
            if not res.node_profiles:
                raise RuntimeError("no node returned a profile; nothing to allocate (see failures above)")
            res.profile = aggregate_profiles(list(res.node_profiles.values()))
        res.allocation = dict(zip(self.vocabulary,
                                  (int(a) for a in allocate(res.profile, self.refinement.pool_size(self.cfg)))))
        log.info("noisy profile %s -> allocation %s", np.round(res.profile, 1).tolist(), res.allocation)
        if self.cfg.coverage_floor > 0 and self.cfg.prompt != "zero-shot" and not res.node_profiles:
            log.warning("coverage-floor is not applied: the profile was masked, so the strong sites' own part of it "
                        "is not known to the server")
        elif self.cfg.coverage_floor > 0 and self.cfg.prompt != "zero-shot":
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
                else "no strong node" if not self.session.members.strong
                else "num-server-rounds = 0" if rounds == 0 else "")
        if arrays is None or skip:
            self.session.result.finetuned = False
            # the run asked for training and gets none
            if not self.session.members.strong and TRAIN in self.session.phases():
                self.session.courier.degrade("phase 1 skipped: no strong node in the run; generating with the "
                                             "pretrained model", skipped=True)
            else:
                log.warning("phase 1 skipped (%s): generating with the pretrained model", skip or "no weights")
            return arrays
        start = self.session.progress.train_round + 1
        trained = start > 1  # rounds finished before a resume count
        if self.evaluate_fn and start == 1:
            self._evaluate(0, arrays)
        for rnd in range(start, rounds + 1):
            self.session.members.admit(grid, f"before phase-1 round {rnd}")
            log.info("[phase 1] round %d/%d on %d strong nodes", rnd, rounds, len(self.session.members.strong))
            messages = list(self.configure_train(rnd, arrays, self.session.request(), grid))
            replies = list(grid.send_and_receive(messages, timeout=self.cfg.node_timeout))
            good = self.session.courier.collect(replies, messages, TRAIN, rnd)
            self.session.courier.coverage(f"phase 1 round {rnd}", good, (m.metadata.dst_node_id for m in messages))
            if not good:
                continue
            trained = True
            new_arrays, metrics = self.aggregate_train(rnd, list(good.values()))
            if new_arrays is not None and not all(np.isfinite(a).all() for a in new_arrays.to_numpy_ndarrays()):
                self.session.courier.degrade(f"phase 1 round {rnd}: the aggregator returned non-finite weights; "
                                             "kept the previous ones")
                new_arrays = None
            if new_arrays is not None:
                arrays = new_arrays
            if metrics is not None:
                self.session.result.train_metrics[rnd] = {k: float(v) for k, v in metrics.items()
                                                          if not isinstance(v, list)}
            if self.evaluate_fn:
                self._evaluate(rnd, arrays)
            self.session.result.arrays, self.session.progress.train_round = arrays, rnd
            self.session.checkpoint()
        self.session.result.finetuned = trained
        if not trained:
            self.session.courier.degrade("phase 1 skipped: no strong node answered any round; generating with the "
                                         "pretrained model", skipped=True)
        return arrays

    def _evaluate(self, rnd: int, arrays: ArrayRecord) -> None:
        metrics = self.evaluate_fn(rnd, arrays) if self.evaluate_fn else None
        if metrics:
            self.session.result.eval_metrics[rnd] = metrics
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
        res = self.session.result
        self._vote_round += 1
        rnd = self._vote_round
        if rnd <= len(self.session.progress.vote_totals):  # finished before the run was resumed: not asked again
            log.info("vote round %d: taken from the checkpoint", rnd)
            return np.asarray(self.session.progress.vote_totals[rnd - 1], dtype=np.float64)
        grid = self.session.run_grid()
        self.session.members.admit(grid, f"before vote round {rnd}")
        voters = self.session.members.voters
        if not voters:
            self.session.courier.degrade(f"vote round {rnd}: no voters (voters={self.cfg.voters} and no weak node); "
                                         "votes are all zero", skipped=True)
        failed_before = len(res.failures)
        content = RecordDict({
            R.CANDIDATES: ConfigRecord({"texts": list(texts), "codes": list(codes)}),
            R.CONFIG: self.session.request(**params, **{"histogram": histogram, "epsilon-share": float(epsilon_share),
                                                 "server-round": rnd}),
        })
        masked = None
        if voters and secure(res.trust, voters) and maskable(histogram):  # the server sees the sum alone
            masked = SecureSum(self.session.courier, res.bounds).run(grid, voters, R.MSG_VOTE, VOTE, content,
                                                                      len(texts), masked_units(histogram, params,
                                                                                               len(texts)))
            res.node_votes = {}
            answered: dict[int, Any] = dict.fromkeys(masked.survivors if masked else ())
        else:
            replies = self.session.courier.ask(grid, voters, R.MSG_VOTE, VOTE, content)
            res.node_votes = answered = self.session.courier.vectors(replies, R.VOTES, len(texts), VOTE)
        self.session.courier.coverage(f"vote round {rnd}", answered, voters)
        refused = {f["node_id"] for f in res.failures[failed_before:] if f.get("code") in R.ERR_REFUSED}
        if voters and not answered and not set(voters) <= refused:
            # Not a round done with zero votes: later rounds would build on it and a resume could not
            # ask it again. The checkpoint stands before this round; a resume asks it anew (a voter
            # that released and lost its reply answers with the stored one, at no cost). A round every
            # voter refused (budget, policy) is answered: a resume would be refused the same way.
            raise RoundUnanswered(f"vote round {rnd}: no voter answered (see failures above); the run stops "
                                  "before this round with its checkpoint: resume it when the voters are back "
                                  "(flwr run . --run-config <run-dir>/resume.toml)")
        if masked is not None:
            total = masked.total
        else:
            total = (np.sum([np.asarray(v) for v in res.node_votes.values()], axis=0)
                     if res.node_votes else np.zeros(len(texts)))
        res.vote_rounds.append({"round": rnd, "histogram": histogram, "epsilon_share": float(epsilon_share),
                                "candidates": len(texts), "voters": sorted(answered),
                                **({"masked": True} if masked is not None else {})})
        self.session.progress.vote_totals.append([float(v) for v in total])
        self.session.checkpoint()
        return total

