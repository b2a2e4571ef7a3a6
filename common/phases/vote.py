"""The vote phase (stage 4): noisy histograms of the records over the server's candidates."""

from __future__ import annotations

from common import records as R
from common.calibration import Planned
from common.config import RunConfig
from common.dp import GAUSSIAN, VOTE, WEAK
from common.phases.base import Phase, Pricing


class Vote(Phase):
    """A refinement's vote rounds: each a registered histogram (``common.histograms``) + Gaussian
    noise at its L2 sensitivity, the rounds splitting epsilon_vote and delta."""

    name = VOTE
    message = R.MSG_VOTE
    reply = R.VOTES
    # the embedder, and the window and precision it embeds at: the node's records' matrix is built for them
    requires = (("embedder", "embedders"), ("vote_window", "vote_windows"), ("vote_precision", "vote_precisions"))

    def missing(self, cfg: RunConfig, tiers: set[str]) -> str | None:  # noqa: D102 - documented on Phase
        # voters = "all": every node votes; "weak" (the paper's): the weak nodes alone
        return None if cfg.voters == "all" or WEAK in tiers else "the votes have no weak node (voters=\"weak\")"

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

    def plan_lines(self, pricing: Pricing, planned: Planned | None, pld: float,  # noqa: D102 - documented on Phase
                   after_unknown_q: bool) -> list[str]:
        cfg, epsilon = pricing.cfg, self.share(pricing.cfg, pricing.tier)
        if planned is None or pricing.votes is None:
            # a refinement whose vote terms no shipped histogram states: its share, never more
            return ([f"vote: epsilon {epsilon:g} in the rounds refinement {cfg.refinement!r} asks for (never more)"]
                    if epsilon and cfg.writes_text else [])
        rounds, sensitivity, formula = pricing.votes
        rate = pricing.speed.get("embedding_vote_window_texts_per_s") or pricing.speed.get("embedding_texts_per_s")
        records = pricing.records
        return [f"vote: epsilon {planned.share:g} in {rounds} round(s), delta {pricing.delta:g}, Gaussian sigma "
                f"{pricing.basic(planned):.3g} per round (sensitivity {formula} = {sensitivity:.3g}; basic; "
                f"{'at most ' if after_unknown_q else ''}{pld:.3g} under accounting = pld"
                + (", less composed with DP-SGD at the node's q" if after_unknown_q else "") + ")"
                + (f"; embedding {records} rows, about {records / rate:.0f} s" if rate and records else "")]
