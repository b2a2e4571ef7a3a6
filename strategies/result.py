"""``FedSynResult``: everything a run produced, filled in by the strategy and its courier,
written out by ``fedsyn_server.outputs`` and saved whole in checkpoints."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
from flwr.app import ArrayRecord


@dataclass
class FedSynResult:
    """Everything a run produced, for the outputs writer."""

    tiers: dict[int, str] = field(default_factory=dict)
    arrays: ArrayRecord | None = None
    train_metrics: dict[int, dict[str, float]] = field(default_factory=dict)
    eval_metrics: dict[int, dict[str, float]] = field(default_factory=dict)
    node_profiles: dict[int, list[float]] = field(default_factory=dict)
    profile: np.ndarray | None = None
    allocation: dict[str, int] = field(default_factory=dict)
    pretrained_codes: list[str] = field(default_factory=list)  # written by θ⁰ (``strategies.coverage``)
    pool_texts: list[str] = field(default_factory=list)
    pool_codes: list[str] = field(default_factory=list)
    # who wrote each pool text (``strategies.writers``): pretrained, finetuned, refined
    pool_writers: list[str] = field(default_factory=list)
    # a table by marginals with a free-text column: the sampled rows' [text of the row, code], which
    # the language model's texts are attached to (``strategies.marginals``)
    table_rows: list[list[str]] = field(default_factory=list)
    finetuned: bool = False  # phase 1 trained the weights (else the one writer is θ⁰)
    pretrained_share: float = 0.0  # the share of each code's pool θ⁰ wrote in this run, and why:
    writers_note: str = ""
    generation: dict[str, Any] = field(default_factory=dict)  # ``Generator.generation_report`` of the pool
    node_votes: dict[int, list[float]] = field(default_factory=dict)  # the last vote round's, by node
    votes: np.ndarray | None = None  # aggregated noisy votes of the final population (last round)
    selected: np.ndarray | None = None
    vote_rounds: list[dict[str, Any]] = field(default_factory=list)  # one entry per vote round
    refinement: dict[str, Any] = field(default_factory=dict)  # the method's own per-round notes
    refinement_history: list[dict[str, Any]] = field(default_factory=list)  # ``Refined.history``
    generator_refined: bool = False  # the refinement trained the generator (its weights are ``arrays``)
    releases: dict[int, list[dict[str, Any]]] = field(default_factory=dict)
    ledgers: dict[int, dict[str, Any]] = field(default_factory=dict)  # node -> its own book of this run
    budgets: dict[int, float] = field(default_factory=dict)
    bounds: dict[int, int] = field(default_factory=dict)  # node -> its public max-records (0: none stated)
    trust: dict[int, int] = field(default_factory=dict)  # node -> its min-honest-nodes (issue 73; 1: trusts nobody)
    ledger_refs: dict[int, str] = field(default_factory=dict)  # node -> its ledger's random name (restarts)
    failures: list[dict[str, Any]] = field(default_factory=list)
    degradations: list[str] = field(default_factory=list)  # what the run did with less than it asked for
    skipped: list[str] = field(default_factory=list)  # planned phases that got no node at all: the run fails
    timings: dict[str, float] = field(default_factory=dict)
