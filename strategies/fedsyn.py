"""The resource-adaptive strategy: every phase of Algorithm 1, top to bottom, over the Grid.

The stages are ``strategies.stages.Stage`` (the numbers the README's table and the logs use).

``FedSynStrategy.start`` is the one place to read the server's logic:

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
Sending, matching replies and that bookkeeping live in ``strategies.messaging.Courier``; stages
0 and 5, the nodes and the checkpoint in ``strategies.session.RunSession``; stages 1-4 in
``strategies.text_stages.TextStages``; this module composes them. The server only ever asks for noised statistics: every
request type here has a noise mechanism on the node.

Why this is not a Flower ``Strategy``: Flower's ``Strategy.start`` runs *its* loop, N rounds of
configure/aggregate train then evaluate, on one global model. One Flower round per phase would not
express this run: the tiers and pre-flight, the profile, server-side generation and the vote
rounds are not training rounds, and the loop's federated evaluation would release an un-noised
statistic of the sites' data (a loss on private records). So ``FedSynStrategy`` is a phase loop
over the Grid whose one entry is ``start(grid, initial_arrays, resume)``; phase 1 still uses
Flower's Strategy API where it fits: any Flower strategy aggregates the DP-SGD rounds
(``TextStages.configure_train``/``aggregate_train``).
"""

from __future__ import annotations

from collections.abc import Callable

from flwr.app import ArrayRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from common.config import RunConfig
from common.logs import get_logger
from strategies.checkpoint import Checkpoint
from strategies.refinement import Generator, Refinement
from strategies.result import FedSynResult
from strategies.session import Orchestration, RoundUnanswered, RunSession
from strategies.text_stages import EvaluateFn, TextStages

__all__ = ["EvaluateFn", "FedSynStrategy", "RoundUnanswered"]

log = get_logger("fedsyn")


class FedSynStrategy(Orchestration):
    """Resource-adaptive federated DP synthetic text (paper Algorithm 1): a phase loop over the Grid.

    ``cfg``: the run config; ``vocabulary``: the public control codes; ``delta``: per release
    (each node caps it by its own policy); ``make_aggregator``, ``refinement``, ``generator``,
    ``evaluate_fn``: stages 1-4's plug-ins (``TextStages``; ``generator`` None only for stage 0
    alone, ``preflight``). ``start`` runs it.
    """

    def __init__(
        self, cfg: RunConfig, vocabulary: list[str], make_aggregator: Callable[[int], Strategy], refinement: Refinement,
        generator: Generator | None, delta: float, evaluate_fn: EvaluateFn | None = None,
        stable_seconds: float = 3.0,
    ) -> None:
        self.cfg = cfg
        self.session = RunSession(cfg, vocabulary, delta, phases=self.phases, stable_seconds=stable_seconds)
        self.text = TextStages(self.session, make_aggregator, refinement, generator, evaluate_fn)

    def phases(self) -> list[str]:
        """The phases this run will ask of nodes (each node takes those of its tier)."""
        return self.text.phases()

    def summary(self) -> None:
        """Log the run's shape."""
        c = self.cfg
        log.info("fedsyn: R=%d tau=%d B=%d eps=%s refinement=%s (T=%d) voters=%s s=%d r=%g K=%d aggregator=%s",
                 c.num_server_rounds, c.local_steps, c.batch_size, c.epsilon, self.text.refinement.name,
                 c.refinement_rounds, c.voters, c.num_synthetic, c.sampling_rate, c.num_votes,
                 type(self.text.aggregator).__name__)
        if not c.private:
            log.warning("epsilon = inf: NO DIFFERENTIAL PRIVACY. Nodes release exact counts, exact votes "
                        "and non-private weights; use this only as a baseline on public data.")

    def start(self, grid: Grid, initial_arrays: ArrayRecord | None = None,
              resume: Checkpoint | None = None) -> FedSynResult:
        """Run stages 0-5 of Algorithm 1 over ``grid`` from ``initial_arrays`` (the pretrained
        trainable weights) and return everything produced; with ``resume`` (a loaded checkpoint
        of this run) continue where it stopped."""
        self.summary()
        t0 = self.session.begin(grid, resume)                           # stage 0
        self.text.write(grid, initial_arrays)                           # stages 2, 1, 3, 4
        return self.session.finish(grid, t0)                            # stage 5
