"""Issue 44: every door Flower 1.42 opens into a node is gated, played by an attacker on real processes.

A SuperLink and two SuperNodes behind their FAB gates (``tests/test_deployment.py``'s deployment),
then, one after another:

1. **an agent app** (a FAB that declares only ``agentapp``, started as ``flwr chat`` starts one:
   a Control API ``StartRun`` with a prompt and the FAB). A stock SuperLink runs it and its
   AgentApp sends each node a message; each node's SuperExec starts ``flwr-agentapp``;
2. **an approved FAB whose stated ``fab_version`` walks out of Flower's apps folder**, to a folder
   holding the attacker's ClientApp (a SuperLink modified to state it: the server's right);
3. **the approved FAB re-sent with another stated ``fab_id``**, whose folder under ``$FLWR_HOME/apps``
   holds the attacker's ClientApp;
4. **a pre-planted install folder** with the approved hash's 8-hex name and the approved FAB's own
   id and version, holding the attacker's ClientApp (what Flower 1.42 would import unchecked).

Every attacker module writes a marker line when imported. None of them may run on a node; 1-3
are refused with the gate's fixed text, the ledgers stay empty and no record reaches the server;
4 runs the approved bytes (the node answers the pre-flight as the reviewed code does).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fedsyn_client.fab_gate import REFUSAL
from fedsyn_server.flwr_runner import APP_DIR
from tests.test_deployment import CONNECTION, TINY, Deployment, _deploy, _ledger

pytestmark = pytest.mark.flwr

# A SuperLink whose Fleet API states another fab_id / fab_version for runs while REWRITE exists.
EVIL_SUPERLINK = '''
import json, sys
from pathlib import Path
import flwr.superlink.servicer.fleet.fleet_handlers as handlers
from flwr.superlink.cli import flower_superlink
REWRITE = Path(sys.argv.pop(1))
honest = handlers.get_run
def get_run(request, state):
    response = honest(request, state)
    if REWRITE.exists():
        for key, value in json.loads(REWRITE.read_text()).items():
            setattr(response.run, key, value)
    return response
handlers.get_run = get_run
sys.argv[0] = "flower-superlink"
flower_superlink()
'''

# The attacker's module: when imported, it writes down where it runs and what it can read.
PAYLOAD = '''
import os, pathlib, time
pathlib.Path({marker!r}).joinpath(f"ran-{{os.getpid()}}-{{time.time_ns()}}").write_text(
    "ATTACKER CODE RAN " + os.environ.get("FLWR_HOME", "?") + "\\n")
'''

AGENT_APP = PAYLOAD + '''
import json
from flwr.agentapp import AgentApp

app = AgentApp()


@app.main()
def main(agent, context):
    def call(name, **arguments):
        return json.loads(agent.grid.call({{"name": name, "call_id": name, "arguments": arguments}})["output"])

    nodes = call("get_nodes")["nodes"]
    sent = call("push_messages", messages=[{{"dst_node_id": n["id"], "payload": "run me", "reply_to_message_id": None}}
                                           for n in nodes])["results"]
    replies = call("pull_messages", message_ids=[r["message_id"] for r in sent if r["message_id"]], timeout=90)
    pathlib.Path({marker!r}).parent.joinpath("agent-replies.json").write_text(json.dumps([nodes, sent, replies]))
'''


def _agent_fab(root: Path, marker: Path) -> bytes:
    from flwr.cli.build import build_fab_from_disk

    app = root / "evil-agent"
    app.mkdir()
    (app / "pyproject.toml").write_text(
        '[build-system]\nrequires = ["hatchling"]\nbuild-backend = "hatchling.build"\n\n'
        '[project]\nname = "agent"\nversion = "1.0.0"\ndependencies = []\n\n'
        '[tool.hatch.build.targets.wheel]\npackages = ["."]\n\n'
        '[tool.flwr.app]\npublisher = "evil"\n\n[tool.flwr.app.components]\nagentapp = "evil_agent:app"\n\n'
        '[tool.flwr.app.config]\n')
    (app / "evil_agent.py").write_text(AGENT_APP.format(marker=str(marker)))
    return build_fab_from_disk(app)


def _start_chat_run(dep: Deployment, fab: bytes) -> int:
    """``StartRun`` as ``flwr chat`` sends it (a prompt and a local FAB), through the operator's connection."""
    script = (
        "import hashlib, sys\n"
        "from flwr.cli.flower_config import read_superlink_connection\n"
        "from flwr.cli.utils import init_http_client_from_connection\n"
        "from flwr.proto.control_pb2 import StartRunRequest\n"
        "from flwr.proto.fab_pb2 import Fab\n"
        "fab = open(sys.argv[2], 'rb').read()\n"
        "client = init_http_client_from_connection(read_superlink_connection(sys.argv[1]))\n"
        "res = client.StartRun(StartRunRequest(app_spec='', user_prompt='hello', federation='',\n"
        "                      fab=Fab(hash_str=hashlib.sha256(fab).hexdigest(), content=fab)))\n"
        "print(res.run_id)\n")
    fab_path = dep.root / "evil-agent.fab"
    fab_path.write_bytes(fab)
    res = subprocess.run([sys.executable, "-c", script, CONNECTION, str(fab_path)], env=dep.env(dep.cli_home),
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr
    return int(res.stdout.strip().splitlines()[-1])


def _wait_finished(dep: Deployment, run_id: int, timeout: float = 180) -> str:
    deadline = time.time() + timeout
    status = ""
    while time.time() < deadline:
        listed = dep.flwr("list", CONNECTION, "--run-id", str(run_id), "--format", "json")
        try:
            status = json.loads(listed.stdout)["runs"][0]["status"]
        except (ValueError, KeyError, IndexError):
            status = ""
        if status.startswith("finished"):
            return status
        time.sleep(2)
    return status


def _plant(folder: Path, marker: Path) -> None:
    """The approved app's files with an attacker's ClientApp module, at ``folder``."""
    shutil.copytree(APP_DIR / "fedsyn_client", folder / "fedsyn_client", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(APP_DIR / "pyproject.toml", folder / "pyproject.toml")
    with (folder / "fedsyn_client" / "client_app.py").open("a") as fh:
        fh.write(PAYLOAD.format(marker=str(marker)))


def _ran(marker: Path) -> list[str]:
    return [p.read_text() for p in marker.iterdir()]


def test_every_door_into_a_gated_node_is_shut(tmp_path):
    root = tmp_path / "attack"
    root.mkdir()
    rewrite = root / "rewrite.json"
    (root / "evil_superlink.py").write_text(EVIL_SUPERLINK)
    with _deploy(tmp_path, {"strong": "strong", "weak": "weak"},
                 superlink=[sys.executable, str(root / "evil_superlink.py"), str(rewrite)]) as dep:
        marker = dep.root / "markers"
        marker.mkdir()
        homes = {name: dep.root / f"home-{name}" for name in dep.nodes}
        approved = next(iter(dep.nodes.values()))["gate"].parent / "allow-list.txt"
        digest = approved.read_text().split()[0]

        def node_logs() -> str:
            return "".join(dep.log(name) for name in dep.nodes)

        def on_nodes() -> list[str]:
            return [line for line in _ran(marker) if any(str(h) in line for h in homes.values())]

        # 1. an agent app, as `flwr chat` starts one
        run_id = _start_chat_run(dep, _agent_fab(root, marker))
        status = _wait_finished(dep, run_id)
        diag = f"{status}\n{dep.log('superlink')[-3000:]}{dep.diagnostics()}"
        assert ("Start `flwr-agentapp` process" not in node_logs()
                or "this node approves no agent app" in node_logs()), diag
        assert node_logs().count("this node approves no agent app") >= 2, diag  # each node's door was knocked on
        assert on_nodes() == [], f"the agent app ran on a node: {on_nodes()}"
        replies = (marker.parent / "agent-replies.json")
        if replies.exists():  # the server's AgentApp got the nodes' answers: the gate's text at most
            text = replies.read_text()
            assert not any(t in text for t in dep.node_texts), text
        for name in dep.nodes:
            assert not list(homes[name].rglob("evil_agent.py")), f"{name} unpacked the agent FAB"

        plan = {**TINY, "dataset": str(dep.root / "public.csv"), "out-dir": str(dep.root / "out")}
        # 2. the approved FAB, its stated version walking out of $FLWR_HOME/apps to the attacker's folder
        h8 = digest[:8]
        for name, home in homes.items():  # what stock Flower would import: apps/<..>/../../walked.<h8>
            (home / "apps" / f"fedsyn.fedsyn.0.1.0.{h8}").mkdir(parents=True, exist_ok=True)
            _plant(home.parent / f"walked-{name}.{h8}", marker)
        for name in homes:
            rewrite.write_text(json.dumps({"fab_version": f"0.1.0.{h8}/../../../walked-{name}"}))
            code, out, err = dep.plan(plan)
            assert code != 0 and REFUSAL in out + err + node_logs(), out + err + dep.diagnostics()
        assert node_logs().count("the run states FAB") >= 2, dep.diagnostics()
        # 3. the approved FAB re-sent with another stated fab_id, whose folder holds the attacker's app
        for home in homes.values():
            _plant(home / "apps" / f"evil.app.0.1.0.{h8}", marker)
        rewrite.write_text(json.dumps({"fab_id": "evil/app"}))
        code, out, err = dep.plan(plan)
        assert code != 0, out + err + dep.diagnostics()
        assert node_logs().count("the run states FAB 'evil/app'") >= 2, dep.diagnostics()
        rewrite.unlink()
        assert on_nodes() == [], f"attacker code ran on a node: {on_nodes()}"
        for name, node in dep.nodes.items():
            book = _ledger(node["state"]) if list(node["state"].glob("ledger*.json")) else {"releases": []}
            assert book["releases"] == [] and not book.get("holds"), (name, book)
        # 4. a pre-planted install folder with the approved hash's 8-hex name and the FAB's own id and version
        for home in homes.values():
            planted = home / "apps" / f"fedsyn.fedsyn.0.1.0.{h8}"
            shutil.rmtree(planted)
            _plant(planted, marker)
        code, out, err = dep.plan(plan)
        assert code == 0, out + err + dep.diagnostics()  # the approved bytes answered
        assert on_nodes() == [], f"a planted folder was imported on a node: {on_nodes()}"
        assert node_logs().count(f"FAB {digest} approved; its ClientApp loads from") >= 2
        for name, node in dep.nodes.items():
            book = _ledger(node["state"]) if list(node["state"].glob("ledger*.json")) else {"releases": []}
            assert book["releases"] == [], (name, book)
        assert not any(text in out + err for text in dep.node_texts), "a node's record reached the server"
