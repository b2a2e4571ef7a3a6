"""Integers mod 2^b: what a masked vector is, and the b that holds a sum.

A site's vector is integers (counts, plus its integer noise share); masked, it is uniform mod 2^b.
The server's unmasked sum is read back as the integer in [-2^(b-1), 2^(b-1)) it is congruent to,
which is the true sum whenever the true sum lies in that range. ``bits_for`` sizes b so that the
data part of every site at its public bound, plus each site's noise to a tail no sample exceeds
but with probability below 2^-64 per coordinate, stays inside it. A wrap would only garble the
sum, never leak: the sum mod 2^b is a function of the noisy sum (post-processing).

All arithmetic is in numpy's uint64, which wraps mod 2^64; 2^b divides 2^64, so reducing mod 2^b
at the end gives the same residue as reducing at every step.
"""

from __future__ import annotations

import math

import numpy as np

MAX_BITS = 62  # the ring's largest b: int64 holds the centred lift without a wrap of its own
TAIL_BITS = 64  # a noise sample exceeds its tail bound with probability below 2^-TAIL_BITS


def poisson_tail(mu: float, bits: int = TAIL_BITS) -> int:
    """An integer m with P(Poisson(mu) - mu >= m) < 2^-bits (Chernoff: exp(-m^2 / (2 (mu + m)))),
    so a Skellam(mu) sample (a difference of two Poissons) exceeds m in absolute value with
    probability below 2^(1-bits)."""
    if mu <= 0:
        return 0
    log_target = bits * math.log(2)  # solve m^2 = 2 (mu + m) log_target for m
    return int(math.ceil(log_target + math.sqrt(log_target ** 2 + 2 * mu * log_target))) + 1


def bits_for(sites: int, value_bound: int, noise_mu: float) -> int:
    """The ring's b for the sum of ``sites`` vectors whose data part lies in [-value_bound,
    value_bound] per coordinate and whose noise is Skellam(``noise_mu``) per site (the largest
    share a site adds): the sum's absolute value stays below 2^(b-1) unless a noise sample passes
    its 2^-64 tail. Raises ``ValueError`` when that needs more than ``MAX_BITS``."""
    if sites < 1 or value_bound < 0 or noise_mu < 0:
        raise ValueError(f"bits_for(sites={sites}, value_bound={value_bound}, noise_mu={noise_mu})")
    largest = sites * (int(value_bound) + poisson_tail(noise_mu))
    bits = max(2, largest.bit_length() + 1)  # + 1: the sign
    if bits > MAX_BITS:
        raise ValueError(f"the sum of {sites} sites at value bound {value_bound} and noise mu {noise_mu:g} needs "
                         f"{bits} bits, above {MAX_BITS}: lower the sites' bound or the noise")
    return bits


def modulus_mask(bits: int) -> np.uint64:
    """2^bits - 1 as a uint64 (``x & mask`` is x mod 2^bits)."""
    if not 1 <= bits <= 64:
        raise ValueError(f"bits = {bits}; must be in [1, 64]")
    return np.uint64((1 << bits) - 1)


def encode(values: np.ndarray, bits: int) -> np.ndarray:
    """Integers (any signed integer dtype) as their residues mod 2^bits (uint64)."""
    values = np.asarray(values)
    if values.dtype.kind not in "iu":
        raise TypeError(f"only integers are encoded (got {values.dtype}): round a real vector first")
    return values.astype(np.int64).view(np.uint64) & modulus_mask(bits)


def add(a: np.ndarray, b: np.ndarray, bits: int) -> np.ndarray:
    """(a + b) mod 2^bits, elementwise."""
    return (np.asarray(a, dtype=np.uint64) + np.asarray(b, dtype=np.uint64)) & modulus_mask(bits)


def subtract(a: np.ndarray, b: np.ndarray, bits: int) -> np.ndarray:
    """(a - b) mod 2^bits, elementwise."""
    return (np.asarray(a, dtype=np.uint64) - np.asarray(b, dtype=np.uint64)) & modulus_mask(bits)


def decode(residues: np.ndarray, bits: int) -> np.ndarray:
    """The integers in [-2^(bits-1), 2^(bits-1)) congruent to ``residues`` mod 2^bits (int64)."""
    if not 2 <= bits <= MAX_BITS:
        raise ValueError(f"bits = {bits}; must be in [2, {MAX_BITS}]")
    r = np.asarray(residues, dtype=np.uint64) & modulus_mask(bits)
    signed = r.astype(np.int64)
    return np.where(signed >= (1 << (bits - 1)), signed - (1 << bits), signed)
