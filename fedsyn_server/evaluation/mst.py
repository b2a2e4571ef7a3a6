"""MST: the differentially private synthetic-table baseline of McKenna, Miklau and Sheldon (2021),
"Winning the NIST Contest: A scalable and general approach to differentially private synthetic
data" (Journal of Privacy and Confidentiality 11(3)), on Private-PGM (``mbi`` 2.0).

The algorithm (the paper's Algorithm 1, and ``mechanisms/mst.py`` of
github.com/ryan112358/private-pgm, which this follows; written anew here for mbi 2.0's API):

1. (epsilon, delta) -> zCDP rho (``cdp_rho``, the conversion of Canonne, Kamath and Steinke 2020
   that the reference code uses), split in three equal parts.
2. Measure every 1-way marginal with Gaussian noise (rho / 3 over the d marginals together).
3. Compress each column's domain on those *noisy* counts: the values whose noisy count is below
   3 sigma are merged into one value (post-processing; the measurements are re-expressed on the
   compressed domain with mbi's ``LinearMeasurement.compress``).
4. Select a spanning tree of 2-way marginals with Kruskal's algorithm in which every step is an
   exponential mechanism (rho / 3 over the d - 1 steps); an edge's score is the L1 distance
   between the true 2-way marginal and its estimate from the noisy 1-way marginals.
5. Measure the tree's d - 1 2-way marginals with Gaussian noise (rho / 3 together).
6. Estimate a graphical model from all the noisy measurements (mbi's mirror descent), sample
   records from it (mbi's seeded Gumbel-rounding sampler), undo the compression.

Sensitivities are for add/remove-one-record neighbours: one record changes one cell of a marginal
by one (L2 sensitivity 1 per marginal), and an edge's L1 score by at most one.

Around it, this module discretises a table with public information only: a categorical column's
domain is its declared categories; a number or date column is cut into equal-width bins over its
declared [min, max] (never the data's own range, which would be an un-noised statistic). The
sampled bins become values drawn uniformly inside the bin.

jax and mbi are imported inside ``mst_synthesise`` only: the module imports without them.
"""

from __future__ import annotations

import datetime as dt
import itertools
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pandas as pd

from common.rows import Column, Schema

# Mirror-descent iterations: the reference code's counts (2,500 for the model used in the tree
# selection, 10,000 for the final one). On a tree of 16 x 16 marginals both take seconds on CPU.
SELECT_ITERS = 2500
ESTIMATE_ITERS = 10000


# --- privacy accounting --------------------------------------------------------------------------

def cdp_delta(rho: float, epsilon: float) -> float:
    """The delta such that rho-zCDP implies (epsilon, delta)-DP: in rho >= 0 and epsilon >= 0, out
    delta in [0, 1] (Canonne, Kamath, Steinke 2020, Proposition 7; the alpha of its bound found by
    bisection on the derivative)."""
    if rho < 0 or epsilon < 0:
        raise ValueError("rho and epsilon must be >= 0")
    if rho == 0:
        return 0.0
    # Any alpha > 1 gives a valid bound, so a search that stops early only costs tightness;
    # alpha >= 1.01 keeps the log1p terms away from their singularity.
    lo, hi = 1.01, (epsilon + 1) / (2 * rho) + 2
    for _ in range(1000):
        alpha = (lo + hi) / 2
        if (2 * alpha - 1) * rho - epsilon + math.log1p(-1.0 / alpha) < 0:
            lo = alpha
        else:
            hi = alpha
    delta = math.exp((alpha - 1) * (alpha * rho - epsilon) + alpha * math.log1p(-1 / alpha)) / (alpha - 1.0)
    return min(delta, 1.0)


def cdp_rho(epsilon: float, delta: float) -> float:
    """The largest zCDP rho that still implies (epsilon, delta)-DP: in epsilon >= 0 and delta in
    (0, 1], out rho >= 0. The same bisection as private-pgm's ``cdp2adp.cdp_rho``."""
    if epsilon < 0 or not delta > 0:
        raise ValueError("epsilon must be >= 0 and delta > 0")
    if delta >= 1:
        return 0.0
    # Invariant: cdp_delta(lo) <= delta < cdp_delta(hi); the answer is the lower end (valid).
    lo, hi = 0.0, epsilon + 1
    for _ in range(1000):
        rho = (lo + hi) / 2
        if cdp_delta(rho, epsilon) <= delta:
            lo = rho
        else:
            hi = rho
    return lo


# --- discretisation (public schema information only) ---------------------------------------------

def _range(column: Column) -> tuple[float, float]:
    """The declared [min, max] of a number or date column (dates as day ordinals)."""
    if column.min is None or column.max is None:
        raise ValueError(f"column {column.name!r}: the marginal baselines (MST, AIM) need declared ranges: give the {column.type} column "
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
    if column.type == "categorical":
        return len(column.categories)
    if column.type == "float":
        lo, hi = _range(column)
        return bins if hi > lo else 1
    first, last = _whole_range(column)
    return min(bins, last - first + 1)


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
    out = out.copy()
    for column in schema.columns:
        dtype = frame[column.name].dtype
        if column.type == "date" and pd.api.types.is_datetime64_any_dtype(dtype):
            days = pd.to_datetime(out[column.name])
            tz = getattr(dtype, "tz", None)
            out[column.name] = (days.dt.tz_localize(tz) if tz is not None else days).astype(dtype)
        elif column.type == "categorical" and isinstance(dtype, pd.CategoricalDtype):
            out[column.name] = pd.Categorical(out[column.name], categories=list(column.categories))
        elif column.type == "categorical" and dtype != object:
            out[column.name] = out[column.name].astype(dtype)  # pandas 3's str dtype
    return out


# --- MST's own steps -----------------------------------------------------------------------------

def exponential_mechanism(scores: np.ndarray, epsilon: float, sensitivity: float,
                          rng: np.random.Generator) -> int:
    """The index of one candidate, drawn with probability proportional to
    exp(epsilon * score / (2 * sensitivity)): in the candidates' scores (higher is better), the
    mechanism's epsilon (it is then epsilon^2 / 8-zCDP) and the scores' sensitivity."""
    logits = 0.5 * epsilon / sensitivity * np.asarray(scores, dtype=float)
    logits -= logits.max()  # exp of large scores would overflow; the shift cancels
    probs = np.exp(logits)
    return int(rng.choice(len(probs), p=probs / probs.sum()))


def select_tree(weights: Mapping[tuple[str, str], float], attributes: Sequence[str], rho: float,
                rng: np.random.Generator) -> list[tuple[str, str]]:
    """A spanning tree over ``attributes``, as its ``len(attributes) - 1`` edges: Kruskal's
    algorithm where each step picks among the edges that join two components with the exponential
    mechanism on the edges' ``weights`` (keyed by either order of the pair; sensitivity 1), the
    ``rho`` (zCDP) shared equally by the steps. A huge rho gives the maximum spanning tree."""
    from scipy.cluster.hierarchy import DisjointSet

    attrs = list(attributes)
    if len(attrs) < 2:
        return []

    def weight(a: str, b: str) -> float:
        return float(weights[(a, b)] if (a, b) in weights else weights[(b, a)])

    # eps^2 / 8 zCDP per step (bounded-range exponential mechanism), d - 1 steps
    epsilon = math.sqrt(8 * rho / (len(attrs) - 1))
    components = DisjointSet(attrs)
    candidates = list(itertools.combinations(attrs, 2))
    tree: list[tuple[str, str]] = []
    for _ in range(len(attrs) - 1):
        candidates = [e for e in candidates if not components.connected(*e)]
        pick = candidates[exponential_mechanism(np.array([weight(*e) for e in candidates]), epsilon, 1.0, rng)]
        components.merge(*pick)
        tree.append(pick)
    return tree


def support_mapping(noisy: np.ndarray, threshold: float) -> np.ndarray:
    """MST's domain compression for one column, from its noisy 1-way counts only: in the counts
    and the threshold (3 sigma in the paper), out the map original index -> compressed index:
    the values at or above the threshold keep their order, the others become one last value."""
    supported = np.asarray(noisy) >= threshold
    mapping = np.full(supported.size, int(supported.sum()), dtype=np.int64)
    mapping[supported] = np.arange(int(supported.sum()))
    return mapping


def decompress(codes: np.ndarray, mapping: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Original indices for compressed ones: each compressed index goes back to one of its
    original values, drawn uniformly (a merged value is a set of rare ones)."""
    out = np.empty(len(codes), dtype=np.int64)
    for value in np.unique(codes):
        where = np.flatnonzero(codes == value)
        out[where] = rng.choice(np.flatnonzero(mapping == value), size=where.size)
    return out


def _gaussian(counts: np.ndarray, stddev: float, rng: np.random.Generator) -> np.ndarray:
    return counts + rng.normal(0.0, stddev, size=counts.shape)


def prepare(method: str, frame: pd.DataFrame, schema: Schema, epsilon: float, delta: float, rows: int,
            bins: int) -> tuple[list[str], Any, Any, float]:
    """What a marginal baseline (MST, AIM) starts from, after checking its arguments: the column
    names, mbi's ``Domain`` and ``Dataset`` of the discretised records, and the zCDP rho of
    (epsilon, delta). Switches jax to float64 (process-wide) on the way."""
    if not epsilon > 0 or not 0 < delta < 1:
        raise ValueError(f"{method} needs epsilon > 0 and 0 < delta < 1")
    if rows < 1:
        raise ValueError("rows must be >= 1")
    for column in schema.columns:
        domain_size(column, bins)  # a number or date column without a declared range fails here
    codes = discretise(frame, schema, bins)

    import jax

    # mbi's own import-time advice: its estimators stall in float32 on larger counts, and its
    # many small programs make jax's persistent compilation cache a cost, not a saving
    jax.config.update("jax_enable_x64", True)
    jax.config.update("jax_enable_compilation_cache", False)
    from mbi import Dataset, Domain

    attrs = list(schema.names)
    domain = Domain(attrs, [domain_size(c, bins) for c in schema.columns])
    data = Dataset({a: codes[a].to_numpy(dtype=np.int64) for a in attrs}, domain)
    return attrs, domain, data, cdp_rho(epsilon, delta)


def mst_synthesise(frame: pd.DataFrame, schema: Schema, epsilon: float, delta: float, rows: int, seed: int,
                   bins: int = 16) -> pd.DataFrame:
    """``rows`` synthetic records from MST at (epsilon, delta)-DP: in the private records (the
    schema's columns, typed), the schema (public: its categories and declared ranges define the
    domain), the budget, the number of rows to make, a seed (the same seed and input give the same
    frame) and the bins per number or date column; out a DataFrame with the schema's columns in
    its order, typed like the input, every value inside the schema."""
    attrs, domain, data, rho = prepare("MST", frame, schema, epsilon, delta, rows, bins)
    from mbi import LinearMeasurement
    from mbi.estimation import MirrorDescent, minimum_variance_unbiased_total
    from mbi.extensions import synthetic_data

    rng = np.random.default_rng(seed)
    d = len(attrs)
    # rho / 3 for each of the three steps; k Gaussian measurements of sensitivity 1 at stddev
    # sigma * sqrt(k) cost k / (2 sigma^2 k) = 1 / (2 sigma^2) = rho / 3 together
    sigma = math.sqrt(3.0 / (2.0 * rho))

    # 1. every 1-way marginal
    stddev1 = sigma * math.sqrt(d)
    one_way = [LinearMeasurement(_gaussian(np.asarray(data.project(a).datavector()), stddev1, rng), (a,),
                                 stddev=stddev1) for a in attrs]

    # 2. domain compression on the noisy counts (post-processing). mbi estimates the record total
    # from identity measurements only, which a compressed one no longer is: the total is taken
    # here, from the noisy counts before compression (the same minimum-variance estimate)
    raw_one_way = one_way
    mappings = {m.clique[0]: support_mapping(np.asarray(m.noisy_measurement), 3 * m.stddev) for m in one_way}
    mappings = {a: m for a, m in mappings.items() if not np.array_equal(m, np.arange(domain[a]))}
    small = data.compress(mappings) if mappings else data
    one_way = [m.compress(mappings, domain) for m in one_way]

    # 3. the tree: scores from a model of the noisy 1-way marginals alone
    tree: list[tuple[str, str]] = []
    if d > 1:
        total = minimum_variance_unbiased_total(raw_one_way)
        independent = MirrorDescent().estimate(small.domain, one_way, known_total=total, iters=SELECT_ITERS)
        singles = {a: np.asarray(independent.project((a,)).datavector(), dtype=float) for a in attrs}
        scores = {}
        for a, b in itertools.combinations(attrs, 2):
            # a model of singleton cliques is a product: its 2-way marginal is the outer
            # product (what variable elimination gives, without one compilation per pair)
            estimate = np.outer(singles[a], singles[b]).ravel() / total
            scores[(a, b)] = float(np.abs(np.asarray(small.project((a, b)).datavector()) - estimate).sum())
        tree = select_tree(scores, attrs, rho / 3.0, rng)

    # 4. the tree's 2-way marginals
    stddev2 = sigma * math.sqrt(max(len(tree), 1))
    two_way = [LinearMeasurement(_gaussian(np.asarray(small.project(e).datavector()), stddev2, rng), e,
                                 stddev=stddev2) for e in tree]

    # 5. the model, and records from it
    model = MirrorDescent().estimate(small.domain, one_way + two_way,
                                     known_total=minimum_variance_unbiased_total(raw_one_way + two_way),
                                     iters=ESTIMATE_ITERS)
    sampled = synthetic_data(model, rows, seed=int(rng.integers(2**31 - 1)))
    result = {}
    for a in attrs:
        values = np.asarray(sampled.to_dict()[a], dtype=np.int64)
        result[a] = decompress(values, mappings[a], rng) if a in mappings else values
    out = undiscretise(pd.DataFrame(result, columns=attrs), schema, bins, rng)
    return typed_like(out, frame, schema)
