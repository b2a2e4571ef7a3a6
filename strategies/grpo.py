"""``refinement = "grpo"``: the generator learns from the voters' DP scores alone, with GRPO
(Shao et al. 2024, DeepSeekMath; ``trl``'s ``GRPOTrainer``).

T rounds (``refinement-rounds``), one ``trl`` training run over them; in each round:

1. **Rollouts by the server's generator.** For every code, groups of G texts
   (``grpo-group-size``) are sampled by ``Generator.generate``, handed to trl as its
   ``rollout_func``: trl's loop, our sampler (for a table, the row writer under each column's
   grammar). The number of groups per code follows the profile's allocation of the pool.
2. **The reward is one DP vote round.** trl's reward function is ``ctx.vote`` on the round's
   texts with the ``similarity`` histogram (POPri's: each record's cosine similarities to the
   same-code texts, clipped to L2 norm 1, summed; noised on every node) at
   ``epsilon_share = 1/T``. Nothing else scores a text: no embedding, no data, on the server.
   The reward function counts its calls and refuses a (T+1)-th; the nodes' ledgers would too.
3. **GRPO's update.** Each text's advantage is its reward minus its group's mean, over the
   group's standard deviation (trl's default ``scale_rewards="group"``); one clipped policy-
   gradient step per group on the generator's trainable weights (its LoRA adapter), at
   ``grpo-learning-rate``, no KL term (trl's default ``beta = 0``: the DP-finetuned generator
   is the starting point, not a reference to pull back to).

Then the final set, ``max(1, floor(r*s))`` texts by the profile's allocation, is generated
with the updated generator, as POPri does, and the run saves it.

Choices written down here: a text's tokens are the ones the model chose. In a table run the
server writes the column names (``fedsyn_server.synthesis``), so their tokens are masked out
of the loss (trl's ``env_mask``) and only the values' tokens are reinforced; a free text is all
the model's. Rewards are not clipped: the histogram's noise is part of the reward, and the
group normalisation divides by the group's spread, noise included. Whether this moves the
generator at our scale is measured in ``docs/tables.md``.
"""

from __future__ import annotations

import os
import tempfile
from collections import Counter
from typing import Any

import numpy as np

from common.config import RunConfig
from common.logs import get_logger
from strategies.refinement import REFINED, Refined, Refinement, RefinementContext, VotePlan, final_size, round_rows

log = get_logger("fedsyn")
HISTOGRAM = "similarity"


def group_counts(allocation: dict[str, int], group: int) -> dict[str, int]:
    """Groups of ``group`` texts per code for a round: the allocation of the pool, rounded to whole
    groups (at least one for every code the allocation gives a text)."""
    return {c: max(1, round(n / group)) for c, n in allocation.items() if n > 0}


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


class GRPO(Refinement):
    """T rounds of rollouts -> one DP similarity vote each (the reward) -> GRPO steps; then regenerate."""

    name = "grpo"

    def vote_plan(self, cfg: RunConfig) -> VotePlan:
        """T = ``refinement-rounds`` rounds of similarity scores (the rewards), each at epsilon_vote / T."""
        return VotePlan(cfg.refinement_rounds, HISTOGRAM)

    def refine(self, ctx: RefinementContext) -> Refined:  # noqa: D102 - documented on Refinement
        import torch
        from datasets import Dataset
        from trl import GRPOConfig, GRPOTrainer

        from common.devices import model_device

        cfg, gen = ctx.cfg, ctx.generator
        plan = self.vote_plan(cfg)
        rounds, group = plan.rounds, cfg.grpo_group_size
        groups = group_counts(ctx.allocation, group)
        code_of = {gen.prompt(c): c for c in groups}
        rows = [gen.prompt(c) for c, n in groups.items() for _ in range(n)]
        schema = getattr(gen, "row_schema", None)
        history: list[dict] = []
        notes: list[dict[str, Any]] = []

        def rollout(batch: list[str], trainer: Any) -> dict[str, Any]:
            # trl hands over each prompt once per completion it wants (its sampler repeats a group's prompt G times)
            want = Counter(code_of[p] for p in batch)
            t = len(notes) + 1
            texts, codes = gen.generate(want, seed=cfg.seed + 7919 * t)
            by_code: dict[str, list[str]] = {}
            for text, code in zip(texts, codes):
                by_code.setdefault(code, []).append(text)
            out_ids, out_mask, out_texts = [], [], []
            for p in batch:  # a text dropped by generation leaves its slot empty: reward 0 below
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
            if t > rounds:
                raise RuntimeError(f"grpo: trl asked for reward round {t} of {rounds}; no vote beyond the plan")
            codes = [code_of[p] for p in prompts]
            keep = [i for i, text in enumerate(fedsyn_text) if text]
            scores = np.zeros(len(fedsyn_text))
            if keep:
                scores[keep] = ctx.vote([fedsyn_text[i] for i in keep], [codes[i] for i in keep],
                                        **plan.request())
            history.extend(round_rows(t, [fedsyn_text[i] for i in keep], [codes[i] for i in keep], scores[keep]))
            notes.append({"round": t, "texts": len(keep), "groups": len(fedsyn_text) // group,
                          "reward_mean": float(scores[keep].mean()) if keep else 0.0,
                          "reward_std": float(scores[keep].std()) if keep else 0.0})
            log.info("[grpo] round %d/%d: %d texts scored (mean DP reward %.3f)", t, rounds, len(keep),
                     notes[-1]["reward_mean"])
            return [float(s) for s in scores]

        on_cpu = model_device(gen.model).type == "cpu" or not torch.cuda.is_available()
        n_groups = len(rows)
        os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # rollout_func is the documented hook we need
        with tempfile.TemporaryDirectory(prefix="fedsyn-grpo-") as out:
            args = GRPOConfig(output_dir=out, per_device_train_batch_size=group, num_generations=group,
                              steps_per_generation=n_groups, max_steps=rounds * n_groups,
                              num_iterations=1, gradient_accumulation_steps=1,
                              learning_rate=cfg.grpo_learning_rate, save_strategy="no", report_to=[],
                              seed=cfg.seed, logging_steps=1, use_cpu=on_cpu,
                              bf16=not on_cpu and torch.cuda.is_bf16_supported(), gradient_checkpointing=False,
                              shuffle_dataset=False)
            trainer = GRPOTrainer(model=gen.model, reward_funcs=reward, args=args,  # type: ignore[arg-type]  # trl: list[float | None]; a list[float] is one
                                  train_dataset=Dataset.from_dict({"prompt": rows}),
                                  processing_class=gen.tokenizer, rollout_func=rollout)
            result = trainer.train()
        gen.model.eval()
        for note in notes:
            note["train_loss"] = float(result.training_loss)
        final_texts, final_codes = gen.generate(ctx.allocation_for(final_size(cfg)), seed=cfg.seed + rounds + 1)
        return Refined(final_texts, final_codes, np.arange(len(final_codes)), None, notes={"rounds": notes},
                       trained_generator=bool(notes), history=history,
                       writers=[REFINED if notes else ctx.writer] * len(final_texts))
