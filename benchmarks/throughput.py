"""Throughput of every model path on the device it runs on (CPU here, CUDA when present).

Usage: python -m benchmarks.throughput [--model smollm2-135m] [--batch-size 8] [--steps 3]
       [--max-length 64] [--generate 120] [--default-run] [--json out.json]

Prints, for this device: its own peak first (a large matmul in fp32 and bf16, and the
tokens/s of a plain forward pass of the model in each), then DP-SGD and non-private training
tokens/s (LoRA and full finetuning) and their ratio, generation tokens/s at the automatic
batch size, embedding texts/s (MiniLM), and with ``--default-run`` the default run's phase
times (one real ``flwr run`` through ``fedsyn run``'s client resources). Every model figure
also says what fraction of the peak it reaches: its FLOP/s (2 x parameters per token for a
forward; x2 for a LoRA step, whose frozen weights need only the backward to the activations; x3 for
a full-finetuning step) over the matmul peak of the dtype it ran in, so each number
says how far it is from this machine's limit. Training tokens are the padded B x L tokens a
step processes; generation tokens are the new tokens actually produced. Training is timed over
one call of ``--steps`` steps after a one-step warm-up call.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import torch

from common.codes import code_prompt
from common.config import RunConfig
from common.devices import client_resources, default_device, native_bf16


def bbc_records(n: int) -> tuple[list[str], list[str]]:
    """The first ``n`` BBC News articles and their codes (the embedded default dataset)."""
    from common.data import to_text_data
    from common.tables import load_table

    data = to_text_data(load_table("bbc-news"), "text", ["topic"])
    return data.texts[:n], data.codes[:n]


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def matmul_peak(dtype: torch.dtype, n: int = 2048, repeat: int = 10) -> float:
    """GFLOP/s of an n x n matmul in ``dtype`` on the default device: the machine's practical peak."""
    device = default_device()
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    a @ b  # warm-up
    _sync()
    t0 = time.perf_counter()
    for _ in range(repeat):
        a @ b
    _sync()
    return 2 * n ** 3 * repeat / (time.perf_counter() - t0) / 1e9


def forward_throughput(model_name: str, dtype: torch.dtype, batch: int, length: int, repeat: int = 3) -> float:
    """Tokens/s of a plain forward pass (no grad) of ``model_name`` on B x L tokens in ``dtype``."""
    from common.models import load_generator

    model, _ = load_generator(model_name)
    model.eval()
    ids = torch.randint(0, model.config.vocab_size, (batch, length), device=default_device())
    with torch.inference_mode(), torch.autocast(ids.device.type, dtype=dtype, enabled=dtype != torch.float32):
        model(input_ids=ids)
        _sync()
        t0 = time.perf_counter()
        for _ in range(repeat):
            model(input_ids=ids)
        _sync()
    return batch * length * repeat / (time.perf_counter() - t0)


def flops_per_token(model_name: str) -> float:
    """Forward FLOPs per token: 2 x the parameters that take part (the tied output layer counted)."""
    from common.models import load_generator

    model, _ = load_generator(model_name)
    params = sum(p.numel() for p in model.parameters())
    embedding = model.get_input_embeddings().weight.numel()
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    return 2.0 * (params - embedding + (embedding if tied else 0))


def train_throughput(model_name: str, finetune: str, private: bool, batch: int, steps: int,
                     max_length: int) -> float:
    """Training tokens/s (B x L per step): one call of ``steps`` steps, timed after a 1-step warm-up
    call. q = 1 (the batch is all B records), so every step costs exactly B x L tokens; the
    per-call setup (Opacus wrapping, tokenising) is included, as in a real round."""
    from common.models import load_generator
    from common.weights import prepare_model
    from fedsyn_client.training import TrainSettings, dp_train

    texts, codes = bbc_records(batch)
    model, tok = load_generator(model_name)
    model = prepare_model(model, finetune, 2, seed=0)

    def run(n: int) -> float:
        settings = TrainSettings(local_steps=n, batch_size=batch, learning_rate=1e-4, max_length=max_length,
                                 max_grad_norm=1.0, noise_multiplier=1.0 if private else 0.0, private=private)
        _sync()
        t0 = time.perf_counter()
        dp_train(model, tok, texts, codes, settings, 1e-5, [])
        _sync()
        return time.perf_counter() - t0

    run(1)  # warm-up: allocation, kernels, grad samplers
    return steps * batch * max_length / run(steps)


def generation_throughput(model_name: str, prompts: int, max_new_tokens: int) -> tuple[float, int]:
    """(new tokens/s, batch size) of generating ``prompts`` texts at the automatic batch size."""
    from common.models import load_generator
    from fedsyn_server.generation import auto_batch_size, generate_texts

    model, tok = load_generator(model_name)
    batch = auto_batch_size(model, prompts, 8 + max_new_tokens)
    codes = [f"topic={t}" for t in ("business", "sport", "tech", "politics")]
    ps = [code_prompt(codes[i % len(codes)]) for i in range(prompts)]
    generate_texts(model, tok, ps[: min(4, prompts)], max_new_tokens=4, batch_size=batch, progress=False)  # warm-up
    _sync()
    t0 = time.perf_counter()
    texts = generate_texts(model, tok, ps, max_new_tokens=max_new_tokens, batch_size=batch, progress=False)
    _sync()
    seconds = time.perf_counter() - t0
    produced = sum(len(tok(t, add_special_tokens=False)["input_ids"]) for t in texts)
    return produced / seconds, batch


def embedding_throughput(n: int, max_tokens: int | None = None) -> float:
    """MiniLM texts/s on ``n`` BBC articles (after a warm-up batch), each cut to its first
    ``max_tokens`` tokens (the vote's window, ``max-length``) or whole (MiniLM's 256)."""
    from common.models import embed, load_embedder

    texts, _ = bbc_records(n)
    embedder = load_embedder()
    embed(embedder, texts[:16], max_tokens=max_tokens)
    t0 = time.perf_counter()
    embed(embedder, texts, max_tokens=max_tokens)
    return n / (time.perf_counter() - t0)


def default_run_phases() -> dict[str, float]:
    """Phase times (s) of one default ``flwr run`` with the client resources ``fedsyn run`` sets."""
    import os
    import tempfile

    from common.devices import gpu_on_machine
    from fedsyn_server.flwr_runner import run_app

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else gpu_on_machine()
    resources = client_resources(gpus, os.cpu_count() or 1)
    fed = " ".join(f"{k}={v}" for k, v in resources.items()) or None
    res = run_app({"out-dir": tempfile.mkdtemp(prefix="fedsyn-tp-"), "run-name": "default"},
                  federation_config=fed, timeout=3600)
    if not res.ok or res.run_dir is None:
        raise RuntimeError(f"the default run failed: {res.status}\n{res.output[-3000:]}")
    timings = json.loads((res.run_dir / "metrics.json").read_text())["timings_s"]
    return {**{k: round(v, 1) for k, v in timings.items()}, "wall": round(res.seconds, 1)}


def main(argv: list[str] | None = None) -> int:
    """Measure and print the table; optionally write JSON."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--max-length", type=int, default=64)
    ap.add_argument("--generate", type=int, default=120,
                    help="texts to generate (64 new tokens each; 120 = the default pool)")
    ap.add_argument("--embed", type=int, default=256, help="texts to embed")
    ap.add_argument("--default-run", action="store_true", help="also time one default flwr run")
    ap.add_argument("--json", default=None, help="write the results here as JSON")
    args = ap.parse_args(argv)

    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else f"cpu ({torch.get_num_threads()} threads)"
    out: dict[str, Any] = {"device": device, "model": args.model, "batch_size": args.batch_size,
                           "max_length": args.max_length, "torch": torch.__version__,
                           "native_bf16": native_bf16(default_device())}
    # The machine's own limits first: every later figure is read against them.
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        slow = name == "bf16" and not out["native_bf16"]  # emulated: a small matrix says enough
        out[f"peak_matmul_{name}_gflops"] = round(matmul_peak(dtype, n=512 if slow else 2048,
                                                          repeat=2 if slow else 10), 1)
        if slow:
            # emulated bf16 (0.3 GFLOP/s on an AVX2 CPU) would take minutes per forward; training and
            # generation do not use it here either (precision = auto)
            print(f"peak matmul bf16: {out['peak_matmul_bf16_gflops']} GFLOP/s (emulated: not used)", flush=True)
            continue
        out[f"forward_{name}_tokens_per_s"] = round(forward_throughput(args.model, dtype, args.batch_size,
                                                                       args.max_length), 1)
        print(f"peak matmul {name}: {out[f'peak_matmul_{name}_gflops']} GFLOP/s; forward {name}: "
              f"{out[f'forward_{name}_tokens_per_s']} tokens/s", flush=True)
    flops = flops_per_token(args.model)
    # Training and generation run in bf16 where the device computes it natively (precision = auto):
    # their fraction is of that dtype's peak; each forward's of its own dtype's.
    used = "bf16" if out["native_bf16"] else "fp32"
    out["peak_used"] = used

    def of_peak(tokens_per_s: float, factor: float, dtype: str = used) -> float:
        return round(tokens_per_s * flops * factor / (out[f"peak_matmul_{dtype}_gflops"] * 1e9), 3)

    for name in ("fp32", "bf16"):
        if f"forward_{name}_tokens_per_s" in out:
            out[f"forward_{name}_of_peak"] = of_peak(out[f"forward_{name}_tokens_per_s"], 1, name)
    for finetune in ("lora", "full"):
        for private in (True, False):
            key = f"train_{finetune}_{'dp' if private else 'nondp'}_tokens_per_s"
            out[key] = round(train_throughput(args.model, finetune, private, args.batch_size, args.steps,
                                              args.max_length), 1)
            out[key.replace("_tokens_per_s", "_of_peak")] = of_peak(out[key], 2 if finetune == "lora" else 3)
            print(f"{key}: {out[key]} ({out[key.replace('_tokens_per_s', '_of_peak')]:.1%} of the {used} peak)",
                  flush=True)
        out[f"dp_over_nondp_{finetune}"] = round(out[f"train_{finetune}_nondp_tokens_per_s"]
                                                 / out[f"train_{finetune}_dp_tokens_per_s"], 2)
    tps, batch = generation_throughput(args.model, args.generate, 64)
    out.update(generation_tokens_per_s=round(tps, 1), generation_batch_size=batch,
               generation_of_peak=of_peak(tps, 1))
    out["embedding_texts_per_s"] = round(embedding_throughput(args.embed), 1)
    out["embedding_vote_window_texts_per_s"] = round(embedding_throughput(args.embed, RunConfig().vote_window), 1)
    if args.default_run:
        out["default_run_phases_s"] = default_run_phases()
    print(f"\nthroughput on {device} ({default_device()}):")
    for k, v in out.items():
        print(f"  {k:34} {v}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
