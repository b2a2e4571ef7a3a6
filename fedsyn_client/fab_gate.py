"""The node's FAB gate: a SuperNode runs only the Flower App Bundles its operator approved.

Everything a node promises (its policy, its ledger, fixed refusal texts, noise on the node) is
enforced by the ClientApp, and in a deployment that code arrives from the server in the FAB that
``flwr run`` uploaded. Flower 1.41/1.42 unpacks it under ``$FLWR_HOME/apps`` and imports the
ClientApp its ``pyproject.toml`` names; ``--trusted-entities`` only verifies Flower Hub apps. This
gate closes that without patching Flower: it *is* the ``flwr-clientapp`` command the node runs.

``fedsyn node install-launcher DIR --allow-list FILE`` writes ``DIR/flwr-clientapp``: this file,
run by the node venv's Python in isolated mode (``-I``: no current directory, no ``PYTHON*``
variables), with the allow-list's path fixed in it. With ``DIR`` first in the ``PATH`` of the
SuperNode (subprocess isolation: the SuperNode starts ``flower-superexec``, which starts
``flwr-clientapp`` by name) or of the operator's own ``flower-superexec`` (process isolation),
every message's ClientApp process starts here, and:

1. the installed Flower must be one this gate was written against (``FLOWER``) and the hook must
   exist: ``run_clientapp`` calls the module-level ``install_from_fab`` before it unpacks or
   imports anything. Otherwise the process exits (``EXIT_NO_HOOK``) before it pulls the message:
   fail closed, nothing of the FAB is read;
2. ``install_from_fab`` is wrapped: the SHA-256 of the FAB's bytes (computed here, never the
   hash the SuperLink states) must be in the allow-list, read afresh for each message. Else
   ``FabNotApproved`` is raised before a byte is unpacked; Flower replies with its fixed text and
   the node's records, ledger and state are not touched. An unreadable allow-list approves nothing;
3. ``--allow-runtime-dependency-installation`` is dropped: the node's venv is what the
   institution trusts, not a dependency list that came with the FAB;
4. Flower's own entry point runs as usual.

It imports nothing of fedsyn (stdlib and Flower only): Flower imports the FAB's packages by
name, and a fedsyn module already imported here would be used instead of the FAB's.
"""

import hashlib
import re
import sys
from collections.abc import Callable
from importlib.metadata import version
from pathlib import Path
from typing import Any

# The Flower releases whose run_clientapp this gate was read against (major, minor): the hook is
# Flower-internal, so another release is refused until someone reads it again.
FLOWER = ((1, 41), (1, 42))
EXIT_NO_HOOK = 3
REFUSAL = "fab not approved on this node"
MARKER = "# fedsyn FAB gate"
_HASH = re.compile(r"^[0-9a-f]{64}$")


class FabNotApproved(Exception):
    """The FAB's hash is not in the node's allow-list (its text is fixed: it is the server's reply)."""

    def __init__(self) -> None:
        super().__init__(REFUSAL)


def fab_sha256(fab: bytes) -> str:
    """SHA-256 of a FAB's bytes, as ``flwr run`` and Flower's installer compute it."""
    return hashlib.sha256(fab).hexdigest()


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


def check_hook(flower_version: str, run_clientapp_module: Any) -> None:
    """Raise ``RuntimeError`` unless Flower is one of ``FLOWER`` and ``run_clientapp`` still calls
    the module-level ``install_from_fab`` (the one place this gate wraps)."""
    major_minor = tuple(int(x) for x in re.findall(r"\d+", flower_version)[:2])
    if major_minor not in FLOWER:
        raise RuntimeError(f"Flower {flower_version} is not one this FAB gate was written against "
                           f"({', '.join(f'{a}.{b}' for a, b in FLOWER)}); pin the node's Flower to one of them")
    install = getattr(run_clientapp_module, "install_from_fab", None)
    runner = getattr(run_clientapp_module, "run_clientapp", None)
    if not callable(install) or runner is None or "install_from_fab" not in runner.__code__.co_names:
        raise RuntimeError(f"Flower {flower_version}: run_clientapp no longer installs the FAB through "
                           "install_from_fab; this gate cannot check the FAB")


def gated(install: Callable[..., Any], allow_list: str | Path, log: Callable[[str], None]) -> Callable[..., Any]:
    """``install`` (Flower's ``install_from_fab``) behind the allow-list at ``allow_list``."""

    def install_from_fab(fab_file: Any, *args: Any, **kwargs: Any) -> Any:
        content = fab_file if isinstance(fab_file, bytes) else Path(fab_file).read_bytes()
        digest = fab_sha256(content)
        try:
            approved = read_allow_list(allow_list)
        except (OSError, ValueError) as err:
            log(f"fedsyn FAB gate: the allow-list {allow_list} cannot be read ({err}); FAB {digest} refused")
            raise FabNotApproved() from None
        if digest not in approved:
            log(f"fedsyn FAB gate: FAB {digest} is not in {allow_list}; refused before anything was unpacked. "
                f"Review the app and approve it with: fedsyn node approve CHECKOUT --allow-list {allow_list}")
            raise FabNotApproved()
        log(f"fedsyn FAB gate: FAB {digest} approved")
        return install(fab_file, *args, **kwargs)

    return install_from_fab


def main(allow_list: str, argv: list[str] | None = None) -> int:
    """Run Flower's ``flwr-clientapp`` behind the gate; returns an exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)

    def log(text: str) -> None:
        print(text, file=sys.stderr, flush=True)

    try:
        import flwr.supernode.runtime.run_clientapp as runtime

        check_hook(version("flwr"), runtime)
    except (ImportError, RuntimeError) as err:
        log(f"fedsyn FAB gate: {err}; no ClientApp runs on this node until it is fixed")
        return EXIT_NO_HOOK
    runtime.install_from_fab = gated(runtime.install_from_fab, allow_list, log)
    from flwr.supernode.cli.flwr_clientapp import flwr_clientapp

    sys.argv = ["flwr-clientapp", *(a for a in argv if a != "--allow-runtime-dependency-installation")]
    flwr_clientapp()
    return 0


def launcher_source(python: str, allow_list: str) -> str:
    """The text of a ``flwr-clientapp`` launcher: this module run by ``python -I``, the allow-list
    fixed in it (``fedsyn node install-launcher``)."""
    body = Path(__file__).read_text(encoding="utf-8")
    return (f"#!{python} -I\n{MARKER}: written by `fedsyn node install-launcher`; edit nothing here.\n"
            f"{body}\n\nALLOW_LIST = {allow_list!r}\n\nif __name__ == \"__main__\":\n    sys.exit(main(ALLOW_LIST))\n")


def launcher_facts(path: str | Path) -> tuple[str, bool]:
    """(the allow-list a launcher at ``path`` names, whether its gate is this module's code) for
    ``fedsyn node-check``. Raises ``ValueError`` when ``path`` is not a fedsyn FAB gate."""
    text = Path(path).read_text(encoding="utf-8", errors="replace")
    lines = text.splitlines()
    if len(lines) < 2 or not lines[1].startswith(MARKER):
        raise ValueError(f"{path} is not a fedsyn FAB gate (Flower's own flwr-clientapp runs any FAB)")
    match = re.search(r"^ALLOW_LIST = '([^'\n]*)'$", text, re.MULTILINE)
    if match is None:
        raise ValueError(f"{path}: a fedsyn FAB gate without its allow-list; install it again")
    return match.group(1), launcher_source(lines[0][2:-3], match.group(1)) == text
