"""Local DP-SGD on a strong node: paper Algorithm A.3, steps 1-3.

The node receives the global trainable weights, runs ``local_steps`` DP-SGD steps on its
records (Poisson sampling at q = B/|D|, per-record clipping to C, Gaussian noise sigma*C,
Opacus' RDP accountant) and sends the trained weights back (FedAvg of weights = the
average of the local updates Delta_i). The loss is paper eq. 5: -log p(x | c) with the
control-code prompt as conditioning, averaged over a record's tokens, then over records.
"""

from __future__ import annotations

import logging
import math
import sys
import warnings
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset
from tqdm.auto import tqdm

from common.codes import code_prompt
from common.weights import trainable_state

log = logging.getLogger(__name__)

IGNORE = -100  # label value that takes no loss (prompt tokens, padding)
_KEYS = ("input_ids", "attention_mask", "labels", "position_ids")
OPTIMIZERS = ("adamw", "sgd")


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


@dataclass
class TrainSettings:
    """Hyper-parameters of one round of local training on one node."""

    local_steps: int  # tau: optimizer steps per round
    batch_size: int  # B: expected (Poisson) batch size; q = B / |D|
    learning_rate: float
    max_length: int
    max_grad_norm: float  # C: per-record clipping norm
    noise_multiplier: float  # sigma: noise std = sigma * C on the summed clipped gradients
    private: bool = True  # False: plain training, epsilon = inf
    seed: int = 0
    optimizer: str = "adamw"  # "adamw" or "sgd" (paper A.3's literal update)
    # Seed the DP noise and the Poisson sampling from `seed` (and the steps already taken)
    # instead of the OS. Reproducible, but NOT private against anyone who knows the seed:
    # they can recompute and subtract the noise. For tests and experiments only.
    reproducible_noise: bool = False

    def __post_init__(self) -> None:
        if self.local_steps < 1 or self.batch_size < 1:
            raise ValueError(f"local_steps and batch_size must be >= 1, got {self.local_steps}, {self.batch_size}")
        if not self.learning_rate > 0 or not self.max_grad_norm > 0:
            raise ValueError(f"learning_rate and max_grad_norm must be > 0, got {self.learning_rate}, {self.max_grad_norm}")
        if self.noise_multiplier < 0 or (self.private and self.noise_multiplier == 0):
            raise ValueError(f"noise_multiplier must be > 0 when private (>= 0 otherwise), got {self.noise_multiplier}")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {self.optimizer!r}")


@dataclass
class TrainResult:
    """What one round of local training produced (``state`` goes up as an ArrayRecord)."""

    state: dict[str, np.ndarray]
    num_examples: int
    mean_loss: float  # over the steps with a non-empty batch (nan if none)
    losses: list[float]  # per step; nan for an empty Poisson batch (a noise-only step)
    steps: int
    sample_rate: float
    noise_multiplier: float
    accountant_history: list[list] = field(default_factory=list)  # [[sigma, q, steps], ...]
    epsilon: float = math.inf  # RDP epsilon over the whole history at delta; inf if not private


def dp_train(model, tokenizer, texts: list[str], codes: list[str], settings: TrainSettings,
             delta: float, accountant_history: list) -> TrainResult:
    """Run ``settings.local_steps`` local steps on (texts, codes); train ``model`` in place.

    Private: Opacus DP-SGD with Poisson sampling at q = B/|D|; the node's previous
    ``accountant_history`` (Opacus RDPAccountant format) is restored first so the returned
    ``epsilon`` covers every round so far. Not private: same loss and steps on uniform
    batches of B records, no clipping or noise, history returned unchanged.
    """
    n = len(texts)
    if n == 0:
        raise ValueError("no training records on this node")
    if len(codes) != n:
        raise ValueError(f"got {n} texts but {len(codes)} codes")
    batch = settings.batch_size
    if batch > n:
        warnings.warn(f"batch_size {batch} > {n} local records: using the whole dataset per step (q = 1)", stacklevel=2)
        batch = n
    sample_rate = batch / n
    history = _check_history(accountant_history)
    torch.manual_seed(settings.seed)
    enc = encode_examples(tokenizer, texts, codes, settings.max_length)
    dataset = TensorDataset(*(enc[k] for k in _KEYS))
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError("the model has no trainable parameters (call common.weights.prepare_model first)")
    generator = torch.Generator()
    if settings.reproducible_noise or not settings.private:
        prior = sum(int(h[2]) for h in history)  # a different stream in every round
        generator.manual_seed(int(np.random.SeedSequence([settings.seed, prior]).generate_state(1)[0]))
    else:
        generator.seed()  # OS entropy: noise and sampling must be unpredictable
    # AdamW (weight decay 0), not SGD, by default: the paper's learning rates (5e-4 for
    # DP GPT-2, 1e-3 for LoRA LLaMA) are Adam-scale, following Yue et al. 2022 /
    # dp-transformers; Adam's per-coordinate scaling lets one lr serve LoRA and full
    # finetuning and different noise levels. It only post-processes the privatised
    # gradient, so the DP guarantee is unchanged. Its moments restart every round (the
    # node gets new global weights). "sgd" is paper A.3's literal step.
    if settings.optimizer == "adamw":
        optimizer = torch.optim.AdamW(params, lr=settings.learning_rate, weight_decay=0.0)
    else:
        optimizer = torch.optim.SGD(params, lr=settings.learning_rate)
    model.train()
    if settings.private:
        losses, history = _private_steps(model, optimizer, dataset, batch, sample_rate, settings, history, generator)
        epsilon = _epsilon(history, delta)
    else:
        losses = _plain_steps(model, optimizer, dataset, batch, settings, generator)
        epsilon = math.inf
    model.zero_grad(set_to_none=True)
    done = [x for x in losses if not math.isnan(x)]
    return TrainResult(
        state=trainable_state(model), num_examples=n, mean_loss=float(np.mean(done)) if done else math.nan,
        losses=losses, steps=settings.local_steps, sample_rate=sample_rate,
        noise_multiplier=settings.noise_multiplier if settings.private else 0.0,
        accountant_history=[list(h) for h in history], epsilon=epsilon,
    )


def _private_steps(model, optimizer, dataset, batch, sample_rate, settings, history, generator):
    from opacus import PrivacyEngine
    from opacus.data_loader import DPDataLoader

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Secure RNG turned off")
        engine = PrivacyEngine(accountant="rdp", secure_mode=False)
    engine.accountant.history = [tuple(h) for h in history]  # epsilon accumulates over rounds
    # Layers without an Opacus grad sampler (GPT-2's Conv1D and Llama's RMSNorm under full
    # finetuning) fall back to functorch per-sample gradients automatically in "hooks" mode;
    # frozen layers (the base model under LoRA) get no hooks at all.
    gsm, dp_optimizer, _ = engine.make_private(
        module=model, optimizer=optimizer,
        data_loader=DataLoader(dataset, batch_size=batch, generator=generator),
        noise_multiplier=settings.noise_multiplier, max_grad_norm=settings.max_grad_norm,
        poisson_sampling=True, noise_generator=generator,
    )
    # make_private derives q = 1/len(loader) = 1/ceil(|D|/B), which is not B/|D| unless B
    # divides |D|. Sample, average and account at exactly q = B/|D| instead.
    loader = DPDataLoader(dataset, sample_rate=sample_rate, generator=generator)
    dp_optimizer.expected_batch_size = batch
    dp_optimizer.attach_step_hook(engine.accountant.get_optimizer_hook_fn(sample_rate=sample_rate))
    losses = []
    try:
        batches = iter(loader)
        for step in _progress(settings.local_steps, "DP-SGD"):
            try:
                tensors = next(batches)
            except StopIteration:
                batches = iter(loader)
                tensors = next(batches)
            dp_optimizer.zero_grad(set_to_none=True)
            if tensors[0].shape[0] == 0:
                # An empty Poisson batch is still a step: the optimizer releases noise
                # only (sum of zero clipped gradients + N(0, sigma^2 C^2)) and the accountant
                # counts it, as Opacus' empty-batch handling intends. The model is not run.
                for p in dp_optimizer.params:
                    p.grad_sample = p.new_zeros((0, *p.shape))
                losses.append(math.nan)
            else:
                tensors = _trim(tensors)
                loss = conditional_lm_loss(_forward(gsm, tensors), tensors[2])
                loss.backward()
                losses.append(float(loss.detach()))
            dp_optimizer.step()
            _log_step(step, settings.local_steps, losses[-1], int(tensors[0].shape[0]))
    finally:
        gsm.to_standard_module()  # remove hooks and grad-sample attributes; `model` is usable again
    return losses, [tuple(h) for h in engine.accountant.history]


def _plain_steps(model, optimizer, dataset, batch, settings, generator):
    losses = []
    for step in _progress(settings.local_steps, "SGD (non-private)"):
        idx = torch.randperm(len(dataset), generator=generator)[:batch]
        tensors = _trim(dataset[idx])
        optimizer.zero_grad(set_to_none=True)
        loss = conditional_lm_loss(_forward(model, tensors), tensors[2])
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
        _log_step(step, settings.local_steps, losses[-1], batch)
    return losses


def _trim(tensors):
    """Drop padding columns beyond the longest record of the batch (right padding: exact)."""
    width = max(int(tensors[1].sum(dim=1).max()), 1)
    return [t[:, :width] for t in tensors]


def _forward(model, tensors) -> torch.Tensor:
    input_ids, attention_mask, _, position_ids = tensors
    out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False)
    return out.logits


def _progress(steps: int, desc: str):
    return tqdm(range(steps), desc=desc, disable=not sys.stderr.isatty(), leave=False)


def _log_step(step: int, steps: int, loss: float, size: int) -> None:
    log.debug("local step %d/%d: batch %d, loss %.4f", step + 1, steps, size, loss)


def _check_history(history) -> list[tuple]:
    out = []
    for h in history or []:
        if len(h) != 3:
            raise ValueError(f"accountant history entries are [noise_multiplier, sample_rate, steps], got {h!r}")
        out.append((float(h[0]), float(h[1]), int(h[2])))
    return out


def _epsilon(history: list[tuple], delta: float) -> float:
    from opacus.accountants import RDPAccountant

    accountant = RDPAccountant()
    accountant.history = list(history)
    return float(accountant.get_epsilon(delta=delta))
