"""Shamir shares of a site's two secrets, each peer's sealed for that peer alone.

A site shares its self-mask seed and its mask key's private bytes among the round's sites with
its own threshold (``threshold``): the server learns a secret only from that many shares, and an
honest site reveals, for each peer, a share of one secret or of the other, never both.

The splitting is Flower's (``flwr.common.secure_aggregation.crypto.shamir``: pycryptodome's Shamir
over GF(2^128), 16-byte chunks) and the sealing Flower's Fernet (``symmetric_encryption.encrypt``:
AES-CBC with an HMAC, so a share altered on the way is refused); only the key each seal uses is
ours (``masks.agree``, bound to the round and the pair).
"""

from __future__ import annotations

import base64
import struct

from flwr.common.secure_aggregation.crypto.shamir import combine_shares, create_shares
from flwr.common.secure_aggregation.crypto.symmetric_encryption import decrypt, encrypt

PLAIN, SHAMIR = b"\x01", b"\x00"  # a share's first byte: the secret itself (threshold 1), or a Shamir share


def threshold(sites: int, honest: int) -> int:
    """The shares a site's secret needs, for a site that counts on ``honest`` of the ``sites``
    (itself included) following the protocol. Up to c = ``sites - honest`` sites may collude with
    the server and sign every list of survivors it shows; each honest site signs and reveals under
    one. To open this site's vector alone the server needs its seed from the sites shown a list
    with it and its key from those shown one without: c plus each group of honest sites. So the
    threshold exceeds (sites + c) / 2: the two groups cannot both reach it (this is Bonawitz et
    al.'s consistency-check bound, t > 2n/3 for a third corrupt, at our c). It then exceeds c, so
    the colluders alone rebuild nothing, and half, so the honest sites cannot be split either.
    At honest = sites (the default t = K) it is half plus one, as before; below, it asks more
    sites to stay to the end (at 5 sites and t = 3, 4 of them)."""
    if not 1 <= honest <= sites:
        raise ValueError(f"honest = {honest} of {sites} sites; must be in [1, {sites}]")
    if honest == 1:  # a site that trusts nobody adds the whole noise: its vector may be unmasked alone
        return sites // 2 + 1
    return (2 * sites - honest) // 2 + 1


def split(secret: bytes, needed: int, sites: int) -> list[bytes]:
    """``sites`` shares of ``secret``, any ``needed`` of which give it back (share i for site i)."""
    if not 1 <= needed <= sites:
        raise ValueError(f"a threshold of {needed} of {sites} shares")
    if needed == 1:  # a polynomial of degree 0: every share is the secret itself
        return [PLAIN + secret for _ in range(sites)]
    return [SHAMIR + s for s in create_shares(secret, needed, sites)]


def combine(shares: list[bytes]) -> bytes:
    """The secret from ``needed`` of its shares; ``ValueError`` when they do not give one back."""
    if not shares:
        raise ValueError("no shares to combine")
    if any(s[:1] != shares[0][:1] for s in shares) or shares[0][:1] not in (PLAIN, SHAMIR):
        raise ValueError("shares of different kinds")
    if shares[0][:1] == PLAIN:
        return shares[0][1:]
    return combine_shares([s[1:] for s in shares])


def seal(key: bytes, src: int, dst: int, seed_share: bytes, key_share: bytes) -> bytes:
    """Both shares ``src`` gives ``dst``, sealed under their agreed 32-byte ``key``; the ids are
    inside, so a sealed bundle the server moves to another site is refused on opening."""
    body = struct.pack("<QQI", src, dst, len(seed_share)) + seed_share + key_share
    return encrypt(base64.urlsafe_b64encode(key), body)


def unseal(key: bytes, src: int, dst: int, sealed: bytes) -> tuple[bytes, bytes]:
    """(seed share, key share) from a bundle sealed by ``seal`` for (``src``, ``dst``); raises
    ``ValueError`` for a bundle altered, sealed under another key, or addressed to another pair."""
    try:
        body = decrypt(base64.urlsafe_b64encode(key), sealed)
    except Exception:  # noqa: BLE001 - Fernet's InvalidToken and malformed tokens alike
        raise ValueError("a sealed share does not open under the pair's key") from None
    if len(body) < 20:
        raise ValueError("a sealed share is too short")
    got_src, got_dst, n = struct.unpack("<QQI", body[:20])
    if (got_src, got_dst) != (src, dst):
        raise ValueError("a sealed share is addressed to another pair")
    return body[20:20 + n], body[20 + n:]
