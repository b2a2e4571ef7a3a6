"""Batched, seeded sampling of continuations from a causal LM (GPT-2, Llama/SmolLM2, PEFT-wrapped).

Two things here are ours rather than transformers' defaults, both measured (``benchmarks/README.md``):

- **Sampling with one uniform per row.** ``generate(do_sample=True)`` draws a token with
  ``torch.multinomial``, which on a CPU fills an exponential variate for every vocabulary entry of
  every row at every step (49,152 for SmolLM2): 26% of generation time at batch 128 on 2 cores.
  ``InverseCdfSampler`` draws the same distribution (softmax of the temperature-scaled scores,
  restricted to the top-p nucleus) by inverting its CDF with one uniform per row, and hands
  ``generate`` a score row whose argmax is that token, so everything else (KV cache, eos, padding)
  stays transformers' own.
- **Batch size from memory.** One ``generate`` call per batch; the batch is as large as a quarter
  of the free memory allows for the KV cache and the per-step score rows, up to a per-device cap
  past which throughput stops growing (CPU 128, CUDA 512).

A third, for table runs: **constrained decoding** (``GrammarConstraint``). A value of a typed
column is drawn from the model's own distribution restricted, token by token, to texts that can
still become a value of the column (``common.rows.Column.could_start``); a small DP-finetuned
model otherwise writes most numbers out of range or not as numbers at all (measured in
``docs/tables.md``). transformers' ``prefix_allowed_tokens_fn`` does the masking but not the
end-of-value step (folding the model's comma and line-break mass into eos), so it is ours.

Classifier-free guidance (run-config ``guidance``) is transformers' own
``UnbatchedClassifierFreeGuidanceLogitsProcessor``: each token's log-probabilities under the
code's prompt, pushed away from those under the same prompt without the code (Sanchez et al.
2023). It ignores left padding in its branch's positions, which is harmless here: every
unconditional prompt of a run is the same string (``common.codes.unconditional_prompt``).

A sequence that ends with eos is padded until its batch ends (transformers' behaviour); freeing
its slot would need a decode loop of our own, which does not pay on the default data: records are
longer than ``max-length``, so nearly every row runs to the token limit.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from functools import lru_cache
from typing import TYPE_CHECKING, Protocol, cast

import numpy as np
import torch
from tqdm.auto import tqdm
from transformers import LogitsProcessor, LogitsProcessorList, StoppingCriteria, StoppingCriteriaList
from transformers.generation.logits_process import UnbatchedClassifierFreeGuidanceLogitsProcessor

from common.devices import autocast, model_device, to_device

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

BATCH_CAP = {"cpu": 128, "cuda": 512}  # measured: 256 is no faster than 128 on 2 CPU cores
MEMORY_SHARE = 0.25  # of the free memory, for one batch's cache and score rows
SCORE_COPIES = 8  # float32 vocabulary rows per sequence alive in one step (scores, softmax, CDF, ...)


class InverseCdfSampler(LogitsProcessor):
    """Nucleus sampling with one uniform per row: returns scores that are 0 at the drawn token and
    -inf elsewhere, for ``generate(do_sample=False)`` to take by argmax.

    The distribution is softmax(scores / temperature) on the smallest set of most likely tokens
    whose mass reaches ``top_p`` (at least one token), renormalised; ``top_p = 1`` keeps all.
    Draws come from the global torch RNG, so ``torch.manual_seed`` makes them reproducible.
    """

    def __init__(self, temperature: float, top_p: float) -> None:
        if not temperature > 0:
            raise ValueError(f"temperature must be > 0 for sampling, got {temperature}")
        if not 0 < top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {top_p}")
        self.temperature, self.top_p = temperature, top_p

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        probs = torch.softmax(scores.float() / self.temperature, dim=-1)
        order = None
        if self.top_p < 1:
            probs, order = probs.sort(dim=-1, descending=True)
            # keep a token while the mass before it is below top_p (so the first is always kept)
            probs = probs.masked_fill(probs.cumsum(-1) - probs >= self.top_p, 0.0)
        token = draw(probs)
        if order is not None:
            token = order.gather(1, token)
        out = torch.full_like(scores, float("-inf"))
        return out.scatter_(1, token, 0.0)  # type: ignore[return-value]  # transformers' signature says FloatTensor, torch returns Tensor


class TextRule(Protocol):
    """What a constrained continuation may be: ``allows`` a text that can still become one,
    ``done`` when it may end here; ``alphabet`` holds every character such a text can contain."""

    alphabet: frozenset[str]

    def allows(self, text: str) -> bool: ...

    def done(self, text: str) -> bool: ...


END_MARKS = (",", "\n")  # a token that starts with one of these ends a value the way training text does


class GrammarConstraint(LogitsProcessor):
    """Masks each row's scores to the tokens its ``TextRule`` allows next; when the text so far
    may end, eos gets the log-sum of the model's end scores (eos, and tokens starting with a
    comma or line break), so the value ends as often as the model would end it. A row whose rule
    allows nothing more ends (eos); the caller's check then rejects it.

    Runs before the sampler, so temperature and top-p apply to the restricted distribution.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, rules: Sequence[TextRule], prompt_len: int) -> None:
        self.tokenizer, self.rules, self.prompt_len = tokenizer, list(rules), prompt_len
        self.pieces = token_pieces(tokenizer)
        self.ends = torch.tensor(end_tokens(tokenizer), dtype=torch.long)
        self.eos = tokenizer.eos_token_id

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        out = torch.full_like(scores, float("-inf"))
        ends = self.ends.to(scores.device)  # once per step, not once per row
        new = input_ids[:, self.prompt_len:].tolist()
        for r, (ids, rule) in enumerate(zip(new, self.rules)):
            if self.eos in ids:  # finished: transformers pads it from here
                out[r, self.eos] = 0.0
                continue
            text = cast(str, self.tokenizer.decode(ids, skip_special_tokens=True))  # one sequence: one str
            nxt = [i for i in candidates(self.tokenizer, rule.alphabet) if rule.allows(text + self.pieces[i])]
            if nxt:
                keep = torch.tensor(nxt, dtype=torch.long, device=scores.device)
                out[r, keep] = scores[r, keep]
            if rule.done(text):
                out[r, self.eos] = torch.logsumexp(scores[r, ends].float(), 0).to(scores.dtype)
            elif not nxt:
                out[r, self.eos] = 0.0
        return out  # type: ignore[return-value]  # transformers' signature says FloatTensor, torch returns Tensor


@lru_cache(maxsize=4)
def token_pieces(tokenizer: PreTrainedTokenizerBase) -> tuple[str, ...]:
    """Each token id's own text (decoded alone; ~0.2 s for SmolLM2's 49,152 once per tokenizer)."""
    return tuple(cast(str, tokenizer.decode([i])) for i in range(len(tokenizer)))  # one sequence: one str


@lru_cache(maxsize=4)
def end_tokens(tokenizer: PreTrainedTokenizerBase) -> tuple[int, ...]:
    """Token ids that end a value: eos and every token whose text starts with an ``END_MARKS``."""
    pieces = token_pieces(tokenizer)
    ends = {i for i, p in enumerate(pieces) if p.startswith(END_MARKS)}
    return tuple(sorted(ends | {tokenizer.eos_token_id}))


@lru_cache(maxsize=64)
def candidates(tokenizer: PreTrainedTokenizerBase, alphabet: frozenset[str]) -> tuple[int, ...]:
    """Token ids whose text is not empty and uses only ``alphabet``: the only ones a rule can allow."""
    special = set(tokenizer.all_special_ids)
    return tuple(i for i, p in enumerate(token_pieces(tokenizer)) if p and i not in special and set(p) <= alphabet)


def draw(probs: torch.Tensor) -> torch.Tensor:
    """One index per row of ``probs`` [n, V] (non-negative, any positive sum), drawn with
    probability proportional to its entry; returns [n, 1] long.

    Inverse CDF: the first index whose cumulative mass exceeds u * total, u ~ U[0, 1). An entry of
    0 is never drawn (its CDF step is empty).
    """
    cdf = probs.cumsum(-1)
    u = torch.rand(cdf.shape[0], 1, device=cdf.device, dtype=cdf.dtype) * cdf[:, -1:]
    return torch.searchsorted(cdf, u, right=True).clamp_(max=cdf.shape[1] - 1)


def batch_size_for(free_bytes: float, bytes_per_row: float, prompts: int, cap: int) -> int:
    """Rows per ``generate`` call: as many as ``MEMORY_SHARE`` of ``free_bytes`` holds at
    ``bytes_per_row``, at most ``cap`` and ``prompts``, at least 1."""
    fits = int(MEMORY_SHARE * free_bytes // max(bytes_per_row, 1.0))
    return max(1, min(cap, prompts, fits))


def bytes_per_row(model: PreTrainedModel, tokens: int) -> float:
    """Memory one sequence of ``tokens`` (prompt + new) takes while generating: its KV cache in the
    model's dtype plus ``SCORE_COPIES`` float32 rows of the vocabulary."""
    cfg = model.config
    layers = getattr(cfg, "num_hidden_layers", 12)
    heads = getattr(cfg, "num_attention_heads", 12)
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or getattr(cfg, "hidden_size", 768) // heads
    elem = next(model.parameters()).element_size()
    return 2 * layers * kv_heads * head_dim * tokens * elem + SCORE_COPIES * 4 * getattr(cfg, "vocab_size", 50257)


def free_memory(device: torch.device) -> float:
    """Free bytes on ``device``: CUDA's own count, else the memory the OS can give without swapping
    (psutil's ``available``, the kernel's MemAvailable on Linux)."""
    if device.type == "cuda":
        return float(torch.cuda.mem_get_info(device)[0])
    import psutil

    return float(psutil.virtual_memory().available)


def auto_batch_size(model: PreTrainedModel, prompts: int, tokens: int) -> int:
    """``batch_size_for`` on the model's device with its free memory and per-row cost."""
    device = model_device(model)
    return batch_size_for(free_memory(device), bytes_per_row(model, tokens), prompts,
                          BATCH_CAP.get(device.type, BATCH_CAP["cpu"]))


class _StepProgress(StoppingCriteria):
    """Advances a progress bar by one per decoding step; never stops anything."""

    def __init__(self, bar) -> None:
        self.bar = bar

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, **kwargs) -> torch.BoolTensor:
        self.bar.update(1)
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)  # type: ignore[return-value]  # transformers' signature says BoolTensor, torch returns Tensor


def generate_texts(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, prompts: list[str],
                   **kwargs) -> list[str]:
    """``generate_samples`` without the limit flags: one continuation per prompt, in order."""
    return [text for text, _ in generate_samples(model, tokenizer, prompts, **kwargs)]


def generate_samples(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: list[str],
    *,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    batch_size: int = 0,
    seed: int = 0,
    progress: bool = True,
    precision: str = "auto",
    rules: Sequence[TextRule] | None = None,
    guidance: float = 1.0,
    unconditional: Sequence[str] | None = None,
) -> list[tuple[str, bool]]:
    """Sample one continuation per prompt; return (text, stopped by the token limit) in the order of
    `prompts`.

    Each text is only the newly generated text (at most `max_new_tokens` tokens), decoded without
    special tokens and stripped; the flag is True when no eos ended it (it may end mid-word).
    `temperature == 0` decodes greedily; otherwise nucleus sampling with `temperature` and `top_p`
    (``InverseCdfSampler``). `batch_size` 0 = ``auto_batch_size``. The result is a deterministic
    function of (model, prompts, settings, seed, batch size); `precision` "auto" runs the model under
    bf16 autocast where the device has native bf16 (``common.devices.autocast``). The caller's global torch RNG state
    is left untouched and the model's train/eval mode is restored afterwards. ``rules`` (one per
    prompt) constrain each continuation (``GrammarConstraint``). ``guidance`` > 1 with
    ``unconditional`` (one prompt per prompt) samples under classifier-free guidance:
    two forward passes per token (``UnbatchedClassifierFreeGuidanceLogitsProcessor``).
    """
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if not prompts:
        return []
    device = model_device(model)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    # Explicit settings override the checkpoint's own generation_config (SmolLM2-Instruct ships one):
    # greedy argmax over our sampler's scores, no top-k/temperature/top-p of its own.
    # use_cache explicitly: a trainer may have switched the model config's off (trl's DPO does), and
    # sampling without the KV cache recomputes the whole prefix for every new token.
    settings = {"max_new_tokens": max_new_tokens, "pad_token_id": pad_id, "eos_token_id": tokenizer.eos_token_id,
                "use_cache": True, "do_sample": False, "temperature": None, "top_p": None, "top_k": None}
    sampler = [InverseCdfSampler(temperature, top_p)] if temperature > 0 else []
    if rules is not None and len(rules) != len(prompts):
        raise ValueError(f"{len(rules)} rules for {len(prompts)} prompts")
    guided = guidance != 1.0 and unconditional is not None
    if guided and unconditional is not None and len(unconditional) != len(prompts):
        raise ValueError(f"{len(unconditional)} unconditional prompts for {len(prompts)} prompts")
    # Batching prompts of similar length wastes less compute on padding.
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    size = batch_size or auto_batch_size(
        model, len(prompts), max(len(tokenizer(p)["input_ids"]) for p in set(prompts)) + max_new_tokens)
    batches = [order[i : i + size] for i in range(0, len(order), size)]
    outputs: list[tuple[str, bool]] = [("", False)] * len(prompts)
    was_training = model.training
    model.eval()
    bar = tqdm(total=len(batches) * max_new_tokens, desc=f"generating {len(prompts)} texts", unit="step",
               disable=not (progress and sys.stderr.isatty()), leave=False)
    try:
        rng_devices = [device.index or 0] if device.type == "cuda" else []
        with torch.random.fork_rng(devices=rng_devices), torch.inference_mode(), autocast(device, precision):
            for b, idx in enumerate(batches):
                # One seed per batch (not one stream) so a batch's samples do not depend on earlier batches.
                torch.manual_seed(int(np.random.SeedSequence([seed, b]).generate_state(1)[0]))
                enc = tokenizer([prompts[i] for i in idx], return_tensors="pt", padding=True, padding_side="left")
                enc = to_device(enc, device)
                grammar = [] if rules is None else [
                    GrammarConstraint(tokenizer, [rules[i] for i in idx], enc["input_ids"].shape[1])]
                guide = []
                if guided:
                    assert unconditional is not None  # guided needs it
                    un = to_device(tokenizer([unconditional[i] for i in idx], return_tensors="pt", padding=True,
                                             padding_side="left"), device)
                    guide = [UnbatchedClassifierFreeGuidanceLogitsProcessor(guidance, model, un["input_ids"],
                                                                            un["attention_mask"])]
                processors = LogitsProcessorList(guide + grammar + sampler)
                new = model.generate(**enc, **settings, logits_processor=processors,  # type: ignore[operator]  # PreTrainedModel.generate, typed through nn.Module's __getattr__
                                     stopping_criteria=StoppingCriteriaList([_StepProgress(bar)]))
                new = new[:, enc["input_ids"].shape[1] :]
                bar.update(max_new_tokens - new.shape[1])  # a batch that ended early
                texts = tokenizer.batch_decode(new, skip_special_tokens=True)
                eos = tokenizer.eos_token_id
                for row, i, text in zip(new, idx, texts):
                    outputs[i] = (text.strip(), eos is None or not bool((row == eos).any()))
    finally:
        bar.close()
        model.train(was_training)
    return outputs
