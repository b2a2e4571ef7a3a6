"""Idempotent releases: every noised reply a node released, kept on the node's disk.

A run that is stopped and resumed, or a reply that was lost on the way, makes the server
ask the same thing again. Answering with a fresh release would spend the budget twice (or
be refused, and the run could not finish); answering with the *same bytes* costs nothing,
because it tells the server nothing it was not told already. So each release is stored
under (run key, phase, round) with a digest of the request it answered:

- the same request again gets the stored reply, and the ledger is not touched;
- a *different* request under the same (run key, phase, round) is refused: a curious
  server must not learn which of two requests a stored reply answered, nor get a second
  release under the first one's name.

The run key is the request's ``resume-key`` (a resumed run repeats its original run's key)
or the Flower run id. Replies are written atomically (temp file, then rename). Phase-1
replies are whole weight sets, so only each run's latest round is kept: a resumed run
re-asks at most the round that was cut off.

A node runs for years, so a run's replies are kept ``keep-replies-days`` (node config, default
30) after its last release, then deleted with its folder. That bounds how long a stopped run
can be resumed on this node, nothing else: the ledger keeps every release for good, and it
refuses a second release under a released run, phase and round (``refused: budget: round``),
so a request whose stored reply is gone gets the same fixed refusal, never fresh noise.
Deleting depends on the clock alone, never on the records.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
from flwr.app import RecordDict

from common.config import ConfigError
from common.dp import TRAIN
from common.io import atomic_write_npz
from fedsyn_client import refusals
from fedsyn_client.refusals import BudgetExceeded

_KEY = re.compile(r"^[A-Za-z0-9._-]{1,80}$")
_VECTOR = "__vector__"


def check_run_key(key: str) -> str:
    """``key`` if it can name a run on this node's disk; else ``ConfigError``."""
    if not _KEY.match(key) or key in (".", ".."):
        raise ConfigError(f"resume-key {key!r} must be 1-80 characters of letters, digits, '.', '_' or '-'")
    return key


def request_digest(content: RecordDict, terms: dict[str, Any] | None = None) -> str:
    """SHA-256 over everything a request carries (configs, candidates, weights), in a fixed order,
    and the run-config ``terms`` its computation reads (``release.computation_terms``)."""
    h = hashlib.sha256()
    h.update(json.dumps(terms or {}, sort_keys=True, default=str).encode())
    for name, rec in sorted(content.config_records.items()):
        h.update(json.dumps([name, dict(rec)], sort_keys=True, default=str).encode())
    for name, arrays in sorted(content.array_records.items()):
        h.update(name.encode())
        for key in arrays.keys():
            arr = arrays[key]
            h.update(f"{key}:{arr.dtype}:{arr.shape}".encode())
            h.update(arr.data)
    for name, metrics in sorted(content.metric_records.items()):
        h.update(json.dumps([name, dict(metrics)], sort_keys=True, default=str).encode())
    return h.hexdigest()


class ReplyStore:
    """The node's released replies as ``<root>/<run key>/<phase>-<round>.npz`` (the node keeps
    them next to its ledger: ``<state-dir>/ledger-replies/``)."""

    def __init__(self, root: str | Path, keep_days: float = 0.0) -> None:
        self.root = Path(root)
        self.keep_days = float(keep_days)  # 0: keep every run's replies forever

    def _path(self, key: str, phase: str, rnd: int) -> Path:
        return self.root / check_run_key(key) / f"{phase}-{int(rnd)}.npz"

    def get(self, key: str, phase: str, rnd: int, digest: str) -> tuple[Any, dict[str, Any]] | None:
        """The stored (payload, statement) for this request, or None if there is none.

        Raises ``BudgetExceeded`` when (key, phase, round) was released for another request.
        """
        path = self._path(key, phase, rnd)
        if not path.exists():
            return None
        with np.load(path, allow_pickle=False) as stored:
            meta = json.loads(str(stored["__meta__"]))
            if meta["digest"] != digest:
                raise BudgetExceeded(refusals.BUDGET_REPLAYED,
                    f"this node already released {phase} round {rnd} of run {key!r} for a different request; "
                    "a resumed run must repeat the same request (same resume-key, round, candidates and weights)")
            payload = (np.array(stored[_VECTOR]) if meta["order"] == [_VECTOR]
                       else {n: np.array(stored[n]) for n in meta["order"]})
        return payload, meta["statement"]

    def put(self, key: str, phase: str, rnd: int, digest: str, payload: Any, statement: dict[str, Any]) -> Path:
        """Store a released reply atomically; for phase 1, drop the run's earlier rounds."""
        path = self._path(key, phase, rnd)
        arrays = {_VECTOR: np.asarray(payload)} if not isinstance(payload, dict) else {
            str(k): np.asarray(v) for k, v in payload.items()}
        meta = {"digest": digest, "statement": statement, "order": list(arrays)}
        atomic_write_npz(path, {"__meta__": np.array(json.dumps(meta, default=float)), **arrays})
        if phase == TRAIN:
            for old in path.parent.glob(f"{TRAIN}-*.npz"):
                if old != path:
                    old.unlink(missing_ok=True)
        self.prune(keep=path.parent)
        return path

    def prune(self, now: float | None = None, keep: Path | None = None) -> list[str]:
        """Delete the folders of runs whose newest reply is older than ``keep_days`` (none when it
        is 0), except ``keep``; return the run keys deleted, oldest first."""
        if self.keep_days <= 0 or not self.root.is_dir():
            return []
        cutoff = (time.time() if now is None else now) - self.keep_days * 86400.0
        stale = []
        for folder in self.root.iterdir():
            if not folder.is_dir() or folder == keep:
                continue
            times = [f.stat().st_mtime for f in folder.iterdir() if f.is_file()]
            newest = max(times, default=folder.stat().st_mtime)
            if newest < cutoff:
                stale.append((newest, folder))
        stale.sort()
        for _, folder in stale:
            shutil.rmtree(folder, ignore_errors=True)  # another process pruning the same folder is no error
        return [folder.name for _, folder in stale]
