"""The vote phase (stage 4): noisy histograms of the records over the server's candidates."""

from __future__ import annotations

from common import records as R
from common.calibration import Planned
from common.config import RunConfig
from common.dp import GAUSSIAN, VOTE
from common.phases.base import Phase, Pricing


class Vote(Phase):
    """A refinement's vote rounds: each a registered histogram (``common.histograms``) + Gaussian
    noise at its L2 sensitivity, the rounds splitting epsilon_vote and delta."""

    name = VOTE
    message = R.MSG_VOTE
    reply = R.VOTES
    requires = (("embedder", "embedders"),)

    def asked(self, cfg: RunConfig, asks_votes: bool) -> bool:  # noqa: D102 - documented on Phase
        return asks_votes

    def planned(self, pricing: Pricing) -> Planned | None:  # noqa: D102 - documented on Phase
        epsilon = self.share(pricing.cfg, pricing.tier)
        if not epsilon or pricing.votes is None:
            return None
        rounds, sensitivity, _ = pricing.votes
        return Planned(VOTE, GAUSSIAN, epsilon, pricing.delta, sensitivity, rounds=rounds)

    def wording(self, cfg: RunConfig, votes: tuple[int, float, str] | None, formulas: str) -> str:  # noqa: D102 - documented on Phase
        this_run = ""
        if votes is not None:
            rounds, sensitivity, formula = votes
            this_run = (f"; this run ({cfg.refinement}): {rounds} round(s), each at 1/{rounds} of epsilon_vote and "
                        f"delta, sensitivity {formula} = {sensitivity:.3g}")
        return (f"analytic Gaussian at the named histogram's L2 sensitivity ({formulas}); a refinement's vote rounds "
                "split epsilon_vote" + this_run)
