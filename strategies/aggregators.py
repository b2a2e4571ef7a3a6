"""Plug-in point 1: the phase-1 aggregator, any Flower message-API strategy.

``build_aggregator("fedavg", ...)`` gives Flower's ``FedAvg`` set up for fedsyn: train
on every strong node each round (not Flower's default minimum of 2 nodes, which would
wait forever with one strong node), no federated evaluation, uniform weights (A.3).
A class path (``mypkg.strategies:MyStrategy``) plugs in any other strategy; the
keyword arguments it accepts among the ones below are passed. The names live in
``common.plugins.AGGREGATORS``.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from flwr.serverapp.strategy import FedAvg, FedAvgM, Strategy

from common.plugins import AGGREGATORS, load_class
from common.records import ARRAYS, CONFIG, WEIGHT_KEY


def build_aggregator(name: str, server_learning_rate: float, num_strong: int) -> Strategy:
    """A Flower strategy that aggregates phase-1 replies from ``num_strong`` strong nodes.

    Paper A.3's server step is theta <- theta + eta * Delta. FedAvg is that at eta = 1;
    for ``fedavg`` with eta != 1 this returns ``FedAvgM(server_learning_rate=eta,
    server_momentum=0)``, which is exactly that step. FedOpt variants take eta as ``eta``.
    """
    cls = load_class(name, AGGREGATORS, "aggregator", Strategy)
    if cls is FedAvg and server_learning_rate != 1.0:
        cls = FedAvgM
    n = max(1, num_strong)
    kwargs: dict[str, Any] = {
        "fraction_train": 1.0, "fraction_evaluate": 0.0, "min_train_nodes": n, "min_evaluate_nodes": 0,
        "min_available_nodes": n, "weighted_by_key": WEIGHT_KEY, "arrayrecord_key": ARRAYS,
        "configrecord_key": CONFIG, "server_learning_rate": server_learning_rate, "eta": server_learning_rate,
    }
    params = inspect.signature(cls.__init__).parameters  # type: ignore[misc]  # the class's own constructor, never an instance's
    with _without(_NO_EVALUATION):
        return cls(**{k: v for k, v in kwargs.items() if k in params})


# Flower warns that federated evaluation is off each time a strategy is built; fedsyn turns it
# off on purpose (a loss on private data would be an un-noised statistic), so the warning is
# one a user cannot act on, and it came three times per run.
_NO_EVALUATION = "fraction_evaluate is set to 0.0"


@contextmanager
def _without(message: str) -> Iterator[None]:
    """Drop Flower log records that start with ``message`` while the block runs."""
    flwr_logger = logging.getLogger("flwr")

    def keep(record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(message)

    flwr_logger.addFilter(keep)
    try:
        yield
    finally:
        flwr_logger.removeFilter(keep)

