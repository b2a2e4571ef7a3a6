"""The server's side of every request: send, match replies to requests, book what came back.

``Courier`` sends one content to some nodes over the Grid and sorts the replies into good ones
and failures. It books into the run's ``FedSynResult`` what a curious reader of the report must
see: every release a node stated, every failure (with the epsilon a lost reply may still have
spent), and every *degradation* (a phase that ran on fewer nodes than it asked). The phase
logic is the orchestrations' (``strategies.text_stages``, ``strategies.marginals``); this module
holds none.

``SubGrid`` is a view of the Grid that shows only some nodes, so that a plug-in Flower strategy
samples phase-1 nodes among the strong ones.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
from flwr.app import Message, RecordDict
from flwr.serverapp import Grid

from common import records as R
from common.config import RunConfig
from common.logs import get_logger
from common.phases import is_phase, phase as phase_named
from strategies.result import FedSynResult

log = get_logger("fedsyn")


class SubGrid(Grid):
    """A view of the Grid that shows only some nodes, so a Flower strategy's sampling
    in ``configure_train`` picks strong nodes only."""

    def __init__(self, grid: Grid, node_ids: Iterable[int]) -> None:
        self._grid, self._ids = grid, list(node_ids)

    def get_node_ids(self) -> Iterable[int]:  # noqa: D102 - documented on Flower's Grid; here only this view's nodes
        return list(self._ids)

    def set_run(self, run):  # noqa: D102 - documented on Flower's Grid, forwarded to it
        return self._grid.set_run(run)

    @property
    def run(self):  # noqa: D102 - documented on Flower's Grid, forwarded to it
        return self._grid.run

    def create_message(self, *args, **kwargs):  # noqa: D102 - documented on Flower's Grid, forwarded to it
        return self._grid.create_message(*args, **kwargs)

    def push_messages(self, messages):  # noqa: D102 - documented on Flower's Grid, forwarded to it
        return self._grid.push_messages(messages)

    def pull_messages(self, message_ids):  # noqa: D102 - documented on Flower's Grid, forwarded to it
        return self._grid.pull_messages(message_ids)

    def send_and_receive(self, messages, *, timeout=None):  # noqa: D102 - documented on Flower's Grid, forwarded to it
        return self._grid.send_and_receive(messages, timeout=timeout)


def _finite_arrays(msg: Message) -> bool:
    return all(np.isfinite(a).all() for rec in msg.content.array_records.values() for a in rec.to_numpy_ndarrays())


class Courier:
    """Requests to nodes for one run; replies, failures and degradations go into ``result``."""

    def __init__(self, cfg: RunConfig, delta: float, result: FedSynResult) -> None:
        self.cfg, self.delta, self.result = cfg, delta, result

    def ask(self, grid: Grid, node_ids: list[int], message_type: str, phase: str,
            content: RecordDict) -> dict[int, Message]:
        """Send the same content to ``node_ids``; return the good replies by node id."""
        if not node_ids:
            return {}
        messages = [Message(content=content, message_type=message_type, dst_node_id=n) for n in node_ids]
        replies = list(grid.send_and_receive(messages, timeout=self.cfg.node_timeout))
        conf: Mapping[str, Any] = content.config_records.get(R.CONFIG, {})
        return self.collect(replies, messages, phase, int(conf.get("server-round", 0)),
                             float(conf.get("epsilon-share", 1.0)))

    def collect(self, replies: list[Message], sent: list[Message], phase: str, rnd: int = 0,
                 share: float = 1.0) -> dict[int, Message]:
        """Split replies to ``sent`` into good ones (returned, by node) and failures (logged and
        recorded under the node each message went to).

        A reply is matched to its request by ``reply_to_message_id``: Flower's own error
        replies (e.g. "node unavailable") come from the SuperLink, not from the node.
        """
        to_node = {m.metadata.message_id: m.metadata.dst_node_id for m in sent}
        good: dict[int, Message] = {}
        answered: set[int] = set()
        for msg in replies:
            nid = to_node.get(msg.metadata.reply_to_message_id, msg.metadata.src_node_id)
            answered.add(nid)
            if msg.has_error():
                self.fail(nid, phase, f"error {msg.error.code}: {msg.error.reason}", rnd, share, msg.error.code)
                continue
            statement = dict(msg.content.config_records.get(R.RELEASE, {}))
            if statement and statement not in self.result.releases.setdefault(nid, []):  # a replay is not a new release
                self.result.releases[nid].append(statement)
            if not _finite_arrays(msg):  # NaN weights would poison the global model: finite in, finite out
                self.fail(nid, phase, "malformed reply: non-finite weights", rnd, share, stated=bool(statement))
                continue
            good[nid] = msg
        for nid in sorted(set(to_node.values()) - answered):
            self.fail(nid, phase, "no reply before node-timeout", rnd, share)
        return good

    def coverage(self, what: str, good: dict[int, Any], asked: Iterable[int]) -> None:
        """Name a degradation when ``what`` ran on fewer nodes than it asked."""
        asked = set(asked)
        if len(good) < len(asked):
            missing = ", ".join(str(n) for n in sorted(asked - set(good)))
            self.degrade(f"{what}: {len(good)} of {len(asked)} nodes answered (missing: {missing})"
                          + ("; weights unchanged" if not good and what.startswith("phase 1") else ""))

    def vectors(self, replies: dict[int, Message], key: str, length: int, phase: str) -> dict[int, list[float]]:
        """The noisy vectors of good replies; a malformed one (wrong length, not finite,
        missing) is a node failure, not a crash of the run."""
        out: dict[int, list[float]] = {}
        for nid, msg in replies.items():
            stated = R.RELEASE in msg.content.config_records  # the release is on record already
            try:
                vec = R.read_vector(msg.content, key)
            except (KeyError, TypeError, ValueError) as err:
                self.fail(nid, phase, f"malformed reply ({type(err).__name__})", stated=stated)
                continue
            if vec.shape != (length,) or not np.isfinite(vec).all():
                self.fail(nid, phase, f"malformed reply: {vec.shape[0] if vec.ndim else 0} values, expected {length}",
                           stated=stated)
                continue
            out[nid] = vec.tolist()
        return out

    def fail(self, node_id: int, phase: str, reason: str, rnd: int = 0, share: float = 1.0,
              code: int | None = None, stated: bool = False) -> None:
        """Record a failure of ``node_id``. For a release request the node may still have spent
        (it released, then the reply was lost): unless the error says nothing was spent, the
        request's epsilon and delta are recorded, and the report counts them as spent until
        the node's own ledger says otherwise."""
        log.warning("node %d failed in %s: %s", node_id, phase, reason)
        entry: dict[str, Any] = {"node_id": node_id, "phase": phase, "round": rnd, "reason": reason, "code": code}
        if is_phase(phase) and code not in R.ERR_NOTHING_SPENT and not stated:
            tier = self.result.tiers.get(node_id, phase_named(phase).usual_tier)
            entry.update(spent="unknown", epsilon_requested=share * self.cfg.phase_epsilon(tier, phase),
                         delta_requested=share * self.delta)
        self.result.failures.append(entry)

    def degrade(self, what: str, skipped: bool = False) -> None:
        """Name what the run does with less than it asked for; ``skipped``: a planned phase got
        no node at all, and the run will end failed (after writing its outputs)."""
        log.warning("DEGRADED: %s", what)
        self.result.degradations.append(what)
        if skipped:
            self.result.skipped.append(what)
