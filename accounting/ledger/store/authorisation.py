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

from accounting.ledger.callers import ADMIN, Caller, no_access, no_reservation, resolve_dataset, tenant_caller
from accounting.ledger.databases import Connection
from accounting.ledger.errors import NotFound, PermissionDenied, Unauthenticated
from accounting.ledger.store.datasets import DatasetRow
from accounting.ledger.store.queued_jobs import QueuedRow
from accounting.ledger.store.reservations import ReservationRow
from accounting.ledger.store.tables import Tables
from accounting.ledger.store.tenants import Tenants
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


class Authenticator:
    """Tells the caller of a token, remembering the tokens it verified and checking each again after a rotation
    or revocation."""

    def __init__(self, transactions: Transactions, tenants: Tenants) -> None:
        self._transactions = transactions
        self._tenants = tenants
        self._lock = threading.Lock()
        # By token digest: its caller, and the token generation it was last verified at.
        self._verified_tokens: dict[bytes, tuple[Caller, int | None]] = {}
        self._token_generation: int | None = None
        self._tokens_checked_at = -math.inf

    def verified_caller(self, token: str) -> Caller | None:
        """The caller of a token verified lately, or None (then `authenticate` looks it up).

        Costs one SHA-256 and, at most every TOKEN_RECHECK_SECONDS, one read
        of the token generation. When a rotation or revocation changed it, on
        this server or another of the database, each verified token is looked
        up again (one indexed read) when next used, and forgotten only when its
        own key was rotated or revoked: one tenant's rotation never sends
        another's token back through the failed-authentication limit.
        """
        now = time.monotonic()
        if now - self._tokens_checked_at >= TOKEN_RECHECK_SECONDS:
            with self._transactions.read() as connection:
                generation = self._tenants.generation(connection)
            with self._lock:
                self._token_generation = generation
                self._tokens_checked_at = now
        digest = token_digest(token)
        with self._lock:
            known = self._verified_tokens.get(digest)
            generation = self._token_generation
        if known is None:
            return None
        if known[1] == generation:
            return known[0]
        try:
            caller = self._stored_caller(token, digest)
        except Unauthenticated:
            with self._lock:
                self._verified_tokens.pop(digest, None)
            return None
        with self._lock:
            self._verified_tokens[digest] = (caller, generation)
        return caller

    def authenticate(self, token: str) -> Caller:
        """The admin or tenant a token belongs to; raises Unauthenticated for an unknown or revoked token.

        A token is found by its key id and compared by its SHA-256 digest, so
        a wrong one costs one fast hash and one indexed read. Verified tokens
        are remembered (by digest; see `verified_caller`). A tenant token
        stored by scrypt (schema version 6 and before) is checked with scrypt
        once and then stored by digest.
        """
        known = self.verified_caller(token)
        if known is not None:
            return known
        digest = token_digest(token)
        generation = self._token_generation
        caller = self._stored_caller(token, digest)
        with self._lock:
            self._verified_tokens[digest] = (caller, generation)
        return caller

    def _stored_caller(self, token: str, digest: bytes) -> Caller:
        """The admin or tenant whose stored token `token` is; raises Unauthenticated for none."""
        caller = self._admin_caller(token, digest)
        return caller if caller is not None else self._tenant_caller(token, digest)

    def _admin_caller(self, token: str, digest: bytes) -> Caller | None:
        """The admin, when `token` is an admin token the ledger keeps and has not revoked; else None."""
        key_id = admin_key_id(token)
        with self._transactions.read() as connection:
            stored = self._tenants.admin_token_digest(connection, key_id)
        if stored is None or not hmac.compare_digest(digest, stored):
            return None
        return replace(ADMIN, key_id=key_id)

    def _tenant_caller(self, token: str, digest: bytes) -> Caller:
        """The tenant whose token `token` is; raises Unauthenticated for none."""
        key_id = token_key_id(token)
        with self._transactions.read() as connection:
            row = self._tenants.by_key_id(connection, key_id)
        if row is None or not (
            hmac.compare_digest(digest, row.token_hash) if row.token_salt is None
            else token_matches(token, row.token_salt, row.token_hash)
        ):
            raise Unauthenticated(
                "the token is not known to this ledger, or was revoked or rotated; use the token dpfleet ledger "
                "tenant create or dpfleet ledger token rotate printed"
            )
        if row.token_salt is not None:
            with self._transactions.change() as connection:
                self._tenants.store_digest(connection, key_id, row.token_salt, digest)
        return replace(tenant_caller(row.name), key_id=key_id)

    def tokens_changed(self, connection: Connection) -> None:
        """Count a rotation or revocation, so every server forgets the tokens it verified (this one at once)."""
        self._tenants.count_token_change(connection)
        self._tokens_checked_at = -math.inf
