"""Local DP-SGD on a strong node: paper Algorithm A.3, steps 1-3.

The node receives the global trainable weights, runs ``local_steps`` DP-SGD steps on its
records (Poisson sampling at a rate q fixed for the whole phase, per-record clipping to C,
Gaussian noise sigma*C, Opacus' RDP accountant) and sends the trained weights back (FedAvg of
weights = the average of the local updates Delta_i). The step is defined for every dataset,
the empty one included: nothing divides by |D| (the noisy sum is divided by the public B), and
an empty Poisson batch is a step that releases noise only. The loss is paper eq. 5: -log p(x | c) with the
control-code prompt as conditioning, averaged over a record's tokens, then over records; with
``contrastive_weight`` > 0 each record is also read under one other code of the vocabulary and the
loss adds the pair term of ``common.lm_loss.pair_objective`` (a record is then two rows whose
per-sample gradients are summed before clipping).
"""

from __future__ import annotations

import math
import sys
import warnings
from dataclasses import dataclass, field

import numpy as np
import torch
from torch.utils.data import DataLoader, TensorDataset
from tqdm.auto import tqdm

from common.codes import make_prompt
from common.config import PRECISIONS
from common.devices import autocast, to_device
from common.dp import dpsgd_epsilon, poisson_sample_rate
from common.lm_loss import (
    conditional_lm_loss,
    encode_examples,
    fused_conditional_lm_loss,
    fused_sequence_nll,
    fused_weighted_nll,
    head_and_decoder,
    pair_objective,
    sequence_nll,
)
from common.logs import get_logger
from common.weights import trainable_state
from fedsyn_client import fixed_work

log = get_logger(__name__)

_KEYS = ("input_ids", "attention_mask", "labels", "position_ids")
OPTIMIZERS = ("adamw", "sgd")


@dataclass
class TrainSettings:
    """Hyper-parameters of one round of local training on one node."""

    local_steps: int  # tau: optimizer steps per round
    batch_size: int  # B: expected (Poisson) batch size; the noisy sum is divided by B
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
    # "auto": bf16 autocast for forward and backward where the device has native bf16
    # (common.devices.native_bf16); per-sample gradients are upcast to fp32 before clipping, so
    # clipping and noise are exactly as in fp32. "fp32": never.
    precision: str = "auto"
    # q: the Poisson sampling rate. None: min(1, B/|D|) of this call's records (a first round);
    # later rounds of a phase pass the first round's, so that no round's q (hence its epsilon,
    # hence whether it fits the reservation) depends on the view it happens to get.
    sample_rate: float | None = None
    # the prompt each record is trained under (common.codes.make_prompt): what generation will use
    prompt: str = "code"
    template: str = ""
    # > 0: add the pair term (common.lm_loss.pair_objective) against one other code of `vocabulary`
    # per record and round; 0: the paper's loss alone. Each record then costs two rows of compute.
    contrastive_weight: float = 0.0
    vocabulary: tuple[str, ...] = ()
    # The node's public size bound (policy max-records): private steps Poisson-sample this many
    # slots, the ones beyond the records being padding rows that count for nothing, and every row
    # is encoded at the public width max_length, so a step's work is a function of public inputs
    # only. None: the call's own record count (benchmarks, simulation's partitions).
    records_bound: int | None = None

    def __post_init__(self) -> None:
        if self.local_steps < 1 or self.batch_size < 1:
            raise ValueError(f"local_steps and batch_size must be >= 1, got {self.local_steps}, {self.batch_size}")
        if not self.learning_rate > 0 or not self.max_grad_norm > 0:
            raise ValueError(f"learning_rate and max_grad_norm must be > 0, "
                             f"got {self.learning_rate}, {self.max_grad_norm}")
        if self.noise_multiplier < 0 or (self.private and self.noise_multiplier == 0):
            raise ValueError(f"noise_multiplier must be > 0 when private (>= 0 otherwise), got {self.noise_multiplier}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {self.precision!r}")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {self.optimizer!r}")
        if self.sample_rate is not None and not 0 < self.sample_rate <= 1:
            raise ValueError(f"sample_rate must be in (0, 1], got {self.sample_rate}")
        if not 0 <= self.contrastive_weight < math.inf:
            raise ValueError(f"contrastive_weight must be a finite float >= 0, got {self.contrastive_weight}")
        if self.records_bound is not None and self.records_bound < 1:
            raise ValueError(f"records_bound must be >= 1, got {self.records_bound}")


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
    """Run ``settings.local_steps`` local steps on (texts, codes), training ``model`` in place.

    ``model`` comes from ``common.weights.prepare_model`` (only its trainable parameters
    move). Private: Opacus DP-SGD with Poisson sampling at ``sample_rate(settings, |D|)``; the
    node's previous ``accountant_history`` (Opacus RDPAccountant format) is restored first so
    the returned ``epsilon`` (at ``delta``) covers every round so far. Defined for every
    dataset: with no record every step releases noise only. Not private: the same loss and
    number of steps on uniform batches of B records, no clipping or noise, history unchanged.
    Returns the trained ``trainable_state`` with the losses and the privacy spent.
    """
    n = len(texts)
    if len(codes) != n:
        raise ValueError(f"got {n} texts but {len(codes)} codes")
    bound = n if settings.records_bound is None else settings.records_bound
    if n > bound:
        raise ValueError(f"{n} records above the bound records_bound = {bound} (fedsyn_client.view cuts a view to it)")
    batch, q = settings.batch_size, sample_rate(settings, bound)
    if settings.sample_rate is None and batch > bound:
        warnings.warn(f"batch_size {batch} > {bound} records: every step samples all of them (q = 1)", stacklevel=2)
    history = _check_history(accountant_history)
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError("the model has no trainable parameters (call common.weights.prepare_model first)")
    torch.manual_seed(settings.seed)
    sampler_rng, noise_rng = _generators(settings, prior_steps=sum(h[2] for h in history), device=params[0].device)
    # AdamW (weight decay 0) by default, not SGD: the paper's learning rates (5e-4 for DP
    # GPT-2, 1e-3 for LoRA LLaMA) are Adam-scale, following Yue et al. 2022 / dp-transformers;
    # Adam's per-coordinate scaling lets one lr serve LoRA and full finetuning at any noise
    # level. It only post-processes the privatised gradient, so the DP guarantee holds. Its
    # moments restart every round (the node starts from new global weights). "sgd" is
    # paper A.3's literal step (e).
    optimizer: torch.optim.Optimizer
    if settings.optimizer == "adamw":
        optimizer = torch.optim.AdamW(params, lr=settings.learning_rate, weight_decay=0.0)
    else:
        optimizer = torch.optim.SGD(params, lr=settings.learning_rate)
    was_training = model.training
    model.train()
    try:
        if settings.private:
            slots = Slots(tokenizer, texts, codes, settings, bound, sampler_rng)
            losses, history = _private_steps(model, optimizer, slots, q, settings, history, sampler_rng, noise_rng)
        else:
            dataset = _encode(tokenizer, texts, codes, settings, sampler_rng)
            losses = _plain_steps(model, optimizer, dataset, min(batch, n), settings, sampler_rng)
    finally:
        model.train(was_training)
        model.zero_grad(set_to_none=True)
    done = [x for x in losses if not math.isnan(x)]
    return TrainResult(
        state=trainable_state(model), num_examples=n, mean_loss=float(np.mean(done)) if done else math.nan,
        losses=losses, steps=settings.local_steps, sample_rate=q,
        noise_multiplier=settings.noise_multiplier if settings.private else 0.0,
        accountant_history=[list(h) for h in history],
        epsilon=dpsgd_epsilon(history, delta) if settings.private else math.inf,
    )


def pairs_on(settings: TrainSettings) -> bool:
    """Whether the round trains on pairs: a contrastive weight > 0 and a second code to contrast with."""
    return settings.contrastive_weight > 0 and len(set(settings.vocabulary)) >= 2


def _other_codes(codes: list[str], settings: TrainSettings, generator) -> list[str]:
    """For each record, one other code of the vocabulary, uniformly (its pair's second reading)."""
    vocabulary = sorted(set(settings.vocabulary))
    where = {v: i for i, v in enumerate(vocabulary)}
    draws = torch.randint(0, len(vocabulary) - 1, (len(codes),), generator=generator).tolist()
    # k-th of the vocabulary without the record's own code: O(1) a record, whatever the vocabulary's size
    return [vocabulary[k + (k >= where.get(code, len(vocabulary)))] for code, k in zip(codes, draws)]


def _encode_rows(tokenizer, texts: list[str], codes: list[str], settings: TrainSettings, generator,
                 width: int | None = None) -> tuple[torch.Tensor, ...]:
    """The records as tensors [n, width] per key, or [n, 2, width] for pairs (own code, another code
    drawn with ``generator``); ``width``: pad every row to it (None: to the longest)."""
    def encode(row_texts, row_codes):
        return encode_examples(tokenizer, row_texts, row_codes, settings.max_length,
                               lambda code: make_prompt(code, settings.prompt, settings.template), pad_to=width)

    if not pairs_on(settings):
        enc = encode(texts, codes)
        return tuple(enc[k] for k in _KEYS)
    # one encoding of both readings: one padded width, then record i's rows side by side
    enc = encode(list(texts) * 2, list(codes) + _other_codes(codes, settings, generator))
    n = len(codes)
    return tuple(torch.stack([enc[k][:n], enc[k][n:]], dim=1) for k in _KEYS)


def _encode(tokenizer, texts: list[str], codes: list[str], settings: TrainSettings, generator) -> TensorDataset:
    """The records as a dataset of ``_encode_rows`` (non-private training: the other code of a pair
    drawn once per round)."""
    return TensorDataset(*_encode_rows(tokenizer, texts, codes, settings, generator))


class Slots:
    """The node's records as ``bound`` Poisson slots, encoded one batch at a time at the public width.

    Encoding every record up front, padded to the longest, made a round's memory (and whether it
    dies of out-of-memory) a function of |D| and of the longest record. Here a step tokenizes only
    the records its Poisson sample drew, every row is padded to ``max_length`` (public), and a slot
    beyond the records is a padding row: the same work through the model (its ids are eos, its
    mask full), whose per-sample gradient is zeroed before clipping, so it counts for nothing. A
    step's rows are Binomial(bound, q) and its tokens rows x max_length: public inputs only.
    """

    def __init__(self, tokenizer, texts: list[str], codes: list[str], settings: TrainSettings, bound: int,
                 generator) -> None:
        self.tokenizer, self.texts, self.codes, self.settings = tokenizer, texts, codes, settings
        self.bound, self.generator = bound, generator
        self.rows_per_record = 2 if pairs_on(settings) else 1
        # under a bound, the public terms of every batch's rows, fixed for the round
        self.limit = fixed_work.row_bytes(settings.max_length)
        self.filler = fixed_work.filler(self.limit)
        self.public = settings.vocabulary[0] if settings.vocabulary else "record"
        self.widest = max(len(self._prompt(c).encode("utf-8")) for c in {*settings.vocabulary, self.public})

    def _prompt(self, code: str) -> str:
        return make_prompt(code, self.settings.prompt, self.settings.template)

    def __len__(self) -> int:
        return self.bound

    def batch(self, slots: torch.Tensor) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
        """(tensors [b, (2,) max_length] per key, a bool vector of the rows that are records) for
        the sampled ``slots`` (indices in [0, bound))."""
        real = slots < len(self.texts)
        if self.settings.records_bound is None:  # no public bound (simulation): as fast as it goes
            picked = slots[real].tolist()
            tensors = _encode_rows(self.tokenizer, [self.texts[i] for i in picked], [self.codes[i] for i in picked],
                                   self.settings, self.generator)
            return tensors, real
        # Under a bound every slot goes through the same encoding at the public width: a record cut to
        # its row's bytes, a padding slot as filler under a public code (its gradient is zeroed), and
        # the bytes the records fall short of are tokenized as ballast (fedsyn_client.fixed_work).
        texts, codes = [], []
        for slot in slots.tolist():
            is_record = slot < len(self.texts)
            texts.append(fixed_work.cut(self.texts[slot], self.limit) if is_record else self.filler)
            codes.append(self.codes[slot] if is_record else self.public)
        # A row's prompt is its code's: a prompt shorter than the vocabulary's widest (public) is made
        # up in the ballast too, as a short record is (a pair's second reading counted as its first).
        read = [self._prompt(c) + t for c, t in zip(codes, texts)] * self.rows_per_record
        fixed_work.ballast(self.tokenizer, read, len(read), self.limit + self.widest)
        tensors = _encode_rows(self.tokenizer, texts, codes, self.settings, self.generator,
                               width=self.settings.max_length)
        return tensors, real


def sample_rate(settings: TrainSettings, num_records: int) -> float:
    """q: ``settings.sample_rate`` when given, else min(1, B / |D|) (1 for an empty dataset)."""
    if settings.sample_rate is not None:
        return float(settings.sample_rate)
    return poisson_sample_rate(settings.batch_size, num_records)


def _generators(settings: TrainSettings, prior_steps: int, device) -> tuple[torch.Generator, torch.Generator]:
    """(batch sampling on the CPU, noise on the parameters' device).

    Private: seeded from OS entropy, because noise or a sample that can be recomputed from
    a known seed protects nothing. Otherwise (or with ``reproducible_noise``): from the seed
    and the steps already taken, so every round draws a different stream.
    """
    rngs = []
    for i, dev in enumerate(("cpu", device)):
        g = torch.Generator(device=dev)
        if settings.private and not settings.reproducible_noise:
            g.seed()
        else:
            g.manual_seed(int(np.random.SeedSequence([settings.seed, prior_steps, i]).generate_state(1)[0]))
        rngs.append(g)
    return rngs[0], rngs[1]


def _private_steps(model, optimizer, slots: Slots, q, settings, history, sampler_rng, noise_rng):
    from opacus import PrivacyEngine

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Secure RNG turned off")
        engine = PrivacyEngine(accountant="rdp", secure_mode=False)
    if history:  # epsilon accumulates over rounds, never resets
        engine.accountant.load_state_dict({"history": list(history), "mechanism": engine.accountant.mechanism()})
    # Layers with trainable weights but no Opacus grad sampler (GPT-2's Conv1D, Llama's
    # RMSNorm: full finetuning only) fall back to functorch per-sample gradients in "hooks"
    # mode by themselves; frozen layers (the base model under LoRA) get no hooks at all.
    # make_private only wraps the model and the optimizer here: its loader (and the q = 1/len(loader)
    # it derives, and its accountant hook) are replaced below, so it gets a placeholder of one
    # batch that works for an empty dataset too.
    gsm, dp_optimizer, _ = engine.make_private(
        module=model, optimizer=optimizer,
        data_loader=DataLoader(range(settings.batch_size), batch_size=settings.batch_size),  # type: ignore[arg-type]  # a range is a map-style dataset
        noise_multiplier=settings.noise_multiplier, max_grad_norm=settings.max_grad_norm,
        poisson_sampling=False, noise_generator=noise_rng,
    )
    # The noisy sum is divided by the public B, never by a count of records.
    dp_optimizer.expected_batch_size = settings.batch_size
    dp_optimizer.attach_step_hook(engine.accountant.get_optimizer_hook_fn(sample_rate=q))
    try:
        with warnings.catch_warnings():
            # The embedding's backward hook fires on an integer input: harmless, torch warns.
            warnings.filterwarnings("ignore", message="Full backward hook is firing")
            trim = settings.records_bound is None  # no public bound (simulation): drop all-padding columns
            losses = _run(lambda b: _private_step(gsm, dp_optimizer, *b, settings.precision,  # type: ignore[call-arg]  # b: a Slots.batch, (tensors, real)
                                                  settings.contrastive_weight, trim),
                          (slots.batch(s) for s in poisson_slots(len(slots), q, sampler_rng)), settings.local_steps,
                          "DP-SGD")
    finally:
        gsm.to_standard_module()  # remove hooks and grad-sample attributes: `model` is usable again
    return losses, list(engine.accountant.state_dict()["history"])


def poisson_slots(bound: int, q: float, generator: torch.Generator):
    """Endless Poisson samples of ``bound`` slots: each slot is in each sample with probability ``q``.

    By hand rather than Opacus' ``DPDataLoader``: that loader takes the shapes of an empty
    batch from ``dataset[0]``, so it is undefined on an empty dataset, where DP-SGD is not
    (every step is noise only).
    """
    while True:
        yield torch.nonzero(torch.rand(bound, generator=generator) < q).flatten()


# Rows x padded width per forward/backward pass of a DP-SGD step. A Poisson batch is as large as
# q x |D|, and q = min(1, B / |D|) reaches 1 whenever the server asks for B >= |D|: one pass over it
# would make the node's memory, hence whether it fails, a function of its record count. The batch
# is split into passes of at most this many tokens (8 x 1024, or 128 x 64: the default batch is
# one pass); the clipped per-record gradients are summed across passes and noised once, as Opacus'
# BatchMemoryManager does, so the step is the same as in one pass.
TOKENS_PER_PASS = 8192


def _private_step(gsm, dp_optimizer, tensors, real: torch.Tensor, precision: str, weight: float = 0.0,
                  trim: bool = False) -> float:
    """One DP-SGD step on a Poisson batch of rows (``real``: which are records; the others are
    padding rows, run like the rest and zeroed before clipping). Returns the records' mean loss
    (nan without one)."""
    dp_optimizer.zero_grad(set_to_none=True)
    rows = tensors[0].shape[0]
    if rows == 0:
        # An empty Poisson batch is still a step: the optimizer releases noise only (zero
        # clipped gradients + N(0, sigma^2 C^2), over B) and the accountant counts it, as
        # Opacus' empty-batch handling intends; the model is just not run on zero rows.
        for p in dp_optimizer.params:
            p.grad_sample = p.new_zeros((0, *p.shape))
        dp_optimizer.step()
        return math.nan
    rows_per_record = tensors[0][0].numel() // tensors[0].shape[-1]  # 2 for pairs
    per_pass = max(1, TOKENS_PER_PASS // (tensors[0].shape[-1] * rows_per_record))
    total = 0.0
    for start in range(0, rows, per_pass):
        part = tuple(t[start:start + per_pass] for t in tensors)
        keep = real[start:start + per_pass]
        total += _loss(gsm, part, precision, weight, trim=trim) * int(keep.sum())
        group_samples(dp_optimizer.params, rows_per_record)
        for p in dp_optimizer.params:  # bf16 autocast leaves bf16 per-sample gradients: clip in fp32
            if getattr(p, "grad_sample", None) is not None and p.grad_sample.dtype != torch.float32:
                p.grad_sample = p.grad_sample.float()
        zero_nonfinite_samples(dp_optimizer.params)
        zero_padding_samples(dp_optimizer.params, keep)
        if start + per_pass < rows:  # clip and add to the sum; noise and the step come after the last pass
            dp_optimizer.signal_skip_step(do_skip=True)
            dp_optimizer.step()
            dp_optimizer.zero_grad(set_to_none=True)
    dp_optimizer.step()
    n_real = int(real.sum())
    return total / n_real if n_real else math.nan


def zero_padding_samples(params, real: torch.Tensor) -> None:
    """Zero the per-sample gradients of the padding rows (``~real``): they count for nothing."""
    # a multiply of every row, not a write to the padding rows: the same work however many there are
    for p in params:
        g = getattr(p, "grad_sample", None)
        if g is not None:
            g.mul_(real.to(device=g.device, dtype=g.dtype).view(-1, *([1] * (g.dim() - 1))))


def group_samples(params, rows_per_record: int) -> None:
    """Make each record's per-sample gradient the sum of its rows' (rows of a record are adjacent).

    Opacus sees one sample per row of the model's input; a pair is two rows of one record, and
    clipping each row alone would let a record move the sum by 2C. Opacus' "mean" reduction scales
    each row's gradient by the number of rows while the loss is a mean over records, so the sum is
    divided by ``rows_per_record``: the result is d(record's loss)/d(weights), as for single rows.
    """
    if rows_per_record == 1:
        return
    for p in params:
        g = getattr(p, "grad_sample", None)
        if g is not None:
            p.grad_sample = (g.view(g.shape[0] // rows_per_record, rows_per_record, *g.shape[1:]).sum(dim=1)
                             / rows_per_record)


def zero_nonfinite_samples(params) -> int:
    """Set to zero every record's per-sample gradient (across all ``params``) that holds a
    non-finite value; returns how many (for this node's log only).

    Clipping and noise bound a finite gradient; a NaN or inf passes through both, so a record
    crafted to overflow (or weights that make it overflow) would come back un-noised. A zero
    gradient is a fixed value whose norm is within the clipping bound.
    """
    samples = [p.grad_sample for p in params if getattr(p, "grad_sample", None) is not None]
    if not samples or samples[0].shape[0] == 0:
        return 0
    bad = torch.zeros(samples[0].shape[0], dtype=torch.bool, device=samples[0].device)
    for g in samples:
        bad |= ~torch.isfinite(g.reshape(g.shape[0], -1)).all(dim=1)
    if bad.any():
        for g in samples:
            g[bad] = 0
        log.warning("DP-SGD: %d record(s) had a non-finite gradient; it was set to zero before clipping",
                    int(bad.sum()))
    return int(bad.sum())


def _plain_steps(model, optimizer, dataset, batch, settings, generator):
    def step(tensors) -> float:
        optimizer.zero_grad(set_to_none=True)
        if tensors[0].shape[0] == 0:  # no record on the node: nothing to train on
            return math.nan
        loss = _loss(model, tensors, settings.precision, settings.contrastive_weight)
        optimizer.step()
        return loss

    def uniform_batches():
        while True:
            yield dataset[torch.randperm(len(dataset), generator=generator)[:batch]]

    return _run(step, uniform_batches(), settings.local_steps, "training (non-private)")


def _loss(model, tensors, precision: str = "auto", weight: float = 0.0, trim: bool = True) -> float:
    """Forward and backward on one non-empty batch; returns the loss (over every row: with
    padding rows, a value for the node's log only).

    ``trim``: drop the all-padding columns first (non-private training); the private step keeps the
    public width, so that its work does not depend on the records' lengths.

    With a frozen output layer (LoRA) the loss is fused with the head (``fused_conditional_lm_loss``:
    no full-vocabulary logits); a trainable head (full finetuning) needs the ordinary logits so
    that Opacus sees the head's per-sample activations. Pairs ([n, 2, width] tensors) take the
    pair objective with ``weight``.
    """
    pairs = tensors[0].ndim == 3
    # drop all-padding columns (right padding); a pair's rows become adjacent rows of the batch
    width = max(int(tensors[1].sum(dim=-1).max()), 1) if trim else tensors[0].shape[-1]
    tensors = [t[..., :width].reshape(-1, width) for t in tensors]
    input_ids, attention_mask, labels, position_ids = to_device(tensors, model)
    inputs = {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids,
              "use_cache": False}
    split = head_and_decoder(model)
    with autocast(model, precision):
        if pairs:
            loss = _pair_loss(model, split, inputs, labels, weight)
        elif split is not None:
            decoder, head = split
            loss = fused_conditional_lm_loss(decoder(**inputs).last_hidden_state, head.weight, labels)  # type: ignore[arg-type]  # a Linear's weight (nn.Module's __getattr__ says Tensor | Module)
        else:
            loss = conditional_lm_loss(model(**inputs).logits, labels)
    loss.backward()
    return float(loss.detach())


def _pair_loss(model, split, inputs, labels, weight: float) -> torch.Tensor:
    """The pair objective on 2n adjacent rows (a record's own code, then another code)."""
    if split is None:
        nll, count = sequence_nll(model(**inputs).logits, labels)
        return pair_objective(nll.view(-1, 2), count.view(-1, 2)[:, 0], weight)
    # The fused head gives no per-row NLL with a gradient: take the values without one, get
    # d objective / d NLL per row from them, and back-propagate the row-weighted NLL, whose gradient
    # is the objective's.
    decoder, head = split
    hidden = decoder(**inputs).last_hidden_state
    nll, count = fused_sequence_nll(hidden, head.weight, labels)
    nll = nll.view(-1, 2).requires_grad_(True)
    with torch.enable_grad():
        objective = pair_objective(nll, count.view(-1, 2)[:, 0], weight)
        (row_weights,) = torch.autograd.grad(objective, nll)
    surrogate = fused_weighted_nll(hidden, head.weight, labels, row_weights.reshape(-1))
    # the surrogate's value is not the objective's; report the objective
    return surrogate - surrogate.detach() + objective.detach()


def _run(step_fn, batches, steps: int, desc: str) -> list[float]:
    losses = []
    bar = tqdm(range(steps), desc=desc, disable=not sys.stderr.isatty(), leave=False)
    for i, tensors in zip(bar, batches):
        losses.append(step_fn(tensors))
        bar.set_postfix(loss=f"{losses[-1]:.4f}")
        rows = tensors[0][0] if isinstance(tensors[0], tuple) else tensors[0]  # (tensors, real) of a private step
        log.info("%s step %d/%d: batch %d, loss %.4f", desc, i + 1, steps, rows.shape[0], losses[-1])
    return losses


def _check_history(history) -> list[tuple]:
    out = []
    for h in history or []:
        if len(h) != 3:
            raise ValueError(f"accountant history entries are [noise_multiplier, sample_rate, steps], got {h!r}")
        out.append((float(h[0]), float(h[1]), int(h[2])))
    return out
