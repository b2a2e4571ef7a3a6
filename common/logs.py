"""One logger for fedsyn, routed through Flower's so messages show in ``flwr run --stream``."""

from __future__ import annotations

import logging
import os
import sys
import warnings


def get_logger(name: str) -> logging.Logger:
    """A logger under Flower's ``flwr`` logger: it inherits Flower's handlers and format
    (server log stream, Ray actor output) instead of needing a setup of its own."""
    return logging.getLogger("flwr").getChild(name.replace("flwr.", ""))


def plain_console() -> bool:
    """Each log line once and, unless this process writes to a terminal (and ``NO_COLOR`` is
    unset), without ANSI colours; returns whether colours stay on.

    Flower colours every level name and Ray every actor's prefix. A ServerApp or ClientApp never
    writes to a terminal itself: its lines are streamed to ``flwr run --stream`` or land in log
    files (``flwr-run.log``, the experiment's cell logs, a SuperNode's journal), where escape
    codes are noise. Opacus configures the root logger when imported (``logging.basicConfig``),
    so every line of Flower's logger, which propagates to the root, was printed a second time.
    Warnings a user cannot act on are dropped.
    """
    from flwr.common.logger import update_console_handler

    colored = sys.stderr.isatty() and "NO_COLOR" not in os.environ
    update_console_handler(colored=colored)
    if not colored:
        os.environ["RAY_COLOR_PREFIX"] = "0"  # read by Ray's driver for each actor line it prints
    logging.getLogger("flwr").propagate = False  # Flower's own handler prints it; the root's would repeat it
    # Ray's tip about a future default for GPU visibility: fedsyn sets the resources itself (`fedsyn run`)
    warnings.filterwarnings("ignore", message="Tip: In future versions of Ray", category=FutureWarning)
    return colored
