"""A minimal refinement plug-in (docs/writing_a_refinement.md): keep the top-voted texts per code.

Run it with ``flwr run . --run-config 'refinement="examples.top_voted:TopVoted"'``.
"""

from __future__ import annotations

import numpy as np

from common.config import RunConfig
from strategies.refinement import Refined, Refinement, RefinementContext, VotePlan


class TopVoted(Refinement):
    """One kNN vote round on the pool; keep each code's highest-voted texts, as many as A.4 would."""

    name = "top-voted"

    def vote_plan(self, cfg: RunConfig) -> VotePlan:
        """One kNN round at the whole epsilon_vote (``fedsyn plan`` prints its noise from this)."""
        return VotePlan(1, "knn-vote", {"num-votes": cfg.num_votes})

    def refine(self, ctx: RefinementContext) -> Refined:
        votes = ctx.vote(ctx.texts, ctx.codes, **self.vote_plan(ctx.cfg).request())
        codes = np.asarray(ctx.codes)
        keep: list[int] = []
        for code in sorted(set(ctx.codes)):
            idx = np.flatnonzero(codes == code)
            n = max(1, int(ctx.cfg.sampling_rate * idx.size))
            keep += idx[np.argsort(-votes[idx], kind="stable")[:n]].tolist()
        return Refined(ctx.texts, ctx.codes, np.asarray(keep), votes)
