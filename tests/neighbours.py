"""A neighbouring-datasets harness for the real ClientApp (issues 31, 45, 60), in the way DP testing
tools such as DP-Auditorium and StatDP work: play one request sequence against two nodes whose data
differ in one record, and compare everything the server sees that is not a noised payload.

What must be identical between the two nodes, message by message:

- the reply's kind (a release or an error) and, for an error, its code and text;
- a release's structure (record names, keys, array names, shapes and dtypes) and its statement
  (phase, mechanism, epsilon, delta, sigma, sensitivity, steps ...): everything but the noise;
- the node's ledger statements for the run keys used (what the server's privacy report reads).

Only the values of the noised payloads (weights, counts, votes) may differ. A difference
anywhere else is an outcome that depends on the records: a free bit. And what the noise covers
must hold too (issue 60), which comparing structure cannot see:

- ``view_difference``: the node's real view of D and of D' (the whole file read as the node reads
  it, and the records under ``max-records`` that ``fedsyn_client.view.bounded`` keeps with the
  node's secret) differ in at most one record, added or removed, every other record unchanged;
- ``sensitivity_check``: with the noise off, each release's payloads on D and D' are at most the
  sensitivity its statement gives apart (L2): a view that swaps a record, or a stated
  sensitivity below the real one, fails it.

Every path a node serves is drawn (``Shape``): a text file, and a table by rows, by marginals and
with a free-text column; as CSV, JSON Lines, gzipped JSON Lines and Parquet; below, at and above
``max-records``; with one record added or removed at the first, a middle or the last position
(``Neighbour``), the added record an ordinary one or one that broke a reader or a column's typing
before (``ADD_KINDS``).

Used by ``tests/test_neighbours.py`` and ``tests/test_sensitivity.py`` (a fixed example budget in
CI) and ``benchmarks/neighbours.py`` (a longer run whose result goes in docs/testing.md).
"""

from __future__ import annotations

import gzip
import json
import math
import re
import shutil
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from flwr.app import ArrayRecord, ConfigRecord, Message, RecordDict

from common import records as R
from common.config import RunConfig
from fedsyn_client import node as node_module
from fedsyn_client.client_app import app
from fedsyn_client.ledger import PrivacyLedger
from tests.fakes import client_node, set_task_identity

BUDGET = 4.0
MAX_RECORDS = 100  # every harness node's public bound; ``SIZES`` sit below, at and above it
CODES = ("topic=x", "topic=y", "topic=z")
# issue 31's table (two columns; ``write_pair``'s files)
SCHEMA = json.dumps({"columns": [{"name": "topic", "type": "categorical", "categories": ["x", "y", "z"]},
                                 {"name": "size", "type": "integer", "min": 0, "max": 99}]})
# issue 60's tables: a categorical column of numbers as text ("1"/"2"/"3": finding 1's ``stars``),
# and the same with a free-text column (docs/tables.md#free-text)
_COLUMNS = [{"name": "topic", "type": "categorical", "categories": ["x", "y", "z"]},
            {"name": "stars", "type": "categorical", "categories": ["1", "2", "3"]},
            {"name": "size", "type": "integer", "min": 0, "max": 99}]
TABLE_SCHEMA = json.dumps({"columns": _COLUMNS})
FREE_SCHEMA = json.dumps({"columns": [*_COLUMNS, {"name": "review", "type": "text"}]})

# ---------------------------------------------------------------------------------------- paths
PATHS = ("text", "rows", "marginals", "free-text")  # "table": issue 31's two-column table by rows
FORMATS = ("csv", "jsonl", "jsonl.gz", "parquet")
SIZES = (41, MAX_RECORDS, 130)  # at MAX_RECORDS; ``sizes`` at any bound
POSITIONS = ("first", "middle", "last")
OPS = ("add", "remove")
_SCHEMAS = {"text": "", "table": SCHEMA, "rows": TABLE_SCHEMA, "marginals": TABLE_SCHEMA, "free-text": FREE_SCHEMA}
_METHODS = {"table": "rows", "rows": "rows", "marginals": "marginals", "free-text": "marginals"}


@dataclass(frozen=True)
class Shape:
    """The node a neighbour pair is drawn for: its path (``PATHS``, or ``table``), its file's format
    and size (records of D), its ``max-records`` and the epsilon of its node and run config (inf:
    no noise, the sensitivity check's)."""

    path: str = "text"
    format: str = "csv"
    size: int = 41
    max_records: int = MAX_RECORDS
    epsilon: float = BUDGET

    @property
    def table(self) -> bool:
        """Whether the node's records are a table's rows (a table schema)."""
        return self.path != "text"

    @property
    def schema(self) -> str:
        """The table schema (inline JSON) of the run and the node; "" for a text run."""
        return _SCHEMAS[self.path]

    def run_config(self, data: str) -> dict[str, Any]:
        """The harness's run config: a tiny model, two rounds of two steps, ``epsilon``."""
        table = {"table_schema": self.schema, "table_method": _METHODS[self.path]} if self.table else {}
        cfg = RunConfig(model="tiny-gpt2", dataset=data, test_fraction=0.0, epsilon=self.epsilon, epsilon_profile=1.0,
                        num_server_rounds=2, local_steps=2, batch_size=4, max_length=16, control_codes=(),
                        text_column="text", **table)
        return cfg.to_flower()

    def node_config(self, data: str, state: Path, tier: str = "weak") -> dict[str, Any]:
        """The node's ``--node-config`` for ``data`` (its state in ``state``)."""
        config = {"tier": tier, "data-path": data, "max-records": self.max_records, "state-dir": str(state),
                  "epsilon": self.epsilon, "vote-window": 32}  # the run's max-length 16: votes at 32 tokens
        return {**config, **({"table-schema": self.schema} if self.table else {})}

    def describe(self) -> str:
        """One line for a report: path, format, size against the bound."""
        side = "below" if self.size < self.max_records else "at" if self.size == self.max_records else "above"
        return f"{self.path}/{self.format}/{self.size} ({side} max-records {self.max_records})"


def sizes(bound: int) -> tuple[int, int, int]:
    """File sizes below, at and above ``bound`` (41, 100 and 130 at the harness's 100)."""
    return max(1, round(0.41 * bound)), bound, round(1.3 * bound)


def as_shape(table: bool | Shape) -> Shape:
    """``table`` as a ``Shape``: issue 31's callers pass a bool (its table, or a text file)."""
    if isinstance(table, Shape):
        return table
    return Shape("table") if table else Shape("text")


# ------------------------------------------------------------------------------------ records
# What a record added by a neighbour may hold (issues 45, 60): each once changed more than its own
# record on some path (a reader that split a line, failed on a value, or typed a column from it)
_LONG = "a record far longer than the others " * 400
ADD_KINDS = ("plain", "line-separator", "paragraph-separator", "next-line", "lone-surrogate", "big-integer",
             "empty-category", "numeric-category", "zero-padded", "unicode", "long")
_FREE_TEXTS = {"line-separator": "great film\u2028truly", "paragraph-separator": "one\u2029two",
               "next-line": "one\x85three", "lone-surrogate": "great film \ud83d", "unicode": "record añadido sobre ẋ",
               "long": _LONG}


@dataclass(frozen=True)
class Neighbour:
    """How D' differs from D: one record added (of kind ``record``, ``ADD_KINDS``) or one removed,
    at the ``position`` (``POSITIONS``) of the file."""

    op: str = "add"
    position: str = "last"
    record: str = "plain"

    def describe(self) -> str:
        """One line for a report."""
        return f"{self.op} {self.record + ' ' if self.op == 'add' else ''}record at {self.position}"


def applies(shape: Shape, neighbour: Neighbour) -> bool:
    """Whether ``neighbour`` can be written in ``shape``'s format: a lone surrogate exists only as a
    JSON escape (a CSV or Parquet file holding one is not UTF-8: outside the promise, privacy.md)."""
    return not (neighbour.op == "add" and neighbour.record == "lone-surrogate" and not shape.format.startswith("json"))


def base_rows(size: int) -> list[dict[str, Any]]:
    """D's rows: the first the only ``z`` (removing it empties a view), the others ``x`` and ``y`` in
    turn; every column a path reads (text, topic, stars, size, review) and one none reads (note)."""
    rows = []
    for i in range(size):
        topic = "z" if i == 0 else "xy"[i % 2]
        rows.append({"text": f"record {i} about {topic} and its subject {topic * 3}", "topic": topic,
                     "stars": str(1 + i % 3), "size": i % 90, "note": f"note {i}",
                     "review": f"review {i}: a {('dull', 'fine', 'great')[i % 3]} film about {topic}"})
    return rows


def added_row(shape: Shape, kind: str) -> dict[str, Any]:
    """The record a neighbour of ``kind`` adds, on ``shape``'s path: odd text where the path reads
    text (a text file's text, a free-text column; a table's unread ``note`` otherwise, which its
    reader still parses), an odd value in the category the path codes by (topic; a table's stars)."""
    row = {"text": "the added record about y", "topic": "y", "stars": "2", "size": 7, "note": "an added note",
           "review": "the added review of a film about y"}
    text = {"text": "text", "free-text": "review"}.get(shape.path, "note")
    category = "topic" if shape.path == "text" else "stars"
    if kind in _FREE_TEXTS:
        row[text] = _FREE_TEXTS[kind]
    if kind == "unicode":
        row[category] = "ẋ"
    elif kind == "big-integer":  # a JSON number beyond 64 bits, where the path reads a number or a text
        row["text" if shape.path == "text" else "size"] = 10 ** 30
    elif kind == "empty-category":
        row[category] = None
    elif kind == "numeric-category":  # a number in a column of strings ("2.0" in a CSV)
        row[category] = 4.5 if shape.path == "text" else 2.0
    elif kind == "zero-padded":
        row[category] = "01" if shape.path == "text" else "02"
    elif kind not in ADD_KINDS:
        raise ValueError(f"unknown added record {kind!r}; one of {ADD_KINDS}")
    return row


def neighbour_rows(shape: Shape, neighbour: Neighbour) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(D's rows, D''s rows) for ``shape`` and ``neighbour``."""
    rows = base_rows(shape.size)
    if neighbour.op == "remove":
        if not rows:
            return rows, rows
        at = {"first": 0, "middle": len(rows) // 2, "last": len(rows) - 1}[neighbour.position]
        return rows, rows[:at] + rows[at + 1:]
    at = {"first": 0, "middle": len(rows) // 2, "last": len(rows)}[neighbour.position]
    return rows, rows[:at] + [added_row(shape, neighbour.record)] + rows[at:]


def write_rows(path: Path, rows: list[dict[str, Any]]) -> str:
    """``rows`` in the format ``path``'s name ends in, as an export would write them: CSV by pandas
    (None empty), JSON Lines one object a line (raw U+2028 inside strings, as JSON allows; a lone
    surrogate as its escape), gzipped too, Parquet by pyarrow (a column whose values one type cannot
    hold, such as a number among strings or an integer beyond 64 bits, written as text: the writer
    types the column, as a real export's would)."""
    name = path.name
    if name.endswith(".csv"):
        pd.DataFrame(rows).to_csv(path, index=False)
    elif name.endswith(".parquet"):
        import pyarrow as pa
        import pyarrow.parquet as pq

        names = list(rows[0]) if rows else ["text"]
        columns = {k: [r.get(k) for r in rows] for k in names}
        for k, values in columns.items():
            kinds = {type(v) for v in values if v is not None}
            if len(kinds) > 1 or any(isinstance(v, int) and not -2 ** 63 <= v < 2 ** 63 for v in values):
                columns[k] = [None if v is None else str(v) for v in values]
        pq.write_table(pa.table(columns), path)
    else:
        text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
        text = re.sub("[\ud800-\udfff]", lambda m: f"\\u{ord(m.group()):04x}", text)
        data = text.encode("utf-8")
        path.write_bytes(gzip.compress(data) if name.endswith(".gz") else data)
    return str(path)


def write_neighbours(folder: Path, shape: Shape, neighbour: Neighbour) -> tuple[str, str]:
    """Write D and D' for ``shape`` and ``neighbour`` in ``folder``; their paths."""
    d, other = neighbour_rows(shape, neighbour)
    stem = f"{shape.path}-{shape.size}-{neighbour.op}-{neighbour.record}-{neighbour.position}"
    return (write_rows(folder / f"d-{stem}.{shape.format}", d),
            write_rows(folder / f"d-other-{stem}.{shape.format}", other))


# Issue 31/45's neighbours of a 41-record CSV (the corpus tests): records a neighbour may add (odd
# control values, a missing one, unicode, a text far longer than the others), or one removed.
ADDED = {
    "add-odd": ("record added with an odd topic", "x.0"),
    "add-zero-padded": ("record added with a zero-padded topic", "01"),
    "add-empty": ("record added with an empty topic", ""),
    "add-unicode": ("record añadido sobre ẋ", "ẋ"),
    "add-long": ("a record far longer than the others " * 400, "x"),
    "add-number": ("record added with a numeric topic", "4.5"),
}
NEIGHBOURS = ("remove-y", "remove-z", *ADDED)


def write_pair(folder: Path, remove: str, table: bool = False) -> tuple[str, str]:
    """Two CSV data sets that differ in one record: the second lacks one record of topic ``remove``
    (``y``/``z``, or ``remove-y``/``remove-z``) or holds one more record (``add-...``, ``ADDED``).

    The first holds 20 records of x, 20 of y and 1 of z, so removing the z record empties a view
    and removing a y record makes a code's view smaller than another's (the phase-1 case).
    ``table``: the text column is a row of ``SCHEMA``'s other column (a table run's data).
    """
    rows = [(t, i) for t, n in (("x", 20), ("y", 20), ("z", 1)) for i in range(n)]
    frame = _frame(rows)
    neighbour = remove if remove.startswith(("remove-", "add-")) else f"remove-{remove}"
    if neighbour.startswith("remove-"):
        other = _frame(_without(rows, neighbour.split("-", 1)[1]))
    else:
        text, topic = ADDED[neighbour]
        other = pd.concat([frame, pd.DataFrame({"text": [text], "topic": [topic], "size": [7]})], ignore_index=True)
    paths = []
    for name, data in (("d", frame), ("d-other", other)):
        path = folder / f"{name}-{neighbour}{'-table' if table else ''}.csv"
        data.to_csv(path, index=False)
        paths.append(str(path))
    return paths[0], paths[1]


def _frame(rows: list[tuple[str, int]]) -> pd.DataFrame:
    return pd.DataFrame({"text": [f"record {i} about {t} and its subject {t * 3}" for t, i in rows],
                         "topic": [t for t, _ in rows], "size": [i % 90 for _, i in rows]})


def _without(rows: list[tuple[str, int]], topic: str) -> list[tuple[str, int]]:
    last = max(i for i, (t, _) in enumerate(rows) if t == topic)
    return rows[:last] + rows[last + 1:]


# --------------------------------------------------------------------------------- the views
def view_difference(d: str, other: str, state: Path, table: bool | Shape = False,
                    secret: int | None = None) -> str | None:
    """None when the node's records of the two files differ in at most one record, added or removed,
    every other record reading the same text and code; else what differs. Checked twice: the whole
    file as the node reads it (its policy's columns, a table's schema), and the node's real view,
    what ``node._view`` serves: the records under ``max-records`` that ``fedsyn_client.view.bounded``
    keeps with the node's secret in ``state`` (one secret for both files, as one node would hold).

    The mechanisms' sensitivities assume it: a rule that codes a record from the other rows
    (pandas typing a column from the whole file) moves every record at once, and a view that
    pushes one record out when another comes in (a subsample of exactly the bound) is a swap,
    while each release only shows noise."""
    from fedsyn_client.policy import policy_from_node_config
    from fedsyn_client.refusals import NodeSetupError

    shape = as_shape(table)
    if secret is not None:
        share_view_seed(state, secret=secret)
    whole, view, unreadable = [], [], []
    for path in (d, other):
        policy = policy_from_node_config(shape.node_config(path, state))
        try:
            records = node_module._data(policy, None)
            served, _ = node_module._view(policy, str(state))
        except NodeSetupError as err:  # the file refused as a whole: the same for D and D' is no difference
            unreadable.append(f"{Path(path).name}: {err}")
            continue
        whole.append(Counter(zip(records.texts, records.codes)))
        view.append(Counter(zip(served.texts, served.codes)))
    if unreadable:
        return None if len(unreadable) == 2 else f"one file of the two is unreadable: {unreadable[0]}"
    for name, (a, b) in (("files", whole), ("views", view)):
        only_d, only_other = a - b, b - a
        if sorted((sum(only_d.values()), sum(only_other.values()))) not in ([0, 0], [0, 1]):
            return (f"the {name} differ in more than one record: only in D {_few(only_d)}, "
                    f"only in D' {_few(only_other)}")
    return None


def _few(records: Counter) -> str:
    items = list(records.items())
    cut = [((t[:60] + "...") if len(t) > 60 else t, c, n) for (t, c), n in items[:3]]
    return f"{len(items)} records, e.g. {cut}"


def share_view_seed(*states: Path, secret: int | None = None) -> None:
    """Give every state folder of ``states`` one view secret, ``secret`` (None: the first folder's,
    made if it has none): the two nodes of a pair are one node on D and on D' (the neighbour
    relation is for one secret; ``view.bounded``). A drawn secret makes a failure reproducible."""
    import os

    from common.io import atomic_write_text
    from fedsyn_client.view import SEED_FILE, view_seed

    if secret is not None:
        states[0].mkdir(parents=True, exist_ok=True)
        atomic_write_text(states[0] / SEED_FILE, f"{int(secret)}\n")
        os.chmod(states[0] / SEED_FILE, 0o600)
    view_seed(states[0])
    for state in states[1:]:
        state.mkdir(parents=True, exist_ok=True)
        shutil.copy2(states[0] / SEED_FILE, state / SEED_FILE)


# ------------------------------------------------------------------------------- the requests
@dataclass(frozen=True)
class Step:
    """One request of a sequence: a message type, its run-config overrides and its config values."""

    message: str
    rc: tuple[tuple[str, Any], ...] = ()
    conf: tuple[tuple[str, Any], ...] = ()
    tier: str = "strong"
    candidates: tuple[tuple[str, str], ...] | None = None
    policy: tuple[tuple[str, Any], ...] = ()  # node-config keys beyond the harness's (pins, caps, allow-lists)
    weights: str = "initial"  # train: "initial" or "none" (no arrays: malformed)

    def describe(self) -> str:
        """One line for a failing example's report."""
        return f"{self.message} tier={self.tier} rc={dict(self.rc)} conf={dict(self.conf)} policy={dict(self.policy)}"


@dataclass
class Observation:
    """What the server saw of one reply, noise left out, and the ledger statements after it."""

    kind: str  # "error" or "release"
    error: tuple[int, str] | None = None
    structure: dict[str, Any] = field(default_factory=dict)
    statements: list[dict[str, Any]] = field(default_factory=list)


def base_run_config(data: str, table: bool | Shape = False) -> dict[str, Any]:
    """The run config of the harness for ``table`` (a ``Shape``, or issue 31's bool)."""
    return as_shape(table).run_config(data)


def play(steps: list[Step], data: str, state: Path, table: bool | Shape = False) -> list[Observation]:
    """Send ``steps`` in order to one node holding ``data`` (state in ``state``); what it saw."""
    return [_observe(reply, state) for reply in replies(steps, data, state, table)]


def replies(steps: list[Step], data: str, state: Path, table: bool | Shape = False) -> Iterator[Message]:
    """The node's replies to ``steps``, in order (one node holding ``data``, state in ``state``)."""
    arrays = initial_arrays(base_run_config(data, table))
    for step in steps:
        yield _send(step, data, state, arrays, table)


def play_pair(steps: list[Step], d: str, other: str, folder: Path, table: bool | Shape = False,
              secret: int | None = None) -> tuple[list[Observation], list[Observation]]:
    """``steps`` played on a node holding D and on one holding D' (one view secret for both)."""
    states = [folder / "state-0", folder / "state-1"]
    share_view_seed(*states, secret=secret)
    first, second = (play(steps, data, state, table) for data, state in zip((d, other), states))
    return first, second


def first_difference(a: list[Observation], b: list[Observation], steps: list[Step]) -> str | None:
    """None when the two nodes' observations agree; else which step differed, and how."""
    for i, (x, y, step) in enumerate(zip(a, b, steps)):
        if x != y:
            return f"step {i} ({step.describe()}):\n  D : {x}\n  D': {y}"
    return None


def _send(step: Step, data: str, state: Path, arrays: ArrayRecord, table: bool | Shape) -> Message:
    shape = as_shape(table)
    node_module._policy.cache_clear()
    node_module._open.cache_clear()
    rc = {**shape.run_config(data), **dict(step.rc)}
    node_config = {**shape.node_config(data, state, step.tier), **dict(step.policy)}
    node = client_node(app, 5, node_config, rc, run_id=1)
    set_task_identity()
    content = RecordDict({R.CONFIG: ConfigRecord(dict(step.conf))})
    if step.message == R.MSG_TRAIN and step.weights == "initial":
        content[R.ARRAYS] = arrays
    if step.candidates is not None:
        content[R.CANDIDATES] = ConfigRecord({"texts": [t for t, _ in step.candidates],
                                              "codes": [c for _, c in step.candidates]})
    return node(Message(content=content, message_type=step.message, dst_node_id=5))


def _observe(reply: Message, state: Path) -> Observation:
    statements = []
    ledger = state / "ledger.json"
    if ledger.exists():
        book = PrivacyLedger(ledger)
        for run_key in sorted({str(r["run_id"]) for r in book.releases}):
            statements += book.run_statements(run_key)
    if reply.has_error():
        return Observation("error", (int(reply.error.code), str(reply.error.reason)), statements=statements)
    structure: dict[str, Any] = {}
    for name, rec in reply.content.array_records.items():
        structure[f"arrays:{name}"] = sorted((k, tuple(a.shape), str(a.dtype)) for k, a in rec.items())
    for name, rec in reply.content.metric_records.items():
        # a vector is a noised payload (counts, votes): its shape only; a scalar is not noised
        # (a weight, a step count): its value, so a planted ``num-examples: |D|`` would show
        structure[f"metrics:{name}"] = sorted((k, _shape(v)) for k, v in rec.items())
    for name, rec in reply.content.config_records.items():
        # the release statement and the tier and ledger answers are not noised: compared whole
        structure[f"config:{name}"] = _plain(dict(rec))
    return Observation("release", structure=structure, statements=statements)


def _shape(v: Any) -> Any:
    return ("list", len(v)) if isinstance(v, list) else (type(v).__name__, v)


def _plain(d: dict[str, Any]) -> dict[str, Any]:
    # The ledger answer holds a JSON list of statements: compared parsed. A ledger's ref is a random
    # name made with the ledger (two nodes, two names), the same for any data: left out.
    return {k: (json.loads(v) if k == "releases" else v) for k, v in d.items() if k != "ledger-ref"}


_ARRAYS: dict[str, ArrayRecord] = {}


def initial_arrays(rc: dict[str, Any]) -> ArrayRecord:
    """The server's initial trainable weights for run config ``rc`` (built once per model terms)."""
    from fedsyn_server.synthesis import ServerModel

    key = json.dumps({k: rc[k] for k in ("model", "finetune", "lora-rank", "lora-layers", "seed")}, sort_keys=True)
    if key not in _ARRAYS:
        _ARRAYS[key] = ServerModel(RunConfig.from_flower(rc)).initial_arrays()
    return _ARRAYS[key]


# ------------------------------------------------------------------------ the sensitivity check
@dataclass(frozen=True)
class Distance:
    """One release's payloads on D and D' with the noise off: their L2 distance and the sensitivity
    its statement gives (``max_grad_norm`` for a DP-SGD step's clipped sum)."""

    step: int
    release: str  # the phase, and the histogram of a Gaussian release
    distance: float
    sensitivity: float

    @property
    def within(self) -> bool:
        """Whether the distance is at most the stated sensitivity (float32 sums: 1e-4 relative)."""
        return self.distance <= self.sensitivity * (1 + 1e-4) + 1e-6


def sensitivity_check(steps: list[Step], d: str, other: str, folder: Path, table: bool | Shape = False,
                      secret: int | None = None) -> list[Distance]:
    """Play ``steps`` on a node holding D and one holding D' (one view secret) with the noise off,
    and measure, for each release both answered, the L2 distance between the two payloads against
    the sensitivity the release's statement gives.

    Noise off: a Gaussian release (profile, every vote histogram, marginals) through the node's own
    config, node-config and run-config epsilon = inf (sigma 0 by ``analytic_gaussian_sigma``); its
    payload is then the histogram itself. DP-SGD at epsilon = inf does not clip, so its steps run at
    the shape's finite epsilon under ``dpsgd_without_noise``, which reads each step's clipped sum
    where Opacus draws its noise; the first step of each round (both nodes start from the server's
    weights) is compared with the statement's ``max_grad_norm`` C. A later step starts from weights
    the first one moved, so it is not a neighbour's comparison."""
    shape = as_shape(table)
    gaussian = [(i, s) for i, s in enumerate(steps) if s.message != R.MSG_TRAIN]
    trains = [(i, s) for i, s in enumerate(steps) if s.message == R.MSG_TRAIN]
    out: list[Distance] = []
    if gaussian:
        seen = _pair_replies([s for _, s in gaussian], d, other, folder / "sens-gaussian",
                             replace(shape, epsilon=math.inf), secret)
        for (i, _), (a, b) in zip(gaussian, seen):
            if a.has_error() or b.has_error() or R.RELEASE not in a.content.config_records:
                continue
            statement = dict(a.content.config_records[R.RELEASE])
            out.append(Distance(i, f"{statement['phase']}:{statement.get('histogram', '')}",
                                float(np.linalg.norm(_vector(a) - _vector(b))), float(statement["sensitivity"])))
    if trains:
        with dpsgd_without_noise() as rounds:
            seen = _pair_replies([s for _, s in trains], d, other, folder / "sens-dpsgd", shape, secret, rounds)
        for (i, _), (a, b), sums in zip(trains, seen, rounds_by_step(rounds, len(trains))):
            if a.has_error() or b.has_error() or sums is None:
                continue
            statement = dict(a.content.config_records[R.RELEASE])
            out.append(Distance(i, "train:clipped-sum", float(np.linalg.norm(sums[0] - sums[1])),
                                float(statement["max_grad_norm"])))
    return out


def _pair_replies(steps: list[Step], d: str, other: str, folder: Path, shape: Shape, secret: int | None = None,
                  rounds: list | None = None) -> list[tuple[Message, Message]]:
    """Each step sent to the node on D, then to the node on D' (one secret). With ``rounds`` (the
    DP-SGD capture), each reply's first clipped sum is tagged with its step and node."""
    states = [folder / "state-0", folder / "state-1"]
    share_view_seed(*states, secret=secret)
    arrays = initial_arrays(shape.run_config(d))
    out = []
    for k, step in enumerate(steps):
        pair = []
        for n, (data, state) in enumerate(zip((d, other), states)):
            before = len(rounds) if rounds is not None else 0
            pair.append(_send(step, data, state, arrays, shape))
            if rounds is not None:
                for r in rounds[before:]:
                    r["at"] = (k, n)
        out.append((pair[0], pair[1]))
    return out


def rounds_by_step(rounds: list[dict[str, Any]], steps: int) -> list[tuple[np.ndarray, np.ndarray] | None]:
    """For each of ``steps`` train steps, (D's, D''s) clipped sum of the first DP-SGD step of the
    round it ran, or None when a node ran no private step for it."""
    first: dict[tuple[int, int], np.ndarray] = {}
    for r in rounds:
        if "at" in r and r["sums"]:
            first.setdefault(r["at"], r["sums"][0])
    return [(first[(k, 0)], first[(k, 1)]) if (k, 0) in first and (k, 1) in first else None for k in range(steps)]


@contextmanager
def dpsgd_without_noise() -> Iterator[list[dict[str, Any]]]:
    """DP-SGD on the real path with the noise at zero, each step's clipped sum read: yields a list
    that gets, per ``dp_train`` call (a round), ``{"sums": [one float64 vector per step]}``.

    Four things are replaced while it is open, none of them the clipping: Opacus' one noise draw
    (``opacus.optimizers.optimizer._generate_noise``, whose ``reference`` is the clipped sum) gives
    zeros and keeps the sum; the Poisson sample takes every slot of the bound, so both nodes' steps
    sum every record of their views, whatever their order in the file (a sampler seeded by the OS,
    as a private node's is, draws two different batches); each ``nn.Dropout`` is set to 0, so a
    record's gradient is a function of that record; and the contrastive objective's other code is
    the next code of the vocabulary instead of a random one, for the same reason. What is left is
    the sum of the records' clipped gradients, which one record moves by at most C."""
    import opacus.optimizers.optimizer as opacus_optimizer
    import torch

    from fedsyn_client import training

    rounds: list[dict[str, Any]] = []
    captured: list[torch.Tensor] = []
    originals = {"noise": opacus_optimizer._generate_noise, "slots": training.poisson_slots,
                 "other": training._other_codes, "train": training.dp_train, "step": training._private_step}

    def no_noise(std, reference, generator=None, secure_mode=False):  # noqa: ARG001 - Opacus' signature
        captured.append(reference.detach().double().flatten().cpu().clone())
        return torch.zeros_like(reference)

    def every_slot(bound, q, generator):  # noqa: ARG001 - training.poisson_slots' signature
        while True:
            yield torch.arange(bound)

    def next_code(codes, settings, generator):  # noqa: ARG001 - training._other_codes' signature
        vocabulary = list(settings.vocabulary) or sorted(set(codes))
        return [vocabulary[(vocabulary.index(c) + 1) % len(vocabulary)] if c in vocabulary else vocabulary[0]
                for c in codes]

    def dp_train(model, *args, **kwargs):
        for module in model.modules():
            if isinstance(module, torch.nn.Dropout):
                module.p = 0.0
        rounds.append({"sums": []})
        return originals["train"](model, *args, **kwargs)

    def private_step(*args, **kwargs):
        start = len(captured)
        loss = originals["step"](*args, **kwargs)
        if len(captured) > start:
            rounds[-1]["sums"].append(torch.cat(captured[start:]).numpy())
        return loss

    opacus_optimizer._generate_noise = no_noise
    training.poisson_slots, training._other_codes = every_slot, next_code
    training.dp_train, training._private_step = dp_train, private_step
    try:
        yield rounds
    finally:
        opacus_optimizer._generate_noise = originals["noise"]
        training.poisson_slots, training._other_codes = originals["slots"], originals["other"]
        training.dp_train, training._private_step = originals["train"], originals["step"]


def _vector(reply: Message) -> np.ndarray:
    """A Gaussian release's payload: its one vector (profile, votes, marginals)."""
    values = [np.asarray(v, dtype=np.float64) for rec in reply.content.metric_records.values()
              for v in rec.values() if isinstance(v, list)]
    return np.concatenate(values) if values else np.zeros(0)


# ----------------------------------------------------------------------- every release, once
CANDIDATES = (("a text about x", CODES[0]), ("one about y", CODES[1]), ("record 0 about z", CODES[2]),
              ("record 3 about x and its subject xxx", CODES[0]), ("review 4: a fine film about y", CODES[1]))
# every registered histogram
VOTE_KINDS = ("knn-vote", "contrastive-vote", "nearest-neighbour", "similarity", "centred-similarity")
# the marginals a table's release counts: every column alone and two pairs (L2 sensitivity sqrt(5))
CLIQUES = '[["topic"], ["stars"], ["size"], ["topic", "stars"], ["stars", "size"]]'


def every_release(shape: Shape, num_votes: int = 2, histograms: tuple[str, ...] = VOTE_KINDS,
                  train: bool = True) -> list[Step]:
    """One request of each release ``shape``'s path serves, each under its own run key (no phase's
    budget or binding meets another's): a text file and a table by rows a profile, a vote of each of
    ``histograms`` (K = ``num_votes``) and a DP-SGD round (``train``); a table by marginals its
    marginals; one with a free-text column its marginals, the votes and DP-SGD on the free text."""
    def conf(key: str, rnd: int, **extra: Any) -> tuple:
        return tuple(sorted({"codes": list(CODES), "resume-key": key, "server-round": rnd, "delta": 1e-5,
                             **extra}.items()))

    steps = []
    if shape.path in ("text", "table", "rows"):
        steps.append(Step(R.MSG_PROFILE, conf=conf("profile", 0), tier="weak"))
    if shape.path in ("marginals", "free-text"):
        steps.append(Step(R.MSG_MARGINALS, conf=conf("marginals", 1, cliques=CLIQUES), tier="weak"))
    if shape.path != "marginals":
        steps += [Step(R.MSG_VOTE, conf=conf(f"vote-{h}", 1, histogram=h, **{"num-votes": num_votes}), tier="weak",
                       candidates=CANDIDATES) for h in histograms]
        if train:
            steps.append(Step(R.MSG_TRAIN, conf=conf("train", 1)))
    return steps
