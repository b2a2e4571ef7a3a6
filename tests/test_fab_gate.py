"""Issue 32: the node runs only the FAB its institution approved (``fedsyn_client.fab_gate``), and
``fedsyn node-check`` says ready only for a node whose first request cannot burn budget on its set-up.
Through real SuperNodes: ``tests/test_deployment.py``."""

from __future__ import annotations

import hashlib
import io
import os
import struct
import subprocess
import sys
import tracemalloc
import zipfile
import zlib
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
                      'serverapp = "tinyapp.client:server"\nclientapp = "tinyapp.client:app"\n\n'
                      '[tool.flwr.app.config]\n',
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
    flwr-clientapp, flwr-agentapp and flower-supernode launchers with EXIT_NO_HOOK."""
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
    # the SuperNode's launcher: Flower's own flower-supernode behind the gate, run by `python -I`
    res = subprocess.run([str(launcher.parent / "flower-supernode"), "--help"], capture_output=True, text=True,
                         timeout=60, env={**os.environ, "FLWR_DISABLE_UPDATE_CHECK": "1"})
    assert res.returncode == 0 and "--superlink" in res.stdout, res.stderr
    for name in ("flwr-clientapp", "flwr-agentapp", "flower-supernode"):
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
    assert ((tree / "fedsyn_client" / "client_app.py").read_bytes()
            == (APP / "fedsyn_client" / "client_app.py").read_bytes())
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
    assert f"FAB gate {gate}: 1 approved FAB(s) in {allow.resolve()}, 7 launchers" in capsys.readouterr().out
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
    said = [line for line in capsys.readouterr().err.splitlines() if line.startswith("fedsyn node-check: ")]
    assert len(said) == 1 and fragment in said[0], said
    assert not (tmp_path / "s").exists()  # nothing opened


def test_node_check_refuses_an_audit_dir_it_cannot_write(tmp_path, capsys):
    data = tmp_path / "site.csv"
    pd.DataFrame([{"text": f"note {i}", "topic": "x"} for i in range(4)]).to_csv(data, index=False)
    blocked = tmp_path / "audit"
    blocked.write_text("a file where the folder should be")
    config = (f'tier="weak" data-path="{data}" max-records=100 state-dir="{tmp_path / "s"}" epsilon=8 '
              f'audit-dir="{blocked}"')
    assert main(["node-check", "--allow-any-fab", "--node-config", config]) == 1
    assert "audit-dir" in capsys.readouterr().err


# Issue 60, finding 8: what a node accepts of a FAB before anything unpacks it.

def _zeros_zip(mib: int, name: str = "pyproject.toml", method: int = zipfile.ZIP_DEFLATED) -> bytes:
    """A zip whose one member is ``mib`` MiB of zeros, written a MiB at a time (never held whole)."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", method) as archive, archive.open(name, "w") as member:
        for _ in range(mib):
            member.write(bytes(2**20))
    return buffer.getvalue()


def _declare(fab: bytes, name: str, size: int) -> bytes:
    """``fab`` (one member, ``name``) with that member declaring ``size`` unpacked bytes (central
    directory and local header) and the CRC of that many zeros: zipfile's own reader then stops
    there without complaint."""
    data = bytearray(fab)
    crc = zlib.crc32(bytes(size))
    with zipfile.ZipFile(io.BytesIO(fab)) as archive:
        member = archive.getinfo(name)
    struct.pack_into("<I", data, member.header_offset + 14, crc)
    struct.pack_into("<I", data, member.header_offset + 22, size)
    directory = fab.rindex(b"PK\x01\x02")  # the one member's central-directory header
    struct.pack_into("<I", data, directory + 16, crc)
    struct.pack_into("<I", data, directory + 24, size)
    return bytes(data)


def _peak(call):
    """(what ``call()`` returns or raises, the peak bytes Python allocated while it ran)."""
    tracemalloc.start()
    try:
        try:
            result = call()
        except Exception as err:  # noqa: BLE001  (the refusal is the result)
            result = err
        return result, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def _approved(tmp_path: Path, *fabs: bytes) -> Path:
    allow = tmp_path / "allow.txt"
    allow.write_text("".join(hashlib.sha256(f).hexdigest() + "\n" for f in fabs))
    return allow


def _flower_must_not_read(*args):
    raise AssertionError("Flower's get_fused_config_from_fab ran on a FAB the gate should have kept from it")


def test_finding8_a_trailing_newline_is_not_a_plain_name():
    """`$` also matches before a trailing newline: "1.0.0\\n" passed as a plain version."""
    assert fab_gate.plain_fab_name("lab/tiny", "1.0.0")
    for fab_id, fab_version in (("lab/tiny", "1.0.0\n"), ("lab/tiny\n", "1.0.0"), ("lab\n/tiny", "1.0.0")):
        assert not fab_gate.plain_fab_name(fab_id, fab_version), (fab_id, fab_version)
    assert fab_gate._HASH.match("a" * 64) and not fab_gate._HASH.match("a" * 64 + "\n")


def test_finding8_the_bounds_pass_fedsyns_own_fab_and_name_what_is_not_a_zip(tiny_fab):
    from fedsyn_client.approval import build_fab

    assert fab_gate.fab_bounds(tiny_fab) == "" and fab_gate.fab_bounds(build_fab(APP)) == ""
    assert fab_gate.fab_bounds(b"not a zip") == "the FAB is not a zip archive"
    assert fab_gate.fab_bounds(tiny_fab[:-30]) != ""  # a cut end record


def test_finding8_a_zip_bomb_is_refused_before_it_is_inflated(tmp_path):
    """50 MiB of zeros deflated to ~51 KB (ratio ~1,000): refused from the central directory, by the
    ClientApp's gate and by the SuperNode's, approved or not, allocating under 1 MiB; Flower never reads it."""
    bomb = _zeros_zip(50)
    assert len(bomb) < 2**17
    assert f"a ratio over {fab_gate.MAX_RATIO}" in fab_gate.fab_bounds(bomb)
    with pytest.raises(ValueError, match="a ratio over"):
        fab_gate.fab_manifest(bomb)
    allow, log = _approved(tmp_path, bomb), []  # even an approved one (an operator tricked into it)
    refused, peak = _peak(lambda: fab_gate.ClientAppGate(allow, log.append).install(bomb))
    assert isinstance(refused, fab_gate.FabNotApproved) and peak < 2**20, peak
    assert "a ratio over 100; refused before anything was unpacked" in log[-1]
    supernode = fab_gate.SuperNodeGate(allow, log.append, _flower_must_not_read)
    config, peak = _peak(lambda: supernode.fused_config(bomb, None))
    assert config == {} and peak < 2**20, (config, peak)
    assert "a ratio over 100; Flower does not read it" in log[-1]


def test_finding8_too_many_entries_are_refused_before_zipfile_parses_them(tmp_path, monkeypatch):
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        for i in range(fab_gate.MAX_ENTRIES + 1):
            archive.writestr(f"f{i}", b"")
    many = buffer.getvalue()
    why, peak = _peak(lambda: fab_gate.fab_bounds(many))
    assert why.startswith("the FAB states 10,001 entries in ") and peak < 2**16, (why, peak)
    # an end record that states one entry: the gate counts the headers zipfile would walk
    end = many.rindex(b"PK\x05\x06")
    lying = many[:end + 8] + struct.pack("<2H", 1, 1) + many[end + 12:]
    why, peak = _peak(lambda: fab_gate.fab_bounds(lying))
    assert why == "the FAB has over 10,000 entries, the bound" and peak < 2**16, (why, peak)
    allow, log = _approved(tmp_path, lying), []
    with pytest.raises(fab_gate.FabNotApproved):
        fab_gate.ClientAppGate(allow, log.append).install(lying)
    assert fab_gate.SuperNodeGate(allow, log.append, _flower_must_not_read).fused_config(lying, None) == {}
    monkeypatch.setattr(fab_gate, "MAX_CENTRAL_DIRECTORY", 2**16)  # the directory's bytes are bounded too
    assert "central directory, over the bounds" in fab_gate.fab_bounds(lying)


def test_finding8_an_oversize_fab_is_refused_unread(tmp_path):
    big = _zeros_zip(50, method=zipfile.ZIP_STORED)  # stored: ratio 1, only its size is over
    assert len(big) > fab_gate.MAX_FAB_BYTES
    assert fab_gate.fab_bounds(big).startswith(f"the FAB is {len(big):,} bytes, over the bound of 52,428,800")
    allow, log = _approved(tmp_path, big), []
    with pytest.raises(fab_gate.FabNotApproved):
        fab_gate.ClientAppGate(allow, log.append).install(big)
    assert fab_gate.SuperNodeGate(allow, log.append, _flower_must_not_read).fused_config(big, None) == {}
    path = tmp_path / "big.fab"
    path.write_bytes(big)
    assert len(fab_gate.read_fab(path)) == fab_gate.MAX_FAB_BYTES + 1  # a path is read to one byte over, no more


def test_finding8_a_member_whose_declared_size_lies_is_cut_at_it(tmp_path):
    """pyproject.toml declares 1,000 bytes (with their CRC) and inflates to 50 MiB: the central
    directory cannot see it; zipfile's read() inflates all 50 MiB in one call before it cuts them to
    1,000 (Flower's get_fab_config reads so). The gate's read stops one chunk past the declared size,
    and the SuperNode hands Flower no FAB whose pyproject.toml inflates past its declared size."""
    liar = _declare(_zeros_zip(50), "pyproject.toml", 1000)
    assert fab_gate.fab_bounds(liar) == ""
    with zipfile.ZipFile(io.BytesIO(liar)) as archive:
        data, peak = _peak(lambda: archive.read("pyproject.toml"))
        assert data == bytes(1000) and peak > 50 * 2**20  # what Flower's read costs
        refused, peak = _peak(lambda: fab_gate.read_member(archive, "pyproject.toml"))
    assert isinstance(refused, ValueError) and "inflates past its declared 1,000 bytes" in str(refused)
    assert peak < 2**20, peak
    log = []
    unapproved = fab_gate.SuperNodeGate(_approved(tmp_path), log.append, _flower_must_not_read)
    assert unapproved.fused_config(liar, None) == {}
    assert log[-1].endswith(f"not in {tmp_path / 'allow.txt'}; Flower does not read it, and its ClientApp is refused")
    approved = fab_gate.SuperNodeGate(_approved(tmp_path, liar), log.append, _flower_must_not_read)
    config, peak = _peak(lambda: approved.fused_config(liar, None))
    assert config == {} and peak < 2**20 and "inflates past its declared 1,000 bytes" in log[-1], (config, peak)
    short = _declare(_zeros_zip(1), "pyproject.toml", 2**20 + 1)  # declares more than it holds
    with zipfile.ZipFile(io.BytesIO(short)) as archive, pytest.raises(ValueError, match="inflates to 1,048,576"):
        fab_gate.read_member(archive, "pyproject.toml")


def test_finding8_the_supernode_gate_hands_flower_only_approved_fabs_within_the_bounds(tmp_path, tiny_fab):
    from flwr.common.config import get_fused_config_from_fab
    from flwr.supercore.run import Run

    calls, log = [], []
    gate = fab_gate.SuperNodeGate(_approved(tmp_path, tiny_fab), log.append, lambda *a: calls.append(a) or {"x": 1})
    assert gate.fused_config(tiny_fab, "run") == {"x": 1} and calls == [(tiny_fab, "run")]
    other = tiny_fab.replace(b"1.0.0", b"1.0.1")
    assert gate.fused_config(other, "run") == {} and len(calls) == 1 and "not in" in log[-1]
    real = fab_gate.SuperNodeGate(tmp_path / "allow.txt", log.append, get_fused_config_from_fab)
    assert real.fused_config(tiny_fab, Run.create_empty(1)) == {}  # Flower's own, on the approved bytes


def test_finding8_the_supernode_hook_fails_closed(monkeypatch):
    with pytest.raises(RuntimeError, match="pin the node's Flower"):
        fab_gate.supernode_hook("/nowhere", print, "1.42.1")
    import flwr.supernode.start_client_internal as internal

    monkeypatch.setattr(internal, "_pull_and_store_message", lambda: None)  # a Flower that reads FABs elsewhere
    with pytest.raises(RuntimeError, match="no longer reads a FAB through get_fused_config_from_fab"):
        fab_gate.supernode_hook("/nowhere", print, "1.42.0")


# Flower's own SuperNode loop (flwr/supernode/start_client_internal.py:_pull_and_store_message) with
# a server that sends a bomb as a run's FAB; argv: MiB, "flower" or "gate", allow-list. Prints JSON.
_LOOP = r'''
import hashlib, io, json, sys, tracemalloc, zipfile
buffer = io.BytesIO()
with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive, archive.open("pyproject.toml", "w") as member:
    for _ in range(int(sys.argv[1])):
        member.write(bytes(2**20))
fab = buffer.getvalue()
from flwr.app import Message, RecordDict
from flwr.supercore.fab import Fab
from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects, get_object_tree
from flwr.supercore.object_store import ObjectStoreFactory
from flwr.supercore.run import Run
from flwr.supercore.task_identity import TaskIdentity
from flwr.supernode.nodestate import NodeStateFactory
import flwr.supernode.start_client_internal as internal
if sys.argv[2] == "gate":
    from fedsyn_client import fab_gate
    fab_gate.supernode_hook(sys.argv[3], lambda text: print(text, file=sys.stderr), "1.42.0")
stores = ObjectStoreFactory()
state, store = NodeStateFactory(stores).state(), stores.store()
state.set_node_id(7)
TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1
message = Message(RecordDict(), dst_node_id=7, message_type="query")
message.metadata.__dict__["_message_id"] = message.object_id
objects = {k: v.deflate() for k, v in get_all_nested_objects(message).items()}
run = Run.create_empty(1)
run.fab_hash = hashlib.sha256(fab).hexdigest()
pulled = []
def receive():
    if pulled:
        return None
    pulled.append(1)
    return message, get_object_tree(message)
tracemalloc.start()
try:
    internal._pull_and_store_message(
        state=state, object_store=store, node_config={}, receive=receive, get_run=lambda _: run,
        get_fab=lambda h, _: Fab(h, fab, {}), pull_object=lambda _, oid: objects[oid],
        confirm_message_received=lambda *_: None, trusted_entities=None)
    outcome = {"run_config": state.get_run_series_context(0).run_config, "stored": len(state.get_messages_legacy())}
except Exception as err:
    outcome = {"raised": type(err).__name__}
outcome["peak_mib"] = tracemalloc.get_traced_memory()[1] / 2**20
outcome["fab_bytes"] = len(fab)
print(json.dumps(outcome))
'''


def test_finding8_flowers_own_supernode_loop_reads_no_unapproved_fab_behind_the_gate(tmp_path):
    """The issue's attack through Flower's real receive loop, each in a fresh process: a server's
    bomb (50 MiB of zeros in 51 KB) makes a stock SuperNode allocate over 50 MiB and its ValueError
    escapes the loop (the SuperNode stops); behind the gate the run is stored with an empty config,
    the message is taken, and the loop allocates under 1 MiB."""
    import json

    allow = _approved(tmp_path)
    env = {**os.environ, "PYTHONPATH": str(APP), "FLWR_TELEMETRY_ENABLED": "0"}

    def loop(mode: str) -> dict:
        res = subprocess.run([sys.executable, "-c", _LOOP, "50", mode, str(allow)], capture_output=True, text=True,
                             timeout=120, env=env, cwd=tmp_path)
        assert res.returncode == 0, res.stderr[-2000:]
        return json.loads(res.stdout.strip().splitlines()[-1])

    stock, gated = loop("flower"), loop("gate")
    assert stock["raised"] == "ValueError" and stock["peak_mib"] > 50, stock
    assert gated["run_config"] == {} and gated["stored"] == 1 and gated["peak_mib"] < 1, gated
