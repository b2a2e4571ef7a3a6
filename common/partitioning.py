"""Held-out splits and simulated nodes, for simulations on public benchmark data.

- ``train_test_split``: stratified held-out test split (no node trains on it).
- ``partition`` / ``parse_partitioning``: simulated nodes (``iid``, ``dirichlet:<alpha>``,
  and the paper's non-IID ``strong-codes:<code>,...``) with flwr-datasets partitioners.

Heavy libraries (``datasets``, ``flwr_datasets``, ``scikit-learn``) are imported inside the
functions that need them: a weak node that only reads its CSV should not pay for them.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence

import numpy as np

from common.codes import parse_code
from common.data import CODE_FIELD, TextData
from common.dp import STRONG, TIERS, WEAK
from common.logs import get_logger

logger = get_logger(__name__)

PARTITIONING_FORMS = "'iid', 'dirichlet:<alpha>' with alpha > 0, 'strong-codes:<code>,<code>,...'"


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
        parts: list[list[int]] = _iid_split(list(range(len(data))), num_partitions, seed, what="records")
    elif kind == "dirichlet":
        parts = _dirichlet_split(data.codes, num_partitions, float(argument), seed)  # type: ignore[arg-type]  # parse_partitioning's alpha: a float
    else:
        vocab = sorted(set(data.codes)) if vocabulary is None else list(vocabulary)
        strong_codes = set(resolve_codes(argument, vocab))  # type: ignore[arg-type]  # parse_partitioning's codes: a list of str
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
        parts = [[] for _ in range(num_partitions)]
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
