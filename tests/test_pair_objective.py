"""The contrastive phase-1 objective (common.lm_loss.pair_objective) and how a node trains on it:
a record read under two codes is still one record to DP-SGD (fedsyn_client.training)."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from common.lm_loss import conditional_lm_loss, pair_objective, sequence_nll
from common.models import tiny_gpt2
from common.weights import prepare_model, trainable_state
from fedsyn_client import training
from fedsyn_client.training import TrainSettings, dp_train, pairs_on

TEXTS = [f"Record {i} talks about {'football and goals' if i % 2 else 'markets and shares'}." for i in range(24)]
CODES = [f"topic={'sport' if i % 2 else 'business'}" for i in range(24)]
VOCAB = ("topic=business", "topic=sport", "topic=tech")


def _settings(**kw) -> TrainSettings:
    base = {"local_steps": 2, "batch_size": 6, "learning_rate": 1e-2, "max_length": 24, "max_grad_norm": 1.0,
            "noise_multiplier": 1.0, "seed": 0, "reproducible_noise": True, "contrastive_weight": 1.0,
            "vocabulary": VOCAB}
    return TrainSettings(**{**base, **kw})


def _model(finetune: str = "lora"):
    model, tok = tiny_gpt2(0)
    model = prepare_model(model, finetune, lora_rank=4, seed=0)
    for m in model.modules():  # no dropout: the per-sample and the one-record passes see one network
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    return model, tok


def test_pair_objective_by_hand():
    nll = torch.tensor([[2.0, 3.0], [1.5, 1.0]])
    count = torch.tensor([4, 10])
    want = ((2.0 + 0.5 * F.softplus(torch.tensor(4 * (2.0 - 3.0))))
            + (1.5 + 0.5 * F.softplus(torch.tensor(10 * 0.5)))) / 2
    assert torch.allclose(pair_objective(nll, count, 0.5), want)
    assert torch.allclose(pair_objective(nll, count, 0.0), nll[:, 0].mean())  # weight 0: the paper's loss
    # a record whose own code explains it better gains less from the pair term than one whose other code does
    assert F.softplus(torch.tensor(-4.0)) < F.softplus(torch.tensor(5.0))
    with pytest.raises(ValueError, match=r"\[n, 2\]"):
        pair_objective(torch.zeros(3), count, 1.0)


def test_sequence_nll_is_the_lm_loss_per_row():
    torch.manual_seed(0)
    logits = torch.randn(3, 5, 7)
    labels = torch.tensor([[-100, 1, 2, 3, -100], [-100, -100, 4, 5, 6], [-100] * 5])
    nll, count = sequence_nll(logits, labels)
    assert count.tolist() == [3, 3, 0] and float(nll[2]) == 0.0  # a row with no label token: 0
    assert torch.allclose(nll[:2].mean(), conditional_lm_loss(logits[:2], labels[:2]), atol=1e-6)


def test_pairs_need_a_weight_and_a_second_code():
    assert pairs_on(_settings())
    assert not pairs_on(_settings(contrastive_weight=0.0))
    assert not pairs_on(_settings(vocabulary=("topic=sport",)))
    with pytest.raises(ValueError, match="contrastive_weight"):
        _settings(contrastive_weight=-1.0)


def test_the_other_code_is_never_the_record_own():
    _, tok = _model()
    g = torch.Generator().manual_seed(0)
    data = training._encode(tok, TEXTS, CODES, _settings(), g)
    ids = data.tensors[0]
    assert ids.shape[:2] == (len(TEXTS), 2)
    for i, code in enumerate(CODES):
        own, other = (tok.decode(ids[i, k]).split("\n")[0] for k in range(2))  # the prompt line: "topic: sport"
        value = code.split("=")[1]
        assert value in own and value not in other and any(v.split("=")[1] in other for v in VOCAB if v != code)
    # every other code is drawn: for each own code, both of the vocabulary's others appear
    seen = {(code, tok.decode(ids[i, 1]).split("\n")[0].split(": ")[-1]) for i, code in enumerate(CODES)}
    assert len(seen) == 4, seen


@pytest.mark.parametrize("finetune", ["lora", "full"])  # the fused head (LoRA) and the logits path (full)
def test_a_pair_is_one_record_to_dp_sgd(finetune):
    """Each record's per-sample gradient, after grouping its two rows, is the gradient of that
    record's own pair loss computed alone: so clipping bounds a record, not a row, and no record's
    gradient depends on another's (the neighbouring-datasets property)."""
    from opacus import GradSampleModule

    model, tok = _model(finetune)
    data = training._encode(tok, TEXTS[:5], CODES[:5], _settings(), torch.Generator().manual_seed(1))
    gsm = GradSampleModule(model, loss_reduction="mean")
    training._loss(gsm, data.tensors, "fp32", weight=1.0)
    params = [p for p in model.parameters() if p.requires_grad]
    training.group_samples(params, 2)
    per_record = [p.grad_sample.clone() for p in params]
    gsm.to_standard_module()
    for i in range(5):
        model.zero_grad(set_to_none=True)
        rows = [t[i].reshape(-1, t.shape[-1]) for t in data.tensors]
        inputs = {"input_ids": rows[0], "attention_mask": rows[1], "position_ids": rows[3]}
        nll, count = sequence_nll(model(**inputs).logits, rows[2])
        pair_objective(nll.view(1, 2), count[:1], 1.0).backward()
        for p, g in zip(params, per_record):
            assert g.shape[0] == 5
            torch.testing.assert_close(g[i], p.grad, rtol=2e-3, atol=1e-5)  # fp32 sums in another order


def test_dp_train_on_pairs_is_a_dp_step_per_record():
    """With pairs the round still takes tau steps at q with one accountant entry, and the update is
    the clipped, noised mean of per-record gradients: with a tiny clipping norm and no noise the
    weights move by at most lr per coordinate per Adam step, whatever the objective's scale."""
    model, tok = _model()
    before = trainable_state(model)
    result = dp_train(model, tok, TEXTS, CODES, _settings(local_steps=3), 1e-5, [])
    assert sum(h[2] for h in result.accountant_history) == 3 and np.isfinite(result.epsilon)
    assert all(np.isfinite(x) for x in result.losses if not np.isnan(x))
    moved = max(float(np.abs(result.state[k] - before[k]).max()) for k in before)
    assert 0 < moved <= 3 * 1e-2 * 1.01


def test_plain_training_on_pairs_separates_the_codes():
    """Non-private training on the pair objective makes each record likelier under its own code
    than under the others, more than the paper's loss does in the same steps."""
    def margin(model, tok) -> float:
        data = training._encode(tok, TEXTS, CODES, _settings(), torch.Generator().manual_seed(2))
        t = [x.reshape(-1, x.shape[-1]) for x in data.tensors]
        with torch.no_grad():
            nll, count = sequence_nll(model(input_ids=t[0], attention_mask=t[1], position_ids=t[3]).logits, t[2])
        nll = nll.view(-1, 2)
        return float(((nll[:, 1] - nll[:, 0]) * count.view(-1, 2)[:, 0]).mean())

    margins = {}
    for weight in (0.0, 1.0):
        model, tok = _model()
        dp_train(model, tok, TEXTS, CODES, _settings(private=False, local_steps=30, batch_size=8, learning_rate=3e-2,
                                                     contrastive_weight=weight), 1e-5, [])
        model.eval()
        margins[weight] = margin(model, tok)
    assert margins[1.0] > margins[0.0] and margins[1.0] > 0
