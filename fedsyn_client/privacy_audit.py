"""``fedsyn audit``: what each release of this node really loses, measured on the node (issue 63).

An operator runs it against their own node config before joining, or after an update of the app:
nothing leaves the machine, and the live ledger and state are never opened (a scratch folder holds
the node's view secret, copied, and everything the audit writes). For each Gaussian release the node
would serve in the run described (profile, a vote of every registered histogram, marginals), it:

1. writes neighbouring datasets D and D' from the node's own file, in the file's own format, row
   values as written: one record removed (the first, the last) or added (a copy of one, a record far
   longer than the others, a table's record at the edges of its columns' ranges), on files below,
   at and above the audit's ``max-records`` (``neighbours``): the worst cases of the view, whose
   rule must change one record per record added at any size;
2. runs the node's real release path (the ClientApp, its policy, ledger and view) with the noise off
   (node and run epsilon inf: sigma 0) on every pair, and keeps the pair whose releases lie furthest
   apart: that distance is a sensitivity the release really has, compared with the one it states;
3. runs the real path with its noise ``draws`` times on each side of that pair, each draw a first
   release on a fresh ledger (so every draw is priced and noised alike), and bounds from below the
   epsilon the pair loses at the release's delta, two ways (``common.auditing``): by the Gaussian
   claim (the residuals bound sigma from above, the distance is exact) and by the threshold test that
   assumes nothing; the residuals' shape is tested too (normal, centred, one scale on D and D'), the
   error rate split between the five so that a correct release fails with probability <= 1 - confidence;
4. fails a release whose lower bound exceeds its stated epsilon, whose measured sensitivity exceeds
   its stated one, or whose noise is not the stated Gaussian.

DP-SGD is not audited here (a lower bound needs thousands of trainings); ``--canaries`` is its audit
(the one-run membership test on a whole simulated run).

The audit's ``max-records`` (default the smaller of the node's and 100) sets the files' sizes: the
release code is the same function of any bound, and a vote's noise-off pass embeds every file's
``max-records`` rows, so the node's own bound of 10,000 would take hours on two cores.
"""

from __future__ import annotations

import csv
import gzip
import itertools
import json
import math
import secrets
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from common import records as R
from common.auditing import (
    ShapeCheck,
    epsilon_lower_bound,
    gaussian_epsilon,
    projection,
    shape_check,
    sigma_upper,
    skellam_claim_epsilon,
)
from common.config import RunConfig
from common.dp import GAUSSIAN, MARGINALS, PROFILE, VOTE
from common.histograms import HISTOGRAMS
from common.logs import get_logger
from common.phases import phase as phase_named, phases

log = get_logger(__name__)

DEFAULT_DRAWS = 200  # noised releases per side of the worst pair (fewer where the vector is long)
DEFAULT_BOUND = 100  # the audit's max-records, at most the node's
DEFAULT_CONFIDENCE = 0.999  # per release kind: a correct release fails the audit with probability <= 0.1%
MIN_COORDINATES = 4000  # residual coordinates a kind's draws aim for: sigma's upper bound within ~4%
MIN_DRAWS = 40  # the threshold test needs a few draws per half whatever the vector's length
MAX_CANDIDATES = 24  # a vote's candidates: the node's own texts (they never leave the machine)


# ------------------------------------------------------------------------------------ the files
@dataclass
class RowFile:
    """A data file's records as written (each a dict of column to value, as the format stores it) and
    a writer of any list of them in the same format: a neighbour differs from D in one record only,
    every other value byte for byte the file's (a CSV field stays its text, a Parquet column its type)."""

    rows: list[dict[str, Any]]
    suffix: str  # ".csv", ".jsonl.gz", ".parquet", ...
    columns: list[str] = field(default_factory=list)
    arrow_schema: Any = None

    def write(self, rows: Sequence[dict[str, Any]], path: Path) -> Path:
        """``rows`` written to ``path`` + this file's suffix; the path written."""
        out = path.with_name(path.name + self.suffix)
        opener = _opener(self.suffix)
        if ".parquet" in self.suffix:
            import pyarrow as pa
            import pyarrow.parquet as pq

            pq.write_table(pa.Table.from_pylist(list(rows), schema=self.arrow_schema), out)
        elif ".csv" in self.suffix:
            with opener(out, "wt", encoding="utf-8", newline="") as fh:
                writer = csv.DictWriter(fh, fieldnames=self.columns)
                writer.writeheader()
                writer.writerows(rows)
        else:
            with opener(out, "wt", encoding="utf-8") as fh:
                fh.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
        return out


def read_rows(path: str | Path, limit: int | None = None) -> RowFile:
    """The records of a node's data file (CSV, JSON Lines or Parquet, optionally gzipped), as written;
    the first ``limit`` of them (the audit's files need no more than its bound and a third)."""
    p = Path(path)
    name = p.name.lower()
    suffix = "".join(s for s in p.suffixes if s.lower() in (".csv", ".jsonl", ".json", ".parquet", *_COMPRESSED))
    opener = _opener(suffix)
    if ".parquet" in name:
        import pyarrow.parquet as pq

        table = pq.read_table(p)
        table = table if limit is None else table.slice(0, limit)
        return RowFile(table.to_pylist(), suffix, list(table.column_names), table.schema)
    if ".csv" in name:
        with opener(p, "rt", encoding="utf-8", newline="") as fh:
            reader = csv.DictReader(fh)
            rows = list(itertools.islice(reader, limit))
            return RowFile(rows, suffix, list(reader.fieldnames or []))
    if ".json" in name:
        with opener(p, "rt", encoding="utf-8") as fh:
            lines = (x for x in fh if x.strip())
            first = next(lines, "")
            if first.lstrip().startswith("["):  # a JSON array: written back as JSON Lines, one record a line
                rows = json.loads(first + "".join(lines))[:limit]
            else:
                rows = [json.loads(line) for line in itertools.islice(itertools.chain([first], lines), limit)
                        if line]
        return RowFile(rows, suffix.replace(".json", ".jsonl") if ".jsonl" not in suffix else suffix,
                       list(rows[0]) if rows else [])
    raise ValueError(f"{p}: the audit reads CSV, JSON Lines, JSON and Parquet files (optionally .gz, .bz2 or .xz); "
                     "convert the file to one of them for the audit")


_COMPRESSED = (".gz", ".bz2", ".xz")


def _opener(suffix: str) -> Callable[..., Any]:
    """``open`` for the compression a suffix names (gzip, bz2, xz), or plain ``open``."""
    import bz2
    import lzma

    openers: dict[str, Callable[..., Any]] = {".gz": gzip.open, ".bz2": bz2.open, ".xz": lzma.open}
    return openers.get(suffix[suffix.rfind("."):].lower(), open)


# ---------------------------------------------------------------------------------- neighbours
@dataclass(frozen=True)
class Pair:
    """Two neighbouring files: ``d_prime`` is ``d`` with one record added or removed."""

    name: str
    d: Path
    d_prime: Path


def _cycled(rows: list[dict[str, Any]], n: int) -> list[dict[str, Any]]:
    """``n`` records: the file's first ``n``, or all of them repeated (a copy is a record like any)."""
    return [dict(rows[i % len(rows)]) for i in range(n)]


def _edge_rows(row: dict[str, Any], schema: Any) -> list[tuple[str, dict[str, Any]]]:
    """A table's records at the edges of its histogram: every ranged column at its min, then at its
    max, categoricals at their first and last category; each value in the type the file holds."""
    out = []
    for side in ("min", "max"):
        edge = dict(row)
        for column in schema.columns:
            if column.name not in edge:
                continue
            value = (column.categories[0 if side == "min" else -1] if column.type == "categorical" and column.categories
                     else getattr(column, side) if column.type in ("integer", "float") else None)
            if value is None:
                continue
            held = edge[column.name]
            edge[column.name] = (column.write(value) if isinstance(held, str) else
                                 int(value) if column.type == "integer" else float(value))
        out.append((f"a record at every column's {side}", edge))
    return out


def neighbours(source: RowFile, folder: Path, bound: int, schema: Any = None,
               text_column: str = "text") -> list[Pair]:
    """The neighbouring pairs the audit tries, written in ``folder``: files below, at and above
    ``bound`` records, each with one record removed (the first, the last) or added (a copy of a
    record at the start, a record far longer than the others, a table's edge records). At the
    bound, one record added is where a view that keeps "a subsample of exactly max-records" swaps
    one record for another; above it, where a view's rule meets records it cannot keep."""
    if not source.rows:
        raise ValueError("the node's data file has no records: there is nothing to audit")
    folder.mkdir(parents=True, exist_ok=True)
    sizes = {"below": max(2, min(len(source.rows), bound // 2)), "at": bound, "above": bound + bound // 3 + 1}
    pairs = []
    for where, n in sizes.items():
        base = _cycled(source.rows, n)
        d = source.write(base, folder / f"d-{where}")
        long = dict(base[-1])
        if text_column in long and isinstance(long[text_column], str):
            long[text_column] = (long[text_column] + " ") * 200
        variants: list[tuple[str, list[dict[str, Any]]]] = [
            ("remove the first record", base[1:]), ("remove the last record", base[:-1]),
            ("add a copy of a record at the start", [dict(base[n // 2])] + base),
            ("add a record far longer than the others", base + [long]),
        ]
        if schema is not None:
            variants += [(f"add {what}", base + [edge]) for what, edge in _edge_rows(base[0], schema)]
        for i, (what, rows) in enumerate(variants):
            pairs.append(Pair(f"{where} max-records ({n}): {what}", d, source.write(rows, folder / f"d-{where}-{i}")))
    return pairs


# ---------------------------------------------------------------------------------- the requests
@dataclass(frozen=True)
class Kind:
    """One release the audit runs: its phase, label (a vote's histogram), request config,
    candidates (a vote's) and, at min-honest-nodes > 1, what of a masked round it audits."""

    phase: str
    label: str
    conf: dict[str, Any]
    candidates: tuple[tuple[str, str], ...] | None = None
    masked: str = ""  # a masked round's: "share" (the colluding peers' view) or "sum" (t sites); "" plain


def release_kinds(cfg: RunConfig, tier: str, codes: list[str], texts: list[tuple[str, str]],
                  delta: float) -> list[Kind]:
    """The Gaussian releases a node of ``tier`` serves in a run of ``cfg``: the profile, a vote of each
    registered histogram over candidates from ``texts`` (text, code), and a
    table's marginals (every counted column, and each pair of neighbouring columns), each asking ``delta``."""
    base = {"codes": list(codes), "server-round": 1, "delta": float(delta)}
    out = []
    for p in phases():
        if p.mechanism != GAUSSIAN or not p.asked(cfg, True) or p.share(cfg, tier) <= 0:
            continue
        if p.name == PROFILE:
            out.append(Kind(PROFILE, PROFILE, base))
        elif p.name == VOTE:
            for name in sorted(HISTOGRAMS):
                out.append(Kind(VOTE, f"vote:{name}", {**base, "histogram": name, "num-votes": cfg.num_votes},
                                tuple(texts[:MAX_CANDIDATES])))
        elif p.name == MARGINALS:
            schema = cfg.schema()
            assert schema is not None  # a marginals run is a table's
            names = list(schema.structured().names)
            cliques: list[tuple[str, ...]] = [(a,) for a in names] + [(a, b) for a, b in zip(names, names[1:])]
            out.append(Kind(MARGINALS, MARGINALS, {**base, R.CLIQUES: R.cliques_value(cliques)}))
        else:  # a phase registered from outside: the audit knows no request for it
            log.warning("the audit has no request for phase %r; it is not audited", p.name)
    return out


# ------------------------------------------------------------------------------- the node, for real
class AuditError(RuntimeError):
    """The audit could not run a release (the node refused or failed it): says which and why."""


class AuditNode:
    """The node's real ClientApp under the operator's node config, in ``scratch``: every release is
    a Flower message to ``fedsyn_client.client_app.app`` (policy, authorise, view, ledger, mechanism),
    each under its own run key and on a fresh ledger, so every draw is a first release, noised alike.
    One state folder per data file (a node's snapshot is its file's), each with the node's secret."""

    NODE_ID = 1

    def __init__(self, node_config: dict[str, Any], cfg: RunConfig, scratch: Path, bound: int, secret: Path | None,
                 base: Path | None = None):
        # the node's outgoing-message log goes to the scratch folder: "" would fall back to FEDSYN_AUDIT_DIR, and
        # the operator's log would record replies that never left the node
        self.node_config = {**node_config, "max-records": int(bound), "audit-dir": str(scratch / "outgoing")}
        self.run_config = cfg.to_flower()
        self.scratch, self.secret, self.sent = scratch, secret, 0
        self.base = base or scratch  # the file a masked round's simulated peers hold (``--sum``)
        # run keys no earlier audit in a reused scratch folder used: a repeated key and request would get
        # the stored reply (no fresh noise) and a ledger of the same name would price the draw after others
        self.token = secrets.token_hex(4)

    def state_for(self, data: Path) -> Path:
        """The state folder of the node on ``data`` (one per file, each with the node's secret)."""
        from fedsyn_client.view import SEED_FILE, view_seed

        if self.secret is None:  # a node with no view yet: one new secret for every file, as one node holds
            view_seed(self.scratch / "secret")
            self.secret = self.scratch / "secret" / SEED_FILE
        state = self.scratch / "state" / data.name.split(".")[0]
        if not state.exists():
            state.mkdir(parents=True)
            # the node's own view secret, one for D and D': the neighbour relation is one node's
            shutil.copy2(self.secret, state / SEED_FILE)
        return state

    def release(self, kind: Kind, data: Path, noise: bool = True) -> tuple[np.ndarray, dict[str, Any]]:
        """(the released vector, its statement) of ``kind`` on ``data``; with ``noise`` False, at epsilon
        inf in the node and the run (sigma 0: the statistic itself). A masked kind's is the unmasked
        sum of its round (``fedsyn_client.masked_audit``). Raises ``AuditError``."""
        if kind.masked:
            from fedsyn_client.masked_audit import MaskedRoundFailed, masked_release

            try:
                return masked_release(self, kind, data, noise)
            except MaskedRoundFailed as err:
                raise AuditError(str(err)) from None
        self.sent += 1
        reply = self.ask(kind, data, noise, f"audit-{self.token}-{self.sent}")
        statement = dict(reply.content.config_records[R.RELEASE])
        return R.read_vector(reply.content, phase_named(kind.phase).reply), statement

    def ask(self, kind: Kind, data: Path, noise: bool, key: str, *, node_id: int = NODE_ID,
            state: Path | None = None, config: dict[str, Any] | None = None,
            records: dict[str, Any] | None = None, node: dict[str, Any] | None = None) -> Any:
        """One Flower message of ``kind``'s request to the real ClientApp as node ``node_id`` on
        ``data`` (its state folder ``state``, default the file's), its run key ``key``, ``config``
        added to the request, ``records`` (name -> ConfigRecord) to the message and ``node`` to the
        node config; the reply. Raises ``AuditError`` when the node answers an error."""
        from flwr.app import ConfigRecord, Context, Message, RecordDict
        from flwr.supercore.task_identity import TaskIdentity

        from fedsyn_client.client_app import app

        node_config = {**self.node_config, "data-path": str(data), "state-dir": str(state or self.state_for(data)),
                       "ledger-id": f"{key}-{node_id}", **(node or {})}
        run_config = dict(self.run_config)
        if not noise:
            node_config["epsilon"] = run_config["epsilon"] = math.inf
        content = RecordDict({R.CONFIG: ConfigRecord({**kind.conf, "resume-key": key, **(config or {})})})
        if kind.candidates is not None:
            content[R.CANDIDATES] = ConfigRecord({"texts": [t for t, _ in kind.candidates],
                                                  "codes": [c for _, c in kind.candidates]})
        for name, record in (records or {}).items():
            content[name] = record
        # Flower builds a message only inside a running app's task; the audit is the server here
        TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1
        msg = Message(content=content, message_type=phase_named(kind.phase).message, dst_node_id=node_id)
        context = Context(run_id=1, node_id=node_id, node_config=node_config, state=RecordDict(),
                          run_config=run_config)
        reply = app(msg, context)
        if reply.has_error():
            raise AuditError(f"{kind.label} on {data.name}: the node answered {reply.error.reason!r} "
                             "(its log says why)")
        return reply


# ----------------------------------------------------------------------------------- one release
@dataclass
class KindAudit:
    """What the audit found for one release kind."""

    kind: str
    stated_epsilon: float
    delta: float
    stated_sensitivity: float
    measured_sensitivity: float
    worst: str  # the pair that moved the release most
    stated_sigma: float
    sigma_upper: float
    lower_gaussian: float  # under the release's claim (Gaussian; Skellam for a masked count) and sigma's bound
    lower_threshold: float  # the threshold test, assuming nothing
    shape: ShapeCheck | None
    confidence: float
    draws: int  # noised releases per side
    seconds: float
    problems: list[str] = field(default_factory=list)

    @property
    def lower(self) -> float:
        """The audit's lower bound on epsilon: the larger of the two (each at a quarter of the error rate)."""
        return max(self.lower_gaussian, self.lower_threshold)

    @property
    def failed(self) -> bool:
        """Whether the audit found the release breaking its statement."""
        return bool(self.problems)


def _distance(a: np.ndarray, b: np.ndarray) -> float:
    return math.inf if a.shape != b.shape else float(np.linalg.norm(a - b))


def audit_kind(node: AuditNode, kind: Kind, pairs: Sequence[Pair], max_draws: int = DEFAULT_DRAWS,
               confidence: float = DEFAULT_CONFIDENCE, tick: Callable[[], None] = lambda: None) -> KindAudit:
    """Audit one release kind on ``pairs`` (steps 2-4 of the module's method); ``tick`` is called
    after each release (a progress bar's)."""
    start = time.perf_counter()
    exact: dict[Path, tuple[np.ndarray, dict[str, Any]]] = {}

    def off(path: Path) -> tuple[np.ndarray, dict[str, Any]]:
        if path not in exact:
            exact[path] = node.release(kind, path, noise=False)
            tick()
        return exact[path]

    moved = [(_distance(off(p.d)[0], off(p.d_prime)[0]), p) for p in pairs]
    distance, worst = max(moved, key=lambda m: m[0])
    f_d, f_dp = off(worst.d)[0], off(worst.d_prime)[0]
    coordinates = max(1, f_d.size)
    draws = int(min(max_draws, max(MIN_DRAWS, math.ceil(MIN_COORDINATES / (2 * coordinates)))))
    outputs: dict[int, list[np.ndarray]] = {0: [], 1: []}
    statement: dict[str, Any] = {}
    for _ in range(draws):  # interleaved, so a drift of the machine falls on both sides alike
        for side, path in enumerate((worst.d, worst.d_prime)):
            vector, statement = node.release(kind, path)
            outputs[side].append(vector)
            tick()
    out_d, out_dp = np.array(outputs[0]), np.array(outputs[1])
    stated_eps, stated_sens = float(statement["epsilon"]), float(statement["sensitivity"])
    stated_sigma = float(statement["sigma"])
    # the delta the release is (epsilon, delta)-DP at: under pld the policy's, at which it is composed
    delta = float(statement.get("composed_delta", statement["delta"]))
    # a masked count release states Skellam(mu) noise on integers: judged under that claim (a lattice's
    # noise loses less than the Gaussian of its variance) and its heavier tails widen sigma's bound
    mu = statement.get("skellam_mu")
    kurtosis = 1.0 / (2.0 * float(mu)) if mu else 0.0
    # the error rate 1 - confidence is split (union bound) between the two bounds, a quarter each, and the
    # three shape tests, a sixth each: a correct release fails the audit with probability <= 1 - confidence
    alpha = 1.0 - confidence
    half = 1.0 - alpha / 4
    problems = []
    if not math.isfinite(distance):
        problems.append(f"the release's length depends on the records ({worst.name})")
        res_d = res_dp = np.zeros(2)
        upper, lower_g, lower_t = 0.0, math.inf, math.inf
    else:
        res_d, res_dp = out_d - f_d, out_dp - f_dp
        upper = sigma_upper(np.concatenate([res_d.ravel(), res_dp.ravel()]), half, kurtosis)
        claim = skellam_claim_epsilon(upper, f_d - f_dp, delta) if mu is not None else None
        lower_g = gaussian_epsilon(upper, distance, delta) if claim is None else claim
        lower_t = epsilon_lower_bound(projection(out_d, f_d, f_dp), projection(out_dp, f_d, f_dp), delta,
                                      half).epsilon_lower
    if distance > stated_sens * (1 + 1e-4) + 1e-6 + float(statement.get("tolerance", 0.0)):
        problems.append(f"its sensitivity is at least {distance:.4g}, above the stated {stated_sens:.4g} "
                        f"({worst.name})")
    if max(lower_g, lower_t) > stated_eps:
        problems.append(f"it loses epsilon >= {max(lower_g, lower_t):.3g} at delta {delta:.2g}, above the stated "
                        f"{stated_eps:.3g} ({worst.name})")
    shape = shape_check(res_d, res_dp, float(mu) if mu is not None else None) if math.isfinite(distance) else None
    if shape is not None:
        problems += shape.failures(alpha / 6)
    return KindAudit(kind.label, stated_eps, delta, stated_sens, distance, worst.name, stated_sigma, upper,
                     lower_g, lower_t, shape, confidence, draws, time.perf_counter() - start, problems)


# ------------------------------------------------------------------------------------ the audit
@dataclass
class Audit:
    """The whole audit: the releases audited and how."""

    results: list[KindAudit]
    bound: int
    node_records: int
    pairs: int
    seconds: float

    @property
    def failed(self) -> list[KindAudit]:
        """The releases that break their statement."""
        return [r for r in self.results if r.failed]


def audit_run_config(policy: Any, overrides: dict[str, Any] | None = None) -> RunConfig:
    """The run the audit asks the node's releases of: the default run on the node's own columns,
    schema, embedder, vote window and precision and budget (a run the node's policy admits), then
    ``overrides`` (run-config keys, as ``flwr run --run-config`` takes them)."""
    base = RunConfig()
    embedder = base.embedder if base.embedder in policy.embedders else policy.embedders[0]
    model = base.model if base.model in policy.models else policy.models[0]
    epsilon = policy.epsilon if math.isfinite(policy.epsilon) else base.epsilon
    precision = base.precision if base.precision in policy.vote_precisions else policy.vote_precisions[0]
    cfg = replace(base, text_column=policy.text_column, control_columns=tuple(policy.control_columns),
                  table_schema=policy.table_schema, embedder=embedder, model=model, epsilon=epsilon,
                  accounting=policy.accounting, max_length=policy.vote_windows[0] // 2, precision=precision)
    if overrides:
        cfg = RunConfig.from_flower({**cfg.to_flower(), **overrides})
    return cfg


def run_audit(node_config: dict[str, Any], overrides: dict[str, Any] | None = None, bound: int | None = None,
              max_draws: int = DEFAULT_DRAWS, confidence: float = DEFAULT_CONFIDENCE,
              only: Sequence[str] | None = None, scratch: Path | None = None,
              progress: bool = True, sums: bool = False) -> Audit:
    """Audit every Gaussian release the node of ``node_config`` serves in the run of ``overrides``
    (``audit_run_config``). ``bound``: the audit's max-records (default the smaller of the node's and
    ``DEFAULT_BOUND``); ``only``: the releases to audit, by label ("profile", "vote:knn-vote",
    "marginals", a masked round's "profile/share"; default all); ``scratch``: where to write (default a
    temporary folder, removed after). A node at min-honest-nodes > 1 has its masked rounds audited
    too (``fedsyn_client.masked_audit``): its share against colluding peers and, with ``sums``, the
    sum of a simulated round of t sites.
    Raises ``NodeSetupError`` for an unusable node config, ``AuditError`` when a release cannot run."""
    from tqdm.auto import tqdm

    from fedsyn_client.masked_audit import masked_kinds
    from fedsyn_client.node import deployed_records
    from fedsyn_client.refusals import NodeSetupError
    from fedsyn_client.view import SEED_FILE

    start = time.perf_counter()
    if "partition-id" in node_config:
        raise NodeSetupError("fedsyn audit --node-config audits a deployed node (its data-path); this node config is "
                             "a simulated one (partition-id): audit a simulated run with --canaries")
    policy, records = deployed_records(node_config)
    cfg = audit_run_config(policy, overrides)
    bound = int(bound or min(policy.max_records, DEFAULT_BOUND))
    if len(records) == 0:
        raise NodeSetupError(f"data-path {policy.data_path!r} has no records under the node's policy: nothing to audit")
    codes = list(policy.control_codes) or sorted(set(records.codes))
    by_code: dict[str, list[str]] = {}
    for text, code in zip(records.texts, records.codes):
        by_code.setdefault(code, []).append(text)
    # the candidates: the node's own texts, a few of each code in turn (nearest to the records, so an
    # added record's vote lands on them; nothing is sent anywhere)
    texts = [(t[i], c) for i in range(MAX_CANDIDATES) for c, t in sorted(by_code.items()) if i < len(t)]
    delta = min(cfg.resolve_delta(len(records)), policy.delta)
    kinds = release_kinds(cfg, policy.tier, codes, texts, delta)
    kinds += masked_kinds(kinds, policy.min_honest_nodes, sums)
    if only:
        unknown = sorted(set(only) - {k.label for k in kinds})
        if unknown:
            raise ValueError(f"this node serves no release {unknown} in the run audited; it serves "
                             f"{[k.label for k in kinds]}")
        kinds = [k for k in kinds if k.label in only]
    secret = Path(policy.state_dir or "~/.fedsyn/state").expanduser() / SEED_FILE
    temporary = scratch is None
    folder = Path(tempfile.mkdtemp(prefix="fedsyn-audit-")) if scratch is None else Path(scratch)
    try:
        schema = cfg.schema()
        pairs = neighbours(read_rows(policy.data_path, bound + bound // 3 + 1), folder / "data", bound, schema,
                           schema.text_column or "" if schema is not None else policy.text_column)
        node = AuditNode(node_config, cfg, folder, bound, secret if secret.exists() else None, pairs[0].d)
        results = []
        files = len({p.d for p in pairs} | {p.d_prime for p in pairs})
        for kind in kinds:
            with tqdm(total=files + 2 * max_draws, desc=f"audit {kind.label}", unit="release",
                      disable=not progress) as bar:
                results.append(audit_kind(node, kind, pairs, max_draws, confidence, lambda: bar.update()))
                bar.total = bar.n
                bar.refresh()
        return Audit(results, bound, len(records), len(pairs), time.perf_counter() - start)
    finally:
        if temporary:
            shutil.rmtree(folder, ignore_errors=True)


def format_audit(audit: Audit) -> str:
    """The audit as the operator reads it: one row per release kind, then each failure in words."""
    header = (f"{'release':24} {'stated eps':>10} {'lower bound':>11} {'confidence':>10} {'draws':>6} "
              f"{'seconds':>8}  {'sensitivity stated/measured':>27}  {'sigma stated/upper':>19}  verdict")
    lines = [f"fedsyn audit: {len(audit.results)} release kind(s), {audit.pairs} neighbouring pairs at max-records "
             f"{audit.bound} from the node's {audit.node_records} records, {audit.seconds:.0f} s", "", header,
             "-" * len(header)]
    for r in audit.results:
        lines.append(f"{r.kind:24} {r.stated_epsilon:10.4g} {r.lower:11.4g} {r.confidence:10.4g} {r.draws:6d} "
                     f"{r.seconds:8.1f}  {r.stated_sensitivity:13.4g}/{r.measured_sensitivity:<13.4g}  "
                     f"{r.stated_sigma:9.4g}/{r.sigma_upper:<9.4g}  {'FAILS' if r.failed else 'ok'}")
    for r in audit.failed:
        lines += [f"{r.kind} FAILS: {p}" for p in r.problems]
    if not audit.results:
        lines.append("(this node serves no Gaussian release in this run: DP-SGD is audited by --canaries)")
    return "\n".join(lines)
