"""``fedsyn node service``: what keeps an institution's node running, as a systemd unit.

A SuperNode started by hand stops with the shell and does not come back after a reboot. The unit
written here runs ``deploy/start_node.sh --foreground`` (the same script an operator runs by hand:
the gate written, node-check as the ClientApps will run, then the SuperNode and, with ``--run-as``,
its SuperExec as the ClientApp user), restarts it when it fails (node-check first, every time), and
reads the node's settings from an environment file beside it, so that changing a budget is an edit
and a restart, never an edit of the unit. systemd is not a library we could call for this: the
two files are text in its documented format (systemd.service(5), systemd.exec(5)), checked by
``systemd-analyze verify`` in the tests.
"""

from __future__ import annotations

import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from common.io import atomic_write_text

# the environment file's keys, in the order the unit passes them to start_node.sh
OPTIONS = (("FEDSYN_SUPERLINK", "--superlink"), ("FEDSYN_NODE_CONFIG", "--node-config"),
           ("FEDSYN_ALLOW_LIST", "--allow-list"), ("FEDSYN_WORK", "--work"), ("FEDSYN_RUN_AS", "--run-as"),
           ("FEDSYN_ROOT_CERTIFICATES", "--root-certificates"), ("FEDSYN_AUTH_KEY", "--auth-key"),
           ("FEDSYN_PORT", "--port"))
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
# a path written into the unit itself: no quoting, specifier (%) or variable ($) to get wrong
_PLAIN_PATH = re.compile(r"/[A-Za-z0-9_@+=:,./-]*")


@dataclass(frozen=True)
class NodeService:
    """How the operator starts this node (start_node.sh's options) and where fedsyn is installed."""

    name: str
    superlink: str
    node_config: str
    allow_list: Path
    work: Path
    flwr_bin: Path
    start_script: Path
    run_as: str = ""
    same_user: bool = False
    root_certificates: Path | None = None
    auth_key: Path | None = None
    port: int | None = None

    @property
    def unit_name(self) -> str:
        return f"fedsyn-node-{self.name}.service"

    def environment(self) -> dict[str, str]:
        """The environment file's settings: start_node.sh's options, and the venv's bin folder."""
        values = {"FEDSYN_SUPERLINK": self.superlink, "FEDSYN_NODE_CONFIG": self.node_config,
                  "FEDSYN_ALLOW_LIST": str(self.allow_list), "FEDSYN_WORK": str(self.work),
                  "FEDSYN_RUN_AS": self.run_as, "FEDSYN_ROOT_CERTIFICATES": str(self.root_certificates or ""),
                  "FEDSYN_AUTH_KEY": str(self.auth_key or ""), "FEDSYN_PORT": str(self.port or "")}
        return {"FLWR_BIN": str(self.flwr_bin), **{k: v for k, v in values.items() if v}}


def _bash() -> str:
    return shutil.which("bash", path="/usr/bin:/bin") or "/bin/bash"


def check_service(service: NodeService) -> None:
    """Raise ``ValueError`` naming what to fix before a unit is written that could not start."""
    if not _NAME.fullmatch(service.name):
        raise ValueError(f"--name {service.name!r}: letters, digits, '.', '_' and '-' only (it names the unit)")
    if bool(service.run_as) == service.same_user:
        raise ValueError("choose how ClientApps run: --run-as USER (a user who owns none of the gate, the allow-list, "
                         "the approved trees or the venv) or --same-user (they run as root, who can change all of it)")
    if service.run_as:
        import pwd

        try:
            pwd.getpwnam(service.run_as)
        except KeyError:
            raise ValueError(f"--run-as {service.run_as}: no such user; create one (useradd --system "
                             f"--user-group {service.run_as})") from None
    paths = [("--allow-list", service.allow_list), ("--start-script", service.start_script),
             *((flag, p) for flag, p in (("--root-certificates", service.root_certificates),
                                          ("--auth-key", service.auth_key)) if p is not None)]
    for flag, path in paths:
        if not path.is_absolute() or not path.is_file():
            raise ValueError(f"{flag} {path}: not an existing file with an absolute path (the unit runs from /)")
    for binary in ("flower-supernode", "flower-superexec", "fedsyn", "python"):
        if not (service.flwr_bin / binary).exists():
            raise ValueError(f"{service.flwr_bin / binary} not found: run fedsyn node service from the node's venv, "
                             "or give --flwr-bin its bin folder")
    for path in (service.start_script, Path(_bash())):
        if not _PLAIN_PATH.fullmatch(str(path)):
            raise ValueError(f"{path}: the unit names this path, which must be absolute and plain (letters, digits, "
                             "and _@+=:,./- only); move it")
    if any(ch in value for value in service.environment().values() for ch in "\n\r\0"):
        raise ValueError("a setting holds a line break: the environment file could not keep it")


def _quoted(value: str) -> str:
    """``value`` in double quotes, as systemd's environment files and the shell read them alike:
    inside, a backslash escapes only ``"``, ``\\``, `````` and ``$``, so each of those is escaped."""
    return '"' + re.sub(r'(["\\`$])', r"\\\1", value) + '"'


def env_file(service: NodeService) -> str:
    """The environment file (systemd.exec(5) EnvironmentFile=): one KEY="value" per line, quoted so
    that a node config's own double quotes reach start_node.sh as written."""
    lines = [f"# {service.unit_name}: the node's settings (start_node.sh's options). Edit, then: systemctl restart "
             f"{service.unit_name}"]
    lines += [f"{key}={_quoted(value)}" for key, value in service.environment().items()]
    return "\n".join(lines) + "\n"


def unit_file(service: NodeService, env_path: Path) -> str:
    """The systemd unit: start_node.sh --foreground with the environment file's settings, each
    ``${KEY}`` one argument (systemd keeps a braced variable as one word), restarted on failure."""
    settings = service.environment()
    argv = [_bash(), str(service.start_script), "--foreground"]
    argv += [word for key, flag in OPTIONS if key in settings for word in (flag, f"${{{key}}}")]
    argv += ["--same-user"] if service.same_user else []
    who = f"ClientApps as {service.run_as}" if service.run_as else "ClientApps as root (--same-user)"
    return f"""# Written by `fedsyn node service`: the institution's fedsyn SuperNode behind its FAB gate.
# Install: systemctl link {env_path.parent / service.unit_name} && systemctl enable --now {service.unit_name}
# Settings: {env_path} (then systemctl restart {service.unit_name}); watch: journalctl -fu {service.unit_name}
[Unit]
Description=fedsyn SuperNode {service.name} ({who}), SuperLink {service.superlink}
Documentation=file://{service.start_script.parent.parent / "docs" / "deployment.md"}
After=network-online.target
Wants=network-online.target
# a node that keeps failing its start-up check stops being restarted: the operator reads the journal
StartLimitIntervalSec=600
StartLimitBurst=5

[Service]
Type=simple
EnvironmentFile={env_path}
# start_node.sh: the gate, node-check (every start), the SuperNode and its SuperExec; it exits 1
# when either stops, and stops both on TERM
ExecStart={" ".join(argv)}
Restart=on-failure
RestartSec=15
TimeoutStopSec=30

[Install]
WantedBy=multi-user.target
"""


def write_service(service: NodeService, out: Path) -> tuple[Path, Path]:
    """Check ``service``, then write its unit and environment file into ``out`` (each atomically);
    returns (unit path, environment file path). Raises ``ValueError`` naming what to fix."""
    check_service(service)
    out = out.expanduser().resolve()
    if not _PLAIN_PATH.fullmatch(str(out)):
        raise ValueError(f"--out {out}: the unit names this folder, which must be plain (letters, digits, "
                         "and _@+=:,./- only)")
    env_path = out / f"fedsyn-node-{service.name}.env"
    unit_path = out / service.unit_name
    atomic_write_text(env_path, env_file(service))
    env_path.chmod(0o600)  # the node config names the data's path and the budget: the operator's to read
    atomic_write_text(unit_path, unit_file(service, env_path))
    return unit_path, env_path
