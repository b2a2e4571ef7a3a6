"""``refinement = "popri"``: POPri (Hou et al., ICML 2025, Algorithm 1), per control code.

T rounds (``refinement-rounds``); in each:

1. **On-policy samples.** The pool is the current generator's samples by the profile's
   allocation: round 1's is the stage-3 pool, written wholly by the finetuned weights for this
   method (``Refinement.on_policy``: DPO learns from the writer's own samples, so none of the
   pretrained model's, ``strategies.writers``); each later round's is written afresh by the
   generator the previous round's DPO left. A prompt is a control code, and a code's samples
   are cut into groups of J (``popri-samples-per-prompt``, the paper's J = 10): K = s / J groups,
   each J responses to one prompt, as the paper's K prompts of J samples each.
2. **DP scores.** Every voter releases its similarity scores of the pool (``popri-histogram``:
   ``similarity``, the paper's, each record's cosine similarities to the same-code texts clipped
   to L2 norm 1, summed; or ``centred-similarity``, the same vectors minus their mean, which keeps
   more of the clip for the differences between texts), sensitivity 1, at ``1/T`` of its vote
   budget; through secure aggregation where the sites share the noise, as in the paper.
3. **Preference pairs**: in each group the best-scored text is *chosen* and the ℓ-th best
   (``popri-rejected-rank``, the paper's ℓ = 5) *rejected*.
4. **DPO** (``trl.DPOTrainer``, ``popri-loss``: ``dpo``, or ``ipo`` the paper's ablation) on the
   generator's trainable weights (its LoRA adapter), ``popri-epochs`` epochs (0: no update, the
   paired control: round 1's pool and scores are then the final population) at
   ``popri-learning-rate`` and β = ``popri-beta``. A share ``popri-holdout`` of the pairs is held
   out of training, and **the round's adapter is kept only if it raises the chosen-over-rejected
   log-probability margin on those pairs**; otherwise the generator goes back to the weights it
   started the round with. The paper keeps each round's checkpoint with the lowest FID against a
   validation set of client data; a server here holds no such data, and the held-out pairs are
   post-processing of released scores, free in ε.

The last round trains nothing: its pool, written by the last kept adapter, and its released
scores are the final population, and **the final set is drawn from it by A.4** (the paper's
sampling), ``floor(r·n_c)`` texts per code as every method, with each code's scores centred on
their mean first (post-processing: a record's similarity to every text of its code is about the
same, so uncentred scores would make A.4 draw almost uniformly). So T = 1 is A.4 on one round of
similarity scores, and T rounds train T − 1 times.

Choices where the paper's setting differs from ours (written down here): POPri's privacy unit
is a client, so it clips each *client's* mean similarity vector to 1; ours is one record of a
node, so each *record's* vector is clipped to 1 and the node releases the sum (a mean would
divide by the private |D|). A trailing group smaller than J is used when it has at least ℓ
texts. DPO's reference is the generator as the round starts (trl copies the adapter), where the
paper keeps the public checkpoint: here the generator starts DP-finetuned, and DPO should not
pull it back towards the pretrained model. The paper's 3e-7 to 8e-7 learning rate is for
LLaMA-3-8B's full projections on 1,800 pairs a round; a small adapter on tens of pairs needs
orders of magnitude more (``popri-learning-rate``). The adapter is phase 1's (its rank and
modules), not the paper's rank 4 on every projection: the DP-finetuned weights are where
POPri starts.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from typing import Any

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
    round_rows,
)
from strategies.resampling import resample_by_code

log = get_logger("fedsyn")
DPO_BATCH = 8
LOSS_TYPES = {"dpo": "sigmoid", "ipo": "ipo"}  # popri-loss -> trl's loss_type
MARGIN_MAX_LENGTH = 512  # tokens of prompt + text scored for the held-out margin (generation writes fewer)


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


def split_pairs(pairs: list[tuple[int, int]], holdout: float,
                rng: np.random.Generator) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """(train, held-out) pairs: ``round(holdout x n)`` pairs drawn at random are held out, at least
    one when ``holdout`` > 0 and there are two pairs or more, and never all of them (a round trains
    on one pair at least). Both keep the pairs' order."""
    n = len(pairs)
    held = 0 if holdout <= 0 or n < 2 else min(n - 1, max(1, round(holdout * n)))
    out = set(rng.choice(n, size=held, replace=False).tolist()) if held else set()
    return [p for i, p in enumerate(pairs) if i not in out], [p for i, p in enumerate(pairs) if i in out]


def centred_by_code(codes: list[str], scores: np.ndarray) -> np.ndarray:
    """Each score minus the mean of its code's scores: the weights A.4 draws the final set by."""
    codes_arr, s = np.asarray(codes), np.asarray(scores, dtype=np.float64)
    out = s.copy()
    for code in set(codes):
        mine = codes_arr == code
        out[mine] -= s[mine].mean()
    return out


def logprob_margin(generator: Generator, prompts: list[str], chosen: list[str], rejected: list[str],
                   batch: int = 16) -> float:
    """The generator's mean over pairs of log p(chosen | prompt) − log p(rejected | prompt), each the
    sum over the text's tokens and its eos (what DPO raises); 0.0 for no pair."""
    import torch

    from common.devices import model_device
    from common.lm_loss import encode_examples, sequence_nll

    if not prompts:
        return 0.0
    model, tok = generator.model, generator.tokenizer
    was_training, old_side = model.training, tok.padding_side
    model.eval()
    tok.padding_side = "right"
    logp: list[float] = []
    try:
        with torch.no_grad():
            texts, ctx = list(chosen) + list(rejected), list(prompts) * 2
            for i in range(0, len(texts), batch):
                enc = encode_examples(tok, texts[i:i + batch], ctx[i:i + batch], MARGIN_MAX_LENGTH, lambda p: p)
                device = model_device(model)
                logits = model(input_ids=enc["input_ids"].to(device), attention_mask=enc["attention_mask"].to(device),
                               position_ids=enc["position_ids"].to(device), use_cache=False).logits
                nll, count = sequence_nll(logits, enc["labels"].to(device))
                logp += (-(nll * count)).cpu().tolist()
    finally:
        tok.padding_side = old_side
        model.train(was_training)
    n = len(prompts)
    return float(np.mean(np.asarray(logp[:n]) - np.asarray(logp[n:])))


@dataclass
class DPOStats:
    """What one DPO run did: its optimiser steps and its training loss, mean, first and last step's."""

    steps: int
    loss: float
    first_loss: float
    last_loss: float


def dpo_finetune(generator: Generator, prompts: list[str], chosen: list[str], rejected: list[str],
                 learning_rate: float, seed: int, *, beta: float = 0.1, loss: str = "dpo",
                 epochs: int = 2) -> DPOStats:
    """DPO-finetune the generator's trainable weights in place on the preference pairs
    (``trl.DPOTrainer``; ``loss``: ``dpo`` or ``ipo``); returns its steps and losses."""
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
                         num_train_epochs=epochs, learning_rate=learning_rate, beta=beta,
                         loss_type=[LOSS_TYPES[loss]], max_length=None, save_strategy="no", report_to=[],
                         seed=seed, logging_steps=1, use_cpu=on_cpu,
                         bf16=not on_cpu and torch.cuda.is_bf16_supported(), gradient_checkpointing=False)
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
    losses = [float(e["loss"]) for e in trainer.state.log_history if "loss" in e]
    mean = float(result.training_loss)
    return DPOStats(int(trainer.state.global_step), mean, losses[0] if losses else mean, losses[-1] if losses else mean)


class POPri(Refinement):
    """T rounds of on-policy samples -> DP similarity scores -> DPO on preference pairs, each round's
    adapter kept if held-out pairs say it learned; the last round's scores draw the final set (A.4)."""

    name = "popri"
    on_policy = True

    def vote_plan(self, cfg: RunConfig) -> VotePlan:
        """T = ``refinement-rounds`` rounds of ``popri-histogram`` scores, each at epsilon_vote / T."""
        return VotePlan(cfg.refinement_rounds, cfg.popri_histogram)

    def refine(self, ctx: RefinementContext) -> Refined:  # noqa: D102 - documented on Refinement
        cfg, gen = ctx.cfg, ctx.generator
        plan = self.vote_plan(cfg)
        rounds = plan.rounds
        texts, codes = list(ctx.texts), list(ctx.codes)
        writer = ctx.writer
        notes: list[dict[str, Any]] = []
        history: list[dict] = []
        scores = np.zeros(len(texts))
        for t in range(1, rounds + 1):
            if t > 1:
                texts, codes = gen.generate(ctx.allocation, seed=cfg.seed + t)
            scores = ctx.vote(texts, codes, **plan.request())
            note: dict[str, Any] = {"round": t, "pool": len(texts)}
            # the final population: its scores draw the final set, nothing is trained on them. Without
            # an update (popri-epochs = 0, the paired control) that is round 1's: no vote is spent on pairs
            if t == rounds or cfg.popri_epochs == 0:
                history += round_rows(t, texts, codes, scores, role=[None] * len(texts))
                notes.append(note)
                break
            pairs = preference_pairs(codes, scores, cfg.popri_samples_per_prompt, cfg.popri_rejected_rank)
            train, held = split_pairs(pairs, cfg.popri_holdout, np.random.default_rng([cfg.seed, t]))
            role: list[str | None] = [None] * len(texts)
            for i, j in pairs:
                role[i], role[j] = "chosen", "rejected"
            held_texts = {k for p in held for k in p}
            history += round_rows(t, texts, codes, scores, role=role,
                                  held_out=[k in held_texts for k in range(len(texts))])
            note.update(pairs=len(pairs), train_pairs=len(train), held_out_pairs=len(held))
            if train:
                note.update(self._train_round(gen, cfg, t, texts, codes, train, held))
                if note["kept"]:
                    writer = REFINED
            else:
                log.warning("[popri] round %d: no code has %d texts for a preference pair; DPO skipped",
                            t, cfg.popri_rejected_rank)
            notes.append(note)
        selected = resample_by_code(codes, centred_by_code(codes, scores), cfg.sampling_rate, cfg.seed)
        trained = any(n.get("kept") for n in notes)
        return Refined(texts, codes, selected, np.asarray(scores, dtype=np.float64), notes={"rounds": notes},
                       trained_generator=trained, history=history, writers=[writer] * len(texts))

    @staticmethod
    def _train_round(gen: Generator, cfg: RunConfig, t: int, texts: list[str], codes: list[str],
                     train: list[tuple[int, int]], held: list[tuple[int, int]]) -> dict[str, Any]:
        """One round's DPO on ``train``, kept if the margin on ``held`` rises (no held pair: kept);
        the round's note (steps, losses, margins, kept)."""
        def triples(pairs: list[tuple[int, int]]) -> tuple[list[str], list[str], list[str]]:
            return [gen.prompt(codes[i]) for i, _ in pairs], [texts[i] for i, _ in pairs], [texts[j] for _, j in pairs]

        def margin(pairs: list[tuple[int, int]]) -> float:
            return logprob_margin(gen, *triples(pairs))

        before_weights = gen.weights() if held else None  # a copy: trainable_state copies every tensor
        before = margin(held) if held else 0.0
        stats = dpo_finetune(gen, *triples(train), cfg.popri_learning_rate, cfg.seed + t,
                             beta=cfg.popri_beta, loss=cfg.popri_loss, epochs=cfg.popri_epochs)
        note: dict[str, Any] = {"dpo_steps": stats.steps, "dpo_loss": stats.loss, "dpo_first_loss": stats.first_loss,
                                "dpo_last_loss": stats.last_loss, "train_margin": margin(train)}
        kept = True
        if held:
            after = margin(held)
            kept = after > before
            note.update(held_out_margin_before=before, held_out_margin_after=after)
            if not kept:
                gen.load(before_weights)
        note["kept"] = kept
        log.info("[popri] round %d: %d pairs (%d held out), %d DPO steps, loss %.4f -> %.4f; held-out margin "
                 "%s -> %s: adapter %s", t, len(train) + len(held), len(held), stats.steps, stats.first_loss,
                 stats.last_loss, f"{before:.3f}" if held else "-",
                 f"{note['held_out_margin_after']:.3f}" if held else "-", "kept" if kept else "discarded")
        return note
