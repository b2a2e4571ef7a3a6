"""Test-wide settings: offline hub access, and the markers for the long tests."""

import logging
import os

import pytest

# These machines reach only package registries: never try the Hugging Face hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def pytest_configure(config):
    # Deselect with `-m "not slow and not flwr"` for a quick run (about two minutes).
    config.addinivalue_line("markers", "slow: loads real model weights; takes tens of seconds")
    config.addinivalue_line("markers", "flwr: starts a real local SuperLink with `flwr run` (minutes)")
    config.addinivalue_line("markers", "gpu: runs on CUDA; skipped where torch sees no GPU (`pytest -m gpu`)")


@pytest.fixture(autouse=True)
def _flower_logs_reach_caplog():
    """The apps stop Flower's logger propagating to the root (``common.logs.plain_console``:
    a library's root handler printed each line twice); pytest's ``caplog`` listens on the root."""
    flwr_logger = logging.getLogger("flwr")
    before, flwr_logger.propagate = flwr_logger.propagate, True
    yield
    flwr_logger.propagate = before
