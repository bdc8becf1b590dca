"""Who sent a request: the bearer token of its metadata, checked by the ledger, and a limit on failed tries.

An admin token (the one the server was started with, or one rotated in)
or a tenant token, all kept by the ledger (`Ledger.authenticate`). A
token key id whose authentications keep failing is refused for a while without
a look at its tokens (RateLimited, with a retry hint). Nothing here speaks
gRPC: the servicer hands over the request's metadata.
"""

from __future__ import annotations

import contextlib

from accounting.ledger.callers import Caller
from accounting.ledger.errors import InvalidArgument, RateLimited, Unauthenticated
from accounting.ledger.limits import TokenBuckets
from accounting.ledger.store import Ledger
from accounting.ledger.tokens import admin_key_id

MIN_ADMIN_TOKEN_LENGTH = 16


def bearer_token(metadata: tuple) -> str | None:
    """The token of an `authorization: Bearer <token>` entry, or None."""
    for key, value in metadata or ():
        if key == "authorization":
            scheme, _, token = value.partition(" ")
            if scheme.lower() == "bearer" and token.strip():
                return token.strip()
    return None


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


# The one bucket of the failed authentications whose token names no live key id: such a token can never be right,
# so refusing them hurts no caller, and made-up key ids cannot each start a bucket of their own.
UNKNOWN_KEY_IDS = "tokens of key ids the ledger does not know"


class Authenticator:
    """The caller of each request, from its token, with `auth_failures` counting failed tries per token key id."""

    def __init__(self, ledger: Ledger, auth_failures: TokenBuckets) -> None:
        self._ledger = ledger
        self._auth_failures = auth_failures

    def caller(self, metadata: tuple) -> Caller:
        """Who sent a request with this metadata (see `authenticate`)."""
        token = bearer_token(metadata)
        if token is None:
            raise Unauthenticated(
                "no token: send metadata 'authorization: Bearer <token>' (dpfleet ledger --token or DPFLEET_TOKEN)"
            )
        return self.authenticate(token)

    def authenticate(self, token: str) -> Caller:
        """Who holds `token`, for the gRPC service and the web page alike.

        A live token passes at once, whatever anyone else sent: its check is
        a hash and a lookup in memory, made before any limit. Failures are
        counted by the key id the token names when it is a live one (one
        tenant's or admin token's), else in one bucket for all made-up key
        ids; never by peer address, so a tenant flooding wrong tokens from an
        address it shares with others spends its own allowance, never theirs.
        A key id that used up its failures is refused before a token still
        stored by scrypt is hashed.
        """
        known = self._ledger.verified_caller(token)
        if known is not None:
            return known
        key = f"key id {admin_key_id(token)}" if self._ledger.knows_key_id(token) else UNKNOWN_KEY_IDS
        wait = self._auth_failures.owes(key)
        if wait > 0:
            raise RateLimited(
                f"too many failed authentications with {key}: at most {self._auth_failures.burst:g} at once, "
                f"then {self._auth_failures.rate_per_second:g} a second; retry in {wait:.1f} s with a valid token",
                wait,
            )
        try:
            return self._ledger.authenticate(token)
        except Unauthenticated:
            with contextlib.suppress(RateLimited):
                self._auth_failures.take(key)
            raise
