"""A node's records under its public size bound ``max-records`` (issue 45).

The server may learn the bound, never the count: DP-SGD's sampling rate is q = B / max-records
(public, the same for every file), and a release does the work of ``max-records`` records
whatever the file holds (``fedsyn_client.training`` pads its batches with rows that count for
nothing). A file with more records than the bound is cut to a uniform subsample of exactly that
many, chosen once: the draw is keyed by a secret the node keeps in its state folder, so the same
file gives the same subsample run after run (the ledger's charges are for that view) and the
server cannot predict which records it is. Pure functions besides the secret's file.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

import numpy as np

from common.data import TextData
from common.io import atomic_write_text

SEED_FILE = "view-seed"


def bounded(data: TextData, bound: int, seed: int) -> TextData:
    """``data`` when it holds at most ``bound`` records, else a uniform subsample of exactly
    ``bound`` of them (in file order) drawn from ``seed``."""
    if bound < 1:
        raise ValueError(f"max-records = {bound}: must be >= 1")
    if len(data) <= bound:
        return data
    keep = np.sort(np.random.default_rng(seed).choice(len(data), size=bound, replace=False))
    return data.subset(keep)


def view_seed(state_dir: str | Path) -> int:
    """The node's secret for its subsample, created once in ``state_dir`` (mode 0600) and kept."""
    path = Path(state_dir) / SEED_FILE
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, f"{secrets.randbits(128)}\n")
        os.chmod(path, 0o600)
    return int(path.read_text().strip())
