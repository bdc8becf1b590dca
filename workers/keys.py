"""The secret key that a process's sampling and noise derive from, held in memory only.

The ε of DP-SGD rests on two secrets: each step's noise vector, and which
examples each step sampled (amplification by subsampling). Both derive from
one 256-bit key per process (the driver's, or a silo worker's own) through a
keyed BLAKE2b, a pseudorandom function: every generator is
PRF(key, purpose, numbers...) for a purpose ("noise", "sample", ...) and
numbers such as the step. So a step can be drawn again bit for bit while the
process lives (after a worker's death), and nothing that does not hold the key
can recompute it. The key never leaves memory: it has no readable ``repr``,
refuses to be pickled, and nothing writes it to a checkpoint, a log or a
metric. A resumed run draws a new key.

A seed (tests only) makes the key a public function of the seed, so a seeded
run is reproducible and, for that reason, not private.
"""

from __future__ import annotations

import hashlib
import secrets

import numpy as np

KEY_BYTES = 32
# Domain separation: a seed's key is never the PRF output of some other key.
_SEED_PERSON = b"dpfleet-seed"
_DERIVE_PERSON = b"dpfleet-derive"

# What a derived value is for: one purpose never shares a stream with another.
NOISE = "noise"
SAMPLE = "sample"
LOCAL_SAMPLE = "local sample"
SLICE_NOISE = "slice noise"
DRIVER = "driver"
ORDER = "order"


def _encode(purpose: str, numbers: tuple[int, ...]) -> bytes:
    """An unambiguous byte string for (purpose, numbers): length-prefixed text, then 8 bytes per number."""
    label = purpose.encode()
    if len(label) > 255:
        raise ValueError(f"a purpose is at most 255 bytes (got {len(label)})")
    for number in numbers:
        if not 0 <= number < 2**64:
            raise ValueError(f"derivation numbers must lie in 0..2**64 - 1 (got {number})")
    return bytes([len(label)]) + label + b"".join(int(number).to_bytes(8, "big") for number in numbers)


class SecretKey:
    """A 256-bit key and the generators it derives; ``seeded`` when it comes from a test seed.

    Build one with `fresh` (OS entropy: production) or `from_seed` (tests).
    """

    __slots__ = ("_material", "seeded")

    def __init__(self, material: bytes, seeded: bool = False) -> None:
        if len(material) != KEY_BYTES:
            raise ValueError(f"a key is {KEY_BYTES} bytes (got {len(material)})")
        self._material = bytes(material)
        self.seeded = seeded

    @classmethod
    def fresh(cls) -> SecretKey:
        """A new key from the operating system's entropy (``secrets``)."""
        return cls(secrets.token_bytes(KEY_BYTES))

    @classmethod
    def from_seed(cls, seed: int, purpose: str = DRIVER, *numbers: int) -> SecretKey:
        """The key a test seed gives for `purpose` and `numbers`: public, reproducible, not private."""
        digest = hashlib.blake2b(_encode(purpose, (int(seed) % 2**64, *numbers)), digest_size=KEY_BYTES,
                                 person=_SEED_PERSON)
        return cls(digest.digest(), seeded=True)

    def derive(self, purpose: str, *numbers: int) -> bytes:
        """PRF(key, purpose, numbers): 32 bytes that only the key's holder can compute."""
        return hashlib.blake2b(_encode(purpose, numbers), key=self._material, digest_size=KEY_BYTES,
                               person=_DERIVE_PERSON).digest()

    def numpy_generator(self, purpose: str, *numbers: int) -> np.random.Generator:
        """A numpy PCG64 generator seeded with the 256 derived bits of (purpose, numbers)."""
        return np.random.Generator(np.random.PCG64(np.random.SeedSequence(
            int.from_bytes(self.derive(purpose, *numbers), "little"))))

    def torch_seed(self, purpose: str, *numbers: int) -> int:
        """A 63-bit seed for a torch generator, derived from (purpose, numbers)."""
        return int.from_bytes(self.derive(purpose, *numbers)[:8], "little") >> 1

    def __repr__(self) -> str:
        return f"SecretKey(<hidden>, seeded={self.seeded})"

    def __reduce__(self):
        raise TypeError("a SecretKey lives in memory only: it is never pickled, saved or sent")


def process_key(seed: int | None, purpose: str = DRIVER, *numbers: int) -> SecretKey:
    """A process's key: fresh from the OS unless `seed` (tests only) is given, then derived from it."""
    return SecretKey.fresh() if seed is None else SecretKey.from_seed(seed, purpose, *numbers)
