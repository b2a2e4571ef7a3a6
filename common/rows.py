"""A table's rows as text and back (issue 25): the schema, serialisation and parsing.

The generator learns rows as sentences, ``age is 54, sex is F, smoker is no``, with the column
order permuted per record so that no order is learned as meaning. Generated text is parsed back
into a typed row; text that does not parse, or breaks the schema (a missing or repeated column,
an unknown category, a value out of its declared range), is a ``RowError`` with a fixed reason,
counted by the caller and never written.

The schema (names, types, categories, ranges) is public input: the run config or a schema file
written by the people who run the study. It is never read off a node's records: a category
that occurs only in one hospital's data, or a range's true maximum, would be an un-noised
statistic. A value outside the schema on a node is clipped to its range, or its row left out
(``serialise`` raises, the node decides), on the node.
"""

from __future__ import annotations

import datetime as dt
import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from common.codes import control_value

TYPES = ("categorical", "integer", "float", "date", "text")
SEP, IS = ", ", " is "
# A table's free-text column (issue 48: at most one, ``"type": "text"``) is written after the other
# columns and this separator, never inside the ``name is value`` list: free text may hold ", " and
# " is ". A category cannot hold a newline, so the first blank line of a record ends its row.
FREE_TEXT_SEP = "\n\n"
# The reasons a generated text is not a row (fixed texts: counted per reason in metrics.json).
NO_COLUMN, REPEATED, MISSING, UNKNOWN_CATEGORY, NOT_A_NUMBER, NOT_A_DATE, OUT_OF_RANGE = (
    "no column", "repeated column", "missing column", "unknown category", "not a number", "not a date",
    "out of range")


class SchemaError(ValueError):
    """A schema that cannot be used; the message names the column, the problem and the fix."""


class RowError(ValueError):
    """A text that is not a row of the schema; ``reason`` is one of the fixed reasons above."""

    def __init__(self, reason: str, column: str = "") -> None:
        super().__init__(f"{reason}: {column}" if column else reason)
        self.reason, self.column = reason, column


@dataclass(frozen=True)
class Column:
    """One column: its name, type, and (public) categories or range."""

    name: str
    type: str
    categories: tuple[str, ...] = ()
    min: float | str | None = None  # a number, or an ISO date for a date column
    max: float | str | None = None
    decimals: int = 2  # floats are written with this many decimals

    def write(self, value: Any) -> str:
        """``value`` as the generator sees it; ``RowError`` when it is not in the schema.

        Read from ``value`` alone, whatever type the file gave it (issue 60): a node reads a table's
        columns as written (a CSV field is its text, a JSON value its JSON type), because a column
        typed from the whole file would let one record move every other record (one empty ``stars``
        made ``2`` read ``2.0`` in all of them). So a category is the per-value text of
        ``common.codes.control_value`` (``2``, ``2.0`` and ``" 2 "`` are ``2``), a number is parsed
        from its own text or JSON number, a date from its own ISO text or date value.
        """
        if self.type == "text":
            return _free_text(value, self.name)
        if self.type == "categorical":
            text = control_value(value)
            if text is None:
                raise RowError(MISSING, self.name)
            if text not in self.categories:
                raise RowError(UNKNOWN_CATEGORY, self.name)
            return text
        if self.type == "date":
            if isinstance(value, dt.datetime):  # a Parquet timestamp (pandas' Timestamp is one)
                value = value.date()
            day = value if isinstance(value, dt.date) else _date(str(value), self.name)
            self._check_range(day.isoformat())
            return day.isoformat()
        number = _number(value)
        if number is None:
            raise RowError(NOT_A_NUMBER, self.name)
        self._check_range(number)
        return str(int(round(number))) if self.type == "integer" else f"{number:.{self.decimals}f}"

    def read(self, text: str) -> Any:
        """The typed value written as ``text``; ``RowError`` when it is not one of the schema's."""
        text = text.strip()
        if self.type == "text":
            return _free_text(text, self.name)
        if self.type == "categorical":
            if text not in self.categories:
                raise RowError(UNKNOWN_CATEGORY, self.name)
            return text
        if self.type == "date":
            day = _date(text, self.name)
            self._check_range(day.isoformat())
            return day
        try:
            number = int(text) if self.type == "integer" else float(text)
        except ValueError:
            raise RowError(NOT_A_NUMBER, self.name) from None
        if not math.isfinite(number):
            raise RowError(NOT_A_NUMBER, self.name)
        self._check_range(number)
        return number

    def could_start(self, text: str) -> bool:
        """Whether ``text`` is the start of a value this column writes (a category, an in-range
        number in its written form, an in-range ISO date): the grammar of constrained decoding.

        Exact for categories and numbers (every accepted prefix can still be completed within the
        declared range); for dates the range is checked digit by digit on the ISO form, so an
        impossible day (02-30) is only caught by ``complete``.
        """
        if self.type == "categorical":
            return any(c.startswith(text) for c in self.categories)
        if self.type == "date":
            if not _DATE_PREFIX.fullmatch(text):
                return False
            return ((self.min is None or text >= str(self.min)[:len(text)])
                    and (self.max is None or text <= str(self.max)[:len(text)]))
        decimals = self.decimals if self.type == "float" else 0
        m = _NUMBER_PREFIX.fullmatch(text)
        if m is None or (m.group("frac") is not None and (not decimals or len(m.group("frac")) > decimals)):
            return False
        return _reachable(m.group("sign") == "-", m.group("int") or "", m.group("frac"), decimals,
                          -math.inf if self.min is None else float(self.min),
                          math.inf if self.max is None else float(self.max))

    def characters(self) -> frozenset[str]:
        """Every character a written value of this column can contain."""
        if self.type == "categorical":
            return frozenset("".join(self.categories))
        return frozenset("0123456789-" + ("." if self.type == "float" else ""))

    def widest(self) -> int:
        """The most characters a written value of this column takes."""
        if self.type == "categorical":
            return max(map(len, self.categories))
        if self.type == "date":
            return 10
        bounds = [abs(float(v)) for v in (self.min, self.max) if v is not None]
        digits = len(str(int(max(bounds)))) if len(bounds) == 2 else 15
        sign = int(self.min is None or float(self.min) < 0)
        return sign + digits + (1 + self.decimals if self.type == "float" else 0)

    def complete(self, text: str) -> bool:
        """Whether ``text`` is a whole value this column writes (``could_start`` and ``read`` agree)."""
        if not text or text != text.strip() or not self.could_start(text) or text.endswith((".", "-")):
            return False
        try:
            value = self.read(text)
        except RowError:
            return False
        return not (text.startswith("-") and value == 0)  # a negative zero is not written

    def _check_range(self, value: float | str) -> None:
        # ISO dates compare as strings in calendar order
        if (self.min is not None and value < self.min) or (self.max is not None and value > self.max):  # type: ignore[operator]  # a column's bounds are of its values' type (floats, or ISO dates as str)
            raise RowError(OUT_OF_RANGE, self.name)


@dataclass(frozen=True)
class Schema:
    """The table's columns, in their declared order (the order of the written table)."""

    columns: tuple[Column, ...]

    @property
    def names(self) -> tuple[str, ...]:
        """The column names, in order."""
        return tuple(c.name for c in self.columns)

    def column(self, name: str) -> Column:
        """The column called ``name``."""
        return next(c for c in self.columns if c.name == name)

    @property
    def text_column(self) -> str | None:
        """The name of the free-text column (``"type": "text"``), or None for a table without one."""
        return next((c.name for c in self.columns if c.type == "text"), None)

    def only(self, names: Sequence[str]) -> Schema:
        """The schema of the columns in ``names`` alone, in the schema's order (``names`` empty: all)."""
        return Schema(tuple(c for c in self.columns if not names or c.name in names))

    def structured(self) -> Schema:
        """The schema without its free-text column: the columns a marginal counts, a graphical
        model fits and the table metrics score."""
        return Schema(tuple(c for c in self.columns if c.type != "text"))

    def to_dict(self) -> dict[str, Any]:
        """The schema as JSON-ready data (``schema_from_dict`` reads it back)."""
        out = []
        for c in self.columns:
            entry: dict[str, Any] = {"name": c.name, "type": c.type}
            if c.categories:
                entry["categories"] = list(c.categories)
            entry.update({k: v for k, v in (("min", c.min), ("max", c.max)) if v is not None})
            if c.type == "float":
                entry["decimals"] = c.decimals
            out.append(entry)
        return {"columns": out}


def schema_from_dict(data: Mapping[str, Any]) -> Schema:
    """A ``Schema`` from ``{"columns": [{"name", "type", "categories" | "min"/"max", ...}]}``;
    ``SchemaError`` naming the column and the fix for anything unusable."""
    cols = data.get("columns") if isinstance(data, Mapping) else None
    if not isinstance(cols, list) or not cols:
        raise SchemaError('a table schema is {"columns": [{"name": ..., "type": ...}, ...]} with at least one column')
    out: list[Column] = []
    for i, c in enumerate(cols):
        if not isinstance(c, Mapping) or not isinstance(c.get("name"), str) or not c["name"].strip():
            raise SchemaError(f"column {i + 1}: needs a non-empty string 'name'")
        name, kind = c["name"], c.get("type")
        if SEP.strip() in name or IS.strip() in f" {name} ".split() or name != name.strip():
            raise SchemaError(f"column {name!r}: a name may not contain ',' or the word 'is', nor start or end "
                              "with a space (rows are written as 'name is value, ...'); rename it")
        if kind not in TYPES:
            raise SchemaError(f"column {name!r}: type {kind!r}; allowed: {', '.join(TYPES)}")
        unknown = set(c) - {"name", "type", "categories", "min", "max", "decimals"}
        if unknown:
            raise SchemaError(f"column {name!r}: unknown keys {sorted(unknown)}")
        categories = tuple(str(v) for v in c.get("categories", ()))
        if kind == "categorical":
            if not categories or len(set(categories)) != len(categories):
                raise SchemaError(f"column {name!r}: a categorical column needs its distinct 'categories' listed "
                                  "(public: never read off the nodes' records)")
            if any(SEP in v or "\n" in v or not v.strip() or v != v.strip() for v in categories):
                raise SchemaError(f"column {name!r}: a category may not be empty, contain ', ' or a line break, or "
                                  "start or end with a space")
        elif categories:
            raise SchemaError(f"column {name!r}: only a categorical column has 'categories'")
        lo, hi = c.get("min"), c.get("max")
        if kind == "date":
            try:
                lo, hi = (None if v is None else _date(str(v), name).isoformat() for v in (lo, hi))
            except RowError:
                raise SchemaError(f"column {name!r}: 'min' and 'max' of a date column are ISO dates "
                                  "(2024-01-31)") from None
        elif kind in ("integer", "float"):
            try:
                lo, hi = (None if v is None else float(v) for v in (lo, hi))
            except (TypeError, ValueError):
                raise SchemaError(f"column {name!r}: 'min' and 'max' must be numbers") from None
        elif lo is not None or hi is not None:
            raise SchemaError(f"column {name!r}: a {kind} column has no 'min'/'max'")
        if lo is not None and hi is not None and lo > hi:  # type: ignore[operator]  # both dates (str) or both floats, by the kind
            raise SchemaError(f"column {name!r}: min {lo} > max {hi}")
        decimals = c.get("decimals", 2)
        if isinstance(decimals, bool) or not isinstance(decimals, int) or not 0 <= decimals <= 8:
            raise SchemaError(f"column {name!r}: 'decimals' must be an integer from 0 to 8")
        out.append(Column(name, kind, categories, lo, hi, decimals))
    free = [c.name for c in out if c.type == "text"]
    if len(free) > 1:
        raise SchemaError(f"columns {free} are all free text; a table has at most one 'text' column (join the "
                          "others into it, or leave them out)")
    if free and len(out) == 1:
        raise SchemaError(f"column {free[0]!r} is the only column: a table of free text alone is a text run "
                          "(text-column, control-columns), not a table-schema")
    names = [c.name for c in out]
    if len(set(names)) != len(names):
        raise SchemaError(f"column names repeat: {sorted({n for n in names if names.count(n) > 1})}")
    return Schema(tuple(out))


def canonical(schema: Schema | None) -> str:
    """One string per schema ("" for none): what a node compares with its own policy's."""
    return "" if schema is None else json.dumps(schema.to_dict(), sort_keys=True, separators=(",", ":"))


def load_schema(value: str) -> Schema:
    """The schema from a run-config value: inline JSON, or the path of a JSON file."""
    text = value.strip()
    if not text.startswith("{"):
        path = Path(text).expanduser()
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as err:
            raise SchemaError(f"table-schema {value!r}: cannot read the file ({err.strerror}); give a JSON file "
                              "or inline JSON") from None
    try:
        return schema_from_dict(json.loads(text))
    except json.JSONDecodeError as err:
        raise SchemaError(f"table-schema is not valid JSON ({err.msg}, line {err.lineno})") from None


def serialise(row: Mapping[str, Any], schema: Schema, rng: np.random.Generator) -> str:
    """One record as text, its columns in an order drawn from ``rng``, a free-text column's value
    after them (``FREE_TEXT_SEP``). ``RowError`` when a value is not in the schema (the node leaves
    the row out, on the node)."""
    columns = schema.structured().columns
    order = rng.permutation(len(columns))
    text = SEP.join(f"{columns[i].name}{IS}{columns[i].write(row[columns[i].name])}" for i in order)
    free = schema.text_column
    return text if free is None else join_record(text, schema.column(free).write(row[free]))


def join_record(row_text: str, free_text: str) -> str:
    """A record of a table with a free-text column: its row's text, then the free text."""
    return f"{row_text}{FREE_TEXT_SEP}{free_text}"


def split_record(text: str) -> tuple[str, str]:
    """(the row's text, the free text) of a record written by ``join_record``; a record without the
    separator is all row and no free text."""
    row_text, _, free_text = text.partition(FREE_TEXT_SEP)
    return row_text, free_text


def parse(text: str, schema: Schema) -> dict[str, Any]:
    """The typed row written in ``text`` (any column order), keyed by the schema's names in
    its order; ``RowError`` with a fixed reason when ``text`` is not exactly one row of it. A
    free-text column's value is what follows the row (``split_record``)."""
    free = schema.text_column
    if free is not None:
        row_text, free_text = split_record(text)
        values = parse(row_text, schema.structured())
        values[free] = schema.column(free).read(free_text)
        return {n: values[n] for n in schema.names}
    marker = _marker(schema)
    found = list(marker.finditer(text))
    if not found or text[:found[0].start()].strip(" ,"):
        raise RowError(NO_COLUMN)
    values = {}  # typed by parse's result above
    for hit, nxt in zip(found, found[1:] + [None]):
        name = hit.group("name")
        if name in values:
            raise RowError(REPEATED, name)
        end = nxt.start() if nxt is not None else len(text)
        raw = text[hit.end():end].strip()
        if nxt is None and raw.endswith("."):  # a generated sentence may end with a full stop
            try:
                values[name] = schema.column(name).read(raw)
                continue
            except RowError:
                raw = raw[:-1]
        values[name] = schema.column(name).read(raw)
    missing = [n for n in schema.names if n not in values]
    if missing:
        raise RowError(MISSING, missing[0])
    return {n: values[n] for n in schema.names}


def written_pairs(text: str, schema: Schema) -> list[tuple[str, str]]:
    """(column name, value as written) in the order ``text`` writes them (a row's own
    permutation); nothing is checked (``parse`` does that)."""
    found = list(_marker(schema).finditer(text))
    ends = [m.start() for m in found[1:]] + [len(text)]
    return [(m.group("name"), text[m.end():end].strip()) for m, end in zip(found, ends)]


def _marker(schema: Schema) -> re.Pattern[str]:
    # "<name> is " at the start or after ", "; the longest names first so that "age group"
    # is not read as "age" followed by text.
    names = sorted(schema.names, key=len, reverse=True)
    return re.compile(r"(?:^\s*|, )(?P<name>" + "|".join(re.escape(n) for n in names) + r") is ")


_MONTH, _DAY = r"(?:0|0[1-9]|1|1[0-2])?", r"(?:0|0[1-9]|[12]\d?|3|3[01])?"
_DATE_PREFIX = re.compile(rf"\d{{0,4}}|\d{{4}}-(?:{_MONTH}|(?:0[1-9]|1[0-2])-{_DAY})")
_NUMBER_PREFIX = re.compile(r"(?P<sign>-?)(?P<int>0|[1-9]\d{0,14})?(?:\.(?P<frac>\d*))?")


def _reachable(negative: bool, whole: str, frac: str | None, decimals: int, lo: float, hi: float) -> bool:
    """Whether a number whose written form starts with a sign, integer digits ``whole`` and (after
    a point) ``frac`` can still end inside [lo, hi].

    Each way of finishing it is a span of magnitudes [a, b], open at b when digits may follow
    (floats): with the point written, [w.f, w.f + 10^-len(f)); without it, ``whole`` followed by
    k more integer digits, [w * 10^k, (w + 1) * 10^k) for a float and [w * 10^k, (w + 1) * 10^k - 1]
    for an integer, for every k that keeps it under 16 digits.
    """
    if frac is not None and not whole:
        return False  # ".5" is not how a number is written
    spans: list[tuple[float, float, bool]] = []  # (a, b, b included)
    if frac is not None:
        start = float(f"{whole}.{frac}" if frac else whole)
        spans.append((start, start, True) if len(frac) == decimals else (start, start + 10.0 ** -len(frac), False))
    elif not whole:
        spans.append((0.0, math.inf, True))
    elif whole == "0":
        spans.append((0.0, 1.0, False) if decimals else (0.0, 0.0, True))
    else:
        w = int(whole)
        spans += [(w * 10.0 ** k, (w + 1) * 10.0 ** k, False) if decimals
                  else (w * 10.0 ** k, (w + 1) * 10.0 ** k - 1, True) for k in range(16 - len(whole))]
    for a, b, closed in spans:
        if negative:
            if b == 0 or (a == 0 and lo >= 0):
                continue  # "-0" is not written: a negative number needs a negative bound
            # magnitudes [a, b) are the values (-b, -a]
            if (-b <= hi if closed else -b < hi) and -a >= lo:
                return True
        elif a <= hi and (b >= lo if closed else b > lo):
            return True
    return False


def _number(value: Any) -> float | None:
    """A finite number from one value (its own text, or a JSON / Parquet number), else None: a bool,
    an empty or non-numeric text, an integer beyond a float's range (JSON has no limit), inf or NaN."""
    if isinstance(value, (bool, np.bool_)):
        return None
    try:
        number = float(value.strip() if isinstance(value, str) else value)
    except (TypeError, ValueError, OverflowError):
        return None
    return number if math.isfinite(number) else None


def _free_text(value: Any, column: str) -> str:
    # one line of words: whitespace runs (line breaks included) become one space, so the text
    # cannot end its record's row part early nor carry layout a record could be told apart by
    text = " ".join(str(value).split()) if isinstance(value, str) else ""
    if not text:
        raise RowError(MISSING, column)
    return text


def _date(text: str, column: str) -> dt.date:
    try:
        return dt.date.fromisoformat(text.strip())
    except ValueError:
        raise RowError(NOT_A_DATE, column) from None


def generated_part(schema: Schema, control_columns: Sequence[str]) -> Schema:
    """The columns a record's text holds: all but the control columns (its code carries those)."""
    return Schema(tuple(c for c in schema.columns if c.name not in control_columns))


def record_row(text: str, code_values: Mapping[str, str], schema: Schema) -> dict[str, Any]:
    """The full typed row of a record: its text's columns and its code's, in the schema's order."""
    values = {**parse(text, generated_part(schema, list(code_values))),
              **{c: schema.column(c).read(v) for c, v in code_values.items()}}
    return {n: values[n] for n in schema.names}
