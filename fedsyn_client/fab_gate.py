"""The node's FAB gate: a SuperNode runs only the app code its operator approved, through every door.

Everything a node promises (its policy, its ledger, fixed refusal texts, noise on the node) is
enforced by the ClientApp, and in a deployment that code arrives from the server in the FAB. Flower
1.42 has several doors through which a FAB's code can run on the node: the SuperExec starts a task
process *by name from PATH* for every task type (``flwr.supercore.constant.TASK_TYPE_TO_COMMAND``:
``flwr-clientapp``, ``flwr-agentapp``, ``flwr-model``, ``flwr-connector``, ``flwr-serverapp``,
``flwr-simulation``), and each runner installs the FAB with ``flwr.cli.install.install_from_fab``
and imports a folder named from the *server-stated* ``fab_id``/``fab_version``. The review of
every call that imports app code, and where this gate covers it, is in ``docs/privacy.md``.

``fedsyn node install-launcher DIR --allow-list FILE`` writes one launcher per task-process name
into ``DIR``: this file, run by the node venv's Python in isolated mode (``-I``: no current
directory, no ``PYTHON*`` variables), with its role, the allow-list and the folder of approved
trees fixed in it. With ``DIR`` first in the SuperExec's PATH, every task process starts here:

1. the installed Flower must be exactly one this gate was read against (``FLOWER``), else the
   process exits (``EXIT_NO_HOOK``) before it connects anywhere: fail closed;
2. its arguments must be the ones a SuperExec passes (``ARGS``), else ``EXIT_REFUSED``;
   ``--allow-runtime-dependency-installation`` is dropped (the node's venv is what the
   institution trusts, not a dependency list that came with the FAB);
3. ``flwr-clientapp``: ``install_from_fab`` is replaced *where it is defined* (so every runner
   that imports it gets this one) by :class:`ClientAppGate`. The SHA-256 of the FAB's bytes
   (computed here, never a stated hash) must be in the allow-list, read afresh per message, and
   the tree the operator installed from those bytes (``<allow-list>.apps/<sha256>``, written by
   ``fedsyn node approve``, read-only) must hold exactly the FAB's files and bytes. The ClientApp
   is then imported from that tree only; the stated ``fab_id``/``fab_version``/``fab_hash`` must
   be plain names equal to the tree's own, and Flower's ``$FLWR_HOME/apps`` is never read, so
   neither a name that walks out of it nor a folder planted there is ever imported;
4. ``flwr-agentapp``: Flower's runner, with an installer that approves nothing: the server gets
   the same fixed refusal (``REFUSAL``) before a byte is unpacked. fedsyn ships no agent app;
5. every other name: exits (``EXIT_REFUSED``) before it connects anywhere.

It imports nothing of fedsyn (stdlib and Flower only): the ClientApp's packages must come from the
approved tree, and a fedsyn module already imported here would be used instead.
"""

import hashlib
import importlib
import io
import os
import re
import stat
import sys
import tomllib
import zipfile
from collections.abc import Callable
from importlib.metadata import version
from pathlib import Path
from typing import Any

# The Flower releases whose doors this gate was read against, exactly: the hooks are Flower-internal,
# so another release (a patch release included) is refused until someone reads it again.
FLOWER = ("1.42.0",)
# Every task-process name Flower 1.42.0's SuperExec starts by name (TASK_TYPE_TO_COMMAND).
CLIENTAPP, AGENTAPP = "flwr-clientapp", "flwr-agentapp"
LAUNCHERS = (CLIENTAPP, AGENTAPP, "flwr-model", "flwr-connector", "flwr-serverapp", "flwr-simulation")
# The flags a SuperExec passes a task process (flwr.common.args.add_args_flwr_app_common); value-taking ones True.
ARGS = {"--runtime-api-address": True, "--token": True, "--token-file": True, "--token-stdin": False,
        "--insecure": False, "--root-certificates": True, "--parent-pid": True,
        "--allow-runtime-dependency-installation": False}
EXIT_NO_HOOK = 3
EXIT_REFUSED = 4
REFUSAL = "fab not approved on this node"
MARKER = "# fedsyn FAB gate"
_HASH = re.compile(r"^[0-9a-f]{64}$")
# A plain FAB id and version (what Flower's own pyproject validation produces): no "/" beyond the
# id's one, no "..", nothing that can walk a path.
_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$")


class FabNotApproved(Exception):
    """The FAB is not one this node approved (its text is fixed: it is the server's reply)."""

    def __init__(self) -> None:
        super().__init__(REFUSAL)


def fab_sha256(fab: bytes) -> str:
    """SHA-256 of a FAB's bytes, as ``flwr run`` and Flower's installer compute it."""
    return hashlib.sha256(fab).hexdigest()


def apps_dir(allow_list: str | Path) -> Path:
    """The folder of approved trees that belongs to ``allow_list``: ``<allow-list>.apps``, one
    read-only tree per approved FAB, named by its full SHA-256 (``fedsyn node approve`` writes it)."""
    path = Path(allow_list)
    return path.with_name(path.name + ".apps")


def read_allow_list(path: str | Path) -> frozenset[str]:
    """The approved FAB hashes in ``path``: one SHA-256 (64 lowercase hex) per line, ``#`` starts
    a comment. Raises ``ValueError`` naming the line of anything else, ``OSError`` when unreadable."""
    hashes = set()
    for number, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), start=1):
        entry = line.split("#", 1)[0].strip()
        if not entry:
            continue
        if not _HASH.match(entry):
            raise ValueError(f"{path}, line {number}: {entry[:80]!r} is not a SHA-256 (64 lowercase hex digits)")
        hashes.add(entry)
    return frozenset(hashes)


def fab_manifest(fab: bytes) -> dict[str, str]:
    """{relative path: SHA-256} of the files a FAB installs (its ``.info/CONTENT``). Raises
    ``ValueError`` when the archive's members and its manifest differ, or a path is not plain."""
    with zipfile.ZipFile(io.BytesIO(fab)) as archive:
        members = {m.filename for m in archive.infolist() if not m.is_dir()}
        try:
            listing = archive.read(".info/CONTENT").decode("utf-8")
        except KeyError:
            raise ValueError("the FAB has no .info/CONTENT") from None
    manifest = {}
    for line in listing.strip().splitlines():
        rel, digest, _ = line.rsplit(",", 2)
        parts = Path(rel).parts
        if rel.startswith("/") or ".." in parts or not parts or rel in manifest:
            raise ValueError(f"the FAB lists {rel!r}: not a plain relative path")
        manifest[rel] = digest
    if members - {n for n in members if n.startswith(".info/")} != set(manifest):
        raise ValueError("the FAB's files and its .info/CONTENT differ")
    return manifest


def tree_differs(tree: Path, manifest: dict[str, str]) -> str:
    """Why the folder ``tree`` is not exactly the files of ``manifest`` with their bytes (a missing,
    changed or extra file, a link), or "" when it is."""
    if tree.is_symlink() or not tree.is_dir():
        return f"{tree} is not an installed folder"
    seen = set()
    for root, dirs, files in os.walk(tree):
        for name in [*dirs, *files]:
            path = Path(root) / name
            if path.is_symlink():
                return f"{path} is a link"
        for name in files:
            path = Path(root) / name
            rel = path.relative_to(tree).as_posix()
            if rel not in manifest:
                return f"{path} is not in the FAB"  # a planted module or a .pyc would be imported
            if hashlib.sha256(path.read_bytes()).hexdigest() != manifest[rel]:
                return f"{path} differs from the FAB"
            seen.add(rel)
    missing = sorted(set(manifest) - seen)
    return f"{tree / missing[0]} is missing" if missing else ""


def tree_metadata(tree: Path) -> tuple[str, str, str]:
    """(fab_id, fab_version, clientapp reference) that an installed tree's ``pyproject.toml`` states."""
    config = tomllib.loads((tree / "pyproject.toml").read_text(encoding="utf-8"))
    flwr = config["tool"]["flwr"]["app"]
    return f"{flwr['publisher']}/{config['project']['name']}", str(config["project"]["version"]), \
        str(flwr["components"].get("clientapp", ""))


def plain_fab_name(fab_id: str, fab_version: str) -> bool:
    """Whether a stated ``fab_id`` (``publisher/name``) and ``fab_version`` are plain names."""
    parts = fab_id.split("/")
    return len(parts) == 2 and all(_NAME.match(p) and ".." not in p for p in [*parts, fab_version])


class ClientAppGate:
    """``install_from_fab`` and the ClientApp loader of one ``flwr-clientapp`` process, behind the
    allow-list at ``allow_list`` and the approved trees beside it."""

    def __init__(self, allow_list: str | Path, log: Callable[[str], None]) -> None:
        self.allow_list = Path(allow_list)
        self.log = log
        self.approved: tuple[str, Path] | None = None  # (sha256, tree) of this process's FAB

    def install(self, fab_file: Any, *args: Any, **kwargs: Any) -> Path:
        """Flower's ``install_from_fab``: returns the approved tree of these bytes, or raises
        ``FabNotApproved`` before anything is unpacked (nothing is ever unpacked here)."""
        content = fab_file if isinstance(fab_file, bytes) else Path(fab_file).read_bytes()
        digest = fab_sha256(content)
        try:
            approved = read_allow_list(self.allow_list)
        except (OSError, ValueError) as err:
            return self._refuse(f"the allow-list {self.allow_list} cannot be read ({err}); FAB {digest} refused")
        if digest not in approved:
            return self._refuse(f"FAB {digest} is not in {self.allow_list}; refused before anything was unpacked. "
                                f"Review the app and approve it with: fedsyn node approve CHECKOUT "
                                f"--allow-list {self.allow_list}")
        tree = apps_dir(self.allow_list) / digest
        try:
            why = tree_differs(tree, fab_manifest(content))
        except (OSError, ValueError, zipfile.BadZipFile) as err:
            why = str(err)
        if why:
            return self._refuse(f"FAB {digest} is approved but its installed tree is not its bytes ({why}); "
                                f"refused. Approve it again: fedsyn node approve CHECKOUT --allow-list {self.allow_list}")
        self.approved = (digest, tree)
        self.log(f"fedsyn FAB gate: FAB {digest} approved; its ClientApp loads from {tree} only")
        return tree

    def load(self, fab_id: str, fab_version: str, fab_hash: str) -> Any:
        """Flower's ClientApp loader: the approved tree's ClientApp, when the stated ``fab_id``,
        ``fab_version`` and ``fab_hash`` are plain and name exactly that tree."""
        from flwr.clientapp.client_app import ClientApp, LoadClientAppError
        from flwr.supercore.object_ref import load_app

        if self.approved is None:
            return self._refuse("a ClientApp was to be loaded before its FAB passed the gate; refused")
        digest, tree = self.approved
        own_id, own_version, reference = tree_metadata(tree)
        if not plain_fab_name(fab_id, fab_version) or (fab_id, fab_version, fab_hash) != (own_id, own_version, digest):
            return self._refuse(f"the run states FAB {fab_id!r} {fab_version!r} {fab_hash!r}, but the approved bytes "
                                f"are {own_id} {own_version} {digest}; refused")
        app = load_app(reference, LoadClientAppError, tree)
        if not isinstance(app, ClientApp):
            raise LoadClientAppError(f"{reference} is not a ClientApp")
        stray = imported_outside(tree)
        if stray:  # e.g. an installed copy of the app's package found first: not the bytes approved
            return self._refuse(f"{stray} was imported from outside the approved tree {tree}; refused")
        return app

    def loader(self, *args: Any, **kwargs: Any) -> Callable[[str, str, str], Any]:
        """Flower's ``get_load_client_app_fn``, whatever its arguments: this gate's loader."""
        return self.load

    def _refuse(self, reason: str) -> Any:
        self.log(f"fedsyn FAB gate: {reason}")
        raise FabNotApproved()


def imported_outside(tree: Path) -> str:
    """The first imported module of one of ``tree``'s top-level packages or modules whose file is
    not inside ``tree``, or ""."""
    tops = {p.stem if p.suffix == ".py" else p.name for p in tree.iterdir() if p.is_dir() or p.suffix == ".py"}
    root = tree.resolve()
    for name, module in list(sys.modules.items()):
        if name.split(".")[0] not in tops:
            continue
        files = [getattr(module, "__file__", None), *list(getattr(module, "__path__", []) or [])]
        for file in filter(None, files):
            if not Path(file).resolve().is_relative_to(root):
                return f"{name} ({file})"
    return ""


def refuse_every_fab(*args: Any, **kwargs: Any) -> Any:
    """An ``install_from_fab`` that approves nothing (agent apps: fedsyn ships none)."""
    raise FabNotApproved()


def _rebind(original: Callable[..., Any], replacement: Callable[..., Any]) -> None:
    """Point every loaded module's name for ``original`` at ``replacement`` (``from x import f``
    binds a copy of the name in each importer)."""
    for module in list(sys.modules.values()):
        for name, value in list(getattr(module, "__dict__", {}).items()):
            if value is original:
                setattr(module, name, replacement)


def check_hook(role: str, flower_version: str) -> Any:
    """Import Flower's runner for ``role`` with ``install_from_fab`` already replaced where it is
    defined, and return it; raise ``RuntimeError`` unless Flower is exactly one of ``FLOWER`` and
    the runner still installs through ``install_from_fab`` (and loads the ClientApp through
    ``get_load_client_app_fn``), the places this gate replaces."""
    if flower_version not in FLOWER:
        raise RuntimeError(f"Flower {flower_version} is not one this FAB gate was read against "
                           f"({', '.join(FLOWER)}); pin the node's Flower to it")
    # import_module, not `import a.b as m`: a package that re-exports a function of its module's
    # name (flwr.supercore.task_process.agent.run_agentapp) would hand back the function
    if role == CLIENTAPP:
        runner = importlib.import_module("flwr.supernode.runtime.run_clientapp")
        from flwr.clientapp.client_app import ClientApp, LoadClientAppError  # noqa: F401  (ClientAppGate.load's)
        from flwr.supercore.object_ref import load_app  # noqa: F401
        calls = runner.run_clientapp.__code__.co_names
        needed = ("install_from_fab", "get_load_client_app_fn")
    elif role == AGENTAPP:
        runner = importlib.import_module("flwr.supercore.task_process.agent.run_agentapp")
        calls = (runner._AgentAppTaskLifecycle._prepare_task_app.__code__.co_names
                 + runner.preload_agentapp.__code__.co_names)
        needed = ("install_from_fab",)
    else:
        raise RuntimeError(f"{role}: no Flower runner is allowed under this name")
    if not all(name in calls and callable(getattr(runner, name, None)) for name in needed):
        raise RuntimeError(f"Flower {flower_version}: {role} no longer goes through {', '.join(needed)}; "
                           "this gate cannot check the FAB")
    return runner


def task_args(argv: list[str]) -> list[str]:
    """``argv`` with ``--allow-runtime-dependency-installation`` dropped; raises ``ValueError`` on
    any flag a SuperExec does not pass (the gate forwards nothing it has not read)."""
    kept, i = [], 0
    while i < len(argv):
        flag = argv[i].split("=", 1)[0]
        if flag not in ARGS:
            raise ValueError(f"unexpected argument {argv[i][:80]!r}")
        takes_value = ARGS[flag] and "=" not in argv[i]
        if flag != "--allow-runtime-dependency-installation":
            kept += argv[i:i + 1 + takes_value]
        i += 1 + takes_value
    return kept


def main(role: str, allow_list: str, argv: list[str] | None = None) -> int:
    """Run the task process ``role`` behind the gate; returns an exit code."""
    sys.dont_write_bytecode = True  # a .pyc written beside the approved tree would be imported next time
    argv = list(sys.argv[1:] if argv is None else argv)

    def log(text: str) -> None:
        print(text, file=sys.stderr, flush=True)

    try:
        args = task_args(argv)
    except ValueError as err:
        log(f"fedsyn FAB gate: {role}: {err}; refused")
        return EXIT_REFUSED
    if role not in (CLIENTAPP, AGENTAPP):
        log(f"fedsyn FAB gate: {role}: this node runs no {role} task; refused before connecting")
        return EXIT_REFUSED
    import flwr.cli.install as installer

    original = installer.install_from_fab
    gate = ClientAppGate(allow_list, log) if role == CLIENTAPP else None
    replacement = gate.install if gate else refuse_every_fab
    installer.install_from_fab = replacement
    try:
        runner = check_hook(role, version("flwr"))
    except (ImportError, RuntimeError, AttributeError) as err:
        log(f"fedsyn FAB gate: {err}; no {role} runs on this node until it is fixed")
        return EXIT_NO_HOOK
    _rebind(original, replacement)
    if runner.install_from_fab is not replacement:  # fail closed: the runner would install unchecked
        log(f"fedsyn FAB gate: {role}: Flower's runner still holds its own installer; no {role} runs on this node")
        return EXIT_NO_HOOK
    sys.argv = [role, *args]
    if gate is not None:
        runner.get_load_client_app_fn = gate.loader
        from flwr.supernode.cli.flwr_clientapp import flwr_clientapp as entry
    else:
        log("fedsyn FAB gate: flwr-agentapp: this node approves no agent app; its FAB is refused unread")
        from flwr.supercore.cli.flwr_agentapp import flwr_agentapp as entry
    entry()
    return 0


def launcher_source(python: str, allow_list: str, role: str = CLIENTAPP) -> str:
    """The text of the launcher ``role`` (one of ``LAUNCHERS``): this module run by ``python -I``,
    its role and allow-list fixed in it (``fedsyn node install-launcher``)."""
    body = Path(__file__).read_text(encoding="utf-8")
    return (f"#!{python} -I\n{MARKER}: written by `fedsyn node install-launcher`; edit nothing here.\n"
            f"{body}\n\nROLE = {role!r}\nALLOW_LIST = {allow_list!r}\n\n"
            f"if __name__ == \"__main__\":\n    sys.exit(main(ROLE, ALLOW_LIST))\n")


def launcher_facts(path: str | Path) -> tuple[str, str, str, bool]:
    """(role, allow-list, Python, whether its gate is this module's code) of the launcher at
    ``path``, for ``fedsyn node-check``. Raises ``ValueError`` when ``path`` is not a fedsyn gate."""
    text = Path(path).read_text(encoding="utf-8", errors="replace")
    lines = text.splitlines()
    if len(lines) < 2 or not lines[1].startswith(MARKER) or not lines[0].endswith(" -I"):
        raise ValueError(f"{path} is not a fedsyn FAB gate (Flower's own launcher runs any FAB)")
    role = re.search(r"^ROLE = '([^'\n]*)'$", text, re.MULTILINE)
    allow = re.search(r"^ALLOW_LIST = '([^'\n]*)'$", text, re.MULTILINE)
    if role is None or allow is None:
        raise ValueError(f"{path}: a fedsyn FAB gate of an older fedsyn; install it again")
    python = lines[0][2:-3]
    return role.group(1), allow.group(1), python, launcher_source(python, allow.group(1), role.group(1)) == text

