"""The node's FAB gate: a SuperNode runs only the app code its operator approved, through every door.

Everything a node promises (its policy, its ledger, fixed refusal texts, noise on the node) is
enforced by the ClientApp, and in a deployment that code arrives from the server in the FAB. Flower
1.42 has several doors through which a FAB's code can run on the node: the SuperExec starts a task
process *by name from PATH* for every task type (``flwr.supercore.constant.TASK_TYPE_TO_COMMAND``:
``flwr-clientapp``, ``flwr-agentapp``, ``flwr-model``, ``flwr-connector``, ``flwr-serverapp``,
``flwr-simulation``), and each runner installs the FAB with ``flwr.cli.install.install_from_fab``
and imports a folder named from the *server-stated* ``fab_id``/``fab_version``. The review of
every call that imports app code, and where this gate covers it, is in ``docs/privacy.md``.

``fedsyn node install-launcher DIR --allow-list FILE`` writes one launcher per task-process name,
and one for ``flower-supernode``, into ``DIR``: this file, run by the node venv's Python in isolated
mode (``-I``: no current
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
5. every other name: exits (``EXIT_REFUSED``) before it connects anywhere;
6. ``flower-supernode`` (the operator starts it, ``deploy/start_node.sh``): Flower's SuperNode
   reads every run's FAB *itself* before any task process starts
   (``flwr/supernode/start_client_internal.py:_pull_and_store_message`` →
   ``flwr/common/config.py:get_fused_config_from_fab``, which inflates ``pyproject.toml`` whole:
   a 525 KB zip made it allocate 1,073 MiB). That name is replaced in the SuperNode's module by
   :class:`SuperNodeGate`: a FAB over the bounds, or not approved, is never read (its run config is
   empty, and the ClientApp's gate refuses it with ``REFUSAL``).

Bounds (``fab_bounds``), checked before anything of a FAB is inflated, from the zip's end record
and central directory only: its size (``MAX_FAB_BYTES``), its entries (``MAX_ENTRIES``, and the
central directory's bytes, ``MAX_CENTRAL_DIRECTORY``, which is what ``zipfile`` parses), the
declared unpacked total (``MAX_UNPACKED_BYTES``), the compression ratio of each member and of the
whole (``MAX_RATIO`` above ``RATIO_FLOOR`` bytes), and the methods (stored or deflated). Declared
sizes can lie, so a member the gate reads is read by ``read_member``, in chunks, refused the
moment it inflates past its declared size.

It imports nothing of fedsyn (stdlib and Flower only): the ClientApp's packages must come from the
approved tree, and a fedsyn module already imported here would be used instead.
"""

import copy
import hashlib
import importlib
import io
import os
import re
import struct
import sys
import tomllib
import zipfile
import zlib
from collections.abc import Callable
from importlib.metadata import version
from pathlib import Path
from typing import Any

# The Flower releases whose doors this gate was read against, exactly: the hooks are Flower-internal,
# so another release (a patch release included) is refused until someone reads it again.
FLOWER = ("1.42.0",)
# Every task-process name Flower 1.42.0's SuperExec starts by name (TASK_TYPE_TO_COMMAND).
CLIENTAPP, AGENTAPP = "flwr-clientapp", "flwr-agentapp"
# ... and the SuperNode itself, which reads every FAB before any task process sees it.
SUPERNODE = "flower-supernode"
LAUNCHERS = (CLIENTAPP, AGENTAPP, "flwr-model", "flwr-connector", "flwr-serverapp", "flwr-simulation", SUPERNODE)
# The flags a SuperExec passes a task process (flwr.common.args.add_args_flwr_app_common); value-taking ones True.
ARGS = {"--runtime-api-address": True, "--token": True, "--token-file": True, "--token-stdin": False,
        "--insecure": False, "--root-certificates": True, "--parent-pid": True,
        "--allow-runtime-dependency-installation": False}
EXIT_NO_HOOK = 3
EXIT_REFUSED = 4
REFUSAL = "fab not approved on this node"
MARKER = "# fedsyn FAB gate"
# \Z, not $: `$` also matches before a trailing newline, so "1.0.0\n" would pass as plain.
_HASH = re.compile(r"\A[0-9a-f]{64}\Z")
# A plain FAB id and version (what Flower's own pyproject validation produces): no "/" beyond the
# id's one, no "..", nothing that can walk a path.
_NAME = re.compile(r"\A[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}\Z")
# What a node accepts of a FAB before anything inflates it (fab_bounds). fedsyn's own FAB is
# 1.4 MB, 196 entries, 1.4 MB unpacked, stored (ratio 1): each bound is far above an app and far
# below what hurts a node.
MAX_FAB_BYTES = 50 * 2**20
MAX_ENTRIES = 10_000
# zipfile reads the whole central directory and parses every entry into an object before anyone
# can count them (89,000 minimal entries in 4 MiB: 31 MiB, 5 s), so the gate counts the headers
# itself first, and caps the bytes zipfile then reads (10,000 entries of ~400 bytes).
MAX_CENTRAL_DIRECTORY = 4 * 2**20
MAX_UNPACKED_BYTES = 200 * 2**20
MAX_RATIO = 100
# Below this many unpacked bytes no ratio is a bomb (an empty __init__.py "inflates" 0 from 2).
RATIO_FLOOR = 2**20
# What one read of a member inflates at most: zipfile's read() asks zlib for up to 1 GiB at once.
_CHUNK = 2**16


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


def fab_bounds(fab: bytes) -> str:
    """Why the FAB ``fab`` is more than a node unpacks (size, entries, declared unpacked size,
    ratio, method), or "" when it is within every bound. Reads the zip's end record and central
    directory only: nothing is inflated."""
    if len(fab) > MAX_FAB_BYTES:
        return f"the FAB is {len(fab):,} bytes, over the bound of {MAX_FAB_BYTES:,}"
    try:
        # the very record ZipFile reads next, found by its own search (a private helper: the gate
        # runs on the node venv's Python, and fails closed if it is gone)
        end = zipfile._EndRecData(io.BytesIO(fab))  # type: ignore[attr-defined]  # zipfile's own private reader, not in typeshed
        if end is None:
            return "the FAB is not a zip archive"
        entries, directory = end[zipfile._ECD_ENTRIES_TOTAL], end[zipfile._ECD_SIZE]  # type: ignore[attr-defined]  # as above
    except (AttributeError, TypeError, OSError, ValueError) as err:
        return f"the FAB's end record cannot be read ({type(err).__name__})"
    if end[0] != zipfile.stringEndArchive:  # type: ignore[attr-defined]  # zipfile's constant, not in typeshed
        return "the FAB is a zip64 archive (no FAB within the bounds needs one)"
    if entries > MAX_ENTRIES or directory > MAX_CENTRAL_DIRECTORY:
        return (f"the FAB states {entries:,} entries in {directory:,} bytes of central directory, over the bounds "
                f"of {MAX_ENTRIES:,} and {MAX_CENTRAL_DIRECTORY:,}")
    # the stated count is not what zipfile walks: it walks the directory's bytes, header by header
    counted = _directory_entries(fab, end[zipfile._ECD_LOCATION] - directory, directory)  # type: ignore[attr-defined]  # zipfile's constant, not in typeshed
    if counted < 0:
        return "the FAB's central directory is not a zip's"
    if counted > MAX_ENTRIES:
        return f"the FAB has over {MAX_ENTRIES:,} entries, the bound"
    try:
        with zipfile.ZipFile(io.BytesIO(fab)) as archive:
            members = archive.infolist()
    except (zipfile.BadZipFile, OSError, ValueError, EOFError) as err:
        return f"the FAB is not a readable zip ({err})"
    if len(members) > MAX_ENTRIES:
        return f"the FAB has {len(members):,} entries, over the bound of {MAX_ENTRIES:,}"
    for member in members:
        why = _member_bounds(member)
        if why:
            return why
    total = sum(m.file_size for m in members)
    if total > MAX_UNPACKED_BYTES:
        return f"the FAB declares {total:,} bytes unpacked, over the bound of {MAX_UNPACKED_BYTES:,}"
    if total > RATIO_FLOOR and total > MAX_RATIO * len(fab):
        return f"the FAB declares {total:,} bytes unpacked from {len(fab):,}: a ratio over {MAX_RATIO}"
    return ""


def _directory_entries(fab: bytes, start: int, size: int) -> int:
    """How many central-directory headers ``fab[start:start + size]`` holds, walked as zipfile walks
    them and counted to at most ``MAX_ENTRIES + 1`` (nothing is parsed beyond); -1 when the walk
    meets something that is not a header."""
    pos, count = start, 0
    while pos < start + size and count <= MAX_ENTRIES:
        if pos < 0 or pos + 46 > len(fab) or fab[pos:pos + 4] != zipfile.stringCentralDir:  # type: ignore[attr-defined]  # as above
            return -1
        names, extra, comment = struct.unpack_from("<3H", fab, pos + 28)
        pos += 46 + names + extra + comment
        count += 1
    return count


def _member_bounds(member: zipfile.ZipInfo) -> str:
    """Why one central-directory entry is not one a node inflates, or ""."""
    name = member.filename[:80]
    if member.compress_type not in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED) or member.flag_bits & 0x1:
        return (f"the FAB's {name!r} is encrypted or compressed by method {member.compress_type} "
                "(a FAB is stored or deflated)")
    if member.compress_type == zipfile.ZIP_STORED and member.file_size != member.compress_size:
        return f"the FAB's stored {name!r} declares {member.file_size:,} bytes in {member.compress_size:,}"
    if member.file_size > RATIO_FLOOR and member.file_size > MAX_RATIO * member.compress_size:
        return (f"the FAB's {name!r} declares {member.file_size:,} bytes from {member.compress_size:,}: "
                f"a ratio over {MAX_RATIO}")
    return ""


def read_member(archive: zipfile.ZipFile, name: str) -> bytes:
    """The bytes of the member ``name`` of ``archive`` (a FAB that passed ``fab_bounds``), inflated
    ``_CHUNK`` at a time. Raises ``ValueError`` the moment it inflates past its declared size, or when
    it ends short of it; ``KeyError`` when there is no such member. Memory: its declared size plus a chunk."""
    member = archive.getinfo(name)
    # zipfile stops a member at its declared size, but only after inflating what one read asks for;
    # a probe that declares one byte more lets the stream show that it goes on (its CRC is checked
    # here, on the bytes as declared)
    probe = copy.copy(member)
    probe.file_size, probe.CRC = member.file_size + 1, None  # type: ignore[assignment]  # None: zipfile checks no CRC on the probe
    data = bytearray()
    with archive.open(probe) as stream:
        while chunk := stream.read(_CHUNK):
            data += chunk
            if len(data) > member.file_size:
                raise ValueError(f"the FAB's {name[:80]!r} inflates past its declared {member.file_size:,} bytes")
    if len(data) != member.file_size:
        raise ValueError(f"the FAB's {name[:80]!r} inflates to {len(data):,} bytes, "
                         f"not its declared {member.file_size:,}")
    if zlib.crc32(data) != member.CRC:
        raise ValueError(f"the FAB's {name[:80]!r} does not match its CRC-32")
    return bytes(data)


def read_fab(fab_file: Any) -> bytes:
    """The bytes of a FAB as Flower hands it over (bytes, or a path), a path read to at most one
    byte over ``MAX_FAB_BYTES`` (``fab_bounds`` refuses it then)."""
    if isinstance(fab_file, bytes):
        return fab_file
    with open(fab_file, "rb") as handle:
        return handle.read(MAX_FAB_BYTES + 1)


def fab_manifest(fab: bytes) -> dict[str, str]:
    """{relative path: SHA-256} of the files a FAB installs (its ``.info/CONTENT``). Raises
    ``ValueError`` when the FAB is over a bound (``fab_bounds``), its members and its manifest differ,
    or a path is not plain."""
    why = fab_bounds(fab)
    if why:
        raise ValueError(why)
    with zipfile.ZipFile(io.BytesIO(fab)) as archive:
        members = {m.filename for m in archive.infolist() if not m.is_dir()}
        try:
            listing = read_member(archive, ".info/CONTENT").decode("utf-8")
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
        ``FabNotApproved`` before anything is unpacked (nothing is ever unpacked here; of an
        approved FAB within the bounds, only ``.info/CONTENT`` is inflated, by ``read_member``)."""
        content = read_fab(fab_file)
        digest = fab_sha256(content)
        why = fab_bounds(content)
        if why:
            return self._refuse(f"FAB {digest}: {why}; refused before anything was unpacked")
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
        except (OSError, ValueError, EOFError, zipfile.BadZipFile, zlib.error) as err:
            why = str(err)
        if why:
            return self._refuse(f"FAB {digest} is approved but its installed tree is not its bytes ({why}); "
                                "refused. Approve it again: "
                                f"fedsyn node approve CHECKOUT --allow-list {self.allow_list}")
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


class SuperNodeGate:
    """Flower's ``get_fused_config_from_fab`` in the SuperNode process (``original``), behind the
    bounds and the allow-list at ``allow_list``: the SuperNode reads the FAB of every run a server
    starts, before any task process (and so the ClientApp's gate) sees it."""

    def __init__(self, allow_list: str | Path, log: Callable[[str], None], original: Callable[..., Any]) -> None:
        self.allow_list = Path(allow_list)
        self.log = log
        self.original = original

    def fused_config(self, fab_file: Any, run: Any) -> Any:
        """The run config Flower fuses from an approved FAB within the bounds (Flower reads it);
        ``{}`` for any other, whose bytes are never inflated: its task process is refused by the
        ClientApp's gate (``REFUSAL``), so its config is never used. Raising instead would stop the
        SuperNode: Flower does not catch an error here."""
        content = read_fab(fab_file)
        digest = fab_sha256(content)
        why = fab_bounds(content) or self._unapproved(digest)
        if not why:
            try:
                with zipfile.ZipFile(io.BytesIO(content)) as archive:
                    read_member(archive, "pyproject.toml")  # its true size: Flower inflates it in one call
            except (KeyError, ValueError, OSError, EOFError, zipfile.BadZipFile, zlib.error) as err:
                why = f"its pyproject.toml cannot be read within its declared size ({err})"
        if why:
            self.log(f"fedsyn FAB gate: SuperNode: FAB {digest}: {why}; Flower does not read it, and its "
                     f"ClientApp is refused")
            return {}
        return self.original(content, run)

    def _unapproved(self, digest: str) -> str:
        """Why ``digest`` is not approved now (the allow-list is read afresh), or ""."""
        try:
            approved = read_allow_list(self.allow_list)
        except (OSError, ValueError) as err:
            return f"the allow-list {self.allow_list} cannot be read ({err})"
        return "" if digest in approved else f"not in {self.allow_list}"


def supernode_hook(allow_list: str | Path, log: Callable[[str], None], flower_version: str) -> Any:
    """Put a :class:`SuperNodeGate` in place of ``get_fused_config_from_fab`` in Flower's SuperNode
    loop (``flwr.supernode.start_client_internal``) and in every loaded module that holds the name;
    returns that module. Raises ``RuntimeError`` unless Flower is one of ``FLOWER`` and its loop
    still reads the FAB through that name (and through nothing else that unzips)."""
    if flower_version not in FLOWER:
        raise RuntimeError(f"Flower {flower_version} is not one this FAB gate was read against "
                           f"({', '.join(FLOWER)}); pin the node's Flower to it")
    internal = importlib.import_module("flwr.supernode.start_client_internal")
    original = getattr(internal, "get_fused_config_from_fab", None)
    reads = internal._pull_and_store_message.__code__.co_names
    if not callable(original) or "get_fused_config_from_fab" not in reads:
        raise RuntimeError(f"Flower {flower_version}: the SuperNode no longer reads a FAB through "
                           "get_fused_config_from_fab; this gate cannot bound it")
    gate = SuperNodeGate(allow_list, log, original)
    _rebind(original, gate.fused_config)
    internal.get_fused_config_from_fab = gate.fused_config  # type: ignore[attr-defined]  # Flower's function (checked present above)
    return internal


def run_supernode(allow_list: str, argv: list[str], log: Callable[[str], None]) -> int:
    """Flower's ``flower-supernode`` with ``argv`` (the operator's own flags, passed as they are),
    its FAB reads behind :class:`SuperNodeGate`; returns an exit code."""
    try:
        supernode_hook(allow_list, log, version("flwr"))
    except (ImportError, RuntimeError, AttributeError) as err:
        log(f"fedsyn FAB gate: {err}; the SuperNode does not start until it is fixed")
        return EXIT_NO_HOOK
    from flwr.supernode.cli.flower_supernode import flower_supernode

    sys.argv = [SUPERNODE, *argv]
    flower_supernode()
    return 0


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
        from flwr.clientapp.client_app import ClientApp, LoadClientAppError  # noqa: F401 - ClientAppGate.load's imports, loaded now
        from flwr.supercore.object_ref import load_app  # noqa: F401 - as above
        calls = runner.run_clientapp.__code__.co_names
        needed: tuple[str, ...] = ("install_from_fab", "get_load_client_app_fn")
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

    if role == SUPERNODE:  # started by the operator, not by a SuperExec: its flags are the operator's
        return run_supernode(allow_list, argv, log)
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

