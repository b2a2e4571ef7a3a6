"""The DP finetuning phase (stage 1, A.3): the strong nodes' DP-SGD rounds."""

from __future__ import annotations

from common import records as R
from common.calibration import Planned
from common.config import RunConfig
from common.dp import DPSGD, STRONG, TRAIN
from common.phases.base import Phase, Pricing


class Train(Phase):
    """R rounds of tau Poisson-subsampled DP-SGD steps (Opacus), the whole phase's epsilon
    reserved at its first round; replies the trainable weights."""

    name = TRAIN
    message = R.MSG_TRAIN
    reply = R.ARRAYS
    mechanism = DPSGD
    requires = (("model", "models"), ("finetune", "finetune_modes"))
    usual_tier = STRONG

    def asked(self, cfg: RunConfig, asks_votes: bool) -> bool:  # noqa: D102 - documented on Phase
        return cfg.trains

    def planned(self, pricing: Pricing) -> Planned | None:  # noqa: D102 - documented on Phase
        cfg, epsilon = pricing.cfg, self.share(pricing.cfg, pricing.tier)
        if not (cfg.writes_text and epsilon and cfg.trains):
            return None
        return Planned(TRAIN, DPSGD, epsilon, pricing.delta, sample_rate=pricing.sample_rate,
                       steps=cfg.num_server_rounds * cfg.local_steps)

    def wording(self, cfg: RunConfig, votes: tuple[int, float, str] | None, formulas: str) -> str:  # noqa: D102 - documented on Phase
        return ("DP-SGD (Opacus, Poisson sampling, RDP accountant over all rounds; the whole "
                "phase's epsilon is reserved at round 1)")
