"""``refinement = "popri"``: POPri (Hou et al., ICML 2025, Algorithm 1), per control code.

T rounds (``refinement-rounds``); in each:

1. the pool is the generator's samples by the allocation (round 1: the stage-3 pool; later
   rounds regenerate with the updated generator). The prompt is the control code, so a
   code's samples are the J responses to one prompt, in groups of J
   (``popri-samples-per-prompt``, the paper's J = 10);
2. every voter releases DP similarity scores of the pool (``similarity``: for each record,
   its cosine similarities to the same-code texts, clipped to L2 norm 1, summed; L2
   sensitivity 1) at ``epsilon_share = 1/T`` of its vote budget;
3. in each group, the highest-scored text is *chosen* and the l-th highest
   (``popri-rejected-rank``, the paper's l = 5) *rejected*;
4. the generator's trainable weights (its LoRA adapter) are DPO-finetuned on those pairs
   with ``trl``'s ``DPOTrainer``. The reference is the generator as the round starts (trl
   copies the adapter), where the paper keeps the public checkpoint: here the generator
   starts DP-finetuned, and DPO should not pull it back towards the pretrained model.

Then the final set, ``max(1, floor(r*s))`` texts by the profile's allocation, is generated
with the finetuned generator (the paper's output step), so every method ends with the
same number of texts; the run's saved model is the DPO-finetuned one.

Choices where the paper's setting differs from ours (written down here): POPri's privacy
unit is a client, so it clips each *client's* mean similarity vector to 1; ours is one
record of a node, so each *record's* vector is clipped to 1 and the node releases the sum
(a mean would divide by the private |D|). A trailing group smaller than J is used when it
has at least l texts. DPO runs 2 epochs (the paper's) at ``popri-learning-rate`` with
beta = 0.1 (trl's default): the paper's 3e-7 to 8e-7 is for LLaMA-3-8B on 1,800 pairs a
round and moves a small adapter on a few pairs not at all.
"""

from __future__ import annotations

import tempfile

import numpy as np

from common.config import RunConfig
from common.logs import get_logger
from strategies.refinement import (
    REFINED,
    Generator,
    Refined,
    Refinement,
    RefinementContext,
    VotePlan,
    final_size,
    round_rows,
)

log = get_logger("fedsyn")
HISTOGRAM = "similarity"
DPO_EPOCHS = 2
DPO_BETA = 0.1
DPO_BATCH = 8


def preference_pairs(codes: list[str], scores: np.ndarray, group: int, rejected_rank: int) -> list[tuple[int, int]]:
    """(chosen, rejected) pool indices: per code, per group of ``group`` consecutive texts,
    the top-scored text and the ``rejected_rank``-th (1 = top). A trailing group with fewer
    than ``rejected_rank`` texts gives no pair. Codes in sorted order; ties keep the earlier text.
    """
    if not 2 <= rejected_rank <= group:
        raise ValueError(f"rejected rank {rejected_rank} must be in [2, {group}]")
    codes_arr, s = np.asarray(codes), np.asarray(scores, dtype=np.float64)
    if s.shape != (len(codes),):
        raise ValueError(f"{s.size} scores for {len(codes)} texts")
    pairs: list[tuple[int, int]] = []
    for code in sorted(set(codes)):
        idx = np.flatnonzero(codes_arr == code)
        for start in range(0, idx.size, group):
            members = idx[start:start + group]
            if members.size < rejected_rank:
                continue
            ranked = members[np.argsort(-s[members], kind="stable")]
            pairs.append((int(ranked[0]), int(ranked[rejected_rank - 1])))
    return pairs


def dpo_finetune(generator: Generator, prompts: list[str], chosen: list[str], rejected: list[str],
                 learning_rate: float, seed: int) -> float:
    """DPO-finetune the generator's trainable weights in place on the preference pairs
    (``trl.DPOTrainer``); returns the mean training loss."""
    import torch
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    from common.devices import model_device

    data = Dataset.from_dict({"prompt": prompts, "chosen": chosen, "rejected": rejected})
    on_cpu = model_device(generator.model).type == "cpu" or not torch.cuda.is_available()
    with tempfile.TemporaryDirectory(prefix="fedsyn-dpo-") as out:
        # trl's DPOConfig turns on bf16 and gradient checkpointing by default. On a CPU without
        # bf16 units (ours: AMD EPYC) bf16 is emulated, and checkpointing runs every forward twice:
        # one step of 8 pairs took minutes (benchmarks/README.md). The generator is small, so fp32
        # and no checkpointing on a CPU; bf16 on a GPU that has it.
        args = DPOConfig(output_dir=out, per_device_train_batch_size=min(DPO_BATCH, len(prompts)),
                         num_train_epochs=DPO_EPOCHS, learning_rate=learning_rate, beta=DPO_BETA,
                         max_length=None, save_strategy="no", report_to=[], seed=seed, logging_steps=1,
                         use_cpu=on_cpu, bf16=not on_cpu and torch.cuda.is_bf16_supported(),
                         gradient_checkpointing=False)
        trainer = DPOTrainer(model=generator.model, args=args, train_dataset=data, processing_class=generator.tokenizer)
        try:
            result = trainer.train()
        finally:
            # trl keeps the reference as a frozen copy of the adapter, named "ref"; drop it so the
            # saved weights are the trained adapter alone and the next round can copy it again
            peft_config = getattr(generator.model, "peft_config", {})
            if "ref" in peft_config:
                generator.model.delete_adapter("ref")
    generator.model.eval()
    return float(result.training_loss)


class POPri(Refinement):
    """T rounds of DP similarity scores -> preference pairs -> DPO on the generator; then regenerate."""

    name = "popri"

    def vote_plan(self, cfg: RunConfig) -> VotePlan:
        """T = ``refinement-rounds`` rounds of similarity scores, each at epsilon_vote / T."""
        return VotePlan(cfg.refinement_rounds, HISTOGRAM)

    def refine(self, ctx: RefinementContext) -> Refined:  # noqa: D102 - documented on Refinement
        cfg, gen = ctx.cfg, ctx.generator
        plan = self.vote_plan(cfg)
        rounds = plan.rounds
        texts, codes = list(ctx.texts), list(ctx.codes)
        notes: list[dict[str, float]] = []
        history: list[dict] = []
        for t in range(1, rounds + 1):
            if t > 1:
                texts, codes = gen.generate(ctx.allocation, seed=cfg.seed + t)
            scores = ctx.vote(texts, codes, **plan.request())
            pairs = preference_pairs(codes, scores, cfg.popri_samples_per_prompt, cfg.popri_rejected_rank)
            role: list[str | None] = [None] * len(texts)
            for i, j in pairs:
                role[i], role[j] = "chosen", "rejected"
            history += round_rows(t, texts, codes, scores, role=role)
            note: dict[str, float] = {"round": t, "pool": len(texts), "pairs": len(pairs)}
            if pairs:
                note["dpo_loss"] = dpo_finetune(gen, [gen.prompt(codes[i]) for i, _ in pairs],
                                                [texts[i] for i, _ in pairs], [texts[j] for _, j in pairs],
                                                cfg.popri_learning_rate, cfg.seed + t)
            else:
                log.warning("[popri] round %d: no code has %d texts for a preference pair; DPO skipped",
                            t, cfg.popri_rejected_rank)
            notes.append(note)
            log.info("[popri] round %d/%d: %d texts scored, %d preference pairs%s", t, rounds, len(texts), len(pairs),
                     f", DPO loss {note['dpo_loss']:.4f}" if "dpo_loss" in note else "")
        final_texts, final_codes = gen.generate(ctx.allocation_for(final_size(cfg)), seed=cfg.seed + rounds + 1)
        trained = any("dpo_loss" in n for n in notes)
        return Refined(final_texts, final_codes, np.arange(len(final_codes)), None, notes={"rounds": notes},
                       trained_generator=trained, history=history,
                       writers=[REFINED if trained else ctx.writer] * len(final_texts))
