"""Issue 32: the node runs only the FAB its institution approved (``fedsyn_client.fab_gate``), and
``fedsyn node-check`` says ready only for a node whose first request cannot burn budget on its set-up.
Through real SuperNodes: ``tests/test_deployment.py``."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import types
from pathlib import Path

import pandas as pd
import pytest

from fedsyn_client import fab_gate
from fedsyn_client.approval import approve, fab_hash, gate_status, install_launcher
from fedsyn_server.cli import main

APP = Path(__file__).resolve().parents[1]


def test_the_allow_list_reads_hashes_and_names_a_bad_line(tmp_path):
    good, other = "a" * 64, "0123456789abcdef" * 4
    path = tmp_path / "allow.txt"
    path.write_text(f"# approved apps\n{good}  # fedsyn at abc\n\n{other}\n")
    assert fab_gate.read_allow_list(path) == {good, other}
    path.write_text(f"{good}\n{good.upper()}\n")
    with pytest.raises(ValueError, match="line 2"):
        fab_gate.read_allow_list(path)


def test_the_gate_unpacks_only_an_approved_fab(tmp_path):
    fab, calls, log = b"PK a fab", [], []
    allow = tmp_path / "allow.txt"
    install = fab_gate.gated(lambda f, *a, **k: calls.append(f) or "installed", allow, log.append)
    for content in ("", "b" * 64 + "\n", "not a hash\n"):  # missing, another app's, damaged: nothing approved
        if content:
            allow.write_text(content)
        with pytest.raises(fab_gate.FabNotApproved, match="^fab not approved on this node$"):
            install(fab, skip_prompt=True)
    assert calls == [] and len(log) == 3
    allow.write_text(hashlib.sha256(fab).hexdigest() + "\n")
    assert install(fab, skip_prompt=True) == "installed" and calls == [fab]


def test_the_gate_fails_closed_without_its_hook():
    import flwr.supernode.runtime.run_clientapp as runtime

    fab_gate.check_hook("1.42.0", runtime)  # the installed Flower: the hook is there
    with pytest.raises(RuntimeError, match="pin the node's Flower"):
        fab_gate.check_hook("1.43.0", runtime)

    def run_clientapp():  # a Flower that installs the FAB some other way
        return unpack_somehow()  # noqa: F821

    moved = types.SimpleNamespace(install_from_fab=runtime.install_from_fab, run_clientapp=run_clientapp)
    with pytest.raises(RuntimeError, match="no longer installs the FAB"):
        fab_gate.check_hook("1.42.0", moved)


def test_the_launcher_exits_before_pulling_a_message_when_the_hook_is_gone(tmp_path):
    """The installed launcher is a real executable; a Flower it was not written for stops it with
    EXIT_NO_HOOK before it connects anywhere."""
    launcher = install_launcher(tmp_path / "bin", tmp_path / "allow.txt")
    text = launcher.read_text()
    assert text.startswith(f"#!{Path(sys.executable).absolute()} -I\n{fab_gate.MARKER}")
    broken = tmp_path / "broken" / "flwr-clientapp"
    broken.parent.mkdir()
    broken.write_text(text.replace("FLOWER = ((1, 41), (1, 42))", "FLOWER = ((0, 1),)"))
    broken.chmod(0o755)
    res = subprocess.run([str(broken), "--runtime-api-address", "127.0.0.1:1", "--insecure"], capture_output=True,
                         text=True, timeout=60)
    assert res.returncode == fab_gate.EXIT_NO_HOOK and "pin the node's Flower" in res.stderr


def test_fab_hash_is_reproducible_and_approve_records_it_once(tmp_path):
    digest = fab_hash(APP)
    assert digest == fab_hash(APP) and len(digest) == 64
    allow = tmp_path / "allow.txt"
    assert approve(APP, allow, "reviewed by the security team") == digest
    assert approve(APP, allow) == digest  # approving twice adds nothing
    assert fab_gate.read_allow_list(allow) == {digest}
    assert allow.read_text().count(digest) == 1 and "reviewed by the security team" in allow.read_text()


def test_node_check_checks_the_gate_on_path(tmp_path, monkeypatch, capsys):
    data = tmp_path / "site.csv"
    pd.DataFrame([{"text": f"note {i}", "topic": "x"} for i in range(4)]).to_csv(data, index=False)
    config = f'tier="weak" data-path="{data}" state-dir="{tmp_path / "s"}" epsilon=8'
    flower_only = tmp_path / "flower-only"  # Flower's own flwr-clientapp first: any FAB would run
    flower_only.mkdir()
    (flower_only / "flwr-clientapp").symlink_to(Path(sys.executable).parent / "flwr-clientapp")
    monkeypatch.setenv("PATH", f"{flower_only}{os.pathsep}{os.environ['PATH']}")
    assert main(["node-check", "--node-config", config]) == 1
    assert "not a fedsyn FAB gate" in capsys.readouterr().err
    allow = tmp_path / "allow.txt"
    gate = install_launcher(tmp_path / "gate", allow).parent
    monkeypatch.setenv("PATH", f"{gate}{os.pathsep}{os.environ['PATH']}")
    assert main(["node-check", "--node-config", config]) == 1
    assert "cannot be read" in capsys.readouterr().err  # no allow-list yet
    approve(APP, allow)
    allow.chmod(0o666)
    assert main(["node-check", "--node-config", config]) == 1
    assert "writable by other users" in capsys.readouterr().err
    allow.chmod(0o644)
    assert main(["node-check", "--node-config", config]) == 0
    assert f"FAB gate {gate / 'flwr-clientapp'}: 1 approved FAB(s)" in capsys.readouterr().out
    assert gate_status().endswith(str(allow.resolve()))


@pytest.mark.parametrize("extra,fragment", [
    ('embedder="all-MiniLM-L6-v2,/nowhere/embedder"', "/nowhere/embedder"),
    ('control-codes="topic=a,topic=b"', "none of the 4 records"),
])
def test_node_check_refuses_what_would_burn_budget_on_the_first_request(tmp_path, capsys, extra, fragment):
    data = tmp_path / "site.csv"
    pd.DataFrame([{"text": f"note {i}", "topic": "x"} for i in range(4)]).to_csv(data, index=False)
    config = f'tier="weak" data-path="{data}" state-dir="{tmp_path / "s"}" epsilon=8 {extra}'
    assert main(["node-check", "--allow-any-fab", "--node-config", config]) == 1
    err = capsys.readouterr().err.strip()
    assert fragment in err and len(err.splitlines()) == 1
    assert not (tmp_path / "s").exists()  # nothing opened


def test_node_check_refuses_an_audit_dir_it_cannot_write(tmp_path, capsys):
    data = tmp_path / "site.csv"
    pd.DataFrame([{"text": f"note {i}", "topic": "x"} for i in range(4)]).to_csv(data, index=False)
    blocked = tmp_path / "audit"
    blocked.write_text("a file where the folder should be")
    config = f'tier="weak" data-path="{data}" state-dir="{tmp_path / "s"}" epsilon=8 audit-dir="{blocked}"'
    assert main(["node-check", "--allow-any-fab", "--node-config", config]) == 1
    assert "audit-dir" in capsys.readouterr().err
