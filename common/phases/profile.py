"""The profile phase (stage 2): every node's noisy per-code counts."""

from __future__ import annotations

from common import records as R
from common.calibration import Planned
from common.config import RunConfig
from common.dp import GAUSSIAN, PROFILE
from common.phases.base import Phase, Pricing


class Profile(Phase):
    """Per-code counts + Gaussian noise at L2 sensitivity 1: one record is in one code's count."""

    name = PROFILE
    message = R.MSG_PROFILE
    reply = R.PROFILE
    reads = "code"

    def asked(self, cfg: RunConfig, asks_votes: bool) -> bool:  # noqa: D102 - documented on Phase
        return True  # a tier without a profile share (a table's) takes none

    def planned(self, pricing: Pricing) -> Planned | None:  # noqa: D102 - documented on Phase
        epsilon = self.share(pricing.cfg, pricing.tier)
        return Planned(PROFILE, GAUSSIAN, epsilon, pricing.delta) if pricing.cfg.writes_text and epsilon else None

    def wording(self, cfg: RunConfig, votes: tuple[int, float, str] | None, formulas: str) -> str:  # noqa: D102 - documented on Phase
        return "analytic Gaussian, L2 sensitivity 1"

    def plan_lines(self, pricing: Pricing, planned: Planned | None, pld: float,  # noqa: D102 - documented on Phase
                   after_unknown_q: bool) -> list[str]:
        if planned is None:  # a table's free text has none: its sampled rows allocate the texts
            return []
        return [f"profile: epsilon {planned.share:g}, delta {pricing.delta:g}, Gaussian sigma "
                f"{pricing.basic(planned):.3g} (sensitivity 1; basic; {pld:.3g} under accounting = pld)"]
