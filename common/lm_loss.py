"""The conditional LM loss both sides use: paper eq. 5, -log p(x | c), per record.

Nodes train with it (``fedsyn_client.training``) and the server scores held-out text with
it (``fedsyn_server.synthesis``); the encoding and the loss live here once so both sides
read a record the same way.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from common.codes import code_prompt

IGNORE = -100  # label value that takes no loss (prompt tokens, padding)


def encode_examples(tokenizer, texts: list[str], codes: list[str], max_length: int,
                    prompt: Callable[[str], str] = code_prompt, pad_to: int | None = None) -> dict[str, torch.Tensor]:
    """Tokenise ``prompt(code) + text + eos`` per record, right-padded to the longest, or to
    ``pad_to`` (a public width, so the shape says nothing about the records' lengths)
    (``prompt``: ``common.codes.make_prompt`` of the run; the paper's bare code by default).

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
        prompt_ids = list(tokenizer(prompt(code))["input_ids"])
        body = list(tokenizer(text, add_special_tokens=False)["input_ids"]) + ([eos] if eos is not None else [])
        ids = (prompt_ids + body)[:max_length]
        rows.append((ids, min(len(prompt_ids), len(ids))))
    width = pad_to if pad_to is not None else max([len(ids) for ids, _ in rows] + [1])
    if pad_to is not None and pad_to < max_length:
        raise ValueError(f"pad_to = {pad_to} is below max_length = {max_length}: a row would not fit")
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
    return sequence_nll(logits, labels)[0].mean()


# --------------------------------------------------------------------- the loss without full logits
# The output layer of a small LM is much of its cost: SmolLM2's 49,152 x 576 head on B x L = 32 x 64
# positions is a 100M-entry fp32 logits tensor, copied, log-softmaxed, and a same-size gradient, plus
# a zero-filled copy for the shift's slice: 20% of a LoRA DP-SGD step on 2 CPU cores (profiled,
# benchmarks/README.md). When the head is frozen (LoRA), only the gradient to the hidden states is
# needed, so the head, the softmax and that gradient are computed together, a chunk of label
# positions at a time, and only the [positions, hidden] gradient is kept (what Liger's fused linear
# cross-entropy does on GPUs; written here because none ships for the CPU).
FUSED_MODEL_TYPES = frozenset({"llama", "gpt2", "mistral", "qwen2", "qwen3"})  # logits = hidden @ W^T, nothing after
CHUNK_ROWS = 1024  # label positions per chunk: 1024 x 49,152 fp32 = 200 MB at a time


class _FusedHeadNll(torch.autograd.Function):
    """sum_i w_i * NLL(softmax(h_i W^T), y_i) with dL/dh computed in the forward, chunk by chunk."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, row_weights):  # noqa: D102 - torch.autograd.Function's
        total = hidden.new_zeros((), dtype=torch.float32)
        grad = torch.empty_like(hidden, dtype=torch.float32)
        # The two matmuls run in whatever precision an enclosing autocast asks for; the softmax
        # and the sums always in fp32.
        for s in range(0, hidden.shape[0], CHUNK_ROWS):
            logits = (hidden[s : s + CHUNK_ROWS] @ weight.T).float()
            y, rw = targets[s : s + CHUNK_ROWS], row_weights[s : s + CHUNK_ROWS]
            rows = torch.arange(len(y), device=y.device)
            top = logits.max(dim=-1, keepdim=True).values
            picked = logits[rows, y] - top.squeeze(1)
            # one pass each: shift, exp, sum, scale; the logits' memory becomes w_i * softmax
            norm = logits.sub_(top).exp_().sum(dim=-1)
            total += ((norm.log() - picked) * rw).sum()
            probs = logits.mul_((rw / norm)[:, None])
            probs[rows, y] -= rw  # w_i * (softmax - onehot) = w_i * d(nll)/d(logits)
            grad[s : s + CHUNK_ROWS] = probs.to(weight.dtype) @ weight
        ctx.save_for_backward(grad)
        ctx.hidden_dtype = hidden.dtype
        return total

    @staticmethod
    def backward(ctx, grad_output):  # noqa: D102 - torch.autograd.Function's
        (grad,) = ctx.saved_tensors
        return (grad * grad_output).to(ctx.hidden_dtype), None, None, None


def head_and_decoder(model) -> tuple[torch.nn.Module, torch.nn.Module] | None:
    """(the decoder that yields the last hidden state, the output layer) of a causal LM whose
    logits are just ``hidden @ W^T`` and whose output layer is frozen and has no bias; else None.

    Sees through Opacus' ``GradSampleModule`` (``_module``) and a peft model: their hooks sit on
    the inner layers, so calling the decoder directly keeps per-sample gradients.
    """
    inner = model
    while hasattr(inner, "_module"):
        inner = inner._module
    if hasattr(inner, "get_base_model"):
        inner = inner.get_base_model()
    head = inner.get_output_embeddings() if hasattr(inner, "get_output_embeddings") else None
    if (head is None or getattr(inner.config, "model_type", None) not in FUSED_MODEL_TYPES
            or getattr(head, "bias", None) is not None or head.weight.requires_grad):
        return None
    return inner.base_model, head


def fused_conditional_lm_loss(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """``conditional_lm_loss(hidden @ weight.T, labels)`` without the full logits.

    ``hidden`` [n, L, d] (the decoder's last hidden state), ``weight`` [V, d] (a frozen output
    layer: no gradient reaches it), ``labels`` [n, L] unshifted. Only positions whose next label
    counts are gathered; each carries 1 / (its record's label count x n), so a record's term
    depends only on that record, as in ``conditional_lm_loss``.
    """
    n = labels.shape[0]
    return fused_weighted_nll(hidden, weight, labels, torch.full((n,), 1.0 / max(n, 1), device=hidden.device))


# --------------------------------------------------------------------- a contrastive phase-1 objective
# The paper's loss (eq. 5) teaches the style of the records; under DP noise at this scale it does not
# keep the code conditioning (docs/results.md, issue 33: label fidelity falls). This objective adds a
# term that only the conditioning can lower: each record is read under its own code c and under one
# other code c', and -log sigmoid(log p(x|c) - log p(x|c')) is the record's loss of the Bayes
# classifier p(c | x) over {c, c'} with a uniform prior. A record is the pair of rows; its gradient is
# the sum of the rows' (fedsyn_client.training groups them before clipping), so a record still moves
# the sum by at most C.
def pair_objective(nll: torch.Tensor, count: torch.Tensor, weight: float) -> torch.Tensor:
    """Mean over records of ``nll[i, 0] + weight * softplus(count[i] * (nll[i, 0] - nll[i, 1]))``.

    ``nll`` [n, 2]: each record's mean token NLL under its own code (column 0) and under another
    code (column 1); ``count`` [n]: its number of text tokens under its own code, so that
    ``count * nll`` is -log p(x | c). ``weight`` 0 gives the paper's loss. A record's term depends on
    its own two rows only.
    """
    if nll.ndim != 2 or nll.shape[1] != 2:
        raise ValueError(f"nll must have shape [n, 2], got {list(nll.shape)}")
    margin = count.to(nll.dtype) * (nll[:, 0] - nll[:, 1])
    return (nll[:, 0] + weight * F.softplus(margin)).mean()


def sequence_nll(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(each row's mean next-token NLL on its label positions [n], its label count [n]) from
    ``logits`` [n, L, V] and unshifted ``labels`` [n, L]; a row with no label token has NLL 0."""
    logits = logits[:, :-1].float()
    target = labels[:, 1:]
    nll = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1), ignore_index=IGNORE,
                          reduction="none")
    count = (target != IGNORE).sum(dim=1)
    return nll.view(target.shape).sum(dim=1) / count.clamp(min=1), count


@torch.no_grad()
def fused_sequence_nll(hidden: torch.Tensor, weight: torch.Tensor,
                       labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``sequence_nll(hidden @ weight.T, labels)`` without the full logits, and without a gradient
    (the values that set ``fused_weighted_nll``'s row weights)."""
    target = labels[:, 1:]
    keep = target != IGNORE
    count = keep.sum(dim=1)
    h, y = hidden[:, :-1][keep], target[keep]
    nll = torch.empty(len(y), dtype=torch.float32, device=hidden.device)
    for s in range(0, len(y), CHUNK_ROWS):
        logits = (h[s : s + CHUNK_ROWS] @ weight.T).float()
        nll[s : s + CHUNK_ROWS] = (torch.logsumexp(logits, dim=-1)
                                   - logits.gather(1, y[s : s + CHUNK_ROWS, None]).squeeze(1))
    rows = torch.arange(labels.shape[0], device=labels.device)[:, None].expand_as(target)[keep]
    total = torch.zeros(labels.shape[0], dtype=torch.float32, device=hidden.device).index_add_(0, rows, nll)
    return total / count.clamp(min=1), count


def fused_weighted_nll(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                       row_weights: torch.Tensor) -> torch.Tensor:
    """sum_i ``row_weights[i]`` x (row i's mean token NLL), without the full logits (``weight``
    frozen). With ``row_weights`` = d objective / d NLL from ``fused_sequence_nll``'s values, its
    gradient is the objective's: how a non-linear objective of per-row NLLs uses the fused head."""
    target = labels[:, 1:]
    keep = target != IGNORE
    count = keep.sum(dim=1).clamp(min=1)
    per_position = (row_weights.float() / count)[:, None].expand_as(target)[keep]
    return _FusedHeadNll.apply(hidden[:, :-1][keep], weight.detach(), target[keep], per_position)
