"""Who a caller is (tokens) and what it may see and change.

Datasets belong to tenants. A caller names a dataset 'name' within its own
tenant or 'tenant/name'; only admins may use another tenant's prefix. A tenant
asking for another tenant's dataset or reservation, or one that does not
exist, gets the same PermissionDenied by the same reads, so existence is
never revealed, not even by the time taken; an admin gets NotFound for what
does not exist.
"""

from __future__ import annotations

import hmac
import math
import threading
import time
from dataclasses import replace
from typing import NamedTuple

from accounting.ledger.callers import ADMIN, Caller, no_access, no_reservation, resolve_dataset, tenant_caller
from accounting.ledger.databases import Connection
from accounting.ledger.errors import NotFound, PermissionDenied, Unauthenticated
from accounting.ledger.store.datasets import DatasetRow
from accounting.ledger.store.queued_jobs import QueuedRow
from accounting.ledger.store.reservations import ReservationRow
from accounting.ledger.store.tables import Tables
from accounting.ledger.store.tenants import TenantRow, Tenants
from accounting.ledger.store.transactions import Transactions
from accounting.ledger.tokens import admin_key_id, token_digest, token_key_id, token_matches
from accounting.ledger.validation import check_name

# How long a server trusts the tokens it verified without looking at the token generation again: a rotation or
# revocation on any server of the database takes effect on every other within this (plus one read).
TOKEN_RECHECK_SECONDS = 0.5


def acting_caller(caller: Caller | None, default: Caller | None) -> Caller:
    """The caller a request acts for: the one it names, else the one the ledger was opened with."""
    caller = caller or default
    if caller is None:
        raise Unauthenticated("no caller given; open the ledger with a caller or pass one")
    return caller


def require_admin(caller: Caller, refusal: str) -> None:
    """Raise PermissionDenied(`refusal`) unless the caller is the admin."""
    if not caller.admin:
        raise PermissionDenied(refusal)


def job_tenant(caller: Caller, dataset: DatasetRow) -> str:
    """Whose job a reservation is: the tenant's that makes it; an admin's jobs count as the dataset owner's."""
    return dataset.tenant if caller.admin else caller.tenant


def visible_dataset(
    tables: Tables, connection: Connection, caller: Caller, reference: str, shared: bool = False
) -> DatasetRow:
    """The dataset `reference` names; with `shared`, also another tenant's where the caller holds a quota."""
    dataset = resolve_dataset(caller, reference, shared)
    # Another tenant's dataset is read only where the caller holds a quota on it: "not yours" and "none" are the
    # same one read that finds nothing, and the same refusal.
    if not caller.admin and dataset.tenant != caller.tenant and not tables.uses.has_quota_in(
        connection, caller.tenant, dataset.tenant, dataset.name
    ):
        raise no_access(reference)
    row = tables.datasets.named(connection, dataset.tenant, dataset.name)
    if row is None and caller.admin:
        raise NotFound(f"dataset {reference!r} does not exist; create it with dpfleet ledger dataset create")
    if row is None:
        raise no_access(reference)
    return row


def visible_reservation(tables: Tables, connection: Connection, caller: Caller, reservation_id: str) -> ReservationRow:
    """The reservation of `reservation_id`, when it is the caller's job (any for the admin)."""
    check_name("reservation id", reservation_id)
    # A tenant's lookup asks for its own job only, so another's and none are the same empty read and refusal.
    row = tables.reservations.by_id(connection, reservation_id, None if caller.admin else caller.tenant)
    if row is None and caller.admin:
        raise NotFound(f"reservation {reservation_id!r} does not exist (dpfleet ledger jobs lists them)")
    if row is None:
        raise no_reservation(reservation_id)
    return row


def visible_queued_job(tables: Tables, connection: Connection, caller: Caller, queue_id: str) -> QueuedRow:
    """The queued job of `queue_id`, when it is on one of the caller's datasets (any for the admin)."""
    check_name("queued job id", queue_id)
    # As for reservations: another tenant's and none are the same empty read.
    row = tables.queue.by_id(connection, queue_id, None if caller.admin else caller.tenant)
    if row is None and caller.admin:
        raise NotFound(f"queued job {queue_id!r} does not exist (dpfleet ledger jobs --queued lists them)")
    if row is None:
        raise PermissionDenied(
            f"queued job {queue_id!r} is not one of yours, or does not exist (dpfleet ledger jobs --queued)"
        )
    return row


class _KnownTokens(NamedTuple):
    """The tokens that can authenticate, by key id, as last read, and the token generation they were read at."""

    admins: dict[str, bytes]
    tenants: dict[str, TenantRow]
    generation: int | None


class Authenticator:
    """Tells the caller of a token from the live tokens it keeps in memory.

    A token costs one SHA-256 and two dictionary lookups, whoever sends it and
    whatever its key id: no read of the database, so a flood of wrong or made-up
    tokens costs the server next to nothing and never delays a right one. The
    tokens are read again whenever the token generation changed (a creation,
    rotation or revocation on any server of the database), which is looked at
    at most every TOKEN_RECHECK_SECONDS.
    """

    def __init__(self, transactions: Transactions, tenants: Tenants) -> None:
        self._transactions = transactions
        self._tenants = tenants
        self._lock = threading.Lock()
        self._known = _KnownTokens({}, {}, None)
        self._checked_at = -math.inf

    def _live_tokens(self, look_now: bool = False) -> _KnownTokens:
        """The live tokens, read again when the generation changed since the last look.

        Looked at at most every TOKEN_RECHECK_SECONDS, by one thread while
        the others use what it last read; `look_now` looks at once, waiting
        for a look under way.
        """
        if not look_now and time.monotonic() - self._checked_at < TOKEN_RECHECK_SECONDS:
            return self._known
        if not self._lock.acquire(blocking=look_now):
            return self._known
        try:
            if look_now or time.monotonic() - self._checked_at >= TOKEN_RECHECK_SECONDS:
                with self._transactions.read() as connection:
                    generation = self._tenants.generation(connection)
                    if generation != self._known.generation:
                        tenants, admins = self._tenants.live_tokens(connection)
                        self._known = _KnownTokens(dict(admins), {row.key_id: row for row in tenants}, generation)
                self._checked_at = time.monotonic()
            return self._known
        finally:
            self._lock.release()

    def verified_caller(self, token: str) -> Caller | None:
        """The caller of `token` when it is a live token stored by digest, else None (see `authenticate`).

        One SHA-256 and two lookups in memory; at most every
        TOKEN_RECHECK_SECONDS, one read of the token generation, and when it
        changed one read of the live tokens.
        """
        return self._caller_of(self._live_tokens(), token)

    @staticmethod
    def _caller_of(known: _KnownTokens, token: str) -> Caller | None:
        """The caller whose live token, stored by digest, `token` is; else None."""
        digest = token_digest(token)
        key_id = admin_key_id(token)
        admin_digest = known.admins.get(key_id)
        if admin_digest is not None and hmac.compare_digest(digest, admin_digest):
            return replace(ADMIN, key_id=key_id)
        row = known.tenants.get(key_id)
        if row is not None and row.token_salt is None and hmac.compare_digest(digest, row.token_hash):
            return replace(tenant_caller(row.name), key_id=key_id)
        return None

    def knows_key_id(self, token: str) -> bool:
        """Whether the key id `token` names is a live token's: only then can a token of that key id be right."""
        known = self._live_tokens()
        key_id = admin_key_id(token)
        return key_id in known.admins or key_id in known.tenants

    def authenticate(self, token: str) -> Caller:
        """The admin or tenant a token belongs to; raises Unauthenticated for an unknown or revoked token.

        Unlike `verified_caller`, it looks at the token generation first,
        so a token created a moment ago on another server is found: one read,
        which the server's limit on failed authentications bounds. A tenant
        token still stored by scrypt (schema version 6 and before) is checked
        with scrypt once and then stored by digest.
        """
        known = self._live_tokens(look_now=True)  # a token made since the last look, on any server, is found
        caller = self._caller_of(known, token)
        if caller is not None:
            return caller
        row = known.tenants.get(admin_key_id(token))
        if row is None or row.token_salt is None or not token_matches(token, row.token_salt, row.token_hash):
            token_key_id(token)  # one not even of a ledger token's form says so
            raise Unauthenticated(
                "the token is not known to this ledger, or was revoked or rotated; use the token dpfleet ledger "
                "tenant create or dpfleet ledger token rotate printed"
            )
        with self._transactions.change() as connection:
            self._tenants.store_digest(connection, row.key_id, row.token_salt, token_digest(token))
            self.tokens_changed(connection)
        return replace(tenant_caller(row.name), key_id=row.key_id)

    def tokens_changed(self, connection: Connection) -> None:
        """Count a token's creation, rotation or revocation, so every server reads the live tokens again (this
        one at once)."""
        self._tenants.count_token_change(connection)
        self._checked_at = -math.inf
