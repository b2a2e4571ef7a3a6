"""Evaluate one synthetic set against real data: embed both once, compute every metric.

``evaluate_sets`` takes texts and codes, ``evaluate_files`` two CSV / JSONL / Parquet files
(``fedsyn evaluate`` on the command line); ``write_evaluation`` stores a result as a run's
``evaluation.json`` is stored: the same shape, so one reader reads both.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from common.codes import parse_code
from common.data import CODE_FIELD, TextData, to_text_data
from common.io import atomic_write_json
from common.tables import load_table
from fedsyn_server.evaluation.alignment import (
    MAUVE_MISSING,
    allocation_error,
    frechet_distance,
    knn_precision_recall,
    mauve_available,
    mauve_score,
)
from fedsyn_server.evaluation.utility import CLASSIFIERS, downstream_utility, label_agreement, transformer_utility

if TYPE_CHECKING:
    import pandas as pd
    from sentence_transformers import SentenceTransformer

DEFAULT_EMBEDDER = "all-MiniLM-L6-v2"
JOINT_LABEL = CODE_FIELD  # utility key for the full code when there are several columns


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


def cached_embeddings(model: Any, name: str, texts: Sequence[str]) -> Any:
    """``common.models.embed(model, texts)``, kept on disk under the fedsyn cache
    (``<cache>/embeddings``) by a hash of the embedder, its token limit, the library versions and the
    texts: a run's held-out split is the same public records in every run of a dataset and seed, and
    embedding its 223 BBC articles at 256 tokens was most of the evaluation's time. For public texts
    only (the caller says so): the vectors of private records must not outlive the call."""
    import io

    import numpy as np
    import sentence_transformers
    import torch

    from common.io import atomic_write_bytes
    from common.models import embed, public_cache_path

    path = public_cache_path("embeddings", [name, _embedder_name(model), getattr(model, "max_seq_length", None),
                                            sentence_transformers.__version__, torch.__version__, list(texts)], ".npy")
    try:
        found = np.load(path, allow_pickle=False)
        if found.shape[0] == len(texts):
            return found
    except (OSError, ValueError):
        pass
    vectors = embed(model, list(texts))
    try:
        buf = io.BytesIO()
        np.save(buf, vectors, allow_pickle=False)
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(path, buf.getvalue())
    except OSError:
        pass  # a cache that cannot be written costs the next run the time, nothing else
    return vectors


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
    cache_real: bool = False,
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
    note) when ``mauve`` is False or the package is missing. ``cache_real``: the real texts are
    public (a run's held-out split): their embeddings are kept on disk for the next run
    (``cached_embeddings``).

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
    syn_emb = embed(model, syn.texts)
    real_emb = cached_embeddings(model, embedder_name, real.texts) if cache_real else embed(model, real.texts)
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
        raise ValueError(f"{path}: column {CODE_FIELD!r} is empty; pass --control-columns (Python: control_columns=)")
    columns = list(parse_code(codes.iloc[0]))
    for code in codes:
        if list(parse_code(code)) != columns:
            raise ValueError(
                f"{path}: control codes do not all have the same columns ({codes.iloc[0]!r} vs "
                f"{code!r}); pass --control-columns (Python: control_columns=)"
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
    ``out``, the result is also written there (see ``write_evaluation``).
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
                    f"{CODE_FIELD!r} column; pass --control-columns (Python: control_columns=) "
                    f"(available in {synthetic}: "
                    f"{[str(c) for c in syn_df.columns]})"
                )
            control_columns = _columns_from_codes(real_df, real)
    syn = _to_records(syn_df, synthetic, text_column, control_columns)
    ref = _to_records(real_df, real, text_column, control_columns)
    result = {
        "synthetic_path": (str(Path(synthetic).expanduser().resolve()) if Path(synthetic).expanduser().exists()
                           else synthetic),
        "real_path": str(Path(real).expanduser().resolve()) if Path(real).expanduser().exists() else real,
        "text_column": text_column,
        **evaluate_sets(syn.texts, syn.codes, ref.texts, ref.codes, control_columns, **options),
    }
    if out is not None:
        write_evaluation(out, result)
    return result


def write_evaluation(path: str | Path, result: dict[str, Any]) -> Path:
    """Write ``result`` (an evaluation) to ``path`` atomically and return the path.

    Only an earlier evaluation is replaced: any other existing file (a run's ``metrics.json``,
    someone's data) raises ValueError naming it, and is left as it was.
    """
    path = Path(path).expanduser()
    current: dict[str, Any] = {}
    if path.exists():
        try:
            current = json.loads(path.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise ValueError(f"{path} exists and is not an evaluation; choose another output file") from err
        if not isinstance(current, dict) or not ("utility" in current or "table" in current):
            raise ValueError(f"{path} exists and is not an evaluation; choose another output file")
    return atomic_write_json(path, result)
