"""A synthetic table against real rows (issue 25): fidelity, dependence, efficacy, memorisation.

- ``column_fidelity``: per column, 1 - the Kolmogorov-Smirnov statistic (numbers, dates;
  ``scipy.stats.ks_2samp``) or 1 - the total variation distance of the category shares.
- ``pair_dependence``: per pair of columns, 1 - |Pearson r_real - r_syn| / 2 for two numbers,
  else 1 - the total variation distance of the two columns' joint shares (numbers cut into
  the real column's quartiles).
- ``efficacy``: train on the synthetic rows, test on real held-out rows, against train on real
  (when real training rows are given); accuracy and macro-F1 of a ``target`` column
  (scikit-learn's histogram gradient boosting on one-hot categories).
- ``closest_record``: the distance of each synthetic row to its closest real training row
  (numbers scaled by the real range, categories one-hot; ``NearestNeighbors``), against the
  distances of real held-out rows to the same training rows: synthetic rows much closer than
  held-out ones are copies.

These are the SDMetrics definitions (KSComplement, TVComplement, CorrelationSimilarity,
ContingencySimilarity, DCR). SDMetrics itself pins pandas < 3 in its current releases (ours is
3.1), so the few lines each are written here on scipy and scikit-learn.
"""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import pandas as pd

from common.rows import Schema


def _numeric(series: pd.Series, kind: str) -> np.ndarray:
    if kind == "date":
        return pd.to_datetime(series).map(pd.Timestamp.toordinal).to_numpy(dtype=float)
    return pd.to_numeric(series).to_numpy(dtype=float)


def _shares(values: pd.Series, categories: list[Any]) -> np.ndarray:
    counts = values.value_counts()
    out = np.array([float(counts.get(c, 0)) for c in categories])
    return out / max(out.sum(), 1.0)


def column_fidelity(real: pd.DataFrame, syn: pd.DataFrame, schema: Schema) -> dict[str, float]:
    """Column name -> similarity in [0, 1] of its marginal in ``syn`` to that in ``real``."""
    from scipy.stats import ks_2samp

    out = {}
    for col in schema.columns:
        if col.type == "categorical":
            tv = 0.5 * np.abs(_shares(real[col.name], list(col.categories)) -
                              _shares(syn[col.name], list(col.categories))).sum()
            out[col.name] = float(1.0 - tv)
        else:
            out[col.name] = float(1.0 - ks_2samp(_numeric(real[col.name], col.type),
                                                 _numeric(syn[col.name], col.type)).statistic)
    return out


def _binned(series: pd.Series, kind: str, edges: np.ndarray | None) -> pd.Series:
    if edges is None:
        return series.astype(str)
    return pd.Series(np.searchsorted(edges, _numeric(series, kind), side="right"), index=series.index).astype(str)


def pair_dependence(real: pd.DataFrame, syn: pd.DataFrame, schema: Schema) -> dict[str, float]:
    """``"a | b"`` -> similarity in [0, 1] of the two columns' dependence in ``syn`` and ``real``."""
    edges = {c.name: (None if c.type == "categorical" else
                      np.unique(np.quantile(_numeric(real[c.name], c.type), [0.25, 0.5, 0.75])))
             for c in schema.columns}
    out = {}
    for a, b in itertools.combinations(schema.columns, 2):
        if a.type != "categorical" and b.type != "categorical":
            r_real = np.corrcoef(_numeric(real[a.name], a.type), _numeric(real[b.name], b.type))[0, 1]
            r_syn = np.corrcoef(_numeric(syn[a.name], a.type), _numeric(syn[b.name], b.type))[0, 1]
            score = 1.0 - abs(np.nan_to_num(r_real) - np.nan_to_num(r_syn)) / 2.0
        else:
            joint_real = (_binned(real[a.name], a.type, edges[a.name]) + "|"
                          + _binned(real[b.name], b.type, edges[b.name]))
            joint_syn = _binned(syn[a.name], a.type, edges[a.name]) + "|" + _binned(syn[b.name], b.type, edges[b.name])
            cells = sorted(set(joint_real) | set(joint_syn))
            score = 1.0 - 0.5 * np.abs(_shares(joint_real, cells) - _shares(joint_syn, cells)).sum()
        out[f"{a.name} | {b.name}"] = float(score)
    return out


def _features(frame: pd.DataFrame, schema: Schema, columns: list[str], real: pd.DataFrame) -> np.ndarray:
    """Numbers scaled by the real column's range, categories one-hot (the schema's categories)."""
    parts = []
    for name in columns:
        col = schema.column(name)
        if col.type == "categorical":
            parts.append(np.stack([(frame[name] == c).to_numpy(dtype=float) for c in col.categories], axis=1))
        else:
            ref = _numeric(real[name], col.type)
            span = float(ref.max() - ref.min()) or 1.0
            parts.append(((_numeric(frame[name], col.type) - ref.min()) / span)[:, None])
    return np.hstack(parts)


def efficacy(syn: pd.DataFrame, test: pd.DataFrame, schema: Schema, target: str,
             real_train: pd.DataFrame | None = None, seed: int = 0) -> dict[str, Any]:
    """Accuracy and macro-F1 on ``test`` of a classifier of ``target`` trained on ``syn`` (and,
    with ``real_train``, the same trained on real rows: the reference)."""
    from sklearn.ensemble import HistGradientBoostingClassifier
    from sklearn.metrics import accuracy_score, f1_score

    features = [c for c in schema.names if c != target]
    ref = real_train if real_train is not None else test
    x_test, y_test = _features(test, schema, features, ref), test[target].astype(str).to_numpy()

    def score(train: pd.DataFrame) -> dict[str, float] | None:
        y = train[target].astype(str).to_numpy()
        if len(set(y)) < 2:
            return None  # one class: nothing to learn
        model = HistGradientBoostingClassifier(random_state=seed).fit(_features(train, schema, features, ref), y)
        pred = model.predict(x_test)
        return {"accuracy": float(accuracy_score(y_test, pred)),
                "macro_f1": float(f1_score(y_test, pred, average="macro"))}

    return {"target": target, "n_train": len(syn), "n_test": len(test), "synthetic": score(syn),
            "real": score(real_train) if real_train is not None else None}


def closest_record(syn: pd.DataFrame, real_train: pd.DataFrame, real_holdout: pd.DataFrame,
                   schema: Schema) -> dict[str, float]:
    """Median and 5th percentile of each synthetic row's distance to its closest real training row,
    the same for real held-out rows, and the share of synthetic rows closer than the held-out
    rows' 5th percentile (about 0.05 when nothing is copied)."""
    from sklearn.neighbors import NearestNeighbors

    names = list(schema.names)
    index = NearestNeighbors(n_neighbors=1).fit(_features(real_train, schema, names, real_train))
    d_syn = index.kneighbors(_features(syn, schema, names, real_train))[0][:, 0]
    d_hold = index.kneighbors(_features(real_holdout, schema, names, real_train))[0][:, 0]
    p5 = float(np.percentile(d_hold, 5))
    return {"synthetic_median": float(np.median(d_syn)), "synthetic_p5": float(np.percentile(d_syn, 5)),
            "holdout_median": float(np.median(d_hold)), "holdout_p5": p5,
            "share_closer_than_holdout_p5": float(np.mean(d_syn < p5))}


def evaluate_table(syn: pd.DataFrame, test: pd.DataFrame, schema: Schema, target: str,
                   real_train: pd.DataFrame | None = None, seed: int = 0) -> dict[str, Any]:
    """Every table metric above as one JSON-ready dict (``closest_record`` needs ``real_train``), over
    the schema's columns but its free-text one (scored as text: ``evaluate_sets``)."""
    schema = schema.structured()
    fidelity, dependence = column_fidelity(test, syn, schema), pair_dependence(test, syn, schema)
    return {
        "n_synthetic": len(syn), "n_real": len(test),
        "column_fidelity": fidelity, "column_fidelity_mean": float(np.mean(list(fidelity.values()))),
        "pair_dependence": dependence, "pair_dependence_mean": float(np.mean(list(dependence.values()))),
        "efficacy": efficacy(syn, test, schema, target, real_train, seed),
        "closest_record": closest_record(syn, real_train, test, schema) if real_train is not None else None,
    }


def records_frame(texts: list[str], codes: list[str], schema: Schema) -> pd.DataFrame:
    """Records (a row's text and its control code) as a frame typed by ``schema``; a text that is
    not a row of it is left out."""
    from common.codes import parse_code
    from common.rows import RowError, record_row

    rows = []
    for text, code in zip(texts, codes):
        try:
            rows.append(record_row(text, parse_code(code), schema))
        except RowError:
            continue
    return pd.DataFrame(rows, columns=list(schema.names))


def table_rows(frame: pd.DataFrame, schema: Schema) -> tuple[pd.DataFrame, int]:
    """The rows of ``frame`` that are rows of ``schema`` (typed by it), and how many were not."""
    from common.rows import RowError

    def cell(value: Any, kind: str) -> str:  # a file's value as the text the schema reads
        if kind == "date" and hasattr(value, "isoformat"):
            return (value.date() if hasattr(value, "date") else value).isoformat()
        if kind == "integer" and isinstance(value, float) and value.is_integer():
            return str(int(value))  # a CSV column with a gap reads as floats
        return str(value)

    rows, bad = [], 0
    for raw in frame.to_dict("records"):
        try:
            rows.append({c.name: c.read(cell(raw[c.name], c.type)) for c in schema.columns})
        except (KeyError, RowError):
            bad += 1
    return pd.DataFrame(rows, columns=list(schema.names)), bad


def evaluate_table_files(synthetic: str, real: str, schema: Schema, target: str, real_train: str | None = None,
                         seed: int = 0) -> dict[str, Any]:
    """``evaluate_table`` on files (CSV / JSONL / Parquet, e.g. a run's ``synthetic.parquet``);
    rows outside ``schema`` are left out and counted (``rows_outside_schema``)."""
    from common.tables import load_table

    if target not in schema.names or schema.column(target).type != "categorical":
        raise ValueError(f"--target {target!r} must be a categorical column of the schema "
                         f"({[c.name for c in schema.columns if c.type == 'categorical']})")
    frames, outside = {}, {}
    for name, path in (("synthetic", synthetic), ("real", real), ("real_train", real_train)):
        if path:
            frames[name], outside[name] = table_rows(load_table(path), schema)
            if frames[name].empty:
                raise ValueError(f"{path}: no row is a row of the schema ({outside[name]} rows outside it); "
                                 "check the column names, categories and ranges")
    return {"synthetic": synthetic, "real": real, "rows_outside_schema": outside,
            "table": evaluate_table(frames["synthetic"], frames["real"], schema, target, frames.get("real_train"),
                                    seed)}
