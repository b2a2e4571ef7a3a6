"""A deployed node's records embedded once per snapshot (issue 61).

A vote compares the node's records with the server's candidates in an embedder's space. Embedding
the records is the vote's cost: under the node's public bound every vote embedded ``max-records``
rows padded to the vote window (issue 45), about 40 rows a second on two cores, so an hour per
vote at 100,000 records, paid again in every round of a run while the records had not changed
since the snapshot. So a deployed node keeps its view's embedding matrix in its state folder, one
per (snapshot, embedder, window, text column, bf16 or fp32), built by ``fedsyn node-check`` or by the first vote
that needs it, and rebuilt when the snapshot is.

The matrix is exactly ``max-records`` rows (the view's records in the snapshot's order, then zero
rows for the slots without a record), float32, so its size and the time to build, read and use it
are the bound's: the build embeds every slot padded to the window (``embed_slots``: records cut,
filler rows, ballast), a vote reads the whole file and gathers a fixed ``max-records`` rows from it
(``gathered``). Which matrix a vote may use is decided by its stamp, written in the file's first
line: the snapshot's stamp and fingerprint (a changed file is a new snapshot), the embedder's
identity (its name and where its weights live, with their sizes and times), the window, whether
the texts are a table's free-text column and whether they were embedded under bf16 autocast (the
run config's ``precision`` on this node's hardware). A matrix whose stamp differs is never read: it is built
again. By hand: no library keeps an embedding matrix keyed to a data snapshot.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from common.io import read_stamped, write_stamped
from common.logs import get_logger
from fedsyn_client import fixed_work

MATRIX_FORMAT = 1
EMBED_BATCH = 64  # common.models.embed's batch: the ballast is tokenized in batches as large
_CHUNK = 16 * EMBED_BATCH  # rows per progress step (and the first step times the estimate)
log = get_logger(__name__)


def matrix_path(state_dir: str | Path, snapshot: Path, embedder: str, window: int, free_text: bool,
                bf16: bool = False) -> Path:
    """Where the matrix of ``snapshot`` for (embedder, window, free_text, bf16 or not) lives: one
    file per combination, replaced in place when the snapshot changes (so stale matrices do not
    pile up)."""
    key = json.dumps([snapshot.name, embedder, int(window), bool(free_text)] + (["bf16"] if bf16 else []))
    return Path(state_dir) / f"emb-{hashlib.sha256(key.encode()).hexdigest()[:16]}.bin"


def read_matrix(path: str | Path, stamp: dict[str, Any]) -> np.ndarray | None:
    """The matrix at ``path`` (rows x dim, float32) when it was written for ``stamp``, else None
    (missing, stale, another embedder or window, damaged: the caller builds it again)."""
    found = read_stamped(path, MATRIX_FORMAT, stamp)
    if found is None:
        return None
    head, body = found
    rows: Any = head.get("rows")  # checked below
    dim: Any = head.get("dim")
    if not all(isinstance(v, int) and v >= 0 for v in (rows, dim)) or len(body) != rows * dim * 4:
        return None
    return np.frombuffer(body, dtype="<f4").reshape(rows, dim)


def write_matrix(path: str | Path, matrix: np.ndarray, stamp: dict[str, Any]) -> None:
    """Write ``matrix`` (rows x dim) for ``stamp``, mode 0600, whole or not at all."""
    matrix = np.ascontiguousarray(matrix, dtype="<f4")
    head = {"format": MATRIX_FORMAT, "stamp": stamp, "rows": int(matrix.shape[0]), "dim": int(matrix.shape[1])}
    write_stamped(path, head, matrix.tobytes())


def embed_slots(texts: Sequence[str], embedder: Any, window: int, bound: int,
                progress: bool | None = None, precision: str = "fp32") -> np.ndarray:
    """The ``bound`` x dim matrix of ``texts`` (at most ``bound``, the view's records): each cut to
    the window's bytes, the rows beyond them public filler, every row padded to the window, and the
    bytes the records fall short of tokenized as ballast (``fixed_work``); the filler's vectors are
    zeroed. The work is ``bound`` rows of ``window`` tokens, whatever the records. ``progress``: a
    bar over the rows (default: on a terminal), after a log line with the time it will take,
    measured on the first rows. ``precision``: the run config's (``common.models.embed``)."""
    from common.models import embed

    if len(texts) > bound:
        raise ValueError(f"{len(texts)} records above the bound {bound}")
    progress = sys.stderr.isatty() if progress is None else progress
    window = min(int(window), int(embedder.max_seq_length))
    limit = fixed_work.row_bytes(window)
    rows = [fixed_work.cut(t, limit) for t in texts]
    fixed_work.ballast(_tokenizer(embedder), rows, len(rows), limit, batch=EMBED_BATCH)
    rows += [fixed_work.filler(limit)] * (bound - len(rows))
    dim = _dimension(embedder)
    matrix = np.zeros((bound, dim), dtype=np.float32)
    started = time.perf_counter()
    bar = _bar(bound, progress)
    for start in range(0, bound, _CHUNK):
        chunk = rows[start:start + _CHUNK]
        matrix[start:start + len(chunk)] = embed(embedder, chunk, batch_size=EMBED_BATCH, max_tokens=window,
                                                 fixed_width=True, precision=precision)
        bar(len(chunk))
        if start == 0 and bound > _CHUNK:
            # the node's own log: an estimate from public numbers (rows, window) and this machine
            per_row = (time.perf_counter() - started) / len(chunk)
            log.info("embedding the node's %d rows at a window of %d tokens: about %.0f s", bound, window,
                     per_row * bound)
    matrix[len(texts):] = 0.0
    log.info("embedded the node's records as %d rows in %.0f s", bound, time.perf_counter() - started)
    return matrix


def gathered(matrix: np.ndarray, keep: np.ndarray) -> np.ndarray:
    """``matrix``'s rows ``keep`` (the records a vote reads, in order) followed by zero rows, as
    float64: always ``len(matrix)`` rows, gathered and masked over the whole bound so that the work
    does not follow how many records are kept."""
    rows = len(matrix)
    index = np.zeros(rows, dtype=np.int64)
    index[:len(keep)] = keep
    real = np.arange(rows) < len(keep)
    return np.where(real[:, None], matrix[index].astype(np.float64), 0.0)


def embedder_identity(name: str, embedder: Any) -> dict[str, Any]:
    """What decides an embedder's vectors, for a matrix's stamp: its name, where its weights are
    read from, those files' sizes and modification times, and the backend it runs on."""
    folder = _weights_folder(embedder)
    files: list[list[Any]] = []
    if folder is not None and folder.is_dir():
        for path in sorted(p for p in folder.rglob("*") if p.is_file()):
            stat = path.stat()
            files.append([str(path.relative_to(folder)), stat.st_size, stat.st_mtime_ns])
    digest = hashlib.sha256(json.dumps(files).encode()).hexdigest()[:16]
    backend = str(getattr(embedder, "backend", getattr(getattr(embedder, "inner", None), "backend", "torch")))
    return {"name": name, "type": type(embedder).__name__, "weights": str(folder or ""), "files": digest,
            "backend": backend}


def _weights_folder(embedder: Any) -> Path | None:
    inner = getattr(embedder, "inner", embedder)  # a wrapper's own model (common.sentiment_embedder)
    try:
        source = inner[0].auto_model.config._name_or_path
    except (AttributeError, IndexError, KeyError, TypeError):
        return None
    return Path(source) if source and Path(source).exists() else None


def _tokenizer(embedder: Any) -> Any:
    # a SentenceTransformer's own, or the inner model's of a wrapper (common.sentiment_embedder)
    return getattr(embedder, "tokenizer", None) or embedder.inner.tokenizer


def _dimension(embedder: Any) -> int:
    get = getattr(embedder, "get_embedding_dimension", None) or embedder.get_sentence_embedding_dimension
    return int(get())


def _bar(total: int, on: bool) -> Callable[[int], None]:
    if not on:
        return lambda n: None
    from tqdm.auto import tqdm

    bar = tqdm(total=total, unit="row", desc="embedding the node's records")

    def step(n: int) -> None:
        bar.update(n)
        if bar.n >= total:
            bar.close()

    return step
