"""Test-wide settings: offline hub access, and the markers for the long tests."""

import os

# These machines reach only package registries: never try the Hugging Face hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def pytest_configure(config):
    # Deselect with `-m "not slow and not flwr"` for a quick run (about two minutes).
    config.addinivalue_line("markers", "slow: loads real model weights; takes tens of seconds")
    config.addinivalue_line("markers", "flwr: starts a real local SuperLink with `flwr run` (minutes)")
    config.addinivalue_line("markers", "gpu: runs on CUDA; skipped where torch sees no GPU (`pytest -m gpu`)")
