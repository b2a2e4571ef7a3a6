"""Secure aggregation as a state machine: one site's side and the server's arithmetic.

Bonawitz et al. 2017 (CCS, "Practical Secure Aggregation for Privacy-Preserving Machine
Learning"), on the full graph of the round's sites, with its consistency check; every site picks
its own Shamir threshold from the number of sites it counts on (``shares.threshold``). Five
requests of the server, each answered by one method of ``Participant``:

1. ``advertise``: two fresh X25519 public keys, the noise it needs in the
   sum and the sites it counts on (every site's share follows from all adverts: ``noise_share``), signed by
   its identity key (its SuperNode key in a deployment, else a key made for the round);
2. ``share``: given every advert, checked (signatures; in a deployment, only keys the operator
   listed are counted), Shamir shares of the self-mask seed and of the mask key, one sealed
   bundle per peer, and a commitment to the seed;
3. ``mask``: given the bundles addressed to it, its integer vector plus the self mask plus the
   pairwise masks, mod 2^b: uniform on its own;
4. ``confirm``: given the survivors (the sites whose masked vector the server holds), a signature
   over that list, unless the list leaves fewer sites it counts than it trusts to be honest;
5. ``reveal``: given the survivors' signatures (at least its threshold, all over the same list),
   a share of the seed of each survivor that signed and of each dropped site's mask key, never
   both for one site. A survivor that did not sign (it refused the list) is never unmasked: so a
   site that finds too few sites it trusts among the survivors stops the whole round; a site lost
   after signing is unmasked from the others' shares.

``unmask`` is the server's: the sum of the survivors' vectors from their masked vectors and the
revealed shares. Everything here is pure (no Flower, no files); a refusal is ``SecAggRefused``
with a fixed text (what the node may send), its detail in ``detail``.
"""

from __future__ import annotations

import hashlib
import math
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from cryptography.hazmat.primitives.asymmetric import ec

from common.secagg import masks, ring, shares as shamir


class SecAggRefused(ValueError):
    """A request this site will not answer; ``reason`` is a fixed text, ``detail`` the node's log."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason, self.detail = reason, detail


# the most sites a round may have: a site's work (agreements, shares, one mask per peer) grows with them,
# so the server may not name an arbitrary number (fedsyn's scale runs have 100)
MAX_SITES = 1000

# the fixed texts a site refuses with (no number, id or key in them)
MALFORMED = "secure aggregation: a malformed request"
UNTRUSTED = "secure aggregation: fewer trusted sites than this site requires"
FORGED = "secure aggregation: a signature does not verify"
INCONSISTENT = "secure aggregation: the survivors are not those this site saw or signed"
REPLAYED = "secure aggregation: a step asked twice or out of order"


@dataclass(frozen=True)
class Terms:
    """A round's public terms, the same for every site: ``context`` binds every key, seal and
    signature to this round (the run, phase, round and request), ``length`` and ``bits`` the ring
    (0 until the server sizes it from the adverts, at ``share``)."""

    context: bytes
    length: int
    bits: int = 0

    def __post_init__(self) -> None:
        if self.length < 0 or not (self.bits == 0 or 2 <= self.bits <= ring.MAX_BITS) or not self.context:
            raise SecAggRefused(MALFORMED, f"terms length={self.length} bits={self.bits}")


@dataclass(frozen=True)
class Advert:
    """A site's announcement: its two round keys, the Skellam mu its release needs in the sum and
    its ``honest`` (the sites it counts on, whence its threshold: ``threshold_of``), and who it is."""

    site: int
    seal_public: bytes
    mask_public: bytes
    needed: float  # the Skellam mu this site's release needs in the sum (public: its request and ledger's)
    honest: int  # its min-honest-nodes
    identity: str  # its identity key, an OpenSSH public-key line
    signature: bytes = b""

    def signed_part(self, context: bytes) -> bytes:
        """What the identity key signs: the round and every other field."""
        return b"advert|" + _fields(context, self.site, self.seal_public, self.mask_public,
                                    repr(float(self.needed)).encode(), self.honest, self.identity.encode())


@dataclass
class Revealed:
    """What one site reveals: the shares it holds of survivors' seeds and of dropped sites' keys."""

    seeds: dict[int, bytes] = field(default_factory=dict)
    keys: dict[int, bytes] = field(default_factory=dict)


class Participant:
    """One site's side of one round. ``honest``: the sites, itself included, this site counts on
    to follow the protocol (its ``min-honest-nodes``); ``needed``: the Skellam mu its release
    needs in the sum (what it adds is ``noise_share`` of the round's adverts); ``identity``: its signing key (None:
    a key made for the round, which authenticates nothing); ``peers``: the identity keys its
    operator lists (fingerprint -> key; None: every site of the round counts, as in simulation)."""

    def __init__(self, site: int, terms: Terms, honest: int, needed: float,
                 identity: ec.EllipticCurvePrivateKey | None = None,
                 peers: Mapping[str, ec.EllipticCurvePublicKey] | None = None) -> None:
        if honest < 1 or not needed >= 0 or math.isinf(needed):
            raise SecAggRefused(MALFORMED, f"honest={honest} needed={needed}")
        self.site, self.terms, self.honest, self.needed = int(site), terms, int(honest), float(needed)
        self.noise = 0.0  # the mu it adds: fixed from every advert at ``share``
        self.identity = identity or ec.generate_private_key(ec.SECP384R1())
        self.own_key = masks.key_id(self.identity.public_key())
        self.peers = dict(peers) if peers is not None else None
        self.seal_keys, self.mask_keys = masks.KeyPair.generate(), masks.KeyPair.generate()
        self.step = 0
        self.adverts: dict[int, Advert] = {}
        self.threshold = 0
        self._seed = b""  # the self-mask seed, drawn at ``share``
        self.held: dict[int, tuple[bytes, bytes]] = {}  # peer -> (its seed share, its key share) held here
        self.shared: list[int] = []  # U2: the sites whose bundles reached this site
        self.survivors: tuple[int, ...] = ()

    # ---------------------------------------------------------- 1. advertise
    def advertise(self, sites: int) -> Advert:
        """This site's advert for a round the server asks of ``sites`` sites (its threshold follows
        from the number that advertise, at ``share``)."""
        self._next(1)
        if not 1 <= sites <= MAX_SITES:
            raise SecAggRefused(MALFORMED, f"a round of {sites} sites (1 to {MAX_SITES})")
        advert = Advert(self.site, self.seal_keys.public, self.mask_keys.public, self.needed,
                        self.honest, masks.public_key_text(self.identity.public_key()))
        return _signed(advert, self.identity, self.terms.context)

    # ---------------------------------------------------------- 2. share
    def share(self, adverts: Sequence[Advert], bits: int | None = None) -> tuple[dict[int, bytes], bytes]:
        """Given every site's advert (its own among them) and the ring's ``bits`` (None: the terms'),
        the bundles it seals for each peer and the commitment to its self-mask seed."""
        self._next(2)
        if bits is not None:
            self.terms = Terms(self.terms.context, self.terms.length, int(bits))
        if not self.terms.bits:
            raise SecAggRefused(MALFORMED, "no ring size")
        if len(adverts) > MAX_SITES:
            raise SecAggRefused(MALFORMED, f"{len(adverts)} adverts, above {MAX_SITES}")
        by_site = {a.site: a for a in adverts}
        own = by_site.get(self.site)
        if len(by_site) != len(adverts) or own is None or own.mask_public != self.mask_keys.public \
                or own.needed != self.needed or own.honest != self.honest:
            raise SecAggRefused(MALFORMED, "the adverts repeat a site, leave this one out or change its advert")
        for a in adverts:
            if not masks.verify(masks.load_public_key(a.identity), a.signature, a.signed_part(self.terms.context)):
                raise SecAggRefused(FORGED, f"site {a.site}'s advert")
            if not 0 <= a.needed < math.inf or a.honest < 1:
                raise SecAggRefused(MALFORMED, f"site {a.site}'s noise or trust")
        self.adverts = by_site
        self.threshold = threshold_of(by_site, self.site)
        self.noise = noise_share(by_site, self.site)
        if len(self.counted(by_site)) < min(self.honest, len(adverts)) or self.honest > len(adverts):
            raise SecAggRefused(UNTRUSTED, f"{len(self.counted(by_site))} counted of {len(adverts)} adverts")
        order = sorted(by_site)
        seed = _random(masks.SEED_BYTES)
        self._seed = seed
        seed_shares = shamir.split(seed, self.threshold, len(order))
        key_shares = shamir.split(self.mask_keys.private_bytes(), self.threshold, len(order))
        sealed = {}
        for i, peer in enumerate(order):
            if peer == self.site:
                self.held[peer] = (seed_shares[i], key_shares[i])
                continue
            key = masks.agree(self.seal_keys, by_site[peer].seal_public, masks.SEAL, self.terms.context, self.site,
                              peer)
            sealed[peer] = shamir.seal(key, self.site, peer, seed_shares[i], key_shares[i])
        return sealed, commitment(seed)

    # ---------------------------------------------------------- 3. mask
    def mask(self, bundles: Mapping[int, bytes], vector: np.ndarray) -> np.ndarray:
        """Given the bundles addressed to this site (by sender: U2 less itself), its integer
        ``vector`` (the data plus its noise share) masked mod 2^b."""
        self._next(3)
        vector = np.asarray(vector)
        if vector.shape != (self.terms.length,):
            raise SecAggRefused(MALFORMED, f"a vector of shape {vector.shape}, not ({self.terms.length},)")
        if not set(bundles) <= set(self.adverts) - {self.site}:
            raise SecAggRefused(MALFORMED, "a bundle from a site that did not advertise")
        for src, sealed in bundles.items():
            key = masks.agree(self.seal_keys, self.adverts[src].seal_public, masks.SEAL, self.terms.context, src,
                              self.site)
            try:
                self.held[src] = shamir.unseal(key, src, self.site, sealed)
            except ValueError as err:
                raise SecAggRefused(FORGED, f"site {src}'s bundle: {err}") from None
        self.shared = sorted(set(bundles) | {self.site})
        if len(self.shared) < self.threshold:
            raise SecAggRefused(UNTRUSTED, f"{len(self.shared)} sites shared, below the threshold {self.threshold}")
        bits = self.terms.bits
        out = ring.add(ring.encode(vector, bits), masks.expand(self._seed, self.terms.length, bits), bits)
        for peer in self.shared:
            if peer == self.site:
                continue
            pad = pair_mask(self.mask_keys, self.adverts[peer].mask_public, self.terms, self.site, peer)
            out = (ring.add if masks.pairwise_sign(self.site, peer) > 0 else ring.subtract)(out, pad, bits)
        return out

    # ---------------------------------------------------------- 4. confirm
    def confirm(self, survivors: Sequence[int]) -> bytes:
        """A signature over ``survivors`` (the sites whose masked vectors the server holds), unless
        this site is not among them, they are not all sites that shared, or they leave fewer
        counted sites, or less noise, than this site requires."""
        self._next(4)
        chosen = tuple(sorted(set(int(s) for s in survivors)))
        if len(chosen) != len(survivors) or self.site not in chosen or not set(chosen) <= set(self.shared):
            raise SecAggRefused(INCONSISTENT, "the survivors leave this site out or name a site that did not share")
        if len(chosen) < self.threshold:
            raise SecAggRefused(UNTRUSTED, f"{len(chosen)} survivors, below the threshold {self.threshold}")
        present = self.counted({s: self.adverts[s] for s in chosen})
        if len(present) < self.honest:
            raise SecAggRefused(UNTRUSTED, f"{len(present)} counted sites survive, {self.honest} required")
        # itself, and any ``honest - 1`` of the others present: the least noise they add
        others = sorted(noise_share(self.adverts, s) for s in present if s != self.site)
        least = noise_share(self.adverts, self.site) + sum(others[:self.honest - 1])
        if least < self.needed * (1 - 1e-12):
            raise SecAggRefused(UNTRUSTED, f"the {self.honest} least noisy counted survivors add mu {least:g}, "
                                f"{self.needed:g} required")
        self.survivors = chosen
        return masks.sign(self.identity, survivors_message(self.terms.context, chosen))

    # ---------------------------------------------------------- 5. reveal
    def reveal(self, signatures: Mapping[int, bytes]) -> Revealed:
        """Given the survivors' signatures over the list this site confirmed, the shares it holds
        of each survivor's seed and of each dropped site's mask key."""
        self._next(5)
        message = survivors_message(self.terms.context, self.survivors)
        valid = {s for s, sig in signatures.items()
                 if s in self.survivors and masks.verify(masks.load_public_key(self.adverts[s].identity), sig, message)}
        if len(valid) < self.threshold or self.site not in valid:
            raise SecAggRefused(INCONSISTENT, f"{len(valid)} valid signatures over the survivors, "
                                f"{self.threshold} required")
        out = Revealed()
        for peer, (seed_share, key_share) in self.held.items():
            if peer in self.survivors:
                # only a survivor that signed the list: a site that refused it (too few sites it trusts)
                # keeps its vector masked, and being a survivor its key is never revealed either, so
                # nothing of the round is unmasked without its consent
                if peer in valid:
                    out.seeds[peer] = seed_share
            elif peer in self.shared:
                out.keys[peer] = key_share
        return out

    # ---------------------------------------------------------- between requests
    def state(self, keep_identity: bool) -> dict[str, Any]:
        """Everything this site must remember between requests, JSON-ready (its private keys
        among them: the node keeps it in its own state folder, never sends it). ``keep_identity``:
        include the identity key (a key made for the round); else the node reloads its SuperNode key."""
        from cryptography.hazmat.primitives import serialization

        identity = (self.identity.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                serialization.NoEncryption()).decode() if keep_identity else "")
        return {"site": self.site, "context": b64(self.terms.context), "length": self.terms.length,
                "bits": self.terms.bits, "honest": self.honest, "noise": self.noise, "needed": self.needed,
                "identity": identity, "seal": b64(self.seal_keys.private_bytes()),
                "mask": b64(self.mask_keys.private_bytes()), "step": self.step, "threshold": self.threshold,
                "seed": b64(self._seed),
                "adverts": [advert_to_dict(a) for a in self.adverts.values()],
                "held": {str(k): [b64(a), b64(b)] for k, (a, b) in self.held.items()},
                "shared": list(self.shared), "survivors": list(self.survivors)}

    @staticmethod
    def restore(state: Mapping[str, Any], identity: ec.EllipticCurvePrivateKey | None = None,
                peers: Mapping[str, ec.EllipticCurvePublicKey] | None = None) -> Participant:
        """The site ``state`` describes (``identity``: its SuperNode key where the state holds none)."""
        from cryptography.hazmat.primitives import serialization

        if identity is None:
            loaded = serialization.load_pem_private_key(str(state["identity"]).encode(), password=None)
            assert isinstance(loaded, ec.EllipticCurvePrivateKey)
            identity = loaded
        p = Participant(int(state["site"]), Terms(unb64(state["context"]), int(state["length"]), int(state["bits"])),
                        int(state["honest"]), float(state["needed"]), identity, peers)
        p.noise = float(state["noise"])
        p.seal_keys = masks.KeyPair.from_private_bytes(unb64(state["seal"]))
        p.mask_keys = masks.KeyPair.from_private_bytes(unb64(state["mask"]))
        p.step, p.threshold = int(state["step"]), int(state["threshold"])
        if state["seed"]:
            p._seed = unb64(state["seed"])
        p.adverts = {a.site: a for a in (advert_from_dict(d) for d in state["adverts"])}
        p.held = {int(k): (unb64(a), unb64(b)) for k, (a, b) in state["held"].items()}
        p.shared, p.survivors = [int(s) for s in state["shared"]], tuple(int(s) for s in state["survivors"])
        return p

    # ---------------------------------------------------------- helpers
    def counted(self, adverts: Mapping[int, Advert]) -> list[int]:
        """The sites of ``adverts`` this site counts on: itself, and those whose identity its
        operator lists (every one where it lists none: simulation). A key listed twice counts once."""
        if self.peers is None:
            return sorted(adverts)
        seen, out = {self.own_key}, [self.site] if self.site in adverts else []
        for site, a in sorted(adverts.items()):
            if site == self.site:
                continue
            fingerprint = masks.key_id(masks.load_public_key(a.identity))
            if fingerprint in self.peers and fingerprint not in seen:
                seen.add(fingerprint)
                out.append(site)
        return sorted(out)

    def _next(self, step: int) -> None:
        if self.step != step - 1:
            raise SecAggRefused(REPLAYED, f"step {step} after step {self.step}")
        self.step = step


# ----------------------------------------------------------------- shared by both sides
def threshold_of(adverts: Mapping[int, Advert], site: int) -> int:
    """The shares ``site``'s secrets need in a round of ``adverts`` (``shares.threshold`` of the
    sites that advertised and its trust): every site and the server compute it alike."""
    return shamir.threshold(len(adverts), min(adverts[site].honest, len(adverts)))


def noise_share(adverts: Mapping[int, Advert], site: int) -> float:
    """The Skellam mu ``site`` adds in a round of ``adverts``: the most any site needs in the sum,
    over the sites it counts on (its ``honest``). Sites of one trust then put at least every
    site's need in the sum; a site that counts on fewer adds more. Every site and the server
    compute it from the adverts alone."""
    return max(a.needed for a in adverts.values()) / adverts[site].honest


def advert_to_dict(a: Advert) -> dict[str, Any]:
    """An advert as JSON-ready values (bytes as base64)."""
    return {"site": a.site, "seal": b64(a.seal_public), "mask": b64(a.mask_public),
            "needed": a.needed, "honest": a.honest, "identity": a.identity, "signature": b64(a.signature)}


def advert_from_dict(d: Mapping[str, Any]) -> Advert:
    """The advert of ``advert_to_dict``'s values; ``SecAggRefused(MALFORMED)`` for anything else."""
    try:
        return Advert(int(d["site"]), unb64(d["seal"]), unb64(d["mask"]), float(d["needed"]),
                      int(d["honest"]), str(d["identity"]), unb64(d["signature"]))
    except (KeyError, TypeError, ValueError) as err:
        raise SecAggRefused(MALFORMED, f"an advert: {type(err).__name__}") from None


def revealed_to_dict(r: Revealed) -> dict[str, Any]:
    """What a site reveals, JSON-ready."""
    return {"seeds": {str(k): b64(v) for k, v in r.seeds.items()}, "keys": {str(k): b64(v) for k, v in r.keys.items()}}


def revealed_from_dict(d: Mapping[str, Any]) -> Revealed:
    """``revealed_to_dict``'s values back; ``ValueError`` for anything else."""
    try:
        return Revealed({int(k): unb64(v) for k, v in d["seeds"].items()},
                        {int(k): unb64(v) for k, v in d["keys"].items()})
    except (KeyError, TypeError, AttributeError) as err:
        raise ValueError(f"a reveal: {type(err).__name__}") from None


def b64(raw: bytes) -> str:
    """``raw`` as base64 text (how bytes travel in a JSON payload)."""
    import base64

    return base64.b64encode(raw).decode()


def unb64(text: Any) -> bytes:
    """The bytes of base64 ``text``; ``ValueError`` for anything else."""
    import base64
    import binascii

    try:
        return base64.b64decode(str(text), validate=True)
    except (binascii.Error, ValueError):
        raise ValueError("not base64") from None


def commitment(seed: bytes) -> bytes:
    """SHA-256 of a self-mask seed: the server checks the seed it reconstructs against it."""
    return hashlib.sha256(b"fedsyn-secagg-seed|" + seed).digest()


def survivors_message(context: bytes, survivors: Sequence[int]) -> bytes:
    """What the consistency check signs: the round and the sorted survivors."""
    return b"survivors|" + _fields(context, *sorted(int(s) for s in survivors))


def pair_mask(own: masks.KeyPair, peer_public: bytes, terms: Terms, a: int, b: int) -> np.ndarray:
    """The mask the pair (a, b) shares, as ``own`` (a's or b's mask key) derives it."""
    return masks.expand(masks.agree(own, peer_public, masks.PAIR, terms.context, a, b), terms.length, terms.bits)


def route(sealed: Mapping[int, Mapping[int, bytes]]) -> dict[int, dict[int, bytes]]:
    """The server's step between share and mask: bundles by sender -> bundles by recipient."""
    out: dict[int, dict[int, bytes]] = {}
    for src, per_dst in sealed.items():
        for dst, bundle in per_dst.items():
            out.setdefault(int(dst), {})[int(src)] = bundle
    return out


def unmask(terms: Terms, adverts: Mapping[int, Advert], commitments: Mapping[int, bytes],
           masked: Mapping[int, np.ndarray], revealed: Mapping[int, Revealed]) -> np.ndarray:
    """The server's sum of the survivors' vectors (int64), from their ``masked`` vectors, the
    ``commitments`` of every site that shared (U2), and what the survivors ``revealed``.
    Raises ``ValueError`` when a secret cannot be rebuilt from the shares (too few, or altered)."""
    bits, survivors = terms.bits, sorted(masked)
    dropped = sorted(set(commitments) - set(survivors))
    total = np.zeros(terms.length, dtype=np.uint64)
    for s in survivors:
        vec = np.asarray(masked[s], dtype=np.uint64)
        if vec.shape != (terms.length,):
            raise ValueError(f"site {s}'s masked vector has shape {vec.shape}")
        total = ring.add(total, vec, bits)
    for s in survivors:  # their self masks
        seed = _rebuild([r.seeds[s] for r in revealed.values() if s in r.seeds], threshold_of(adverts, s))
        if commitment(seed) != commitments[s]:
            raise ValueError(f"site {s}'s seed does not match its commitment")
        total = ring.subtract(total, masks.expand(seed, terms.length, bits), bits)
    for d in dropped:  # the masks the survivors share with a site that dropped after sharing
        key = masks.KeyPair.from_private_bytes(
            _rebuild([r.keys[d] for r in revealed.values() if d in r.keys], threshold_of(adverts, d)))
        if key.public != adverts[d].mask_public:
            raise ValueError(f"site {d}'s mask key does not match its advert")
        for s in survivors:
            pad = pair_mask(key, adverts[s].mask_public, terms, s, d)
            # survivor s added sign(s, d) * pad: take it back out
            total = (ring.subtract if masks.pairwise_sign(s, d) > 0 else ring.add)(total, pad, bits)
    return ring.decode(total, bits)


def _rebuild(parts: list[bytes], needed: int) -> bytes:
    if len(parts) < needed:
        raise ValueError(f"{len(parts)} shares, {needed} needed")
    return shamir.combine(parts[:needed])


def _signed(advert: Advert, key: ec.EllipticCurvePrivateKey, context: bytes) -> Advert:
    return Advert(advert.site, advert.seal_public, advert.mask_public, advert.needed,
                  advert.honest, advert.identity, masks.sign(key, advert.signed_part(context)))


def _fields(context: bytes, *parts: int | bytes) -> bytes:
    """Length-prefixed fields, so no two field lists sign the same bytes."""
    out = [hashlib.sha256(context).digest()]
    for p in parts:
        raw = p if isinstance(p, bytes) else str(int(p)).encode()  # any size: Flower's node ids are uint64
        out.append(struct.pack(">I", len(raw)) + raw)
    return b"".join(out)


def _random(n: int) -> bytes:
    import os

    return os.urandom(n)
