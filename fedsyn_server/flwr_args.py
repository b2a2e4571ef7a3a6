"""What a ``flwr run`` command line means for this app: its folder, its run config, its paths.

``fedsyn run`` (and ``fedsyn plan``) take ``flwr run``'s own arguments. Flower resolves a
relative ``out-dir``, ``dataset`` or ``resume`` where the ServerApp and ClientApps run: the
directory the local SuperLink was started in, which is not always where the user is. This
module makes such paths absolute against the user's directory before ``flwr run`` sees them,
with Flower's own parser for ``--run-config`` (key=value pairs, or one TOML file).
"""

from __future__ import annotations

import json
import tomllib
from pathlib import Path
from typing import Any

from common.tables import names_a_file

RUN_CONFIG_FLAGS = ("--run-config", "-c")
OPTIONS_WITH_VALUE = ("--federation", "--federation-config", "--format", *RUN_CONFIG_FLAGS)
PATH_KEYS = ("out-dir", "resume", "dataset", "table-schema")


def positionals(args: list[str]) -> list[str]:
    """``flwr run``'s positional arguments in ``args`` (APP, then SUPERLINK): options and their values left out."""
    return [args[i] for i in _positional_at(args)]


def _positional_at(args: list[str]) -> list[int]:
    at, skip = [], False
    for i, arg in enumerate(args):
        if skip:
            skip = False
        elif arg in OPTIONS_WITH_VALUE:
            skip = True  # its value follows
        elif not arg.startswith("-"):
            at.append(i)
    return at


def app_dir(args: list[str]) -> Path:
    """The app folder ``flwr run`` would use: its first positional argument, else ``.``."""
    return Path(positionals(args)[0]) if positionals(args) else Path(".")


def with_app(args: list[str], app: Path) -> list[str]:
    """``args`` with ``app`` as ``flwr run``'s APP argument (in place of the one given, or first
    when none was: ``flwr run`` then took ``.``)."""
    at = _positional_at(args)
    return [str(app), *args] if not at else [*args[:at[0]], str(app), *args[at[0] + 1:]]


def connection_name(args: list[str]) -> str | None:
    """The SuperLink connection ``args`` name (the positional after the app folder), else None:
    ``flwr`` then uses the default one of ``$FLWR_HOME/config.toml``."""
    named = positionals(args)
    return named[1] if len(named) > 1 else None


def app_defaults(app: Path) -> dict[str, Any]:
    """``[tool.flwr.app.config]`` of ``app``'s pyproject.toml (empty when it has none)."""
    try:
        spec = tomllib.loads((app / "pyproject.toml").read_text())
    except (OSError, tomllib.TOMLDecodeError):
        return {}
    return dict(spec.get("tool", {}).get("flwr", {}).get("app", {}).get("config", {}))


def run_config_values(args: list[str]) -> tuple[list[int], list[str]]:
    """Positions (in ``args``) and values of every ``--run-config`` / ``-c`` given."""
    positions, values = [], []
    for i, arg in enumerate(args):
        if arg in RUN_CONFIG_FLAGS and i + 1 < len(args):
            positions.append(i + 1)
            values.append(args[i + 1])
        elif arg.startswith("--run-config="):
            positions.append(i)
            values.append(arg.split("=", 1)[1])
    return positions, values


def overrides(args: list[str]) -> dict[str, Any]:
    """The run-config overrides ``args`` give, parsed as Flower parses them (ValueError on bad syntax)."""
    from common.config import parse_pairs

    return parse_pairs(run_config_values(args)[1], "--run-config")


def effective_run_config(args: list[str]) -> dict[str, Any]:
    """The app's defaults with the command line's overrides on top: the run config Flower will send."""
    return {**app_defaults(app_dir(args)), **overrides(args)}


def relative_paths(config: dict[str, Any], cwd: Path) -> dict[str, str]:
    """``key -> absolute path`` for every path in ``config`` that is relative (``dataset`` only when
    it names a local file, not ``bbc-news`` or a hub id), and ``table-schema`` -> the one-line JSON
    of the file it names, or of its inline JSON written over several lines (the run config
    carries a schema inline: see ``common.config``)."""
    out = {}
    for key in PATH_KEYS:
        value = config.get(key)
        if not isinstance(value, str) or not value.strip():
            continue
        if key == "table-schema" and value.strip().startswith("{"):
            try:  # an inline schema on one line: key=value pairs cannot hold a line break
                one_line = json.dumps(json.loads(value), separators=(",", ":"))
            except ValueError:
                continue  # left as it is: the run config's check says what is wrong with it
            if one_line != value:
                out[key] = one_line
            continue
        if key == "dataset" and not names_a_file(value):
            continue  # a dataset name or hub id
        path = Path(value.strip()).expanduser()
        absolute = path if path.is_absolute() else (cwd / path).resolve()
        if key == "table-schema":  # sent inline: a node never reads a path the run config names
            try:
                out[key] = json.dumps(json.loads(absolute.read_text(encoding="utf-8")), separators=(",", ":"))
            except (OSError, ValueError):
                pass  # left as it is: the run config's check says what is wrong with it
        elif absolute != path:
            out[key] = str(absolute)
    return out


def with_absolute_paths(args: list[str], cwd: Path, scratch: Path) -> list[str]:
    """``args`` with every relative path of the run config made absolute against ``cwd``.

    Key=value overrides get one more ``--run-config`` after them; a TOML file given as
    ``--run-config`` (Flower takes no pairs beside it) is replaced by a copy with absolute
    paths, written into the folder ``scratch`` (the caller removes it after ``flwr run``).
    """
    import tomli_w

    fixed = relative_paths(effective_run_config(args), cwd)
    if not fixed:
        return list(args)
    args = list(args)
    positions, values = run_config_values(args)
    toml_at = [p for p, v in zip(positions, values) if v.strip().endswith(".toml")]
    if toml_at:
        pos = toml_at[0]
        value = args[pos].split("=", 1)[1] if args[pos].startswith("--run-config=") else args[pos]
        copy = scratch / Path(value).name
        copy.write_text(tomli_w.dumps({**tomllib.loads(Path(value).read_text()), **fixed}))
        args[pos] = f"--run-config={copy}" if args[pos].startswith("--run-config=") else str(copy)
        return args
    return args + ["--run-config", " ".join(f"{k}={toml_value(v)}" for k, v in fixed.items())]


def toml_value(v: object) -> str:
    """A Python value as a TOML literal that ``flwr run --run-config 'key=value ...'`` reads whole.

    Flower cuts the pairs with a pattern that ends a double-quoted value at its first ``"``, so a
    string holding ``"`` (an inline table schema's JSON) goes in single quotes (a TOML literal
    string). One holding both quote kinds, or a line break, cannot be a pair: put it in a TOML
    file (``--run-config file.toml``)."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v) if v == v and v not in (float("inf"), float("-inf")) else ("inf" if v > 0 else "-inf")
    text = str(v)
    if '"' not in text:
        return json.dumps(text)  # a JSON string is a valid TOML basic string (same escapes)
    if "'" in text or "\n" in text or "\r" in text:
        raise ValueError(f"a run-config value holding both quote kinds or a line break cannot be passed as "
                         f"key=value ({text[:60]!r}...); put it in a TOML file and pass --run-config file.toml")
    return f"'{text}'"
