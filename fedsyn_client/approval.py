"""The operator's side of the FAB gate (``fedsyn_client.fab_gate``): hash a reviewed checkout,
approve it (its hash in the allow-list, its tree installed read-only beside it), install the
launchers, and check the node's trust roots. Used by ``fedsyn node fab-hash|approve|install-launcher``
and ``fedsyn node-check``.

``flwr run APP`` builds the FAB from the files of ``APP`` (Flower's ``build_fab_from_disk``:
``pyproject.toml`` and the files its include patterns match that ``.gitignore`` does not
exclude, sorted, with a fixed date, deflated), so the same files give the same bytes and hash
on the server and on the node, with the same Flower and zlib. ``fab_hash`` builds it exactly
that way.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import tempfile
import time
import zipfile
from io import BytesIO
from pathlib import Path

from common.io import atomic_write_text
from fedsyn_client.fab_gate import (
    AGENTAPP,
    CLIENTAPP,
    FLOWER,
    LAUNCHERS,
    apps_dir,
    check_hook,
    fab_manifest,
    fab_sha256,
    launcher_facts,
    launcher_source,
    read_allow_list,
    tree_differs,
)


def build_fab(checkout: str | Path) -> bytes:
    """The bytes of the FAB ``flwr run`` would build from ``checkout``."""
    from flwr.cli.build import build_fab_from_disk

    folder = Path(checkout).expanduser().resolve()
    if not (folder / "pyproject.toml").is_file():
        raise FileNotFoundError(f"{folder} has no pyproject.toml: give the folder the server runs `flwr run` on")
    return build_fab_from_disk(folder)


def fab_hash(checkout: str | Path) -> str:
    """SHA-256 of the FAB ``flwr run`` would build from ``checkout``."""
    return fab_sha256(build_fab(checkout))


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


def install_tree(fab: bytes, allow_list: str | Path) -> Path:
    """Unpack ``fab`` once into ``<allow-list>.apps/<sha256>`` (files 0444, folders 0555, with the
    FAB's bytes beside it as ``<sha256>.fab`` for ``fedsyn node-check``), checked against the FAB's
    manifest before it is moved into place; an intact tree is kept. Returns the tree."""
    root = apps_dir(Path(allow_list).expanduser().resolve())
    digest = fab_sha256(fab)
    tree, manifest = root / digest, fab_manifest(fab)
    root.mkdir(parents=True, exist_ok=True)
    os.chmod(root, 0o755)
    if tree.exists() and not tree_differs(tree, manifest):
        return tree
    staging = Path(tempfile.mkdtemp(prefix=f".{digest[:8]}-", dir=root))
    with zipfile.ZipFile(BytesIO(fab)) as archive:
        for rel in manifest:  # only the manifest's plain paths: nothing can land outside the tree
            target = staging / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(archive.read(rel))
    why = tree_differs(staging, manifest)
    if why:
        raise ValueError(f"the FAB does not unpack to its own manifest ({why})")
    for folder, dirs, files in os.walk(staging, topdown=False):
        for name in files:
            os.chmod(Path(folder) / name, 0o444)
        os.chmod(folder, 0o555)
    if tree.exists():  # a damaged tree: set aside, then replaced in one rename
        old = root / f".{digest[:8]}-damaged-{int(time.time())}"
        _writable(tree)
        tree.rename(old)
        shutil.rmtree(old)
    staging.rename(tree)
    (root / f"{digest}.fab").write_bytes(fab)
    os.chmod(root / f"{digest}.fab", 0o444)
    return tree


def _writable(tree: Path) -> None:
    for folder, _, _ in os.walk(tree):
        os.chmod(folder, 0o755)


def approve(checkout: str | Path, allow_list: str | Path, note: str = "") -> str:
    """Install the FAB of ``checkout`` read-only beside ``allow_list`` (``install_tree``), then add
    its hash to ``allow_list`` (created if missing; written atomically) with a comment saying what
    was approved and when; returns the hash. The gate imports only that tree."""
    fab = build_fab(checkout)
    digest = fab_sha256(fab)
    path = Path(allow_list).expanduser()
    old = path.read_text(encoding="utf-8") if path.exists() else ""
    # a damaged list is the operator's to fix (ValueError names the line), not to append to
    listed = bool(old) and digest in read_allow_list(path)
    install_tree(fab, path)  # before the hash is listed: the gate never sees an approved hash without its tree
    if listed:
        return digest
    when = time.strftime("%Y-%m-%d %H:%M:%S")
    line = f"{digest}  # {Path(checkout).resolve()} ({describe_checkout(checkout)}) approved {when}"
    header = "" if old else "# FABs this node runs: SHA-256 per line (fedsyn node approve CHECKOUT --allow-list FILE)\n"
    atomic_write_text(path, old + ("" if not old or old.endswith("\n") else "\n") + header + line
                      + (f"; {note}" if note else "") + "\n")
    os.chmod(path, 0o644)  # read by the ClientApp user (hashes are not secret), written by the operator only
    return digest


def install_launcher(folder: str | Path, allow_list: str | Path, python: str = sys.executable) -> Path:
    """Write one launcher per task-process name Flower starts (``fab_gate.LAUNCHERS``) into
    ``folder`` (mode 0755), each the gate run by ``python -I`` with its role and ``allow_list``
    fixed in it; returns the ``flwr-clientapp`` one. Put ``folder`` first in the SuperNode's PATH."""
    target = Path(folder).expanduser().resolve()
    target.mkdir(parents=True, exist_ok=True)
    allow = str(Path(allow_list).expanduser().resolve())
    for role in LAUNCHERS:
        atomic_write_text(target / role, launcher_source(str(Path(python).absolute()), allow, role))
        os.chmod(target / role, 0o755)
    return target / CLIENTAPP


def _user(clientapp_user: str | None) -> tuple[int, set[int], str]:
    """(uid, groups, name) of the user ClientApps run as: ``clientapp_user`` or whoever runs this."""
    import grp
    import pwd

    entry = pwd.getpwnam(clientapp_user) if clientapp_user else pwd.getpwuid(os.geteuid())
    groups = {entry.pw_gid} | {g.gr_gid for g in grp.getgrall() if entry.pw_name in g.gr_mem}
    return entry.pw_uid, groups, entry.pw_name


def write_problem(path: Path, uid: int, gids: set[int], same_user: bool, ancestor: bool = False) -> str:
    """Why user ``uid`` (groups ``gids``) could change ``path``, or "". Root or the owner always can
    (the owner can chmod); so can a group or everyone with a write bit. ``same_user``: the ClientApp
    user is the operator, so only others' write bits count. An ``ancestor`` folder with the sticky
    bit (``/tmp``) lets others add names but not replace this one."""
    st = path.lstat()
    if stat.S_ISLNK(st.st_mode):
        return ""  # a link's own bits mean nothing; its folder and its target are checked
    others = bool(st.st_mode & stat.S_IWOTH) or bool(st.st_mode & stat.S_IWGRP and (same_user or st.st_gid in gids))
    if others and not (ancestor and st.st_mode & stat.S_ISVTX):
        return f"{path} is writable by other users (chmod go-w {path})"
    if same_user:
        return ""
    if uid == 0:
        return "ClientApps run as root, who can change every file"
    if st.st_uid == uid:
        return f"{path} is owned by the ClientApp user (uid {uid}), who can change it"
    return ""


def trust_problems(roots: list[Path], trees: list[Path], uid: int, gids: set[int], same_user: bool) -> list[str]:
    """What the ClientApp user could change among ``roots`` (each with every folder above it) and
    everything inside ``trees``: the gate, the allow-list, the approved trees, the venv."""
    problems: list[str] = []
    seen: set[Path] = set()

    def check(path: Path, ancestor: bool) -> None:
        if path in seen or not os.path.lexists(path):
            return
        seen.add(path)
        why = write_problem(path, uid, gids, same_user, ancestor)
        if why and why not in problems:
            problems.append(why)

    def chain(path: Path) -> None:
        real = Path(os.path.realpath(path))
        for parent in reversed(real.parents):
            check(parent, ancestor=True)
        check(real, ancestor=False)

    for root in [*roots, *trees]:
        chain(root)
    for tree in trees:
        for folder, dirs, files in os.walk(os.path.realpath(tree)):
            for name in [*dirs, *files]:
                path = Path(folder) / name
                check(path, ancestor=False)
                if path.is_symlink():
                    chain(path)
    return problems


def gate_status(clientapp_user: str | None = None, same_user: bool = False) -> str:
    """The FAB gate this node's processes would run, checked as the SuperExec will use it: every
    task-process name Flower can start resolves on PATH to this fedsyn's gate for that name, all
    naming one readable allow-list with at least one hash, each approved hash installed intact;
    Flower is exactly the release the gate was read against with its hooks present; and the ClientApp
    user (``clientapp_user``, default whoever runs this) can change none of the gate, the allow-list,
    the approved trees, the venv, nor a folder above them (``same_user``: it is the operator, and only
    others' write bits count). Returns a line for the operator; raises ``ValueError`` saying what to fix."""
    from importlib.metadata import version

    from flwr.supercore.constant import TASK_TYPE_TO_COMMAND

    fix = "install it: fedsyn node install-launcher DIR --allow-list FILE, then put DIR first in the SuperNode's PATH"
    flower = version("flwr")
    if flower not in FLOWER:
        raise ValueError(f"Flower {flower} is not a release the FAB gate was read against ({', '.join(FLOWER)}); "
                         f"install flwr=={FLOWER[-1]} in the node's venv")
    names = sorted(set(LAUNCHERS) | set(TASK_TYPE_TO_COMMAND.values()))
    launchers, allow_lists, pythons = [], set(), set()
    for name in names:
        launcher = shutil.which(name)
        if launcher is None:
            raise ValueError(f"no {name} on PATH: the SuperExec would fail open to whatever it finds later; {fix}")
        try:
            role, listed, python, current = launcher_facts(launcher)
        except ValueError as err:
            raise ValueError(f"{err}; {fix}") from None
        if role != name or not current:
            raise ValueError(f"{launcher} is not this fedsyn's gate for {name} (edited, renamed or from another "
                             f"version); {fix}")
        launchers.append(Path(launcher))
        allow_lists.add(listed)
        pythons.add(python)
    if len(allow_lists) != 1:
        raise ValueError(f"the launchers on PATH name different allow-lists ({', '.join(sorted(allow_lists))}); {fix}")
    allow = Path(allow_lists.pop())
    for role in (CLIENTAPP, AGENTAPP):
        check_hook(role, flower)
    try:
        hashes = read_allow_list(allow)
    except OSError as err:
        raise ValueError(f"the allow-list {allow} cannot be read ({err.strerror or err}); approve the reviewed app "
                         f"with: fedsyn node approve CHECKOUT --allow-list {allow}") from None
    if not hashes:
        raise ValueError(f"the allow-list {allow} approves no FAB: fedsyn node approve CHECKOUT --allow-list {allow}")
    trees = apps_dir(allow)
    for digest in sorted(hashes):
        try:
            why = tree_differs(trees / digest, fab_manifest((trees / f"{digest}.fab").read_bytes()))
        except (OSError, ValueError, zipfile.BadZipFile) as err:
            why = str(err)
        if why:
            raise ValueError(f"the approved FAB {digest} is not installed intact ({why}); approve the reviewed "
                             f"checkout again: fedsyn node approve CHECKOUT --allow-list {allow}")
    uid, gids, user = _user(clientapp_user)
    venv = Path(sys.prefix)
    problems = trust_problems([*launchers, allow, *(Path(p) for p in pythons)],
                              [trees, venv, *{p.parent for p in launchers}],
                              uid, gids, same_user)
    if problems:
        raise ValueError(f"the ClientApp user {user} could change what decides which code runs on the records: "
                         f"{problems[0]}" + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else "")
                         + "; run ClientApps as a user who owns none of it (deploy/start_node.sh --run-as USER), "
                         "or accept it with --same-user where the operator runs them")
    mode = f"ClientApps run as {user}" + (" (same user as the operator: --same-user)" if same_user else "")
    return f"FAB gate {launchers[0].parent}: {len(hashes)} approved FAB(s) in {allow}, {len(names)} launchers; {mode}"
