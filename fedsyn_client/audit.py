"""An outgoing-message audit log: what left this node, written on this node.

Enabled by node-config ``audit-dir`` (or the ``FEDSYN_AUDIT_DIR`` environment variable,
which reaches simulated nodes). Every reply the ClientApp sends is appended as one JSON
line: message type, error if any, and for each record its kind, keys, value types,
lengths and the values themselves. An institution can read exactly what it released;
the leak tests read it to prove no record text ever leaves.
"""

from __future__ import annotations

import os
import time
import traceback
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from flwr.app import Context, Error, Message
from flwr.clientapp.typing import ClientAppCallable

from common import records as R
from common.io import folder_write_problem, jsonl_line
from common.logs import get_logger
from fedsyn_client import refusals

log = get_logger(__name__)

AUDIT_ENV = "FEDSYN_AUDIT_DIR"


def audit_dir(context: Context) -> Path | None:
    """The audit folder for this node, or None when auditing is off."""
    return audit_folder(context.node_config)


def audit_folder(node_config: Mapping[str, Any]) -> Path | None:
    """The audit folder a node config names (``audit-dir``, else ``FEDSYN_AUDIT_DIR``), or None."""
    value = node_config.get("audit-dir") or os.environ.get(AUDIT_ENV)
    return Path(str(value)) if value else None


def check_audit_dir(folder: Path | None) -> None:
    """Raise ``NodeSetupError`` unless ``folder`` (None: no audit) can be created and written: a
    node fact, checked before a request is authorised so that no release is charged and then
    withheld for want of its audit line."""
    why = folder_write_problem(folder) if folder is not None else ""
    if why:
        raise refusals.NodeSetupError(f"audit-dir {folder} cannot be written ({why}); fix its "
                                      "permissions or unset audit-dir")


def describe_reply(reply: Message) -> dict[str, Any]:
    """A JSON-serialisable description of a reply's content (or its error)."""
    out: dict[str, Any] = {"message_type": reply.metadata.message_type, "time": time.time()}
    if reply.has_error():
        out["error"] = {"code": reply.error.code, "reason": reply.error.reason}
        return out
    records: dict[str, Any] = {}
    for key, rec in reply.content.array_records.items():
        records[key] = {"kind": "array", "arrays": {k: {"shape": list(a.shape), "dtype": a.dtype}
                                                    for k, a in rec.items()}}
    for kind, group in (("metric", reply.content.metric_records), ("config", reply.content.config_records)):
        for key, values in group.items():
            records[key] = {"kind": kind, "values": {k: _plain(v) for k, v in values.items()}}
    out["records"] = records
    return out


def audit_mod(msg: Message, context: Context, call_next: ClientAppCallable) -> Message:
    """Flower mod: pass the message on, then append the reply's description to the audit log.

    Inside the same guard as the handlers: a write that fails (a full disk, a folder the node
    cannot write) is logged here and the server gets the fixed ``FAILED`` text instead of the
    reply, never Flower's exception text (which names the path). Failing closed: an institution
    that asked for an audit of every outgoing message never sends one the audit missed; a release
    stays charged and stored, so the server's repeat of the request gets it once it is logged.
    """
    reply = call_next(msg, context)
    folder = audit_dir(context)
    if folder is not None:
        try:
            folder.mkdir(parents=True, exist_ok=True)
            line = jsonl_line({"node_id": context.node_id, **describe_reply(reply)})
            # One write of one line in append mode: concurrent writers never interleave lines.
            with open(folder / f"node-{context.node_id}.jsonl", "a", encoding="utf-8") as fh:
                fh.write(line + "\n")
        except Exception:  # noqa: BLE001 - the reply must be a fixed text whatever failed
            log.error("the audit log in %s could not be written; the reply was withheld:\n%s", folder,
                      traceback.format_exc())
            return Message(Error(R.ERR_INTERNAL, refusals.FAILED), reply_to=msg)
    return reply


def _plain(v: Any) -> Any:
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    if isinstance(v, bytes):
        return {"bytes": len(v)}
    return v
