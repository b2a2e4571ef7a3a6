"""Issue 32: the node runs only the FAB its institution approved (``fedsyn_client.fab_gate``), and
``fedsyn node-check`` says ready only for a node whose first request cannot burn budget on its set-up.
Through real SuperNodes: ``tests/test_deployment.py``."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from fedsyn_client import fab_gate
from fedsyn_client.approval import approve, fab_hash, install_launcher, install_tree
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


TINY_APP = {
    "pyproject.toml": '[build-system]\nrequires = ["hatchling"]\nbuild-backend = "hatchling.build"\n\n'
                      '[project]\nname = "tiny"\nversion = "1.0.0"\ndependencies = []\n\n'
                      '[tool.hatch.build.targets.wheel]\npackages = ["."]\n\n'
                      '[tool.flwr.app]\npublisher = "lab"\n\n[tool.flwr.app.components]\n'
                      'serverapp = "tinyapp.client:server"\nclientapp = "tinyapp.client:app"\n\n[tool.flwr.app.config]\n',
    "tinyapp/__init__.py": "",
    "tinyapp/client.py": "from flwr.clientapp import ClientApp\napp = ClientApp()\nserver = None\n",
}


@pytest.fixture
def tiny_fab(tmp_path) -> bytes:
    """The FAB of a two-module app (built as `flwr run` builds it)."""
    from fedsyn_client.approval import build_fab

    app = tmp_path / "tiny-app"
    for rel, text in TINY_APP.items():
        (app / rel).parent.mkdir(parents=True, exist_ok=True)
        (app / rel).write_text(text)
    return build_fab(app)


def test_the_gate_loads_only_the_tree_installed_from_the_approved_bytes(tmp_path, tiny_fab):
    """A missing, foreign or damaged allow-list approves nothing; an approved hash loads only from its
    intact tree beside the allow-list; an added module (a planted file, a .pyc), a changed file or a
    missing tree refuses; nothing is ever unpacked by the gate itself."""
    allow, log = tmp_path / "allow.txt", []
    gate = fab_gate.ClientAppGate(allow, log.append)
    digest = hashlib.sha256(tiny_fab).hexdigest()
    for content in ("", "b" * 64 + "\n", "not a hash\n", digest + "\n"):  # the last: approved, not installed
        if content:
            allow.write_text(content)
        with pytest.raises(fab_gate.FabNotApproved, match="^fab not approved on this node$"):
            gate.install(tiny_fab, skip_prompt=True)
    assert "is approved but its installed tree is not its bytes" in log[-1] and gate.approved is None
    tree = install_tree(tiny_fab, allow)
    assert tree == fab_gate.apps_dir(allow.resolve()) / digest and gate.install(tiny_fab, skip_prompt=True) == tree
    assert sorted(p.relative_to(tree).as_posix() for p in tree.rglob("*") if p.is_file()) == sorted(TINY_APP)
    assert all(not p.stat().st_mode & 0o222 for p in tree.rglob("*"))  # read-only, folders too
    (tree / "tinyapp").chmod(0o755)
    for plant in ("tinyapp/evil.py", "tinyapp/__pycache__/client.cpython-311.pyc"):
        (tree / plant).parent.mkdir(exist_ok=True)
        (tree / plant).write_text("raise SystemExit('planted')")
        with pytest.raises(fab_gate.FabNotApproved):
            gate.install(tiny_fab)
        assert f"{tree / plant} is not in the FAB" in log[-1]
        (tree / plant).unlink()
    (tree / "tinyapp" / "__pycache__").rmdir()
    (tree / "tinyapp" / "client.py").chmod(0o644)
    (tree / "tinyapp" / "client.py").write_text("import os; os.system('echo pwned')\n")
    with pytest.raises(fab_gate.FabNotApproved):
        gate.install(tiny_fab)
    assert "differs from the FAB" in log[-1]
    assert install_tree(tiny_fab, allow) == tree and gate.install(tiny_fab) == tree  # approving again repairs it
    assert not (tmp_path / "apps").exists() and not list(tmp_path.glob("*/apps"))  # Flower's apps folder: never


@pytest.mark.parametrize("fab_id,fab_version,why", [
    ("lab/tiny", "1.0.0/../../../elsewhere", "a version that walks out of the apps folder"),
    ("lab/../tiny", "1.0.0", "an id that walks"),
    ("evil/app", "1.0.0", "another app's stated id (its folder may hold anything)"),
    ("lab/tiny", "2.0.0", "another stated version"),
])
def test_the_gate_refuses_a_stated_fab_id_or_version_that_is_not_the_approved_trees(tmp_path, tiny_fab, fab_id,
                                                                                    fab_version, why):
    allow, log = tmp_path / "allow.txt", []
    install_tree(tiny_fab, allow)
    digest = hashlib.sha256(tiny_fab).hexdigest()
    allow.write_text(digest + "\n")
    gate = fab_gate.ClientAppGate(allow, log.append)
    with pytest.raises(fab_gate.FabNotApproved):
        gate.load("lab/tiny", "1.0.0", digest)  # nothing passed install yet
    gate.install(tiny_fab)
    with pytest.raises(fab_gate.FabNotApproved):
        gate.load(fab_id, fab_version, digest)
    assert "the run states FAB" in log[-1], why
    with pytest.raises(fab_gate.FabNotApproved):
        gate.load("lab/tiny", "1.0.0", "0" * 64)  # a stated hash that is not the bytes'


def test_the_gate_imports_the_clientapp_from_the_approved_tree(tmp_path, tiny_fab, monkeypatch):
    from flwr.clientapp import ClientApp

    allow = tmp_path / "allow.txt"
    tree = install_tree(tiny_fab, allow)
    allow.write_text(hashlib.sha256(tiny_fab).hexdigest() + "\n")
    gate = fab_gate.ClientAppGate(allow, lambda _: None)
    gate.install(tiny_fab)
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.delitem(sys.modules, "tinyapp", raising=False)
    monkeypatch.delitem(sys.modules, "tinyapp.client", raising=False)
    app = gate.loader("", None, True)("lab/tiny", "1.0.0", hashlib.sha256(tiny_fab).hexdigest())
    assert isinstance(app, ClientApp) and Path(sys.modules["tinyapp.client"].__file__).parent == tree / "tinyapp"
    # the app's package already imported from elsewhere (an installed copy found first): not the approved bytes
    elsewhere = tmp_path / "site" / "tinyapp"
    elsewhere.mkdir(parents=True)
    (elsewhere / "__init__.py").write_text("")
    (elsewhere / "client.py").write_text(TINY_APP["tinyapp/client.py"])
    monkeypatch.delitem(sys.modules, "tinyapp")
    monkeypatch.delitem(sys.modules, "tinyapp.client")
    sys.path.insert(0, str(elsewhere.parent))
    __import__("tinyapp.client")
    with pytest.raises(fab_gate.FabNotApproved):
        gate.load("lab/tiny", "1.0.0", hashlib.sha256(tiny_fab).hexdigest())


def test_the_gate_fails_closed_on_another_flower_or_a_moved_hook(monkeypatch):
    import importlib

    for role in (fab_gate.CLIENTAPP, fab_gate.AGENTAPP):
        assert callable(fab_gate.check_hook(role, "1.42.0").install_from_fab)  # the installed Flower
        with pytest.raises(RuntimeError, match="pin the node's Flower"):
            fab_gate.check_hook(role, "1.42.1")  # a patch release is not one the gate was read against
    with pytest.raises(RuntimeError, match="no Flower runner"):
        fab_gate.check_hook("flwr-model", "1.42.0")
    runner = importlib.import_module("flwr.supernode.runtime.run_clientapp")

    def run_clientapp():  # a Flower that installs the FAB some other way
        return unpack_somehow()  # noqa: F821

    monkeypatch.setattr(runner, "run_clientapp", run_clientapp)
    with pytest.raises(RuntimeError, match="no longer goes through"):
        fab_gate.check_hook(fab_gate.CLIENTAPP, "1.42.0")


def test_the_gate_forwards_only_the_arguments_a_superexec_passes():
    args = ["--runtime-api-address", "127.0.0.1:1", "--token", "t", "--insecure", "--parent-pid", "7",
            "--allow-runtime-dependency-installation"]
    assert fab_gate.task_args(args) == args[:-1]
    assert fab_gate.task_args(["--token-stdin", "--root-certificates=/ca.pem"]) == ["--token-stdin",
                                                                                   "--root-certificates=/ca.pem"]
    with pytest.raises(ValueError, match="unexpected argument"):
        fab_gate.task_args(["--token", "t", "--app", "/elsewhere"])


def test_every_launcher_flower_can_start_is_a_gate_and_the_unknown_ones_exit_before_connecting(tmp_path):
    """The launchers are real executables: flwr-model, flwr-connector, flwr-serverapp and
    flwr-simulation exit with EXIT_REFUSED before they connect anywhere, and so does any launcher
    given an argument a SuperExec does not pass; a Flower the gate was not read against stops the
    flwr-clientapp and flwr-agentapp launchers with EXIT_NO_HOOK."""
    from flwr.supercore.constant import TASK_TYPE_TO_COMMAND

    launcher = install_launcher(tmp_path / "bin", tmp_path / "allow.txt")
    assert launcher.name == "flwr-clientapp"
    assert set(TASK_TYPE_TO_COMMAND.values()) <= {p.name for p in launcher.parent.iterdir()}
    args = ["--runtime-api-address", "127.0.0.1:1", "--insecure", "--token", "t"]
    for name in ("flwr-model", "flwr-connector", "flwr-serverapp", "flwr-simulation"):
        res = subprocess.run([str(launcher.parent / name), *args], capture_output=True, text=True, timeout=60)
        assert res.returncode == fab_gate.EXIT_REFUSED and "refused before connecting" in res.stderr, res.stderr
    res = subprocess.run([str(launcher), *args, "--flwr-dir", "/x"], capture_output=True, text=True, timeout=60)
    assert res.returncode == fab_gate.EXIT_REFUSED and "unexpected argument" in res.stderr
    text = launcher.read_text()
    assert text.startswith(f"#!{Path(sys.executable).absolute()} -I\n{fab_gate.MARKER}")
    for name in ("flwr-clientapp", "flwr-agentapp"):
        broken = tmp_path / "broken" / name
        broken.parent.mkdir(exist_ok=True)
        broken.write_text((launcher.parent / name).read_text().replace('FLOWER = ("1.42.0",)', 'FLOWER = ("0.1",)'))
        broken.chmod(0o755)
        res = subprocess.run([str(broken), *args], capture_output=True, text=True, timeout=60)
        assert res.returncode == fab_gate.EXIT_NO_HOOK and "pin the node's Flower" in res.stderr, res.stderr


def test_fab_hash_is_reproducible_and_approve_installs_the_tree_and_records_it_once(tmp_path):
    digest = fab_hash(APP)
    assert digest == fab_hash(APP) and len(digest) == 64
    allow = tmp_path / "allow.txt"
    assert approve(APP, allow, "reviewed by the security team") == digest
    assert approve(APP, allow) == digest  # approving twice adds nothing
    assert fab_gate.read_allow_list(allow) == {digest}
    assert allow.read_text().count(digest) == 1 and "reviewed by the security team" in allow.read_text()
    tree = fab_gate.apps_dir(allow) / digest
    assert (tree / "fedsyn_client" / "client_app.py").read_bytes() == (APP / "fedsyn_client" / "client_app.py").read_bytes()
    assert hashlib.sha256((fab_gate.apps_dir(allow) / f"{digest}.fab").read_bytes()).hexdigest() == digest


def _node(tmp_path: Path) -> str:
    data = tmp_path / "site.csv"
    pd.DataFrame([{"text": f"note {i}", "topic": "x"} for i in range(4)]).to_csv(data, index=False)
    return f'tier="weak" data-path="{data}" max-records=100 state-dir="{tmp_path / "s"}" epsilon=8'


def test_node_check_checks_every_launcher_on_path(tmp_path, monkeypatch, capsys):
    config = _node(tmp_path)
    flower_only = tmp_path / "flower-only"  # Flower's own flwr-clientapp first: any FAB would run
    flower_only.mkdir()
    (flower_only / "flwr-clientapp").symlink_to(Path(sys.executable).parent / "flwr-clientapp")
    monkeypatch.setenv("PATH", f"{flower_only}{os.pathsep}{os.environ['PATH']}")
    assert main(["node-check", "--node-config", config, "--same-user"]) == 1
    assert "not a fedsyn FAB gate" in capsys.readouterr().err
    allow = tmp_path / "allow.txt"
    gate = install_launcher(tmp_path / "gate", allow).parent
    monkeypatch.setenv("PATH", f"{gate}{os.pathsep}{os.environ['PATH']}")
    assert main(["node-check", "--node-config", config, "--same-user"]) == 1
    assert "cannot be read" in capsys.readouterr().err  # no allow-list yet
    approve(APP, allow)
    assert main(["node-check", "--node-config", config, "--same-user"]) == 0
    assert f"FAB gate {gate}: 1 approved FAB(s) in {allow.resolve()}, 6 launchers" in capsys.readouterr().out
    (gate / "flwr-agentapp").unlink()  # the venv's own flwr-agentapp is next on PATH: agent apps would run
    assert main(["node-check", "--node-config", config, "--same-user"]) == 1
    assert "flwr-agentapp is not a fedsyn FAB gate" in capsys.readouterr().err
    install_launcher(gate, allow)
    monkeypatch.setattr("importlib.metadata.version", lambda name: "1.42.1" if name == "flwr" else "0")
    assert main(["node-check", "--node-config", config, "--same-user"]) == 1
    assert "Flower 1.42.1 is not a release the FAB gate was read against" in capsys.readouterr().err


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another user needs root")
def test_node_check_says_not_ready_when_the_clientapp_user_could_change_what_runs(tmp_path, monkeypatch, capsys):
    """Checked for a ClientApp user other than the operator (deploy/start_node.sh --run-as): it must
    own and be able to write none of the gate, the allow-list, the approved trees, the venv."""
    import pwd

    user = pwd.getpwnam("nobody")
    config = _node(tmp_path)
    allow = tmp_path / "allow.txt"
    gate = install_launcher(tmp_path / "gate", allow).parent
    approve(APP, allow)
    monkeypatch.setenv("PATH", f"{gate}{os.pathsep}{os.environ['PATH']}")
    check = ["node-check", "--node-config", config, "--clientapp-user", "nobody"]
    assert main(check) == 0, capsys.readouterr().err
    assert "ClientApps run as nobody" in capsys.readouterr().out
    assert main(["node-check", "--node-config", config]) == 1  # as root, without --same-user: root changes anything
    assert "ClientApps run as root" in capsys.readouterr().err
    tree = fab_gate.apps_dir(allow)
    for path, harm in ((gate / "flwr-clientapp", "owned by the ClientApp user"), (allow, "owned by the ClientApp user"),
                       (tree, "writable by other users"), (gate, "writable by other users")):
        before = path.stat()
        if harm.startswith("owned"):
            os.chown(path, user.pw_uid, -1)
        else:
            path.chmod(before.st_mode | 0o002)
        assert main(check) == 1
        err = capsys.readouterr().err
        assert f"{path} is {harm}" in err, err
        os.chown(path, before.st_uid, -1)
        path.chmod(before.st_mode & 0o7777)
    assert main(check) == 0


@pytest.mark.parametrize("extra,fragment", [
    ('embedder="all-MiniLM-L6-v2,/nowhere/embedder"', "/nowhere/embedder"),
    ('control-codes="topic=a,topic=b"', "none of the 4 records"),
])
def test_node_check_refuses_what_would_burn_budget_on_the_first_request(tmp_path, capsys, extra, fragment):
    data = tmp_path / "site.csv"
    pd.DataFrame([{"text": f"note {i}", "topic": "x"} for i in range(4)]).to_csv(data, index=False)
    config = f'tier="weak" data-path="{data}" max-records=100 state-dir="{tmp_path / "s"}" epsilon=8 {extra}'
    assert main(["node-check", "--allow-any-fab", "--node-config", config]) == 1
    err = capsys.readouterr().err.strip()
    assert fragment in err and len(err.splitlines()) == 1
    assert not (tmp_path / "s").exists()  # nothing opened


def test_node_check_refuses_an_audit_dir_it_cannot_write(tmp_path, capsys):
    data = tmp_path / "site.csv"
    pd.DataFrame([{"text": f"note {i}", "topic": "x"} for i in range(4)]).to_csv(data, index=False)
    blocked = tmp_path / "audit"
    blocked.write_text("a file where the folder should be")
    config = f'tier="weak" data-path="{data}" max-records=100 state-dir="{tmp_path / "s"}" epsilon=8 audit-dir="{blocked}"'
    assert main(["node-check", "--allow-any-fab", "--node-config", config]) == 1
    assert "audit-dir" in capsys.readouterr().err
