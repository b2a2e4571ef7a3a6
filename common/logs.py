"""One logger for fedsyn, routed through Flower's so messages show in ``flwr run --stream``."""

from __future__ import annotations

import logging
import os
import sys


def get_logger(name: str) -> logging.Logger:
    """A logger under Flower's ``flwr`` logger: it inherits Flower's handlers and format
    (server log stream, Ray actor output) instead of needing a setup of its own."""
    return logging.getLogger("flwr").getChild(name.replace("flwr.", ""))


def plain_console() -> bool:
    """Turn off the ANSI colours of Flower's console handler unless this process writes to a
    terminal (and ``NO_COLOR`` is unset); returns whether colours stay on.

    Flower colours every level name. A ServerApp or ClientApp never writes to a terminal itself:
    its lines are streamed to ``flwr run --stream`` or land in log files (``flwr-run.log``, the
    experiment's cell logs, a SuperNode's journal), where escape codes are noise.
    """
    from flwr.common.logger import update_console_handler

    colored = sys.stderr.isatty() and "NO_COLOR" not in os.environ
    update_console_handler(colored=colored)
    return colored
