"""A node's privacy policy: what the institution allows its records to lose, whatever the server asks.

The server *asks* (run config + message); the node checks the request against its policy
and refuses what does not fit, before it reads a record. Everything that decides how much
a node's records can lose, and what runs on them, comes from here, never from the server:

| policy field      | node-config key (deployment)            | simulation (no institution)      |
|-------------------|-----------------------------------------|----------------------------------|
| tier              | ``tier``                                | from ``strong-fraction``         |
| data              | ``data-path``                           | the node's partition             |
| text column       | ``text-column`` (default ``text``)      | run config ``text-column``       |
| control columns   | ``control-columns`` (default ``topic``) | run config ``control-columns``   |
| table schema      | ``table-schema`` (a table: JSON or file) | run config ``table-schema``     |
| vocabulary        | ``control-codes`` (optional, pins it)   | the benchmark's vocabulary       |
| total epsilon     | ``epsilon`` (**required**)              | run config ``epsilon``           |
| largest delta     | ``delta`` (default 1e-5)                | the run's resolved ``delta``     |
| per-phase caps    | ``max-epsilon-train``/``-profile``/``-vote``/``-marginals`` (optional; across all runs in the window) | none |
| measurable columns | ``measurable-columns`` (a table; default: every column of its schema): the columns any release may read (``NodePolicy.reads``): a marginals request's cliques, a profile's code, and the text DP finetuning and votes read (under ``table-method = "rows"`` every column; with a free-text column that column and the code's) | every column |
| cap window        | ``cap-window-days`` (default 0: the ledger's whole life) | none               |
| generators        | ``model`` (default ``smollm2-135m,tiny-gpt2``) | run config ``model``      |
| embedders         | ``embedder`` (default ``all-MiniLM-L6-v2``) | run config ``embedder``       |
| finetune modes    | ``finetune`` (default ``lora,full``)    | run config ``finetune``          |
| ledger            | ``state-dir``, ``ledger-id``            | a temp dir per run               |
| unconfirmed holds | ``max-unconfirmed-holds`` (default 1)   | 1                                |
| reply retention   | ``keep-replies-days`` (default 30; 0 = forever) | 30 (the store is the run's)  |
| token cap         | ``max-length`` (default 512): the longest ``max-length`` a request may ask | the run's ``max-length`` |
| vote terms        | ``vote-window`` (default 128, or 2 x ``max-length`` when smaller) and ``vote-precision`` (default ``auto``): the one window and precision every vote is computed under, so one records' matrix per embedder is built and kept | the run's |
| work per request  | ``max-candidates`` (20,000 a vote), ``max-local-steps`` (200 DP-SGD steps a round), ``max-batch-size`` (1,024 expected rows a step), ``max-rounds`` (100 rounds of a phase a run: a training run's ``num-server-rounds``, a round's ``epsilon-share`` at least 1/100), ``max-marginal-cells`` (4,000,000 a marginals request): each request's work and reply stay below them | the same |
| trust (secure aggregation) | ``min-honest-nodes`` (default 1: nobody), ``peer-keys`` (a file of the peers' SuperNode public keys), ``identity-key`` (its own SuperNode private key) | run config ``min-honest-nodes``; every site counts |
| accounting        | ``accounting`` (default ``pld``: a privacy-loss distribution prices each release, ``common.calibration``; ``basic``: epsilons add up, the paper's) | run config ``accounting`` |
| public size bound | ``max-records`` (**required**): every release does the work of exactly this many records; a file with more is subsampled once (``fedsyn_client.view``) | none: the partition's size, no padding |

``policy-file`` names a TOML file with the same keys (node-config keys win), so an
institution can keep its policy under version control. Each key's parser, default, checks and
one-line doc are declared once, in ``node_table`` (``NODE_KEYS`` is its names), like
``common.config.RunConfig``'s. An unknown key, in the node config
or the file, a negative cap or a cap above the budget stops the node at start-up with one
line naming the key.

``NodePolicy.authorise(ask)`` is the one check: every handler of the ClientApp calls it
(``fedsyn_client.release.authorise``) before it touches data, for the tier query and every
release alike, so a new message type cannot skip it. A refusal is a ``PolicyRefused`` whose
``rule`` is a fixed text (the server's reply) and whose message is the detail (the node's log).
"""  # noqa: E501 - a markdown table: one row a line

from __future__ import annotations

import functools
import math
import tomllib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common.config import ACCOUNTING, DEFAULT_ACCOUNTING, PRECISIONS, RunConfig
from common.dp import TIERS, TRAIN
from common.phases import is_phase, phase as phase_named, phases as registered_phases
from common.plugins import FINETUNE_MODES
from common.records import ERR_POLICY
from fedsyn_client.refusals import (
    RULE_BATCH,
    RULE_CANDIDATES,
    RULE_CAP,
    RULE_CELLS,
    RULE_COLUMNS,
    RULE_DELTA,
    RULE_EMBEDDER,
    RULE_EPSILON,
    RULE_FINETUNE,
    RULE_MAX_LENGTH,
    RULE_MODEL,
    RULE_OPEN_ROUNDS,
    RULE_PHASE,
    RULE_ROUNDS,
    RULE_STEPS,
    RULE_VOCABULARY,
    RULE_VOTE_PRECISION,
    RULE_VOTE_WINDOW,
    Refusal,
)

DEFAULT_DELTA = 1e-5
# The offline models the project ships (common.models): what a node runs unless its institution
# names others. The server's run config only asks; a model the node does not list is refused.
DEFAULT_MODELS = ("smollm2-135m", "tiny-gpt2")
DEFAULT_EMBEDDERS = ("all-MiniLM-L6-v2", "sentence-transformers/all-MiniLM-L6-v2")
DEFAULT_FINETUNE = FINETUNE_MODES
# The longest max-length (tokens a record is cut to) a request may ask: memory and time of a
# training round grow with it, so the server may not move them at will (issue 45).
DEFAULT_MAX_LENGTH = 512
# The vote window (2 x max-length) a deployed node embeds its records at unless its operator pins
# another: a run's default max-length's, what node-check builds. Each window would be one more
# records' matrix (max-records rows, built in minutes to hours), so the server may not choose it (issue 75).
DEFAULT_VOTE_WINDOW = RunConfig().vote_window
DEFAULT_VOTE_PRECISION = RunConfig().precision
# The most candidates one vote request may carry: each is embedded and compared with every record
# slot, so a vote's time and memory grow with them. A 600-text run's pool is 2,400 (issue 74).
DEFAULT_MAX_CANDIDATES = 20_000
# DP-SGD's work is local-steps x batch-size rows a round, num-server-rounds rounds (the presets ask at
# most 50 steps of 256); a phase's rounds split its budget by epsilon-share, so without a floor on the
# share a server could ask any number of them, each a full pass over the bound's rows.
DEFAULT_MAX_LOCAL_STEPS = 200
DEFAULT_MAX_BATCH_SIZE = 1024
DEFAULT_MAX_ROUNDS = 100
# The most cells one marginals request may count: its work and reply grow with them (32 MB of floats)
DEFAULT_MAX_MARGINAL_CELLS = 4_000_000
# The most masked rounds (issue 73) whose keys a node keeps at once: a run has one open at a time
# (a phase's rounds follow one another); each is a file kept until its last step or for a day.
DEFAULT_MAX_OPEN_ROUNDS = 16
SIMULATION_KEYS = ("partition-id", "num-partitions")  # set by Flower's simulation engine

class PolicyError(ValueError):
    """The node's own configuration is unusable; the message says what to set."""


class PolicyRefused(Refusal):
    """A request the node's policy does not allow (nothing was read or released).

    ``rule`` is one of the fixed ``RULE_*`` texts (what the server is told); the message is the
    detail for the node's log.
    """

    code = ERR_POLICY
    prefix = "refused: policy: "


@dataclass(frozen=True)
class Ask:
    """What a request asks of a node, read from the run config and the message only.

    ``phases`` maps each phase the request would make this node release in (one for a release,
    the planned ones for the tier query) to this run's epsilon for it. ``delta`` is None when the
    request carries none (the tier query may omit it; a release may not: ``release`` checks).
    """

    text_column: str
    control_columns: tuple[str, ...]
    epsilon: float  # the run's per-node total
    vocabulary: tuple[str, ...]
    phases: tuple[tuple[str, float], ...]
    delta: Any = None
    model: str = ""
    embedder: str = ""
    finetune: str = ""
    table_schema: str = ""  # common.rows.canonical of the run's table schema; "" = a text column
    max_length: int = 0  # the tokens a record is cut to (training; the vote window is twice it)
    vote_window: int = DEFAULT_VOTE_WINDOW  # the run's vote window (2 x max-length): the tokens a vote embeds
    vote_precision: str = DEFAULT_VOTE_PRECISION  # the run's precision (a vote embeds at it)
    local_steps: int = 0  # DP-SGD steps a training round
    batch_size: int = 0  # DP-SGD's expected rows a step
    rounds: int = 0  # training rounds the run asks (num-server-rounds)
    measured: tuple[str, ...] = ()  # a marginals request: the columns it counts (other phases: NodePolicy.reads)


@dataclass(frozen=True)
class NodePolicy:
    """The institution's rules for its node (see the module docstring for the keys)."""

    tier: str
    epsilon: float  # total budget of this node's records, across all runs
    delta: float = DEFAULT_DELTA  # the largest delta this node accepts per release
    text_column: str = "text"
    control_columns: tuple[str, ...] = ("topic",)
    control_codes: tuple[str, ...] = ()  # () = accept the server's public vocabulary
    table_schema: str = ""  # common.rows.canonical of the node's table schema; "" = a text column
    data_path: str = ""  # "" in simulation (the partition comes from the run config)
    state_dir: str = ""
    ledger_id: str = ""
    phase_caps: tuple[tuple[str, float], ...] = ()  # (phase, max epsilon across runs in the window)
    cap_window_days: float = 0.0  # 0: the caps count the ledger's whole life
    max_unconfirmed_holds: int = 1  # pre-flight holds no release confirmed yet, at a time (fedsyn_client.holds)
    keep_replies_days: float = 30.0  # a run's stored replies (for resuming it) live this long; 0: forever
    models: tuple[str, ...] = DEFAULT_MODELS
    embedders: tuple[str, ...] = DEFAULT_EMBEDDERS
    finetune_modes: tuple[str, ...] = DEFAULT_FINETUNE
    max_length: int = DEFAULT_MAX_LENGTH  # the longest max-length a request may ask
    # the vote terms a request may ask (deployed: the pinned one; precision: those computing alike here)
    vote_windows: tuple[int, ...] = (DEFAULT_VOTE_WINDOW,)
    vote_precisions: tuple[str, ...] = (DEFAULT_VOTE_PRECISION,)
    max_candidates: int = DEFAULT_MAX_CANDIDATES  # the most candidates a vote request may carry
    max_local_steps: int = DEFAULT_MAX_LOCAL_STEPS
    max_batch_size: int = DEFAULT_MAX_BATCH_SIZE
    max_rounds: int = DEFAULT_MAX_ROUNDS  # rounds of one phase a run may ask (the share's floor is 1/it)
    max_marginal_cells: int = DEFAULT_MAX_MARGINAL_CELLS
    max_open_rounds: int = DEFAULT_MAX_OPEN_ROUNDS  # masked rounds whose keys the node keeps at once
    max_records: int = 0  # the public size bound (0 in simulation: the partition's size, public there)
    accounting: str = DEFAULT_ACCOUNTING  # how this node composes its releases (common.config.ACCOUNTING)
    measurable_columns: tuple[str, ...] = ()  # the columns any release may read; () = all of the schema's
    # secure aggregation (issue 73): the sites, this one included, it counts on to follow the protocol;
    # the SuperNode public keys of the peers it may count (OpenSSH lines; simulation: every site counts)
    # and its own SuperNode private key, which signs its round keys
    min_honest_nodes: int = 1
    peer_keys: tuple[str, ...] = ()
    identity_key: str = ""
    simulated: bool = False
    partition: tuple[int, ...] = ()  # simulation: (partition id, number of partitions)
    warnings: tuple[str, ...] = field(default=(), compare=False)

    def cap(self, phase: str) -> float | None:
        """The policy's epsilon cap for ``phase`` across runs (None: no cap)."""
        return dict(self.phase_caps).get(phase)

    # ----------------------------------------------------------------- the one check
    def authorise(self, ask: Ask) -> None:
        """Refuse (``PolicyRefused``) anything in ``ask`` this policy does not allow.

        The data view and the run's per-node epsilon; the vocabulary and delta; for each phase,
        that this tier takes part in it, its per-phase cap, and the models it would run (training:
        the generator and finetune mode; votes: the embedder). Nothing here reads a record.
        """
        if ask.table_schema != self.table_schema:  # a table's view is every column of its schema
            raise PolicyRefused(RULE_COLUMNS, (
                f"the run asks for table-schema {ask.table_schema[:200] or '(none: a text column)'}, but this "
                f"node's policy is {self.table_schema[:200] or '(none: a text column)'} (node-config table-schema)"))
        text_differs = not self.table_schema and ask.text_column != self.text_column
        if text_differs or tuple(ask.control_columns) != self.control_columns:
            raise PolicyRefused(RULE_COLUMNS, (
                f"the run asks for text-column={ask.text_column!r} control-columns={','.join(ask.control_columns)!r}, "
                f"but this node's policy is text-column={self.text_column!r} "
                f"control-columns={','.join(self.control_columns)!r}"))
        if ask.epsilon > self.epsilon:
            raise PolicyRefused(RULE_EPSILON, f"the run asks for epsilon = {ask.epsilon:g} per node, above this "
                                              f"node's budget epsilon = {self.epsilon:g}")
        self._check_vocabulary(ask.vocabulary)
        _within(RULE_MAX_LENGTH, "the run asks for max-length", ask.max_length, "max-length", self.max_length)
        if ask.delta is not None:
            self._check_delta(ask.delta)
        if any(name == TRAIN for name, _ in ask.phases):  # DP-SGD's work: steps x rows, rounds of it
            _within(RULE_STEPS, "the run asks for local-steps", ask.local_steps, "max-local-steps",
                    self.max_local_steps)
            _within(RULE_BATCH, "the run asks for batch-size", ask.batch_size, "max-batch-size", self.max_batch_size)
            _within(RULE_ROUNDS, "the run asks for num-server-rounds", ask.rounds, "max-rounds", self.max_rounds)
        for name, eps in ask.phases:
            self._check_phase(name, eps)
            kind = phase_named(name)
            self._check_columns(name, ask.measured if kind.reads == "measured" else self.reads(name))
            for key, allowed in kind.requires:  # the models the phase runs (common.phases)
                _allowed(_REQUIRED_RULES[key], key, getattr(ask, key), getattr(self, allowed))

    def check_share(self, share: float) -> None:
        """Refuse a round asking less than 1/``max-rounds`` of its phase's budget: the rounds of a phase
        split it, so the floor bounds how many rounds of work one run can ask of the node."""
        if share * self.max_rounds < 1 - 1e-9:
            raise PolicyRefused(RULE_ROUNDS, f"the request asks epsilon-share = {share:g} of its phase, below 1 / "
                                             f"max-rounds = 1/{self.max_rounds}: a run may ask at most "
                                             f"{self.max_rounds} rounds of a phase (node-config max-rounds)")

    def check_cells(self, cells: int) -> None:
        """Refuse a marginals request counting more than ``max-marginal-cells`` cells."""
        _within(RULE_CELLS, "the marginals request's cells", cells, "max-marginal-cells", self.max_marginal_cells)

    def check_open_rounds(self, count: int) -> None:
        """Refuse a masked round that would be the node's ``count``-th open one, above ``max-open-rounds``."""
        _within(RULE_OPEN_ROUNDS, "the masked rounds open on this node", count, "max-open-rounds",
                self.max_open_rounds)

    def check_candidates(self, count: int) -> None:
        """Refuse (``PolicyRefused``) a vote request carrying more than ``max-candidates`` candidates,
        before any is embedded."""
        _within(RULE_CANDIDATES, "the vote request's candidates", count, "max-candidates", self.max_candidates)

    def reads(self, name: str) -> tuple[str, ...]:
        """The table columns a release of ``phase`` reads of each record on this node, in the
        schema's order (``()`` on a text node, which has no column policy).

        A profile counts records by their code: the control columns. DP finetuning and votes read
        each record's text and code: with a free-text column that column and the code's (the
        node gives them the free text alone); without one (``table-method = "rows"``) every column,
        since a record's text writes all the others. A marginals release reads its cliques' columns,
        which only the request says (``Ask.measured``): ``()`` here. Public: the policy alone."""
        reads = phase_named(name).reads if is_phase(name) else "measured"
        if not self.table_schema or reads == "measured":
            return ()
        schema = _schema(self.table_schema)
        read = set(self.control_columns)
        if reads == "record":
            read |= {schema.text_column} if schema.text_column else set(schema.names)
        return tuple(n for n in schema.names if n in read)

    def unmeasurable(self, columns: Sequence[str]) -> list[str]:
        """Those of ``columns`` that ``measurable-columns`` leaves out (none when it is not set)."""
        return [c for c in columns if self.measurable_columns and c not in self.measurable_columns]

    def _check_columns(self, name: str, columns: Sequence[str]) -> None:
        """Refuse a release of ``phase`` that reads a column outside ``measurable-columns``: the
        column policy binds every release, not only marginals (issue 60)."""
        outside = self.unmeasurable(columns)
        if not outside:
            return
        reads = phase_named(name).reads
        why, fix = _COLUMN_NOTES[reads if reads != "record" else
                                 "free-text" if _schema(self.table_schema).text_column else "rows"]
        raise PolicyRefused(RULE_COLUMNS, (
            f"a {name} release reads columns {outside}, which this node's policy does not let be read "
            f"(node-config measurable-columns = {','.join(self.measurable_columns)!r}): {why}. Fix: {fix}"))

    def _check_vocabulary(self, codes: Sequence[str]) -> None:
        if not codes:
            raise PolicyRefused(RULE_VOCABULARY, "the request carries an empty control-code vocabulary")
        if self.control_codes and set(codes) != set(self.control_codes):
            raise PolicyRefused(RULE_VOCABULARY, (
                f"the request's control-code vocabulary ({len(set(codes))} codes) is not this node's pinned "
                f"vocabulary ({len(self.control_codes)} codes, node-config control-codes)"))

    def _check_delta(self, delta: Any) -> None:
        if isinstance(delta, bool) or not isinstance(delta, (int, float)) or not 0 < delta <= self.delta:
            raise PolicyRefused(RULE_DELTA, f"the request asks for delta = {delta!r}; this node accepts "
                                            f"0 < delta <= {self.delta:g} per release (node-config delta)")

    def _check_phase(self, phase: str, epsilon_this_run: float) -> None:
        if not is_phase(phase) or not epsilon_this_run > 0:
            raise PolicyRefused(RULE_PHASE, f"{phase} was asked of a {self.tier} node, which has no {phase} "
                                            "budget in this run")
        cap = self.cap(phase)
        if cap is not None and epsilon_this_run > cap + 1e-9:
            raise PolicyRefused(RULE_CAP, f"the run asks for epsilon = {epsilon_this_run:.4g} for {phase}, above "
                                          f"this node's cap max-epsilon-{phase} = {cap:g}")


def _within(rule: str, asked: str, value: int, key: str, most: int) -> None:
    """Refuse (``PolicyRefused``, ``rule``) a request whose ``asked`` is ``value``, above the policy's cap
    ``key`` = ``most``: every request's work is bounded by the node, not the server (issue 75)."""
    if value > most:
        raise PolicyRefused(rule, f"{asked} = {value}, above this node's cap {key} = {most} (node-config {key})")


# the fixed refusal text (what the server is told) for a model a phase requires and the policy does not allow
_REQUIRED_RULES = {"model": RULE_MODEL, "finetune": RULE_FINETUNE, "embedder": RULE_EMBEDDER,
                   "vote_window": RULE_VOTE_WINDOW, "vote_precision": RULE_VOTE_PRECISION}
# what a refused vote term can be changed to (the run's side, then the operator's)
_FIXES = {
    "vote_window": "the vote window is 2 x the run's max-length: ask max-length = {half}, or the node's operator "
                   "pins vote-window = {value} and runs `fedsyn node-check` to build its matrix",
    "vote_precision": "ask precision = {allowed}, or the node's operator pins vote-precision = {value} and runs "
                      "`fedsyn node-check` to build its matrix",
}

# (what the release reads, what the institution or the server can do) for a refused column, by what
# the phase reads (``Phase.reads``; a record's text by the table's kind)
_COLUMN_NOTES = {
    "measured": ("its marginals count them",
                "the server may ask marginals of the measurable columns only; or add these to measurable-columns if "
                "the institution lets them be counted"),
    "code": ("the profile counts the records by their code, read from the control columns",
              "add the control columns to measurable-columns if the institution lets them be counted; else this "
              "node can take part in a table-method 'marginals' run without a free-text column only"),
    "rows": ("under table-method 'rows' each record's text writes every column of the schema, and DP finetuning "
             "and votes read that text",
             "ask the server for table-method 'marginals' (the default with a table-schema), which counts only "
             "marginals of the measurable columns; or add every column to measurable-columns"),
    "free-text": ("DP finetuning and votes read the free-text column and the record's code (its control columns)",
                  "add the free-text column and the control columns to measurable-columns if the institution lets "
                  "the language model's phases read them; else this node cannot take part in a run with that "
                  "free-text column"),
}


@functools.lru_cache(maxsize=8)
def _schema(table_schema: str) -> Any:
    """The schema of a policy's canonical ``table-schema`` (parsed once)."""
    from common.rows import load_schema

    return load_schema(table_schema)


def _allowed(rule: str, key: str, value: Any, allowed: tuple[Any, ...]) -> None:
    if value not in allowed:
        name = key.replace("_", "-")
        fix = _FIXES.get(key, "").format(half=allowed[0] // 2 if isinstance(allowed[0], int) else "",
                                         value=value, allowed=allowed[0])
        raise PolicyRefused(rule, f"the run asks for {name} = {value!r}; this node's policy allows "
                                  f"{name} = {','.join(map(str, allowed))!r} (node-config {name})"
                                  + (f": {fix}" if fix else ""))


# --------------------------------------------------------------------------- building
def is_simulated(node_config: Mapping[str, Any]) -> bool:
    """True for a node started by Flower's simulation engine without its own data file."""
    return all(k in node_config for k in SIMULATION_KEYS) and not _get(node_config, "data-path")


# --------------------------------------------------------------------------- the node config, declared
Check = tuple[Callable[[Any], bool], Callable[[Any], str]]  # (passes?, the PolicyError message for the value)


@dataclass(frozen=True)
class NodeKey:
    """One ``--node-config`` key (also a ``policy-file`` key): what ``policy_from_node_config`` reads.

    ``name`` is spelt as users type it; ``parse(name, raw)`` reads a given value (raising
    ``PolicyError``); an absent key takes ``default``, unless ``required`` is set: then its absence
    raises ``PolicyError(required)``, which says how to set it. Each of ``checks`` then runs on the
    value, given or default; ``to`` converts the checked value. ``policy_field`` is the
    ``NodePolicy`` field the value fills, "" where the builder (caps, ``table-schema``) or another module
    (``audit-dir``, ``policy-file``) uses it.
    """

    name: str
    doc: str
    parse: Callable[[str, Any], Any]
    default: Any = None
    required: str = ""
    checks: tuple[Check, ...] = ()
    policy_field: str = ""
    to: Callable[[Any], Any] | None = None


def _float(key: str, raw: Any) -> float:
    try:
        if isinstance(raw, bool):
            raise ValueError
        value = float(raw)
    except (TypeError, ValueError):
        raise PolicyError(f"node-config {key} = {raw!r} is not a number") from None
    if math.isnan(value):
        raise PolicyError(f"node-config {key} = {raw!r} is not a number")
    return value


def _list(key: str, raw: Any) -> tuple[str, ...]:
    items = raw if isinstance(raw, (list, tuple)) else str(raw).split(",")  # TOML arrays or a,b,c
    return tuple(s.strip() for s in map(str, items) if s.strip())


def _text(key: str, raw: Any) -> str:
    return str(raw).strip()


def _verbatim(key: str, raw: Any) -> str:
    return str(raw)  # paths and ids are used as written, spaces included


def _table_schema(key: str, raw: Any) -> Any:
    """The ``Schema`` a ``table-schema`` value names (None when blank: a text node)."""
    if not str(raw).strip():
        return None
    from common.rows import SchemaError, load_schema

    try:
        return load_schema(str(raw))
    except SchemaError as err:
        raise PolicyError(f"node-config {key}: {err}") from None


def _bad_tier(tier: str) -> str:
    return f'node-config tier = {tier!r} is invalid; set tier="strong" or tier="weak"'


_DATA_PATH_MISSING = 'node-config data-path is missing; set data-path="/path/to/records.csv"'


def _days(key: str, why: str) -> Check:
    # a window of days: inf would never let anything expire, so it is refused with the negatives
    return (lambda v: 0 <= v < math.inf), (lambda v: f"node-config {key} = {v:g} must be >= 0 ({why})")


def _listed(key: str) -> Check:
    return bool, (lambda v: f"node-config {key} is empty; name the allowed values, comma-separated, or leave it "
                            "unset for the project's offline models")


def _finetune_modes(modes: tuple[str, ...]) -> str:
    bad = sorted(set(modes) - set(DEFAULT_FINETUNE))
    return (f"node-config finetune = {','.join(modes)!r}: {bad} is not a finetune mode; "
            f"allowed: {','.join(DEFAULT_FINETUNE)}")


def _cap_key(phase: str) -> str:
    return f"max-epsilon-{phase}"


@functools.lru_cache(maxsize=4)
def _table(phases: tuple[str, ...]) -> tuple[NodeKey, ...]:
    caps = tuple(NodeKey(_cap_key(phase), f"the most epsilon all runs together may spend on {phase} releases "
                                          "within cap-window-days, in [0, epsilon] (default: no cap)", _float)
                 for phase in phases)
    return (
        NodeKey("tier", '"strong" (DP finetuning, profile, votes) or "weak" (profile and votes only)',
                lambda key, raw: _text(key, raw).lower(), required=_bad_tier(""),
                checks=((lambda v: v in TIERS, _bad_tier),), policy_field="tier"),
        NodeKey("data-path", "the institution's records: a CSV, JSONL or Parquet file", _text,
                required=_DATA_PATH_MISSING, checks=((bool, lambda v: _DATA_PATH_MISSING),), policy_field="data_path"),
        NodeKey("text-column", "the text column a run must ask for (default text)", _text, "text",
                policy_field="text_column"),
        NodeKey("control-columns", "the control columns, in order, a run must ask for (default topic)", _list,
                ("topic",), policy_field="control_columns"),
        NodeKey("table-schema", "a table node's schema (a JSON file or inline JSON); a run must ask for the same",
                _table_schema),
        NodeKey("control-codes", "pins the control-code vocabulary a run must send (default: the server's)", _list,
                (), policy_field="control_codes"),
        NodeKey("epsilon", "the total epsilon budget of these records across all runs (required)", _float,
                required=("node-config epsilon is missing: this node does not let the server choose its privacy "
                          "budget. Set the institution's total budget, e.g. --node-config '... epsilon=8.0'"),
                checks=((lambda v: v > 0, lambda v: f"node-config epsilon = {v} must be > 0 (or inf to switch DP "
                                                    "off on purpose)"),), policy_field="epsilon"),
        NodeKey("delta", f"the largest delta a release may ask (default {DEFAULT_DELTA:g})", _float, DEFAULT_DELTA,
                checks=((lambda v: 0 < v < 1, lambda v: f"node-config delta = {v} must be in (0, 1); the default "
                                                        f"is {DEFAULT_DELTA:g}"),), policy_field="delta"),
        *caps,
        NodeKey("cap-window-days", "the caps count releases of the last this-many days (default 0: the ledger's "
                                   "whole life)", _float, 0.0,
                checks=(_days("cap-window-days", "0: the ledger's whole life"),), policy_field="cap_window_days"),
        NodeKey("model", f"the generators that may train on the records (default {','.join(DEFAULT_MODELS)})",
                _list, DEFAULT_MODELS, checks=(_listed("model"),), policy_field="models"),
        NodeKey("embedder", f"the embedders that may embed the records for votes (default "
                            f"{','.join(DEFAULT_EMBEDDERS)})", _list, DEFAULT_EMBEDDERS,
                checks=(_listed("embedder"),), policy_field="embedders"),
        NodeKey("finetune", f"the finetune modes a strong node accepts (default {','.join(DEFAULT_FINETUNE)})",
                _list, DEFAULT_FINETUNE,
                checks=(_listed("finetune"), (lambda v: set(v) <= set(DEFAULT_FINETUNE), _finetune_modes)),
                policy_field="finetune_modes"),
        NodeKey("state-dir", "where the node's privacy ledger lives (default ~/.fedsyn/state)", _verbatim, "",
                policy_field="state_dir"),
        NodeKey("ledger-id", "a name for the ledger, to keep two ledgers in one state-dir", _verbatim, "",
                policy_field="ledger_id"),
        NodeKey("max-unconfirmed-holds", "pre-flight holds no release has confirmed yet, at a time (default 1)",
                _float, 1.0,
                checks=((lambda v: math.isfinite(v) and v >= 0 and v == int(v),
                         lambda v: f"node-config max-unconfirmed-holds = {v:g} must be an integer >= 0 (default 1)"),),
                policy_field="max_unconfirmed_holds", to=int),
        NodeKey("keep-replies-days", "how long a run's stored replies are kept after its last release (default 30; "
                                     "0: forever)", _float, 30.0,
                checks=(_days("keep-replies-days", "default 30; 0: keep every run's replies forever"),),
                policy_field="keep_replies_days"),
        # read by fedsyn_client.audit from the node config itself; listed so that it is not unknown
        NodeKey("audit-dir", "every outgoing reply is also written to this folder (JSON lines)", _verbatim, ""),
        NodeKey("policy-file", "a TOML file with any of these keys (node-config keys win)", _verbatim, ""),
        NodeKey("max-length", f"the longest max-length (tokens per record) a run may ask (default "
                              f"{DEFAULT_MAX_LENGTH})", _float, DEFAULT_MAX_LENGTH,
                checks=((lambda v: 8 <= v <= 8192 and v == int(v),
                         lambda v: f"node-config max-length = {v:g} must be an integer in [8, 8192] (default "
                                   f"{DEFAULT_MAX_LENGTH}): the longest max-length a request may ask"),),
                policy_field="max_length", to=int),
        NodeKey("vote-window", f"the vote window (tokens of each text a vote embeds: 2 x a run's max-length) every "
                               f"vote is computed under; the records' matrix is built for it (default "
                               f"{DEFAULT_VOTE_WINDOW}, or 2 x max-length when that is smaller)", _float, 0.0,
                checks=((lambda v: v == 0 or (16 <= v <= 16384 and v == int(v) and v % 2 == 0),
                         lambda v: f"node-config vote-window = {v:g} must be an even integer in [16, 16384] (2 x a "
                                   f"run's max-length; default {DEFAULT_VOTE_WINDOW})"),), to=int),
        NodeKey("vote-precision", f"the precision every vote is embedded at: auto (bf16 where this node's hardware "
                                  f"computes it natively) or fp32 (default {DEFAULT_VOTE_PRECISION})", _text,
                DEFAULT_VOTE_PRECISION,
                checks=((lambda v: v in PRECISIONS,
                         lambda v: f"node-config vote-precision = {v!r} must be one of {', '.join(PRECISIONS)}"),)),
        _cap_key_of("max-candidates", "the most candidates one vote request may carry", DEFAULT_MAX_CANDIDATES,
                    most=10_000_000),
        *(_cap_key_of(name, doc, default) for name, doc, default in (
            ("max-local-steps", "the most DP-SGD steps a training round may ask (local-steps)",
             DEFAULT_MAX_LOCAL_STEPS),
            ("max-batch-size", "the largest DP-SGD batch (expected rows a step) a run may ask (batch-size)",
             DEFAULT_MAX_BATCH_SIZE),
            ("max-rounds", "the most rounds of one phase a run may ask: a training run's num-server-rounds, and a "
                           "round's epsilon-share at least 1/max-rounds", DEFAULT_MAX_ROUNDS),
            ("max-marginal-cells", "the most cells one marginals request may count", DEFAULT_MAX_MARGINAL_CELLS),
            ("max-open-rounds", "the most masked rounds whose keys the node keeps at once",
             DEFAULT_MAX_OPEN_ROUNDS))),
        NodeKey("max-records", "the public bound on the records: every release does the work of exactly this many "
                               "(required)", _float,
                required=("node-config max-records is missing: the public bound on this node's record count. Every "
                          "release does the work of exactly that many records, so its time and DP-SGD's sampling "
                          "rate say nothing about how many records the file holds (the server learns the bound, not "
                          "the count); a file with more is subsampled. Set it, e.g. --node-config '... "
                          "max-records=10000'"),
                checks=((lambda v: 1 <= v <= 10_000_000 and v == int(v),
                         lambda v: f"node-config max-records = {v:g} must be an integer in [1, 10000000]"),),
                policy_field="max_records", to=int),
        NodeKey("accounting", "how releases compose: pld (a privacy-loss distribution, the default) or basic "
                              "(epsilons add up)", _text, DEFAULT_ACCOUNTING,
                checks=((lambda v: v in ACCOUNTING,
                         lambda v: f"node-config accounting = {v!r} must be one of {', '.join(ACCOUNTING)} (basic: "
                                   "epsilons add up; pld: the same budget priced by a privacy-loss distribution, less "
                                   "noise)"),), policy_field="accounting"),
        NodeKey("measurable-columns", "a table node: the columns any release may read (default: every column of "
                                      "its table-schema)", _list, (), policy_field="measurable_columns"),
        NodeKey("min-honest-nodes", "the sites, this one included, it counts on under secure aggregation: it adds "
                                    "1/sqrt(t) of each release's noise and unmasks only with t of them present "
                                    "(default 1: nobody, the whole noise)", _float, 1.0,
                checks=((lambda v: 1 <= v <= 10_000 and v == int(v),
                         lambda v: f"node-config min-honest-nodes = {v:g} must be an integer >= 1 (default 1: "
                                   "trust nobody, add the whole noise)"),),
                policy_field="min_honest_nodes", to=int),
        NodeKey("peer-keys", "a file of the SuperNode public keys (one OpenSSH line each) of the peers it may count "
                             "on (with min-honest-nodes > 1)", _peer_keys, (), policy_field="peer_keys"),
        NodeKey("identity-key", "this node's SuperNode private key (a file), which signs its secure-aggregation keys "
                                "(with min-honest-nodes > 1)", _identity_key, "", policy_field="identity_key"),
    )


def _cap_key_of(name: str, doc: str, default: int, most: int = 10**9) -> NodeKey:
    """A work cap's node-config key: an integer in [1, ``most``], ``default`` when absent (issue 75)."""
    return NodeKey(name, f"{doc} (default {default})", _float, float(default),
                   checks=((lambda v: 1 <= v <= most and v == int(v),
                            lambda v: f"node-config {name} = {v:g} must be an integer in [1, {most}] (default "
                                      f"{default})"),),
                   policy_field=name.replace("-", "_"), to=int)


def _peer_keys(key: str, raw: Any) -> tuple[str, ...]:
    """The public-key lines of the file ``raw`` names (blank lines and ``#`` comments skipped), each
    checked to be a SuperNode key; ``PolicyError`` naming the file and line otherwise."""
    from common.secagg.masks import load_public_key

    path = Path(_text(key, raw)).expanduser()
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as err:
        raise PolicyError(f"node-config {key} = {str(path)!r} cannot be read ({err.strerror}): a file of the "
                          "peers' SuperNode public keys, one OpenSSH line each") from None
    keys = []
    for number, line in enumerate(lines, start=1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        try:
            load_public_key(line)
        except (ValueError, TypeError):
            raise PolicyError(f"node-config {key}: line {number} of {path} is not a SuperNode public key (an "
                              "'ecdsa-sha2-nistp384 ...' line, as deploy/generate_node_keys.sh writes NAME.pub)"
                              ) from None
        keys.append(line)
    return tuple(keys)


def _identity_key(key: str, raw: Any) -> str:
    """The path of this node's SuperNode private key, checked to load; ``PolicyError`` otherwise."""
    from common.secagg.masks import load_signing_key

    path = Path(_text(key, raw)).expanduser()
    try:
        load_signing_key(path.read_bytes())
    except OSError as err:
        raise PolicyError(f"node-config {key} = {str(path)!r} cannot be read ({err.strerror}): this node's "
                          "SuperNode private key (the file given to --auth-supernode-private-key)") from None
    except (ValueError, TypeError):
        raise PolicyError(f"node-config {key} = {str(path)!r} is not an elliptic-curve private key (ssh-keygen -t "
                          "ecdsa -b 384, as deploy/generate_node_keys.sh makes)") from None
    return str(path)


def node_table(phases: Sequence[str] | None = None) -> tuple[NodeKey, ...]:
    """Every node-config key, in the order they are read and listed; one ``max-epsilon-<phase>``
    per phase of ``phases`` (default: the registered phases, ``common.phases``, read at call time), so
    that a new phase gets its cap key without a line here."""
    return _table(tuple(_phase_names() if phases is None else phases))


def _phase_names() -> tuple[str, ...]:
    return tuple(p.name for p in registered_phases())


NODE_KEYS = tuple(key.name for key in node_table())


def policy_from_node_config(node_config: Mapping[str, Any]) -> NodePolicy:
    """The policy of a deployed node, from its ``--node-config`` (and ``policy-file``), by ``node_table``.

    Raises ``PolicyError`` naming the missing, unknown or invalid key and how to set it.
    """
    phases = _phase_names()
    table = node_table(phases)
    names = tuple(key.name for key in table)
    given = {_canonical(k): v for k, v in node_config.items() if _canonical(k) not in SIMULATION_KEYS}
    unknown = sorted(k for k in given if k not in names)
    if unknown:
        raise PolicyError(f"unknown node-config key(s) {unknown}: a misspelt key would be ignored; "
                          f"allowed: {', '.join(names)}")
    raw: dict[str, Any] = {}
    if given.get("policy-file"):
        raw.update(_read_policy_file(Path(str(given["policy-file"])).expanduser(), names))
    raw.update(given)
    values = {key.name: _value(key, raw) for key in table}
    return _policy(values, table, phases)


def _value(key: NodeKey, raw: Mapping[str, Any]) -> Any:
    if key.name in raw:
        value = key.parse(key.name, raw[key.name])
    elif key.required:
        raise PolicyError(key.required)
    else:
        value = key.default
    for ok, message in key.checks:
        if not ok(value):
            raise PolicyError(message(value))
    return key.to(value) if key.to else value


def _policy(values: Mapping[str, Any], table: Sequence[NodeKey], phases: Sequence[str]) -> NodePolicy:
    """The ``NodePolicy`` of values each valid alone, after the checks that span keys."""
    columns, text_column = values["control-columns"], values["text-column"]
    if not columns or not text_column or text_column in columns:
        raise PolicyError(f"node-config text-column = {text_column!r} / control-columns = {columns} are invalid: "
                          "one text column and one or more other control columns")
    caps = tuple((phase, values[_cap_key(phase)]) for phase in phases if values[_cap_key(phase)] is not None)
    for phase, cap in caps:
        if not 0 <= cap <= values["epsilon"]:
            raise PolicyError(f"node-config {_cap_key(phase)} = {cap:g} must be in [0, epsilon = "
                              f"{values['epsilon']:g}]: a cap is a part of the node's budget")
    schema, measurable = values["table-schema"], values["measurable-columns"]
    if schema is not None:
        from common.rows import canonical

        bad_columns = [c for c in columns if c not in schema.names or schema.column(c).type != "categorical"]
        if bad_columns:
            raise PolicyError(f"node-config control-columns {bad_columns} are not categorical columns of its "
                              "table-schema")
        # a free-text column may be named: it lets DP finetuning and votes read it (marginals never count it)
        outside = [c for c in measurable if c not in schema.names]
        if outside:
            raise PolicyError(f"node-config measurable-columns {outside} are not columns of its table-schema "
                              f"({', '.join(schema.names)})")
    elif measurable:
        raise PolicyError("node-config measurable-columns needs a table-schema: it names the table columns this "
                          "node's releases may read")
    honest = values["min-honest-nodes"]
    if honest > 1 and (not values["identity-key"] or len(values["peer-keys"]) < honest - 1):
        raise PolicyError(f"node-config min-honest-nodes = {honest} needs identity-key (this node's SuperNode private "
                          f"key) and peer-keys listing at least {honest - 1} peers' SuperNode public keys "
                          f"({len(values['peer-keys'])} listed): the node counts only sites whose keys its operator "
                          "lists, so a server cannot invent them")
    notes = () if values["control-codes"] else (
        "node-config control-codes is not set: this node accepts the server's public vocabulary and drops "
        "records whose code is not in it; set control-codes to pin the vocabulary",)
    window = values["vote-window"] or min(DEFAULT_VOTE_WINDOW, 2 * values["max-length"])
    if window > 2 * values["max-length"]:
        raise PolicyError(f"node-config vote-window = {window} is above 2 x max-length = {2 * values['max-length']}: "
                          "no run this node serves could ask it; raise max-length or lower vote-window")
    return NodePolicy(**{k.policy_field: values[k.name] for k in table if k.policy_field}, phase_caps=caps,
                      table_schema=canonical(schema) if schema is not None else "", warnings=notes,
                      vote_windows=(window,), vote_precisions=computing_alike(values["vote-precision"]))


def computing_alike(precision: str) -> tuple[str, ...]:
    """``precision`` and every other precision that embeds exactly as it does on this node's hardware
    (on a CPU without native bf16, auto is fp32): a vote at any of them reads the same matrix."""
    from common.devices import default_device, native_bf16

    bf16 = native_bf16(default_device())
    return tuple(p for p in PRECISIONS if (p == "auto" and bf16) == (precision == "auto" and bf16))


def simulation_policy(tier: str, epsilon: float, delta: float, text_column: str,
                      control_columns: Sequence[str], vocabulary: Sequence[str], state_dir: str,
                      partition: tuple[int, int], model: str, embedder: str, finetune: str,
                      table_schema: str = "", max_length: int = DEFAULT_MAX_LENGTH,
                      accounting: str = DEFAULT_ACCOUNTING, min_honest_nodes: int = 1,
                      vote_window: int = DEFAULT_VOTE_WINDOW, precision: str = DEFAULT_VOTE_PRECISION) -> NodePolicy:
    """The policy of a simulated node: built from the run config, since no institution exists
    (its models, table schema and vote terms are the run's own; a simulated node keeps no matrix)."""
    return NodePolicy(tier=tier, epsilon=epsilon, delta=delta, text_column=text_column,
                      control_columns=tuple(control_columns), control_codes=tuple(vocabulary),
                      table_schema=table_schema,
                      state_dir=state_dir, simulated=True, partition=tuple(partition),
                      models=(model,), embedders=(embedder,), finetune_modes=(finetune,),
                      max_length=max(DEFAULT_MAX_LENGTH, max_length), accounting=accounting,
                      min_honest_nodes=int(min_honest_nodes), vote_windows=(vote_window,),
                      vote_precisions=(precision,))


def _canonical(key: str) -> str:
    return str(key).replace("_", "-")


def _get(node_config: Mapping[str, Any], key: str) -> Any:
    return node_config.get(key, node_config.get(key.replace("-", "_")))


def _read_policy_file(path: Path, keys: Sequence[str] = NODE_KEYS) -> dict[str, Any]:
    """The keys of a ``policy-file`` (kebab-case); ``PolicyError`` if it is missing, not TOML, or has a key
    outside ``keys`` (or ``policy-file`` itself: a file naming another would be read by nobody)."""
    try:
        values = {_canonical(k): v for k, v in tomllib.loads(path.read_text(encoding="utf-8")).items()}
    except FileNotFoundError:
        raise PolicyError(f"node-config policy-file {path} does not exist") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as err:
        raise PolicyError(f"node-config policy-file {path} is not valid TOML: {err}") from None
    allowed = [k for k in keys if k != "policy-file"]
    unknown = sorted(k for k in values if k not in allowed)
    if unknown:
        raise PolicyError(f"unknown policy key(s) {unknown} in {path}; allowed: {', '.join(allowed)}")
    return values

