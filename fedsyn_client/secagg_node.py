"""The node's side of secure aggregation (issue 73): one round's five steps on this node.

A release request (profile, vote, marginals) whose config names a ``secagg-step`` is one step of a
masked round (``common.secagg.protocol``); every step is authorised against the policy like any
request (``release.authorise``). Only the ``mask`` step releases: it goes through the one release
path (``release.release``: reserve, compute, noise, confirm), its mechanism ``SkellamShare`` adds
this site's share of the noise as Skellam noise and masks the noisy vector, so what leaves is
uniform mod 2^b on its own. A count histogram's values are integers already; a scaled one's
(``common.histograms``: the similarity scores) are each record's vector scaled and rounded within a
public norm (``common.skellam.round_rows``), accounted by the Skellam Renyi bound at the release's
part of the node's delta (``release_shift``). The site's noise is fixed at ``advertise`` from public
inputs only:

- mu, what the *sum* needs for the release's (epsilon, delta) on the node's ledger (its rule's
  ``skellam_mu``: composed with every earlier release under pld), stated in its advert;
- its own share, the most any site of the round needs over t, its ``min-honest-nodes``
  (``protocol.noise_share``); the ledger is charged for mu in the sum (its trust), and the statement
  says too what the share alone gives (``epsilon_alone``) if every other site colludes.

What the site must remember between steps (its round keys, the shares it holds) lives in its own
state folder, one private file per round, removed once it has revealed; a round's keys are made
fresh at ``advertise`` and bound to the round's context (run, phase, round, the server's session,
the request), so a resumed run never reuses one. Every refusal is a fixed text.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from flwr.app import ConfigRecord, Message, RecordDict

from common import records as R, skellam
from common.calibration import basic_delta, release_base
from common.config import ConfigError
from common.dp import SKELLAM
from common.histograms import maskable, rounded
from common.io import atomic_write_text
from common.logs import get_logger
from common.secagg import masks
from common.secagg.protocol import (
    MALFORMED,
    REPLAYED,
    Participant,
    SecAggRefused,
    Terms,
    advert_from_dict,
    advert_to_dict,
    b64,
    revealed_to_dict,
    unb64,
)
from fedsyn_client import refusals
from fedsyn_client.node import Node, state_folder
from fedsyn_client.policy import NodePolicy
from fedsyn_client.refusals import BudgetExceeded, NodeSetupError, SecAggRefusal
from fedsyn_client.release import Mechanism, Output, Request, release, under_policy
from fedsyn_client.replies import request_digest

log = get_logger(__name__)

# besides the vote histograms that declare themselves counts or scaled (common.histograms.maskable): the
# profile's and the marginals', one record moving each of sensitivity^2 coordinates by at most 1 (common.skellam)
COUNTS = ("code-counts", "marginals")


def can_mask(histogram: str) -> bool:
    """Whether a release of ``histogram`` may be a masked round: the profile's or the marginals'
    counts, or a vote histogram that declares itself counts or scaled (``common.histograms.maskable``)."""
    return histogram in COUNTS or maskable(histogram)
STALE_SECONDS = 86_400.0  # a round's state not finished within a day is removed (its keys with it)


def serve(msg: Message, node: Node, req: Request, histogram: str, compute: Callable[..., np.ndarray],
          sensitivity: float, length: int, prepare: Callable[[], object] | None = None) -> RecordDict:
    """One step of a masked round of ``histogram`` (``compute``: its un-noised values, of L2
    ``sensitivity`` and ``length`` values); returns the step's reply."""
    step, session = str(req.params.get(R.SECAGG_STEP, "")), str(req.params.get(R.SECAGG_SESSION, ""))
    if step not in R.SECAGG_STEPS or not re.fullmatch(r"[0-9a-f]{32}", session):
        raise ConfigError(f"a secure-aggregation step {step!r} of session {session!r}: one of {R.SECAGG_STEPS}, "
                          "a session of 32 hex digits")
    if not can_mask(histogram):
        raise ConfigError(f"histogram {histogram!r} is neither counts nor scaled (common.histograms): "
                          "it cannot be masked")
    shift = release_shift(node, req, histogram, sensitivity, length)
    payload = _payload(msg)
    path = round_path(node.policy, req, session)
    context = round_context(msg, req, session)
    identity, peers = _identity(node.policy)
    statement = None
    try:
        if step == R.ADVERTISE:
            if path.exists():
                raise SecAggRefused(REPLAYED, "this round was advertised before")
            open_round(node.policy, path)
            sites = _int(payload, "sites")
            needed = noise_needed(node, req, shift)
            honest = node.policy.min_honest_nodes
            site = Participant(int(msg.metadata.dst_node_id), Terms(context, length), honest, needed, identity, peers)
            # the context too: the server derives the masks of a site that drops from it
            out: dict[str, Any] = {"advert": advert_to_dict(site.advertise(sites)), "context": b64(context)}
        else:
            site = _load(path, identity, peers)
            if site.terms.context != context:
                raise SecAggRefused(MALFORMED, "the request changed between the round's steps")
            if step == R.SHARE:
                sealed, commitment = site.share([advert_from_dict(d) for d in _list(payload, "adverts")],
                                                _int(payload, "bits"))
                out = {"sealed": {str(k): b64(v) for k, v in sealed.items()}, "commitment": b64(commitment)}
            elif step == R.MASK:
                bundles = {int(k): _unb64(v) for k, v in _dict(payload, "bundles").items()}
                mechanism = SkellamShare(histogram, compute, sensitivity, shift, site, bundles, prepare)
                masked, statement = release(node, req, mechanism)
                out = {"masked": b64(np.asarray(masked, dtype="<u8").tobytes())}
            elif step == R.CONFIRM:
                out = {"signature": b64(site.confirm([int(s) for s in _list(payload, "survivors")]))}
            else:
                signatures = {int(k): _unb64(v) for k, v in _dict(payload, "signatures").items()}
                out = revealed_to_dict(site.reveal(signatures))
    except SecAggRefused as err:
        log.warning("secure aggregation %s of %s round %d refused: %s", step, req.phase, req.round, err)
        raise SecAggRefusal(err.reason, err.detail) from None
    if step == R.REVEAL:
        path.unlink(missing_ok=True)  # the round's keys are gone with its last step
    else:
        _save(path, site, keep_identity=identity is None)
    reply = RecordDict({R.SECAGG: ConfigRecord({"payload": json.dumps(out)})})
    if statement is not None:
        reply[R.RELEASE] = statement
    return reply


def release_shift(node: Node, req: Request, histogram: str, sensitivity: float, length: int) -> skellam.Shift:
    """What one record moves in this masked release, from public inputs only: a count histogram's
    coordinates (``common.skellam.coordinates``), or for a scaled one (``common.histograms.rounded``)
    its rounded vectors' L2 bound with the part of the node's delta its Renyi bound is converted at
    (the policy's delta times the release's part of the node's epsilon, or what the request asked
    if less: ``basic_delta``, so the parts of a spent budget fit the policy's delta)."""
    if not rounded(histogram):
        return skellam.coordinates(sensitivity)
    request = under_policy(req, node.policy.epsilon, node.policy.delta)
    part = basic_delta(request.delta, request.epsilon, node.policy.epsilon, request.policy_delta)
    return skellam.Rounded(skellam.record_norm(sensitivity, length), part)


def noise_needed(node: Node, req: Request, shift: skellam.Shift) -> float:
    """The Skellam mu the round's *sum* needs for this release of ``shift``, from public inputs
    only (the request, the policy, the ledger's earlier releases); ``BudgetExceeded`` before
    anything is reserved when no finite noise spends the share."""
    request = under_policy(req, node.policy.epsilon, node.policy.delta)
    before = node.ledger.entries_before(request.run_id, request.phase, request.round) \
        if request.rule.composes_ledger else []
    mu = request.rule.skellam_mu(release_base(before), request.epsilon, shift, request.delta, request.policy_delta)
    if math.isinf(mu):
        raise BudgetExceeded(refusals.BUDGET, f"{req.phase}: no finite Skellam noise spends epsilon = "
                                              f"{request.epsilon:.4g} on this node's ledger")
    return mu


class SkellamShare(Mechanism):
    """This site's release in a masked round: the count histogram (or the real-valued one, each
    record's vector scaled and rounded: ``common.skellam.round_rows``) plus Skellam(mu / t), masked.
    The ledger counts Skellam(mu) in the sum (the site's trust); ``epsilon_alone`` in the
    statement is what the share alone gives."""

    name = SKELLAM

    def __init__(self, histogram: str, compute: Callable[..., np.ndarray], sensitivity: float, shift: skellam.Shift,
                 site: Participant, bundles: dict[int, bytes], prepare: Callable[[], object] | None = None) -> None:
        self.histogram, self.compute, self.sensitivity, self.shift = histogram, compute, float(sensitivity), shift
        self.site, self.bundles, self.prepare = site, bundles, prepare

    def check(self, request: Request) -> None:  # noqa: D102 - documented on Mechanism
        if self.prepare is not None:
            try:
                self.prepare()
            except Exception as err:  # noqa: BLE001 - any failure to load is the node's set-up
                raise NodeSetupError(f"{self.histogram}: cannot load what it needs: {type(err).__name__}") from None

    def binding(self, request: Request) -> dict[str, Any]:  # noqa: D102 - documented on Mechanism
        return {"epsilon": float(request.epsilon), "delta": float(request.delta), "honest": self.site.honest}

    def charge(self, request: Request, before: list[dict[str, Any]]) -> float | None:  # noqa: D102 - documented on Mechanism
        return request.rule.skellam_charge(release_base(before), self.site.needed, self.shift, request.policy_delta)

    def public(self, request: Request) -> dict[str, Any]:  # noqa: D102 - documented on Mechanism
        at = request.policy_delta if request.rule.composes_ledger else request.delta
        share = self.site.noise
        shift = self.shift
        moved: dict[str, Any] = {"coordinates": shift}
        if isinstance(shift, skellam.Rounded):  # its Renyi bound is read at its own part of the delta
            moved, at = {"scale": skellam.SCALE, "norm": shift.norm, "rdp_delta": shift.delta}, shift.delta
        return {"histogram": self.histogram, "sensitivity": self.sensitivity, **moved,
                "mu": self.site.needed, "mu_share": share, "honest": self.site.honest,
                "epsilon_alone": skellam.epsilon(share, shift, at) if share > 0 else math.inf,
                "secure_aggregation": True, **request.rule.terms(request.policy_delta)}

    def release(self, request: Request) -> Output:  # noqa: D102 - documented on Mechanism
        rng, shift = np.random.default_rng(), self.shift
        if isinstance(shift, skellam.Rounded):  # real values: each record's vector scaled, rounded, within the norm
            values = np.asarray(self.compute(rounding=lambda rows: skellam.round_rows(
                rows, self.sensitivity, shift.norm, rng)), dtype=np.int64)
        else:
            values = np.rint(np.asarray(self.compute(), dtype=np.float64)).astype(np.int64)  # counts: exact
        noisy = values + skellam.sample(self.site.noise, len(values), rng)
        try:
            masked = self.site.mask(self.bundles, noisy)
        except SecAggRefused as err:  # the bundles' fault, not the records': still a failure after the reservation
            raise RuntimeError(f"masking refused: {err.reason}") from None
        return Output(masked)


# ----------------------------------------------------------------- the round's state on the node
def round_path(policy: NodePolicy, req: Request, session: str) -> Path:
    """The private file of this round's state in the node's state folder: named by the ledger (two
    nodes may share a folder), the round (run, phase, round) and the server's session, so that the
    node's open rounds and a round's earlier sessions can be found by name."""
    def tag(text: str) -> str:
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    name = f"{tag(policy.ledger_id)}-{tag(f'{req.run_id}|{req.phase}|{req.round}')}-{tag(session)}"
    return state_folder(policy) / "secagg" / f"{name}.json"


def open_round(policy: NodePolicy, path: Path) -> None:
    """Before a round is advertised at ``path``: remove this round's earlier sessions (a session the
    server started again supersedes its state: keys no later step may use) and rounds abandoned for a
    day, then refuse (``PolicyRefused``) a round beyond the ``max-open-rounds`` this node keeps at once.
    Each open round is a file of keys: the server, not the node, would otherwise choose how many."""
    _prune(path.parent)
    ledger, round_, _ = path.stem.split("-")
    for earlier in path.parent.glob(f"{ledger}-{round_}-*.json"):
        earlier.unlink(missing_ok=True)
    policy.check_open_rounds(len(list(path.parent.glob(f"{ledger}-*.json"))) + 1)


def round_context(msg: Message, req: Request, session: str) -> bytes:
    """What binds the round's keys, seals and signatures: the run, phase, round, the server's
    session and the request itself (every record but the step's own payload)."""
    content = RecordDict()
    for name, rec in msg.content.config_records.items():
        if name != R.SECAGG:
            content[name] = ConfigRecord({k: v for k, v in rec.items() if k != R.SECAGG_STEP})
    for name, arrays in msg.content.array_records.items():
        content[name] = arrays
    digest = request_digest(content)
    return f"fedsyn-secagg|{req.run_id}|{req.phase}|{req.round}|{session}|{digest}".encode()


def _save(path: Path, site: Participant, keep_identity: bool) -> None:
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    atomic_write_text(path, json.dumps(site.state(keep_identity)))
    os.chmod(path, 0o600)  # the round's private keys: the node's alone


def _load(path: Path, identity: Any, peers: Any) -> Participant:
    try:
        state = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise SecAggRefused(REPLAYED, "no advertised round of this session") from None
    return Participant.restore(state, identity, peers)


def _prune(folder: Path) -> None:
    """Remove rounds abandoned for a day (a server that stopped mid-round): their keys with them."""
    if not folder.is_dir():
        return
    cutoff = time.time() - STALE_SECONDS
    for old in folder.glob("*.json"):
        if old.stat().st_mtime < cutoff:
            old.unlink(missing_ok=True)


def _identity(policy: NodePolicy) -> tuple[Any, dict[str, Any] | None]:
    """(this node's signing key or None for one made per round, the listed peers or None: every
    site counts). A deployed node that trusts nobody needs neither: its reply is fully noised."""
    if not policy.identity_key:
        return None, (None if policy.simulated or policy.min_honest_nodes <= 1 else {})
    key = masks.load_signing_key(Path(policy.identity_key).read_bytes())
    peers = {masks.key_id(k): k for k in (masks.load_public_key(line) for line in policy.peer_keys)}
    return key, peers


def _payload(msg: Message) -> dict[str, Any]:
    rec = msg.content.config_records.get(R.SECAGG)
    if rec is None or not isinstance(rec.get("payload"), str):
        return {}
    try:
        value = json.loads(str(rec["payload"]))
    except json.JSONDecodeError:
        raise SecAggRefused(MALFORMED, "the payload is not JSON") from None
    if not isinstance(value, dict):
        raise SecAggRefused(MALFORMED, "the payload is not an object")
    return value


def _int(payload: dict[str, Any], key: str) -> int:
    value = payload.get(key)
    if isinstance(value, bool) or not isinstance(value, int):
        raise SecAggRefused(MALFORMED, f"{key} is not an integer")
    return value


def _list(payload: dict[str, Any], key: str) -> list[Any]:
    return _typed(payload, key, list)


def _dict(payload: dict[str, Any], key: str) -> dict[str, Any]:
    return _typed(payload, key, dict)


def _typed(payload: dict[str, Any], key: str, kind: type) -> Any:
    value = payload.get(key)
    if not isinstance(value, kind):
        raise SecAggRefused(MALFORMED, f"{key} is not a {kind.__name__}")
    return value


def _unb64(text: Any) -> bytes:
    try:
        return unb64(text)
    except ValueError:
        raise SecAggRefused(MALFORMED, "a value is not base64") from None
