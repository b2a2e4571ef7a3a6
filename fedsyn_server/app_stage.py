"""The app's files as ``flwr run`` packages them, copied into a folder of their own.

Flower builds a run's FAB by listing every file under the app folder and filtering the list
afterwards (``flwr.cli.utils.collect_files``, then ``filter_paths_for_publish``). With the
virtual environment inside the project (the README's ``.venv``: about 70,000 files) that walk
is about 6 s of every ``flwr run`` on 2 cores, before the run starts. Here the folders whose
every file Flower would drop are never entered (its own exclusions, ``.venv/``, ``.flwr/``,
``__pycache__/``, and the folders the app's ``.gitignore`` ignores), the files found go through
Flower's own filter, and ``flwr run`` is pointed at a copy of just those files: the FAB built
from the copy is byte for byte the one built from the app folder (same hash, so a node's FAB
gate sees the same app). ``tests/test_app_stage.py`` checks the file list against Flower's walk.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

# Flower's APP_PUBLISH_EXCLUDE_PATTERNS drop these folders whole (``.venv/**`` and ``.flwr/**``
# at the top, ``**/__pycache__/**`` anywhere).
_TOP_EXCLUDED = frozenset({".venv", ".flwr"})
_ANY_EXCLUDED = frozenset({"__pycache__"})


def app_files(app: Path) -> dict[str, Path]:
    """The files Flower would put in ``app``'s FAB before its include/exclude keys in
    ``[tool.flwr.app]``: relative POSIX path -> absolute path. In: an app folder (with its
    pyproject.toml). Symlinks are skipped, as Flower skips them."""
    from flwr.cli.utils import build_pathspec, filter_paths_for_publish, load_gitignore_patterns

    root = app.expanduser().resolve()
    gitignore = root / ".gitignore"
    patterns = load_gitignore_patterns(gitignore.read_bytes() if gitignore.is_file() else b"")
    # A negated pattern can bring back a file below an ignored folder in Flower's filter (it
    # matches file paths, not git's folder rule): then every folder is walked, as Flower does.
    ignored = build_pathspec(patterns) if not any(p.startswith("!") for p in patterns) else None
    found: dict[str, Path] = {}
    for folder, subfolders, names in os.walk(root, followlinks=False):
        rel = Path(folder).relative_to(root)
        subfolders[:] = [d for d in subfolders if not _dropped(rel / d, ignored)]
        for name in names:
            path = Path(folder) / name
            if not path.is_symlink():
                found[(rel / name).as_posix()] = path
    return {k: Path(v) for k, v in filter_paths_for_publish(found).items()}  # type: ignore[arg-type]  # flwr keeps the values it is given: our Paths


def _dropped(folder: Path, ignored) -> bool:
    """Whether every file below ``folder`` (relative to the app) is one Flower drops."""
    if folder.name in _ANY_EXCLUDED or (len(folder.parts) == 1 and folder.name in _TOP_EXCLUDED):
        return True
    return ignored is not None and ignored.match_file(folder.as_posix() + "/")


def with_staged_app(flwr_args: list[str], scratch: Path) -> list[str]:
    """``flwr run``'s arguments with its app folder replaced by a staged copy in ``scratch``
    (``staged_app``); unchanged when the app is not a folder with a pyproject.toml (an app id,
    or a path ``flwr run`` itself will refuse with its own message)."""
    from fedsyn_server.flwr_args import app_dir, with_app

    app = app_dir(flwr_args)
    return with_app(flwr_args, staged_app(app, scratch)) if (app / "pyproject.toml").is_file() else list(flwr_args)


def staged_app(app: Path, into: Path) -> Path:
    """Copy ``app``'s FAB files (``app_files``) into ``into/app`` and return that folder, for
    ``flwr run`` to package in place of ``app``. ``into`` is the caller's scratch folder (it
    removes it after the run)."""
    stage = into / "app"
    for rel, src in app_files(app).items():
        dst = stage / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, dst)
    return stage
