import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import threading
import time

import numpy as np
import pytest
import torch

from common import models
from common.models import embed, load_embedder, load_generator, resolve_generator


def test_tiny_gpt2_loads_and_round_trips():
    model, tok = load_generator("tiny-gpt2", device="cpu")
    assert not model.training and model.dtype == torch.float32
    assert tok.pad_token is not None and tok.padding_side == "left"
    ids = tok("Hello world")["input_ids"]
    assert ids == [15496, 995]  # GPT-2's real ids, so the BPE files were read
    assert tok.decode(ids) == "Hello world"


def test_tiny_gpt2_deterministic_per_seed():
    a, _ = load_generator("tiny-gpt2", seed=3, device="cpu")
    models.clear_caches()
    b, _ = load_generator("tiny-gpt2", seed=3, device="cpu")
    c, _ = load_generator("tiny-gpt2", seed=4, device="cpu")
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not all(torch.equal(sa[k], sc[k]) for k in sa)


def test_load_generator_returns_private_copies():
    a, tok_a = load_generator("tiny-gpt2", device="cpu")
    with torch.no_grad():
        a.transformer.wte.weight.zero_()
    tok_a.padding_side = "right"
    b, tok_b = load_generator("tiny-gpt2", device="cpu")
    assert b.transformer.wte.weight.abs().sum() > 0
    assert tok_b.padding_side == "left"


def test_resolve_generator(tmp_path):
    assert resolve_generator("tiny-gpt2") == "tiny-gpt2"
    assert resolve_generator("SmolLM2-135M") == "smollm2-135m"
    assert resolve_generator("HuggingFaceTB/SmolLM2-135M-Instruct") == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert resolve_generator(str(tmp_path)) == str(tmp_path.resolve())
    with pytest.raises(ValueError, match="not-a-model.*smollm2-135m.*tiny-gpt2"):
        resolve_generator("not-a-model")
    with pytest.raises(ValueError, match="not-a-model"):
        load_generator("not-a-model")


def test_offline_hub_id_fails_with_hint():
    with pytest.raises(OSError, match="(?s)no-such-owner/no-such-model.*smollm2-135m"):
        load_generator("no-such-owner/no-such-model")


def test_embedder_normalised_and_semantic():
    embedder = load_embedder()
    assert load_embedder("sentence-transformers/all-MiniLM-L6-v2") is not None
    assert load_embedder() is embedder  # cached in-process
    texts = [
        "The striker scored twice as the football club won the league match.",
        "A late goal gave the home team victory in the football cup final.",
        "Parliament voted to raise the income tax rate for high earners.",
    ]
    e = embed(embedder, texts)
    assert e.dtype == np.float32 and e.shape == (3, 384)
    np.testing.assert_allclose(np.linalg.norm(e, axis=1), 1.0, atol=1e-5)
    sims = e @ e.T
    assert sims[0, 1] > sims[0, 2] + 0.2 and sims[0, 1] > sims[1, 2] + 0.2
    assert embed(embedder, []).shape == (0, 384)


def test_embedding_window_cuts_texts_and_restores_the_shared_embedder():
    """``max_tokens`` embeds only each text's first tokens (the vote's window); the cached,
    shared embedder keeps its own limit afterwards."""
    embedder = load_embedder()
    limit = embedder.max_seq_length
    head = "The striker scored twice as the football club won the league match"
    a, b = head + " and the fans sang all night.", head + " while parliament voted on the income tax rate."
    cut = embed(embedder, [a, b], max_tokens=8)
    np.testing.assert_allclose(cut[0], cut[1], atol=1e-6)  # the same first 8 tokens ([CLS] included)
    whole = embed(embedder, [a, b])
    assert float(whole[0] @ whole[1]) < 0.99  # without the window they differ
    assert embedder.max_seq_length == limit
    np.testing.assert_allclose(embed(embedder, [a], max_tokens=10_000), embed(embedder, [a]), atol=1e-6)


def test_conversion_is_published_atomically(tmp_path, monkeypatch):
    """Racing loaders never see a half-written folder: it appears complete, by one rename."""
    seen = []

    class FakeModel:
        def save_pretrained(self, path):
            (path / "model.safetensors").write_text("w")
            time.sleep(0.2)  # a window in which a non-atomic writer would expose a partial folder
            (path / "config.json").write_text("{}")

    class FakeTok:
        def save_pretrained(self, path):
            (path / "tokenizer.json").write_text("{}")

    import transformers

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", lambda *a, **k: FakeModel())
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: FakeTok())
    dest = models.smollm2_dir(tmp_path)

    def watch():
        for _ in range(100):
            if dest.is_dir():
                seen.append(sorted(p.name for p in dest.iterdir()))
            time.sleep(0.005)

    threads = [threading.Thread(target=models._ensure_smollm2, args=(tmp_path,)) for _ in range(2)]
    threads.append(threading.Thread(target=watch))
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(names == ["config.json", "model.safetensors", "tokenizer.json"] for names in seen)
    assert [p.name for p in dest.parent.iterdir() if p.is_dir()] == [dest.name]  # no temp dirs left


@pytest.mark.slow
def test_smollm2_converted_once_then_cached(tmp_path):
    models.clear_caches()
    t0 = time.perf_counter()
    model, tok = load_generator("smollm2-135m", cache_dir=tmp_path, device="cpu")
    first = time.perf_counter() - t0
    folder = models.smollm2_dir(tmp_path)
    assert (folder / "config.json").is_file() and (folder / "model.safetensors").is_file()
    assert type(model).__name__ == "LlamaForCausalLM" and model.dtype == torch.float32
    assert tok.pad_token is not None and tok.padding_side == "left"

    t0 = time.perf_counter()
    load_generator("smollm2-135m", cache_dir=tmp_path, device="cpu")
    copied = time.perf_counter() - t0
    models.clear_caches()
    t0 = time.perf_counter()
    again, _ = load_generator("smollm2-135m", cache_dir=tmp_path, device="cpu")
    cached = time.perf_counter() - t0
    print(f"\nSmolLM2 load: convert {first:.1f}s, from cache folder {cached:.1f}s, in-process copy {copied:.1f}s")
    sd, sd2 = model.state_dict(), again.state_dict()
    assert all(torch.equal(sd[k], sd2[k]) for k in sd)
