"""Ledger tokens: a new one, its key id, and the digest and hashes it is stored and checked by."""

from __future__ import annotations

import hashlib
import hmac
import secrets

from accounting.ledger.errors import Unauthenticated

_TOKEN_PREFIX = "dpf"
_SCRYPT = {"n": 2**14, "r": 8, "p": 1, "dklen": 32}


def new_token() -> tuple[str, str]:
    """A fresh tenant token and its key id: (key_id, token). The token is shown once and never stored."""
    key_id = secrets.token_hex(8)
    return key_id, f"{_TOKEN_PREFIX}_{key_id}_{secrets.token_urlsafe(32)}"


def token_key_id(token: str) -> str:
    """The key id a tenant token starts with, used to find its salted hash."""
    prefix, _, rest = token.partition("_")
    key_id, _, secret = rest.partition("_")
    if prefix != _TOKEN_PREFIX or len(key_id) != 16 or not secret:
        raise Unauthenticated(
            "the token is not a dpfleet ledger token; use the token printed by dpfleet ledger tenant create"
        )
    return key_id


def token_digest(token: str) -> bytes:
    """The SHA-256 digest of a token, as stored (schema version 7 on).

    No salt, no slow hash and no server key: a ledger token carries 256
    random bits, so its digest cannot be inverted or looked up in a table,
    and a wrong token costs one fast hash. A key held by every server (HMAC)
    would protect only guessable tokens, and would be one more secret to
    hand out and rotate. Admin tokens given to a server are stored the same
    way, so they must be random too (`check_admin_token`).
    """
    return hashlib.sha256(token.encode()).digest()


def admin_key_id(token: str) -> str:
    """The key id of an admin token: its own for a dpfleet token, else one taken from its digest."""
    try:
        return token_key_id(token)
    except Unauthenticated:
        return "adm" + token_digest(token).hex()[:13]


def hash_token(token: str, salt: bytes) -> bytes:
    """Salted scrypt hash of a token, as stored before schema version 7 (checked once, then replaced)."""
    return hashlib.scrypt(token.encode(), salt=salt, **_SCRYPT)


def token_matches(token: str, salt: bytes, stored_hash: bytes) -> bool:
    """True when `token` hashes to `stored_hash` under `salt` (constant-time comparison)."""
    return hmac.compare_digest(hash_token(token, salt), stored_hash)
