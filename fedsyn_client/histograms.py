"""The histograms a node releases with Gaussian noise, each with its L2 sensitivity.

The profile is ``TextData.code_counts`` (L2 sensitivity 1). A vote request names a histogram
(``common.histograms.HISTOGRAMS``: each object owns its scoring and its sensitivity); the node
embeds its records, pads them to its bound, has the histogram score them, and the one release
path (``fedsyn_client.release``) adds noise at that sensitivity. A new refinement that needs
another statistic subclasses ``common.histograms.Histogram`` and registers it (with a test of
its bound); it then gets the node's policy, ledger, fixed work and noise for free.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from common.config import ConfigError, RunConfig
from common.data import TextData, dataset_fingerprint
from common.histograms import HISTOGRAMS
from common.voting import finite_rows, padded
from fedsyn_client import fixed_work
from fedsyn_client.record_matrix import embed_slots

Compute = Callable[[], np.ndarray]


def vote_histogram(name: str, records: TextData, texts: list[str], codes: list[str], params: Mapping[str, Any],
                   cfg: RunConfig, bound: int | None = None,
                   embedded: Compute | None = None) -> tuple[Callable[..., np.ndarray], float]:
    """(compute, L2 sensitivity) of the registered histogram ``name`` (``common.histograms``) on the
    node's ``records`` over the candidates ``texts`` and their ``codes``, under the request's
    ``params``. The sensitivity is read now (bad params raise ``ConfigError`` before anything is
    reserved); ``compute`` embeds and scores only when called, after the ledger's reservation.
    ``bound``: the node's public size bound, the rows every histogram is handed (issue 45);
    ``embedded``: the node's records already embedded as those rows (issue 61). ``compute`` takes
    a keyword ``rounding`` for a scaled histogram's masked round (``common.histograms``: scaled)."""
    histogram = HISTOGRAMS.get(name)
    if histogram is None:
        raise ConfigError(f"histogram {name!r} is unknown on this node; known: {sorted(HISTOGRAMS)}")
    sensitivity = float(histogram.sensitivity(params))

    def compute(rounding: Callable[[np.ndarray], np.ndarray] | None = None) -> np.ndarray:
        # Records and candidates are compared within a window around what the generator learned
        # and writes (``RunConfig.vote_window``: a candidate can only imitate a record's opening),
        # which also halves the vote's time at BBC's 256-token articles. The rows are padded here,
        # not by the histogram, so a plug-in's work is the bound's whatever it does; non-finite
        # rows become zero rows before any statistic is computed from them.
        window = cfg.vote_window
        local = embedded() if embedded is not None else local_embeddings(records, cfg.embedder, window, bound,
                                                                         cfg.precision)
        candidates = candidate_embeddings(texts, cfg.embedder, window, cfg.precision)
        extra = {} if rounding is None else {"rounding": rounding}
        return histogram.score(finite_rows(padded(local, bound)), records.codes, finite_rows(candidates), codes,
                               params, bound=bound, **extra)

    return compute, sensitivity


def local_embeddings(records: TextData, embedder_name: str, max_tokens: int | None = None,
                     bound: int | None = None, precision: str = "fp32") -> np.ndarray:
    """Embeddings of the node's records (each cut to its first ``max_tokens`` tokens; None = the
    embedder's own limit).

    Under ``bound`` (a deployed node's max-records) the work is that of ``bound`` rows, each padded
    to the window: each record is cut to the window's bytes, the rows beyond the records are filler
    whose vectors are dropped, and the bytes the records fall short of are tokenized as ballast
    (``fedsyn_client.fixed_work``), so the time of a vote is a function of the bound and the window,
    never of |D| or the records' lengths. None (a simulated node): the records as they are, computed
    once per process (one worker serves many nodes, and the records never change). ``precision``:
    the run config's (``common.models.embed``)."""
    from common.models import embed, load_embedder

    embedder = load_embedder(embedder_name)
    if bound is None:
        cache = _EMBEDDING_CACHE.setdefault((embedder_name, max_tokens, len(records), precision), {})
        key = dataset_fingerprint(records)
        if key not in cache:
            cache[key] = embed(embedder, list(records.texts), progress=sys.stderr.isatty(), max_tokens=max_tokens,
                               precision=precision)
        return cache[key]
    # the work of ``bound`` rows padded to the window (record_matrix.embed_slots); the filler's rows dropped
    return embed_slots(records.texts, embedder, max_tokens or embedder.max_seq_length,  # type: ignore[arg-type]  # the embedders' limit is set (typed Optional)
                       max(len(records), bound), precision=precision)[:len(records)]


def candidate_embeddings(texts: list[str], embedder_name: str, max_tokens: int | None,
                         precision: str = "fp32") -> np.ndarray:
    """Embeddings of a vote round's candidates (public texts from the server). The last round's
    are kept: in simulation one worker process serves many nodes the same candidates, and each
    would embed them again (10^4 texts x 50 weak nodes); a deployed node embeds them once anyway.

    Each text is first cut to the window's bytes (``fixed_work.row_bytes``, as the records are): a
    tokenizer reads a whole text before it truncates, so a server sending megabyte candidates would
    otherwise set the node's work (issue 75); the cut leaves every window a text fills as it was."""
    import hashlib
    import json

    from common.models import embed, load_embedder

    if max_tokens is not None:
        limit = fixed_work.row_bytes(max_tokens)
        texts = [fixed_work.cut(t, limit) for t in texts]
    key = (embedder_name, max_tokens, precision, hashlib.sha256(json.dumps(texts).encode()).hexdigest())
    if _CANDIDATES.get("key") != key:
        _CANDIDATES.clear()
        _CANDIDATES.update(key=key, emb=embed(load_embedder(embedder_name), texts, max_tokens=max_tokens,
                                              precision=precision))
    return _CANDIDATES["emb"]


_EMBEDDING_CACHE: dict[tuple[str, int | None, int, str], dict[str, np.ndarray]] = {}
_CANDIDATES: dict[str, Any] = {}


# --- federated marginals (issue 48) ---------------------------------------------------------------

def marginals_histogram(records: TextData, cliques: list[tuple[str, ...]], schema: Any,
                        control_columns: tuple[str, ...], bins: int,
                        bound: int | None = None) -> tuple[Compute, float]:
    """The node's counts of each clique's marginal over the schema's bins, joined in the request's
    order (as ``common.marginals.joined_marginals``); L2 sensitivity sqrt(number of cliques), since
    one record adds 1 to one cell of each. The records' rows are read back from their texts and
    codes (``common.rows.record_row``); under ``bound`` as many filler rows are read, discretised
    and counted beside them at weight 0 (``slot_codes``), so the time is the bound's, not |D|'s."""
    from common.marginals import column_sizes

    sizes = column_sizes(schema, bins)

    def compute() -> np.ndarray:
        codes, counted = slot_codes(records, schema, control_columns, bins, bound)
        return counted_marginals(codes, counted, cliques, sizes)

    return compute, float(np.sqrt(len(cliques)))


def counted_marginals(codes: Any, counted: np.ndarray, cliques: list[tuple[str, ...]],
                      sizes: Mapping[str, int]) -> np.ndarray:
    """``common.marginals.joined_marginals`` of the rows ``counted`` marks, with the work of every
    row: in the rows' bin indices (``slot_codes``), a bool per row, the cliques and the columns'
    domain sizes; out the joined float64 counts. Every row's cell is computed and added at weight
    1 (counted) or 0 (filler, or a record that is not a row of the schema): the same whole numbers
    as counting the marked rows alone, bit for bit."""
    weights = np.asarray(counted, dtype=np.float64)
    parts = []
    for clique in cliques:
        shape = tuple(int(sizes[a]) for a in clique)
        if not clique:
            parts.append(np.array([weights.sum()]))
            continue
        cells = np.ravel_multi_index(tuple(codes[a].to_numpy(dtype=np.int64) for a in clique), shape)
        parts.append(np.bincount(cells, weights=weights, minlength=int(np.prod(shape))).astype(np.float64, copy=False))
    return np.concatenate(parts) if parts else np.zeros(0)


def node_codes(records: TextData, schema: Any, control_columns: tuple[str, ...], bins: int,
               bound: int | None = None) -> Any:
    """The records as bin indices (``common.marginals.discretise``), each record's row read from its
    text and code: the rows ``slot_codes`` counts. A record that is not a row of the schema (its
    file changed under the node) is counted nowhere, like a row with a value outside the schema."""
    codes, counted = slot_codes(records, schema, control_columns, bins, bound)
    return codes[counted].reset_index(drop=True)


def slot_codes(records: TextData, schema: Any, control_columns: tuple[str, ...], bins: int,
               bound: int | None = None) -> tuple[Any, np.ndarray]:
    """(bin indices of every row, which rows are counted): the rows are the records, then public
    filler rows up to ``bound`` (None: the records alone), each read from its text and code
    (``common.rows.record_row``) and discretised the same way. A filler row, and a record that is
    not a row of the schema (its file changed under the node; the public filler row stands in for
    it), are computed like any other and not counted: the work is the bound's, whatever |D|."""
    import pandas as pd

    from common.marginals import discretise
    from common.rows import RowError, canonical, split_record

    key = (canonical(schema), tuple(control_columns), bins, bound, len(records))
    # one node's view at a time, recognised by the object (a node's records are one TextData for
    # its life): a fingerprint would hash every record, work that follows |D|
    if _CODES.get("records") is records and _CODES.get("key") == key:
        return _CODES["out"]
    # A free-text column is not counted: each record's row is read from the text before it
    # (``split_record``), so the free text is never parsed.
    schema = schema.structured()
    filler_text, filler_code = _filler(schema, control_columns)
    filler_row = record_row_of(filler_text, filler_code, schema)
    n = len(records)
    rows = max(n, bound or 0)
    texts = list(records.texts) + [filler_text] * (rows - n)
    codes = list(records.codes) + [filler_code] * (rows - n)
    typed, counted = [], np.zeros(rows, dtype=bool)
    for i, (text, code) in enumerate(zip(texts, codes)):
        try:
            typed.append(record_row_of(split_record(text)[0], code, schema))
            counted[i] = i < n
        except (RowError, KeyError, ValueError):
            typed.append(filler_row)  # computed like a row, counted nowhere
    out = discretise(pd.DataFrame(typed, columns=list(schema.names)), schema, bins)
    if len(out) != rows:  # record_row reads only values inside the schema, which discretise keeps all of
        raise RuntimeError(f"discretise left out {rows - len(out)} rows that record_row read: the two disagree")
    _CODES.clear()
    _CODES.update(records=records, key=key, out=(out, counted))
    return out, counted


def record_row_of(text: str, code: str, schema: Any) -> dict[str, Any]:
    """``common.rows.record_row`` of a record's row text and its code string."""
    from common.codes import parse_code
    from common.rows import record_row

    return record_row(text, parse_code(code), schema)


def _filler(schema: Any, control_columns: tuple[str, ...]) -> tuple[str, str]:
    """(text, code) of the public filler row: each column's first value (a category's first, a
    number's or date's min), written as a record is."""
    from common.codes import make_code
    from common.rows import generated_part, serialise

    first = {c.name: (c.categories[0] if c.type == "categorical" else c.min) for c in schema.columns}
    text = serialise(first, generated_part(schema, control_columns), np.random.default_rng(0))
    return text, make_code({c: schema.column(c).write(first[c]) for c in control_columns}, control_columns)


_CODES: dict[str, Any] = {}
