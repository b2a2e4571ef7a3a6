"""The front door: outputs and data paths are where the user is, and `latest` finds the newest run."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

from common.io import atomic_symlink
from fedsyn_server.flwr_args import app_dir, effective_run_config, with_absolute_paths

APP = Path(__file__).resolve().parents[1]


def _last_pairs(args: list[str]) -> str:
    assert args[-2] == "--run-config"
    return args[-1]


def test_flwr_args_app_folder_and_effective_config():
    assert app_dir([".", "--stream"]) == Path(".")
    assert app_dir(["--run-config", "a=1", "--federation-config", "x=1", "proj", "remote"]) == Path("proj")
    assert app_dir(["--stream"]) == Path(".")
    cfg = effective_run_config([str(APP), "--run-config", 'epsilon=4.0 out-dir="runs"'])
    assert cfg["epsilon"] == 4.0 and cfg["out-dir"] == "runs" and cfg["model"] == "smollm2-135m"  # defaults kept


def test_default_out_dir_becomes_the_users_directory(tmp_path):
    args = with_absolute_paths([str(APP), "--stream"], tmp_path, tmp_path)
    assert args[:2] == [str(APP), "--stream"]
    assert _last_pairs(args) == f'out-dir="{tmp_path / "outputs"}"'  # pyproject's relative default


def test_relative_data_file_and_resume_resolved_but_names_and_absolute_paths_kept(tmp_path):
    args = [str(APP), "--run-config", 'dataset="data/notes.csv" resume="outputs/r1" out-dir="/abs/out"']
    pairs = _last_pairs(with_absolute_paths(args, tmp_path, tmp_path))
    assert f'dataset="{tmp_path / "data/notes.csv"}"' in pairs and f'resume="{tmp_path / "outputs/r1"}"' in pairs
    assert "out-dir" not in pairs  # already absolute
    for name in ("bbc-news", "someone/some-dataset"):  # the packaged data set and a hub id are not paths
        args = [str(APP), "--run-config", f'dataset="{name}" out-dir="/abs/out"']
        assert with_absolute_paths(args, tmp_path, tmp_path) == args


def test_a_toml_run_config_is_copied_with_absolute_paths(tmp_path):
    user = tmp_path / "mine.toml"
    user.write_text('epsilon = 4.0\ndataset = "notes.jsonl"\n')
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    args = with_absolute_paths([str(APP), "--run-config", str(user)], tmp_path, scratch)
    copy = Path(args[2])
    assert copy.parent == scratch and len(args) == 3  # Flower takes no pairs beside a TOML file
    merged = tomllib.loads(copy.read_text())
    assert merged == {"epsilon": 4.0, "dataset": str(tmp_path / "notes.jsonl"), "out-dir": str(tmp_path / "outputs")}
    assert user.read_text() == 'epsilon = 4.0\ndataset = "notes.jsonl"\n'  # the user's file is untouched


def test_fedsyn_run_dry_run_anywhere_prints_absolute_paths(tmp_path):
    """`fedsyn run . --dry-run` is dry too (argparse gave it to flwr before)."""
    for argv in (["run", "--dry-run", str(APP)], ["run", str(APP), "--dry-run"]):
        out = subprocess.run([sys.executable, "-m", "fedsyn_server.cli", *argv], cwd=tmp_path, capture_output=True,
                             text=True, timeout=120, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
        assert out.returncode == 0, out.stderr
        command = out.stdout.strip().splitlines()[-1]
        assert "--dry-run" not in command and f'out-dir="{tmp_path / "outputs"}"' in command


def test_server_resolves_relative_paths_in_its_working_directory_and_links_latest(tmp_path, monkeypatch):
    from common.config import RunConfig
    from fedsyn_server.server_app import LATEST, run_directory

    monkeypatch.chdir(tmp_path)
    cfg = RunConfig.from_flower({"out-dir": "outputs", "run-name": "first"})
    run_dir = run_directory(cfg, 7)
    assert run_dir == tmp_path / "outputs" / "first"
    for name in ("first", "second"):
        (tmp_path / "outputs" / name).mkdir(parents=True)
        atomic_symlink(tmp_path / "outputs" / LATEST, name)
        assert (tmp_path / "outputs" / LATEST).resolve() == tmp_path / "outputs" / name
    assert sorted(p.name for p in (tmp_path / "outputs").iterdir()) == ["first", "latest", "second"]  # no temp left
