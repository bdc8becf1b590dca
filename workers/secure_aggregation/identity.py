"""Silos' long-term Ed25519 identities: the registry of public keys, and the signatures that bind round keys.

A silo's identity is declared with its shard (`identity`: the 32-byte public
key as 64 hex digits, or the path of a file holding them, read where the
config is read), and its private key lives on the silo's node only
(`identity_key_file`: a PEM or raw 32-byte Ed25519 private key, read by the
silo's worker). Every silo signs its round keys with it, and checks the
others' signatures against the registry before deriving anything from their
keys. A node may pin the registry it accepts: `REGISTRY_PIN_VARIABLE` set to
`registry_digest` of it, which the run prints at start.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

PUBLIC_KEY_BYTES = 32
REGISTRY_PIN_VARIABLE = "DPFLEET_SILO_REGISTRY_SHA256"


def parse_identity(text: str) -> bytes:
    """The 32-byte Ed25519 public key that `text` gives: 64 hex digits, or a file holding them."""
    candidate = text.strip()
    if len(candidate) != 2 * PUBLIC_KEY_BYTES or any(char not in "0123456789abcdefABCDEF" for char in candidate):
        path = Path(candidate).expanduser()
        if not path.is_file():
            raise ValueError(f"a silo identity is its Ed25519 public key as {2 * PUBLIC_KEY_BYTES} hex digits or "
                             f"the path of a file holding them (got {text!r}, neither); make one with "
                             "`python -m workers.secure_aggregation.identity KEY_FILE`")
        candidate = path.read_text().strip()
    try:
        key = bytes.fromhex(candidate)
        Ed25519PublicKey.from_public_bytes(key)
    except ValueError:
        raise ValueError(f"a silo identity must be an Ed25519 public key of {PUBLIC_KEY_BYTES} bytes in hex "
                         f"(got {candidate[:80]!r})") from None
    return key


def load_identity_key(path: str) -> Ed25519PrivateKey:
    """The silo's Ed25519 private key from `path` on its node: PEM (PKCS#8) or the raw 32 bytes."""
    data = Path(path).expanduser().read_bytes()
    if len(data) == 32:
        return Ed25519PrivateKey.from_private_bytes(data)
    key = serialization.load_pem_private_key(data, password=None)
    if not isinstance(key, Ed25519PrivateKey):
        raise ValueError(f"{path} holds a {type(key).__name__}, not an Ed25519 private key")
    return key


def public_identity(private_key: Ed25519PrivateKey) -> bytes:
    """The 32 raw bytes of `private_key`'s public key."""
    return private_key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def registry_digest(registry: Sequence[bytes]) -> str:
    """The SHA-256 (hex) of the silos' public keys in silo order: what a node pins and the run prints."""
    return hashlib.sha256(b"".join(registry)).hexdigest()


def check_registry(registry: Sequence[bytes], party: int, own_key: Ed25519PrivateKey) -> None:
    """Refuse a registry whose entry for `party` is not this silo's own key, or that the node's pin refuses."""
    if registry[party] != public_identity(own_key):
        raise ValueError(f"the registry's identity of silo {party} is not the one whose private key this node "
                         "holds: the config's `identity` and this node's `identity_key_file` must be one pair")
    pinned = os.environ.get(REGISTRY_PIN_VARIABLE)
    if pinned and pinned.strip().lower() != registry_digest(registry):
        raise ValueError(f"the silos' identity registry (sha256 {registry_digest(registry)}) is not the one this "
                         f"node pins in {REGISTRY_PIN_VARIABLE} ({pinned.strip()}): the config's identities were "
                         "changed; check them with every silo before the run")


def verify(public_key: bytes, signature: bytes, message: bytes) -> bool:
    """Whether `signature` is `public_key`'s Ed25519 signature of `message`."""
    try:
        Ed25519PublicKey.from_public_bytes(public_key).verify(signature, message)
    except (InvalidSignature, ValueError):
        return False
    return True


def main(argv: Sequence[str] | None = None) -> int:
    """Write a new Ed25519 private key (PEM, mode 0600) to the path given, and print its public key in hex."""
    import argparse
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("key_file", help="where the silo's node keeps its private key (refused if it exists)")
    arguments = parser.parse_args(argv)
    key = Ed25519PrivateKey.generate()
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                            serialization.NoEncryption())
    descriptor = os.open(arguments.key_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(descriptor, "wb") as handle:
        handle.write(pem)
    print(public_identity(key).hex())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
