"""A node's records under its public size bound ``max-records`` (issue 45).

The server may learn the bound, never the count: DP-SGD's sampling rate is q = B / max-records
(public, the same for every file), and a release does the work of ``max-records`` records
whatever the file holds (``fedsyn_client.training`` pads its batches with rows that count for
nothing). Which records a node serves is decided per record (``bounded``: each record keyed by a
secret the node keeps in its state folder to one of ``max-records`` slots, each slot serving one
record when it holds an odd number), so
that one record added anywhere in the file, at any size, adds or removes at most one record of the
view (issue 60), the same file gives the same view run after run (the ledger's charges are for
that view), and the server cannot predict which records it is.

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

import hashlib
import json
import os
import secrets
import struct
from pathlib import Path
from typing import Any

from common.data import TextData, dataset_fingerprint
from common.io import atomic_write_text, read_stamped, write_stamped
from fedsyn_client.fixed_work import cut

SEED_FILE = "view-seed"
SNAPSHOT_FORMAT = 3  # 3: the view is one record of each odd slot (issue 60)
_LENGTHS = 8  # a row starts with its text's and its code's lengths in characters (two uint32)
CODE_BYTES = 256


def bounded(data: TextData, bound: int, seed: int) -> TextData:
    """The records of ``data`` a node with ``max-records`` = ``bound`` serves, at most ``bound`` of
    them (in file order). Each record is hashed, keyed by the node's secret ``seed``, by its own code
    and text, to one of ``bound`` slots; a slot holding an odd number of records serves one of them
    (the one whose keyed priority is highest), a slot holding an even number serves none.

    Why (issue 60): before, a file above the bound was cut to a uniform subsample of exactly the
    bound, so one added record pushed another out with probability about 1 - bound/(N + 1): a
    substitution, while every release is calibrated for one record added or removed (a profile
    stated (2, 1e-5) was really epsilon 2.94 under it). Here adding a record changes the view by at
    most one record, at any size and wherever it sits: only its slot changes, and its count's parity
    flips, so the slot goes from serving one record to none, or from none to one. Removing a record
    is the same read backwards. So every release's add/remove sensitivity holds for the view
    (docs/privacy.md#the-view proves it, and why no rule can keep a whole file below the bound).

    What it costs: ``view_retention``: about 91% of a file a tenth of its bound, 43% of one as
    large, and about bound/2 records of any file far above it."""
    if bound < 1:
        raise ValueError(f"max-records = {bound}: must be >= 1")
    slots: dict[int, list[tuple[int, int]]] = {}
    for i, (text, code) in enumerate(zip(data.texts, data.codes)):
        slot, priority = _keyed(seed, text, code, bound)
        slots.setdefault(slot, []).append((priority, i))
    # max() picks by priority alone between records of equal content (equal priority), by position:
    # they are the same record, so which copy is served changes no release
    keep = sorted(max(held)[1] for held in slots.values() if len(held) % 2 == 1)
    return data.subset(keep)


def view_retention(records: int, bound: int) -> float:
    """The expected share of a file's ``records`` (N) that ``bound`` (M) slots serve: a slot's count
    is odd with probability (1 - (1 - 2/M)^N) / 2, so M (1 - (1 - 2/M)^N) / (2 N) of the records."""
    if records < 1:
        return 1.0
    return bound * (1.0 - (1.0 - 2.0 / bound) ** records) / (2.0 * records)


def _keyed(seed: int, text: str, code: str, bound: int) -> tuple[int, int]:
    """(slot, priority) of a record: keyed by the node's secret, so the server cannot place two
    records in one slot on purpose; by the record's own content, so no other record, nor its
    position in the file, decides where it goes."""
    key = int(seed).to_bytes(16, "little") if 0 <= int(seed) < 1 << 128 else str(seed).encode()[-64:]
    digest = hashlib.blake2b(json.dumps([code, text], ensure_ascii=False).encode("utf-8", "replace"),
                             key=key, digest_size=16).digest()
    return int.from_bytes(digest[:8], "little") % bound, int.from_bytes(digest[8:], "little")


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
    write_stamped(path, head, bytes(body))


def read_snapshot(path: str | Path, stamp: dict[str, Any]) -> tuple[TextData, str] | None:
    """(the records, their fingerprint) of the snapshot at ``path`` when it was written for
    ``stamp``, else None (missing, stale or damaged: the caller builds it again). Every row is
    read and decoded, records or not, so the work is the bound's."""
    found = read_stamped(path, SNAPSHOT_FORMAT, stamp)
    if found is None:
        return None
    head, body = found
    fields: list[Any] = [head.get(k) for k in ("rows", "text-bytes", "code-bytes", "records")]  # checked below
    rows, text_bytes, code_bytes, records = fields
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
