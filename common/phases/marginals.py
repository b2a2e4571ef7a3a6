"""The marginals phase (issue 48): a table run's noisy marginal counts, every tier's."""

from __future__ import annotations

from common import records as R
from common.calibration import Planned
from common.config import RunConfig
from common.dp import GAUSSIAN, MARGINALS, STRONG, analytic_gaussian_sigma
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

    def plan_lines(self, pricing: Pricing, planned: Planned | None, pld: float,  # noqa: D102 - documented on Phase
                   after_unknown_q: bool) -> list[str]:
        if planned is None:
            return []
        # every round at 1/rounds of the phase's epsilon and of its split of the delta; ``pld`` is
        # the rounds' one noise multiplier (sigma / sensitivity)
        rounds, total, delta = planned.rounds, planned.share, pricing.split(planned.share)
        lines = [f"marginals: epsilon {total:g} in {rounds} round(s), delta {delta:g}"]
        for rnd, k in enumerate(pricing.marginals, start=1):
            what = "1- and 2-way marginals" if rnd == 1 else "marginals of the tree the round-1 sums choose"
            lines.append(f"  round {rnd}: {k} {what}, "
                         f"Gaussian sigma {analytic_gaussian_sigma(total / rounds, delta / rounds, k ** 0.5):.3g} "
                         f"per cell (sensitivity sqrt({k}); basic; {pld * k ** 0.5:.3g} under accounting = pld)")
        return lines
