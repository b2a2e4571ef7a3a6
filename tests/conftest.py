def pytest_configure(config):
    # Deselect with `-m "not slow"`: these load the real SmolLM2 (tens of seconds on 2 cores).
    config.addinivalue_line("markers", "slow: loads real model weights; takes tens of seconds")
    config.addinivalue_line("markers", "flwr: starts a real local SuperLink with `flwr run` (minutes)")
