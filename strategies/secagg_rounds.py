"""The server's side of secure aggregation (issue 73): one masked release as five Flower rounds.

Where a site of the run counts on others (its ``min-honest-nodes`` above 1, stated in its tier
reply), the server needs each phase's vectors only summed, so it asks them masked
(``common.secagg.protocol``): every site's reply is uniform on its own and only the sum of the
sites that sent one is ever unmasked. The five requests carry the phase's own request (the same
content every step, so each site authorises it against its policy each time) plus the step:

1. ``advertise`` to the sites asked; 2. ``share`` (the adverts, the ring's b sized for the sum of
all of them at their public bound and their largest noise share) to those that advertised;
3. ``mask`` (the bundles addressed to each) to those that shared: the release, booked like any;
4. ``confirm`` (the survivors: those whose masked vector arrived) and 5. ``reveal`` (the
survivors' signatures) to the survivors. The sum follows from the masked vectors and the revealed
shares (``protocol.unmask``); its noise is the survivors' stated shares summed.

A site that fails a step is a failure of that site, as for any request; the sum is of the
survivors. A round whose sum cannot be unmasked (too few reveals, a site's refusal to unmask with
too few sites it trusts) releases nothing: ``None``, and the phase's logic decides.
"""

from __future__ import annotations

import json
import math
import secrets
from dataclasses import dataclass
from typing import Any

import numpy as np
from flwr.app import ConfigRecord, Message, RecordDict
from flwr.serverapp import Grid

from common import records as R
from common.logs import get_logger
from common.secagg import ring
from common.secagg.protocol import (
    Advert,
    Revealed,
    Terms,
    advert_from_dict,
    advert_to_dict,
    b64,
    noise_share,
    revealed_from_dict,
    route,
    unb64,
    unmask,
)
from strategies.messaging import Courier

log = get_logger("fedsyn")
# the value bound a site that states none (a simulated one) is sized for: more records than any partition
UNSTATED_BOUND = 2 ** 31


@dataclass(frozen=True)
class MaskedSum:
    """A masked round's outcome: the survivors' summed vector, the standard deviation of the
    noise in it (their shares: Skellam(mu) has variance 2 mu) and the survivors."""

    total: np.ndarray
    stddev: float
    survivors: tuple[int, ...]


def secure(trust: dict[int, int], node_ids: list[int]) -> bool:
    """Whether a round of ``node_ids`` must be masked: some site among them counts on others."""
    return any(trust.get(n, 1) > 1 for n in node_ids)


class SecureSum:
    """One masked release over ``courier``'s Grid: ``run`` asks the five steps and unmasks."""

    def __init__(self, courier: Courier, bounds: dict[int, int]) -> None:
        self.courier, self.bounds = courier, bounds

    def run(self, grid: Grid, node_ids: list[int], message_type: str, phase: str, content: RecordDict,
            length: int, units: tuple[float, int] = (1.0, 1)) -> MaskedSum | None:
        """The sum of the vectors of ``length`` that ``node_ids`` release for ``content`` (the
        phase's request), masked; None when the round could not be unmasked. ``units``: (what the
        sum is divided by, the most one record adds to a value), ``common.histograms.masked_units``:
        a scaled histogram's integers are its real values times the scale."""
        conf: dict[str, Any] = dict(content.config_records.get(R.CONFIG, {}))
        rnd, share = int(conf.get("server-round", 0)), float(conf.get("epsilon-share", 1.0))
        session = secrets.token_hex(16)

        def ask(nodes: list[int], step: str, payload: dict[int, dict[str, Any]] | dict[str, Any]) -> dict[int, Any]:
            per_node = all(isinstance(k, int) for k in payload) and bool(payload)
            messages = []
            for n in nodes:
                body = payload[n] if per_node else payload  # type: ignore[index]  # per node: keyed by node id
                records = RecordDict()
                for name, rec in content.config_records.items():
                    records[name] = rec
                for name, arrays in content.array_records.items():
                    records[name] = arrays
                records[R.CONFIG] = ConfigRecord(conf | {R.SECAGG_STEP: step, R.SECAGG_SESSION: session})
                records[R.SECAGG] = ConfigRecord({"payload": json.dumps(body)})
                messages.append(Message(content=records, message_type=message_type, dst_node_id=n))
            replies = list(grid.send_and_receive(messages, timeout=self.courier.cfg.node_timeout))
            good = self.courier.collect(replies, messages, phase, rnd, share)
            out = {}
            for n, msg in good.items():
                try:
                    out[n] = json.loads(str(msg.content.config_records[R.SECAGG]["payload"]))
                except (KeyError, TypeError, ValueError) as err:
                    self.courier.fail(n, phase, f"malformed secure-aggregation reply ({type(err).__name__})", rnd,
                                      share, stated=R.RELEASE in msg.content.config_records)
            return out

        adverts, context = self._adverts(ask(sorted(node_ids), R.ADVERTISE, {"sites": len(node_ids)}), phase)
        if not adverts:
            return None
        scale, unit = units
        try:
            bits = ring.bits_for(len(adverts), unit * max((self.bounds.get(n, 0) or UNSTATED_BOUND) for n in adverts),
                                 max(noise_share(adverts, n) for n in adverts))
        except ValueError as err:  # the sites' bounds and noise do not fit the ring: nothing is asked of them
            self.courier.degrade(f"{phase} round {rnd}: {err}; the round is not masked and nothing of it is used")
            return None
        shared = ask(sorted(adverts), R.SHARE, {"adverts": [advert_to_dict(a) for a in adverts.values()], "bits": bits})
        sealed, commitments = {}, {}
        for n, reply in shared.items():
            try:
                sealed[n] = {int(k): unb64(v) for k, v in reply["sealed"].items()}
                commitments[n] = unb64(reply["commitment"])
            except (KeyError, TypeError, ValueError, AttributeError):
                self.courier.fail(n, phase, "malformed secure-aggregation reply (share)", rnd, share)
        inbox = route(sealed)
        masked_replies = ask(sorted(sealed), R.MASK, {n: {"bundles": {str(k): b64(v) for k, v in
                                                              inbox.get(n, {}).items() if k in sealed}}
                                                       for n in sealed})
        masked = {}
        for n, reply in masked_replies.items():
            try:
                vec = np.frombuffer(unb64(reply["masked"]), dtype="<u8").astype(np.uint64)
            except (KeyError, TypeError, ValueError):
                vec = np.zeros(0, dtype=np.uint64)
            if vec.shape != (length,):
                self.courier.fail(n, phase, f"malformed masked vector: {vec.shape[0]} values, expected {length}",
                                  rnd, share, stated=True)
                continue
            masked[n] = vec
        if not masked:
            return None
        survivors = sorted(masked)
        confirmed = ask(survivors, R.CONFIRM, {"survivors": survivors})
        signatures = {}
        for n, reply in confirmed.items():
            try:
                signatures[n] = unb64(reply["signature"])
            except (KeyError, TypeError, ValueError):
                continue
        revealed: dict[int, Revealed] = {}
        for n, reply in ask(sorted(signatures), R.REVEAL, {"signatures": {str(k): b64(v) for k, v in
                                                                         signatures.items()}}).items():
            try:
                revealed[n] = revealed_from_dict(reply)
            except ValueError:
                self.courier.fail(n, phase, "malformed secure-aggregation reply (reveal)", rnd, share)
        terms = Terms(context, length, bits)
        try:
            total = unmask(terms, adverts, commitments, masked, revealed)
        except ValueError as err:
            self.courier.degrade(f"{phase} round {rnd}: the masked sum of {len(masked)} sites could not be unmasked "
                                 f"({err}); nothing of it is used")
            return None
        stddev = math.sqrt(sum(2 * noise_share(adverts, n) for n in survivors))
        log.info("%s round %d: the masked sum of %d sites unmasked (noise stddev %.3g)", phase, rnd, len(survivors),
                 stddev / scale)
        return MaskedSum(total.astype(np.float64) / scale, stddev / scale, tuple(survivors))

    def _adverts(self, replies: dict[int, Any], phase: str) -> tuple[dict[int, Advert], bytes]:
        """The well-formed adverts, and the round's context they agree on (the most common one:
        a site whose context differs is a failure of that site)."""
        adverts, contexts = {}, {}
        for n, reply in replies.items():
            try:
                advert, context = advert_from_dict(reply["advert"]), unb64(reply["context"])
            except (KeyError, TypeError, ValueError):
                self.courier.fail(n, phase, "malformed secure-aggregation reply (advert)")
                continue
            if advert.site != n:
                self.courier.fail(n, phase, "an advert for another site")
                continue
            adverts[n], contexts[n] = advert, context
        if not contexts:
            return {}, b""
        values = list(contexts.values())
        context = max(set(values), key=values.count)
        for n in [n for n, c in contexts.items() if c != context]:
            self.courier.fail(n, phase, "an advert for another request")
            del adverts[n]
        return adverts, context


