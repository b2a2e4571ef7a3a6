"""Text records with control codes: ``TextData``, from a table, and their fingerprint.

- ``TextData``: parallel lists of texts and their control codes (one code per record).
- ``to_text_data`` / ``code_vocabulary``: DataFrame -> records with codes, and the public
  code vocabulary (configuration or the columns' value schema, never record counts).
- ``load_node_data``: a deployed node's own file (``common.tables.load_table``) as records.
- ``dataset_fingerprint``: an order-independent hash of the records (logged in the ledger, caches).

Where tables come from is ``common.tables``; held-out splits and simulated nodes are
``common.partitioning``.
"""

from __future__ import annotations

import hashlib
import itertools
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd

from common.codes import control_value, make_code, parse_code
from common.logs import get_logger
from common.tables import load_table

if TYPE_CHECKING:
    from common.rows import Schema

logger = get_logger(__name__)

TEXT_FIELD = "text"
CODE_FIELD = "control_code"


@dataclass(frozen=True)
class TextData:
    """Records as two parallel lists: ``texts[i]`` carries control code ``codes[i]``."""

    texts: list[str]
    codes: list[str]

    def __post_init__(self) -> None:
        if len(self.texts) != len(self.codes):
            raise ValueError(
                f"TextData needs one code per text, got {len(self.texts)} texts and "
                f"{len(self.codes)} codes"
            )

    def __len__(self) -> int:
        """Number of records."""
        return len(self.texts)

    def subset(self, indices: Sequence[int] | np.ndarray) -> TextData:
        """The records at ``indices`` (in that order) as a new ``TextData``."""
        idx = [int(i) for i in indices]
        return TextData([self.texts[i] for i in idx], [self.codes[i] for i in idx])

    def code_counts(self, vocabulary: Sequence[str]) -> np.ndarray:
        """Records per code: int64 array aligned with ``vocabulary``.

        Raises ValueError naming the first record code that is not in the vocabulary:
        every record must carry exactly one public code, and silently dropping a record
        would make the released profile disagree with the data the node trains on.
        """
        position = {code: j for j, code in enumerate(vocabulary)}
        counts = np.zeros(len(vocabulary), dtype=np.int64)
        for code in self.codes:
            j = position.get(code)
            if j is None:
                raise ValueError(
                    f"record control code {code!r} is not in the public vocabulary "
                    f"{list(vocabulary)}"
                )
            counts[j] += 1
        return counts

    def to_records(self) -> list[dict[str, str]]:
        """The records as ``[{"text": ..., "control_code": ...}, ...]``."""
        return [{TEXT_FIELD: t, CODE_FIELD: c} for t, c in zip(self.texts, self.codes)]


def load_node_data(path: str, text_column: str, control_columns: Sequence[str], schema: Schema | None = None,
                   seed: int = 0) -> TextData:
    """A deployed node's own records: its file (csv/jsonl/parquet) -> ``TextData``.

    ``path`` is anything ``load_table`` accepts (normally a local file named in the
    SuperNode's ``--node-config``); columns are checked as in ``to_text_data``, or, for a
    table (``schema``), as in ``table_text_data``. A file with no usable row gives an empty
    ``TextData``: a node's release is defined on every dataset, and "does this file hold a
    usable row" would be a free bit if loading failed instead.
    """
    # Every column a release reads is read as written, never typed from the whole file (``control_value``,
    # ``common.rows.Column.write``): a table's every schema column, a text run's text and control columns.
    table = load_table(path, text_columns=schema.names if schema is not None else (text_column, *control_columns))
    if schema is not None:
        return table_text_data(table, schema, control_columns, seed, allow_empty=True)
    return to_text_data(table, text_column, control_columns, allow_empty=True)


def table_text_data(df: pd.DataFrame, schema: Schema, control_columns: Sequence[str], seed: int = 0,
                    allow_empty: bool = False) -> TextData:
    """A table's rows as records: the code from the control columns, the text the other
    columns written as ``name is value, ...`` (``common.rows.serialise``) in an order drawn per
    record from ``seed`` and the row's own values (``row_order_seed``): the same text for the same
    row, run after run, wherever it sits in the file, whatever the other rows hold.

    Rows with a missing value, or a value outside the public schema (an unknown category, a
    number out of its range), are left out, and only this process's log says how many.
    Raises ValueError naming a missing column, or when no row is left.
    """
    from common.rows import RowError, Schema as _Schema, serialise

    _check_control_columns(None, control_columns)
    _check_columns(df, list(schema.names))
    generated = _Schema(tuple(c for c in schema.columns if c.name not in control_columns))
    texts, codes, dropped = [], [], 0
    for row in df[list(schema.names)].to_dict("records"):
        try:
            # each value written by itself (``Column.write``): a missing or odd one leaves this row out alone
            written = {c.name: c.write(row[c.name]) for c in schema.columns}
        except (RowError, TypeError, ValueError, OverflowError):
            dropped += 1
            continue
        texts.append(serialise(written, generated, np.random.default_rng(row_order_seed(written, seed))))
        codes.append(make_code({c: written[c] for c in control_columns}, control_columns))
    if dropped:
        logger.warning("left out %d of %d rows: a missing value, or a value outside the table schema", dropped, len(df))
    if not texts and not allow_empty:
        raise ValueError("no usable rows: every row has a missing value or one outside the table schema")
    return TextData(texts, codes)


def row_order_seed(written: dict[str, str], seed: int) -> list[int]:
    """The seed of a row's column order: ``seed`` and a digest of the row's written values, never its
    position (issue 60: one row inserted at the top rewrote 478 of 500 other rows' texts when the
    order was drawn from the row's index, and those texts are what DP-SGD trains on and votes embed)."""
    digest = hashlib.sha256(json.dumps(sorted(written.items()), ensure_ascii=False).encode("utf-8")).digest()
    return [int(seed), *(int.from_bytes(digest[i:i + 4], "little") for i in range(0, 16, 4))]


def free_text_part(data: TextData) -> TextData:
    """The records of a table with a free-text column as that column's text alone, each with its
    code (``common.rows.split_record``): what the language model learns and is scored on."""
    from common.rows import split_record

    return TextData([split_record(t)[1] for t in data.texts], list(data.codes))


def schema_vocabulary(schema: Schema, control_columns: Sequence[str]) -> list[str]:
    """A table's code vocabulary: every combination of the control columns' declared categories
    (public: the schema's, never the records')."""
    per_column = [schema.column(c).categories for c in control_columns]
    return [make_code(dict(zip(control_columns, combo)), control_columns) for combo in itertools.product(*per_column)]


# ------------------------------------------------------------------ records and codes


def _check_columns(df: pd.DataFrame, columns: Sequence[str]) -> None:
    available = [str(c) for c in df.columns]
    for column in columns:
        if column not in df.columns:
            raise ValueError(
                f"column {column!r} is not in the dataset; available columns: {available}"
            )


def _check_control_columns(text_column: str | None, control_columns: Sequence[str]) -> None:
    if isinstance(control_columns, str):
        raise TypeError(f"control_columns must be a list of names, got {control_columns!r}")
    if not control_columns:
        raise ValueError("at least one control column is needed: every record carries a code")
    if len(set(control_columns)) != len(control_columns):
        raise ValueError(f"control columns repeat a name: {list(control_columns)}")
    if text_column is not None and text_column in control_columns:
        # The code is public; a code made from the text would publish the text.
        raise ValueError(f"text column {text_column!r} cannot also be a control column")


def to_text_data(
    df: pd.DataFrame, text_column: str, control_columns: Sequence[str], allow_empty: bool = False
) -> TextData:
    """DataFrame -> ``TextData`` with codes ``col=value|...`` from ``control_columns``.

    Raises ValueError naming a missing column (and listing the available ones). Texts are
    stripped; rows with an empty or missing text, or a missing control value (which has no
    code), are dropped with a logged warning. Raises ValueError if no row is left.
    """
    _check_control_columns(text_column, control_columns)
    _check_columns(df, [text_column, *control_columns])
    texts = df[text_column]
    text_ok = texts.notna() & (texts.astype(str).str.strip() != "")
    values = pd.DataFrame({c: [control_value(v) for v in df[c].tolist()] for c in control_columns}, index=df.index,
                          dtype=object)
    codes_ok = values.notna().all(axis=1)
    n_empty, n_uncoded = int((~text_ok).sum()), int((text_ok & ~codes_ok).sum())
    if n_empty or n_uncoded:
        logger.warning(
            "dropped %d of %d rows: %d with an empty text in %r, %d with a missing value "
            "in control columns %s",
            n_empty + n_uncoded, len(df), n_empty, text_column, n_uncoded, list(control_columns),
        )
    kept = df[text_ok & codes_ok]
    if kept.empty and not allow_empty:
        raise ValueError(f"no usable rows: every row has an empty {text_column!r} or no code")
    codes = [make_code(row, control_columns) for row in values[text_ok & codes_ok].to_dict("records")]
    return TextData([str(t).strip() for t in kept[text_column]], codes)


def _sorted_values(series: pd.Series) -> list[str]:
    values = {v for v in map(control_value, series.tolist()) if v is not None}

    def key(value: str) -> tuple:
        try:
            return (0, float(value), value)  # numbers numerically: stars 2 < 10
        except ValueError:
            return (1, 0.0, value)

    return sorted(values, key=key)


def code_vocabulary(
    df: pd.DataFrame,
    control_columns: Sequence[str],
    declared: Sequence[str] | None = None,
) -> list[str]:
    """The public control-code vocabulary, in a fixed order.

    With ``declared`` (from configuration) that list is the vocabulary, in the order
    given; bare values (``sport``) are accepted for a single control column and become
    ``topic=sport``. Otherwise it is the cartesian product of each control column's
    distinct values (each sorted), in ``control_columns`` order. The product reads only
    the schema of the label columns - which values exist, not how many records have them
    - so it is public for a public benchmark (simulation); a deployment declares it.
    Codes that no record has stay in (they get zero noisy mass); counting records would
    be a private statistic.
    """
    _check_control_columns(None, control_columns)
    if declared is not None:
        vocabulary = [_normalise_code(c, control_columns) for c in declared]
        if not vocabulary:
            raise ValueError("the declared control-code vocabulary is empty")
        duplicates = sorted({c for c in vocabulary if vocabulary.count(c) > 1})
        if duplicates:
            raise ValueError(f"the declared vocabulary repeats codes {duplicates}")
        return vocabulary
    _check_columns(df, control_columns)
    per_column = [_sorted_values(df[c]) for c in control_columns]
    vocabulary = [make_code(dict(zip(control_columns, combo)), control_columns)
                  for combo in itertools.product(*per_column)]
    # make_code replaces separators, so two raw values may render alike; keep one.
    return list(dict.fromkeys(vocabulary))


def _normalise_code(code: str, control_columns: Sequence[str]) -> str:
    code = str(code).strip()
    if "=" not in code and len(control_columns) == 1:
        code = make_code({control_columns[0]: code}, control_columns)
    if list(parse_code(code)) != list(control_columns):
        raise ValueError(
            f"declared code {code!r} does not have the form "
            f"{'|'.join(f'{c}=<value>' for c in control_columns)}"
        )
    return code


# ----------------------------------------------------------------------- fingerprint


def dataset_fingerprint(data: TextData) -> str:
    """SHA-256 hex digest of the multiset of (code, text) records.

    Order-independent (sorted per-record digests are hashed): reshuffling a file keeps it,
    adding, removing or editing any record changes it. The ledger only logs it (a node's
    ledger is keyed by the node, never by its data).
    """
    digests = sorted(
        hashlib.sha256(json.dumps([c, t], ensure_ascii=False).encode("utf-8")).digest()
        for t, c in zip(data.texts, data.codes)
    )
    outer = hashlib.sha256(b"fedsyn-data-v1\n")
    for digest in digests:
        outer.update(digest)
    return outer.hexdigest()
