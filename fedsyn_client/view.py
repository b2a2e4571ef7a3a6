"""A node's records under its public size bound ``max-records`` (issue 45).

The server may learn the bound, never the count: DP-SGD's sampling rate is q = B / max-records
(public, the same for every file), and a release does the work of ``max-records`` records
whatever the file holds (``fedsyn_client.training`` pads its batches with rows that count for
nothing). A file with more records than the bound is cut to a uniform subsample of exactly that
many, chosen once: the draw is keyed by a secret the node keeps in its state folder, so the same
file gives the same subsample run after run (the ledger's charges are for that view) and the
server cannot predict which records it is.

Reading the file takes time that grows with it (pandas parses every row; 2,000 news articles took
20 times as long as 100), so a deployed node reads its file once, when ``fedsyn node-check`` runs
or at the first request after the file changed, and keeps the view in its state folder as a
snapshot of fixed size: ``bound`` rows of ``8 + text_bytes + CODE_BYTES`` bytes each (the text's
and the code's lengths, then the text cut to ``text_bytes`` and the code, in fixed slots), the rows
beyond the records empty. Every
request reads and decodes all of it, so the time is that of the bound. A record's code longer
than ``CODE_BYTES`` is kept as no code (it is then in no run's vocabulary). By hand: no file
format reads in time independent of its content.
"""

from __future__ import annotations

import json
import os
import secrets
import struct
from pathlib import Path
from typing import Any

import numpy as np

from common.data import TextData, dataset_fingerprint
from common.io import atomic_write_bytes, atomic_write_text
from fedsyn_client.fixed_work import cut

SEED_FILE = "view-seed"
SNAPSHOT_FORMAT = 2
_LENGTHS = 8  # a row starts with its text's and its code's lengths in characters (two uint32)
CODE_BYTES = 256


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


def cut_view(data: TextData, text_bytes: int) -> TextData:
    """``data`` with each text cut to its first ``text_bytes`` UTF-8 bytes (whole characters) and each
    code longer than ``CODE_BYTES`` bytes replaced by no code: what a snapshot can hold."""
    texts = [cut(t, text_bytes) for t in data.texts]
    return TextData(texts, [c if len(c.encode("utf-8")) <= CODE_BYTES else "" for c in data.codes])


def write_snapshot(path: str | Path, data: TextData, bound: int, text_bytes: int, stamp: dict[str, Any]) -> None:
    """Write ``data`` (at most ``bound`` records, already ``cut_view``) as a snapshot of exactly
    ``bound`` rows for ``stamp`` (what it was read from), mode 0600, written whole or not at all."""
    if len(data) > bound:
        raise ValueError(f"{len(data)} records above the bound {bound}")
    row = _LENGTHS + text_bytes + CODE_BYTES
    body = bytearray(bound * row)
    for i, (text, code) in enumerate(zip(data.texts, data.codes)):
        t, c = text.encode("utf-8"), code.encode("utf-8")
        if len(t) > text_bytes or len(c) > CODE_BYTES:
            raise ValueError(f"record {i} does not fit its row: cut the view first (cut_view)")
        at = i * row
        body[at:at + _LENGTHS] = struct.pack("<II", len(text), len(code))
        body[at + _LENGTHS:at + _LENGTHS + len(t)] = t
        body[at + _LENGTHS + text_bytes:at + _LENGTHS + text_bytes + len(c)] = c
    head = {"format": SNAPSHOT_FORMAT, "stamp": stamp, "records": len(data), "rows": bound,
            "text-bytes": text_bytes, "code-bytes": CODE_BYTES, "fingerprint": dataset_fingerprint(data)}
    atomic_write_bytes(path, json.dumps(head, sort_keys=True).encode("utf-8") + b"\n" + bytes(body))
    os.chmod(path, 0o600)


def read_snapshot(path: str | Path, stamp: dict[str, Any]) -> tuple[TextData, str] | None:
    """(the records, their fingerprint) of the snapshot at ``path`` when it was written for
    ``stamp``, else None (missing, stale or damaged: the caller builds it again). Every row is
    read and decoded, records or not, so the work is the bound's."""
    try:
        raw = Path(path).read_bytes()
        line, _, body = raw.partition(b"\n")
        head = json.loads(line)
    except (OSError, ValueError):
        return None
    if not isinstance(head, dict) or head.get("format") != SNAPSHOT_FORMAT or head.get("stamp") != stamp:
        return None
    rows, text_bytes, code_bytes, records = (head.get(k) for k in ("rows", "text-bytes", "code-bytes", "records"))
    if not all(isinstance(v, int) and v >= 0 for v in (rows, text_bytes, code_bytes, records)) or records > rows \
            or len(body) != rows * (_LENGTHS + text_bytes + code_bytes):
        return None
    row = _LENGTHS + text_bytes + code_bytes
    texts, codes, rest = [], [], []
    for i in range(rows):
        # Every slot is decoded whole and split at its stored length, the rest copied too and dropped:
        # each row costs its slot's bytes, a record or padding, long or short. (A strip of the padding
        # bytes cost as many steps as there were: a node of 100 records read its snapshot slower than
        # one of 2,000, and the profile reply showed it, KS p = 0.012.)
        at = i * row
        n_text, n_code = struct.unpack_from("<II", body, at)
        text = body[at + _LENGTHS:at + _LENGTHS + text_bytes].decode("utf-8", "replace")
        code = body[at + _LENGTHS + text_bytes:at + row].decode("utf-8", "replace")
        texts.append(text[:n_text])
        codes.append(code[:n_code])
        rest.append((text[n_text:], code[n_code:]))
    del rest  # held until here: the memory taken is every slot's, a record's or padding's
    return TextData(texts[:records], codes[:records]), str(head.get("fingerprint", ""))
