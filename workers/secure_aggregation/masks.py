"""Pairwise masks that cancel in a sum: seeds agreed by X25519, expanded by ChaCha20 (the `cryptography` package).

Parties i and j derive the same 32-byte mask seed, and a second key that
seals what one sends the other through the driver, from their X25519 shared
secret by HKDF-SHA256, bound to the keying round's public context and to the
pair. Party i adds the pair's mask for a step when i < j and subtracts it
when i > j, so the masks of every pair whose two parties both sent cancel in
the ring sum. A step's mask is the ChaCha20 keystream under the pair's seed
with the step as nonce, read as uint64 values: no two steps share a stream.
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
_PAIR_INFO = b"dpfleet secure aggregation pair v1"


def pair_secrets(private_key: X25519PrivateKey, peer_public_key: bytes, party: int, peer: int,
                 context: bytes) -> tuple[bytes, bytes]:
    """The (mask seed, sealing key) of the pair {party, peer}, 32 bytes each; both parties derive the same two."""
    if party == peer:
        raise ValueError(f"a pair needs two parties (got party {party} twice)")
    shared = private_key.exchange(X25519PublicKey.from_public_bytes(peer_public_key))
    low, high = sorted((party, peer))
    material = HKDF(algorithm=hashes.SHA256(), length=2 * SEED_BYTES, salt=context,
                    info=_PAIR_INFO + low.to_bytes(4, "big") + high.to_bytes(4, "big")).derive(shared)
    return material[:SEED_BYTES], material[SEED_BYTES:]


def expand_mask(seed: bytes, step: int, size: int) -> np.ndarray:
    """`size` uint64 values of the pair's mask for step `step`: ChaCha20's keystream under `seed`, nonce `step`."""
    if not 0 <= step < 2**64:
        raise ValueError(f"a step must lie in 0..2**64 - 1 (got {step})")
    # The 16-byte ChaCha20 nonce: the block counter starts at 0 and the step fills the last 8 bytes.
    nonce = bytes(8) + step.to_bytes(8, "little")
    mask = np.zeros(size, dtype=RING_DTYPE)
    # The keystream is the encryption of zeros, written over them in place: no second buffer.
    buffer = memoryview(mask).cast("B")
    Cipher(algorithms.ChaCha20(seed, nonce), mode=None).encryptor().update_into(buffer, buffer)
    return mask


def mask_sign(party: int, peer: int) -> int:
    """+1 when `party` adds the pair's mask (party < peer), -1 when it subtracts it."""
    return 1 if party < peer else -1


def apply_masks(values: np.ndarray, party: int, mask_seeds: Mapping[int, bytes], step: int) -> np.ndarray:
    """`values` (uint64, changed in place and returned) with `party`'s masks of every pair in `mask_seeds` added.

    `mask_seeds` maps each peer to the pair's seed.
    """
    for peer, seed in mask_seeds.items():
        mask = expand_mask(seed, step, values.size)
        if mask_sign(party, peer) > 0:
            values += mask
        else:
            values -= mask
    return values
