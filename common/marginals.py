"""A table as bin indices over its public schema, and back: what every marginal method counts.

A categorical column's domain is its declared categories; a number or date column is cut into
equal-width bins over its declared [min, max] (never the data's own range, which would be an
un-noised statistic). Sampled bins become values drawn uniformly inside the bin. Used by the
marginal baselines (``benchmarks/baselines``: MST, AIM) and by the federated marginals of issue 48,
where a node counts its rows over these bins: so nothing here reads anything but the schema and
the rows it is given.
"""

from __future__ import annotations

import datetime as dt
import math
from typing import Any

import numpy as np
import pandas as pd

from common.rows import Column, Schema


def _range(column: Column) -> tuple[float, float]:
    """The declared [min, max] of a number or date column (dates as day ordinals)."""
    if column.min is None or column.max is None:
        raise ValueError(f"column {column.name!r}: marginals (table-method = 'marginals', MST, AIM) need declared "
                         f"ranges: give the {column.type} column "
                         "a 'min' and a 'max' in the schema (bins are cut from them, never from the data)")
    if column.type == "date":
        return (float(dt.date.fromisoformat(str(column.min)).toordinal()),
                float(dt.date.fromisoformat(str(column.max)).toordinal()))
    return float(column.min), float(column.max)


def _whole_range(column: Column) -> tuple[int, int]:
    """The first and last whole value (integer, or day ordinal) an integer or date column allows."""
    lo, hi = _range(column)
    first, last = math.ceil(lo), math.floor(hi)
    if first > last:
        raise ValueError(f"column {column.name!r}: no whole value lies in [{column.min}, {column.max}]")
    return first, last


def domain_size(column: Column, bins: int) -> int:
    """The number of discrete values ``column`` takes: in a column and the bin count, out its
    categories' count, or ``bins`` (fewer for an integer or date range with fewer whole values,
    one for a float column whose min equals its max)."""
    if bins < 1:
        raise ValueError("bins must be >= 1")
    if column.type == "text":
        raise ValueError(f"column {column.name!r} is free text: it has no bins, and no marginal counts it")
    if column.type == "categorical":
        return len(column.categories)
    if column.type == "float":
        lo, hi = _range(column)
        return bins if hi > lo else 1
    first, last = _whole_range(column)
    return min(bins, last - first + 1)


def has_domain(column: Column, bins: int) -> bool:
    """Whether ``column`` has a finite domain from the schema alone (``domain_size`` does not raise)."""
    try:
        domain_size(column, bins)
    except ValueError:
        return False
    return True


def bin_edges(column: Column, bins: int) -> np.ndarray:
    """The ``domain_size + 1`` bin edges of a number or date column, from its declared range only.

    Floats: equal-width bins over [min, max]. Integers and dates (day ordinals): equal-width bins
    over [first, last + 1), each whole value owning the unit interval above it, so that no bin is
    empty of whole values and a range of at most ``bins`` values gets one bin per value.
    """
    k = domain_size(column, bins)
    if column.type == "categorical":
        raise ValueError(f"column {column.name!r}: a categorical column has no bin edges")
    if column.type == "float":
        lo, hi = _range(column)
        return np.linspace(lo, hi, k + 1) if hi > lo else np.array([lo, hi])
    first, last = _whole_range(column)
    return first + np.arange(k + 1) * ((last - first + 1) / k)


def _day(value: Any) -> float:
    """A date-like value as its day ordinal; NaN for a missing or unreadable one."""
    if value is None or (not isinstance(value, str) and pd.isna(value)):  # NaT is a datetime too
        return math.nan
    if isinstance(value, dt.datetime):  # pandas Timestamps too
        return float(value.date().toordinal())
    if isinstance(value, dt.date):
        return float(value.toordinal())
    try:
        if isinstance(value, str):
            return float(dt.date.fromisoformat(value.strip()[:10]).toordinal())
        return float(pd.Timestamp(value).date().toordinal())
    except (ValueError, TypeError):
        return math.nan  # not a date: its row is left out, like an undeclared category


def _codes(column: Column, values: pd.Series, bins: int) -> np.ndarray:
    """A column's values as bin indices (floats, NaN where a value cannot be counted)."""
    if column.type == "categorical":
        index = {c: i for i, c in enumerate(column.categories)}
        return np.array([math.nan if value is None or (not isinstance(value, str) and pd.isna(value))
                         else index.get(str(value), math.nan) for value in values], dtype=float)
    if column.type == "date":
        numbers = np.array([_day(v) for v in values], dtype=float)
    else:
        numbers = pd.to_numeric(values, errors="coerce").to_numpy(dtype=float)
    k = domain_size(column, bins)
    out = np.full(numbers.shape, math.nan)
    ok = ~np.isnan(numbers)  # +-inf stay: clipped into the edge bins below
    if column.type == "float":
        lo, hi = _range(column)
        scaled = (np.clip(numbers[ok], lo, hi) - lo) / (hi - lo) * k if hi > lo else np.zeros(ok.sum())
        out[ok] = np.clip(np.floor(scaled), 0, k - 1)
    else:
        first, last = _whole_range(column)
        whole = np.round(np.clip(numbers[ok], first, last)).astype(np.int64) - first
        # exact integer arithmetic: value v is in bin floor(v * k / n)
        out[ok] = (whole * k) // (last - first + 1)
    return out


def discretise(frame: pd.DataFrame, schema: Schema, bins: int) -> pd.DataFrame:
    """The records as bin indices: in the typed records (categories as text, numbers, dates as
    ``datetime.date``, pandas datetimes or ISO text), out one int64 column per schema column, in
    the schema's order. A row with an undeclared category or a missing value is dropped whole
    (counted nowhere); a number or date outside its declared range goes to the edge bin.
    ``ValueError`` when a number or date column has no declared min or max."""
    schema = schema.structured()  # a free-text column has no bins: it is not counted
    missing = [c.name for c in schema.columns if c.name not in frame.columns]
    if missing:
        raise ValueError(f"the records lack the schema's columns {missing}")
    coded = {c.name: _codes(c, frame[c.name], bins) for c in schema.columns}
    keep = np.ones(len(frame), dtype=bool)
    for values in coded.values():
        keep &= ~np.isnan(values)
    return pd.DataFrame({name: values[keep].astype(np.int64) for name, values in coded.items()})


def _round_into(values: np.ndarray, decimals: int, lo: float, hi: float) -> np.ndarray:
    """Floats rounded to ``decimals``, kept inside [lo, hi] with values the schema can write."""
    step = 10.0 ** -decimals
    lo_r, hi_r = round(lo, decimals), round(hi, decimals)
    lo_r = round(lo_r + step, decimals) if lo_r < lo else lo_r
    hi_r = round(hi_r - step, decimals) if hi_r > hi else hi_r
    if lo_r > hi_r:  # no written value lies in the range: keep the exact (clipped) values
        return np.clip(values, lo, hi)
    return np.clip(np.round(values, decimals), lo_r, hi_r)


def undiscretise(codes: pd.DataFrame, schema: Schema, bins: int, rng: np.random.Generator) -> pd.DataFrame:
    """Values for bin indices: in one integer column per schema column (as ``discretise`` makes),
    out the schema's columns in its order: a category's text; a whole number (int64) or a date
    (``datetime.date``) drawn uniformly among those of the bin; a float drawn uniformly inside the
    bin and rounded to the column's ``decimals``. Every value is inside the declared range."""
    schema = schema.structured()  # a free-text column has no bins: it is not counted
    out: dict[str, np.ndarray] = {}
    for column in schema.columns:
        index = codes[column.name].to_numpy(dtype=np.int64)
        k = domain_size(column, bins)
        if index.size and (index.min() < 0 or index.max() >= k):
            raise ValueError(f"column {column.name!r}: bin indices must lie in [0, {k})")
        if column.type == "categorical":
            out[column.name] = np.asarray(column.categories, dtype=object)[index]
        elif column.type == "float":
            edges = bin_edges(column, bins)
            drawn = rng.uniform(edges[index], edges[index + 1])
            out[column.name] = _round_into(drawn, column.decimals, edges[0], edges[-1])
        else:
            first, last = _whole_range(column)
            n = last - first + 1
            # bin i holds the whole offsets ceil(i n / k) .. ceil((i + 1) n / k) - 1
            start = -((-index * n) // k)
            stop = -((-(index + 1) * n) // k)
            whole = first + rng.integers(start, stop)
            out[column.name] = (whole.astype(np.int64) if column.type == "integer"
                                else np.array([dt.date.fromordinal(int(v)) for v in whole], dtype=object))
    return pd.DataFrame(out, columns=list(schema.names))


def typed_like(out: pd.DataFrame, frame: pd.DataFrame, schema: Schema) -> pd.DataFrame:
    """``out`` with each column in the dtype of the same input column where that is a choice
    (text vs category dtype for categories, ``datetime.date`` vs pandas datetimes for dates)."""
    schema = schema.structured()  # a free-text column has no bins: it is not counted
    out = out.copy()
    for column in schema.columns:
        dtype = frame[column.name].dtype
        if column.type == "date" and pd.api.types.is_datetime64_any_dtype(dtype):
            days = pd.to_datetime(out[column.name])
            tz = getattr(dtype, "tz", None)
            out[column.name] = (days.dt.tz_localize(tz) if tz is not None else days).astype(dtype)
        elif column.type == "categorical" and isinstance(dtype, pd.CategoricalDtype):
            out[column.name] = pd.Categorical(out[column.name], categories=list(column.categories))
        elif column.type == "categorical" and dtype != object:  # noqa: E721 - np.dtype("O") == object; `is` is never true
            out[column.name] = out[column.name].astype(dtype)  # pandas 3's str dtype
    return out


# --- marginals: what a site counts over the bins --------------------------------------------------

def marginal_counts(codes: pd.DataFrame, clique: tuple[str, ...], sizes: dict[str, int]) -> np.ndarray:
    """The counts of ``clique``'s cells: in the rows as bin indices (``discretise``), the clique's
    column names and every column's domain size, out a float64 vector of prod(sizes) cells in
    C order over the clique (the order of Private-PGM's ``Dataset.project(clique).datavector()``).

    One record adds 1 to exactly one cell, so a marginal's L2 sensitivity is 1, and k marginals
    released together have sqrt(k). Its length depends on the schema only, never on the rows.
    """
    shape = tuple(int(sizes[a]) for a in clique)
    if not clique:
        return np.array([float(len(codes))])
    cells = np.ravel_multi_index(tuple(codes[a].to_numpy(dtype=np.int64) for a in clique), shape) if len(codes) \
        else np.zeros(0, dtype=np.int64)
    return np.bincount(cells, minlength=int(np.prod(shape))).astype(np.float64)


def column_sizes(schema: Schema, bins: int) -> dict[str, int]:
    """Each column's domain size (``domain_size``), in the schema's order: the public shape of
    every marginal a site counts, known to server and node alike. A free-text column has no bins:
    it is not counted."""
    return {c.name: domain_size(c, bins) for c in schema.structured().columns}


def cells(clique: tuple[str, ...], sizes: dict[str, int]) -> int:
    """How many cells ``clique``'s marginal has (the product of its columns' domain sizes)."""
    return int(np.prod([int(sizes[a]) for a in clique], dtype=np.int64)) if clique else 1


def joined_marginals(codes: pd.DataFrame, cliques: list[tuple[str, ...]], sizes: dict[str, int]) -> np.ndarray:
    """Several marginals as one vector, in ``cliques``' order (``marginal_counts`` each): what a
    site releases in one Gaussian release. One record adds 1 to one cell of each, so k marginals
    together have L2 sensitivity sqrt(k); the length is the schema's, never the rows'."""
    if not cliques:
        return np.zeros(0)
    return np.concatenate([marginal_counts(codes, clique, sizes) for clique in cliques])


def split_marginals(vector: np.ndarray, cliques: list[tuple[str, ...]],
                    sizes: dict[str, int]) -> dict[tuple[str, ...], np.ndarray]:
    """The inverse of ``joined_marginals``: one vector back into each clique's counts. ``ValueError``
    when its length is not the cliques' cells together (a malformed reply)."""
    lengths = [cells(c, sizes) for c in cliques]
    if len(vector) != sum(lengths):
        raise ValueError(f"{len(vector)} values for marginals of {sum(lengths)} cells")
    bounds = np.cumsum([0] + lengths)
    return {c: np.asarray(vector[bounds[i]:bounds[i + 1]], dtype=np.float64) for i, c in enumerate(cliques)}
