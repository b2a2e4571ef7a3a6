"""The operator's side of the FAB gate (``fedsyn_client.fab_gate``): hash a reviewed checkout,
approve it, install the launcher. Used by ``fedsyn node fab-hash|approve|install-launcher``.

``flwr run APP`` builds the FAB from the files of ``APP`` (Flower's ``build_fab_from_disk``:
``pyproject.toml`` and the files its include patterns match that ``.gitignore`` does not
exclude, sorted, with a fixed date, deflated), so the same files give the same bytes and hash
on the server and on the node, with the same Flower and zlib. ``fab_hash`` builds it exactly
that way.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from common.io import atomic_write_text
from fedsyn_client.fab_gate import fab_sha256, launcher_source, read_allow_list


def fab_hash(checkout: str | Path) -> str:
    """SHA-256 of the FAB ``flwr run`` would build from ``checkout``."""
    from flwr.cli.build import build_fab_from_disk

    folder = Path(checkout).expanduser().resolve()
    if not (folder / "pyproject.toml").is_file():
        raise FileNotFoundError(f"{folder} has no pyproject.toml: give the folder the server runs `flwr run` on")
    return fab_sha256(build_fab_from_disk(folder))


def describe_checkout(checkout: str | Path) -> str:
    """``git`` commit of ``checkout`` and whether its tree is clean (the FAB holds untracked files
    too), or "not a git checkout"."""
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(checkout), *args], capture_output=True, text=True, check=True,
                              timeout=30).stdout.strip()

    try:
        commit, changes = git("rev-parse", "HEAD"), git("status", "--porcelain")
    except (OSError, subprocess.SubprocessError):
        return "not a git checkout"
    return f"commit {commit[:12]}" + (", with uncommitted or untracked files" if changes else ", clean")


def approve(checkout: str | Path, allow_list: str | Path, note: str = "") -> str:
    """Add the FAB hash of ``checkout`` to ``allow_list`` (created if missing; written atomically)
    with a comment saying what was approved and when; returns the hash."""
    digest = fab_hash(checkout)
    path = Path(allow_list).expanduser()
    old = path.read_text(encoding="utf-8") if path.exists() else ""
    # a damaged list is the operator's to fix (ValueError names the line), not to append to
    if old and digest in read_allow_list(path):
        return digest
    when = time.strftime("%Y-%m-%d %H:%M:%S")
    line = f"{digest}  # {Path(checkout).resolve()} ({describe_checkout(checkout)}) approved {when}"
    header = "" if old else "# FABs this node runs: SHA-256 per line (fedsyn node approve CHECKOUT --allow-list FILE)\n"
    atomic_write_text(path, old + ("" if not old or old.endswith("\n") else "\n") + header + line
                      + (f"; {note}" if note else "") + "\n")
    os.chmod(path, 0o644)  # read by the ClientApp user (hashes are not secret), written by the operator only
    return digest


def install_launcher(folder: str | Path, allow_list: str | Path, python: str = sys.executable) -> Path:
    """Write ``folder/flwr-clientapp`` (mode 0755), the gate run by ``python -I`` with
    ``allow_list`` fixed in it; returns its path. Put ``folder`` first in the SuperNode's PATH."""
    target = Path(folder).expanduser().resolve() / "flwr-clientapp"
    target.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(target, launcher_source(str(Path(python).absolute()), str(Path(allow_list).expanduser().resolve())))
    os.chmod(target, 0o755)
    return target


def gate_status() -> str:
    """The FAB gate this node's processes would run (``flwr-clientapp`` on PATH), checked as the
    SuperNode will use it: a fedsyn gate of this code, its allow-list readable with at least one
    hash, neither writable by others, and the Flower hook present. Returns a line for the
    operator; raises ``ValueError`` saying what to fix."""
    import shutil
    import stat
    from importlib.metadata import version

    from fedsyn_client.fab_gate import check_hook, launcher_facts

    fix = "install it: fedsyn node install-launcher DIR --allow-list FILE, then put DIR first in the SuperNode's PATH"
    launcher = shutil.which("flwr-clientapp")
    if launcher is None:
        raise ValueError(f"no flwr-clientapp on PATH; {fix}")
    try:
        allow, current = launcher_facts(launcher)
    except ValueError as err:
        raise ValueError(f"{err}; {fix}") from None
    if not current:
        raise ValueError(f"the FAB gate {launcher} is not this fedsyn's gate (edited, or from another version); {fix}")
    for path in (launcher, allow):
        if Path(path).exists() and Path(path).stat().st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            raise ValueError(f"{path} is writable by other users: whoever can edit it chooses what runs on the "
                             f"records; chmod go-w {path}")
    try:
        hashes = read_allow_list(allow)
    except OSError as err:
        raise ValueError(f"the allow-list {allow} cannot be read ({err.strerror or err}); approve the reviewed app "
                         f"with: fedsyn node approve CHECKOUT --allow-list {allow}") from None
    if not hashes:
        raise ValueError(f"the allow-list {allow} approves no FAB: fedsyn node approve CHECKOUT --allow-list {allow}")
    import flwr.supernode.runtime.run_clientapp as runtime

    check_hook(version("flwr"), runtime)
    return f"FAB gate {launcher}: {len(hashes)} approved FAB(s) in {allow}"
