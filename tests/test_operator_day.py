"""Issue 64: docs/deployment.md's operator's day, followed as written, from a fresh venv to a finished run.

Each ```bash block of the section runs as written, with the machine's paths, the SuperLink's
address, the ClientApp user and ``max-records`` replaced by the test's own (``_SUBSTITUTE``);
``systemctl`` and ``journalctl`` lines, which need a running systemd, are done by the test with
the unit's command line run as written (``tests/test_run_as.py`` reads it the same way). The
operator's side: a SuperLink with TLS (deploy/generate_certs.sh), a strong node beside the doc's
weak one, and ``flwr run`` of the reviewed checkout, then of the updated one. Slow (a fresh venv
installs every dependency): a session check, covered in CI by the run-as test.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from fedsyn_client.approval import build_fab, install_tree
from fedsyn_client.fab_gate import fab_sha256
from fedsyn_server.flwr_runner import APP_DIR, alive, free_port, with_descendants
from tests.test_deployment import BIN, CONNECTION, TINY, Deployment, _ledger, _overrides, _start, _stop_all, _write_csv
from tests.test_run_as import SYSTEMD_PATH, _clientapp_user, _enterable, _env_settings, _exec_start

pytestmark = [
    pytest.mark.flwr,
    pytest.mark.session(covered_by="tests/test_run_as.py::"
                                   "test_a_node_started_with_run_as_runs_its_clientapps_as_that_user_who_can_change_"
                                   "nothing_that_decides_the_code"),
    pytest.mark.skipif(os.geteuid() != 0 or not Path("/usr/bin/python3").exists(),
                       reason="the operator's day is run as root with the system's Python"),
]
DOC = APP_DIR / "docs" / "deployment.md"
COPY_IGNORE = shutil.ignore_patterns(".git", ".venv", ".ci-venv", "outputs", "results", "__pycache__", "*.egg-info",
                                     ".pytest_cache", "build")


def operator_day() -> list[str]:
    """The ```bash blocks of docs/deployment.md's "An operator's day", in order."""
    text = DOC.read_text()
    start = text.index("## An operator's day")
    section = text[start:text.index("\nSettings live in", start)]  # the paragraph after the day's last step
    return re.findall(r"```bash\n(.*?)```", section, flags=re.S)


def _substitute(block: str, root: Path, port: int, user: str) -> str:
    for old, new in (("/opt/fedsyn-node", f"{root}/opt/fedsyn-node"), ("/srv/review", f"{root}/review"),
                     ("/etc/fedsyn", f"{root}/etc/fedsyn"), ("/var/lib/fedsyn", f"{root}/var/lib/fedsyn"),
                     ("/var/log/fedsyn", f"{root}/var/log/fedsyn"), ("/data/notes.csv", f"{root}/data/notes.csv"),
                     ("superlink.example.org:8000", f"127.0.0.1:{port}"), ("fedsyn-app", user),
                     ("max-records=10000", "max-records=100")):  # a test's file of 40 records
        block = block.replace(old, new)
    return block


def test_the_operator_day_runs_as_written_from_a_fresh_venv_to_a_finished_run():
    blocks = operator_day()
    assert len(blocks) == 8, "install, approve, check, start, watch, stop, audit, update"
    root = Path(tempfile.mkdtemp(prefix="fedsyn-day-"))
    root.chmod(0o755)
    dep: Deployment | None = None
    service: subprocess.Popen | None = None
    with _clientapp_user() as user, _enterable([root]):
        try:
            port = free_port()
            blocks = [_substitute(b, root, port, user) for b in blocks]
            useradd = next(line for line in blocks[0].splitlines() if line.startswith("useradd"))
            blocks[0] = blocks[0].replace(useradd + "\n", "")  # the test made the user (and removes it)
            # the machine: the reviewed checkout (and its next version), the data, the certificates
            shutil.copytree(APP_DIR, root / "review" / "fedsyn", ignore=COPY_IGNORE)
            shutil.copytree(root / "review" / "fedsyn", root / "review" / "fedsyn-next")
            with (root / "review" / "fedsyn-next" / "README.md").open("a") as fh:
                fh.write("\n<!-- the next version -->\n")
            (root / "data").mkdir()
            node_texts = _write_csv(root / "data" / "notes.csv", 100)
            certs = subprocess.run([APP_DIR / "deploy" / "generate_certs.sh", root / "certs"], capture_output=True,
                                   text=True, check=False)
            assert certs.returncode == 0, certs.stderr
            (root / "etc" / "fedsyn").mkdir(parents=True)
            shutil.copy(root / "certs" / "ca.crt", root / "etc" / "fedsyn" / "ca.crt")
            assignments = "\n".join(line for line in blocks[0].splitlines()
                                    if line.startswith(("export ", "NODE=", "START=")))

            def step(i: int, timeout: float = 600) -> str:
                """Block ``i`` without its systemctl/journalctl lines, in bash, after block 1's settings."""
                lines = [ln for ln in blocks[i].splitlines() if not ln.startswith(("systemctl", "journalctl"))]
                script = "set -euo pipefail\n" + (assignments + "\n" if i else "") + "\n".join(lines) + "\n"
                env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", FLWR_TELEMETRY_ENABLED="0",
                           PIP_DISABLE_PIP_VERSION_CHECK="1")
                env["PATH"] = SYSTEMD_PATH
                res = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=timeout,
                                     check=False, env=env, cwd=root)
                assert res.returncode == 0, f"step {i + 1}:\n{script}\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}"
                return res.stdout + res.stderr

            # ---- 1-3: install, approve, check (and write the service)
            t0 = time.time()
            step(0, timeout=1800)
            print(f"install: {time.time() - t0:.0f} s")
            step(1)
            checked = step(2)
            assert "node ready:" in checked and f"ClientApps run as {user}" in checked, checked[-3000:]
            unit = root / "etc" / "fedsyn" / "fedsyn-node-notes.service"
            settings = _env_settings(unit.with_suffix(".env"))
            argv = _exec_start(unit.read_text(), settings)
            assert argv[0].startswith("/") and str(root / "review" / "fedsyn" / "deploy") in argv[1]

            # ---- the operator's side: a SuperLink with TLS, a strong node, the CLI's connection
            dep = Deployment(root=root, port=port, cli_home=root / "home-cli", nodes={})
            dep.cli_home.mkdir()
            (dep.cli_home / "config.toml").write_text(
                f'[superlink]\ndefault = "{CONNECTION}"\n\n[superlink.{CONNECTION}]\naddress = "127.0.0.1:{port}"\n'
                f'root-certificates = "{root / "certs" / "ca.crt"}"\n')
            _start(dep, "superlink", [str(BIN / "flower-superlink"), "--host", "127.0.0.1", "--port", str(port),
                                      "--ssl-ca-certfile", str(root / "certs" / "ca.crt"), "--ssl-certfile",
                                      str(root / "certs" / "server.pem"), "--ssl-keyfile",
                                      str(root / "certs" / "server.key"), "--database", str(root / "superlink.db"),
                                      "--disable-runtime-dependency-installation"], root / "home-superlink")
            strong_allow = root / "strong" / "allow-list.txt"
            strong_allow.parent.mkdir()
            for checkout in ("fedsyn", "fedsyn-next"):
                fab = build_fab(root / "review" / checkout)
                install_tree(fab, strong_allow)
                with strong_allow.open("a") as fh:
                    fh.write(f"{fab_sha256(fab)}  # {checkout}\n")
            from fedsyn_client.approval import install_launcher

            _write_csv(root / "strong" / "strong.csv", 500)
            dep.nodes["strong"] = {"data": root / "strong" / "strong.csv", "state": root / "strong" / "state",
                                   "tier": "strong", "gate": install_launcher(root / "strong" / "gate",
                                                                              strong_allow).parent}
            strong_config = (f'tier="strong" data-path="{root / "strong" / "strong.csv"}" max-records=100 '
                             f'state-dir="{root / "strong" / "state"}" epsilon=8')
            _start(dep, "strong", [str(dep.nodes["strong"]["gate"] / "flower-supernode"), "--superlink",
                                   f"127.0.0.1:{port}", "--root-certificates", str(root / "certs" / "ca.crt"),
                                   "--port", str(free_port()), "--node-config", strong_config],
                   root / "home-strong", path_first=dep.nodes["strong"]["gate"])

            def start() -> subprocess.Popen:
                """systemctl start: the unit's command line, as written, with its environment file."""
                log = (root / "service.log").open("a")
                return subprocess.Popen(argv, env={"PATH": SYSTEMD_PATH, **settings}, stdout=log,
                                        stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd="/")

            def stop(proc: subprocess.Popen) -> None:
                """systemctl stop: TERM to the main process; it stops the rest and exits 0."""
                tree = with_descendants([proc.pid])
                proc.send_signal(signal.SIGTERM)
                assert proc.wait(timeout=60) == 0, (root / "service.log").read_text()[-3000:]
                time.sleep(0.5)
                assert not [p for p in tree if alive(p)]

            def online(count: int) -> None:
                deadline = time.time() + 180
                while dep.online_nodes() < count:
                    assert service is None or service.poll() is None, (root / "service.log").read_text()[-3000:]
                    assert time.time() < deadline, (root / "service.log").read_text()[-3000:] + dep.diagnostics()
                    time.sleep(1)

            def run(checkout: str, name: str) -> str:
                res = dep.flwr("run", str(root / "review" / checkout), CONNECTION, "--stream", "--run-config",
                               _overrides({**TINY, "epsilon": 3.0, "dataset": str(root / "strong" / "strong.csv"),
                                           "out-dir": str(root / "out"), "run-name": name}), timeout=400)
                output = res.stdout + res.stderr
                status = dep.status(output)
                assert status.get("status") == "finished:completed", output[-4000:] + dep.diagnostics() + (
                    root / "service.log").read_text()[-3000:]
                return status["run-id"]

            # ---- 4: start; 5: watch (after the server's run)
            service = start()
            online(2)
            first = run("fedsyn", "day-1")
            watched = step(4)
            assert "budget" in watched and str(first)[-8:] in watched, watched[-2000:]
            page = (root / "var" / "lib" / "fedsyn" / "ledger.html").read_text()
            assert str(first) in page and "reviewed by the DPO" in page and "data:image/png;base64," in page
            assert "node ready:" in (root / "service.log").read_text()  # journalctl: node-check ran at start
            state = root / "var" / "lib" / "fedsyn" / "state"
            assert {r["phase"] for r in _ledger(state)["releases"] if r["run_id"] == first} == {"profile", "vote"}

            # ---- 6: stop; 7: audit (nothing sent, the ledger untouched)
            stop(service)
            service = None
            before = _ledger(state)["releases"]
            audited = step(6, timeout=900)
            assert "profile" in audited and "vote" in audited and "FAILED" not in audited, audited[-3000:]
            assert _ledger(state)["releases"] == before

            # ---- 8: update the app, restart, a run of the new version
            step(7)
            service = start()
            online(2)
            second = run("fedsyn-next", "day-2")
            assert {r["phase"] for r in _ledger(state)["releases"] if r["run_id"] == second} == {"profile", "vote"}
            server_files = "\n".join(p.read_text(errors="replace") for p in (root / "out").rglob("*")
                                     if p.is_file() and p.suffix in {".json", ".jsonl"})
            assert not [t for t in node_texts if t in server_files], "a record of the node reached the server"
            stop(service)
            service = None
        finally:
            if service is not None and service.poll() is None:
                stop_tree = with_descendants([service.pid])
                service.send_signal(signal.SIGTERM)
                try:
                    service.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    for pid in stop_tree:
                        try:
                            os.kill(pid, signal.SIGKILL)
                        except ProcessLookupError:
                            pass
            if dep is not None:
                _stop_all(dep)
    shutil.rmtree(root, ignore_errors=True)
