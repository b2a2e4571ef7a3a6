import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest
import torch

from common.models import load_generator
from fedsyn_server.generation import generate_texts

PROMPTS = ["Topic: sport. Article:", "Hi", "Topic: business, with a much longer prompt. Article:", "Hi", "Tech:"]


@pytest.fixture(scope="module")
def tiny():
    return load_generator("tiny-gpt2", device="cpu")


def test_one_output_per_prompt_in_order(tiny):
    model, tok = tiny
    out = generate_texts(model, tok, PROMPTS, max_new_tokens=8, batch_size=2, progress=False)
    assert len(out) == len(PROMPTS) and all(isinstance(t, str) and t for t in out)
    # Order is preserved although prompts are regrouped by length: under greedy decoding each
    # prompt gets what it gets alone (batch_size=1 so padding noise cannot flip a near-tie argmax).
    greedy = generate_texts(model, tok, PROMPTS, max_new_tokens=8, temperature=0, batch_size=1, progress=False)
    alone = [generate_texts(model, tok, [p], max_new_tokens=8, temperature=0, progress=False)[0] for p in PROMPTS]
    assert greedy == alone and len(set(greedy)) == 4


def test_seeded_and_rng_neutral(tiny):
    model, tok = tiny
    kwargs = {"max_new_tokens": 8, "batch_size": 2, "progress": False}
    torch.manual_seed(123)
    state = torch.get_rng_state()
    a = generate_texts(model, tok, PROMPTS, seed=1, **kwargs)
    assert torch.equal(torch.get_rng_state(), state)  # the caller's RNG stream is not consumed
    assert generate_texts(model, tok, PROMPTS, seed=1, **kwargs) == a
    assert generate_texts(model, tok, PROMPTS, seed=2, **kwargs) != a


def test_max_new_tokens_respected(tiny, monkeypatch):
    model, tok = tiny
    new_counts = []
    generate = model.generate

    def spy(**kw):
        out = generate(**kw)
        new = out[:, kw["input_ids"].shape[1] :]
        new_counts.extend((new != tok.pad_token_id).sum(dim=1).tolist())
        return out

    monkeypatch.setattr(model, "generate", spy)
    out = generate_texts(model, tok, PROMPTS, max_new_tokens=5, batch_size=2, progress=False)
    assert len(new_counts) == len(PROMPTS) and max(new_counts) <= 5
    # Re-tokenising decoded text is not exact for random byte tokens; allow slack, catch runaways.
    assert all(len(tok(t)["input_ids"]) <= 3 * 5 for t in out)


def test_train_mode_restored_and_empty(tiny):
    model, tok = tiny
    model.train()
    generate_texts(model, tok, ["Hi"], max_new_tokens=2, progress=False)
    assert model.training
    model.eval()
    assert generate_texts(model, tok, [], max_new_tokens=2) == []


@pytest.mark.slow
def test_smollm2_generates_text():
    model, tok = load_generator("smollm2-135m", device="cpu")
    prompts = ["Write one sentence about football:", "The weather today is"]
    out = generate_texts(model, tok, prompts, max_new_tokens=16, seed=0, progress=False)
    print("\n", out)
    assert len(out) == 2
    for text in out:
        assert isinstance(text, str) and text
        assert sum(c.isalpha() for c in text) / len(text) > 0.5
