"""A quiet, honest console: no escape codes where no terminal reads them."""

from __future__ import annotations

import logging

from flwr.supercore.logger import ConsoleHandler

from common.logs import get_logger, plain_console


def _flower_console() -> ConsoleHandler:
    return next(h for h in logging.getLogger("flwr").handlers if isinstance(h, ConsoleHandler))


def test_flower_console_colours_only_on_a_terminal(monkeypatch):
    handler = _flower_console()
    monkeypatch.setattr(handler, "colored", True)
    monkeypatch.setattr("sys.stderr.isatty", lambda: False)
    assert plain_console() is False and handler.colored is False
    record = get_logger("fedsyn").makeRecord("flwr.fedsyn", logging.WARNING, __file__, 1, "a line", (), None)
    assert "\033[" not in handler.format(record)
    monkeypatch.setattr("sys.stderr.isatty", lambda: True)
    monkeypatch.delenv("NO_COLOR", raising=False)
    assert plain_console() is True and "\033[" in handler.format(record)
    monkeypatch.setenv("NO_COLOR", "1")
    assert plain_console() is False


def test_each_line_once_and_no_ray_colours_off_a_terminal(monkeypatch):
    """Opacus adds a root handler on import; Flower's logger must not hand its lines to it too."""
    import opacus  # noqa: F401 - installs its root handler (logging.basicConfig)

    monkeypatch.setattr("sys.stderr.isatty", lambda: False)
    monkeypatch.setenv("RAY_COLOR_PREFIX", "1")  # undone after the test
    flwr_logger = logging.getLogger("flwr")
    monkeypatch.setattr(flwr_logger, "propagate", True)
    plain_console()
    assert flwr_logger.propagate is False
    assert __import__("os").environ["RAY_COLOR_PREFIX"] == "0"


def test_a_warning_nobody_can_act_on_is_dropped(monkeypatch):
    import warnings

    monkeypatch.setenv("RAY_COLOR_PREFIX", "1")
    monkeypatch.setattr(logging.getLogger("flwr"), "propagate", True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plain_console()
        warnings.warn("Tip: In future versions of Ray, Ray will no longer override ...", FutureWarning)
        warnings.warn("a warning someone can act on", UserWarning)
    assert [str(w.message) for w in caught] == ["a warning someone can act on"]
