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
    config.addinivalue_line("markers", "session(covered_by): a multi-process check another test already covers; "
                                       "skipped in CI's run for its time, run in a developer's session with "
                                       "`pytest -m session` (docs/testing.md)")


def pytest_collection_modifyitems(config, items):
    # CI's budget is 45 minutes on two cores: the checks below repeat, through real processes, what
    # another test covers, and each developers' session runs them (`-m session`, or FEDSYN_ALL_TESTS=1).
    if "session" in (config.getoption("-m") or "") or os.environ.get("FEDSYN_ALL_TESTS") == "1":
        return
    for item in items:
        mark = item.get_closest_marker("session")
        if mark is not None:
            covered = mark.kwargs.get("covered_by", "")
            item.add_marker(pytest.mark.skip(reason=f"session-only (covered in CI by {covered}); "
                                                    "run: pytest -m session"))


@pytest.fixture(autouse=True)
def _flower_logs_reach_caplog():
    """The apps stop Flower's logger propagating to the root (``common.logs.plain_console``:
    a library's root handler printed each line twice); pytest's ``caplog`` listens on the root."""
    flwr_logger = logging.getLogger("flwr")
    before, flwr_logger.propagate = flwr_logger.propagate, True
    yield
    flwr_logger.propagate = before
