"""``refinement = "grpo"``: the generator learns from the voters' DP scores alone, with GRPO
(Shao et al. 2024, DeepSeekMath; ``trl``'s ``GRPOTrainer``), under Concordia's choices (issue 74).

T rounds (``refinement-rounds``). Rounds 1 to T − 1 are one ``trl`` training run; in each:

1. **Rollouts by the server's generator.** For every code, groups of G texts
   (``grpo-group-size``; round 1's from the stage-3 pool, which the same weights wrote, since
   ``on_policy``) are sampled by ``Generator.generate``, handed to trl as its
   ``rollout_func``: trl's loop, our sampler (for a table, the row writer under each column's
   grammar). The number of groups per code follows the profile's allocation of the pool; their
   number in all is the pool's (num-synthetic / G) or ``grpo-groups``, which decouples what a
   round trains on from the final population's size (at 2,400 texts, 300 groups would be about
   1,200 steps a cell on two CPU cores; 30 are the preset's 120).
2. **The reward is one DP vote round.** trl's reward function is ``ctx.vote`` on the round's
   texts with the ``centred-similarity`` histogram (each record's cosine similarities to the
   same-code texts minus their mean over them, clipped to L2 norm 1, summed; sensitivity 1,
   noised on every node) at ``epsilon_share = 1/T``. Nothing else scores a text: no embedding, no
   data, on the server. The reward function counts its calls and refuses one beyond the plan.
3. **Rank-normalised advantages.** Within each group the DP scores are replaced by their ranks,
   standardised (mean 0, sd 1) and clipped at ``grpo-advantage-clip`` (5): the noise in a sum of
   similarities has heavy outliers to a group's spread, and a rank keeps one noisy text from taking
   a group's whole step. A text generation dropped (a row that does not parse) ranks last. trl is
   told not to rescale them (``scale_rewards="none"``): they are the advantages. (Standardised ranks
   of G texts stay within sqrt(3(G-1)/(G+1)) < sqrt(3), so the clip at 5 is Concordia's guard for
   other rewards and never acts on ranks.)
4. **GRPO's update**: ``grpo-iterations`` optimisation passes over each batch of rollouts (above 1
   PPO's ratio clip acts, ε = 0.2), a KL penalty of ``grpo-kl`` (0.01) against the adapter the
   refinement starts from (trl keeps a copy, "ref"), on the generator's trainable weights (its LoRA
   adapter) at ``grpo-learning-rate``.

Round T trains nothing: the trained generator writes the final population, the voters score it
(the T-th share), and the final set is drawn from it by A.4 on those scores, ``floor(r·n_c)``
texts per code as every method (as POPri; never regenerated blind). So T = 1 is A.4 on one round
of centred similarity scores.

Choices written down here: a text's tokens are the ones the model chose. In a table run the
server writes the column names (``fedsyn_server.synthesis``), so their tokens are masked out
of the loss (trl's ``env_mask``) and only the values' tokens are reinforced; a free text is all
the model's. Each round's reward signal against its noise is in the notes (the within-group spread
of the released scores) and measured against ε = ∞ in ``benchmarks/refinement_learning.py``.
"""

from __future__ import annotations

import os
import tempfile
from collections import Counter
from typing import Any

import numpy as np

from common.config import RunConfig
from common.logs import get_logger
from strategies.allocation import allocate_exactly
from strategies.refinement import REFINED, Refined, Refinement, RefinementContext, VotePlan, round_rows
from strategies.resampling import resample_by_code

log = get_logger("fedsyn")
HISTOGRAM = "centred-similarity"


def group_counts(allocation: dict[str, int], group: int, total: int = 0) -> dict[str, int]:
    """Groups of ``group`` texts per code for a training round, at least one for every code the
    allocation gives a text. ``total`` 0: the allocation of the pool, rounded to whole groups;
    ``total`` > 0 (``grpo-groups``): that many groups shared in proportion to the allocation by
    largest remainders (so more than ``total`` only where there are more codes than groups)."""
    codes = [c for c, n in allocation.items() if n > 0]
    if total <= 0:
        return {c: max(1, round(allocation[c] / group)) for c in codes}
    shares = allocate_exactly(np.array([allocation[c] for c in codes], dtype=np.float64), total)
    return {c: max(1, int(k)) for c, k in zip(codes, shares)}


def masked_completion(text: str, tokenizer: Any, schema: Any | None) -> tuple[list[int], list[int]]:
    """A generated text as trl's completion: its token ids and, per token, 1 where the model chose
    it and 0 where the server wrote it (a table row's column names). Out: (ids, mask)."""
    from common.rows import IS, SEP, RowError, parse, written_pairs

    whole = tokenizer(text, add_special_tokens=False)["input_ids"]
    if schema is None:
        return whole, [1] * len(whole)
    try:
        parse(text, schema)
    except RowError:  # generation keeps only rows; a text that is not one is all the model's
        return whole, [1] * len(whole)
    ids: list[int] = []
    mask: list[int] = []
    for k, (name, value) in enumerate(written_pairs(text, schema)):
        for piece, chosen in (((SEP if k else "") + name + IS.rstrip(), 0), (" " + value, 1)):
            piece_ids = tokenizer(piece, add_special_tokens=False)["input_ids"]
            ids += piece_ids
            mask += [chosen] * len(piece_ids)
    return ids, mask


def rank_advantages(scores: np.ndarray, group: int, clip: float, valid: np.ndarray | None = None) -> np.ndarray:
    """Each text's advantage from the DP scores of its group (consecutive runs of ``group``): its rank
    in the group (ties: the earlier text lower), standardised to mean 0 and sd 1 and clipped to
    ``[-clip, clip]``; a text not ``valid`` ranks below every valid one. A trailing partial group is
    ranked on its own; a group of one gets 0."""
    s = np.asarray(scores, dtype=np.float64)
    ok = np.ones(s.size, dtype=bool) if valid is None else np.asarray(valid, dtype=bool)
    keyed = np.where(ok, s, -np.inf)
    out = np.zeros(s.size)
    for start in range(0, s.size, group):
        part = keyed[start:start + group]
        if part.size < 2:
            continue
        ranks = np.empty(part.size)
        ranks[np.argsort(part, kind="stable")] = np.arange(part.size)
        out[start:start + group] = np.clip((ranks - ranks.mean()) / ranks.std(), -clip, clip)
    return out


def within_group_spread(scores: np.ndarray, group: int) -> float:
    """The mean over groups of the DP scores' standard deviation within a group: the spread GRPO
    learns from, noise included (beside the noise's sd it is the reward's signal-to-noise)."""
    s = np.asarray(scores, dtype=np.float64)
    spreads = [float(s[i:i + group].std()) for i in range(0, s.size, group) if s[i:i + group].size > 1]
    return float(np.mean(spreads)) if spreads else 0.0


class GRPO(Refinement):
    """T − 1 rounds of rollouts -> one DP centred-similarity vote each -> rank advantages -> GRPO steps;
    then the trained generator's population, scored once more, and A.4."""

    name = "grpo"
    on_policy = True

    def vote_plan(self, cfg: RunConfig) -> VotePlan:
        """T = ``refinement-rounds`` rounds of centred similarity scores (T − 1 rewards, then the final
        population's), each at epsilon_vote / T."""
        return VotePlan(cfg.refinement_rounds, HISTOGRAM)

    def refine(self, ctx: RefinementContext) -> Refined:  # noqa: D102 - documented on Refinement
        cfg, gen = ctx.cfg, ctx.generator
        plan = self.vote_plan(cfg)
        rounds, group = plan.rounds, cfg.grpo_group_size
        history: list[dict] = []
        notes: list[dict[str, Any]] = []
        if rounds > 1 and cfg.grpo_iterations > 0:  # 0: no update, the paired control (no reward vote spent)
            self._train(ctx, plan, rounds - 1, history, notes)
        texts, codes = (list(ctx.texts), list(ctx.codes)) if not notes else gen.generate(ctx.allocation,
                                                                                          seed=cfg.seed + rounds)
        scores = ctx.vote(texts, codes, **plan.request())
        history += round_rows(len(notes) + 1, texts, codes, scores)
        notes.append({"round": len(notes) + 1, "texts": len(texts),
                      "reward_mean": float(np.mean(scores)) if len(scores) else 0.0,
                      "within_group_spread": within_group_spread(scores, group)})
        selected = resample_by_code(codes, scores, cfg.sampling_rate, cfg.seed)
        trained = len(notes) > 1
        return Refined(texts, codes, selected, np.asarray(scores, dtype=np.float64), notes={"rounds": notes},
                       trained_generator=trained, history=history,
                       writers=[REFINED if trained else ctx.writer] * len(texts))

    @staticmethod
    def _train(ctx: RefinementContext, plan: VotePlan, train_rounds: int, history: list[dict],
               notes: list[dict[str, Any]]) -> None:
        """trl's GRPO over ``train_rounds`` rounds of rollouts, each rewarded by one DP vote; appends
        each round's rows to ``history`` and its note to ``notes``."""
        import torch
        from datasets import Dataset
        from trl import GRPOConfig, GRPOTrainer

        from common.devices import model_device

        cfg, gen = ctx.cfg, ctx.generator
        group = cfg.grpo_group_size
        groups = group_counts(ctx.allocation, group, cfg.grpo_groups)
        code_of = {gen.prompt(c): c for c in groups}
        rows = [gen.prompt(c) for c, n in groups.items() for _ in range(n)]
        schema = getattr(gen, "row_schema", None)

        def rollout(batch: list[str], trainer: Any) -> dict[str, Any]:
            # trl hands over each prompt once per completion it wants (its sampler repeats a group's prompt G times)
            want = Counter(code_of[p] for p in batch)
            t = len(notes) + 1
            by_code: dict[str, list[str]] = {}
            if t == 1:  # round 1's rollouts: the stage-3 pool, the same weights' samples (on_policy), not written twice
                for text, code in zip(ctx.texts, ctx.codes):
                    if len(by_code.setdefault(code, [])) < want.get(code, 0):
                        by_code[code].append(text)
            short = {c: n - len(by_code.get(c, [])) for c, n in want.items() if n > len(by_code.get(c, []))}
            texts, codes = gen.generate(short, seed=cfg.seed + 7919 * t) if short else ([], [])
            for text, code in zip(texts, codes):
                by_code.setdefault(code, []).append(text)
            out_ids, out_mask, out_texts = [], [], []
            for p in batch:  # a text dropped by generation leaves its slot empty: it ranks last below
                mine = by_code.get(code_of[p], [])
                text = mine.pop(0) if mine else ""
                ids, mask = masked_completion(text, gen.tokenizer, schema)
                out_ids.append(ids + [gen.tokenizer.eos_token_id])
                out_mask.append(mask + [0 if schema is not None else 1])
                out_texts.append(text)
            prompt_ids = [gen.tokenizer(p, add_special_tokens=False)["input_ids"] for p in batch]
            return {"prompt_ids": prompt_ids, "completion_ids": out_ids, "logprobs": None,
                    "env_mask": out_mask, "fedsyn_text": out_texts}

        def reward(prompts: list[str], completions: list[str], fedsyn_text: list[str], **_: Any) -> list[float]:
            t = len(notes) + 1
            if t > train_rounds:
                raise RuntimeError(f"grpo: trl asked for reward round {t} of {train_rounds}; no vote beyond the plan")
            codes = [code_of[p] for p in prompts]
            keep = [i for i, text in enumerate(fedsyn_text) if text]
            scores = np.zeros(len(fedsyn_text))
            if keep:
                scores[keep] = ctx.vote([fedsyn_text[i] for i in keep], [codes[i] for i in keep],
                                        **plan.request())
            valid = np.zeros(len(fedsyn_text), dtype=bool)
            valid[keep] = True
            advantages = rank_advantages(scores, group, cfg.grpo_advantage_clip, valid)
            history.extend(round_rows(t, [fedsyn_text[i] for i in keep], [codes[i] for i in keep], scores[keep],
                                      advantage=advantages[keep].tolist()))
            notes.append({"round": t, "texts": len(keep), "groups": len(fedsyn_text) // group,
                          "reward_mean": float(scores[keep].mean()) if keep else 0.0,
                          "within_group_spread": within_group_spread(scores, group)})
            log.info("[grpo] round %d/%d: %d texts scored (within-group spread of the DP scores %.3f)", t,
                     train_rounds, len(keep), notes[-1]["within_group_spread"])
            return [float(a) for a in advantages]

        on_cpu = model_device(gen.model).type == "cpu" or not torch.cuda.is_available()
        n_groups = len(rows)
        os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # rollout_func is the documented hook we need
        with tempfile.TemporaryDirectory(prefix="fedsyn-grpo-") as out:
            # one batch of rollouts a round: steps_per_generation x num_iterations steps use it
            args = GRPOConfig(output_dir=out, per_device_train_batch_size=group, num_generations=group,
                              steps_per_generation=n_groups, num_iterations=cfg.grpo_iterations,
                              max_steps=train_rounds * n_groups * cfg.grpo_iterations, gradient_accumulation_steps=1,
                              beta=cfg.grpo_kl, scale_rewards="none",
                              learning_rate=cfg.grpo_learning_rate, save_strategy="no", report_to=[],
                              seed=cfg.seed, logging_steps=1, use_cpu=on_cpu,
                              bf16=not on_cpu and torch.cuda.is_bf16_supported(), gradient_checkpointing=False,
                              shuffle_dataset=False)
            trainer = GRPOTrainer(model=gen.model, reward_funcs=reward, args=args,  # type: ignore[arg-type]  # trl: list[float | None]; a list[float] is one
                                  train_dataset=Dataset.from_dict({"prompt": rows}),
                                  processing_class=gen.tokenizer, rollout_func=rollout)
            try:
                result = trainer.train()
            finally:  # trl's reference copy of the adapter (beta > 0): the saved weights are the trained adapter alone
                if "ref" in getattr(gen.model, "peft_config", {}):
                    gen.model.delete_adapter("ref")
        gen.model.eval()
        logged = [e for e in trainer.state.log_history if "loss" in e]
        clipped = [float(e["clip_ratio/region_mean"]) for e in logged if "clip_ratio/region_mean" in e]  # trl's share
        for note in notes:
            note.update(train_loss=float(result.training_loss), steps=int(trainer.state.global_step),
                        clip_ratio=float(np.mean(clipped)) if clipped else 0.0)
