"""The key of a run's windows of planned batches: what a killed run leaves on disk is ciphertext of fixed size.

A window's files hold sampled rows, so they say who is in which step. Each
is sealed with AES-256-GCM under a key of its own, with a fresh nonce and
the file's identity (run, step, worker) as associated data: a file cannot be
read, altered or passed off as another step's or worker's without the key.

The keys come from the window owner's `WindowKey`, an X25519 private key
made when the windows start, held in that process's memory only: no
readable ``repr``, no pickling, never in a checkpoint or a log. Its owner is
the driver, or a silo's gradient worker for its own windows. The gather that
writes a window is a Ray Data task, and Ray Data puts a map's arguments into
the object store, which spills to disk under memory pressure; so the gather
is given only the public key. It draws an ephemeral key for the window, and
the X25519 secret it shares with the public key (`WindowSeal`) derives each
file's key through HKDF-SHA256; the gather returns only the ephemeral
public key. The owner, holding the private key, derives the same file keys
(`WindowKey.file_key`). A file's key opens that one file only; the driver
hands a gradient worker the keys of its step's files inside the step's call,
a direct actor call whose small arguments Ray carries inline in memory, never
through the object store (a silo's worker derives its own).
"""

from __future__ import annotations

import os

from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

# A window file starts with this, then the nonce, then the ciphertext and its tag.
FILE_MAGIC = b"dpfleet-window-1"
NONCE_BYTES = 12
# What the AEAD adds to a file beyond its plaintext: the header and the tag.
FILE_OVERHEAD = len(FILE_MAGIC) + NONCE_BYTES + 16
_FILE_KEY_INFO = b"dpfleet window file key"


def _identity(run: bytes, step: int, worker: int) -> bytes:
    """The file's identity as bytes: the run (its window public key), the step and the worker."""
    return FILE_MAGIC + run + int(step).to_bytes(8, "big") + int(worker).to_bytes(8, "big")


def _file_key(shared: bytes, ephemeral: bytes, run: bytes, step: int, worker: int) -> bytes:
    """HKDF-SHA256 of the window's shared secret into the 32-byte AES key of the file (run, step, worker)."""
    return HKDF(hashes.SHA256(), 32, salt=ephemeral, info=_FILE_KEY_INFO + _identity(run, step, worker)).derive(shared)


class WindowKey:
    """The window owner's X25519 private key, in memory only: the file keys of every window of the run derive from it.

    ``run`` (its public key) names the run in each file's identity and is
    all a gather needs to seal a window (`WindowSeal`).
    """

    __slots__ = ("_private", "run")

    def __init__(self) -> None:
        self._private = X25519PrivateKey.generate()
        self.run = self._private.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)

    def file_key(self, ephemeral: bytes, step: int, worker: int) -> bytes:
        """The AES key of the file (step, worker) of the window that a gather sealed with public key `ephemeral`."""
        shared = self._private.exchange(X25519PublicKey.from_public_bytes(ephemeral))
        return _file_key(shared, ephemeral, self.run, step, worker)

    def __repr__(self) -> str:
        return "WindowKey(<hidden>)"

    def __reduce__(self):
        raise TypeError("a WindowKey lives in memory only: it is never pickled, saved or sent")


class WindowSeal:
    """A gather's sealing of one window to the run's public key `run`: a fresh ephemeral X25519 key per window.

    ``ephemeral`` is its public key, the one thing the gather hands back;
    the shared secret stays in the gather's memory and goes with it.
    """

    __slots__ = ("_shared", "ephemeral", "run")

    def __init__(self, run: bytes) -> None:
        ephemeral = X25519PrivateKey.generate()
        self._shared = ephemeral.exchange(X25519PublicKey.from_public_bytes(run))
        self.ephemeral = ephemeral.public_key().public_bytes(serialization.Encoding.Raw,
                                                              serialization.PublicFormat.Raw)
        self.run = run

    def seal(self, plaintext: bytes, step: int, worker: int) -> bytes:
        """The file (step, worker): its header, a fresh random nonce, and `plaintext` sealed under its own key."""
        nonce = os.urandom(NONCE_BYTES)
        key = _file_key(self._shared, self.ephemeral, self.run, step, worker)
        return FILE_MAGIC + nonce + AESGCM(key).encrypt(nonce, plaintext, _identity(self.run, step, worker))

    def __repr__(self) -> str:
        return "WindowSeal(<hidden>)"

    def __reduce__(self):
        raise TypeError("a WindowSeal lives in its gather's memory only: it is never pickled, saved or sent")


def open_file(sealed: bytes, key: bytes, run: bytes, step: int, worker: int) -> bytes:
    """The plaintext of window file (step, worker) of run `run`, sealed under `key`.

    Raises ValueError when the file is not a window file, and
    cryptography's InvalidTag when it was altered or is another run's, step's
    or worker's file.
    """
    if not sealed.startswith(FILE_MAGIC):
        raise ValueError(f"not a window file of this format: it must start with {FILE_MAGIC!r}")
    nonce = sealed[len(FILE_MAGIC):len(FILE_MAGIC) + NONCE_BYTES]
    return AESGCM(key).decrypt(nonce, sealed[len(FILE_MAGIC) + NONCE_BYTES:], _identity(run, step, worker))
