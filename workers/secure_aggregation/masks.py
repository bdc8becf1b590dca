"""Masks that cancel in a sum, and the pair keys behind them: X25519 agreements, HKDF, ChaCha20 (`cryptography`).

Parties i and j agree two keys per round, each from its own X25519 key pair:
the pair's mask seed from their masking keys, and the key that seals what
one sends the other through the driver from their sealing keys. Both are
HKDF-SHA256 of the shared secret, bound to the round (its binding bytes as
the salt), to the pair and to the purpose, so neither key says anything
about the other and no round shares a key with another. Party i adds the
pair's mask when i < j and subtracts it when i > j, so the masks of every
pair whose two parties both sent cancel in the ring sum. A mask is the
ChaCha20 keystream under a 32-byte seed, with a stream number as nonce,
read as uint64 values.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from workers.secure_aggregation.fixed_point import RING_DTYPE

SEED_BYTES = 32
MASKING, SEALING = b"mask", b"seal"
_PAIR_INFO = b"dpfleet secure aggregation pair v2 "


def pair_key(private_key: X25519PrivateKey, peer_public_key: bytes, party: int, peer: int, binding: bytes,
             purpose: bytes) -> bytes:
    """The 32-byte key of the pair {party, peer} for `purpose` (MASKING or SEALING) in the round of `binding`;
    both parties derive the same one from their own private key and the other's public key."""
    if party == peer:
        raise ValueError(f"a pair needs two parties (got party {party} twice)")
    if purpose not in (MASKING, SEALING):
        raise ValueError(f"a pair key's purpose is {MASKING!r} or {SEALING!r} (got {purpose!r})")
    shared = private_key.exchange(X25519PublicKey.from_public_bytes(peer_public_key))
    low, high = sorted((party, peer))
    return HKDF(algorithm=hashes.SHA256(), length=SEED_BYTES, salt=binding,
                info=_PAIR_INFO + purpose + low.to_bytes(4, "big") + high.to_bytes(4, "big")).derive(shared)


def expand_mask(seed: bytes, stream: int, size: int) -> np.ndarray:
    """`size` uint64 values of ChaCha20's keystream under `seed`, nonce `stream` (0..2^64 − 1)."""
    if not 0 <= stream < 2**64:
        raise ValueError(f"a stream number must lie in 0..2**64 - 1 (got {stream})")
    # The 16-byte ChaCha20 nonce: the block counter starts at 0 and the stream number fills the last 8 bytes.
    nonce = bytes(8) + stream.to_bytes(8, "little")
    mask = np.zeros(size, dtype=RING_DTYPE)
    # The keystream is the encryption of zeros, written over them in place: no second buffer.
    buffer = memoryview(mask).cast("B")
    Cipher(algorithms.ChaCha20(seed, nonce), mode=None).encryptor().update_into(buffer, buffer)
    return mask


def mask_sign(party: int, peer: int) -> int:
    """+1 when `party` adds the pair's mask (party < peer), -1 when it subtracts it."""
    return 1 if party < peer else -1


def apply_masks(values: np.ndarray, party: int, mask_seeds: Mapping[int, bytes], self_seed: bytes,
                step: int) -> np.ndarray:
    """`values` (uint64, changed in place and returned) plus `party`'s self-mask and its masks of every pair in
    `mask_seeds` (peer → the pair's seed) for step `step`."""
    values += expand_mask(self_seed, step, values.size)
    for peer, seed in mask_seeds.items():
        mask = expand_mask(seed, step, values.size)
        if mask_sign(party, peer) > 0:
            values += mask
        else:
            values -= mask
    return values
