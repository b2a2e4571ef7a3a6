"""``fedsyn audit`` of the masked releases (issue 73): the share a site adds, and the sum of a round.

A node at ``min-honest-nodes`` = t > 1 answers a release the server only needs summed (the profile,
a count or scaled vote, the marginals) in a masked round (``fedsyn_client.secagg_node``): it adds
Skellam(mu / t), a 1/t share of the noise variance the sum needs, and masks the result. The audit
plays the server and unmasks the round for real, so it measures both promises the site's
statement makes, on the node's real ClientApp (its five steps, its policy, ledger and view):

- ``share``: t - 1 peers that collude with the server (the audit plays them: they add no noise, mask
  zeros and reveal all they hold), so the unmasked sum is the site's values plus its own share. It
  must meet the statement's ``epsilon_alone``, what the site promises against a server that holds
  every other site;
- ``sum`` (``--sum``: a round of t sites simulated from this node, each its own state and keys, the
  audited one on D or D', the others on one fixed file): the unmasked sum carries t shares,
  Skellam(mu), and must meet the release's ``epsilon``, the promise under the site's trust.

The keys are fresh ones in the audit's scratch folder for the node and its peers (the operator's
identity key and peer list are not opened: the audit measures the mechanism at the node's t, not
whom it trusts). A count release is judged under its own claim, Skellam noise on integers
(``common.auditing.skellam_claim_epsilon``, ``shape_check``); a scaled one's (the similarity
scores) sum is divided by the scale, its noise at that scale all but Gaussian, and its noise-off
values carry the records' random rounding, whose spread the sensitivity check allows for.
"""

from __future__ import annotations

import json
import math
import secrets
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from common import records as R
from common.dp import MARGINALS, PROFILE
from common.histograms import masked_units
from common.secagg import masks, ring
from common.secagg.protocol import (
    Participant,
    Terms,
    advert_from_dict,
    advert_to_dict,
    b64,
    noise_share,
    revealed_from_dict,
    revealed_to_dict,
    route,
    unb64,
    unmask,
)

SHARE, SUM = "share", "sum"
ROUNDING_SDS = 4.0  # the noise-off distance a scaled release may exceed its norm by: 4 sd of the roundings


class MaskedRoundFailed(RuntimeError):
    """A masked round the audit plays could not finish (the audit reports it as the release's failure)."""


class Kind(Protocol):
    """What this module reads of ``privacy_audit.Kind`` (a release the audit runs, frozen)."""

    @property
    def phase(self) -> str:
        """The release's phase: profile, vote or marginals."""

    @property
    def label(self) -> str:
        """How the audit names it (``vote:knn-vote/share``)."""

    @property
    def conf(self) -> dict[str, Any]:
        """Its request's config."""

    @property
    def candidates(self) -> tuple[tuple[str, str], ...] | None:
        """A vote's candidates: (text, code)."""

    @property
    def masked(self) -> str:
        """``share`` or ``sum``."""


class AuditNode(Protocol):
    """What this module needs of ``privacy_audit.AuditNode``: the node's real ClientApp, asked."""

    node_config: dict[str, Any]
    scratch: Path
    token: str
    sent: int
    base: Path

    def state_for(self, data: Path) -> Path:
        """The state folder of the node on ``data``."""

    def ask(self, kind: Any, data: Path, noise: bool, key: str, *, node_id: int = 1, state: Path | None = None,
            config: dict[str, Any] | None = None, records: dict[str, Any] | None = None,
            node: dict[str, Any] | None = None) -> Any:
        """One request to the ClientApp as ``node_id``; its reply."""


def histogram_of(kind: Kind) -> str:
    """The histogram a kind's masked round releases (what ``secagg_node.serve`` is given)."""
    return {PROFILE: "code-counts", MARGINALS: MARGINALS}.get(kind.phase) or str(kind.conf["histogram"])


def masked_kinds(kinds: list[Any], honest: int, sums: bool) -> list[Any]:
    """For a node at ``min-honest-nodes`` = ``honest``: the masked rounds the audit runs, each kind
    that may be masked as a ``share`` and (``sums``) a ``sum``, labelled ``KIND/share``, ``KIND/sum``."""
    from dataclasses import replace

    from fedsyn_client.secagg_node import can_mask

    if honest <= 1:
        return []
    out = []
    for k in kinds:
        if can_mask(histogram_of(k)):
            out += [replace(k, label=f"{k.label}/{m}", masked=m) for m in ((SHARE, SUM) if sums else (SHARE,))]
    return out


def site_keys(folder: Path, n: int) -> list[tuple[Path, str]]:
    """``n`` SuperNode-style key pairs for the audit's sites (made once in ``folder``): (private key
    file, public OpenSSH line)."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    out = []
    for i in range(n):
        path = folder / f"site{i + 1}.pem"
        if not path.exists():
            path.write_bytes(ec.generate_private_key(ec.SECP384R1()).private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
        out.append((path, masks.public_key_text(masks.load_signing_key(path.read_bytes()).public_key())))
    return out


class _Real:
    """A site of the round that is the node's real ClientApp (the audited one, or a simulated peer)."""

    def __init__(self, node: AuditNode, kind: Kind, data: Path, noise: bool, key: str, session: str, site: int,
                 state: Path, keys: list[tuple[Path, str]]) -> None:
        self.node, self.kind, self.data, self.noise, self.key, self.session = node, kind, data, noise, key, session
        self.site, self.state = site, state
        peers = state / "peers.txt"
        state.mkdir(parents=True, exist_ok=True)
        peers.write_text("".join(f"{pub}\n" for i, (_, pub) in enumerate(keys) if i + 1 != site))
        self.config = {"identity-key": str(keys[site - 1][0]), "peer-keys": str(peers)}
        self.statement: dict[str, Any] = {}

    def step(self, step: str, payload: dict[str, Any]) -> dict[str, Any]:
        from flwr.app import ConfigRecord

        reply = self.node.ask(self.kind, self.data, self.noise, self.key, node_id=self.site, state=self.state,
                              config={R.SECAGG_STEP: step, R.SECAGG_SESSION: self.session},
                              records={R.SECAGG: ConfigRecord({"payload": json.dumps(payload)})}, node=self.config)
        if R.RELEASE in reply.content.config_records:
            self.statement = dict(reply.content.config_records[R.RELEASE])
        return dict(json.loads(str(reply.content.config_records[R.SECAGG]["payload"])))


class _Colluder:
    """A peer the server controls: it follows the protocol's form (so the site counts it) but adds
    no noise, masks zeros and reveals every share it holds."""

    def __init__(self, site: int, honest: int, key: Path, context: bytes) -> None:
        self.site = site
        # its vector's length is set at the mask step, from the site's vector (the server sees it then)
        self.p = Participant(site, Terms(context, 0), honest, 0.0, masks.load_signing_key(key.read_bytes()))

    def step(self, step: str, payload: dict[str, Any]) -> dict[str, Any]:
        p = self.p
        if step == R.ADVERTISE:
            return {"advert": advert_to_dict(p.advertise(int(payload["sites"])))}
        if step == R.SHARE:
            sealed, commit = p.share([advert_from_dict(d) for d in payload["adverts"]], int(payload["bits"]))
            return {"sealed": {str(k): b64(v) for k, v in sealed.items()}, "commitment": b64(commit)}
        if step == R.MASK:
            bundles = {int(k): unb64(v) for k, v in payload["bundles"].items()}
            return {"masked": b64(np.asarray(p.mask(bundles, np.zeros(p.terms.length, dtype=np.int64)),
                                             dtype="<u8").tobytes())}
        if step == R.CONFIRM:
            return {"signature": b64(p.confirm([int(s) for s in payload["survivors"]]))}
        return revealed_to_dict(p.reveal({int(k): unb64(v) for k, v in payload["signatures"].items()}))


def masked_release(node: AuditNode, kind: Kind, data: Path, noise: bool = True) -> tuple[np.ndarray, dict[str, Any]]:
    """One masked round of ``kind`` with the audited site on ``data``, played and unmasked by the
    audit: (the unmasked sum, divided by the scale; the statement ``audit_kind`` judges it by: the
    share's or the sum's epsilon, its delta, sensitivity, noise sd and Skellam mu)."""
    honest = int(node.node_config.get("min-honest-nodes", 1))
    keys = site_keys(node.scratch / "keys", honest)
    node.sent += 1
    key, session = f"audit-{node.token}-{node.sent}", secrets.token_hex(16)
    audited = _Real(node, kind, data, noise, key, session, 1, node.state_for(data), keys)
    real: list[_Real] = [audited]
    if kind.masked == SUM:  # the others: this node's copies, each its own view and state, on one fixed file
        real += [_Real(node, kind, node.base, noise, key, session, n, node.scratch / "peers" / f"site{n}", keys)
                 for n in range(2, honest + 1)]
    name = histogram_of(kind)
    length = len(kind.candidates) if kind.candidates is not None else 0  # a vote's (only a vote is scaled)
    scale, unit = masked_units(name, kind.conf, length)
    try:
        replies = {s.site: s.step(R.ADVERTISE, {"sites": honest}) for s in real}
        context = unb64(replies[1]["context"])
        sites: dict[int, Any] = {s.site: s for s in real}
        for n in range(len(real) + 1, honest + 1):
            sites[n] = _Colluder(n, honest, keys[n - 1][0], context)
            replies[n] = sites[n].step(R.ADVERTISE, {"sites": honest})
        adverts = {n: advert_from_dict(r["advert"]) for n, r in replies.items()}
        bits = ring.bits_for(honest, unit * int(node.node_config["max-records"]),
                             max(noise_share(adverts, n) for n in adverts))
        listed = [advert_to_dict(a) for a in adverts.values()]
        shared = {n: s.step(R.SHARE, {"adverts": listed, "bits": bits}) for n, s in sorted(sites.items())}
        commitments = {n: unb64(r["commitment"]) for n, r in shared.items()}
        inbox = route({n: {int(k): unb64(v) for k, v in r["sealed"].items()} for n, r in shared.items()})
        masked: dict[int, np.ndarray] = {}
        for n, s in sorted(sites.items(), key=lambda item: isinstance(item[1], _Colluder)):  # real sites first
            if isinstance(s, _Colluder):
                s.p.terms = Terms(context, len(masked[1]), bits)
            reply = s.step(R.MASK, {"bundles": {str(k): b64(v) for k, v in inbox.get(n, {}).items()}})
            masked[n] = np.frombuffer(unb64(reply["masked"]), dtype="<u8").astype(np.uint64)
        survivors = sorted(masked)
        signatures = {n: s.step(R.CONFIRM, {"survivors": survivors})["signature"] for n, s in sorted(sites.items())}
        revealed = {n: revealed_from_dict(s.step(R.REVEAL, {"signatures": signatures}))
                    for n, s in sorted(sites.items())}
        total = unmask(Terms(context, len(masked[1]), bits), adverts, commitments, masked, revealed)
    except (KeyError, TypeError, ValueError) as err:  # a refusal of the node's is its reply's error (AuditError)
        raise MaskedRoundFailed(f"{kind.label} on {data.name}: the masked round failed "
                                f"({type(err).__name__}: {err})") from None
    return total.astype(np.float64) / scale, _judged(kind, audited.statement, adverts, [s.site for s in real],
                                                     int(node.node_config["max-records"]), len(total))


def _judged(kind: Kind, st: dict[str, Any], adverts: dict[int, Any], real: list[int], bound: int,
            length: int) -> dict[str, Any]:
    """The statement a masked round's unmasked sum is audited against: the share alone's promise
    (``epsilon_alone``) or the sum's (``epsilon``), at the delta each is read at, with the noise
    the real sites state they add (Skellam mu summed: its standard deviation sqrt(2 mu))."""
    mu = sum(noise_share(adverts, n) for n in real)
    scale = float(st.get("scale", 1.0))
    delta = float(st["rdp_delta"]) if "rdp_delta" in st else float(st.get("composed_delta", st["delta"]))
    out: dict[str, Any] = {"epsilon": float(st["epsilon_alone"] if kind.masked == SHARE else st["epsilon"]),
                           "delta": delta, "sigma": math.sqrt(2 * mu) / scale, "skellam_mu": mu}
    if "norm" in st:  # scaled: what one record moves (its rounded norm), and the spread of the others' roundings
        out["sensitivity"] = float(st["norm"]) / scale
        out["tolerance"] = ROUNDING_SDS * math.sqrt(length * (bound + 1) * len(real) / 2) / scale
        out["skellam_mu"] = None  # its noise on the scale's grid is all but Gaussian: judged as one
    else:
        out["sensitivity"] = float(st["sensitivity"])
    return out

