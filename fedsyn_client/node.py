"""A node's standing facts: its policy, its records and its ledger.

Deployment: ``flower-supernode --node-config 'tier="strong" data-path="/data/x.csv"
state-dir="/var/lib/fedsyn" epsilon=8'`` (see ``fedsyn_client.policy`` for every key).
Simulation: the policy is built from the run config (no institution exists), tier and
records follow from ``partition-id`` / ``num-partitions``; the ledger lives under
``simulation_state_root()`` per run and partition. After that the code path is the same.

The order is the point: ``node_policy`` reads the policy (no data), the request is
authorised against it (``fedsyn_client.release.authorise``), and only then does ``open_node``
read the records and the ledger.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

from common.config import RunConfig
from common.data import TextData, dataset_fingerprint, load_node_data
from common.io import folder_write_problem, prune_stamped
from common.logs import get_logger
from common.rows import Schema, canonical, load_schema, split_record
from fedsyn_client import refusals
from fedsyn_client.fixed_work import row_bytes
from fedsyn_client.ledger import PrivacyLedger
from fedsyn_client.policy import NodePolicy, PolicyError, is_simulated, policy_from_node_config, simulation_policy
from fedsyn_client.record_matrix import embed_slots, embedder_identity, gathered, matrix_path, read_matrix, write_matrix
from fedsyn_client.refusals import NodeSetupError
from fedsyn_client.replies import ReplyStore
from fedsyn_client.view import bounded, cut_view, read_snapshot, view_retention, view_seed, write_snapshot

log = get_logger(__name__)
# A record is kept to the bytes of the longer of the policy's max-length and the vote window of
# MiniLM-sized embedders (256 tokens): enough for any training row or vote the policy allows.
EMBEDDER_TOKENS = 256
STATE_ENV = "FEDSYN_STATE_DIR"


def simulation_state_root() -> Path:
    """Where simulated nodes keep their state: ``$FEDSYN_STATE_DIR``, else ``<tmp>/fedsyn-sim``.

    Each node's ledger and reply store are under ``run-<run key>/node-<partition id>``, keyed by
    the partition (the simulated institution), not by the process or machine that runs it. On a
    Ray cluster Flower may run a node's next message on another machine, so every Ray node must
    see one shared ``FEDSYN_STATE_DIR`` (set where ``ray start`` runs: actors inherit the raylet's
    environment); with each machine's own temp directory a node that moved would start a second
    ledger. The variable is the simulation operator's, like a deployed node's ``state-dir``: the
    run config cannot move it.
    """
    value = os.environ.get(STATE_ENV)
    return Path(value).expanduser() if value else Path(tempfile.gettempdir()) / "fedsyn-sim"


@dataclass
class Snapshot:
    """A deployed node's view on disk (``fedsyn_client.view``): its file, what it was read from
    (the data file's path, size and time, the policy's terms) and its records' fingerprint."""

    path: Path
    stamp: dict[str, Any]
    fingerprint: str


@dataclass
class Node:
    """Everything a handler needs about this node."""

    policy: NodePolicy
    data: TextData  # every record of the node, read with the policy's columns
    ledger: PrivacyLedger
    replies: ReplyStore  # the noised replies it released, for repeated requests
    snapshot: Snapshot | None = None  # a deployed node's view on disk (None in simulation)
    _views: dict[tuple[tuple[str, ...], bool], TextData] = field(default_factory=dict, repr=False)
    _positions: dict[tuple[str, ...], np.ndarray] = field(default_factory=dict, repr=False)
    _matrices: dict[tuple[bool, str, int, bool], np.ndarray] = field(default_factory=dict, repr=False)

    @property
    def tier(self) -> str:
        """``strong`` or ``weak`` (the institution's choice)."""
        return self.policy.tier

    @property
    def bound(self) -> int | None:
        """The public size bound every release works to (the policy's ``max-records``); None in
        simulation, where no institution exists and the partition is the server's choice: a
        simulated node works as fast as it goes."""
        return self.policy.max_records or None

    def records(self, vocabulary: tuple[str, ...], free_text: bool = False) -> TextData:
        """The records whose code is in ``vocabulary``; the others are dropped the same way in
        every phase, and only this node's log says how many (a count is a statistic). With
        ``free_text`` (a table whose schema has a free-text column), each record's text is that
        column's value alone (``common.rows.split_record``): what the language model's phases read."""
        key = (vocabulary, free_text)
        if key not in self._views:
            keep = self._kept(vocabulary)
            # numpy's take, not a loop over the kept records: the time of a view is the bound's
            texts = list(np.asarray(self._texts(free_text), dtype=object)[keep])
            self._views[key] = TextData(texts, list(np.asarray(self.data.codes, dtype=object)[keep]))
        return self._views[key]

    def embedded(self, vocabulary: tuple[str, ...], free_text: bool, embedder: str, window: int,
                 precision: str) -> Callable[[], np.ndarray] | None:
        """A deployed node: the embeddings of ``records(vocabulary, free_text)`` (each text cut to
        ``window`` tokens, at the run's ``precision``) followed by zero rows, ``bound`` rows in all,
        read from the node's matrix (``fedsyn_client.record_matrix``: built once per snapshot),
        computed when called. None in simulation, where a vote embeds its records itself (once per
        process)."""
        if self.snapshot is None or not self.bound:
            return None
        return lambda: gathered(self.matrix(free_text, embedder, window, precision), self._kept(vocabulary))

    def matrix(self, free_text: bool, embedder: str, window: int, precision: str) -> np.ndarray:
        """The view's embedding matrix for (embedder, window, free_text, precision): ``bound`` rows,
        from the state folder when one was written for this snapshot and embedder, else built and
        written. ``precision`` is the run config's; the matrix is bf16's or fp32's as it resolves
        on this node's hardware (``common.devices.uses_bf16``)."""
        from common.devices import uses_bf16
        from common.models import EMBEDDER_ALIASES, load_embedder

        embedder = EMBEDDER_ALIASES.get(embedder, embedder)  # one matrix per model, whichever alias named it
        model = load_embedder(embedder)
        window = min(int(window), int(model.max_seq_length))  # type: ignore[arg-type]  # a node's embedders have a token limit
        inner: Any = getattr(model, "inner", model)
        bf16 = uses_bf16(inner, precision)
        key = (free_text, embedder, window, bf16)
        if key in self._matrices:
            return self._matrices[key]
        assert self.snapshot is not None and self.bound
        stamp = {"snapshot": self.snapshot.stamp, "fingerprint": self.snapshot.fingerprint, "rows": self.bound,
                 "embedder": embedder_identity(embedder, model), "window": window, "free-text": free_text,
                 "bf16": bf16}
        path = matrix_path(self.snapshot.path.parent, self.snapshot.path, embedder, window, free_text, bf16)
        found = read_matrix(path, stamp)
        if found is None or len(found) != self.bound:
            # the node's own log only: this one request does the build (node-check does it beforehand)
            log.warning("embedding the node's view for %s at a window of %d tokens into %s (none yet, or the data "
                        "or the embedder changed); `fedsyn node-check` builds it before any request", embedder,
                        window, path)
            found = embed_slots(self._texts(free_text), model, window, self.bound,
                                precision="auto" if bf16 else "fp32")
            try:
                write_matrix(path, found, stamp)
            except OSError as err:  # the vote goes on with the matrix in memory; the next one builds again
                log.warning("could not keep the node's embedding matrix %s (%s): the next vote builds it again",
                            path, err)
            else:  # one matrix per (view, embedder, text kind): another window or precision is superseded
                gone = prune_stamped(path.parent, "emb-*.bin", path, lambda old: _same_matrix(stamp, old))
                if gone:
                    log.info("removed the superseded matrix file(s) %s", ", ".join(p.name for p in gone))
        self._matrices[key] = found
        return found

    def _texts(self, free_text: bool) -> list[str]:
        """Every record's text, or with ``free_text`` its free-text column's value alone."""
        if not free_text:
            return self.data.texts
        # one split per slot of the bound, records or padding (the work is the bound's); not
        # numpy's fixed-width strings, whose memory the longest record would set
        slots = self.data.texts + [""] * max(0, (self.bound or 0) - len(self.data))
        return [split_record(t)[1] for t in slots][:len(self.data)]

    def _kept(self, vocabulary: tuple[str, ...]) -> np.ndarray:
        """The positions of the records whose code is in ``vocabulary``, in file order."""
        return np.flatnonzero(self._in(vocabulary) < len(vocabulary))

    def code_counts(self, vocabulary: tuple[str, ...]) -> np.ndarray:
        """Records per code of ``vocabulary`` (int64), those of ``records(vocabulary)``."""
        return np.bincount(self._in(vocabulary), minlength=len(vocabulary) + 1)[:len(vocabulary)]

    def _in(self, vocabulary: tuple[str, ...]) -> np.ndarray:
        """Each record's position in ``vocabulary`` (``len(vocabulary)``: none), once per vocabulary."""
        if vocabulary not in self._positions:
            # one lookup per slot of the bound, records or padding: the work is the bound's, not |D|'s
            position = {code: j for j, code in enumerate(vocabulary)}
            none = len(vocabulary)
            slots = self.data.codes + [""] * max(0, (self.bound or 0) - len(self.data))
            where = np.fromiter((position.get(c, none) for c in slots), dtype=np.int64, count=len(slots))
            where = where[:len(self.data)]
            outside = int((where == none).sum())
            if outside:  # the node's own log only: a count is a statistic
                log.warning("%d of %d records have a code outside the run's vocabulary and are left out of "
                            "every release", outside, len(self.data))
            self._positions[vocabulary] = where
        return self._positions[vocabulary]


def node_policy(run_id: str, node_config: dict[str, Any], cfg: RunConfig) -> NodePolicy:
    """This node's policy (nothing is read from the records). Raises ``NodeSetupError`` when
    the node's own configuration is unusable."""
    try:
        return _policy(run_id, tuple(sorted((str(k), str(v)) for k, v in node_config.items())), cfg)
    except (PolicyError, ValueError) as err:
        raise NodeSetupError(str(err)) from None


def open_node(policy: NodePolicy, cfg: RunConfig) -> Node:
    """This node's records and ledger under ``policy`` (call once the request is authorised).
    Raises ``NodeSetupError`` when the data or the ledger is unusable."""
    return _open(policy, cfg if policy.simulated else None)


def check_node(node_config: dict[str, Any]) -> str:
    """The start-up check of a deployed node (``fedsyn node-check``): its node config, data file
    and ledger, loaded exactly as its first request will load them. Returns the ready line
    (tier, record count, budget, ledger path: for the operator's own terminal only); raises
    ``NodeSetupError`` naming the file and the reason. Spends nothing, sends nothing."""
    if is_simulated(node_config):
        raise NodeSetupError("node-check is for deployed nodes; this node config has partition-id (simulation)")
    policy, data = deployed_records(node_config)
    if len(data) == 0:  # before the ledger: nothing is opened for a node that cannot start
        raise NodeSetupError(f"data-path {policy.data_path!r} has no records (after the policy's columns and "
                             "schema): the node would release noise only; check the file and the node config")
    if policy.control_codes and not set(data.codes) & set(policy.control_codes):
        seen = ", ".join(sorted(set(data.codes))[:3])
        raise NodeSetupError(f"control-codes pins {', '.join(policy.control_codes[:3])}... but none of the "
                             f"{len(data)} records has one of them (theirs look like: {seen}); check control-codes "
                             "and control-columns")
    _check_requirements(policy, node_config)
    state = state_folder(policy)  # the audit-dir was checked with the requirements
    why = folder_write_problem(state)
    if why:
        raise NodeSetupError(f"state-dir {state} cannot be written ({why}): the ClientApps keep the node's ledger, "
                             f"view and snapshot there; create it for the user they run as (install -d -o USER -m 700 "
                             f"{state}; deploy/start_node.sh --run-as does it for a new folder) or fix its owner")
    node = _open(policy, None)
    spent = _composed_within_budget(policy, node.ledger)
    kept = len(node.data)
    bound = (f"max-records={policy.max_records}: every release does the work of {policy.max_records} records; the "
             f"file holds {len(data)}, of which each release uses the same {kept} (one of each odd slot of "
             f"{policy.max_records}: {100 * kept / len(data):.0f}% kept, expected "
             f"{100 * view_retention(len(data), policy.max_records):.0f}%"
             + ("; raise max-records to keep more, at more work per release" if kept < 0.9 * len(data) else "") + ")")
    return (f"node ready: tier={policy.tier} records={kept} budget epsilon={policy.epsilon:g} "
            f"ledger={node.ledger.path} (spent {spent}); {bound}{_measurable(policy)}"
            f"; {_matrices(node)}")


def _composed_within_budget(policy: NodePolicy, ledger: PrivacyLedger) -> str:
    """What the ready line says the node has spent: its rule's figure (under pld the ledger composed at
    the policy's delta, what admission holds to the budget). Raises ``NodeSetupError`` explaining a
    ledger that composes above the budget (releases made under another rule or delta): the node would
    refuse every request as over budget without saying why to the server's side (issue 75)."""
    from common.accounting import rule

    basic = ledger.spent()
    if not rule(policy.accounting).composes_ledger:
        return f"{basic:.4g}"
    composed = ledger.composed(policy.delta)
    if composed > policy.epsilon * (1 + 1e-9) + 1e-9:
        state = ledger.path.parent
        raise NodeSetupError(
            f"the ledger {ledger.path} composes to epsilon = {composed:.4g} at the policy's delta = {policy.delta:g} "
            f"({policy.accounting}), above its budget {policy.epsilon:g} (its releases were made under another rule "
            f"or delta; their stated epsilons add up to {basic:.4g}): every request would be refused as over budget. "
            f"Raise the budget on purpose (fedsyn ledger {state} --set-budget EPS --reason '...'), or start over "
            f"(fedsyn ledger {state} --reset --reason '...' --budget {policy.epsilon:g})")
    return f"{composed:.4g} at the policy's delta by {policy.accounting}; {basic:.4g} by the stated epsilons"


def _matrices(node: Node) -> str:
    """Build (or find) the view's embedding matrix of every embedder the policy allows, at the vote
    window of a run with the default max-length (or the policy's, when smaller): what the first vote
    would otherwise build (issue 61). Returns what was done, for the ready line."""
    policy = node.policy
    window, precision = policy.vote_windows[0], policy.vote_precisions[0]  # the pinned terms (deployed: one each)
    free_text = bool(policy.table_schema) and load_schema(policy.table_schema).text_column is not None
    done = []
    from common.models import EMBEDDER_ALIASES

    for embedder in dict.fromkeys(EMBEDDER_ALIASES.get(e, e) for e in policy.embedders):
        matrix = node.matrix(free_text, embedder, window, precision)
        done.append(f"{embedder} ({matrix.shape[0]} x {matrix.shape[1]})")
    return (f"records embedded at a window of {window} tokens ({precision}) for {', '.join(done)}: a vote reads "
            f"them from the state folder; a run asking another vote window (2 x max-length) or precision is refused "
            f"(node-config vote-window, vote-precision)")


def _measurable(policy: NodePolicy) -> str:
    """For a table node: which columns a marginals run may count (issue 48), which other releases
    its ``measurable-columns`` allows (issue 60: the list binds every release), and which columns
    no marginals run can use (a number or date column without a declared range has no bins)."""
    from common.dp import PROFILE, TRAIN
    from common.marginals import has_domain

    if not policy.table_schema:
        return ""
    schema = load_schema(policy.table_schema)
    counted = schema.structured()
    named = [c for c in policy.measurable_columns or counted.names if c in counted.names]
    unranged = [c.name for c in counted.columns if not has_domain(c, 2)]
    free = schema.text_column

    def verdict(phase: str) -> str:
        outside = policy.unmeasurable(policy.reads(phase))
        return "allowed" if not outside else f"refused ({', '.join(outside)} outside measurable-columns)"

    text_phases = (f"DP finetuning and votes of a run with its free-text column {free!r} (they read it and the code's "
                   f"columns): {verdict(TRAIN)}" if free else
                   f"a table-method 'rows' run's profile (the code's columns): {verdict(PROFILE)}, its DP finetuning "
                   f"and votes (each record's text writes every column): {verdict(TRAIN)}")
    return (f"; a marginals run may count {', '.join(named)}"
            + (" (every column of its schema; node-config measurable-columns narrows it)"
               if not policy.measurable_columns else " (node-config measurable-columns)")
            + f"; {text_phases}"
            + (f"; {', '.join(unranged)} declare no min and max, so no marginals run can use this schema"
               if unranged else "")
            + (f"; free-text column {free!r} is never counted: only the language model's phases (DP finetuning, "
               "noisy votes) read it" if free else ""))


def state_folder(policy: NodePolicy) -> Path:
    """The node's state folder (ledger, view, snapshot, record matrices): ``state-dir``, else
    ``~/.fedsyn/state`` of the user the ClientApps run as."""
    return Path(policy.state_dir).expanduser() if policy.state_dir else Path.home() / ".fedsyn" / "state"


def node_folders(node_config: dict[str, Any]) -> dict[str, Path]:
    """The folders a deployed node's ClientApps write, by node-config key: ``state-dir`` always,
    ``audit-dir`` when auditing is on. ``NodeSetupError`` when the node config is unusable."""
    from fedsyn_client.audit import audit_folder

    try:
        policy = policy_from_node_config(dict(node_config))
    except (PolicyError, ValueError) as err:
        raise NodeSetupError(str(err)) from None
    audit = audit_folder(node_config)
    return {"state-dir": state_folder(policy), **({"audit-dir": audit} if audit is not None else {})}


def deployed_records(node_config: dict[str, Any]) -> tuple[NodePolicy, TextData]:
    """A deployed node's policy and the records of its whole file under it (the policy's columns and
    schema, before the view), as node-check and ``fedsyn audit`` read them first; ``NodeSetupError``
    naming the problem when the node config or the file is unusable."""
    try:
        policy = _deployed_policy(dict(node_config))
    except (PolicyError, ValueError) as err:
        raise NodeSetupError(str(err)) from None
    return policy, _data(policy, None)


def _check_requirements(policy: NodePolicy, node_config: dict[str, Any]) -> None:
    """Load every embedder the policy allows (every node may vote), every generator it allows on a
    strong node, and write to its audit folder: what a request would need is there before a
    request can be charged for it. Raises ``NodeSetupError`` naming the one that failed."""
    from common.dp import STRONG
    from common.models import load_embedder, load_generator
    from fedsyn_client.audit import audit_folder, check_audit_dir

    check_audit_dir(audit_folder(node_config))
    wanted: list[tuple[str, str, Callable[..., Any]]] = [("embedder", name, load_embedder) for name in policy.embedders]
    wanted += [("model", name, load_generator) for name in policy.models] if policy.tier == STRONG else []
    for key, name, load in wanted:
        try:
            load(name)
        except Exception as err:  # noqa: BLE001 - any failure to load is the operator's to fix
            raise NodeSetupError(f"node-config {key} allows {name!r}, which cannot be loaded here "
                                 f"({type(err).__name__}: {str(err)[:200]}); "
                                 f"install it or take it out of {key}") from None


def _deployed_policy(node_config: dict[str, Any]) -> NodePolicy:
    """A deployed node's policy from its node config, its warnings logged on the node."""
    policy = policy_from_node_config(node_config)
    for note in policy.warnings:
        log.warning("%s", note)
    return policy


@lru_cache(maxsize=16)
def _policy(run_id: str, node_config_items: tuple[tuple[str, str], ...], cfg: RunConfig) -> NodePolicy:
    node_config = dict(node_config_items)
    if not is_simulated(node_config):
        return _deployed_policy(node_config)
    from common.federation import benchmark, simulation_tiers

    num, pid = int(node_config["num-partitions"]), int(node_config["partition-id"])
    bench = benchmark(cfg)
    state = node_config.get("state-dir") or str(simulation_state_root() / f"run-{run_id}" / f"node-{pid}")
    return simulation_policy(
        tier=simulation_tiers(num, cfg.strong_fraction)[pid], epsilon=cfg.epsilon,
        delta=cfg.resolve_delta(len(bench.train)), text_column=cfg.text_column,
        control_columns=cfg.control_columns, vocabulary=bench.vocabulary, state_dir=state, partition=(pid, num),
        model=cfg.model, embedder=cfg.embedder, finetune=cfg.finetune, table_schema=canonical(cfg.schema()),
        max_length=cfg.max_length, accounting=cfg.accounting, min_honest_nodes=cfg.min_honest_nodes,
        vote_window=cfg.vote_window, precision=cfg.precision,
    )


@lru_cache(maxsize=16)
def _open(policy: NodePolicy, sim_cfg: RunConfig | None) -> Node:
    state_dir = str(state_folder(policy))
    snapshot = None
    if policy.max_records:
        data, snapshot = _view(policy, state_dir)
        fingerprint = snapshot.fingerprint
    else:  # a simulated node: its partition, public in simulation
        data = _data(policy, sim_cfg)
        fingerprint = dataset_fingerprint(data)
    # An empty data set is served like any other (every release is defined on it): refusing it
    # would answer "does this node hold any record" for free. node-check tells the operator.
    if len(data) == 0:
        log.warning("data-path %r has no records: every release of this node is noise only", policy.data_path)
    elif policy.delta >= 1.0 / len(data):  # the node's own log only: the count never leaves
        log.warning("delta = %g >= 1/%d records on this node: the guarantee is weak; set a smaller node-config delta",
                    policy.delta, len(data))
    ledger = PrivacyLedger.open(state_dir, policy.epsilon, policy.ledger_id, fingerprint, delta=policy.delta)
    log.info("node ready: tier=%s records=%d budget=%s ledger=%s", policy.tier, len(data), policy.epsilon, ledger.path)
    replies = ReplyStore(ledger.path.with_name(f"{ledger.path.stem}-replies"), policy.keep_replies_days)
    return Node(policy, data, ledger, replies, snapshot)


def _view(policy: NodePolicy, state_dir: str) -> tuple[TextData, Snapshot]:
    """(the records under the policy's max-records, their snapshot) from the node's snapshot file
    (``fedsyn_client.view``), built from the data file when it is missing or the file changed."""
    text_bytes = row_bytes(max(policy.max_length, EMBEDDER_TOKENS))
    try:
        stat = os.stat(policy.data_path)
    except OSError:
        _data(policy, None)  # raises the data error the server sees as DATA
        raise
    seed = view_seed(state_dir)
    terms = {"data-path": str(Path(policy.data_path).resolve()), "text-column": policy.text_column,
             "control-columns": list(policy.control_columns), "table-schema": policy.table_schema,
             "measurable-columns": list(policy.measurable_columns),
             "max-records": policy.max_records, "text-bytes": text_bytes,
             "seed": hashlib.sha256(str(seed).encode()).hexdigest()[:16]}
    path = Path(state_dir) / f"view-{hashlib.sha256(json.dumps(terms, sort_keys=True).encode()).hexdigest()[:16]}.bin"
    stamp = {**terms, "size": stat.st_size, "mtime-ns": stat.st_mtime_ns}
    found = read_snapshot(path, stamp)
    if found is not None:
        _prune_views(state_dir, path, stamp)
        return found[0], Snapshot(path, stamp, found[1])
    # the node's own log only: this one request's time depends on the file (node-check builds it first)
    log.warning("reading data-path %r into the node's view %s (no view yet, or the file changed): this request's "
                "time depends on the file; run `fedsyn node-check` after changing the data", policy.data_path, path)
    whole = _data(policy, None)
    data = bounded(whole, policy.max_records, seed)
    # the node's own log only: the counts never leave
    log.info("data-path %r: %d records, %d of them (one of each odd slot of max-records = %d) serve every release "
             "(fedsyn_client.view.bounded)", policy.data_path, len(whole), len(data), policy.max_records)
    write_snapshot(path, cut_view(data, text_bytes), policy.max_records, text_bytes, stamp)
    found = read_snapshot(path, stamp)
    if found is None:
        raise NodeSetupError(f"the node's view {path} cannot be read back after writing it; check the state-dir's "
                             "disk and permissions", refusals.DATA)
    _prune_views(state_dir, path, stamp)
    return found[0], Snapshot(path, stamp, found[1])


def _same_matrix(stamp: dict[str, Any], other: dict[str, Any]) -> bool:
    """Whether a matrix's ``other`` stamp is of the same view, embedder and text kind as ``stamp``'s (at
    another window or precision: superseded by it)."""
    embedder = other.get("embedder")
    return (other.get("snapshot") == stamp["snapshot"] and other.get("free-text") == stamp["free-text"]
            and isinstance(embedder, dict) and embedder.get("name") == stamp["embedder"]["name"])


def _same_node(stamp: dict[str, Any], other: Any) -> bool:
    """Whether a view's ``other`` stamp is of this node's data file under other terms: a view a node
    config change (max-records, columns, max-length) or an upgrade left behind. The ledgers of one state
    folder share the views of a file (their terms are the same); views of other data files are another
    node's, never touched."""
    return isinstance(other, dict) and other.get("data-path") == stamp["data-path"]


def _prune_views(state_dir: str, current: Path, stamp: dict[str, Any]) -> None:
    """Remove this node's superseded views and every matrix embedded from one (issue 75: state of
    other terms is not kept). Only the node's own log says so: which files a folder holds is the
    operator's to see, and the work is the folder's, never the records'."""
    removed = prune_stamped(state_dir, "view-*.bin", current, lambda old: _same_node(stamp, old))
    removed += prune_stamped(state_dir, "emb-*.bin", current,
                             lambda old: old.get("snapshot") != stamp and _same_node(stamp, old.get("snapshot")))
    if removed:
        log.info("removed %d superseded view and matrix file(s) of this node from %s: %s", len(removed), state_dir,
                 ", ".join(p.name for p in removed))


def readable_schema(schema: Schema, policy: NodePolicy) -> Schema:
    """The columns of a table node's ``schema`` its records are read with: ``measurable-columns`` and the
    code's columns (a record needs its code), or every column when the policy lists none. A value outside
    the schema leaves its row out, so a row read with a column the policy does not let be read would be
    in or out of every release by that column's value (issue 60); a release reading it is refused anyway
    (``NodePolicy.reads``)."""
    if not policy.measurable_columns:
        return schema
    return schema.only((*policy.measurable_columns, *policy.control_columns))


def _data(policy: NodePolicy, sim_cfg: RunConfig | None) -> TextData:
    """The node's records under ``policy`` (a simulated node: its partition of the run's data)."""
    if sim_cfg is not None:
        from common.federation import simulation_node_data

        return simulation_node_data(sim_cfg, *policy.partition)[1]
    try:
        schema = readable_schema(load_schema(policy.table_schema), policy) if policy.table_schema else None
        return load_node_data(policy.data_path, policy.text_column, list(policy.control_columns), schema)
    except (OSError, ValueError, KeyError) as err:
        # The detail (file, line, field counts) is for the node's log; the server gets DATA.
        raise NodeSetupError(f"data unavailable: data-path {policy.data_path!r} cannot be used: "
                             f"{type(err).__name__}: {str(err)[:300]}", refusals.DATA) from None
