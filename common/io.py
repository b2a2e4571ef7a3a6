"""Atomic file writes: a reader (or a crash) never sees a half-written output."""

from __future__ import annotations

import csv
import io
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any


def _atomic_write(path: str | Path, write: Callable[[IO[Any]], Any], binary: bool = False) -> Path:
    """Call ``write(handle)`` on a temp file in ``path``'s folder, fsync it, then ``os.replace``
    it onto ``path``; on any failure the temp file is removed and ``path`` is untouched."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") if binary else os.fdopen(fd, "w", encoding="utf-8") as fh:
            write(fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def folder_write_problem(folder: str | Path) -> str:
    """Why this process cannot create ``folder`` (with its parents) and write a file in it (the
    error and the user), or "" when it can. The check is the write itself (a probe file, removed):
    permission bits, ACLs, read-only mounts and full disks all say no only then."""
    try:
        Path(folder).mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".write-check-"):
            pass
    except OSError as err:
        import pwd

        return f"{err.strerror or err}, as user {pwd.getpwuid(os.geteuid()).pw_name}"
    return ""


def atomic_write_bytes(path: str | Path, data: bytes) -> Path:
    """Write ``data`` to ``path`` atomically (temp file in the same folder, mode 0600, then rename)."""
    return _atomic_write(path, lambda f: f.write(data), binary=True)


def write_stamped(path: str | Path, head: dict[str, Any], body: bytes) -> Path:
    """Write ``head`` (JSON, one line) then ``body`` to ``path``, atomically, mode 0600: a node's
    state file whose head says what it was built from (``read_stamped``)."""
    return atomic_write_bytes(path, json.dumps(head, sort_keys=True).encode("utf-8") + b"\n" + body)


def read_stamped(path: str | Path, fmt: int, stamp: dict[str, Any]) -> tuple[dict[str, Any], bytes] | None:
    """(head, body) of a file ``write_stamped`` wrote with format ``fmt`` for ``stamp``; None when it
    is missing, unreadable, of another format or written for another stamp (the caller rebuilds)."""
    try:
        line, _, body = Path(path).read_bytes().partition(b"\n")
        head = json.loads(line)
    except (OSError, ValueError):
        return None
    if not isinstance(head, dict) or head.get("format") != fmt or head.get("stamp") != stamp:
        return None
    return head, body


def stamp_of(path: str | Path) -> dict[str, Any] | None:
    """The ``stamp`` in the head of a file ``write_stamped`` wrote (its first line only: the body is
    not read), or None when it is missing, unreadable or not such a file."""
    try:
        with Path(path).open("rb") as fh:
            head = json.loads(fh.readline())
    except (OSError, ValueError):
        return None
    stamp = head.get("stamp") if isinstance(head, dict) else None
    return stamp if isinstance(stamp, dict) else None


def prune_stamped(folder: str | Path, pattern: str, keep: Path, superseded: Callable[[dict[str, Any]], bool]
                  ) -> list[Path]:
    """Remove the files of ``folder`` matching ``pattern`` (``write_stamped``'s), other than ``keep``,
    whose stamp ``superseded`` says ``keep`` replaces; files it cannot read or whose stamp is another
    owner's are left. Returns the paths removed. A reader that opened one before keeps its data (POSIX
    unlinks the name, not the open file); a removal that fails is left for the next prune."""
    removed = []
    for path in sorted(Path(folder).glob(pattern)):
        if path == keep or path.name.startswith("."):
            continue
        stamp = stamp_of(path)
        if stamp is not None and superseded(stamp):
            try:
                path.unlink()
            except OSError:
                continue
            removed.append(path)
    return removed


def atomic_write_text(path: str | Path, text: str) -> Path:
    """Write ``text`` to ``path`` via a temp file in the same folder and ``os.replace``."""
    return _atomic_write(path, lambda fh: fh.write(text))


@contextmanager
def atomic_folder(target: str | Path) -> Iterator[Path]:
    """Yield an empty temp folder beside ``target``; when the block ends, it replaces ``target``
    whole (an older one is removed just before the rename). On any failure the temp folder is
    removed and ``target`` is untouched, so a reader never finds a half-written folder."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}."))
    try:
        yield tmp
        if target.exists():
            shutil.rmtree(target)
        tmp.rename(target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def atomic_symlink(link: str | Path, target: str | Path) -> Path:
    """Point ``link`` at ``target`` (kept as given, e.g. a name relative to ``link``'s folder),
    replacing an older link by one rename, so a reader finds the old or the new one, never none."""
    link = Path(link)
    link.parent.mkdir(parents=True, exist_ok=True)
    tmp = link.with_name(f".{link.name}.{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)
    os.symlink(target, tmp)
    try:
        os.replace(tmp, link)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return link


def atomic_write_npz(path: str | Path, arrays: dict[str, Any]) -> Path:
    """Write named arrays as an ``.npz`` file, atomically (temp file, then ``os.replace``)."""
    import numpy as np

    return _atomic_write(path, lambda fh: np.savez(fh, **arrays), binary=True)


def atomic_write_json(path: str | Path, obj: Any) -> Path:
    """Write ``obj`` as indented JSON, atomically (non-finite floats become strings)."""
    return atomic_write_text(path, json.dumps(jsonable(obj), indent=2, sort_keys=False) + "\n")


# Line breaks that JSON leaves unescaped outside ASCII but ``str.splitlines`` (and some
# JSONL readers) split on: generated text does contain U+2028 (seen in SmolLM2 output).
_UNSAFE_IN_LINES = str.maketrans({"\u0085": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def jsonl_line(obj: Any) -> str:
    """One JSON object as a single line (no trailing newline): UTF-8 text kept readable,
    only the Unicode line separators escaped so no reader sees the record split."""
    return json.dumps(jsonable(obj), ensure_ascii=False).translate(_UNSAFE_IN_LINES)


def atomic_write_jsonl(path: str | Path, rows: Iterable[dict]) -> Path:
    """Write one JSON object per line, atomically; loadable with ``datasets.load_dataset("json")``."""
    return atomic_write_text(path, "".join(jsonl_line(r) + "\n" for r in rows))


def atomic_write_csv(path: str | Path, rows: Iterable[dict], fieldnames: list[str]) -> Path:
    """Write ``rows`` (dicts keyed by ``fieldnames``; missing keys left empty) as CSV with a
    header line, atomically."""
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=fieldnames, lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    return atomic_write_text(path, buf.getvalue())


def atomic_write_frame(path: str | Path, frame: Any) -> Path:
    """Write a pandas DataFrame as ``.parquet`` or ``.csv`` (by ``path``'s suffix), atomically."""
    if Path(path).suffix == ".parquet":
        return _atomic_write(path, lambda fh: frame.to_parquet(fh, index=False), binary=True)
    return atomic_write_text(path, frame.to_csv(index=False))


def read_jsonl(path: str | Path) -> list[Any]:
    """The objects of a JSONL file, one per non-empty line. Lines are split on ``\\n`` only
    (not ``str.splitlines``), so files whose text holds a raw U+2028 still read correctly.
    Raises ValueError naming the file and line for a line that is not JSON."""
    with open(path, encoding="utf-8", newline="") as fh:
        lines = fh.read().split("\n")
    rows = []
    for number, line in enumerate(lines, start=1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}: line {number} is not JSON ({err})") from err
    return rows


def read_json(path: str | Path) -> Any:
    """Read a JSON file written by ``atomic_write_json``."""
    return json.loads(Path(path).read_text(encoding="utf-8"))


def jsonable(obj: Any) -> Any:
    """``obj`` with every non-finite float written as a string ("inf", "nan") and arrays as lists:
    JSON has no inf/nan, and "inf" keeps epsilon = inf readable in reports."""
    if isinstance(obj, float) and (obj != obj or obj in (float("inf"), float("-inf"))):
        return str(obj)
    if isinstance(obj, dict):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [jsonable(v) for v in obj]
    if hasattr(obj, "item") and callable(obj.item) and getattr(obj, "ndim", 1) == 0:
        return jsonable(obj.item())
    if hasattr(obj, "tolist"):
        return jsonable(obj.tolist())
    return obj
