"""``refinement = "pe"``: Private Evolution (Lin et al. 2024; Aug-PE, Xie et al. 2024), per control code.

T rounds (``refinement-rounds``) on a population of s texts (the stage-3 pool):

1. every voter releases its DP nearest-neighbour histogram of the population
   (``nearest-neighbour``: each record +1 to its nearest same-code text, L2 sensitivity 1)
   at ``epsilon_share = 1/T`` of its vote budget, so the T rounds add up to epsilon_vote;
2. except after the last round, each code keeps its highest-voted half and refills the
   other half with variations of the survivors (``Generator.variation``), best first.

The final set is drawn from the last population by A.4 with the last round's votes, at the
same rate r as ``knn-vote``, so every method ends with the same number of texts.

Choices where the papers leave room (written down here): survivors are the top half by
noisy votes (PE draws parents in proportion to votes; Aug-PE keeps the top ones), survivors
stay in the population (Aug-PE), and there is no vote threshold H (A.4 clamps negatives).
With T = 1 this is ``knn-vote`` with K = 1.

``pe-contrastive`` (issue 34) votes with ``contrastive-vote`` at K = 1 instead (each record +1 to
its nearest text of its code, -1 to its nearest text of another code; sensitivity sqrt(2)), so
the survivors, and the variations made of them, are the texts that carry their code.
"""

from __future__ import annotations

import math

import numpy as np

from common.config import RunConfig
from common.logs import get_logger
from strategies.refinement import Refined, Refinement, RefinementContext, VotePlan, round_rows
from strategies.resampling import resample_by_code
from strategies.writers import better_writer

log = get_logger("fedsyn")
HISTOGRAM = "nearest-neighbour"


def next_generation(codes: list[str], votes: np.ndarray) -> tuple[list[int], list[int]]:
    """Plan one PE step: (survivors, parents), as indices into the population.

    Per code (in sorted order), the top ``ceil(n/2)`` texts by votes survive (ties keep the
    earlier text); the code's other ``n - ceil(n/2)`` slots are children, whose parents cycle
    through the survivors best first. The next population is the survivors followed by one
    variation of each parent, so each code keeps its size.
    """
    codes_arr, v = np.asarray(codes), np.asarray(votes, dtype=np.float64)
    if v.shape != (len(codes),):
        raise ValueError(f"{v.size} votes for {len(codes)} texts")
    survivors: list[int] = []
    parents: list[int] = []
    for code in sorted(set(codes)):
        idx = np.flatnonzero(codes_arr == code)
        ranked = idx[np.argsort(-v[idx], kind="stable")]
        keep = ranked[: math.ceil(idx.size / 2)]
        survivors += keep.tolist()
        parents += [int(keep[i % keep.size]) for i in range(idx.size - keep.size)]
    return survivors, parents


class PrivateEvolution(Refinement):
    """T rounds of DP nearest-neighbour votes, each followed by variations of the best texts."""

    name = "pe"
    histogram = HISTOGRAM
    histogram_params: dict[str, int] = {}

    def vote_plan(self, cfg: RunConfig) -> VotePlan:
        """T = ``refinement-rounds`` rounds of ``histogram``, each at epsilon_vote / T."""
        return VotePlan(cfg.refinement_rounds, self.histogram, dict(self.histogram_params))

    def refine(self, ctx: RefinementContext) -> Refined:  # noqa: D102 - documented on Refinement
        plan = self.vote_plan(ctx.cfg)
        rounds = plan.rounds
        # the population starts as the pool, both writers' texts (strategies.writers); a child is
        # written by the weights the generator holds
        texts, codes, writers = list(ctx.texts), list(ctx.codes), list(ctx.writers) or [ctx.writer] * len(ctx.texts)
        notes: list[dict[str, float]] = []
        history: list[dict] = []
        votes = np.zeros(len(texts))
        for t in range(1, rounds + 1):
            votes = ctx.vote(texts, codes, **plan.request())
            notes.append({"round": t, "population": len(texts),
                          "mean_votes": float(np.mean(votes)) if len(votes) else 0.0})
            log.info("[pe] round %d/%d: %d texts voted, mean noisy votes %.2f", t, rounds, len(texts),
                     notes[-1]["mean_votes"])
            if t == rounds:
                history += round_rows(t, texts, codes, votes, writer=writers)
                break
            survivors, parents = next_generation(codes, votes)
            kept = set(survivors)
            history += round_rows(t, texts, codes, votes, writer=writers,
                                  survived=[i in kept for i in range(len(texts))],
                                  children=np.bincount(parents, minlength=len(texts)).tolist())
            children = ctx.generator.variation([texts[i] for i in parents], [codes[i] for i in parents],
                                               seed=ctx.cfg.seed + t)
            texts = [texts[i] for i in survivors] + children
            codes = [codes[i] for i in survivors] + [codes[i] for i in parents]
            writers = [writers[i] for i in survivors] + [ctx.writer] * len(parents)
        selected = resample_by_code(codes, votes, ctx.cfg.sampling_rate, ctx.cfg.seed,
                                    among=better_writer(codes, writers, votes, ctx.cfg.writer_choice))
        return Refined(texts, codes, selected, votes, notes={"rounds": notes}, history=history, writers=writers)


class ContrastivePrivateEvolution(PrivateEvolution):
    """PE whose rounds vote with ``contrastive-vote`` (K = 1): variations of the texts that carry their code."""

    name = "pe-contrastive"
    histogram = "contrastive-vote"
    histogram_params = {"num-votes": 1}
