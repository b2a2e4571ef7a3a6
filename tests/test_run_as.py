"""Issue 64: an institution's node as it will really run, its ClientApps as their own user.

``deploy/start_node.sh --run-as USER`` on real processes: a SuperLink, a strong and a weak node
started by the script as root with ClientApps as a user made for the test (CI runs as root),
a small fedsyn run to the end through the nodes' FAB gates. Checked: every process under each
node's SuperExec ran as that user; the user can write none of the gate, the allow-list, the
approved trees or the venv; the run's releases are in the nodes' ledgers (written by that user);
node-check, as the ClientApps run, refuses the ownership mistakes an operator can make; the
ledger's page is written from a deployed node's ledger. Then the same node as a service:
``fedsyn node service`` writes a unit that ``systemd-analyze verify`` accepts, and its ExecStart
line, run as written with its environment file (systemd itself cannot run here), starts the
node, exits 1 when the SuperNode dies (Restart=on-failure starts it again) and stops every
process on TERM. Everything started is stopped by PID and the user removed.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from fedsyn_server.flwr_runner import APP_DIR, alive, flwr_env, with_descendants
from tests.test_deployment import (
    BIN,
    CODES,
    EPSILON,
    TINY,
    Deployment,
    _ledger,
    _operator,
    _start_superlink,
    _stop_all,
    _write_csv,
)

pytestmark = [
    pytest.mark.flwr,
    pytest.mark.skipif(os.geteuid() != 0 or not (shutil.which("useradd") and shutil.which("runuser")),
                       reason="--run-as starts processes as another user: needs root, useradd, runuser (CI has)"),
]
START_NODE = APP_DIR / "deploy" / "start_node.sh"
STOP = APP_DIR / "deploy" / "stop_local_deployment.sh"
SYSTEMD_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"  # a system service's PATH


@contextmanager
def _clientapp_user() -> Iterator[str]:
    """A system user with no home and no shell, removed afterwards: the ClientApps' user."""
    name = f"fedsyn-ca{os.getpid()}"
    subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", "--user-group", name],
                   check=True, capture_output=True)
    try:
        yield name
    finally:
        subprocess.run(["userdel", name], check=False, capture_output=True)


@contextmanager
def _enterable(paths: list[Path]) -> Iterator[None]:
    """Let every user enter (o+x, not list) each folder above ``paths`` that others cannot enter yet,
    and restore their modes afterwards. An institution installs the node's venv where the ClientApp
    user can run it; a test's venv may sit under a private home (its Python in ``/root/.pyenv``)."""
    changed: list[tuple[Path, int]] = []
    for path in paths:
        for folder in reversed(Path(os.path.realpath(path)).parents):
            mode = folder.stat().st_mode
            if not mode & stat.S_IXOTH and folder not in (f for f, _ in changed):
                changed.append((folder, mode))
                folder.chmod(stat.S_IMODE(mode) | stat.S_IXOTH)
    try:
        yield
    finally:
        for folder, mode in reversed(changed):
            folder.chmod(stat.S_IMODE(mode))


def _as(user: str, *args: object, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(["runuser", "-u", user, "--", *(str(a) for a in args)], capture_output=True, text=True,
                          timeout=timeout, check=False)


class _Watch(threading.Thread):
    """Samples, until stopped, the owner of every process under ``roots`` (the SuperExecs): pid ->
    (uid, command line), so short-lived ClientApps are seen while they run."""

    def __init__(self, roots: list[int]) -> None:
        super().__init__(daemon=True)
        self.roots, self.seen, self.done = roots, {}, threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            for pid in with_descendants(self.roots):
                if pid in self.roots:
                    continue
                try:
                    uid = os.stat(f"/proc/{pid}").st_uid
                    cmd = _command(pid) or Path(f"/proc/{pid}/comm").read_text().strip()  # an unreaped one: its name
                except OSError:
                    continue
                self.seen[pid] = (uid, cmd)
            time.sleep(0.1)


def _pids(work: Path) -> dict[str, int]:
    """ROLE -> PID of what deploy/start_node.sh started (its WORK/pids: "PID ROLE NAME")."""
    rows = [line.split() for line in (work / "pids").read_text().splitlines() if line.strip()]
    return {role: int(pid) for pid, role, _ in rows}


def _node_config(node: dict) -> str:
    return (f'tier="{node["tier"]}" data-path="{node["data"]}" max-records=100 state-dir="{node["state"]}" '
            f'epsilon={EPSILON} control-codes="{CODES}" audit-dir="{node["audit"]}"')


def test_a_node_started_with_run_as_runs_its_clientapps_as_that_user_who_can_change_nothing_that_decides_the_code():
    import pwd

    root = Path(tempfile.mkdtemp(prefix="fedsyn-runas-"))  # not pytest's tmp_path: root's, mode 700
    root.chmod(0o755)
    dep: Deployment | None = None
    with _clientapp_user() as user, _enterable([Path(sys.executable), Path(sys.prefix), APP_DIR, root]):
        try:
            uid = pwd.getpwnam(user).pw_uid
            env = flwr_env(root / "home-operator")
            env["FLWR_BIN"] = str(BIN)
            can_run = _as(user, BIN / "python", "-c", "import flwr, torch, fedsyn_client")
            assert can_run.returncode == 0, f"{user} cannot run the venv's Python: {can_run.stderr[-2000:]}"

            # ---- the institution: an approved app, two nodes' data (the operator is root)
            allow = root / "node" / "allow-list.txt"
            allow.parent.mkdir()
            approved = subprocess.run([BIN / "fedsyn", "node", "approve", APP_DIR, "--allow-list", allow, "--note",
                                       "reviewed by the test"], capture_output=True, text=True, check=False, env=env)
            assert approved.returncode == 0, approved.stderr
            nodes = {}
            for offset, tier in ((100, "strong"), (200, "weak")):
                nodes[tier] = {"tier": tier, "data": root / f"{tier}.csv", "state": root / "node" / f"state-{tier}",
                               "audit": root / "node" / f"audit-{tier}", "work": root / "node" / f"work-{tier}"}
                _write_csv(nodes[tier]["data"], offset)
            dep = _operator(root, nodes)
            dep.public_texts = _write_csv(root / "public.csv", 900, n=30)
            _start_superlink(dep)

            # ---- deploy/start_node.sh --run-as, as root: node-check as the user, then the SuperNode and SuperExec
            for node in nodes.values():
                started = subprocess.run(
                    ["bash", START_NODE, "--superlink", f"127.0.0.1:{dep.port}", "--node-config", _node_config(node),
                     "--allow-list", allow, "--work", node["work"], "--run-as", user],
                    capture_output=True, text=True, timeout=300, check=False, env=env)
                assert started.returncode == 0, started.stdout + started.stderr
                assert f"ClientApps run as {user}" in started.stdout, started.stdout
                for folder in ("state", "audit"):  # made the user's by the script, private
                    st = node[folder].stat()
                    assert st.st_uid == uid and stat.S_IMODE(st.st_mode) == 0o700, (folder, oct(st.st_mode))
                private = [node["work"] / "clientapp-home", *node["work"].glob("*.log")]  # no other user reads them
                assert len(private) == 4 and all(not p.stat().st_mode & 0o077 for p in private), private
            superexecs = [_pids(n["work"])["superexec"] for n in nodes.values()]
            deadline = time.time() + 90
            while dep.online_nodes() < 2:
                assert time.time() < deadline, "the SuperNodes did not come online\n" + "\n".join(
                    (n["work"] / "supernode.log").read_text()[-2000:] for n in nodes.values())
                time.sleep(1)

            # ---- a small fedsyn run to the end, the ClientApps watched while it runs
            watch = _Watch(superexecs)
            watch.start()
            code, output, status = dep.run({**TINY, "dataset": str(root / "public.csv"), "out-dir": str(root / "out"),
                                            "run-name": "run-as"})
            watch.done.set()
            watch.join()
            logs = "\n".join(f"--- {p}\n{p.read_text(errors='replace')[-3000:]}"
                             for n in nodes.values() for p in sorted(n["work"].glob("*.log")))
            assert status.get("status") == "finished:completed", output[-4000:] + logs
            clientapps = {pid: owner for pid, (owner, cmd) in watch.seen.items() if "flwr-clientapp" in cmd}
            assert clientapps, f"no ClientApp process was seen under the SuperExecs: {watch.seen}"
            assert {owner for owner, _ in watch.seen.values()} == {uid}, watch.seen  # every process, not only these

            # ---- the run's releases are in each node's ledger, written by the ClientApp user
            run_id = status["run-id"]
            for node in nodes.values():
                book = _ledger(node["state"])
                phases = sorted(r["phase"] for r in book["releases"] if r["run_id"] == run_id)
                assert phases == sorted({"strong": ["train", "profile", "vote"], "weak": ["profile", "vote"]}[
                    node["tier"]]), book
                assert all(p.stat().st_uid == uid for p in node["state"].rglob("*")), "state not the user's"
                assert list(node["audit"].glob("node-*.jsonl")), "no outgoing-message log in the audit-dir"

            # ---- the user can change nothing that decides which code runs on the records
            gate = nodes["weak"]["work"] / "gate"
            trees = Path(f"{allow}.apps")
            targets = [gate, gate / "flwr-clientapp", allow, allow.parent, trees, *trees.rglob("*.py")][:12]
            targets += [BIN, BIN / "python", Path(sys.prefix), next(Path(sys.prefix).rglob("site-packages"))]
            for target in targets:
                touched = _as(user, "sh", "-c", f'test -w "{target}" || {{ [ -d "{target}" ] && touch '
                                                 f'"{target}/x" 2>/dev/null; }}')
                assert touched.returncode != 0, f"{user} can write {target}"

            # ---- node-check, run as the ClientApps run, refuses each ownership mistake (and passes once fixed)
            weak = nodes["weak"]
            check_env = dict(env, PATH=f"{gate}{os.pathsep}{env['PATH']}", HOME=str(weak["work"] / "clientapp-home"))

            def node_check() -> subprocess.CompletedProcess:
                return _as(user, "env", *(f"{k}={v}" for k, v in check_env.items()), BIN / "fedsyn", "node-check",
                           "--node-config", _node_config(weak), timeout=300)

            mistakes = [
                (allow, lambda p: os.chown(p, uid, -1), "owned by the ClientApp user"),
                (gate, lambda p: p.chmod(0o777), "is writable by other users"),
                (next(trees.rglob("client_app.py")), lambda p: os.chown(p, uid, -1), "owned by the ClientApp user"),
                (weak["state"], lambda p: os.chown(p, 0, 0), "state-dir"),
            ]
            for path, harm, said in mistakes:
                before = path.stat()
                harm(path)
                try:
                    refused = node_check()
                finally:
                    os.chown(path, before.st_uid, before.st_gid)
                    path.chmod(stat.S_IMODE(before.st_mode))
                assert refused.returncode == 1 and said in refused.stderr and str(path) in refused.stderr, (
                    path, refused.stdout[-1500:], refused.stderr[-1500:])
            ready = node_check()
            assert ready.returncode == 0 and f"ClientApps run as {user}" in ready.stdout, ready.stderr[-2000:]

            # ---- the people who sign off read a page of the deployed node's ledger
            page = root / "ledger.html"
            shown = subprocess.run([BIN / "fedsyn", "ledger", weak["state"], "--html", page, "--allow-list", allow,
                                    "--audit-dir", weak["audit"]], capture_output=True, text=True, check=False, env=env)
            assert shown.returncode == 0, shown.stderr
            html = page.read_text()
            assert str(run_id) in html and "reviewed by the test" in html, html[:2000]

            # ---- the stop script stops every process it started, the user's included
            trees_of = {tier: with_descendants(list(_pids(n["work"]).values())) for tier, n in nodes.items()}
            for tier, node in nodes.items():
                stopped = subprocess.run(["bash", STOP, node["work"]], capture_output=True, text=True, timeout=60,
                                         check=False)
                assert stopped.returncode == 0, stopped.stderr
                time.sleep(0.5)
                assert not [p for p in trees_of[tier] if alive(p)], (tier, stopped.stdout)

            # ---- the node as a service: `fedsyn node service`, checked by systemd-analyze, its command line run
            unit, settings = _service(weak, allow, dep.port, user, root / "etc", env)
            argv = _exec_start(unit.read_text(), settings)
            for attempt in ("crash", "stop"):
                with (root / f"service-{attempt}.log").open("w") as log:
                    main = subprocess.Popen(argv, env={"PATH": SYSTEMD_PATH, **settings}, stdout=log,
                                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd="/")
                said = lambda: (root / f"service-{attempt}.log").read_text(errors="replace")  # noqa: E731
                deadline = time.time() + 180
                while dep.online_nodes() < 1:
                    assert main.poll() is None and time.time() < deadline, said()[-3000:]
                    time.sleep(1)
                assert "node ready:" in said() and f"ClientApps run as {user}" in said(), said()[-3000:]
                tree = with_descendants([main.pid])
                supernode = next(pid for pid in tree if "flower-supernode" in _command(pid))
                if attempt == "crash":  # the SuperNode dies: the rest is stopped, exit 1 (systemd restarts it)
                    os.kill(supernode, signal.SIGKILL)
                    assert main.wait(timeout=60) == 1, said()[-3000:]
                    assert "a node process exited" in said()
                else:  # systemctl stop: TERM to the main process stops the SuperNode and SuperExec, exit 0
                    main.send_signal(signal.SIGTERM)
                    assert main.wait(timeout=60) == 0, said()[-3000:]
                time.sleep(0.5)
                assert not [pid for pid in tree if alive(pid)], (attempt, said()[-3000:])
                deadline = time.time() + 60
                while dep.online_nodes() > 0 and time.time() < deadline:  # the SuperLink sees it go
                    time.sleep(1)
        finally:
            if dep is not None:
                for node in dep.nodes.values():
                    if (node["work"] / "pids").exists():
                        subprocess.run(["bash", STOP, node["work"]], capture_output=True, timeout=60, check=False)
                _stop_all(dep)
    shutil.rmtree(root, ignore_errors=True)


def _command(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _service(node: dict, allow: Path, port: int, user: str, out: Path, env: dict[str, str]) -> tuple[Path, dict]:
    """``fedsyn node service`` for ``node``; returns the unit's path and its environment file's
    settings (``_env_settings``)."""
    written = subprocess.run([BIN / "fedsyn", "node", "service", "--name", "weak", "--out", out, "--superlink",
                              f"127.0.0.1:{port}", "--node-config", _node_config(node), "--allow-list", allow,
                              "--work", node["work"], "--run-as", user], capture_output=True, text=True, check=False,
                             env=env)
    assert written.returncode == 0, written.stderr
    unit = out / "fedsyn-node-weak.service"
    if shutil.which("systemd-analyze"):
        verified = subprocess.run(["systemd-analyze", "verify", unit], capture_output=True, text=True, check=False)
        assert verified.returncode == 0 and not verified.stderr.strip(), verified.stderr
    settings = _env_settings(out / "fedsyn-node-weak.env")
    assert settings["FEDSYN_NODE_CONFIG"] == _node_config(node)  # the node config's quotes arrive as written
    assert "Restart=on-failure" in unit.read_text().splitlines()
    return unit, settings


def _env_settings(path: Path) -> dict[str, str]:
    """An environment file's settings read as systemd reads them (KEY="value", a backslash escaping
    " \\ ` $ inside the quotes; # and ; lines are comments)."""
    settings = {}
    for line in path.read_text().splitlines():
        if line.strip() and not line.startswith(("#", ";")):
            key, _, value = line.partition("=")
            if value[:1] == value[-1:] == '"':
                value = re.sub(r'\\(["\\`$])', r"\1", value[1:-1])
            settings[key] = value
    return settings


def _exec_start(unit: str, settings: dict[str, str]) -> list[str]:
    """The unit's ExecStart= as systemd runs it: words split on spaces, each ``${KEY}`` one argument."""
    line = next(line for line in unit.splitlines() if line.startswith("ExecStart="))
    words = line.removeprefix("ExecStart=").split()
    return [settings[w[2:-1]] if re.fullmatch(r"\$\{\w+\}", w) else w for w in words]
