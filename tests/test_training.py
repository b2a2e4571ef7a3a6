"""Local DP-SGD (fedsyn_client.training) and the weights that travel (common.weights)."""

from __future__ import annotations

import json
import math
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import pytest
import torch

from common.codes import code_prompt
from common.dp import dpsgd_noise_multiplier
from common.lm_loss import conditional_lm_loss, encode_examples
from common.models import tiny_gpt2
from common.weights import load_trainable_state, prepare_model, trainable_state
from fedsyn_client.training import TrainSettings, dp_train

DELTA = 1e-5
TEXTS = [f"Record {i} talks about {'football' if i % 2 else 'markets'} and more." for i in range(40)]
CODES = [f"topic={'sport' if i % 2 else 'business'}" for i in range(40)]


def _settings(**kw) -> TrainSettings:
    base = {"local_steps": 3, "batch_size": 8, "learning_rate": 1e-3, "max_length": 24, "max_grad_norm": 1.0,
            "noise_multiplier": 1.0, "private": True, "seed": 0, "reproducible_noise": True}
    return TrainSettings(**{**base, **kw})


def _model(finetune: str = "lora", seed: int = 0):
    model, tok = tiny_gpt2(seed)
    return prepare_model(model, finetune, lora_rank=4, seed=seed), tok


def _all_params(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _delta_norm(before: dict, after: dict) -> float:
    return math.sqrt(sum(float(np.sum((after[k] - before[k]) ** 2)) for k in before))


# --- common.weights ---------------------------------------------------------------------


def test_prepare_model_lora_is_deterministic_and_only_adapters_train():
    a, _ = _model("lora", seed=0)
    b, _ = _model("lora", seed=0)
    c = prepare_model(tiny_gpt2(0)[0], "lora", lora_rank=4, seed=1)
    sa, sb, sc = trainable_state(a), trainable_state(b), trainable_state(c)
    assert list(sa) == sorted(sa) and sa and all("lora_" in k for k in sa)
    assert all(v.dtype == np.float32 for v in sa.values())
    assert all(np.array_equal(sa[k], sb[k]) for k in sa)
    assert any(not np.array_equal(sa[k], sc[k]) for k in sa)  # the seed drives the adapter init
    assert sum(p.numel() for p in a.parameters() if p.requires_grad) < 0.01 * sum(p.numel() for p in a.parameters())


def test_prepare_model_full_and_bad_mode():
    model, _ = _model("full")
    assert all(p.requires_grad for p in model.parameters())
    # Tied input/output embedding: one parameter, listed once.
    assert model.lm_head.weight is model.transformer.wte.weight
    assert "lm_head.weight" not in trainable_state(model)
    with pytest.raises(ValueError, match="'qlora'"):
        prepare_model(tiny_gpt2(0)[0], "qlora", lora_rank=4)


def test_load_trainable_state_round_trip_and_mismatch():
    src, _ = _model("lora", seed=3)
    dst, _ = _model("lora", seed=4)
    load_trainable_state(dst, trainable_state(src))
    assert all(np.array_equal(v, trainable_state(dst)[k]) for k, v in trainable_state(src).items())
    state = trainable_state(src)
    key = next(iter(state))
    with pytest.raises(ValueError, match="missing"):
        load_trainable_state(dst, {k: v for k, v in state.items() if k != key})
    with pytest.raises(ValueError, match="unexpected"):
        load_trainable_state(dst, {**state, "extra.weight": np.zeros(2, np.float32)})
    with pytest.raises(ValueError, match="shape"):
        load_trainable_state(dst, {**state, key: np.zeros((1, 1), np.float32)})
    full, _ = _model("full")
    with pytest.raises(ValueError):  # a LoRA server and a full-finetune node do not mix
        load_trainable_state(full, state)


# --- encoding and loss --------------------------------------------------------------------


def test_encode_examples_masks_prompt_and_padding():
    _, tok = tiny_gpt2(0)
    texts = ["Hello world, this is a somewhat longer test sentence.", "Short."]
    codes = ["topic=sport", "topic=tech|stars=4"]
    enc = encode_examples(tok, texts, codes, max_length=64)
    assert set(enc) == {"input_ids", "attention_mask", "labels", "position_ids"}
    width = enc["input_ids"].shape[1]
    assert torch.equal(enc["position_ids"], torch.arange(width).expand(2, width))
    for i, (text, code) in enumerate(zip(texts, codes)):
        n_prompt = len(tok(code_prompt(code))["input_ids"])
        length = int(enc["attention_mask"][i].sum())
        assert length == n_prompt + len(tok(text, add_special_tokens=False)["input_ids"]) + 1  # + eos
        assert enc["attention_mask"][i, length:].sum() == 0  # right padding
        labels = enc["labels"][i]
        assert (labels[:n_prompt] == -100).all() and (labels[length:] == -100).all()
        assert torch.equal(labels[n_prompt:length], enc["input_ids"][i, n_prompt:length])
        kept = labels[labels != -100].tolist()
        assert kept[-1] == tok.eos_token_id  # eos is predicted even though pad == eos here
        assert tok.decode(kept[:-1]) == text
        assert tok.decode(enc["input_ids"][i, :n_prompt].tolist()) == code_prompt(code)
    cut = encode_examples(tok, texts, codes, max_length=6)
    assert cut["input_ids"].shape[1] <= 6
    with pytest.raises(ValueError):
        encode_examples(tok, texts, codes[:1], max_length=6)


def test_conditional_lm_loss_by_hand():
    torch.manual_seed(0)
    logits = torch.randn(2, 4, 5)
    labels = torch.tensor([[-100, 1, 2, 3], [-100, -100, 4, -100]])
    logp = torch.log_softmax(logits, dim=-1)
    rec0 = -(logp[0, 0, 1] + logp[0, 1, 2] + logp[0, 2, 3]) / 3  # position t predicts label t+1
    rec1 = -logp[1, 1, 4]
    assert torch.allclose(conditional_lm_loss(logits, labels), (rec0 + rec1) / 2, atol=1e-6)
    empty = torch.full((1, 4), -100)  # a record with no label token adds 0
    both = conditional_lm_loss(torch.cat([logits[:1], logits[:1]]), torch.cat([labels[:1], empty]))
    assert torch.allclose(both, rec0 / 2, atol=1e-6)


def test_record_loss_does_not_depend_on_other_records_length():
    model, tok = tiny_gpt2(0)
    model.eval()
    a, short, long = "A record of medium length here.", "Tiny.", "A much longer record " * 6

    def batch_loss(texts):
        enc = encode_examples(tok, texts, ["topic=x"] * len(texts), max_length=64)
        with torch.no_grad():
            out = model(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"],
                        position_ids=enc["position_ids"])
        return conditional_lm_loss(out.logits, enc["labels"])

    alone_a = batch_loss([a])
    for other in (short, long):
        # mean over records: 2 * L([a, other]) - L([other]) recovers L([a]) exactly,
        # whatever the other record's length (a token-level mean would weight by length).
        assert torch.allclose(2 * batch_loss([a, other]) - batch_loss([other]), alone_a, atol=1e-4)


def test_fused_loss_matches_the_logits_loss_and_its_gradient():
    from common.lm_loss import fused_conditional_lm_loss, head_and_decoder

    model, tok = _model("lora")
    model.eval()  # no dropout: both passes see the same network (gradients still flow)
    enc = encode_examples(tok, TEXTS[:6] + ["Tiny."], CODES[:7], max_length=24)  # mixed lengths, padding
    inputs = {k: enc[k] for k in ("input_ids", "attention_mask", "position_ids")}
    plain = conditional_lm_loss(model(**inputs).logits, enc["labels"])
    plain.backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    model.zero_grad(set_to_none=True)
    decoder, head = head_and_decoder(model)
    fused = fused_conditional_lm_loss(decoder(**inputs).last_hidden_state, head.weight, enc["labels"])
    fused.backward()
    assert torch.allclose(fused, plain, rtol=1e-5)
    for n, p in model.named_parameters():
        if p.requires_grad:
            assert torch.allclose(p.grad, want[n], rtol=1e-4, atol=1e-7), n
    assert head.weight.grad is None  # frozen: nothing computed for it
    assert head_and_decoder(_model("full")[0]) is None  # a trainable head keeps the logits path


@pytest.mark.parametrize("precision, bf16", [("auto", True), ("fp32", False)])
def test_bf16_autocast_where_native_and_clipping_in_fp32(monkeypatch, precision, bf16):
    import common.devices as devices
    import fedsyn_client.training as training
    from common.lm_loss import head_and_decoder

    monkeypatch.setattr(devices, "native_bf16", lambda kind: True)  # as on an AMX CPU or a GPU
    model, tok = _model("lora")
    seen, dtypes = [], []
    head_and_decoder(model)[0].register_forward_hook(lambda m, i, o: seen.append(torch.is_autocast_enabled("cpu")))
    real = training.zero_nonfinite_samples
    monkeypatch.setattr(training, "zero_nonfinite_samples",
                        lambda params: dtypes.extend(p.grad_sample.dtype for p in params) or real(params))
    result = dp_train(model, tok, TEXTS, CODES, _settings(precision=precision), DELTA, [])
    assert seen and all(s == bf16 for s in seen)
    assert dtypes and set(dtypes) == {torch.float32}  # bf16 per-sample gradients are upcast before clipping
    assert all(math.isfinite(x) for x in result.losses) and all(v.dtype == np.float32 for v in result.state.values())
    with pytest.raises(ValueError, match="precision"):
        _settings(precision="fp16")


# --- dp_train -----------------------------------------------------------------------------


@pytest.mark.parametrize("finetune", ["lora", "full"])
def test_dp_train_changes_only_trainable_weights(finetune):
    model, tok = _model(finetune)
    before = _all_params(model)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    mode = model.training
    result = dp_train(model, tok, TEXTS, CODES, _settings(), DELTA, [])
    after = _all_params(model)
    assert len(result.losses) == result.steps == 3
    assert all(math.isfinite(x) for x in result.losses) and math.isfinite(result.mean_loss)
    for name in before:
        changed = not torch.equal(before[name], after[name])
        assert changed == (name in trainable), name  # noise moves every trainable weight
    assert list(result.state) == list(trainable_state(model))
    assert all(np.array_equal(result.state[k], v) for k, v in trainable_state(model).items())
    assert result.num_examples == 40 and result.sample_rate == pytest.approx(0.2)
    assert sum(h[2] for h in result.accountant_history) == 3
    assert 0 < result.epsilon < math.inf
    json.dumps(result.accountant_history)
    # Opacus is gone: plain module, no hooks or per-sample attributes left behind.
    assert type(model).__name__ != "GradSampleModule" and not hasattr(model, "autograd_grad_sample_hooks")
    assert not any(hasattr(p, "grad_sample") or hasattr(p, "_forward_counter") for p in model.parameters())
    assert model.training == mode  # train/eval mode restored


def test_accountant_history_persists_across_rounds():
    model, tok = _model("lora")
    settings = _settings(local_steps=2, max_length=12)
    first = dp_train(model, tok, TEXTS, CODES, settings, DELTA, [])
    history = json.loads(json.dumps(first.accountant_history))  # as stored between rounds
    second = dp_train(model, tok, TEXTS, CODES, settings, DELTA, history)
    once, _ = _model("lora")
    double = dp_train(once, tok, TEXTS, CODES, _settings(local_steps=4, max_length=12), DELTA, [])
    assert second.epsilon == pytest.approx(double.epsilon, abs=1e-6)
    assert second.epsilon > first.epsilon
    assert sum(h[2] for h in second.accountant_history) == 4


def test_calibrated_noise_meets_the_phase_budget():
    eps, rounds, tau, batch = 3.0, 2, 2, 8
    q = batch / len(TEXTS)
    sigma = dpsgd_noise_multiplier(eps, DELTA, q, rounds * tau)
    model, tok = _model("lora")
    history: list = []
    for _ in range(rounds):
        result = dp_train(model, tok, TEXTS, CODES, _settings(local_steps=tau, noise_multiplier=sigma, max_length=12),
                          DELTA, history)
        history = result.accountant_history
    assert 0.9 * eps <= result.epsilon <= eps + 0.01


def test_non_private_training_learns():
    model, tok = _model("full")
    texts, codes = TEXTS[:8], CODES[:8]
    history = [[1.5, 0.25, 7]]
    settings = _settings(local_steps=30, learning_rate=1e-2, private=False, noise_multiplier=0.0, max_length=16)
    result = dp_train(model, tok, texts, codes, settings, DELTA, history)
    assert result.epsilon == math.inf and result.accountant_history == history and result.noise_multiplier == 0
    assert len(result.losses) == 30
    assert np.mean(result.losses[-3:]) < 0.5 * np.mean(result.losses[:3])


def test_clipping_bounds_and_noise_moves_the_sgd_step():
    """One SGD step at q = 1: clipped mean gradient has norm <= C, so |update| <= lr * C."""
    texts, codes = TEXTS[:8], CODES[:8]
    lr, clip = 1.0, 1e-3

    def update(noise: float, max_grad_norm: float) -> float:
        model, tok = _model("lora")
        before = trainable_state(model)
        settings = _settings(local_steps=1, batch_size=8, learning_rate=lr, max_grad_norm=max_grad_norm,
                             noise_multiplier=noise, optimizer="sgd", max_length=16)
        after = dp_train(model, tok, texts, codes, settings, DELTA, []).state
        return _delta_norm(before, after), sum(v.size for v in before.values())

    clipped, dim = update(1e-6, clip)
    unclipped, _ = update(1e-6, 1e3)
    noisy, _ = update(100.0, clip)
    assert 0 < clipped <= lr * clip * 1.001
    assert unclipped > 10 * lr * clip  # without clipping the step would be far larger
    expected = lr * 100.0 * clip * math.sqrt(dim) / 8  # |N(0, (sigma C)^2 I)| / B
    assert 0.7 * expected < noisy < 1.3 * expected


def test_a_batch_split_into_passes_is_the_same_dp_step(monkeypatch):
    """A Poisson batch larger than one pass is clipped pass by pass, summed, and noised once: the
    same update as one pass (memory stays bounded whatever q x |D| is), and the accountant counts
    one step per batch, not per pass."""
    import fedsyn_client.training as training

    def train(tokens_per_pass: int):
        monkeypatch.setattr(training, "TOKENS_PER_PASS", tokens_per_pass)
        model, tok = _model("lora")
        for m in model.modules():  # GPT-2's dropout draws depend on the pass shapes; SmolLM2 has none
            if isinstance(m, torch.nn.Dropout):
                m.p = 0.0
        settings = _settings(local_steps=2, batch_size=20, max_length=16, noise_multiplier=0.5)
        return dp_train(model, tok, TEXTS, CODES, settings, DELTA, [])

    whole, split = train(10_000), train(3 * 16)  # one pass, or passes of 3 rows
    assert split.accountant_history == whole.accountant_history and sum(h[2] for h in split.accountant_history) == 2
    np.testing.assert_allclose(split.losses, whole.losses, rtol=1e-5)
    before = trainable_state(_model("lora")[0])
    moved = _delta_norm(before, whole.state)
    assert moved > 1e-3  # it did train: 2 Adam steps of 1e-3
    assert _delta_norm(whole.state, split.state) < 1e-3 * moved  # the same step, up to float rounding (Adam)


def test_empty_poisson_batches_are_noise_steps():
    model, tok = _model("lora")
    settings = _settings(local_steps=8, batch_size=1, max_length=12, seed=1)  # q = 1/40
    result = dp_train(model, tok, TEXTS, CODES, settings, DELTA, [])
    assert any(math.isnan(x) for x in result.losses)  # P(empty) = 0.975^40 = 0.36 per step
    assert sum(h[2] for h in result.accountant_history) == 8
    assert math.isfinite(result.mean_loss) or all(math.isnan(x) for x in result.losses)


def test_dp_train_on_no_record_releases_noise_only():
    """DP-SGD is defined on the empty dataset: every step is an empty Poisson batch, the update is
    noise (nonzero), and the accountant counts the steps at the stated q."""
    model, tok = _model("lora")
    before = {k: v.copy() for k, v in trainable_state(model).items()}
    result = dp_train(model, tok, [], [], _settings(local_steps=2, sample_rate=0.25), DELTA, [])
    assert all(math.isnan(x) for x in result.losses) and result.steps == 2
    assert result.accountant_history == [[1.0, 0.25, 2]] and result.sample_rate == 0.25
    assert any(not np.array_equal(before[k], v) for k, v in result.state.items())
    assert all(np.isfinite(v).all() for v in result.state.values())


def test_a_stated_sample_rate_is_used_whatever_the_records():
    model, tok = _model("lora")
    result = dp_train(model, tok, TEXTS[:4], CODES[:4], _settings(local_steps=1, sample_rate=0.1, max_length=12),
                      DELTA, [])
    assert result.sample_rate == result.accountant_history[0][1] == 0.1
    with pytest.raises(ValueError, match="sample_rate"):
        _settings(sample_rate=0.0)


def test_dp_train_validation():
    model, tok = _model("lora")
    with pytest.raises(ValueError):
        _settings(noise_multiplier=0.0)  # private needs noise
    with pytest.raises(ValueError):
        _settings(optimizer="adagrad")
    with pytest.warns(UserWarning, match="q = 1"):
        result = dp_train(model, tok, TEXTS[:4], CODES[:4], _settings(local_steps=1, batch_size=10, max_length=12),
                          DELTA, [])
    assert result.sample_rate == 1.0
    # B need not divide |D|: sampling and accounting use q = B/|D| exactly (not 1/ceil(|D|/B)).
    result = dp_train(model, tok, TEXTS, CODES, _settings(local_steps=1, batch_size=6, max_length=12), DELTA, [])
    assert result.sample_rate == result.accountant_history[0][1] == 6 / 40


# --- real model -----------------------------------------------------------------------------


@pytest.mark.slow
def test_smollm2_lora_dp_steps():
    models = pytest.importorskip("common.models")
    if not hasattr(models, "load_generator"):
        pytest.skip("common.models.load_generator not available")
    try:
        model, tok = models.load_generator("smollm2-135m")
    except (OSError, RuntimeError) as err:
        pytest.skip(f"SmolLM2 not available: {err}")
    model = prepare_model(model, "lora", lora_rank=8)
    texts = [("The match ended in a draw after a long and tense second half. " * 4)] * 16
    codes = ["topic=sport"] * 16
    settings = _settings(local_steps=2, batch_size=4, max_length=64, learning_rate=2e-3)
    start = time.perf_counter()
    result = dp_train(model, tok, texts, codes, settings, DELTA, [])
    per_step = (time.perf_counter() - start) / 2
    print(f"SmolLM2-135M LoRA r=8, DP-SGD, batch 4 x 64 tokens: {per_step:.2f} s/step")
    assert all(math.isfinite(x) for x in result.losses if not math.isnan(x))
    assert all("lora_" in k for k in result.state) and 0 < result.epsilon < math.inf


# --- issue 33: the instruction prompt and LoRA on the top blocks ------------------------------
def test_the_instruction_prompt_is_what_phase_1_trains_on_and_generation_uses():
    from common.codes import make_prompt, zero_shot_prompt
    from common.config import RunConfig
    from fedsyn_server.synthesis import ServerModel

    template = "Write a news article about {fields}:\n\n"
    model, tok = _model("lora")
    prompt = lambda code: make_prompt(code, "instruction", template)  # noqa: E731
    enc = encode_examples(tok, ["The match ended."], ["topic=sport"], max_length=64, prompt=prompt)
    n_prompt = len(tok(zero_shot_prompt("topic=sport", template))["input_ids"])
    assert (enc["labels"][0, :n_prompt] == -100).all() and (enc["labels"][0, n_prompt] != -100)
    assert enc["input_ids"][0, :n_prompt].tolist() == tok(prompt("topic=sport"))["input_ids"]
    cfg = RunConfig(model="tiny-gpt2", prompt="instruction", zero_shot_template=template, max_length=16)
    assert cfg.trains and ServerModel(cfg).prompt("topic=sport") == "Write a news article about topic: sport:\n\n"
    assert make_prompt("topic=sport") == code_prompt("topic=sport")  # the paper's, by default
    settings = _settings(local_steps=1, prompt="instruction", template=template)
    assert dp_train(model, tok, TEXTS[:8], CODES[:8], settings, DELTA, []).steps == 1


def test_lora_on_the_top_blocks_trains_only_them():
    base, tok = tiny_gpt2(0)
    blocks = base.config.n_layer
    top = prepare_model(base, "lora", 2, lora_layers=1)
    names = [n for n, p in top.named_parameters() if p.requires_grad]
    assert names and all(f".h.{blocks - 1}." in n for n in names)
    everywhere = prepare_model(tiny_gpt2(0)[0], "lora", 2)
    assert sum(p.numel() for p in everywhere.parameters() if p.requires_grad) == blocks * sum(
        p.numel() for p in top.parameters() if p.requires_grad)
    with pytest.raises(ValueError, match="transformer blocks"):
        prepare_model(tiny_gpt2(0)[0], "lora", 2, lora_layers=blocks + 1)
    result = dp_train(top, tok, TEXTS[:8], CODES[:8], _settings(local_steps=1), DELTA, [])
    assert set(result.state) == set(trainable_state(top))


# ------------------------------------------------- issue 45: a round's work is a function of public inputs
def _work(texts: list[str], codes: list[str], monkeypatch, **kw) -> tuple[list[tuple[int, ...]], int]:
    """(the shapes of every batch that went through the model in one private round, the bytes of
    text the tokenizer read: prompts, records, filler and ballast)."""
    import fedsyn_client.training as training

    shapes, tokenized, text_bytes = [], [], []
    real_loss, real_encode = training._loss, training.encode_examples

    def loss(model, tensors, *a, **k):
        shapes.append(tuple(tensors[0].shape))
        return real_loss(model, tensors, *a, **k)

    def encode(tokenizer, row_texts, *a, **k):
        tokenized.append(len(row_texts))
        return real_encode(tokenizer, row_texts, *a, **k)

    model, tok = _model()
    real_call = type(tok).__call__

    def call(self, text=None, *a, **k):  # a prompt, a record's body, a padding row's filler, the ballast
        text_bytes.append(sum(len(t.encode("utf-8")) for t in ([text] if isinstance(text, str) else text)))
        return real_call(self, text, *a, **k)

    with monkeypatch.context() as patch:
        patch.setattr(training, "_loss", loss)
        patch.setattr(training, "encode_examples", encode)
        patch.setattr(type(tok), "__call__", call)
        dp_train(model, tok, texts, codes, _settings(**kw), DELTA, [])
    assert sum(tokenized) <= 2 * sum(s[0] for s in shapes)  # only the sampled slots (x2 for pairs), per batch
    return shapes, sum(text_bytes)


@pytest.mark.parametrize("pairs", [False, True])
def test_a_rounds_work_is_the_same_for_50_and_5000_records_and_any_longest_record(monkeypatch, pairs):
    """Under one records_bound (the node's max-records), a private round puts the same rows of the
    same width through the model whatever the node holds, 50 records or 5,000, one record a thousand
    times longer than the rest, and its tokenizer reads the same bytes: each sampled slot's row cut
    to 8 bytes a token, a padding slot read as filler, what short records lack read as ballast.
    Encoding everything up front, padded to the longest, made memory and time (and an out-of-memory
    failure) functions of |D| and of the longest record."""
    vocabulary = ("topic=business", "topic=sport")
    extra = {"contrastive_weight": 1.0} if pairs else {}
    settings = {"records_bound": 5000, "batch_size": 100, "local_steps": 2, "vocabulary": vocabulary, **extra}
    small = _work(TEXTS + TEXTS[:10], CODES + CODES[:10], monkeypatch, **settings)
    large = _work([TEXTS[i % 40] for i in range(5000)], [CODES[i % 40] for i in range(5000)], monkeypatch, **settings)
    longest = _work(TEXTS + TEXTS[:9] + ["word " * 20_000], CODES + CODES[:10], monkeypatch, **settings)
    from common.codes import make_prompt

    shapes = small[0]
    assert small[0] == large[0] == longest[0] and all(s[-1] == 24 for s in shapes)  # the public width, max_length
    if not pairs:
        assert small[1] == large[1] == longest[1]
    read = small[1]
    assert sum(s[0] for s in shapes) > 100  # Binomial(5000, 100/5000) per step, in passes
    rows = sum(s[0] * (2 if pairs else 1) for s in shapes)
    widest = len(make_prompt("topic=business").encode())
    # every row the bytes of max_length tokens and the widest prompt (fedsyn_client.fixed_work); a
    # pair's second reading is counted as its first, so pairs are within a prompt's difference a row
    slack = rows * (widest - len(make_prompt("topic=sport").encode())) if pairs else 0
    assert rows * (8 * 24 + widest) - slack <= read <= rows * (8 * 24 + widest) + slack


def test_a_padding_slot_counts_for_nothing(monkeypatch):
    """With the bound above the records, the step is the one on the records alone: the same
    clipped sum, hence (noise seeded alike) the same weights, as a round whose slots are all records
    once the padding rows' gradients are zeroed."""
    import fedsyn_client.training as training

    seen = []
    real_zero = training.zero_padding_samples

    def zero(params, real):
        seen.append(int((~real).sum()))
        return real_zero(params, real)

    monkeypatch.setattr(training, "zero_padding_samples", zero)
    model, tok = _model()
    before = trainable_state(model)
    res = dp_train(model, tok, TEXTS[:4], CODES[:4], _settings(records_bound=400, batch_size=100, local_steps=1,
                                                                 noise_multiplier=1e-9), DELTA, [])
    assert sum(seen) > 50  # padding rows went through the model
    moved = max(float(np.abs(res.state[k] - before[k]).max()) for k in before)
    # at most the 4 records' clipped gradients (norm <= 1 each) over B = 100, times the lr's Adam-scale step
    assert 0 < moved <= 1e-3 * 1.01 and res.sample_rate == pytest.approx(100 / 400)


def test_records_above_the_bound_are_refused():
    model, tok = _model()
    with pytest.raises(ValueError, match="above the bound"):
        dp_train(model, tok, TEXTS, CODES, _settings(records_bound=10), DELTA, [])
