"""A minimal refinement plug-in (docs/writing_a_refinement.md): keep the top-voted texts per code.

Run it with ``flwr run . --run-config 'refinement="examples.top_voted:TopVoted"'``.
"""

from __future__ import annotations

import numpy as np

from strategies.refinement import Refined, RefinementContext, Refinement


class TopVoted(Refinement):
    """One kNN vote round on the pool; keep each code's highest-voted texts, as many as A.4 would."""

    name = "top-voted"

    def refine(self, ctx: RefinementContext) -> Refined:
        votes = ctx.vote(ctx.texts, ctx.codes, histogram="knn-vote", epsilon_share=1.0,
                         **{"num-votes": ctx.cfg.num_votes})
        codes = np.asarray(ctx.codes)
        keep: list[int] = []
        for code in sorted(set(ctx.codes)):
            idx = np.flatnonzero(codes == code)
            n = max(1, int(ctx.cfg.sampling_rate * idx.size))
            keep += idx[np.argsort(-votes[idx], kind="stable")[:n]].tolist()
        return Refined(ctx.texts, ctx.codes, np.asarray(keep), votes)
