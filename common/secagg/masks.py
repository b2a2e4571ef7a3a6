"""Keys, key agreement and the pseudorandom masks of secure aggregation.

A site makes two X25519 key pairs a round: one whose agreements with its peers seal the Shamir
shares it sends them, one whose agreements seed the pairwise masks. An agreement is expanded by
HKDF-SHA256 with the round's context and the two sites' ids (so a key of one round, purpose or
pair never seeds another), and a seed by ChaCha20's keystream into a mask mod 2^b.

Not Flower's helpers for these: ``secaggplus_utils.pseudo_rand_gen`` folds the seed to 32 bits and
draws from numpy's Mersenne Twister (a mask anyone can search for in 2^32 tries, and
``randint(0, range - 1)`` never draws range - 1, so the masked vector is not uniform), and
``symmetric_encryption.generate_shared_key`` agrees on P-384 with no context in its HKDF. The
sealing itself is Flower's (``shares``).

A site's announcement may be signed with its SuperNode key (ECDSA on P-384, the key its operator
lists with ``peer-keys``), so that a server that invents sites or swaps keys is found out.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np
from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from common.secagg.ring import modulus_mask

SEED_BYTES = 32
PAIR, SEAL, SELF = b"fedsyn-secagg-pair", b"fedsyn-secagg-seal", b"fedsyn-secagg-self"


@dataclass(frozen=True)
class KeyPair:
    """An X25519 key pair; ``public`` is the 32 raw bytes sent to the peers."""

    private: X25519PrivateKey
    public: bytes

    @staticmethod
    def generate() -> KeyPair:
        """A fresh key pair from the OS's randomness (never reused: one per site, round and purpose)."""
        key = X25519PrivateKey.generate()
        return KeyPair(key, key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw))

    def private_bytes(self) -> bytes:
        """The private key's 32 raw bytes (what a site Shamir-shares of its mask key)."""
        return self.private.private_bytes(serialization.Encoding.Raw, serialization.PrivateFormat.Raw,
                                          serialization.NoEncryption())

    @staticmethod
    def from_private_bytes(raw: bytes) -> KeyPair:
        """The key pair of 32 raw private bytes (a dropped site's mask key, reconstructed)."""
        key = X25519PrivateKey.from_private_bytes(raw)
        return KeyPair(key, key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw))


def agree(own: KeyPair, peer_public: bytes, purpose: bytes, context: bytes, a: int, b: int) -> bytes:
    """A 32-byte secret that ``own`` and the holder of ``peer_public`` both derive: X25519, then
    HKDF-SHA256 bound to ``purpose``, the round's ``context`` and the pair's ids (in either order).
    Raises ``ValueError`` for a low-order public key (an all-zero agreement)."""
    lo, hi = sorted((int(a), int(b)))
    shared = own.private.exchange(X25519PublicKey.from_public_bytes(peer_public))
    info = purpose + b"|" + hashlib.sha256(context).digest() + lo.to_bytes(8, "big") + hi.to_bytes(8, "big")
    return HKDF(algorithm=hashes.SHA256(), length=SEED_BYTES, salt=None, info=info).derive(shared)


def expand(seed: bytes, length: int, bits: int) -> np.ndarray:
    """``length`` values uniform mod 2^bits from a 32-byte ``seed`` (ChaCha20's keystream, a zero
    nonce: each seed is used for one vector only)."""
    if len(seed) != SEED_BYTES:
        raise ValueError(f"a mask seed has {SEED_BYTES} bytes, got {len(seed)}")
    stream = Cipher(algorithms.ChaCha20(seed, b"\0" * 16), mode=None).encryptor().update(b"\0" * (8 * length))
    return np.frombuffer(stream, dtype="<u8").astype(np.uint64) & modulus_mask(bits)


def pairwise_sign(own_id: int, peer_id: int) -> int:
    """+1 or -1: the pair's two masks cancel (the lower id adds, the higher subtracts)."""
    if own_id == peer_id:
        raise ValueError("a site has no pairwise mask with itself")
    return 1 if own_id < peer_id else -1


# ----------------------------------------------------------------- signatures (SuperNode keys)
def load_signing_key(pem: bytes) -> ec.EllipticCurvePrivateKey:
    """A SuperNode's private key (PEM or OpenSSH, as ``deploy/generate_node_keys.sh`` writes it)."""
    try:
        key = serialization.load_pem_private_key(pem, password=None)
    except (ValueError, UnsupportedAlgorithm):
        try:
            key = serialization.load_ssh_private_key(pem, password=None)
        except UnsupportedAlgorithm:
            raise ValueError("not a private key of a known kind") from None
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise ValueError("a SuperNode key is an elliptic-curve key (ssh-keygen -t ecdsa -b 384)")
    return key


def load_public_key(text: str) -> ec.EllipticCurvePublicKey:
    """A SuperNode's public key: an OpenSSH line (``ecdsa-sha2-nistp384 AAAA...``) or a PEM."""
    data = text.strip().encode()
    try:
        key = (serialization.load_pem_public_key(data) if data.startswith(b"-----")
               else serialization.load_ssh_public_key(data))
    except UnsupportedAlgorithm:
        raise ValueError("not a public key of a known kind") from None
    if not isinstance(key, ec.EllipticCurvePublicKey):
        raise ValueError("a SuperNode public key is an elliptic-curve key (ecdsa-sha2-nistp384)")
    return key


def key_id(key: ec.EllipticCurvePublicKey) -> str:
    """A public key's fingerprint (SHA-256 of its DER form, hex): how logs and ledgers name a peer."""
    der = key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    return hashlib.sha256(der).hexdigest()


def public_key_text(key: ec.EllipticCurvePublicKey) -> str:
    """A public key as the OpenSSH line a peer lists."""
    return key.public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH).decode()


def sign(key: ec.EllipticCurvePrivateKey, message: bytes) -> bytes:
    """ECDSA-SHA256 signature of ``message``."""
    return key.sign(message, ec.ECDSA(hashes.SHA256()))


def verify(key: ec.EllipticCurvePublicKey, signature: bytes, message: bytes) -> bool:
    """Whether ``signature`` is ``key``'s over ``message``."""
    try:
        key.verify(signature, message, ec.ECDSA(hashes.SHA256()))
    except (InvalidSignature, ValueError):
        return False
    return True
