"""Where a simulated node's handlers ran: one JSON line per message, in the node's own state.

In simulation Flower runs a node's messages on whichever ClientApp actor is free, and on a
Ray cluster that actor may be on another machine for every message. ``workers.jsonl`` beside
the node's ledger says, for each message, the host, the process and the Ray node that handled
it. It is written on the node and never sent: the server learns nothing from it. It is what
shows that a node moved between Ray nodes and kept one ledger, and which process to look at
when a worker died. Only simulated nodes write it, by default into their run's own state folder
(``run-<run key>/node-<partition>``, ``fedsyn_client.node.simulation_state_root``), so it holds
one run's messages; a deployed node, which runs for years, never writes it.
"""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

from common.io import jsonl_line

PLACEMENT_FILE = "workers.jsonl"


def ray_node_id() -> str:
    """The Ray node this process runs on, or "" outside a Ray worker."""
    try:
        import ray  # present with flwr[simulation]; a deployed node need not have it

        if ray.is_initialized():
            return str(ray.get_runtime_context().get_node_id())
    except Exception:  # noqa: BLE001 - where a message ran is a note, never a reason to fail it
        pass
    return ""


def record_placement(state_dir: str | Path, kind: str, partition: int) -> None:
    """Append where this message of ``kind`` for ``partition`` runs to ``state_dir/workers.jsonl``
    (written before the handler's work, so a worker that dies mid-message is on record)."""
    folder = Path(state_dir)
    folder.mkdir(parents=True, exist_ok=True)
    line = jsonl_line({"time": time.time(), "kind": kind, "partition": partition, "host": socket.gethostname(),
                       "pid": os.getpid(), "ray_node": ray_node_id()})
    # One write of one line in append mode: processes on several Ray nodes never interleave lines.
    with open(folder / PLACEMENT_FILE, "a", encoding="utf-8") as fh:
        fh.write(line + "\n")
