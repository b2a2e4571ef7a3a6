"""The paper's refinement and its two baselines, as ``Refinement`` plug-ins.

- ``knn-vote`` (Algorithm 1 stages 4-5): one vote round of DP kNN votes (A.2) on the pool of
  s, then A.4 resampling by the votes, per code.
- ``contrastive-vote`` (issue 34): the same round with votes that reward carrying the code: each
  record +1 to its K nearest texts of its code, -1 to its K nearest texts of the other codes
  (``common.voting.contrastive_votes``, sensitivity sqrt(2K)); A.4 clamps negatives to 0.
- ``uniform`` (paper Table A.14): the same pool and final size, A.4 with equal weights, no votes.
- ``none``: generate the final size directly (``max(1, floor(r*s))``) and keep all of it, so
  every method ends with the same number of texts and compares fairly.
"""

from __future__ import annotations

import numpy as np

from common.config import RunConfig
from strategies.refinement import Refined, Refinement, RefinementContext, VotePlan, final_size
from strategies.resampling import resample_by_code
from strategies.writers import better_writer


class KnnVoteRefinement(Refinement):
    """Paper Algorithm 1 stages 4-5: resample the pool by its aggregated DP kNN votes."""

    name = "knn-vote"
    histogram = "knn-vote"  # the node-side statistic (common.histograms.HISTOGRAMS)

    def vote_plan(self, cfg: RunConfig) -> VotePlan:
        """One round of ``histogram`` with K = ``num-votes``, at the whole epsilon_vote."""
        return VotePlan(1, self.histogram, {"num-votes": cfg.num_votes})

    def refine(self, ctx: RefinementContext) -> Refined:  # noqa: D102 - documented on Refinement
        votes = ctx.vote(ctx.texts, ctx.codes, **self.vote_plan(ctx.cfg).request())
        # each code from its better-voted writer (strategies.writers; None: the whole pool)
        among = better_writer(ctx.codes, ctx.writers, votes, ctx.cfg.writer_choice)
        selected = resample_by_code(ctx.codes, votes, ctx.cfg.sampling_rate, ctx.cfg.seed, among=among)
        return Refined(ctx.texts, ctx.codes, selected, votes, writers=list(ctx.writers))


class ContrastiveVoteRefinement(KnnVoteRefinement):
    """kNN-vote's round and A.4 with contrastive votes: +1 near the text's own code's records,
    -1 near the other codes' records (K = ``num-votes`` each)."""

    name = "contrastive-vote"
    histogram = "contrastive-vote"


class UniformRefinement(Refinement):
    """A.4 with equal weights: same pool and final size as knn-vote, no votes."""

    name = "uniform"
    asks_votes = False

    def refine(self, ctx: RefinementContext) -> Refined:  # noqa: D102 - documented on Refinement
        return Refined(ctx.texts, ctx.codes, resample_by_code(ctx.codes, None, ctx.cfg.sampling_rate, ctx.cfg.seed),
                       writers=list(ctx.writers))


class NoRefinement(Refinement):
    """Generate the final size directly and keep it all."""

    name = "none"
    asks_votes = False

    def pool_size(self, cfg: RunConfig) -> int:  # noqa: D102 - documented on Refinement
        return final_size(cfg)

    def refine(self, ctx: RefinementContext) -> Refined:  # noqa: D102 - documented on Refinement
        return Refined(ctx.texts, ctx.codes, np.arange(len(ctx.codes)), writers=list(ctx.writers))
