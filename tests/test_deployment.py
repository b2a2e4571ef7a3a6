"""The real deployment on loopback: ``flower-superlink`` + two ``flower-supernode`` + ``flwr run``.

Two institutions (one strong, one weak) each run a SuperNode with their own CSV, their own
``state-dir`` (privacy ledger) and their own budget in ``--node-config``; the operator
submits fedsyn to the SuperLink through a ``[superlink.deploy-test]`` connection. Then the
same nodes are asked again with their budgets spent: they must refuse, and their ledgers
must not grow. Everything started here is stopped by PID in the fixture's teardown.

Flower 1.41 facts this relies on (read from its source): the SuperLink serves the Fleet,
Control and Runtime APIs over HTTP on one ``--host``/``--port`` (default 127.0.0.1:8000;
``--fleet-api-address``/``--control-api-address`` are deprecated and only start the
legacy gRPC servers when ``FLWR_INTERNAL_GRPC_*_API=1``); each SuperNode serves its
Runtime API on ``--port`` (default 9094); ``flwr run --stream`` returns when the run
ends, with exit code 0 even when the ServerApp failed, so the run's status is read
with ``flwr list --run-id``.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import tomllib
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd
import pytest

from common.io import read_jsonl
from fedsyn_server.flwr_runner import (
    APP_DIR,
    alive,
    flwr_env,
    free_port,
    processes,
    stop_pids,
    stop_processes_of,
    toml_value,
    with_descendants,
)

pytestmark = pytest.mark.flwr

BIN = Path(sys.executable).parent
CONNECTION = "deploy-test"
EPSILON = 8.0
TOPICS = {
    "a": ["The river flows past the old mill number {}.", "Boats drift along the quiet river at dawn {}.",
          "Fish swim under the stone river bridge {}."],
    "b": ["The market opened with strong trading on day {}.", "Shares rose after the bank report {}.",
          "Investors bought government bonds in week {}."],
    "c": ["The home team won the final match {}.", "Fans cheered the striker's late goal {}.",
          "The coach praised the defence after game {}."],
}
CODES = "topic=a,topic=b,topic=c"
TINY = {
    "model": "tiny-gpt2", "num-server-rounds": 1, "local-steps": 2, "batch-size": 4, "num-synthetic": 12,
    "max-new-tokens": 8, "min-nodes": 2, "control-codes": CODES, "test-fraction": 0.1,
}
RUN_TIMEOUT = 240  # seconds per `flwr run`; two runs + start-up stay well under 6 minutes
_STARTED = re.compile(r"Successfully started run (\d+)")


# --------------------------------------------------------------------------- helpers
def _port_open(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return True
    except OSError:
        return False


def _write_csv(path: Path, offset: int, n: int = 40) -> list[str]:
    """``n`` records, topics a/b/c in turn, each sentence unique (numbered from ``offset``)."""
    import csv

    texts = []
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["text", "topic", "source"])
        for i in range(n):
            topic = "abc"[i % 3]
            text = TOPICS[topic][(i // 3) % 3].format(offset + i)
            writer.writerow([text, topic, "wire" if i % 2 else "desk"])
            texts.append(text)
    return texts


def _ledger(state_dir: Path) -> dict:
    files = sorted(state_dir.glob("ledger*.json"))
    assert len(files) == 1, f"expected one ledger in {state_dir}, found {files}"
    return json.loads(files[0].read_text())


def _spent(ledger: dict) -> float:
    return sum(float(r["epsilon"]) for r in ledger["releases"])


def _overrides(run_config: dict[str, object]) -> str:
    """``run_config`` as one ``flwr run --run-config`` string."""
    return " ".join(f"{k}={toml_value(v)}" for k, v in run_config.items())


def _progress(run_dir: Path) -> dict:
    """The run's checkpointed progress (stages done, phase-1 round), or {} before the first one."""
    try:
        return json.loads((run_dir / "checkpoint" / "state.json").read_text())["progress"]
    except (OSError, ValueError, KeyError):
        return {}


# --------------------------------------------------------------------------- deployment
@dataclass
class Deployment:
    """A running SuperLink + SuperNodes on loopback and the operator's CLI home."""

    root: Path
    port: int
    cli_home: Path
    nodes: dict[str, dict]  # name -> {"data", "state", "tier"}
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    public_texts: list[str] = field(default_factory=list)
    node_texts: list[str] = field(default_factory=list)

    def env(self, home: Path) -> dict[str, str]:
        env = flwr_env(home)
        for key in ("FLWR_INTERNAL_GRPC_CONTROL_API", "FLWR_INTERNAL_GRPC_FLEET_API"):
            env.pop(key, None)  # HTTP APIs only, as a default SuperLink
        return env

    def log(self, name: str) -> str:
        path = self.root / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def flwr(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
        return subprocess.run([str(BIN / "flwr"), *args], env=self.env(self.cli_home), capture_output=True,
                              text=True, timeout=timeout, check=False)

    def online_nodes(self) -> int:
        res = self.flwr("supernode", "list", CONNECTION, "--format", "json", timeout=30)
        try:
            return sum(n["status"] == "online" for n in json.loads(res.stdout)["nodes"])
        except (ValueError, KeyError):
            return 0

    def run(self, run_config: dict[str, object], timeout: float = RUN_TIMEOUT) -> tuple[int, str, dict]:
        """``flwr run APP deploy-test --stream``; returns (exit code, output, `flwr list` record)."""
        try:
            res = self.flwr("run", str(APP_DIR), CONNECTION, "--stream", "--run-config", _overrides(run_config),
                            timeout=timeout)
            code, output = res.returncode, res.stdout + res.stderr
        except subprocess.TimeoutExpired as err:
            out = err.stdout or ""
            output = (out.decode(errors="replace") if isinstance(out, bytes) else out)
            code = -1
            output += f"\nTIMEOUT after {timeout}s"
        return code, output, self.status(output)

    def plan(self, run_config: dict[str, object]) -> tuple[int, str, str]:
        """``fedsyn plan APP deploy-test --run-config ...``; returns (exit code, stdout, stderr)."""
        res = subprocess.run([str(BIN / "fedsyn"), "plan", str(APP_DIR), CONNECTION, "--run-config",
                              _overrides(run_config)], env=self.env(self.cli_home), capture_output=True, text=True,
                             timeout=RUN_TIMEOUT, check=False, cwd=self.root)
        return res.returncode, res.stdout, res.stderr

    def diagnostics(self) -> str:
        return "\n".join(f"--- {n}.log (tail)\n{self.log(n)[-3000:]}" for n in self.procs)

    def start_node(self, name: str, process: str = "") -> None:
        """Start (or restart, as ``process``) the SuperNode of institution ``name``: its own data,
        state-dir (ledger) and budget, on a fresh Runtime API port, behind its own FAB gate (its
        launcher first in PATH, its allow-list holding the hash of the app the tests run)."""
        node = self.nodes[name]
        node_config = (f'tier="{node["tier"]}" data-path="{node["data"]}" max-records=100 state-dir="{node["state"]}" '
                       f"epsilon={EPSILON} {node.get('policy', '')}").strip()
        _start(self, process or name, [
            # the gate's SuperNode launcher: Flower's own, its FAB reads behind the gate (issue 60)
            str(node["gate"] / "flower-supernode"), "--insecure", "--superlink", f"127.0.0.1:{self.port}",
            "--port", str(free_port()), "--node-config", node_config,
        ], self.root / f"home-{process or name}", path_first=node["gate"])

    def wait_for(self, condition, run: subprocess.Popen, log_name: str, what: str) -> None:
        """Poll ``condition`` until it holds; fail (with the logs) if ``run`` ends first or time runs out."""
        deadline = time.time() + RUN_TIMEOUT
        while not condition():
            assert run.poll() is None, (f"the run ended before {what}\n" + self.log(log_name)[-3000:]
                                        + self.diagnostics())
            assert time.time() < deadline, f"no {what} in {RUN_TIMEOUT}s\n" + self.diagnostics()
            time.sleep(0.5)

    def kill(self, process: str) -> None:
        """SIGKILL a SuperNode and every process under it (its ClientApps): a crash, no clean-up."""
        for pid in with_descendants([self.procs[process].pid]):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.procs[process].wait(timeout=10)

    def start_run(self, run_config: dict[str, object], log_name: str) -> subprocess.Popen:
        """``flwr run --stream`` in the background, its output in ``<log_name>.log``."""
        with (self.root / f"{log_name}.log").open("w") as log:
            return subprocess.Popen([str(BIN / "flwr"), "run", str(APP_DIR), CONNECTION, "--stream", "--run-config",
                                     _overrides(run_config)], env=self.env(self.cli_home), stdout=log,
                                    stderr=subprocess.STDOUT)

    def status(self, output: str) -> dict:
        """The `flwr list` record of the run whose id ``output`` (of `flwr run`) names, or {}."""
        match = _STARTED.search(output)
        if not match:
            return {}
        listed = self.flwr("list", CONNECTION, "--run-id", match.group(1), "--format", "json")
        try:
            return json.loads(listed.stdout)["runs"][0]
        except (ValueError, KeyError, IndexError):
            return {"raw": listed.stdout + listed.stderr}


def _start(dep: Deployment, name: str, args: list[str], home: Path, path_first: Path | None = None) -> None:
    home.mkdir(parents=True, exist_ok=True)
    log = (dep.root / f"{name}.log").open("w")
    env = dep.env(home)
    if path_first is not None:
        env["PATH"] = f"{path_first}{os.pathsep}{env['PATH']}"
    dep.procs[name] = subprocess.Popen(args, env=env, stdout=log, stderr=subprocess.STDOUT,
                                       stdin=subprocess.DEVNULL, cwd=dep.root)
    log.close()


def _gate(folder: Path, approved: bytes) -> Path:
    """A node's FAB gate as the institution installs it: its launchers in ``folder/bin`` and an
    allow-list approving the FAB ``approved`` (its tree installed beside it, as ``fedsyn node
    approve`` does); returns the folder to put first in the SuperNode's PATH."""
    from fedsyn_client.approval import install_launcher, install_tree
    from fedsyn_client.fab_gate import fab_sha256

    allow_list = folder / "allow-list.txt"
    folder.mkdir(parents=True, exist_ok=True)
    install_tree(approved, allow_list)
    allow_list.write_text(f"{fab_sha256(approved)}  # the app under test\n")
    return install_launcher(folder / "bin", allow_list).parent


@contextmanager
def _deploy(tmp_path: Path, tiers: dict[str, str], policies: dict[str, str] | None = None,
            superlink: list[str] | None = None, write_data=_write_csv):
    """A SuperLink and one SuperNode per ``tiers`` entry (name -> tier), each with its own CSV
    and state-dir; yields the running ``Deployment`` and stops every process it started by PID.
    ``superlink``: the command that starts the SuperLink (default: Flower's ``flower-superlink``);
    ``write_data(path, offset, n=40)``: writes a node's (or, n=30, the public) CSV, returns its texts."""
    # A uniquely named root: every process we start names it on its command line.
    root = Path(tempfile.mkdtemp(prefix="fedsyn-deploy-", dir=tmp_path))
    nodes = {}
    node_texts = []
    approved = _approved_fab()
    for offset, (name, tier) in zip(range(100, 1000, 100), tiers.items()):
        data = root / f"{name}.csv"
        node_texts += write_data(data, offset)
        nodes[name] = {"data": data, "state": root / f"state-{name}", "tier": tier,
                       "policy": (policies or {}).get(name, ""),  # more node-config keys of the institution
                       "gate": _gate(root / f"gate-{name}", approved)}
    public = root / "public.csv"  # the server's public dataset: vocabulary + held-out loss
    dep = _operator(root, nodes)
    dep.public_texts, dep.node_texts = write_data(public, 900, n=30), node_texts
    t0 = time.time()
    try:
        _start_superlink(dep, superlink)
        for name in nodes:
            dep.start_node(name)
        deadline = time.time() + 90
        while dep.online_nodes() < len(nodes):
            for name, proc in dep.procs.items():
                assert proc.poll() is None, f"{name} exited\n" + dep.diagnostics()
            assert time.time() < deadline, "SuperNodes did not come online\n" + dep.diagnostics()
            time.sleep(1)
        print(f"deployment up in {time.time() - t0:.1f}s on 127.0.0.1:{dep.port}")
        yield dep
    finally:
        _stop_all(dep)


def _operator(root: Path, nodes: dict[str, dict] | None = None) -> Deployment:
    """The operator's side in ``root``: a Deployment (SuperLink port, CLI home whose config names
    it as CONNECTION and keeps Flower's local simulation the default) with no process started."""
    dep = Deployment(root=root, port=free_port(), cli_home=root / "home-cli", nodes=nodes or {})
    dep.cli_home.mkdir()
    # The operator's default stays Flower's local simulation: every command must name the deployment
    # (and fedsyn must ask that SuperLink, not the default one, how a run ended).
    (dep.cli_home / "config.toml").write_text(
        '[superlink]\ndefault = "local"\n\n[superlink.local]\naddress = ":local:"\n\n'
        f'[superlink.{CONNECTION}]\naddress = "127.0.0.1:{dep.port}"\ninsecure = true\n'
    )
    return dep


def _start_superlink(dep: Deployment, superlink: list[str] | None = None) -> None:
    """Start the SuperLink (``superlink``: its command, default Flower's) and wait for its port."""
    _start(dep, "superlink", [
        *(superlink or [str(BIN / "flower-superlink")]), "--insecure", "--host", "127.0.0.1",
        "--port", str(dep.port),
        "--database", str(dep.root / "superlink.db"), "--disable-runtime-dependency-installation",
    ], dep.root / "home-superlink")
    deadline = time.time() + 60
    while not _port_open(dep.port):
        assert dep.procs["superlink"].poll() is None, "SuperLink exited\n" + dep.diagnostics()
        assert time.time() < deadline, "SuperLink did not open its port\n" + dep.diagnostics()
        time.sleep(0.3)


def _stop_all(dep: Deployment) -> None:
    """Stop what the test started: SuperNodes first, then the SuperLink, each with its whole tree
    (SuperExec, flwr-serverapp, flwr-clientapp) collected before any signal is sent; then whatever
    else names the deployment's folder (e.g. a stuck `flwr run`). Fails if anything survives."""
    for name in [*(n for n in dep.procs if n != "superlink"), "superlink"]:
        if name in dep.procs:
            stop_pids(with_descendants([dep.procs[name].pid]), timeout=15)
            dep.procs[name].wait(timeout=5)
    stop_processes_of(dep.root)
    survivors = [p for p, cmd in processes().items() if alive(p) and str(dep.root) in cmd]
    assert not survivors, f"processes still alive after teardown: {survivors}"


def _approved_fab() -> bytes:
    """The FAB of the app the tests run (``flwr run APP_DIR``), as an operator approves it."""
    from fedsyn_client.approval import build_fab

    return build_fab(APP_DIR)


@pytest.fixture
def deployment(tmp_path):
    with _deploy(tmp_path, {"strong": "strong", "weak": "weak"}) as dep:
        yield dep


# --------------------------------------------------------------------------- the test
def test_deployment_a_fab_one_line_off_the_approved_one_is_refused_before_it_is_imported(deployment):
    """Issue 32: the server ships a ClientApp that differs from the reviewed one by one line (it
    reads a record at import). Both nodes refuse its FAB before a byte is unpacked: no line of it
    runs, their records and ledgers are untouched, and the server gets only the gate's fixed text.
    (The approved FAB runs whole runs through the same gate in every other deployment test.)"""
    import shutil

    dep = deployment
    evil = dep.root / "evil-app"
    shutil.copytree(APP_DIR, evil, ignore=shutil.ignore_patterns(
        ".git", ".venv", ".ci-venv", "outputs", "results", "__pycache__", "*.egg-info", ".pytest_cache", "docs",
        "tests", "benchmarks", "examples"))
    marker = dep.root / "a-record-left"
    with (evil / "fedsyn_client" / "client_app.py").open("a") as fh:
        fh.write(f"\n__import__('pathlib').Path({str(marker)!r}).write_text(open({str(dep.nodes['weak']['data'])!r}).read())\n")
    res = dep.flwr("run", str(evil), CONNECTION, "--stream", "--run-config",
                   _overrides({**TINY, "dataset": str(dep.root / "public.csv"), "out-dir": str(dep.root / "out"),
                               "run-name": "evil"}), timeout=RUN_TIMEOUT)
    output = res.stdout + res.stderr
    diag = output[-4000:] + dep.diagnostics()
    assert dep.status(output).get("status") == "finished:failed", diag
    # Flower's reply for an exception in flwr-clientapp: the gate's class and fixed text, nothing else
    assert output.count("<class '__main__.FabNotApproved'>:<'fab not approved on this node'>") == 2, diag
    assert not marker.exists(), "the unapproved ClientApp ran on a node"
    for name, node in dep.nodes.items():
        assert "refused before anything was unpacked" in dep.log(name), (name, dep.log(name)[-3000:])
        assert not list((dep.root / f"home-{name}").rglob("client_app.py")), f"{name} unpacked the FAB"
        book = _ledger(node["state"]) if list(node["state"].glob("ledger*.json")) else {"releases": []}
        assert book["releases"] == [] and not book.get("holds"), (name, book)
    assert not any(text in output for text in dep.node_texts), "a node's record reached the server"


def test_deployment_two_supernodes_then_budget_refusal(deployment):
    dep = deployment
    out = dep.root / "out"
    public = dep.root / "public.csv"

    # ---- `fedsyn plan`: the nodes' tier query through the SuperLink (free), from the operator's folder
    run_config = {**TINY, "dataset": str(public), "out-dir": str(out), "run-name": "deploy"}
    code, plan_out, plan_err = dep.plan(run_config)
    assert code == 0, plan_out + plan_err + dep.diagnostics()
    assert "2 node(s) answered the tier query: 1 strong, 1 weak" in plan_out, plan_out
    assert plan_out.count(f"epsilon budget {EPSILON:g}") == 2
    # each node's public bound (max-records) fixes its q: the plan shows the noise and the work at it
    assert plan_out.count("max-records 100: every release does the work of 100 records") == 2, plan_out
    assert "DP-SGD noise multiplier" in plan_out and "(q = 0.04," in plan_out, plan_out
    assert "profile: epsilon" in plan_out and "vote: epsilon" in plan_out, plan_out
    for node in dep.nodes.values():  # nothing spent, nothing held, nothing written
        planned = _ledger(node["state"])
        assert planned["releases"] == [] and not planned.get("holds"), planned
    assert not (out / "deploy").exists()

    # ---- run 1: a full fedsyn run over the real Fleet/Control/Runtime APIs
    t0 = time.time()
    code, output, status = dep.run(run_config)
    print(f"run 1: {time.time() - t0:.1f}s, status {status.get('status')}")
    diag = output[-4000:] + "\n" + dep.diagnostics()
    assert code == 0, diag
    assert status.get("status") == "finished:completed", f"{status}\n{diag}"
    run_id = status["run-id"]
    run_dir = out / "deploy"
    synthetic = read_jsonl(run_dir / "synthetic.jsonl")
    assert synthetic, diag

    report = json.loads((run_dir / "privacy_report.json").read_text())
    assert sorted(n["tier"] for n in report["nodes"]) == ["strong", "weak"]

    ledgers = {}
    for name, node in dep.nodes.items():
        ledger = _ledger(node["state"])
        ledgers[name] = ledger
        this_run = [r for r in ledger["releases"] if r["run_id"] == run_id]
        expected = {"strong": ["train", "profile", "vote"], "weak": ["profile", "vote"]}[name]  # voters = "all"
        assert sorted(r["phase"] for r in this_run) == sorted(expected), ledger
        assert ledger["budget"] == EPSILON
        assert _spent(ledger) <= EPSILON + 1e-6
        # The server's report agrees with the node's own bookkeeping.
        reported = next(n for n in report["nodes"] if n["tier"] == name)
        assert reported["epsilon_spent"] == pytest.approx(_spent(ledger), abs=1e-9)
        assert reported["epsilon_budget"] == EPSILON

    # No node record reached the server's outputs (only noised statistics travel).
    server_files = "\n".join(p.read_text(errors="replace") for p in run_dir.rglob("*")
                             if p.is_file() and p.suffix in {".json", ".jsonl"})
    leaked = [t for t in dep.node_texts if t in server_files]
    assert not leaked, f"node records in the server's outputs: {leaked[:3]}"
    assert any(t in server_files for t in dep.public_texts)  # the check can see text at all

    # ---- run 2: same nodes, same ledgers, budgets spent -> the nodes refuse
    t0 = time.time()
    code2, output2, status2 = dep.run({**TINY, "dataset": str(public), "out-dir": str(out),
                                       "run-name": "deploy-again", "epsilon": EPSILON})
    print(f"run 2: {time.time() - t0:.1f}s, exit code {code2}, status {status2.get('status')}")
    diag2 = output2[-4000:] + "\n" + dep.diagnostics()
    assert status2.get("run-id") not in (None, run_id), diag2
    # Flower 1.41 `flwr run --stream` exits 0 even when the ServerApp raised; the status says it.
    assert code2 != 0 or status2.get("status") == "finished:failed", f"{status2}\n{diag2}"
    # pre-flight: both nodes say their ledgers cannot pay for the run; it stops before anything is spent
    assert "run refused before anything was spent: 2 node(s) cannot finish it" in output2, diag2
    assert output2.count("its ledger lacks epsilon") >= 2, diag2
    for name in dep.nodes:
        assert "refused" in dep.log(name), f"{name} did not log a refusal\n{diag2}"
    assert not (out / "deploy-again" / "synthetic.jsonl").exists()
    # the plan of that run says so first, one line per problem, and exits 1
    code, plan_out, plan_err = dep.plan({**TINY, "dataset": str(public), "out-dir": str(out), "epsilon": EPSILON})
    assert code == 1, plan_out + plan_err
    problems = [line for line in plan_err.splitlines() if line.startswith("fedsyn plan: ")]
    assert len(problems) == 1, plan_err  # one line for the run, naming both nodes
    assert "RunRefused: run refused before anything was spent: 2 node(s) cannot finish it" in problems[0]
    assert problems[0].count("its ledger lacks epsilon") == 2

    for name, node in dep.nodes.items():
        after = _ledger(node["state"])
        assert after["releases"] == ledgers[name]["releases"], f"{name}'s ledger grew: {after}"
        assert _spent(after) <= EPSILON + 1e-6
        assert not [r for r in after["releases"] if r["run_id"] == status2["run-id"]]

    # ---- runs 3-5: a curious operator widens the request; each node's policy refuses at stage 0
    attacks = {
        "columns": {"control-columns": "topic,source", "control-codes": ""},  # another view of the same records
        "epsilon": {"epsilon": 1000.0},  # a raised budget
        "delta": {"delta": "0.5"},  # a large delta
    }
    for what, over in attacks.items():
        code3, output3, status3 = dep.run({**TINY, "dataset": str(public), "out-dir": str(out),
                                           "run-name": f"attack-{what}", **over})
        diag3 = output3[-4000:] + "\n" + dep.diagnostics()
        assert code3 != 0 or status3.get("status") == "finished:failed", f"{what}: {status3}\n{diag3}"
        assert output3.count("refused: policy:") >= 2, f"{what}\n{diag3}"
        assert "run refused before anything was spent: 2 node(s) cannot finish it" in output3, diag3

    # The institution's view: `fedsyn ledger` on each node's state-dir.
    for name, node in dep.nodes.items():
        after = _ledger(node["state"])
        assert after["releases"] == ledgers[name]["releases"], f"{name}'s ledger grew: {after}"
        shown = subprocess.run([str(BIN / "fedsyn"), "ledger", str(node["state"]), "--json"], capture_output=True,
                               text=True, timeout=60, check=True)
        summary = json.loads(shown.stdout)
        assert summary["budget"] == EPSILON and 0 < summary["epsilon_spent"] <= EPSILON + 1e-6, summary
        assert summary["epsilon_pld"] <= summary["epsilon_spent"] + 1e-9
        table = subprocess.run([str(BIN / "fedsyn"), "ledger", str(node["state"])], capture_output=True, text=True,
                               timeout=60, check=True).stdout
        assert f"budget           epsilon = {EPSILON:g}" in table and str(run_id)[-8:] in table

    # The nodes survive failed and refused runs (they keep serving).
    for name, proc in dep.procs.items():
        assert proc.poll() is None, f"{name} exited\n{diag2}"


# --------------------------------------------------------------------------- deploy/ scripts
DEPLOY = APP_DIR / "deploy"


def test_local_deployment_scripts_with_tls_and_node_auth(tmp_path):
    """generate_certs.sh + start_local_deployment.sh --example --tls --auth: the three example nodes
    (their shipped data) come online over TLS, an unregistered key is turned away,
    stop_local_deployment.sh stops every PID."""
    root = Path(tempfile.mkdtemp(prefix="fedsyn-scripts-", dir=tmp_path))
    work = root / "work"
    data = work / "example-data"  # written by --example: 30 BBC articles a node
    env = flwr_env(root / "home")
    env["FLWR_BIN"] = str(BIN)

    def run(*args: object, timeout: float = 120) -> subprocess.CompletedProcess:
        return subprocess.run([str(a) for a in args], env=env, capture_output=True, text=True, timeout=timeout,
                              cwd=root, check=False)

    started: list[int] = []
    try:
        certs = run(DEPLOY / "generate_certs.sh", root / "certs", "superlink.example.org")
        assert certs.returncode == 0, certs.stdout + certs.stderr
        san = run("openssl", "x509", "-in", root / "certs" / "server.pem", "-noout", "-ext", "subjectAltName")
        assert "127.0.0.1" in san.stdout and "superlink.example.org" in san.stdout, san.stdout

        start = run(DEPLOY / "start_local_deployment.sh", "--example", "--work", work, "--tls", root / "certs",
                    "--auth", "--name", "local-tls", "--max-records", "100", timeout=180)
        pid_lines = (work / "pids").read_text().split() if (work / "pids").exists() else []
        roles = {pid_lines[i + 2]: int(pid_lines[i]) for i in range(0, len(pid_lines) - 2, 3)}  # PID ROLE NAME
        started = list(roles.values())
        assert start.returncode == 0, start.stdout + start.stderr
        assert len(started) == 4 and all(alive(p) for p in started), start.stdout
        assert sorted(p.name for p in data.iterdir()) == ["clinic_b.csv", "hospital_a.csv", "practice_c.csv"]
        assert all(len(pd.read_csv(p)) == 30 for p in data.iterdir())
        for pid in started:
            assert str(pid) in start.stdout  # the PIDs are printed too

        cli = dict(env, FLWR_HOME=str(work / "cli"))
        config = (work / "cli" / "config.toml").read_text()
        assert 'root-certificates = "' in config and "insecure" not in config
        listed = subprocess.run([str(BIN / "flwr"), "supernode", "list", "local-tls", "--format", "json"], env=cli,
                                capture_output=True, text=True, timeout=60, check=False)
        nodes = json.loads(listed.stdout)["nodes"]
        assert [n["status"] for n in nodes] == ["online"] * 3, listed.stdout
        for name, tier in (("hospital_a", "weak"), ("clinic_b", "strong"), ("practice_c", "weak")):
            assert f'tier="{tier}"' in processes().get(roles[name], "")

        # A SuperNode whose key the operator did not register is refused (no SuperExec:
        # --isolation process, so the only process is this one).
        keys = run(DEPLOY / "generate_node_keys.sh", root / "rogue", "node_key")
        assert keys.returncode == 0, keys.stderr
        port = (work / "cli" / "config.toml").read_text().split("127.0.0.1:")[1].split('"')[0]
        rogue = run(BIN / "flower-supernode", "--superlink", f"127.0.0.1:{port}",
                    "--root-certificates", root / "certs" / "ca.crt", "--isolation", "process",
                    "--auth-supernode-private-key", root / "rogue" / "node_key", "--port", free_port(),
                    "--max-retries", "1", "--max-wait-time", "10",
                    "--node-config", f'tier="weak" data-path="{data / "clinic_b.csv"}" max-records=100', timeout=60)
        assert rogue.returncode != 0 and "Failed to activate SuperNode" in rogue.stdout + rogue.stderr, (
            rogue.stdout + rogue.stderr)

        trees = with_descendants(started)
        assert len(trees) > 4  # each SuperLink/SuperNode runs a SuperExec child
        stop = run(DEPLOY / "stop_local_deployment.sh", work)
        assert stop.returncode == 0, stop.stdout + stop.stderr
        time.sleep(0.5)
        assert not [p for p in trees if alive(p)], stop.stdout
        assert not (work / "pids").exists() and (work / "pids.stopped").exists()
    finally:
        stop_pids(with_descendants(started), timeout=15)
        stop_processes_of(root)


@pytest.mark.session(covered_by="tests/test_resume.py::"
                               "test_a_run_killed_mid_round_and_between_phases_resumes_without_releasing_twice and "
                               "tests/test_sovereign.py::"
                               "test_a_repeated_training_round_is_replayed_and_only_the_latest_round_is_kept")
def test_deployment_stopped_with_flwr_stop_then_resumed_releases_nothing_twice(deployment):
    dep = deployment
    out, public = dep.root / "out", dep.root / "public.csv"
    rc = {**TINY, "num-server-rounds": 3, "dataset": str(public), "out-dir": str(out), "run-name": "cut"}
    run_dir = out / "cut"
    # ---- the operator starts a run and stops it once its first phase-1 round is checkpointed
    first = dep.start_run(rc, "first-run")
    try:
        dep.wait_for(lambda: _progress(run_dir).get("train_round", 0) >= 1, first, "first-run", "a phase-1 checkpoint")
        runs = json.loads(dep.flwr("list", CONNECTION, "--format", "json").stdout)["runs"]
        running = [r["run-id"] for r in runs if not str(r["status"]).startswith("finished")]
        assert len(running) == 1, runs
        stopped = dep.flwr("stop", str(running[0]), CONNECTION)
        assert stopped.returncode == 0, stopped.stdout + stopped.stderr
        first.wait(timeout=120)
    finally:
        if first.poll() is None:
            stop_pids(with_descendants([first.pid]))
    assert not (run_dir / "synthetic.jsonl").exists()
    # ---- resumed with the run's own resume.toml values: it finishes
    code, output, status = dep.run({**rc, "resume": str(run_dir)})
    diag = output[-4000:] + "\n" + dep.diagnostics()
    assert status.get("status") == "finished:completed", f"{status}\n{diag}"
    assert "resuming run" in output and read_jsonl(run_dir / "synthetic.jsonl"), diag
    assert tomllib.loads((run_dir / "resume.toml").read_text())["resume"] == str(run_dir)
    # every node's ledger: one release per phase and round, whatever was in flight at the stop
    books = _books(dep)
    _once_per_round(books)
    for name, book in books.items():
        assert {r["phase"] for r in book} == ({"train", "profile", "vote"} if name == "strong"
                                              else {"profile", "vote"}), book
    report = json.loads((run_dir / "privacy_report.json").read_text())
    assert all(n["source"] == "node ledger" for n in report["nodes"]), report


def _books(dep: Deployment) -> dict[str, list[dict]]:
    """Each institution's counted ledger entries."""
    return {name: [r for r in _ledger(node["state"])["releases"] if r["status"] != "cancelled"]
            for name, node in dep.nodes.items()}


def _once_per_round(books: dict[str, list[dict]]) -> None:
    for name, book in books.items():
        counted = [(r["run_id"], r["phase"], r["round"]) for r in book]
        assert len(counted) == len(set(counted)), f"{name} paid twice: {counted}"
        assert sum(float(r["epsilon"]) for r in book) <= EPSILON + 1e-6, (name, book)


@pytest.mark.session(covered_by="tests/test_sovereign.py::test_a_strong_node_killed_mid_round_rejoins_later_rounds_without_paying_twice")
def test_deployment_strong_node_killed_mid_round_rejoins_and_weak_node_killed_after_profile(tmp_path):
    """SIGKILL a strong SuperNode during phase-1 round 2 and restart it (Flower gives it a new node
    id): the round aggregates the other strong node, the restarted one trains in round 3 and pays
    nothing twice. SIGKILL the weak node once its profile is in: the vote closes with the votes it
    has, and the weak node's spent epsilon is in the report."""
    with _deploy(tmp_path, {"strong": "strong", "strong2": "strong", "weak": "weak"}) as dep:
        out = dep.root / "out"
        rc = {**TINY, "num-server-rounds": 3, "min-nodes": 3, "voters": "all", "node-timeout": 150.0,
              "dataset": str(dep.root / "public.csv"), "out-dir": str(out), "run-name": "faults"}
        run_dir = out / "faults"
        run = dep.start_run(rc, "faults-run")
        try:
            # the profile is asked before phase 1, so it is in by the time round 1 is
            dep.wait_for(lambda: "profile" in _progress(run_dir).get("completed", []), run, "faults-run", "the profile")
            dep.wait_for(lambda: _progress(run_dir).get("train_round", 0) >= 1, run, "faults-run", "phase-1 round 1")
            dep.kill("strong2")  # round 2 is under way
            dep.kill("weak")  # its profile is in; it will miss the vote
            dep.start_node("strong2", "strong2-restarted")
            run.wait(timeout=RUN_TIMEOUT)
        finally:
            if run.poll() is None:
                stop_pids(with_descendants([run.pid]))
        output = dep.log("faults-run")
        diag = output[-4000:] + "\n" + dep.diagnostics()
        status = dep.status(output)
        assert status.get("status") == "finished:completed", f"{status}\n{diag}"
        metrics = json.loads((run_dir / "metrics.json").read_text())
        degraded = "\n".join(metrics["degradations"])
        assert re.search(r"phase 1 round 2: 1 of 2 nodes answered", degraded), degraded
        assert re.search(r"vote round 1: 2 of 3 nodes answered", degraded), degraded
        assert "a restarted SuperNode, asked in its place" in output, diag
        assert set(metrics["train"]) == {"1", "2", "3"}, metrics["train"]  # every round aggregated someone
        books = _books(dep)
        _once_per_round(books)
        # the restarted strong node trained in round 3 on its one ledger, without a second charge
        train2 = sorted((r["round"], float(r["epsilon"]) > 0) for r in books["strong2"] if r["phase"] == "train")
        assert train2[0] == (1, True) and (3, False) in train2 and all(not paid for _, paid in train2[1:]), train2
        report = {n["ledger_ref"]: n for n in json.loads((run_dir / "privacy_report.json").read_text())["nodes"]}
        refs = {name: _ledger(node["state"])["ref"] for name, node in dep.nodes.items()}
        assert len(report) == 3 and set(report) == set(refs.values()), report
        strong2 = report[refs["strong2"]]
        assert len(strong2["node_ids"]) == 2 and strong2["source"] == "node ledger", strong2
        assert strong2["epsilon_spent"] == pytest.approx(sum(float(r["epsilon"]) for r in books["strong2"]))
        weak = report[refs["weak"]]  # it never answered the ledger query: its replies, and the rest counted as spent
        spent_weak = sum(float(r["epsilon"]) for r in books["weak"])
        assert weak["source"].startswith("replies") and spent_weak > 0, weak
        assert weak["epsilon_spent"] >= spent_weak - 1e-9, (weak, books["weak"])
        assert [r["phase"] for r in weak["releases"]][:1] == ["profile"], weak["releases"]


@pytest.mark.session(covered_by="tests/test_sovereign.py::test_two_concurrent_runs_cannot_both_pass_the_budget_check")
def test_deployment_two_runs_started_at_once_never_both_spend(deployment):
    """Two operators start a run on the same nodes at the same moment. Each node holds its
    budget for the first run whose pre-flight reached it, so the other run is refused before
    it spends anything: no run is left half-paid, and no epsilon is stranded."""
    dep = deployment
    runs = {}
    for name in ("one", "two"):
        rc = {**TINY, "dataset": str(dep.root / "public.csv"), "out-dir": str(dep.root / "out"), "run-name": name}
        runs[name] = dep.start_run(rc, f"run-{name}")
    try:
        for run in runs.values():
            run.wait(timeout=2 * RUN_TIMEOUT)
    finally:
        stop_pids(with_descendants([r.pid for r in runs.values() if r.poll() is None]))
    outputs = {name: dep.log(f"run-{name}") for name in runs}
    diag = "\n".join(o[-3000:] for o in outputs.values()) + dep.diagnostics()
    statuses = {name: dep.status(o).get("status") for name, o in outputs.items()}
    completed = [n for n, s in statuses.items() if s == "finished:completed"]
    assert len(completed) <= 1, f"{statuses}\n{diag}"
    for name in set(runs) - set(completed):
        assert statuses[name] == "finished:failed", f"{statuses}\n{diag}"
        assert "run refused before anything was spent" in outputs[name], diag
    books = _books(dep)
    _once_per_round(books)
    spent_by = {r["run_id"] for book in books.values() for r in book}
    assert len(spent_by) <= 1, f"two runs spent on the nodes: {books}"
    if completed:  # the run that finished paid every phase; the refused one nothing
        assert {r["phase"] for r in books["strong"]} == {"train", "profile", "vote"}
        assert {r["phase"] for r in books["weak"]} == {"profile", "vote"}
    for name, node in dep.nodes.items():  # every hold ended with its run
        assert not _ledger(node["state"]).get("holds"), (name, _ledger(node["state"]))


def test_deployment_bad_data_on_the_server_and_on_a_node_fails_in_one_line_before_any_spending(deployment):
    dep = deployment
    out = dep.root / "out"
    # ---- the server's dataset is a latin-1 CSV: one line naming the file, status failed, nothing asked of the nodes
    latin = dep.root / "latin.csv"
    latin.write_bytes("text,topic\nCaf\xe9 au lait,a\n".encode("latin-1"))
    code, output, status = dep.run({**TINY, "dataset": str(latin), "out-dir": str(out), "run-name": "latin"})
    diag = output[-4000:] + "\n" + dep.diagnostics()
    assert status.get("status") == "finished:failed", f"{status}\n{diag}"
    line = next((ln for ln in output.splitlines() if "failed: DatasetFileError" in ln), "")
    assert str(latin) in line and "UTF-8" in line, diag
    # ---- the weak node's data file cannot be read (latin-1): its own log says so by file; the run is
    # refused up front under the paper's voters (with the default "all" the strong node votes instead and
    # the run goes on, degraded: tests/test_strategy.py). (An empty file is served: its releases are noise
    # only, issue 31.)
    dep.nodes["weak"]["data"].write_bytes("text,topic,source\nCaf\xe9 au lait,a,b\n".encode("latin-1"))
    code, output, status = dep.run({**TINY, "dataset": str(dep.root / "public.csv"), "out-dir": str(out),
                                     "run-name": "empty-node", "voters": "weak"})
    diag = output[-4000:] + "\n" + dep.diagnostics()
    assert status.get("status") == "finished:failed", f"{status}\n{diag}"
    assert "run refused before anything was spent: the votes have no weak node" in output, diag
    assert "data: unreadable on this node" in output, diag  # the server gets the fixed text only...
    assert str(dep.nodes['weak']['data']) not in output, diag
    # ...and the node's own log names the file
    assert f"data unavailable: data-path '{dep.nodes['weak']['data']}' cannot be used" in dep.log("weak"), diag
    assert not any(text in output for text in dep.node_texts), "a node's record reached the server's log"
    for name, node in dep.nodes.items():  # nothing spent, nothing held
        ledger_file = list(node["state"].glob("ledger*.json"))
        if ledger_file:
            book = _ledger(node["state"])
            assert not book["releases"] and not book.get("holds"), (name, book)


@pytest.mark.session(covered_by="tests/test_sovereign.py::"
                               "test_a_model_or_embedder_outside_the_nodes_pins_is_refused_before_anything_is_spent"
                               " and tests/test_curious.py::test_bad_weights_are_refused_before_anything_is_spent")
def test_deployment_a_disallowed_model_and_nan_weights_are_refused_through_flower(tmp_path):
    """Issue 21 through Flower itself: the strong institution pins its generator and the weak one
    its embedder; a run asking for others is refused at stage 0 by both, with fixed texts. Then a
    curious server's aggregator sends NaN weights in round 2: refused before anything is spent,
    and the run still completes on round 1's weights."""
    policies = {"strong": 'model="tiny-gpt2"', "weak": 'embedder="all-MiniLM-L6-v2"'}
    with _deploy(tmp_path, {"strong": "strong", "weak": "weak"}, policies) as dep:
        out = dep.root / "out"
        public = str(dep.root / "public.csv")
        code, output, status = dep.run({**TINY, "dataset": public, "out-dir": str(out), "run-name": "evil-models",
                                         "model": "smollm2-135m", "embedder": "sentence-transformers/all-MiniLM-L6-v2"})
        diag = output[-4000:] + "\n" + dep.diagnostics()
        assert status.get("status") == "finished:failed", f"{status}\n{diag}"
        assert "refused: policy: model not allowed" in output, diag
        assert "refused: policy: embedder not allowed" in output, diag
        # refused before the nodes opened their data or ledgers: nothing spent, nothing held
        assert not any(list(n["state"].glob("ledger*.json")) and (_ledger(n["state"])["releases"]
                                                                   or _ledger(n["state"]).get("holds"))
                       for n in dep.nodes.values()), diag
        code, output, status = dep.run({**TINY, "dataset": public, "out-dir": str(out), "run-name": "nan",
                                         "num-server-rounds": 2, "aggregator": "tests.fakes.NanWeightsFromRound2"})
        diag = output[-4000:] + "\n" + dep.diagnostics()
        assert status.get("status") == "finished:completed", f"{status}\n{diag}"
        assert "refused: bad weights" in output, diag
        trains = [r for r in _ledger(dep.nodes["strong"]["state"])["releases"] if r["phase"] == "train"]
        assert [(r["round"], r["status"]) for r in trains] == [(1, "confirmed")], trains
        assert "non-finite values" in dep.log("strong"), diag  # the detail stays on the node


def _trusting(tmp_path: Path, extra: str = "", names: tuple[str, ...] = ("strong", "weak", "weak2")) -> dict[str, str]:
    """Each institution's node-config keys to count on all of ``names``: its SuperNode key
    (``deploy/generate_node_keys.sh``), the others' public keys listed, ``min-honest-nodes`` = all;
    ``extra`` added to each."""
    keys = tmp_path / "keys"
    for name in names:
        subprocess.run([str(DEPLOY / "generate_node_keys.sh"), str(keys), name], check=True, capture_output=True)
    policies = {}
    for name in names:
        peers = keys / f"{name}-peers.txt"
        peers.write_text("".join((keys / f"{other}.pub").read_text() for other in names if other != name))
        policies[name] = (f'min-honest-nodes={len(names)} peer-keys="{peers}" identity-key="{keys / name}" '
                          f"{extra}").strip()
    return policies


def _masked_ledgers(dep: Deployment, phases: tuple[str, ...], honest: int = 3) -> None:
    """Every release of ``phases`` in each node's ledger a Skellam share under its trust (its
    guarantee alone beside it), the ledger within budget, and no round's keys left on the node."""
    for node in dep.nodes.values():
        ledger = _ledger(node["state"])
        masked = [r for r in ledger["releases"] if r["phase"] in phases]
        assert masked and all(r["mechanism"] == "skellam" for r in masked), ledger
        assert all(r["public"]["honest"] == honest and r["public"]["epsilon_alone"] > float(r["epsilon"])
                   for r in masked)
        assert _spent(ledger) <= EPSILON + 1e-6
        assert not list(Path(node["state"]).glob("secagg/*.json")), "a round's keys stayed on the node"


@pytest.mark.session(covered_by="tests/test_secagg_run.py (deployment-style sites with SuperNode keys and peer "
                              "lists through the real strategy) and tests/test_deployment.py's tiny run at t = K")
def test_the_default_run_with_real_weights_on_supernodes_at_t_equals_k(tmp_path):
    """Issue 73: the default run (SmolLM2, MiniLM, the default refinement; no model override) on a
    SuperLink and three SuperNodes that count on all three: it ends with its synthetic texts, and
    every profile and vote release is a Skellam share under that trust."""
    with _deploy(tmp_path, {"strong": "strong", "weak": "weak", "weak2": "weak"}, policies=_trusting(tmp_path)) as dep:
        out = dep.root / "out"
        run_config = {"dataset": str(dep.root / "public.csv"), "control-codes": CODES, "min-nodes": 3,
                      "test-fraction": 0.1, "out-dir": str(out), "run-name": "default-masked"}
        t0 = time.time()
        code, output, status = dep.run(run_config, timeout=6 * RUN_TIMEOUT)
        print(f"default run at t = K on SuperNodes: {time.time() - t0:.1f}s, status {status.get('status')}")
        diag = output[-4000:] + "\n" + dep.diagnostics()
        assert code == 0 and status.get("status") == "finished:completed", f"{status}\n{diag}"
        assert len(read_jsonl(out / "default-masked" / "synthetic.jsonl")) > 0, diag
        _masked_ledgers(dep, ("profile", "vote"))


@pytest.mark.session(covered_by="tests/test_secagg_run.py (deployment-style sites with SuperNode keys and peer "
                              "lists through the real strategy) and tests/test_secagg_curious.py (the steps by hand)")
def test_deployment_at_t_equals_k_masks_every_sum_the_server_takes(tmp_path):
    """Issue 73 on real processes: a SuperLink and three SuperNodes whose operators each list the
    other two's SuperNode public keys (``deploy/generate_node_keys.sh``) and count on all three
    (``min-honest-nodes = 3``). A tiny run ends; every profile and vote release in each ledger is a
    Skellam share charged under that trust, with its guarantee alone beside it; `fedsyn ledger`
    prints both; no round's keys stay on a node."""
    policies = _trusting(tmp_path)
    with _deploy(tmp_path, {"strong": "strong", "weak": "weak", "weak2": "weak"}, policies=policies) as dep:
        out = dep.root / "out"
        run_config = {**TINY, "dataset": str(dep.root / "public.csv"), "out-dir": str(out), "run-name": "masked"}
        t0 = time.time()
        # five requests a masked round, each a ClientApp process on every node: more start-ups than a plain run
        code, output, status = dep.run(run_config, timeout=3 * RUN_TIMEOUT)
        print(f"masked run: {time.time() - t0:.1f}s, status {status.get('status')}")
        diag = output[-4000:] + "\n" + dep.diagnostics()
        assert code == 0 and status.get("status") == "finished:completed", f"{status}\n{diag}"
        assert read_jsonl(out / "masked" / "synthetic.jsonl"), diag
        _masked_ledgers(dep, ("profile", "vote"))
        shown = subprocess.run([str(BIN / "fedsyn"), "ledger", str(dep.nodes["weak"]["state"])],
                               capture_output=True, text=True, check=False)
        assert shown.returncode == 0, shown.stderr
        assert "if the rest collude" in shown.stdout and "masked, min-honest-nodes 3" in shown.stdout, shown.stdout


def _table_rows(path: Path, offset: int, n: int = 40) -> list[str]:
    """``n`` Breast Cancer rows (from row ``offset`` of the public table), the preset's columns."""
    from common.tables import load_table

    columns = [c["name"] for c in json.loads(TABLE_PRESET["table-schema"])["columns"]]
    load_table("breast-cancer")[columns].iloc[offset % 500:offset % 500 + n].to_csv(path, index=False)
    return []


TABLE_PRESET = tomllib.loads((APP_DIR / "presets" / "table-breast-cancer.toml").read_text())


@pytest.mark.session(covered_by="tests/test_table_marginals.py (a marginals run at t = K through the real strategy "
                              "and ClientApps in-process)")
def test_a_deployed_table_run_at_t_equals_k_measures_masked_marginals(tmp_path):
    """Issue 73 on real processes, for a table: a SuperLink and three SuperNodes holding Breast
    Cancer rows (their operators' table-schema, keys and peer lists) that count on all three. A
    marginals run of two rounds ends with the typed table; every marginals release in each ledger is
    a Skellam share under that trust, and no round's keys stay on a node."""
    schema = tmp_path / "schema.json"
    schema.write_text(TABLE_PRESET["table-schema"])
    policies = _trusting(tmp_path, f'table-schema="{schema}" control-columns="diagnosis"')
    with _deploy(tmp_path, {"strong": "strong", "weak": "weak", "weak2": "weak"}, policies=policies,
                 write_data=_table_rows) as dep:
        out = dep.root / "out"
        # the schema on one line (a key=value override holds no line break)
        run_config = {"table-schema": json.dumps(json.loads(TABLE_PRESET["table-schema"])),
                      "control-columns": "diagnosis"}
        run_config.update({"dataset": str(dep.root / "public.csv"), "table-method": "marginals", "epsilon": EPSILON,
                           "marginal-rounds": 2, "num-synthetic": 60, "sampling-rate": 0.5, "test-fraction": 0.0,
                           "min-nodes": 3, "out-dir": str(out), "run-name": "masked-table"})
        t0 = time.time()
        code, output, status = dep.run(run_config, timeout=3 * RUN_TIMEOUT)
        print(f"masked table run: {time.time() - t0:.1f}s, status {status.get('status')}")
        diag = output[-4000:] + "\n" + dep.diagnostics()
        assert code == 0 and status.get("status") == "finished:completed", f"{status}\n{diag}"
        assert (out / "masked-table" / "synthetic.parquet").exists(), diag
        _masked_ledgers(dep, ("marginals",))
        assert all(len([r for r in _ledger(n["state"])["releases"] if r["phase"] == "marginals"]) == 2
                   for n in dep.nodes.values())  # two rounds
