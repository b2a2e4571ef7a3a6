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

    def missing(self, cfg: RunConfig, tiers: set[str]) -> str | None:  # noqa: D102 - documented on Phase
        return None if STRONG in tiers else "phase 1 has no strong node"

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

    def plan_lines(self, pricing: Pricing, planned: Planned | None, pld: float,  # noqa: D102 - documented on Phase
                   after_unknown_q: bool) -> list[str]:
        if planned is None:
            return []
        cfg, steps = pricing.cfg, planned.steps
        if planned.q_unknown:  # a deployment's plan: q is B / the node's max-records
            return [f"train: epsilon {planned.share:g}, delta {pricing.delta:g} (or the node's cap), {steps} DP-SGD "
                    f"steps of batch {cfg.batch_size}, C = {cfg.max_grad_norm:g}; the noise multiplier is set on the "
                    "node from q = B / max-records (its public bound; its record count is never sent)"]
        tokens = steps * cfg.batch_size * cfg.max_length * (2 if cfg.contrastive_weight > 0 else 1)  # pairs: two rows
        rate = pricing.speed.get(f"train_{cfg.finetune}_dp_tokens_per_s")
        return [f"train: epsilon {planned.share:g}, delta {pricing.delta:g}, DP-SGD noise multiplier "
                f"{pricing.basic(planned):.3g} (basic; {pld:.3g} under accounting = pld) "
                f"(q = {planned.sample_rate:.3g}, {steps} steps, C = {cfg.max_grad_norm:g}); {tokens:,} tokens"
                + (f", about {tokens / rate:.0f} s" if rate else "")]
