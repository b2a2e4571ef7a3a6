"""The curious or lying server against real ClientApp sites in a masked round (issue 73).

Three deployment-style sites that each trust all three. The server drives the five steps by hand
and cheats: it swaps a site's key, drops a site that sent its masked vector, replays a step or a
round under a new session, sends a malformed payload. Each gets a fixed refusal and nothing of a
site's own vector; a refusal before the mask step spends nothing.
"""

from __future__ import annotations

import json
import secrets
from pathlib import Path

import numpy as np
import pytest
from flwr.app import ConfigRecord, Message, RecordDict

from common import records as R
from common.config import RunConfig
from common.secagg import ring
from common.secagg.protocol import advert_from_dict, advert_to_dict, b64, noise_share, route, unb64
from fedsyn_client.client_app import app
from tests.fakes import client_node, set_task_identity, write_topic_csv
from tests.test_secagg_run import TOPICS, VOCAB, _keys

IDS = (11, 12, 13)


class Server:
    """Drives one masked profile round over three real sites, one step at a time."""

    def __init__(self, tmp_path: Path, honest: int = 3, extra: str = "", epsilon: float = 8.0,
                 states: Path | None = None, run_id: int = 41, node_config: dict | None = None) -> None:
        tmp_path.mkdir(parents=True, exist_ok=True)
        data = write_topic_csv(tmp_path / "data.csv", TOPICS, per_topic=10)
        if extra:  # one more record at the top of the file: the neighbouring dataset
            path = Path(data)
            head, *rows = path.read_text().splitlines(keepends=True)
            path.write_text(head + extra + "".join(rows))
        keys = _keys(tmp_path / "keys", 3)
        rc = RunConfig(model="tiny-gpt2", dataset=data, test_fraction=0.0, epsilon=epsilon, num_server_rounds=0,
                       voters="weak").to_flower()
        self.states = {nid: (states or tmp_path) / f"state{nid}" for nid in IDS}
        self.nodes = {}
        for i, nid in enumerate(IDS):
            peers = tmp_path / f"peers{nid}.txt"
            peers.write_text("\n".join(pub for j, (_, pub) in enumerate(keys) if j != i) + "\n")
            self.nodes[nid] = client_node(app, nid, {
                "tier": "weak", "data-path": data, "max-records": 50, "state-dir": str(self.states[nid]),
                "epsilon": epsilon, "min-honest-nodes": honest, "identity-key": str(keys[i][0]),
                "peer-keys": str(peers), "control-codes": ",".join(VOCAB), **(node_config or {})}, rc, run_id=run_id)
        set_task_identity()
        self.session = secrets.token_hex(16)

    def ask(self, nid: int, step: str, payload: dict, session: str | None = None, **extra: int) -> Message:
        conf = {"codes": VOCAB, "delta": 1e-5, R.SECAGG_STEP: step, R.SECAGG_SESSION: session or self.session,
                **extra}
        msg = Message(content=RecordDict({R.CONFIG: ConfigRecord(conf),
                                          R.SECAGG: ConfigRecord({"payload": json.dumps(payload)})}),
                      message_type=R.MSG_PROFILE, dst_node_id=nid)
        return self.nodes[nid](msg)

    @staticmethod
    def payload(reply: Message) -> dict:
        assert not reply.has_error(), reply.error.reason
        return json.loads(str(reply.content.config_records[R.SECAGG]["payload"]))

    def advertise(self) -> dict[int, dict]:
        return {n: self.payload(self.ask(n, R.ADVERTISE, {"sites": 3}))["advert"] for n in IDS}

    def share(self, adverts: dict[int, dict], bits: int = 40) -> tuple[dict, dict]:
        replies = {n: self.payload(self.ask(n, R.SHARE, {"adverts": list(adverts.values()), "bits": bits}))
                   for n in IDS}
        sealed = {n: {int(k): unb64(v) for k, v in r["sealed"].items()} for n, r in replies.items()}
        return route(sealed), {n: unb64(r["commitment"]) for n, r in replies.items()}

    def mask(self, inbox: dict) -> dict[int, np.ndarray]:
        out = {}
        for n in IDS:
            reply = self.payload(self.ask(n, R.MASK, {"bundles": {str(k): b64(v) for k, v in inbox[n].items()}}))
            out[n] = np.frombuffer(unb64(reply["masked"]), dtype="<u8")
        return out

    def spent(self, nid: int) -> float:
        path = self.states[nid] / "ledger.json"
        if not path.exists():
            return 0.0
        return sum(float(e["epsilon"]) for e in json.loads(path.read_text()).get("releases", []))


def _refusal(reply: Message) -> str:
    assert reply.has_error()
    return reply.error.reason


def test_each_masked_vector_is_uniform_and_only_the_sum_is_small(tmp_path: Path) -> None:
    server = Server(tmp_path)
    adverts = server.advertise()
    inbox, _ = server.share(adverts)
    masked = server.mask(inbox)
    for vec in masked.values():  # the profile is two counts of at most 50 plus noise; masked, anywhere in 2^40
        assert np.abs(ring.decode(vec, 40)).min() > 2 ** 20
    total = ring.decode(ring.add(ring.add(masked[11], masked[12], 40), masked[13], 40), 40)
    assert np.abs(total).max() > 2 ** 20  # the self masks still hide even the sum until the shares are revealed


def test_a_swapped_key_is_refused_before_anything_is_spent(tmp_path: Path) -> None:
    from common.secagg.masks import KeyPair

    server = Server(tmp_path)
    adverts = server.advertise()
    forged = dict(adverts)
    a = advert_from_dict(adverts[12])
    forged[12] = advert_to_dict(type(a)(a.site, a.seal_public, KeyPair.generate().public, a.needed, a.honest,
                                        a.identity, a.signature))  # the server's own mask key for 12
    for n in (11, 13):
        reason = _refusal(server.ask(n, R.SHARE, {"adverts": list(forged.values()), "bits": 40}))
        assert reason == "refused: secure aggregation: a signature does not verify"
        assert server.spent(n) == 0.0


def test_a_site_the_operator_did_not_list_is_not_counted(tmp_path: Path) -> None:
    """The server replaces site 13 by one of its own (its own key, validly signed): sites 11 and
    12, which trust three of their listed sites, count two and refuse."""
    server = Server(tmp_path)
    adverts = server.advertise()
    impostor = Server(tmp_path / "other")  # a site whose key nobody listed, in the same round
    impostor.session = server.session
    fake = impostor.advertise()[13]
    mixed = {11: adverts[11], 12: adverts[12], 13: fake}
    for n in (11, 12):
        reason = _refusal(server.ask(n, R.SHARE, {"adverts": list(mixed.values()), "bits": 40}))
        assert reason == "refused: secure aggregation: fewer trusted sites than this site requires"
        assert server.spent(n) == 0.0


def test_a_server_that_drops_a_site_that_sent_gets_nothing_of_it(tmp_path: Path) -> None:
    """Three sites that each count on two: one of them may collude with the server, so every secret
    needs all three shares (``shares.threshold``: above (3 + 1) / 2). The server says 13 dropped
    though its masked vector arrived: 13 refuses the list, and 11 and 12 refuse a list of two
    (below their threshold), so nobody signs, nothing is revealed and 13's vector stays masked."""
    server = Server(tmp_path, honest=2)
    adverts = server.advertise()
    inbox, _ = server.share(adverts)
    masked = server.mask(inbox)
    survivors = [11, 12]  # "13 dropped", though its masked vector arrived
    assert _refusal(server.ask(13, R.CONFIRM, {"survivors": survivors})) == \
        "refused: secure aggregation: the survivors are not those this site saw or signed"
    for n in survivors:
        assert _refusal(server.ask(n, R.CONFIRM, {"survivors": survivors})) == \
            "refused: secure aggregation: fewer trusted sites than this site requires"
        assert _refusal(server.ask(n, R.REVEAL, {"signatures": {}})).startswith("refused: secure aggregation")
    assert masked[13].shape == (2,)


def test_a_step_replayed_or_a_round_under_a_new_session_gets_nothing(tmp_path: Path) -> None:
    server = Server(tmp_path)
    adverts = server.advertise()
    assert _refusal(server.ask(11, R.ADVERTISE, {"sites": 3})) == \
        "refused: secure aggregation: a step asked twice or out of order"
    inbox, _ = server.share(adverts)
    server.mask(inbox)
    spent = server.spent(11)
    assert spent > 0
    # the same round again under another session: new keys, but the round was released
    again = Server.__new__(Server)
    again.__dict__.update(server.__dict__, session=secrets.token_hex(16))
    adverts2 = again.advertise()
    assert all(adverts2[n]["mask"] != adverts[n]["mask"] and adverts2[n]["seal"] != adverts[n]["seal"]
               for n in IDS)  # a new session never reuses a round's keys
    inbox2, _ = again.share(adverts2)
    reply = again.ask(11, R.MASK, {"bundles": {str(k): b64(v) for k, v in inbox2[11].items()}})
    assert _refusal(reply) == "refused: budget: released before for another request"
    assert server.spent(11) == pytest.approx(spent)


def test_the_server_cannot_make_a_node_keep_more_open_rounds_than_its_cap(tmp_path: Path) -> None:
    """Issue 75: each advertised round is a file of keys the node keeps until the round's last step (or
    a day). A new session of a round supersedes the old one's keys; past node-config max-open-rounds a
    round is refused before it is opened, with a fixed text, nothing spent (failed before: every
    session of every round was kept)."""
    server = Server(tmp_path, node_config={"max-open-rounds": 2})
    folder = server.states[11] / "secagg"

    def advertise(rnd: int, session: str) -> Message:
        return server.ask(11, R.ADVERTISE, {"sites": 3}, session=session, **{"server-round": rnd})

    first, second = secrets.token_hex(16), secrets.token_hex(16)
    assert not advertise(1, first).has_error()
    assert not advertise(1, second).has_error() and len(list(folder.glob("*.json"))) == 1
    # the superseded session's keys are gone: its next step gets nothing
    assert _refusal(server.ask(11, R.SHARE, {"adverts": [], "bits": 40}, session=first, **{"server-round": 1})) == \
        "refused: secure aggregation: a step asked twice or out of order"
    assert not advertise(2, first).has_error() and len(list(folder.glob("*.json"))) == 2
    assert _refusal(advertise(3, first)) == "refused: policy: open masked rounds above the node's cap"
    assert len(list(folder.glob("*.json"))) == 2 and server.spent(11) == 0.0


def test_a_malformed_payload_is_a_fixed_text_and_spends_nothing(tmp_path: Path) -> None:
    server = Server(tmp_path)
    server.advertise()
    for payload in ({"adverts": "x", "bits": 40}, {"adverts": [{"site": 1}], "bits": 40}, {"bits": "40"}):
        reason = _refusal(server.ask(11, R.SHARE, payload))
        assert reason in ("refused: secure aggregation: a malformed request", "request: invalid (see the node's log)")
    assert _refusal(server.ask(11, "peek", {})) == "request: invalid (see the node's log)"
    assert server.spent(11) == 0.0


def test_every_site_adds_its_share_of_the_largest_need(tmp_path: Path) -> None:
    server = Server(tmp_path)
    adverts = {n: advert_from_dict(a) for n, a in server.advertise().items()}
    shares = [noise_share(adverts, n) for n in IDS]
    assert shares == pytest.approx([max(a.needed for a in adverts.values()) / 3] * 3)


def test_neighbouring_sites_answer_every_step_alike(tmp_path: Path) -> None:
    """Two rounds whose sites differ in one record (added at the top of the file): every step's
    reply has the same fields and sizes, and the mask step's statement is the same, noise terms and
    all: only the masked bytes differ, and they are uniform either way."""
    shapes = []
    for name, extra in (("d", ""), ("d1", "a record of its own,x\n")):
        server = Server(tmp_path / name, extra=extra)
        adverts = server.advertise()
        inbox, _ = server.share(adverts)
        replies = {n: server.ask(n, R.MASK, {"bundles": {str(k): b64(v) for k, v in inbox[n].items()}})
                   for n in IDS}
        statements = [{k: v for k, v in dict(r.content.config_records[R.RELEASE]).items()} for r in replies.values()]
        sizes = [len(unb64(json.loads(str(r.content.config_records[R.SECAGG]["payload"]))["masked"]))
                 for r in replies.values()]
        shapes.append((sorted(adverts[11]), statements, sizes))
    assert shapes[0] == shapes[1]


def test_with_the_noise_off_the_unmasked_sum_moves_by_the_stated_sensitivity(tmp_path: Path) -> None:
    """The neighbouring-datasets check on the unmasked sum (issue 73), noise off (epsilon = inf): the
    three sites' data differ in one record between the two rounds (the same file, a record added at
    its top; the same state folders, so the same secret views), so each site's view gains or loses one
    record and its counts move by one, the stated sensitivity, and the sum by at most three."""
    from common.secagg.protocol import Terms, revealed_from_dict, unmask

    totals = []
    for run, (name, extra) in enumerate((("d", ""), ("d1", "a record of its own,x\n"))):
        server = Server(tmp_path / name, extra=extra, epsilon=float("inf"), states=tmp_path, run_id=51 + run)
        first = {n: server.payload(server.ask(n, R.ADVERTISE, {"sites": 3})) for n in IDS}
        adverts = {n: r["advert"] for n, r in first.items()}
        inbox, commitments = server.share(adverts)
        masked = server.mask(inbox)
        signatures = {n: server.payload(server.ask(n, R.CONFIRM, {"survivors": list(IDS)}))["signature"]
                      for n in IDS}
        revealed = {n: revealed_from_dict(server.payload(server.ask(n, R.REVEAL, {"signatures": signatures})))
                    for n in IDS}
        terms = Terms(unb64(first[11]["context"]), len(VOCAB), 40)
        totals.append(unmask(terms, {n: advert_from_dict(a) for n, a in adverts.items()}, commitments, masked,
                             revealed))
    moved = totals[1] - totals[0]
    # each site's view gains the record or loses the one that shared its slot (fedsyn_client.view.bounded):
    # one count by one per site, the stated sensitivity 1, so the sum by at most 3 in all
    assert np.abs(moved).sum() <= 3 and np.abs(moved).max() <= 3
    assert totals[0].sum() > 0
