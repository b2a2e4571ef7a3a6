"""Run the app with the real ``flwr run`` (local SuperLink, simulation) and clean up after it.

``flwr run`` starts a detached local SuperLink that outlives the command. Every run here
gets its own ``FLWR_HOME``; afterwards the processes whose command line names that
FLWR_HOME (the SuperLink, its SuperExec) and their descendants are stopped by PID.
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
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from fedsyn_server.app_stage import staged_app
from fedsyn_server.flwr_args import toml_value  # noqa: F401 - run_app's pairs; tests import it here

APP_DIR = Path(__file__).resolve().parents[1]  # the project root (this app)
_RUN_DIR = re.compile(r"outputs go to (\S+)")
_STARTED = re.compile(r"Successfully started run (\d+)")
_ANSI = re.compile(rb"\x1b\[[0-9;]*[A-Za-z]")


@dataclass
class FlwrRun:
    """What a ``flwr run`` produced: exit code, combined output, the run's output folder,
    and the SuperLink's status of the run (``flwr run --stream`` exits 0 even when the
    ServerApp fails, so ``ok`` checks the status too)."""

    returncode: int
    output: str
    run_dir: Path | None
    seconds: float
    status: str = ""

    @property
    def ok(self) -> bool:
        """True when ``flwr run`` exited 0 and the SuperLink reports the run completed."""
        return self.returncode == 0 and self.status == "finished:completed"


def flwr_cli() -> str:
    """The ``flwr`` command beside this Python (the venv's), else the one on PATH."""
    flwr = Path(sys.executable).with_name("flwr")
    return str(flwr) if flwr.exists() else "flwr"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def flwr_env(flwr_home: Path) -> dict[str, str]:
    """Environment for a hermetic, offline ``flwr run``.

    The local SuperLink listens on fixed ports by default (39091/39093), and ``flwr run``
    reuses whatever SuperLink answers there, even another FLWR_HOME's. Fresh ports per
    run keep concurrent runs (and a user's own SuperLink) apart.
    """
    env = dict(os.environ)
    env.update({
        "FLWR_LOCAL_SUPERLINK_HTTP_API_PORT": str(free_port()), "FLWR_LOCAL_CONTROL_API_PORT": str(free_port()),
        "FLWR_HOME": str(flwr_home), "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
        "FLWR_TELEMETRY_ENABLED": "0", "FLWR_DISABLE_UPDATE_CHECK": "1",
        "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
        # `flwr run` launches `flower-superlink` by name: the venv's bin must be on PATH.
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}",
    })
    return env


def run_app(run_config: dict[str, object], federation_config: str | None = None, timeout: float = 1800,
            app_dir: Path = APP_DIR, log_path: Path | None = None, env: dict[str, str] | None = None,
            flwr_home: Path | None = None) -> FlwrRun:
    """``flwr run <app_dir> --stream`` with ``run_config`` overrides; always cleans up.

    The command's output (stdout and stderr, in order) goes to ``log_path`` as it runs,
    appended after a header line, so a long run can be followed with ``tail -f`` and a
    failed one read afterwards; without ``log_path``, to a file in the run's FLWR_HOME.
    ``FlwrRun.output`` is this call's part of it. ``env`` adds to the environment of ``flwr``
    and the SuperLink it starts (e.g. ``RAY_ADDRESS`` to simulate on an existing Ray cluster);
    ``flwr_home`` is the run's FLWR_HOME (default: a new temporary folder; every process the run
    starts names it, which is how they are found and stopped).
    """
    flwr_home = flwr_home or Path(tempfile.mkdtemp(prefix="fedsyn-flwr-home-"))
    overrides = " ".join(f"{k}={toml_value(v)}" for k, v in run_config.items())
    # the app's files alone, copied: Flower's own walk of a project folder holding its venv takes seconds
    cmd = [flwr_cli(), "run", str(staged_app(app_dir, flwr_home)), "--stream"]
    if overrides:
        cmd += ["--run-config", overrides]
    if federation_config:
        cmd += ["--federation-config", federation_config]
    sink = log_path or flwr_home / "flwr-run.log"
    sink.parent.mkdir(parents=True, exist_ok=True)
    t0, env, status, timed_out = time.time(), {**flwr_env(flwr_home), **(env or {})}, "", False
    try:
        with open(sink, "ab") as out:
            out.write(f"=== {time.strftime('%Y-%m-%d %H:%M:%S')} {' '.join(cmd)}\n".encode())
            out.flush()
            start = out.tell()
            code, timed_out = _run_to(cmd, env, out, timeout)
        with open(sink, "rb") as written:
            written.seek(start)
            output = written.read().decode("utf-8", errors="replace")
        if timed_out:
            output += f"\nTIMEOUT after {timeout}s"
        else:
            status = run_status(output, env)
    finally:
        stop_processes_of(flwr_home)
    match = _RUN_DIR.findall(output)
    return FlwrRun(code, output, Path(match[-1]) if match else None, time.time() - t0, status)


def _run_to(cmd: list[str], env: dict[str, str], out, timeout: float) -> tuple[int, bool]:
    """Run ``cmd`` with its output, without ANSI escape codes, appended to ``out`` as it comes;
    (exit code, timed out). `flwr run` colours its own lines whatever it writes to."""
    import threading

    fired = threading.Event()
    with subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT) as proc:
        def stop() -> None:  # a silent command must time out too, so not checked between lines
            fired.set()
            proc.kill()

        timer = threading.Timer(timeout, stop)
        timer.start()
        try:
            for line in proc.stdout:  # type: ignore[union-attr]  # Popen(stdout=PIPE): never None
                out.write(_ANSI.sub(b"", line))
                out.flush()
            code = proc.wait()
        finally:
            timer.cancel()
    return (-1, True) if fired.is_set() else (code, False)


def run_status(output: str, env: dict[str, str], connection: str | None = None) -> str:
    """The SuperLink's status of the run started in ``output`` (e.g. ``finished:completed``)."""
    match = _STARTED.search(output)
    if not match:
        return ""
    cmd = [flwr_cli(), "list"] + ([connection] if connection else [])
    listed = subprocess.run(cmd + ["--run-id", match.group(1), "--format", "json"],
                            env=env, capture_output=True, text=True, timeout=60)
    try:
        return str(json.loads(listed.stdout)["runs"][0]["status"])
    except (ValueError, KeyError, IndexError):
        return "unknown"


# What decides which local SuperLink `flwr run` talks to, and where its simulation runs.
_LOCAL_LINK_KEYS = ("FLWR_HOME", "FLWR_LOCAL_CONTROL_API_PORT")


def stale_local_superlink(env: dict[str, str]) -> str:
    """A one-line problem when a local SuperLink that ``flwr run`` with ``env`` would reuse was
    started under another ``RAY_ADDRESS`` (its simulation would silently run elsewhere than the
    user asked: on this machine instead of the cluster, or the reverse); "" otherwise.

    `flwr run` starts the local SuperLink once and then reuses it, and a SuperLink reads
    ``RAY_ADDRESS`` only from its own environment."""
    want = env.get("RAY_ADDRESS", "")
    for pid, cmd in processes().items():
        if "flower-superlink" not in cmd or pid == os.getpid():
            continue
        try:
            raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        theirs = dict(item.decode(errors="replace").split("=", 1) for item in raw if b"=" in item)
        if any(theirs.get(k, "") != env.get(k, "") for k in _LOCAL_LINK_KEYS):
            continue  # another FLWR_HOME or port: flwr run will not reuse it
        has = theirs.get("RAY_ADDRESS", "")
        if has != want:
            started = f"with RAY_ADDRESS={has}" if has else "without RAY_ADDRESS"
            would = f"not on the Ray cluster at {want}" if want else f"on the Ray cluster at {has}"
            return (f"the local SuperLink (PID {pid}) was started {started}, and flwr run reuses it: this run "
                    f"would simulate {would}. Fix: stop it (kill {pid}) and run again")
    return ""


@contextmanager
def stopped_on_signals() -> Iterator[None]:
    """Inside: SIGTERM and SIGINT raise ``KeyboardInterrupt``, so every ``finally`` runs and
    ``run_app`` stops the SuperLink and simulation it started. Without it a grid started in the
    background (``nohup fedsyn experiment ... &``: SIGINT ignored) and then sent SIGTERM dies at
    once and leaves them running. The previous handlers come back on exit (main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum: int, _frame: object) -> None:
        raise KeyboardInterrupt(signal.Signals(signum).name)

    previous = {sig: signal.signal(sig, interrupt) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def stop_processes_of(flwr_home: Path) -> list[int]:
    """Stop every process whose command line names ``flwr_home``, and their descendants.
    Returns the PIDs signalled."""
    pids = with_descendants([pid for pid, cmd in processes().items() if str(flwr_home) in cmd])
    stop_pids(pids)
    return pids


def stop_pids(pids: list[int], timeout: float = 10) -> None:
    """TERM exactly ``pids``, wait up to ``timeout`` s, then KILL the ones still alive."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.time() + timeout
        while time.time() < deadline and any(alive(p) for p in pids):
            time.sleep(0.2)
        if not any(alive(p) for p in pids):
            return


def processes() -> dict[int, str]:
    """PID -> command line of every process visible in /proc."""
    out = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                out[int(entry.name)] = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
    return out


def _parent(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return int(stat.rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def with_descendants(roots: list[int]) -> list[int]:
    """``roots`` and all their descendants (by parent PID), sorted."""
    found, frontier = set(roots), list(roots)
    all_pids = list(processes())
    while frontier:
        parent = frontier.pop()
        for pid in all_pids:
            if pid not in found and _parent(pid) == parent:
                found.add(pid)
                frontier.append(pid)
    return sorted(found)


def alive(pid: int) -> bool:
    """True if ``pid`` exists and is not a zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        return state != "Z"
    except (OSError, IndexError):
        return False
