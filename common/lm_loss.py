"""The conditional LM loss both sides use: paper eq. 5, -log p(x | c), per record.

Nodes train with it (``fedsyn_client.training``) and the server scores held-out text with
it (``fedsyn_server.synthesis``); the encoding and the loss live here once so both sides
read a record the same way.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from common.codes import code_prompt

IGNORE = -100  # label value that takes no loss (prompt tokens, padding)


def encode_examples(tokenizer, texts: list[str], codes: list[str], max_length: int) -> dict[str, torch.Tensor]:
    """Tokenise ``code_prompt(code) + text + eos`` per record, right-padded to the longest.

    Returns ``input_ids``, ``attention_mask``, ``labels`` and ``position_ids`` (long tensors,
    shape [n, width], width <= max_length). The prompt is tokenised on its own exactly as
    generation tokenises it (so the model learns to continue the very token sequence it
    will be prompted with); the text follows with no special tokens, then eos. Sequences
    are cut at ``max_length`` (the eos may be cut). ``labels`` are the input ids (not
    shifted: ``conditional_lm_loss`` shifts) with ``-100`` on prompt tokens and padding.
    """
    if len(texts) != len(codes):
        raise ValueError(f"got {len(texts)} texts but {len(codes)} codes")
    if max_length < 2:
        raise ValueError(f"max_length must be >= 2, got {max_length}")
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos if eos is not None else 0)
    rows = []
    for text, code in zip(texts, codes):
        prompt = list(tokenizer(code_prompt(code))["input_ids"])
        body = list(tokenizer(text, add_special_tokens=False)["input_ids"]) + ([eos] if eos is not None else [])
        ids = (prompt + body)[:max_length]
        rows.append((ids, min(len(prompt), len(ids))))
    width = max([len(ids) for ids, _ in rows] + [1])
    n = len(rows)
    input_ids = torch.full((n, width), pad, dtype=torch.long)
    attention_mask = torch.zeros((n, width), dtype=torch.long)
    labels = torch.full((n, width), IGNORE, dtype=torch.long)
    for i, (ids, n_prompt) in enumerate(rows):
        input_ids[i, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        attention_mask[i, : len(ids)] = 1
        labels[i, n_prompt : len(ids)] = input_ids[i, n_prompt : len(ids)]
    position_ids = torch.arange(width, dtype=torch.long).expand(n, width).clone()
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels, "position_ids": position_ids}


def conditional_lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean over records of each record's mean next-token NLL on its label positions.

    ``logits`` [n, L, V] at position t predict ``labels`` [n, L] at t+1 (HF convention,
    labels unshifted). A record's term depends only on that record, whatever the lengths of
    the others in the batch (DESIGN "Privacy model"); a record with no label token adds 0.
    """
    logits = logits[:, :-1].float()
    target = labels[:, 1:]
    nll = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1), ignore_index=IGNORE, reduction="none")
    nll = nll.view(target.shape)
    count = (target != IGNORE).sum(dim=1).clamp(min=1)
    return (nll.sum(dim=1) / count).mean()
