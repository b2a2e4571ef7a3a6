"""``fedsyn node service`` (issue 64): the unit and environment file it writes, and what it refuses.

The unit run for real (its ExecStart, a node started, killed and stopped) is in tests/test_run_as.py;
here: the files without a node, on any machine.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from fedsyn_client.node_service import NodeService, env_file, unit_file, write_service

APP = Path(__file__).resolve().parents[1]
NASTY = 'tier="weak" data-path="/data/a b.csv" epsilon=8 note="it\'s $HOME `id` \\ ok"'


def _service(tmp_path: Path, **over) -> NodeService:
    allow = tmp_path / "allow-list.txt"
    allow.write_text("")
    return replace(NodeService(name="notes", superlink="link.example.org:9092", node_config=NASTY, allow_list=allow,
                               work=tmp_path / "work", flwr_bin=Path(sys.executable).parent,
                               start_script=APP / "deploy" / "start_node.sh", same_user=True), **over)


def test_the_environment_file_gives_each_setting_back_as_written(tmp_path):
    """systemd and the shell read a double-quoted value alike (a backslash escapes " \\ ` $ only):
    sourced by bash, every setting, a node config with quotes, $, backticks and a backslash, is back."""
    service = _service(tmp_path, port=9094, root_certificates=tmp_path / "ca.crt")
    env = tmp_path / "n.env"
    env.write_text(env_file(service))
    keys = list(service.environment())
    shown = subprocess.run(["bash", "-c", f'set -a; . "{env}"; ' + "; ".join(f'printf "%s\\0" "${k}"' for k in keys)],
                           capture_output=True, text=True, check=True, env={"PATH": "/usr/bin:/bin"})
    assert dict(zip(keys, shown.stdout.split("\0"), strict=False)) == service.environment()
    assert service.environment()["FEDSYN_NODE_CONFIG"] == NASTY


def test_the_unit_passes_only_the_settings_given_each_as_one_argument(tmp_path):
    unit = unit_file(_service(tmp_path), tmp_path / "n.env")
    exec_start = next(line for line in unit.splitlines() if line.startswith("ExecStart="))
    assert "--foreground" in exec_start and "--same-user" in exec_start
    assert "--node-config ${FEDSYN_NODE_CONFIG}" in exec_start and "--run-as" not in exec_start
    assert "--root-certificates" not in exec_start  # none given: the script's --insecure
    assert "Restart=on-failure" in unit.splitlines() and f"EnvironmentFile={tmp_path / 'n.env'}" in unit


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="no systemd-analyze here")
def test_systemd_analyze_verifies_the_unit(tmp_path):
    unit, env = write_service(_service(tmp_path), tmp_path / "etc")
    assert env.stat().st_mode & 0o077 == 0  # the node config names the data: the operator's to read
    verified = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, check=False)
    assert verified.returncode == 0 and not verified.stderr.strip(), verified.stderr


@pytest.mark.parametrize("over,said", [
    ({"same_user": False}, "choose how ClientApps run"),
    ({"run_as": "nobody"}, "choose how ClientApps run"),  # and --same-user too
    ({"name": "a b"}, "--name"),
    ({"same_user": False, "run_as": "no-such-user-fedsyn"}, "no such user"),
    ({"start_script": Path("deploy/start_node.sh")}, "absolute path"),
    ({"flwr_bin": Path("/nowhere/bin")}, "--flwr-bin"),
    ({"node_config": 'tier="weak"\nepsilon=8'}, "line break"),
])
def test_what_could_not_start_is_refused_before_a_file_is_written(tmp_path, over, said):
    with pytest.raises(ValueError, match=said.replace("(", r"\(")):
        write_service(_service(tmp_path, **over), tmp_path / "etc")
    assert not (tmp_path / "etc").exists()


def test_the_command_writes_both_files_and_says_how_to_install_them(tmp_path, capsys):
    from fedsyn_server.cli import main

    allow = tmp_path / "allow-list.txt"
    allow.write_text("")
    assert main(["node", "service", "--name", "notes", "--out", str(tmp_path / "etc"), "--superlink", "l:9092",
                 "--node-config", NASTY, "--allow-list", str(allow), "--same-user"]) == 0
    out = capsys.readouterr().out
    assert "systemctl link" in out and (tmp_path / "etc" / "fedsyn-node-notes.service").exists()
    assert main(["node", "service", "--name", "notes", "--out", str(tmp_path / "etc"), "--superlink", "l:9092",
                 "--node-config", NASTY, "--allow-list", str(allow)]) == 1
    assert "choose how ClientApps run" in capsys.readouterr().err
