"""Batched, seeded sampling of continuations from a causal LM (GPT-2, Llama/SmolLM2, PEFT-wrapped)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch
from tqdm.auto import tqdm

from common.devices import model_device, to_device

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase


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
    batch_size: int = 16,
    seed: int = 0,
    progress: bool = True,
) -> list[tuple[str, bool]]:
    """Sample one continuation per prompt; return (text, stopped by the token limit) in the order of
    `prompts`.

    Each text is only the newly generated text (at most `max_new_tokens` tokens), decoded without
    special tokens and stripped; the flag is True when no eos ended it (it may end mid-word). `temperature == 0` decodes greedily; otherwise nucleus sampling with
    `temperature` and `top_p`. The result is a deterministic function of (model, prompts, settings,
    seed); the caller's global torch RNG state is left untouched and the model's train/eval mode
    is restored afterwards.
    """
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if not prompts:
        return []
    device = model_device(model)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    # Explicit settings override the checkpoint's own generation_config (SmolLM2-Instruct ships one);
    # top_k=0 turns off transformers' default top-k=50 so sampling is plain temperature/top-p.
    # use_cache explicitly: a trainer may have switched the model config's off (trl's DPO does), and
    # sampling without the KV cache recomputes the whole prefix for every new token.
    settings = {"max_new_tokens": max_new_tokens, "pad_token_id": pad_id, "eos_token_id": tokenizer.eos_token_id,
                "use_cache": True}
    if temperature > 0:
        settings |= {"do_sample": True, "temperature": temperature, "top_p": top_p, "top_k": 0}
    else:
        settings |= {"do_sample": False}
    # Batching prompts of similar length wastes less compute on padding.
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    batches = [order[i : i + batch_size] for i in range(0, len(order), batch_size)]
    outputs: list[tuple[str, bool]] = [("", False)] * len(prompts)
    was_training = model.training
    model.eval()
    try:
        rng_devices = [device.index or 0] if device.type == "cuda" else []
        with torch.random.fork_rng(devices=rng_devices), torch.inference_mode():
            for b, idx in enumerate(tqdm(batches, desc="generating", unit="batch", disable=not progress)):
                # One seed per batch (not one stream) so a batch's samples do not depend on earlier batches.
                torch.manual_seed(int(np.random.SeedSequence([seed, b]).generate_state(1)[0]))
                enc = tokenizer([prompts[i] for i in idx], return_tensors="pt", padding=True, padding_side="left")
                enc = to_device(enc, device)
                new = model.generate(**enc, **settings)[:, enc["input_ids"].shape[1] :]
                texts = tokenizer.batch_decode(new, skip_special_tokens=True)
                eos = tokenizer.eos_token_id
                for row, i, text in zip(new, idx, texts):
                    outputs[i] = (text.strip(), eos is None or not bool((row == eos).any()))
    finally:
        model.train(was_training)
    return outputs
