"""Shamir secret sharing of 32-byte secrets over the prime field GF(2^521 - 1).

A secret s is the constant term of a random polynomial of degree t - 1; share
x (1 ≤ x ≤ n) is the polynomial's value at x. Any t shares give s back by
Lagrange interpolation at 0; any t - 1 shares are consistent with every
secret, so they tell nothing about it. The coefficients come from the
operating system's entropy (``secrets``).
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from dataclasses import dataclass

# A Mersenne prime larger than any 32-byte secret (2^256), so a secret is a field element as it is.
PRIME = 2**521 - 1
SECRET_BYTES = 32
_VALUE_BYTES = (PRIME.bit_length() + 7) // 8


@dataclass(frozen=True)
class Share:
    """One share of a secret: the point x (1-based party number) and the polynomial's value there."""

    x: int
    y: int

    def __repr__(self) -> str:
        return f"Share(x={self.x}, y=<hidden>)"

    def to_bytes(self) -> bytes:
        """The share as 2 bytes of x and the field element y, big-endian (what is encrypted to its holder)."""
        return self.x.to_bytes(2, "big") + self.y.to_bytes(_VALUE_BYTES, "big")

    @classmethod
    def from_bytes(cls, data: bytes) -> Share:
        """The share `to_bytes` wrote."""
        if len(data) != 2 + _VALUE_BYTES:
            raise ValueError(f"a share is {2 + _VALUE_BYTES} bytes (got {len(data)})")
        return cls(int.from_bytes(data[:2], "big"), int.from_bytes(data[2:], "big"))


def split_secret(secret: bytes, shares: int, threshold: int) -> list[Share]:
    """`shares` shares of the 32-byte `secret`, at x = 1..shares, any `threshold` of which recover it."""
    if len(secret) != SECRET_BYTES:
        raise ValueError(f"a shared secret is {SECRET_BYTES} bytes (got {len(secret)})")
    if not 1 <= threshold <= shares < 2**16:
        raise ValueError(f"the threshold must lie in 1..shares and shares below 65536 (got threshold {threshold}, "
                         f"shares {shares})")
    coefficients = [int.from_bytes(secret, "big")] + [secrets.randbelow(PRIME) for _ in range(threshold - 1)]
    return [Share(x, _evaluate(coefficients, x)) for x in range(1, shares + 1)]


def _evaluate(coefficients: Sequence[int], x: int) -> int:
    """The polynomial with `coefficients` (constant first) at x, modulo PRIME (Horner)."""
    value = 0
    for coefficient in reversed(coefficients):
        value = (value * x + coefficient) % PRIME
    return value


def combine_shares(shares: Sequence[Share]) -> bytes:
    """The secret that the polynomial through `shares` has at 0, as 32 bytes.

    With at least the threshold of distinct shares this is the secret; with
    fewer it is an unrelated value, or an error when that value does not fit
    in 32 bytes.
    """
    xs = [share.x for share in shares]
    if not shares or len(set(xs)) != len(xs) or min(xs) < 1:
        raise ValueError(f"combining needs one or more shares with distinct points x ≥ 1 (got x = {xs})")
    secret = 0
    for share in shares:
        numerator, denominator = 1, 1
        for other in xs:
            if other != share.x:
                numerator = numerator * other % PRIME
                denominator = denominator * (other - share.x) % PRIME
        secret = (secret + share.y * numerator * pow(denominator, -1, PRIME)) % PRIME
    if secret >= 2 ** (8 * SECRET_BYTES):
        raise ValueError("the shares do not interpolate to a 32-byte secret: too few, or not of one secret")
    return secret.to_bytes(SECRET_BYTES, "big")
