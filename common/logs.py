"""One logger for fedsyn, routed through Flower's so messages show in ``flwr run --stream``."""

from __future__ import annotations

import logging


def get_logger(name: str) -> logging.Logger:
    """A logger under Flower's ``flwr`` logger: it inherits Flower's handlers and format
    (server log stream, Ray actor output) instead of needing a setup of its own."""
    return logging.getLogger("flwr").getChild(name.replace("flwr.", ""))
