"""The trainable weights that travel between server and nodes in phase 1.

Server and nodes call ``prepare_model`` with the same (finetune, rank, seed) so they hold
identical structures; only the trainable tensors (a LoRA adapter, or the whole model) go
into a Flower ``ArrayRecord`` as ``trainable_state`` and come back via ``load_trainable_state``.
"""

from __future__ import annotations

import warnings

import numpy as np
import torch

from common.plugins import FINETUNE_MODES

_WRAPPER_PREFIX = "_module."  # Opacus' GradSampleModule wraps the model as `_module`


def prepare_model(model, finetune: str, lora_rank: int, seed: int = 0, lora_layers: int = 0):
    """Make ``model`` ready for phase-1 finetuning and return it.

    ``"lora"``: wrap with a peft LoRA adapter (r=lora_rank, alpha=2r, no dropout, peft's
    default target modules for the architecture: ``c_attn`` for GPT-2, ``q_proj``/``v_proj``
    for Llama); the adapter init is seeded, so every party building it from the same
    base model and seed gets the same tensors; only adapter weights are trainable.
    ``lora_layers`` = N > 0 puts the adapter on the top N transformer blocks only: fewer noised
    coordinates per DP step, and the backward pass stops at the lowest adapted block (nothing
    below it needs a gradient), so fewer FLOPs per token.
    ``"full"``: every parameter is trainable. GPT-2 and SmolLM2 tie the input embedding to
    the output layer: that is one ``Parameter`` (``named_parameters`` lists it once), and
    Opacus sums the per-sample gradients of both uses into one per-sample gradient before
    clipping, so the record's whole gradient is clipped as one vector.
    """
    if finetune == "full":
        for p in model.parameters():
            p.requires_grad_(True)
        return model
    if finetune != "lora":
        raise ValueError(f"finetune must be one of {FINETUNE_MODES}, got {finetune!r}")
    if lora_rank < 1:
        raise ValueError(f"lora-rank must be >= 1, got {lora_rank}")
    from peft import LoraConfig, get_peft_model
    from transformers.pytorch_utils import Conv1D

    blocks = int(getattr(model.config, "num_hidden_layers", 0) or getattr(model.config, "n_layer", 0))
    if lora_layers and not 0 < lora_layers <= blocks:
        raise ValueError(f"lora-layers = {lora_layers}: the model has {blocks} transformer blocks")
    top = list(range(blocks - lora_layers, blocks)) if lora_layers and lora_layers < blocks else None
    config = LoraConfig(
        r=lora_rank, lora_alpha=2 * lora_rank, lora_dropout=0.0, task_type="CAUSAL_LM", layers_to_transform=top,
        # GPT-2's projections are Conv1D (weights stored transposed); peft would otherwise
        # flip this itself with a warning.
        fan_in_fan_out=any(isinstance(m, Conv1D) for m in model.modules()),
    )
    with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
        # peft 0.21 reads a property transformers 5 deprecated; nothing to act on.
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated")
        torch.manual_seed(seed)
        return get_peft_model(model, config)


def _stable_name(name: str) -> str:
    while name.startswith(_WRAPPER_PREFIX):
        name = name[len(_WRAPPER_PREFIX):]
    return name


def _trainable_params(model) -> dict[str, torch.nn.Parameter]:
    return {_stable_name(n): p for n, p in model.named_parameters() if p.requires_grad}


def trainable_state(model) -> dict[str, np.ndarray]:
    """Name -> float32 numpy copy of every trainable parameter, keys sorted.

    Names are independent of Opacus wrapping (``_module.`` prefixes stripped).
    """
    params = _trainable_params(model)
    return {n: params[n].detach().to("cpu", torch.float32).numpy().copy() for n in sorted(params)}


def load_trainable_state(model, state: dict[str, np.ndarray]) -> None:
    """Copy ``state`` into the model's trainable parameters (in place).

    Raises ValueError naming missing/unexpected keys and shape mismatches, e.g. when the
    server and a node were configured with different models or finetune modes.
    """
    params = _trainable_params(model)
    missing = sorted(set(params) - set(state))
    unexpected = sorted(set(state) - set(params))
    mismatched = [
        f"{n}: model {tuple(params[n].shape)} vs state {tuple(np.shape(state[n]))}"
        for n in sorted(set(params) & set(state)) if tuple(params[n].shape) != tuple(np.shape(state[n]))
    ]
    if missing or unexpected or mismatched:
        raise ValueError(
            "trainable state does not match the model: "
            f"missing={missing[:10]}{'...' if len(missing) > 10 else ''} ({len(missing)}), "
            f"unexpected={unexpected[:10]}{'...' if len(unexpected) > 10 else ''} ({len(unexpected)}), "
            f"shape mismatches={mismatched[:10]}"
        )
    with torch.no_grad():
        for n, p in params.items():
            p.copy_(torch.as_tensor(np.asarray(state[n]), dtype=p.dtype, device=p.device))


def without_idle_adapter(model):
    """A context in which ``model`` runs without its LoRA adapter when the adapter adds nothing
    (every ``lora_B`` weight exactly zero, as PEFT initialises it: theta^0): the same outputs bit for
    bit, without the adapter's extra products in every layer (about a tenth of generation's time
    with rank 2 on 2 CPU cores). Any other model, or an adapter that moved: a no-op context."""
    import contextlib

    lora_b = [p for n, p in model.named_parameters() if "lora_B" in n]
    if not lora_b or not hasattr(model, "disable_adapter") or any(bool(p.detach().any()) for p in lora_b):
        return contextlib.nullcontext()
    return model.disable_adapter()
