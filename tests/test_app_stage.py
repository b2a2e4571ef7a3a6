"""Issue 61: `flwr run` packages a copy of the app's files, not the project folder with its venv.

Flower lists every file under the app folder before filtering (≈ 6 s of each run with the
README's `.venv` inside the project). The stage must hold exactly the files Flower's own walk
and filter keep, so the FAB, and its hash that a node's FAB gate checks, do not change.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from flwr.cli.build import build_fab_from_disk
from flwr.cli.utils import collect_files, filter_paths_for_publish

from fedsyn_server.app_stage import app_files, staged_app
from fedsyn_server.flwr_args import with_app

APP = Path(__file__).resolve().parents[1]


def _toy_app(root: Path, gitignore: str) -> Path:
    (root / "pkg").mkdir(parents=True)
    (root / "pyproject.toml").write_bytes((APP / "pyproject.toml").read_bytes())
    (root / ".gitignore").write_text(gitignore)
    (root / "pkg" / "a.py").write_text("A = 1\n")
    (root / "pkg" / "notes.md").write_text("kept\n")
    for junk in (".venv/lib/x.py", "pkg/__pycache__/a.py", "outputs/run/metrics.json", ".flwr/c.toml",
                 "deep/.venv/kept.py", "results/keep.json"):
        (root / junk).parent.mkdir(parents=True, exist_ok=True)
        (root / junk).write_text("{}\n")
    (root / "pkg" / "link.py").symlink_to(root / "pkg" / "a.py")
    return root


def _flowers_files(root: Path) -> set[str]:
    return set(filter_paths_for_publish(collect_files(root.resolve())))


def test_the_stage_holds_what_flowers_walk_keeps_and_the_same_fab(tmp_path):
    app = _toy_app(tmp_path / "app", "outputs/\n__pycache__/\n")
    assert set(app_files(app)) == _flowers_files(app) >= {"pkg/a.py", "deep/.venv/kept.py", "results/keep.json"}
    assert not {"pkg/link.py", ".venv/lib/x.py", "outputs/run/metrics.json"} & set(app_files(app))
    stage = staged_app(app, tmp_path / "scratch")
    assert build_fab_from_disk(stage) == build_fab_from_disk(app)
    # a negated pattern can keep a file below an ignored folder: then nothing is pruned
    app2 = _toy_app(tmp_path / "app2", "outputs/\n!outputs/run/metrics.json\n")
    assert set(app_files(app2)) == _flowers_files(app2)


def test_this_project_staged_is_the_fab_flower_builds_from_it(tmp_path):
    """The real project (with its venv, if it is inside): same files, same FAB hash."""
    assert set(app_files(APP)) == _flowers_files(APP)
    staged = build_fab_from_disk(staged_app(APP, tmp_path))
    assert hashlib.sha256(staged).hexdigest() == hashlib.sha256(build_fab_from_disk(APP)).hexdigest()


def test_the_app_argument_is_replaced_or_added():
    assert with_app([".", "--stream"], Path("/s")) == ["/s", "--stream"]
    assert with_app(["--run-config", "a=1", "proj", "remote"], Path("/s")) == ["--run-config", "a=1", "/s", "remote"]
    assert with_app(["--stream"], Path("/s")) == ["/s", "--stream"]
