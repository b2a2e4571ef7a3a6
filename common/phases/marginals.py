"""The marginals phase (issue 48): a table run's noisy marginal counts, every tier's."""

from __future__ import annotations

from common import records as R
from common.calibration import Planned
from common.config import RunConfig
from common.dp import GAUSSIAN, MARGINALS, STRONG
from common.phases.base import Phase, Pricing


class Marginals(Phase):
    """Each round's requested marginals of the node's rows, joined, + Gaussian noise at L2
    sensitivity sqrt(number of marginals): one record adds 1 to one cell of each."""

    name = MARGINALS
    message = R.MSG_MARGINALS
    reply = R.MARGINALS
    reads = "measured"

    def asked(self, cfg: RunConfig, asks_votes: bool) -> bool:  # noqa: D102 - documented on Phase
        return cfg.marginals

    def planned(self, pricing: Pricing) -> Planned | None:  # noqa: D102 - documented on Phase
        cfg = pricing.cfg
        if not cfg.marginals:
            return None
        # every tier's share is the same; each round is solved at sensitivity 1 (its multiplier)
        return Planned(MARGINALS, GAUSSIAN, self.share(cfg, STRONG), pricing.delta, 1.0, rounds=cfg.marginal_rounds)

    def wording(self, cfg: RunConfig, votes: tuple[int, float, str] | None, formulas: str) -> str:  # noqa: D102 - documented on Phase
        return ("analytic Gaussian on each round's marginal counts, joined (L2 sensitivity sqrt(number "
                f"of marginals)); {cfg.marginal_rounds} round(s), each at 1/{cfg.marginal_rounds} of "
                "the phase's epsilon and delta; the server's choice of round 2 and the graphical model "
                "are post-processing of the sums")
