"""A neighbouring-datasets harness for the real ClientApp (issue 31), in the way DP testing tools
such as DP-Auditorium and StatDP work: play one request sequence against two nodes whose data
differ in one record, and compare everything the server sees that is not a noised payload.

What must be identical between the two nodes, message by message:

- the reply's kind (a release or an error) and, for an error, its code and text;
- a release's structure (record names, keys, array names, shapes and dtypes) and its statement
  (phase, mechanism, epsilon, delta, sigma, sensitivity, steps ...): everything but the noise;
- the node's ledger statements for the run keys used (what the server's privacy report reads).

Only the values of the noised payloads (weights, counts, votes) may differ. A difference
anywhere else is an outcome that depends on the records: a free bit.

Used by ``tests/test_neighbours.py`` (a fixed example budget in CI) and
``benchmarks/neighbours.py`` (a longer run whose result goes in docs/testing.md).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd
from flwr.app import ArrayRecord, ConfigRecord, Message, RecordDict

from common import records as R
from common.config import RunConfig
from fedsyn_client import node as node_module
from fedsyn_client.client_app import app
from fedsyn_client.ledger import PrivacyLedger
from tests.fakes import client_node, set_task_identity

BUDGET = 4.0
CODES = ("topic=x", "topic=y", "topic=z")
SCHEMA = json.dumps({"columns": [{"name": "topic", "type": "categorical", "categories": ["x", "y", "z"]},
                                 {"name": "size", "type": "integer", "min": 0, "max": 99}]})


# Records a neighbour may add (issue 45): odd control values, a missing one, unicode, a text far
# longer than the others. The added record's raw value must change nothing but its own code.
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


def view_difference(d: str, other: str, state: Path, table: bool = False) -> str | None:
    """None when the node's records from the two files (read as the node reads them: its policy's
    columns, and schema for a table) differ in at most one record, added or removed, every other record
    reading the same text and code; else what differs. The mechanisms' sensitivities assume it: a
    rule that codes a record from the other rows (pandas typing a column from the whole file) moves
    every record at once, while each release only shows noise."""
    from collections import Counter

    from fedsyn_client.policy import policy_from_node_config

    seen = []
    for path in (d, other):
        config = {"tier": "weak", "data-path": path, "max-records": 100, "state-dir": str(state), "epsilon": BUDGET,
                  **({"table-schema": SCHEMA} if table else {})}
        records = node_module._data(policy_from_node_config(config), None)
        seen.append(Counter(zip(records.texts, records.codes)))
    only_d, only_other = seen[0] - seen[1], seen[1] - seen[0]
    if sorted((sum(only_d.values()), sum(only_other.values()))) in ([0, 0], [0, 1]):  # a record no view holds: 0
        return None
    return f"the views differ in more than one record: only in D {dict(only_d)}, only in D' {dict(only_other)}"


def _frame(rows: list[tuple[str, int]]) -> pd.DataFrame:
    return pd.DataFrame({"text": [f"record {i} about {t} and its subject {t * 3}" for t, i in rows],
                         "topic": [t for t, _ in rows], "size": [i % 90 for _, i in rows]})


def _without(rows: list[tuple[str, int]], topic: str) -> list[tuple[str, int]]:
    last = max(i for i, (t, _) in enumerate(rows) if t == topic)
    return rows[:last] + rows[last + 1:]


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


def base_run_config(data: str, table: bool = False) -> dict[str, Any]:
    """The run config of the harness: a tiny model, two rounds of two steps, ``BUDGET``."""
    cfg = RunConfig(model="tiny-gpt2", dataset=data, test_fraction=0.0, epsilon=BUDGET, epsilon_profile=1.0,
                    num_server_rounds=2, local_steps=2, batch_size=4, max_length=16,
                    control_codes=(), **({"table_schema": SCHEMA, "text_column": "text", "table_method": "rows"} if table else {}))
    return cfg.to_flower()


def play(steps: list[Step], data: str, state: Path, table: bool = False) -> list[Observation]:
    """Send ``steps`` in order to one node holding ``data`` (state in ``state``); what it saw."""
    out = []
    arrays = initial_arrays(base_run_config(data, table))
    for step in steps:
        reply = _send(step, data, state, arrays, table)
        out.append(_observe(reply, state))
    return out


def first_difference(a: list[Observation], b: list[Observation], steps: list[Step]) -> str | None:
    """None when the two nodes' observations agree; else which step differed, and how."""
    for i, (x, y, step) in enumerate(zip(a, b, steps)):
        if x != y:
            return f"step {i} ({step.describe()}):\n  D : {x}\n  D': {y}"
    return None


def _send(step: Step, data: str, state: Path, arrays: ArrayRecord, table: bool) -> Message:
    node_module._policy.cache_clear()
    node_module._open.cache_clear()
    rc = {**base_run_config(data, table), **dict(step.rc)}
    node_config = {"tier": step.tier, "data-path": data, "max-records": 100, "state-dir": str(state), "epsilon": BUDGET,
                   **dict(step.policy)}
    if table:
        node_config["table-schema"] = SCHEMA
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
