"""Who is who in a simulation: node tiers and each node's share of the benchmark data.

The server and every simulated node derive the same public facts from the run config
alone (vocabulary, held-out test split, tiers, partitions), deterministically, so no
data or assignment has to travel. In deployment none of this is used: a node's tier
and data come from its node config.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

from common.config import RunConfig
from common.data import TextData, code_vocabulary, schema_vocabulary, table_text_data, to_text_data
from common.dp import STRONG, WEAK
from common.partitioning import partition, train_test_split
from common.tables import load_table


def simulation_tiers(num_nodes: int, strong_fraction: float) -> list[str]:
    """Tier of each partition id: the first ``round(f * N)`` are strong (at least 1 when f > 0)."""
    if num_nodes < 1:
        raise ValueError(f"need at least one node, got {num_nodes}")
    num_strong = 0 if strong_fraction <= 0 else min(num_nodes, max(1, math.floor(strong_fraction * num_nodes + 0.5)))
    return [STRONG] * num_strong + [WEAK] * (num_nodes - num_strong)


@dataclass(frozen=True)
class Benchmark:
    """The public view of a simulation's data: vocabulary and held-out test split."""

    vocabulary: list[str]
    train: TextData
    test: TextData


@lru_cache(maxsize=4)
def _benchmark(dataset: str, text_column: str, control_columns: tuple[str, ...],
               control_codes: tuple[str, ...], test_fraction: float, seed: int, table_schema: str) -> Benchmark:
    df = load_table(dataset)
    if table_schema:
        schema = RunConfig(table_schema=table_schema, control_columns=control_columns).schema()
        assert schema is not None  # a table-schema is given
        vocabulary = (code_vocabulary(df, list(control_columns), list(control_codes)) if control_codes
                      else schema_vocabulary(schema, control_columns))
        data = table_text_data(df, schema, control_columns, seed)
    else:
        vocabulary = code_vocabulary(df, list(control_columns), list(control_codes) or None)
        data = to_text_data(df, text_column, list(control_columns))
    train, test = train_test_split(data, test_fraction, seed)
    return Benchmark(vocabulary, train, test)


def benchmark(cfg: RunConfig) -> Benchmark:
    """Load (once per process) the configured dataset, its vocabulary and test split."""
    return _benchmark(cfg.dataset, cfg.text_column, cfg.control_columns, cfg.control_codes,
                      cfg.test_fraction, cfg.seed, cfg.table_schema)


@lru_cache(maxsize=8)
def _partitions(cfg: RunConfig, num_nodes: int) -> tuple[TextData, ...]:
    tiers = simulation_tiers(num_nodes, cfg.strong_fraction)
    bench = benchmark(cfg)
    return tuple(partition(bench.train, num_nodes, cfg.partitioning, tiers, cfg.seed, vocabulary=bench.vocabulary))


def simulation_node_data(cfg: RunConfig, partition_id: int, num_nodes: int) -> tuple[str, TextData]:
    """(tier, local training data) of simulated node ``partition_id`` out of ``num_nodes``."""
    if not 0 <= partition_id < num_nodes:
        raise ValueError(f"partition-id {partition_id} is not in [0, {num_nodes})")
    return simulation_tiers(num_nodes, cfg.strong_fraction)[partition_id], _partitions(cfg, num_nodes)[partition_id]
