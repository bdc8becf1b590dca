"""Who sent a request: the bearer token of its metadata, checked by the ledger, and a limit on a peer's failures.

An admin token (the one the server was started with, or one rotated in)
or a tenant token, all kept by the ledger (`Ledger.authenticate`). A peer
address whose authentications keep failing is refused for a while without a
look at its tokens (RateLimited, with a retry hint). Nothing here speaks
gRPC: the servicer hands over the request's metadata and peer.
"""

from __future__ import annotations

import contextlib

from accounting.ledger.callers import Caller
from accounting.ledger.errors import InvalidArgument, RateLimited, Unauthenticated
from accounting.ledger.limits import TokenBuckets
from accounting.ledger.store import Ledger

MIN_ADMIN_TOKEN_LENGTH = 16


def bearer_token(metadata: tuple) -> str | None:
    """The token of an `authorization: Bearer <token>` entry, or None."""
    for key, value in metadata or ():
        if key == "authorization":
            scheme, _, token = value.partition(" ")
            if scheme.lower() == "bearer" and token.strip():
                return token.strip()
    return None


def peer_address(peer: str) -> str:
    """The address of a gRPC peer ("ipv4:127.0.0.1:5000" -> "127.0.0.1"), without its port."""
    kind, _, rest = peer.partition(":")
    if kind == "ipv6":
        return rest.rpartition("]")[0].lstrip("[") or rest
    if kind == "ipv4":
        return rest.rpartition(":")[0] or rest
    return peer


def check_admin_token(admin_token: str | None) -> str | None:
    """The admin token, refused when too short to resist guessing.

    The ledger keeps it as its SHA-256 digest (tokens.token_digest), which
    protects a random token only: make it with secrets, as the error says.
    """
    if admin_token is not None and len(admin_token) < MIN_ADMIN_TOKEN_LENGTH:
        raise InvalidArgument(
            f"the admin token must be at least {MIN_ADMIN_TOKEN_LENGTH} characters (got {len(admin_token)}); "
            "make one with: python -c 'import secrets; print(secrets.token_urlsafe(32))'"
        )
    return admin_token


class Authenticator:
    """The caller of each request, from its token, with `auth_failures` counting each peer's failed tries."""

    def __init__(self, ledger: Ledger, auth_failures: TokenBuckets) -> None:
        self._ledger = ledger
        self._auth_failures = auth_failures

    def caller(self, metadata: tuple, peer: str) -> Caller:
        """Who sent a request with this metadata from this gRPC peer.

        A token verified lately passes at once. Otherwise a peer that has
        used up its failed authentications is refused before its token is
        looked at, and each failure is counted against it.
        """
        token = bearer_token(metadata)
        if token is not None:
            known = self._ledger.verified_caller(token)
            if known is not None:
                return known
        address = peer_address(peer)
        wait = self._auth_failures.owes(address)
        if wait > 0:
            raise RateLimited(
                f"too many failed authentications from {address}: at most {self._auth_failures.burst:g} at once, "
                f"then {self._auth_failures.rate_per_second:g} a second; retry in {wait:.1f} s with a valid token",
                wait,
            )
        try:
            if token is None:
                raise Unauthenticated(
                    "no token: send metadata 'authorization: Bearer <token>' (dpfleet ledger --token or DPFLEET_TOKEN)"
                )
            return self._ledger.authenticate(token)
        except Unauthenticated:
            with contextlib.suppress(RateLimited):
                self._auth_failures.take(address)
            raise
