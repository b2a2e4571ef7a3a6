"""The server's checkpoint: where a run stands, saved after every stage and round.

``<run-dir>/checkpoint/`` holds ``state.json`` (the stages done, the last phase-1 round,
each vote round's aggregated noisy votes, everything the run produced so far, the run key
and the run config) and the global trainable weights it names (``weights-<id>.npz``). Each
save writes new weights under a new name, then ``state.json`` atomically, then removes the
old weights: a crash at any point leaves a ``state.json`` whose weights are the ones it names.

A resumed run (run config ``resume="<run-dir>"``) loads it, sends the same run key, and
asks no node again for a finished stage. A round that was cut off is asked again; each
node answers it with the reply it stored when it released it, byte for byte, at no cost
(``fedsyn_client.replies``).
"""

from __future__ import annotations

import json
import secrets
import uuid
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np
from flwr.app import ArrayRecord

from common import records as R
from common.io import atomic_write_npz, atomic_write_text

FOLDER = "checkpoint"
STATE = "state.json"
FORMAT = 1
# FedSynResult fields keyed by node id (JSON makes the keys strings) and those that are arrays.
_BY_NODE = ("tiers", "train_metrics", "eval_metrics", "node_profiles", "node_votes", "releases", "ledgers", "budgets",
            "ledger_refs", "bounds", "trust")
_ARRAYS = ("profile", "votes", "selected")


@dataclass
class Progress:
    """How far a run got: stages done, the last finished phase-1 round, each vote round's total."""

    resume_key: str
    config: dict[str, Any]
    completed: list[str] = field(default_factory=list)  # "finetune", "profile", "generate", "refine"
    train_round: int = 0
    vote_totals: list[list[float]] = field(default_factory=list)
    # the run's secret for its pre-flight holds: only a request carrying it renews or ends them
    hold_token: str = field(default_factory=lambda: secrets.token_hex(16))


@dataclass
class Checkpoint:
    """A loaded checkpoint: the progress, the result so far (a ``FedSynResult``) and the weights."""

    progress: Progress
    result: Any
    arrays: ArrayRecord | None


def save_checkpoint(run_dir: Path, progress: Progress, result: Any, arrays: ArrayRecord | None) -> Path:
    """Write the checkpoint under ``run_dir/checkpoint`` atomically; returns its folder."""
    folder = Path(run_dir) / FOLDER
    weights: str | None = None
    if arrays is not None:
        weights = f"weights-{uuid.uuid4().hex[:12]}.npz"
        atomic_write_npz(folder / weights, dict(R.state_from_arrays(arrays)))
    state = {"format": FORMAT, "progress": vars(progress), "weights": weights,
             "weight_order": list(arrays.keys()) if arrays is not None else [],
             "result": {f.name: getattr(result, f.name) for f in fields(result) if f.name != "arrays"}}
    atomic_write_text(folder / STATE, json.dumps(state, allow_nan=True, default=_plain))
    for old in folder.glob("weights-*.npz"):
        if old.name != weights:
            old.unlink(missing_ok=True)
    return folder


def load_checkpoint(run_dir: str | Path, result_type: type) -> Checkpoint:
    """Read ``run_dir/checkpoint``; ``result_type`` is ``FedSynResult``. Raises ``FileNotFoundError``
    (naming the folder) when there is no checkpoint, ``ValueError`` for an unknown format."""
    folder = Path(run_dir).expanduser() / FOLDER
    if not (folder / STATE).is_file():
        raise FileNotFoundError(f"resume: no checkpoint in {str(folder)!r}; give the run directory of a run "
                                "started by this version of fedsyn")
    state = json.loads((folder / STATE).read_text(encoding="utf-8"))
    if state.get("format") != FORMAT:
        raise ValueError(f"resume: checkpoint format {state.get('format')!r} in {folder} is not {FORMAT}")
    raw = state["result"]
    for name in _BY_NODE:
        raw[name] = {int(k): v for k, v in raw.get(name, {}).items()}
    for name in _ARRAYS:
        if raw.get(name) is not None:
            raw[name] = np.asarray(raw[name], dtype=np.int64 if name == "selected" else np.float64)
    arrays = None
    if state["weights"]:
        with np.load(folder / state["weights"], allow_pickle=False) as stored:
            arrays = R.arrays_from_state({k: np.array(stored[k]) for k in state["weight_order"]})
    return Checkpoint(Progress(**state["progress"]), result_type(**raw), arrays)


def _plain(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if isinstance(obj, np.generic):
        return obj.item()
    raise TypeError(f"cannot checkpoint {type(obj).__name__}")
