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


def test_the_limit_flag_says_which_texts_the_token_limit_stopped(tiny):
    from fedsyn_server.generation import generate_samples

    model, tok = tiny
    samples = generate_samples(model, tok, PROMPTS, max_new_tokens=4, batch_size=2, progress=False)
    assert len(samples) == len(PROMPTS) and all(hit for _, hit in samples)  # a random model never says eos in 4
    eos_first = model.generate  # a model that says eos at once is never stopped by the limit

    def immediate_eos(**kw):
        out = eos_first(**{**kw, "max_new_tokens": 1})
        out[:, -1] = tok.eos_token_id
        return out

    model.generate = immediate_eos
    try:
        assert all(not hit for _, hit in generate_samples(model, tok, PROMPTS, max_new_tokens=4, progress=False))
    finally:
        del model.generate


def test_no_empty_or_prompt_copy_text_is_written(monkeypatch):
    """The server asks again for unusable texts, drops what stays unusable, and counts both."""
    from common.config import RunConfig
    from fedsyn_server.synthesis import REGENERATE, ServerModel

    server = ServerModel(RunConfig(model="tiny-gpt2"))
    calls = []

    def samples(prompts, max_new_tokens, seed, unconditional=None):
        calls.append(len(prompts))
        # guidance's other prompt, one per text asked for: the code's keys, no value
        assert unconditional == [server.unconditional_prompt("topic=x")] * len(prompts)
        out = []
        for i, p in enumerate(prompts):
            if len(calls) == 1:  # first attempt: every kind of unusable text, and two good ones
                out.append([("", False), (p.strip(), False), ("goal " * 8, False), ("A fine report on the matc", True),
                            ("The vote was close.", False)][i % 5])
            else:  # later attempts: the prompt-copy becomes usable; the empty one never does
                out.append(("", False) if i == 0 else ("The market rose again.", False))
        return out

    monkeypatch.setattr(server, "_samples", samples)
    texts, codes = server.generate({"topic=a": 3, "topic=b": 2}, seed=0)
    # 5 texts and a spare per code (unusable here too), then the unusable ones asked again, REGENERATE times at most
    assert calls == [7, 3, 1] and len(calls) == 1 + REGENERATE
    assert all(t.strip() for t in texts) and not any(t == server.prompt(c).strip() for t, c in zip(texts, codes))
    assert "A fine report on the" in texts  # the limit's cut word is trimmed, the text kept
    report = server.generation_report()
    assert report["written"] == len(texts) == 4 and report["dropped"] == 1
    assert report["rejected"] == {"empty": 4, "prompt-copy": 2, "repetition": 1}
    assert report["per_code"] == {"topic=a": {"allocated": 3, "written": 2}, "topic=b": {"allocated": 2, "written": 2}}
    assert report["spares"] == {"written": 2, "used": 0}


def test_a_spare_of_the_same_code_stands_in_for_an_unusable_text(monkeypatch):
    """Issue 61: one unusable text no longer costs a batch of its own; a spare written beside the
    allocation takes its place, and only a code without a usable spare asks again."""
    from common.config import RunConfig
    from fedsyn_server.synthesis import ServerModel, filled_from_spares, spare_codes

    server = ServerModel(RunConfig(model="tiny-gpt2"))
    calls = []

    def samples(prompts, max_new_tokens, seed, unconditional=None):
        calls.append(len(prompts))
        return [("", False) if i == 0 else (f"Usable text number {i} of call {len(calls)}.", False)
                for i in range(len(prompts))]

    monkeypatch.setattr(server, "_samples", samples)
    texts, codes = server.generate({"topic=a": 3, "topic=b": 2}, seed=0)
    assert calls == [7] and codes == ["topic=a"] * 3 + ["topic=b"] * 2
    assert texts[0] == "Usable text number 5 of call 1." and len(set(texts)) == 5  # topic=a's spare, in slot 0
    assert server.generation_report()["spares"] == {"written": 2, "used": 1}
    # pure: spares are used in order and per code; a code without one keeps its gap
    assert spare_codes({"a": 120, "b": 1, "c": 0}) == ["a"] * 3 + ["b"]
    filled, used = filled_from_spares(["a", "a", "b", "c"], [None, "x", None, None], ["a", "a", "b"],
                                      [None, "s1", "s2"])
    assert filled == ["s1", "x", "s2", None] and used == 2


# ------------------------------------------------------------ the sampler and the batch size (pure)
def test_draw_follows_the_distribution_and_never_draws_a_zero():
    from fedsyn_server.generation import draw

    torch.manual_seed(0)
    p = torch.tensor([0.0, 0.1, 0.0, 0.6, 0.3])
    drawn = draw(p.expand(40_000, 5).clone() * 7.0).squeeze(1)  # any positive total
    freq = torch.bincount(drawn, minlength=5).float() / drawn.numel()
    assert freq[0] == 0 and freq[2] == 0
    assert torch.allclose(freq, p, atol=0.01)  # 40k draws: 3 sigma of 0.6 is 0.0073


def test_inverse_cdf_sampler_matches_temperature_and_nucleus():
    from fedsyn_server.generation import InverseCdfSampler

    torch.manual_seed(1)
    scores = torch.log(torch.tensor([[0.5, 0.25, 0.15, 0.1]])).expand(40_000, 4).clone()
    picks = InverseCdfSampler(0.5, 1.0)(None, scores).argmax(dim=1)
    want = torch.softmax(scores[0] / 0.5, dim=0)  # temperature 0.5 sharpens
    assert torch.allclose(torch.bincount(picks, minlength=4).float() / 40_000, want, atol=0.01)
    picks = InverseCdfSampler(1.0, 0.7)(None, scores).argmax(dim=1)  # nucleus {0.5, 0.25}: 0.5 + 0.25 >= 0.7
    freq = torch.bincount(picks, minlength=4).float() / 40_000
    assert freq[2] == 0 and freq[3] == 0 and abs(freq[0] - 2 / 3) < 0.01
    out = InverseCdfSampler(1.0, 0.1)(None, scores[:3])  # top_p below the top token: only it
    assert (out.argmax(dim=1) == 0).all() and torch.isinf(out).sum(dim=1).eq(3).all()
    with pytest.raises(ValueError, match="top_p"):
        InverseCdfSampler(1.0, 0.0)


def test_batch_size_comes_from_memory_within_the_cap_and_the_prompts():
    from fedsyn_server.generation import MEMORY_SHARE, batch_size_for, bytes_per_row

    assert batch_size_for(free_bytes=1e12, bytes_per_row=1e6, prompts=120, cap=128) == 120  # all prompts
    assert batch_size_for(1e12, 1e6, prompts=1000, cap=128) == 128  # the device's cap
    assert batch_size_for(40e6 / MEMORY_SHARE, 1e6, prompts=1000, cap=128) == 40  # memory
    assert batch_size_for(0.0, 1e6, prompts=1000, cap=128) == 1  # always at least one row
    model, _ = load_generator("tiny-gpt2")
    cfg = model.config
    kv = 2 * cfg.num_hidden_layers * cfg.hidden_size * 100 * 4
    assert bytes_per_row(model, 100) == kv + 8 * 4 * cfg.vocab_size
    assert bytes_per_row(model, 200) > bytes_per_row(model, 100)


def test_the_token_limit_defaults_to_the_window_phase_1_trained():
    from common.config import RunConfig
    from fedsyn_server.synthesis import ServerModel

    server = ServerModel(RunConfig(model="tiny-gpt2", max_length=40))
    prompts = [server.prompt("topic=sport"), server.prompt("topic=entertainment")]
    longest = max(len(server.tokenizer(p)["input_ids"]) for p in prompts)
    assert server.new_tokens(prompts) == 40 - longest < 40  # records were cut at max-length, prompt included
    seen = []
    server._samples = lambda ps, n, seed, unconditional=None: seen.append(n) or [("A usable text.", False)] * len(ps)
    server.generate({"topic=sport": 1, "topic=entertainment": 1}, seed=0)
    assert seen == [40 - longest]
    server.variation(["one two three four"], ["topic=sport"], seed=0)
    assert seen[-1] == (40 - len(server.tokenizer(prompts[0])["input_ids"])) // 2
    assert ServerModel(RunConfig(model="tiny-gpt2", max_new_tokens=7)).new_tokens(prompts) == 7  # explicit wins
    assert ServerModel(RunConfig(model="tiny-gpt2", prompt="zero-shot", max_length=40)).new_tokens(prompts) == 40


def test_guidance_draws_from_the_guided_distribution_and_one_is_off(tiny):
    """Greedy decoding under guidance g picks argmax(u + g (c - u)) of the log-probabilities after
    the prompt (c) and after its unconditional prompt (u), computed here by hand; g = 1 is plain
    sampling; the unconditional prompt keeps the code's keys and drops its values."""
    from common.codes import unconditional_prompt
    from common.config import ConfigError, RunConfig
    from fedsyn_server.generation import generate_samples

    model, tok = tiny
    template = "Please generate a news article about {fields}:\n\n"
    assert unconditional_prompt("topic=sport|region=uk", "instruction", template) == (
        "Please generate a news article about topic: any, region: any:\n\n")
    prompts = [f"topic: {t}\n\n" for t in ("sport", "business", "tech")]
    plain = [unconditional_prompt(f"topic={t}", "code") for t in ("sport", "business", "tech")]
    assert set(plain) == {"topic: any\n\n"}

    def logprobs(text: str) -> torch.Tensor:
        with torch.inference_mode():
            return torch.log_softmax(model(**tok(text, return_tensors="pt")).logits[0, -1].float(), dim=-1)

    greedy = {"max_new_tokens": 1, "temperature": 0, "batch_size": 1, "progress": False,
              "precision": "fp32"}  # as the reference below; one row a call: no padding, no near-tie flips
    unguided = generate_samples(model, tok, prompts, **greedy)
    assert generate_samples(model, tok, prompts, guidance=1.0, unconditional=plain, **greedy) == unguided
    guided = generate_samples(model, tok, prompts, guidance=4.0, unconditional=plain, **greedy)
    u = logprobs(plain[0])
    want = [tok.decode(int(torch.argmax(u + 4.0 * (logprobs(p) - u)))).strip() for p in prompts]
    assert [t for t, _ in guided] == want and guided != unguided
    with pytest.raises(ValueError, match="unconditional prompts"):
        generate_samples(model, tok, prompts, guidance=2.0, unconditional=plain[:1], **greedy)
    for bad in (0.5, 11.0):
        with pytest.raises(ConfigError, match="guidance"):
            RunConfig(guidance=bad).validate()
