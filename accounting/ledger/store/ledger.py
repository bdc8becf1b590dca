"""The ledger's SQLite store and `Ledger`, the embedded ledger (store + core).

Durability: WAL journal with synchronous=FULL, so a change is on disk when
its transaction returns; every state change is one BEGIN IMMEDIATE
transaction, which also serialises writers across processes sharing the file.
Reads run on a pool of connections of their own, beside writes and beside
each other.
Each change appends a row to `history` (who, when, what, JSON details); the
table refuses UPDATE, DELETE (and on PostgreSQL TRUNCATE), and each row
carries an HMAC under the history key over the row and the hash of the one
before it (core.history_hash), so `verify` finds a row edited or removed by
hand, and nobody without the key can rewrite the chain to hide it. The key is
a file the ledger reads when it opens (`load_history_key`), never the
database. `head` signs the chain's head with the same key; `verify` with a
head kept elsewhere finds a tail cut off together with the rows it changed.

Datasets belong to tenants. A caller names a dataset 'name' within its own
tenant or 'tenant/name'; only admins may use another tenant's prefix. A tenant
asking for another tenant's dataset or reservation, or one that does not
exist, gets the same PermissionDenied, so existence is never revealed; an
admin gets NotFound for what does not exist.

Each dataset row carries its admission rule (core.AdmissionRule), its
committed events in canonical form (one record per mechanism) and the exact
RDP tally (see core.RdpTally) of committed + reserved-unrun steps, so
admission and status never read the history; a commit only rewrites the
committed events, which the figures of what is spent are computed from.

A reservation may carry a lease: it expires `lease_seconds` after the
reserve or its last commit. Every reserve and release on its dataset, a
commit to it, and `expire_leases` (which a server runs every second) first
release the unrun steps of the reservations whose lease ran out. A commit to an expired
reservation is refused, so a driver that lost its lease cannot charge steps
the ledger already freed.
"""

from __future__ import annotations

import hmac
import json
import math
import os
import secrets
import threading
import time
from dataclasses import replace
from datetime import datetime
from pathlib import Path
from typing import NamedTuple

from accounting.events import Composition, EventsLike
from accounting.ledger.core import (
    ACTIVE,
    ADMITTED,
    CANCELLED,
    EXAMPLE,
    LEASE_EXPIRY,
    LOCAL_TENANT,
    QUEUE_ADMISSION,
    QUEUE_TIMEOUT,
    QUEUED,
    RELEASED,
    TIMED_OUT,
    ADMIN,
    AdmissionRule,
    AlreadyExists,
    BudgetExceeded,
    BlockStatus,
    BudgetCheck,
    Caller,
    CommitResult,
    DatasetRef,
    DatasetStatus,
    FailedPrecondition,
    FitReport,
    HistoryEntry,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    QueuedJob,
    QuotaStatus,
    RdpTally,
    Reservation,
    SignedHead,
    StoredCommit,
    StoredDataset,
    StoredEntry,
    StoredReservation,
    StoredTenant,
    StoredTenantUse,
    TenantCreated,
    Unauthenticated,
    Verification,
    admin_key_id,
    assess_admission,
    block_data_overlap,
    budget_figures,
    canonical,
    charged_plan,
    check_block_data,
    check_block_names,
    check_budget_epsilon,
    check_delta,
    check_history_limit,
    check_lease_seconds,
    check_max_wait_seconds,
    check_privacy_unit,
    check_rows_per_person,
    check_name,
    check_new_budget,
    check_plan,
    check_priority,
    check_queue_state,
    check_scheduling,
    check_sequence,
    check_state,
    check_steps,
    display_name,
    fits_budget,
    history_hash,
    new_token,
    no_access,
    no_reservation,
    quota_status,
    resolve_dataset,
    sign_head,
    split_steps,
    tenant_caller,
    stored_token_digest,
    token_digest,
    token_key_id,
    token_matches,
    uncached_mechanisms,
    verify_history,
)
from accounting.ledger.databases import Connection, open_database
from accounting.ledger.limits import TokenBuckets
from accounting.ledger.scheduling import BlockBudget, QueuedDemand, SchedulingPolicy, schedule
from accounting.ledger.store.clock import expiry, now
from accounting.ledger.store.history import HISTORY_COLUMNS, HistoryChain
from accounting.ledger.store.local import default_history_key_path, default_ledger_path, load_history_key, local_user
from accounting.ledger.store.schema import create_or_check_schema
from accounting.ledger.store.transactions import Transactions, curves_outside_lock
_DATASET_COLUMNS = (
    "id, tenant, name, budget_epsilon, delta, held_rdp, committed_events, released_jobs, admission_rule, privacy_unit, "
    "block_of, block, scheduling, arrived_jobs, created_at, block_data"
)
_RESERVATION_COLUMNS = (
    "r.id, d.tenant, d.name, r.job_id, r.state, r.planned_events, r.committed_steps, r.created_at, r.released_at, "
    "r.lease_seconds, r.expires_at, r.lease_expired, r.tenant, r.blocks"
)
# Where a reservation row, as _RESERVATION_COLUMNS selects it, holds the tenant that made it; a row selected
# with ", r.dataset_id" after them holds the dataset's id next.
_JOB_TENANT = 12
_JOB_DATASET_ID = 14
_QUEUE_COLUMNS = (
    "q.id, d.tenant, d.name, q.job_id, q.state, q.planned_events, q.priority, q.created_at, q.deadline, q.position, "
    "q.reason, q.reservation_id, q.ended_at, q.lease_seconds"
)


class _DatasetRow(NamedTuple):
    """A row of `datasets` as _DATASET_COLUMNS selects it."""

    dataset_id: int
    tenant: str
    name: str
    budget_epsilon: float
    delta: float
    held_rdp: str
    committed_events: str
    released_jobs: int
    admission_rule: str
    privacy_unit: str
    block_of: int | None
    block: str | None
    scheduling: str
    arrived_jobs: int
    created_at: str
    block_data: str | None


# How long a server trusts the tokens it verified without looking at the token generation again: a rotation or
# revocation on any server of the database takes effect on every other within this (plus one read).
TOKEN_RECHECK_SECONDS = 0.5


def _conversion(planned: Composition, job_events: Composition, rows_per_person: int | None) -> dict:
    """What a `reserve` history entry records of a job's own events when the ledger charged it others."""
    if planned == job_events:
        return {}
    return {"job_events": job_events.to_dict(), "rows_per_person": rows_per_person}


def _rule(row: _DatasetRow) -> AdmissionRule:
    return AdmissionRule.from_dict(json.loads(row.admission_rule))


def _budget_fields(budget: _DatasetRow, pld_may_be_pending: bool) -> dict:
    """A dataset's or block's budget, rule and figures, as the fields its status shares with the other's."""
    rule = _rule(budget)
    figures = budget_figures(
        budget.budget_epsilon, rule, Composition.from_json(budget.committed_events),
        RdpTally.from_json(budget.held_rdp), pld_may_be_pending,
    )
    return {
        "budget_epsilon": budget.budget_epsilon,
        "delta": budget.delta,
        "admission": rule,
        "spent_epsilon": figures.spent_epsilon,
        "spent_epsilon_rdp": figures.spent_epsilon_rdp,
        "spent_epsilon_filter": figures.spent_epsilon_filter,
        "reserved_epsilon": figures.reserved_epsilon,
        "remaining_epsilon": figures.remaining_epsilon,
        "spent_epsilon_accountant": figures.spent_epsilon_accountant,
    }


def _budget_label(reference: str, budget: _DatasetRow) -> str:
    """A budget in words, for refusals: the dataset's, or one block's."""
    return f"dataset {reference!r}" if budget.block is None else f"block {budget.block!r} of dataset {reference!r}"


def _blocks_detail(blocks: tuple[str, ...]) -> dict:
    """The history detail naming the blocks a job is charged to (none for a job on the dataset itself)."""
    return {"blocks": list(blocks)} if blocks else {}


def _job_tenant(caller: Caller, dataset: _DatasetRow) -> str:
    """Whose job a reservation is: the tenant's that makes it; an admin's jobs count as the dataset owner's."""
    return dataset.tenant if caller.admin else caller.tenant


class Ledger:
    """The privacy ledger on an SQLite file or a PostgreSQL database: the embedded ledger, and what a server serves.

    `path` is the SQLite file, or a postgresql:// URL; `scheduling` the
    policy of queued jobs for datasets created without one (fcfs by
    default); `history_key_file` the history key (`load_history_key`;
    default `default_history_key_path()`). Every method takes
    the `caller` it acts for; it defaults to the caller the ledger was
    opened with (the local admin for `open_embedded_ledger`). Safe to share
    between threads; several processes (servers) may open the same file or
    database.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        caller: Caller | None = None,
        scheduling: SchedulingPolicy | None = None,
        history_key_file: str | os.PathLike | None = None,
    ) -> None:
        history_key = load_history_key(history_key_file)
        self._database = open_database(path)
        self._history = HistoryChain(
            history_key, history_key_file or default_history_key_path(), self._database.location
        )
        self._default_scheduling = scheduling or SchedulingPolicy()
        self.path = Path(path) if self._database.is_file else str(path)
        self._default_caller = caller
        self._transactions = Transactions(self._database)
        self._tokens_lock = threading.Lock()
        self._verified_tokens: dict[bytes, Caller] = {}
        self._token_generation: int | None = None
        self._tokens_checked_at = -math.inf
        # Set by a server: the buckets of tenants' costly requests (see `_charge_curves`); None charges nothing.
        self.curve_limits: TokenBuckets | None = None
        try:
            create_or_check_schema(self._transactions, self._database, self._history, self._default_caller)
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> "Ledger":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the store; a read in progress finishes first on its own connection, which closes after it."""
        self._transactions.close()

    def _caller(self, caller: Caller | None) -> Caller:
        caller = caller or self._default_caller
        if caller is None:
            raise Unauthenticated("no caller given; open the ledger with a caller or pass one")
        return caller

    @staticmethod
    def _dataset_row(connection: Connection, caller: Caller, reference: str, shared: bool = False) -> _DatasetRow:
        """The dataset `reference` names; with `shared`, also another tenant's where the caller holds a quota."""
        dataset = resolve_dataset(caller, reference, shared)
        row = connection.execute(
            f"SELECT {_DATASET_COLUMNS} FROM datasets WHERE tenant = ? AND name = ? AND block_of IS NULL",
            (dataset.tenant, dataset.name),
        ).fetchone()
        if row is None:
            if caller.admin:
                raise NotFound(f"dataset {reference!r} does not exist; create it with dpfleet ledger dataset create")
            raise no_access(reference)
        row = _DatasetRow(*row)
        if not caller.admin and row.tenant != caller.tenant and not connection.execute(
            "SELECT 1 FROM tenant_use u JOIN datasets d ON d.id = u.budget_id "
            "WHERE u.tenant = ? AND u.quota_epsilon IS NOT NULL AND (d.id = ? OR d.block_of = ?) LIMIT 1",
            (caller.tenant, row.dataset_id, row.dataset_id),
        ).fetchone():
            raise no_access(reference)
        return row

    @staticmethod
    def _budget_rows(connection: Connection, dataset: _DatasetRow, blocks: tuple[str, ...], reference: str,
                     new_job: bool = False) -> list[_DatasetRow]:
        """The budgets a job on `blocks` of `dataset` is charged to: each block's, or the dataset's own for ().

        A `new_job` on a dataset made of blocks must name them; a job
        reserved before the dataset had blocks stays on its own budget.
        """
        rows = [
            _DatasetRow(*row) for row in connection.execute(
                f"SELECT {_DATASET_COLUMNS} FROM datasets WHERE block_of = ? ORDER BY block", (dataset.dataset_id,)
            ).fetchall()
        ]
        if not blocks:
            if rows and new_job:
                raise FailedPrecondition(
                    f"dataset {reference!r} is made of blocks ({', '.join(row.block for row in rows)}); a job names "
                    "the blocks it trains on (the config's blocks = [...], or a range of them)"
                )
            return [dataset]
        by_name = {row.block: row for row in rows}
        missing = [block for block in blocks if block not in by_name]
        if missing:
            raise NotFound(
                f"dataset {reference!r} has no block {', '.join(map(repr, missing))}; its blocks are "
                f"{', '.join(by_name) or 'none'} (dpfleet ledger block add creates one)"
            )
        undeclared = [block for block in blocks if by_name[block].block_data is None]
        if undeclared and new_job:
            raise FailedPrecondition(
                f"block {', '.join(map(repr, undeclared))} of dataset {reference!r} was added before blocks declared "
                "where their rows are, so nothing shows it owns them alone: it takes no new job. Train on blocks "
                "that declare their data (dpfleet ledger block add ... --files/--rows/--partition/--user-hash/"
                "--user-range)"
            )
        return [by_name[block] for block in blocks]

    @staticmethod
    def _use(connection: Connection, budget_id: int, tenant: str) -> tuple[RdpTally, Composition]:
        """A tenant's tally of committed and reserved steps on a budget, and its committed events."""
        row = connection.execute(
            "SELECT held_rdp, committed_events FROM tenant_use WHERE budget_id = ? AND tenant = ?", (budget_id, tenant)
        ).fetchone()
        if row is None:
            return RdpTally.zero(), Composition()
        return RdpTally.from_json(row[0]), Composition.from_json(row[1])

    @staticmethod
    def _set_use(connection: Connection, budget_id: int, tenant: str, held: RdpTally, committed: Composition) -> None:
        connection.execute(
            "INSERT INTO tenant_use (budget_id, tenant, held_rdp, committed_events) VALUES (?, ?, ?, ?) "
            "ON CONFLICT (budget_id, tenant) DO UPDATE SET held_rdp = excluded.held_rdp, "
            "committed_events = excluded.committed_events",
            (budget_id, tenant, held.to_json(), canonical(committed).to_json()),
        )

    @staticmethod
    def _quota(connection: Connection, budget: _DatasetRow, tenant: str) -> tuple[float, AdmissionRule] | None:
        """The tenant's quota on a budget: its own, else (for a block) the one set on its dataset; None if none."""
        for budget_id in (budget.dataset_id, budget.block_of):
            if budget_id is None:
                continue
            row = connection.execute(
                "SELECT quota_epsilon, quota_rule FROM tenant_use WHERE budget_id = ? AND tenant = ? "
                "AND quota_epsilon IS NOT NULL",
                (budget_id, tenant),
            ).fetchone()
            if row is not None:
                return row[0], AdmissionRule.from_dict(json.loads(row[1]))
        return None

    def _admission_checks(
        self, connection: Connection, tenant: str, dataset: _DatasetRow, budgets: list[_DatasetRow],
        planned: RdpTally, reference: str, committed: bool = False,
    ) -> tuple[list[BudgetCheck], list[BudgetCheck]]:
        """Every filter a job of `tenant` must pass: each budget's (in order), and the tenant's quotas where set.

        Against what is committed and reserved, or with `committed`, against
        what is committed only (a commit's check). Another tenant than the
        owner needs a quota on each budget it is charged to.
        """
        checks, quota_checks = [], []
        for budget in budgets:
            label = _budget_label(reference, budget)
            if committed:
                held = RdpTally.of(Composition.from_json(budget.committed_events))
            else:
                (held,) = connection.execute(
                    "SELECT held_rdp FROM datasets WHERE id = ?", (budget.dataset_id,)
                ).fetchone()
                held = RdpTally.from_json(held)
            checks.append(assess_admission(label, _rule(budget), budget.budget_epsilon, held, planned))
            quota = self._quota(connection, budget, tenant)
            if quota is None:
                if tenant != dataset.tenant:
                    raise PermissionDenied(
                        f"tenant {tenant!r} has no quota on {label}; an admin gives one with dpfleet ledger quota set"
                    )
                continue
            use_held, use_committed = self._use(connection, budget.dataset_id, tenant)
            quota_checks.append(
                assess_admission(
                    f"tenant {tenant!r}'s quota on {label}", quota[1], quota[0],
                    RdpTally.of(use_committed) if committed else use_held, planned,
                )
            )
        return checks, quota_checks

    @staticmethod
    def _reservation_row(connection: Connection, caller: Caller, reservation_id: str) -> tuple:
        check_name("reservation id", reservation_id)
        row = connection.execute(
            f"SELECT {_RESERVATION_COLUMNS}, r.dataset_id FROM reservations r "
            "JOIN datasets d ON d.id = r.dataset_id WHERE r.id = ?",
            (reservation_id,),
        ).fetchone()
        if row is None and caller.admin:
            raise NotFound(f"reservation {reservation_id!r} does not exist (dpfleet ledger jobs lists them)")
        if row is None or not (caller.admin or row[_JOB_TENANT] == caller.tenant):
            raise no_reservation(reservation_id)
        return row

    @staticmethod
    def _reservation(caller: Caller, row: tuple) -> Reservation:
        (
            reservation_id, tenant, name, job_id, state, planned, committed, created_at, released_at,
            lease_seconds, expires_at, lease_expired, _, blocks,
        ) = row[:14]
        return Reservation(
            reservation_id=reservation_id,
            dataset=display_name(caller, DatasetRef(tenant, name)),
            job_id=job_id,
            state=state,
            planned=Composition.from_json(planned),
            committed_steps=committed,
            created_at=created_at,
            released_at=released_at,
            lease_seconds=lease_seconds,
            expires_at=expires_at,
            lease_expired=bool(lease_expired),
            blocks=tuple(json.loads(blocks)),
        )

    def _status_rows(self, connection: Connection, caller: Caller, row: _DatasetRow) -> tuple:
        """What a status needs from the file: read inside a transaction, computed on outside it.

        A tenant sees its own jobs and quotas only; an admin every tenant's.
        """
        mine, parameters = ("", ()) if caller.admin else ("AND r.tenant = ?", (caller.tenant,))
        jobs = connection.execute(
            f"SELECT {_RESERVATION_COLUMNS} FROM reservations r JOIN datasets d ON d.id = r.dataset_id "
            f"WHERE r.dataset_id = ? AND r.state = ? {mine} ORDER BY r.{self._database.insertion_order}",
            (row.dataset_id, ACTIVE, *parameters),
        ).fetchall()
        blocks = [
            _DatasetRow(*block) for block in connection.execute(
                f"SELECT {_DATASET_COLUMNS} FROM datasets WHERE block_of = ? ORDER BY block", (row.dataset_id,)
            ).fetchall()
        ]
        mine, parameters = ("", ()) if caller.admin else ("AND u.tenant = ?", (caller.tenant,))
        uses = connection.execute(
            "SELECT u.budget_id, u.tenant, u.quota_epsilon, u.quota_rule, u.held_rdp, u.committed_events "
            f"FROM tenant_use u JOIN datasets d ON d.id = u.budget_id WHERE (d.id = ? OR d.block_of = ?) {mine} "
            "ORDER BY u.tenant, u.budget_id",
            (row.dataset_id, row.dataset_id, *parameters),
        ).fetchall()
        (queued,) = connection.execute(
            "SELECT COUNT(*) FROM queued_jobs WHERE dataset_id = ? AND state = ?", (row.dataset_id, QUEUED)
        ).fetchone()
        return row, jobs, blocks, uses, queued

    @staticmethod
    def _quota_statuses(row: _DatasetRow, blocks: list[_DatasetRow], uses: list[tuple]) -> tuple[QuotaStatus, ...]:
        """Each tenant's quota on the dataset and on each block; a quota set on the dataset stands in for a
        block that has none of its own."""
        by_budget = {(budget_id, tenant): tuple(use) for budget_id, tenant, *use in uses}
        statuses = []
        for tenant in sorted({use[1] for use in uses}):
            dataset_quota = by_budget.get((row.dataset_id, tenant))
            for budget in [row, *blocks]:
                quota_epsilon, quota_rule, held, committed = by_budget.get(
                    (budget.dataset_id, tenant), (None, None, RdpTally.zero().to_json(), Composition().to_json())
                )
                inherited = quota_epsilon is None and budget is not row and dataset_quota is not None
                if inherited:
                    quota_epsilon, quota_rule = dataset_quota[0], dataset_quota[1]
                if quota_epsilon is None:
                    continue
                statuses.append(
                    quota_status(
                        tenant, budget.block, quota_epsilon, AdmissionRule.from_dict(json.loads(quota_rule)),
                        Composition.from_json(committed), RdpTally.from_json(held), inherited,
                    )
                )
        return tuple(statuses)

    def _status(self, caller: Caller, rows: tuple, pld_may_be_pending: bool = False) -> DatasetStatus:
        # The PLD epsilon can take a second when the committed events changed; no lock is held here.
        row, jobs, blocks, uses, queued = rows
        return DatasetStatus(
            name=display_name(caller, DatasetRef(row.tenant, row.name)),
            tenant=row.tenant,
            **_budget_fields(row, pld_may_be_pending),
            jobs=tuple(self._reservation(caller, job) for job in jobs),
            released_jobs=row.released_jobs,
            blocks=tuple(
                BlockStatus(name=block.block, **_budget_fields(block, pld_may_be_pending),
                            data=json.loads(block.block_data) if block.block_data else None)
                for block in blocks
            ),
            quotas=self._quota_statuses(row, blocks, uses),
            privacy_unit=row.privacy_unit,
            scheduling=SchedulingPolicy.from_dict(json.loads(row.scheduling)),
            queued_jobs=queued,
        )

    def _ensure_tokenless_tenant(self, tenant: str, caller: Caller) -> None:
        with self._transactions.change() as connection:
            created = connection.execute(
                "INSERT INTO tenants (name, created_at) VALUES (?, ?) ON CONFLICT DO NOTHING", (tenant, now())
            ).rowcount
            if created:
                self._history.record(connection, caller, "create_tenant", tenant, None, {"tenant": tenant, "token": False})

    # ------------------------------------------------------------ identity

    def verified_caller(self, token: str) -> Caller | None:
        """The caller of a token this ledger verified lately, or None (then `authenticate` looks it up).

        Costs one SHA-256 and, at most every TOKEN_RECHECK_SECONDS, one read
        of the token generation: when a rotation or revocation changed it,
        on this server or another of the database, every verified token is
        forgotten.
        """
        now = time.monotonic()
        if now - self._tokens_checked_at >= TOKEN_RECHECK_SECONDS:
            with self._transactions.read() as connection:
                (generation,) = connection.execute("SELECT generation FROM token_generation").fetchone()
            with self._tokens_lock:
                if generation != self._token_generation:
                    self._verified_tokens.clear()
                    self._token_generation = generation
                self._tokens_checked_at = now
        return self._verified_tokens.get(token_digest(token))

    def authenticate(self, token: str) -> Caller:
        """The admin or tenant a token belongs to; raises Unauthenticated for an unknown or revoked token.

        A token is found by its key id and compared by its SHA-256 digest, so
        a wrong one costs one fast hash and one indexed read. Verified tokens
        are remembered (by digest) until the token generation changes (see
        `verified_caller`). A tenant token stored by scrypt (schema version 6
        and before) is checked with scrypt once and then stored by digest.
        """
        known = self.verified_caller(token)
        if known is not None:
            return known
        digest = token_digest(token)
        caller = self._admin_caller(token, digest)
        if caller is None:
            key_id = token_key_id(token)
            with self._transactions.read() as connection:
                row = connection.execute(
                    "SELECT name, token_salt, token_hash FROM tenants WHERE key_id = ?", (key_id,)
                ).fetchone()
            if row is None or not (
                hmac.compare_digest(digest, row[2]) if row[1] is None else token_matches(token, row[1], row[2])
            ):
                raise Unauthenticated(
                    "the token is not known to this ledger, or was revoked or rotated; use the token dpfleet ledger "
                    "tenant create or dpfleet ledger token rotate printed"
                )
            if row[1] is not None:
                with self._transactions.change() as connection:
                    connection.execute(
                        "UPDATE tenants SET token_salt = NULL, token_hash = ? WHERE key_id = ? AND token_salt = ?",
                        (digest, key_id, row[1]),
                    )
            caller = replace(tenant_caller(row[0]), key_id=key_id)
        self._verified_tokens[digest] = caller
        return caller

    def _admin_caller(self, token: str, digest: bytes) -> Caller | None:
        """The admin, when `token` is an admin token the ledger keeps and has not revoked; else None."""
        key_id = admin_key_id(token)
        with self._transactions.read() as connection:
            row = connection.execute(
                "SELECT token_hash FROM admin_tokens WHERE key_id = ? AND revoked_at IS NULL", (key_id,)
            ).fetchone()
        if row is None or not hmac.compare_digest(digest, row[0]):
            return None
        return replace(ADMIN, key_id=key_id)

    def register_admin_token(self, token: str) -> None:
        """Keep the admin token a server was started with (once); a revoked one stays revoked."""
        with self._transactions.change() as connection:
            connection.execute(
                "INSERT INTO admin_tokens (key_id, token_hash, created_at) VALUES (?, ?, ?) ON CONFLICT DO NOTHING",
                (admin_key_id(token), token_digest(token), now()),
            )

    def _tokens_changed(self, connection: Connection) -> None:
        """Count a rotation or revocation, so every server forgets the tokens it verified (this one at once)."""
        connection.execute("UPDATE token_generation SET generation = generation + 1")
        self._verified_tokens.clear()
        self._tokens_checked_at = 0.0

    def rotate_token(self, tenant: str | None = None, *, caller: Caller | None = None) -> TenantCreated:
        """Replace a token with a new one, shown this once; the old one stops working on every server within
        a second (TOKEN_RECHECK_SECONDS plus a read).

        `tenant` names a tenant's token (the admin's to rotate, or the
        tenant's own); None the admin token the caller authenticated with
        (admin only). The reply's `tenant` is None for an admin token.
        """
        caller = self._caller(caller)
        if tenant is None:
            if not caller.admin:
                raise PermissionDenied("rotating the admin token needs the admin token; a tenant rotates its own")
            key_id, token = new_token()
            with self._transactions.change() as connection:
                connection.execute(
                    "INSERT INTO admin_tokens (key_id, token_hash, created_at) VALUES (?, ?, ?)",
                    (key_id, token_digest(token), now()),
                )
                revoked = []
                if caller.key_id is not None:
                    revoked = [caller.key_id]
                    connection.execute(
                        "UPDATE admin_tokens SET revoked_at = ? WHERE key_id = ? AND revoked_at IS NULL",
                        (now(), caller.key_id),
                    )
                self._tokens_changed(connection)
                self._history.record(connection, caller, "rotate_token", None, None,
                             {"admin": True, "key_id": key_id, "revoked_key_ids": revoked})
            return TenantCreated(None, token)
        check_name("tenant name", tenant)
        if not (caller.admin or caller.tenant == tenant):
            raise PermissionDenied(f"a tenant rotates only its own token; rotating {tenant!r}'s needs the admin token")
        key_id, token = new_token()
        with self._transactions.change() as connection:
            row = connection.execute("SELECT key_id FROM tenants WHERE name = ?", (tenant,)).fetchone()
            if row is None:
                raise NotFound(f"tenant {tenant!r} does not exist; create it with dpfleet ledger tenant create")
            connection.execute(
                "UPDATE tenants SET key_id = ?, token_salt = NULL, token_hash = ? WHERE name = ?",
                (key_id, token_digest(token), tenant),
            )
            self._tokens_changed(connection)
            self._history.record(connection, caller, "rotate_token", tenant, None,
                         {"tenant": tenant, "key_id": key_id, "revoked_key_ids": [row[0]] if row[0] else [],
                          "token_digest": stored_token_digest(None, token_digest(token))})
        return TenantCreated(tenant, token)

    def revoke_token(
        self, tenant: str | None = None, key_id: str | None = None, *, caller: Caller | None = None
    ) -> str:
        """Revoke a tenant's token, or the admin token of `key_id` (admin only); the revoked key id.

        It stops working on every server within a second. A tenant without a
        token can do nothing until an admin rotates one in for it; the last
        admin token is not revoked (rotate it instead).
        """
        caller = self._caller(caller)
        if not caller.admin:
            raise PermissionDenied("revoking a token needs the admin token (a tenant can rotate its own)")
        if (tenant is None) == (key_id is None):
            raise InvalidArgument("name either a tenant, or the key id of an admin token (got both or neither)")
        with self._transactions.change() as connection:
            if tenant is not None:
                check_name("tenant name", tenant)
                row = connection.execute("SELECT key_id FROM tenants WHERE name = ?", (tenant,)).fetchone()
                if row is None:
                    raise NotFound(f"tenant {tenant!r} does not exist (dpfleet ledger status lists what you see)")
                if row[0] is None:
                    raise FailedPrecondition(f"tenant {tenant!r} has no token to revoke")
                connection.execute(
                    "UPDATE tenants SET key_id = NULL, token_salt = NULL, token_hash = NULL WHERE name = ?", (tenant,)
                )
                revoked = row[0]
            else:
                check_name("admin key id", key_id)
                live = [live_id for (live_id,) in connection.execute(
                    "SELECT key_id FROM admin_tokens WHERE revoked_at IS NULL ORDER BY key_id"
                ).fetchall()]
                if key_id not in live:
                    raise NotFound(f"no admin token with key id {key_id!r} is in use; those in use are {', '.join(live)}")
                if live == [key_id]:
                    raise FailedPrecondition(
                        f"admin token {key_id} is the last one; rotate it (dpfleet ledger token rotate --admin) instead"
                    )
                connection.execute("UPDATE admin_tokens SET revoked_at = ? WHERE key_id = ?", (now(), key_id))
                revoked = key_id
            self._tokens_changed(connection)
            self._history.record(connection, caller, "revoke_token", tenant, None,
                         {"tenant": tenant, "admin": tenant is None, "key_id": revoked})
        return revoked

    def create_tenant(self, tenant: str, *, caller: Caller | None = None) -> TenantCreated:
        """Create a tenant and return its token, shown this once (admin only)."""
        caller = self._caller(caller)
        if not caller.admin:
            raise PermissionDenied(
                "creating a tenant needs the admin token (the server's --admin-token-file or DPFLEET_ADMIN_TOKEN)"
            )
        check_name("tenant name", tenant)
        key_id, token = new_token()
        with self._transactions.change() as connection:
            try:
                connection.execute(
                    "INSERT INTO tenants (name, key_id, token_salt, token_hash, created_at) VALUES (?, ?, ?, ?, ?)",
                    (tenant, key_id, None, token_digest(token), now()),
                )
            except self._database.duplicate_errors:
                raise AlreadyExists(f"tenant {tenant!r} already exists; choose another name") from None
            self._history.record(
                connection, caller, "create_tenant", tenant, None,
                {"tenant": tenant, "key_id": key_id, "token_digest": stored_token_digest(None, token_digest(token))},
            )
        return TenantCreated(tenant, token)

    # ------------------------------------------------------------ datasets

    def create_dataset(
        self,
        dataset: str,
        epsilon: float,
        delta: float,
        privacy_unit: str = EXAMPLE,
        scheduling: SchedulingPolicy | dict | None = None,
        *,
        caller: Caller | None = None,
    ) -> DatasetStatus:
        """Create a dataset with a budget of `epsilon` at `delta` for the whole life of the data.

        The budget is per `privacy_unit`: one row ('example') or one person
        with all its rows ('user'); see `charged_plan` for jobs of the other unit.
        `scheduling` is how its queue of waiting jobs is served (default: the ledger's).
        """
        caller = self._caller(caller)
        epsilon = check_budget_epsilon(epsilon)
        delta = check_delta(delta)
        privacy_unit = check_privacy_unit(privacy_unit)
        scheduling = check_scheduling(scheduling) if scheduling is not None else self._default_scheduling
        reference = resolve_dataset(caller, dataset)
        zero = RdpTally.zero().to_json()
        rule = AdmissionRule.for_budget(epsilon, delta)
        with self._transactions.change() as connection:
            if not connection.execute("SELECT 1 FROM tenants WHERE name = ?", (reference.tenant,)).fetchone():
                raise NotFound(
                    f"tenant {reference.tenant!r} does not exist; create it with dpfleet ledger tenant create"
                )
            try:
                (dataset_id,) = connection.execute(
                    "INSERT INTO datasets (tenant, name, budget_epsilon, delta, held_rdp, committed_events, "
                    "created_at, admission_rule, privacy_unit, scheduling) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?) "
                    "RETURNING id",
                    (
                        reference.tenant, reference.name, epsilon, delta, zero, Composition().to_json(), now(),
                        json.dumps(rule.to_dict()), privacy_unit, json.dumps(scheduling.to_dict()),
                    ),
                ).fetchone()
            except self._database.duplicate_errors:
                raise AlreadyExists(
                    f"dataset {dataset!r} already exists; an admin can raise its budget (dpfleet ledger dataset raise)"
                ) from None
            self._history.record(
                connection, caller, "create_dataset", reference.tenant, dataset_id,
                {"epsilon": epsilon, "delta": delta, "admission": rule.to_dict(), "privacy_unit": privacy_unit,
                 "scheduling": scheduling.to_dict()},
            )
            rows = self._status_rows(connection, caller, self._dataset_row(connection, caller, dataset))
        return self._status(caller, rows)

    def raise_budget(self, dataset: str, epsilon: float, *, caller: Caller | None = None) -> DatasetStatus:
        """Set a dataset's budget epsilon (admin only); refused below what is committed and reserved."""
        caller = self._caller(caller)
        if not caller.admin:
            raise PermissionDenied(
                "changing a budget needs the admin token (the server's --admin-token-file or DPFLEET_ADMIN_TOKEN)"
            )
        epsilon = check_budget_epsilon(epsilon)
        with self._transactions.change() as connection:
            row = self._dataset_row(connection, caller, dataset)
            check_new_budget(dataset, _rule(row), epsilon, RdpTally.from_json(row.held_rdp))
            (largest_block,) = connection.execute(
                "SELECT MAX(budget_epsilon) FROM datasets WHERE block_of = ?", (row.dataset_id,)
            ).fetchone()
            if largest_block is not None and epsilon < largest_block:
                raise FailedPrecondition(
                    f"dataset {dataset!r} has a block of ε {largest_block:g}; its budget, the most any row or person "
                    f"of it may spend, cannot be below that (got ε {epsilon:g}). Choose at least ε {largest_block:g}"
                )
            connection.execute("UPDATE datasets SET budget_epsilon = ? WHERE id = ?", (epsilon, row.dataset_id))
            self._history.record(
                connection, caller, "raise_budget", row.tenant, row.dataset_id,
                {"from": row.budget_epsilon, "to": epsilon},
            )
            rows = self._status_rows(connection, caller, self._dataset_row(connection, caller, dataset))
        return self._status(caller, rows)

    def add_block(
        self, dataset: str, block: str, epsilon: float, delta: float | None = None, data: dict | str | None = None,
        *, caller: Caller | None = None,
    ) -> DatasetStatus:
        """Add a block (a part of the dataset's data, e.g. one day's) with its own budget of `epsilon` at `delta`.

        `data` declares where the block's rows are (`check_block_data`); a
        declaration that may share a row (or, on a per-person dataset, a
        person) with another block's is refused, so each unit is in one
        block at most and its guarantee is that block's budget. The block's
        (epsilon, delta) is at most the dataset's, and a dataset whose own
        budget was charged (its jobs read every row) takes no block.
        `delta` defaults to the dataset's; the block protects the dataset's
        privacy unit. The dataset's owner or an admin may add one. Jobs on
        the dataset then name the blocks they train on, and each is charged
        in full to every block it names.
        """
        caller = self._caller(caller)
        check_name("block name", block)
        epsilon = check_budget_epsilon(epsilon, "block epsilon")
        with self._transactions.change() as connection:
            row = self._dataset_row(connection, caller, dataset)
            delta = row.delta if delta is None else check_delta(delta)
            data = check_block_data(data, row.privacy_unit)
            self._check_new_block(connection, dataset, row, block, epsilon, delta, data)
            rule = AdmissionRule.for_budget(epsilon, delta)
            try:
                (block_id,) = connection.execute(
                    "INSERT INTO datasets (tenant, name, budget_epsilon, delta, held_rdp, committed_events, "
                    "created_at, admission_rule, privacy_unit, block_of, block, block_data) "
                    "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?) RETURNING id",
                    (
                        # ':' is in no dataset name, so a block's row never takes a dataset's name.
                        row.tenant, f"{row.name}:{block}", epsilon, delta, RdpTally.zero().to_json(),
                        Composition().to_json(), now(), json.dumps(rule.to_dict()), row.privacy_unit,
                        row.dataset_id, block, json.dumps(data, sort_keys=True),
                    ),
                ).fetchone()
            except self._database.duplicate_errors:
                raise AlreadyExists(f"dataset {dataset!r} already has a block {block!r}; choose another name") from None
            self._history.record(
                connection, caller, "add_block", row.tenant, block_id,
                {"dataset": row.name, "block": block, "epsilon": epsilon, "delta": delta, "admission": rule.to_dict(),
                 "data": data},
            )
            rows = self._status_rows(connection, caller, row)
        return self._status(caller, rows)

    @staticmethod
    def _check_new_block(
        connection: Connection, reference: str, row: _DatasetRow, block: str, epsilon: float, delta: float, data: dict
    ) -> None:
        """Refuse a block whose budget exceeds the dataset's, whose data may meet another block's, or on a dataset
        whose own budget was charged."""
        if epsilon > row.budget_epsilon or delta > row.delta:
            raise InvalidArgument(
                f"block {block!r} asks for ε {epsilon:g} at δ={delta:g}, above dataset {reference!r}'s budget of "
                f"ε {row.budget_epsilon:g} at δ={row.delta:g}: each unit's guarantee is its block's, and the "
                "dataset's budget is what it promises. Choose at most the dataset's ε and δ, or ask an admin to "
                "raise the budget"
            )
        if RdpTally.from_json(row.held_rdp) != RdpTally.zero() or connection.execute(
            "SELECT 1 FROM queued_jobs WHERE dataset_id = ? AND state = ? AND blocks = '[]' LIMIT 1",
            (row.dataset_id, QUEUED),
        ).fetchone():
            raise FailedPrecondition(
                f"dataset {reference!r} has jobs on its own budget, which read every row, so no block of it could "
                "own its rows alone; add blocks only to a dataset before its first job (create a new dataset for "
                "the data you want in blocks)"
            )
        for other, other_data in connection.execute(
            "SELECT block, block_data FROM datasets WHERE block_of = ? ORDER BY block", (row.dataset_id,)
        ).fetchall():
            reason = block_data_overlap(json.loads(other_data) if other_data else None, data, row.privacy_unit)
            if reason is not None:
                raise FailedPrecondition(
                    f"block {block!r} may hold data of block {other!r} of dataset {reference!r} ({reason}); a block "
                    "owns its data alone, so that no row or person is charged by two budgets. Declare data that "
                    "no other block declares"
                )

    def set_quota(
        self, dataset: str, tenant: str, epsilon: float, block: str | None = None, *, caller: Caller | None = None
    ) -> DatasetStatus:
        """Give `tenant` a quota of `epsilon` on a dataset, or on one of its blocks (admin only).

        The quota is an extra RDP filter, at orders of its own taken from
        (epsilon, the budget's delta), on the tenant's own tally: a job of
        the tenant needs both the budget's filter and this one. A quota set
        on a dataset applies to each of its blocks that has none of its own.
        It lets a tenant other than the owner use the dataset. Setting it
        again replaces it; a quota below what the tenant holds admits no new
        job until enough is released.
        """
        caller = self._caller(caller)
        if not caller.admin:
            raise PermissionDenied(
                "setting a quota needs the admin token (the server's --admin-token-file or DPFLEET_ADMIN_TOKEN)"
            )
        check_name("tenant name", tenant)
        epsilon = check_budget_epsilon(epsilon, "quota epsilon")
        blocks = () if block is None else check_block_names([block])
        with self._transactions.change() as connection:
            row = self._dataset_row(connection, caller, dataset)
            if not connection.execute("SELECT 1 FROM tenants WHERE name = ?", (tenant,)).fetchone():
                raise NotFound(f"tenant {tenant!r} does not exist; create it with dpfleet ledger tenant create")
            (budget,) = self._budget_rows(connection, row, blocks, dataset) if blocks else (row,)
            rule = AdmissionRule.for_budget(epsilon, budget.delta)
            held, committed = self._use(connection, budget.dataset_id, tenant)
            self._set_use(connection, budget.dataset_id, tenant, held, committed)
            connection.execute(
                "UPDATE tenant_use SET quota_epsilon = ?, quota_rule = ? WHERE budget_id = ? AND tenant = ?",
                (epsilon, json.dumps(rule.to_dict()), budget.dataset_id, tenant),
            )
            held_epsilon = rule.epsilon(held)
            self._history.record(
                connection, caller, "set_quota", tenant, budget.dataset_id,
                {"tenant": tenant, "block": block, "epsilon": epsilon, "admission": rule.to_dict(),
                 "held_epsilon_filter": held_epsilon, "held_fits_quota": fits_budget(held_epsilon, epsilon)},
            )
            rows = self._status_rows(connection, caller, row)
        return self._status(caller, rows)

    def fits(
        self, dataset: str, planned: EventsLike, blocks: tuple[str, ...] | list[str] = (),
        privacy_unit: str = EXAMPLE, rows_per_person: int | None = None, *, caller: Caller | None = None,
    ) -> FitReport:
        """Whether a job would be admitted now, what it would cost and what would remain; reserves nothing.

        The same conversion (`charged_plan`) and checks as `reserve`, on one
        snapshot of the budgets; a reservation made later meets the budgets
        as they are then.
        """
        caller = self._caller(caller)
        self._charge_curves(caller, 1)
        blocks = check_block_names(blocks)
        _, charged, _ = self._charged(caller, dataset, planned, privacy_unit, rows_per_person)
        self._charge_curves(caller, uncached_mechanisms(charged))
        planned_tally = RdpTally.of(charged)
        with self._transactions.read() as connection:
            row = self._dataset_row(connection, caller, dataset, shared=True)
            budgets = self._budget_rows(connection, row, blocks, dataset, new_job=True)
            checks, quota_checks = self._admission_checks(
                connection, _job_tenant(caller, row), row, budgets, planned_tally, dataset
            )
        return FitReport(dataset, blocks, (*checks, *quota_checks))

    def get_budget(
        self, dataset: str, pld_may_be_pending: bool = False, *, caller: Caller | None = None
    ) -> DatasetStatus:
        """One dataset's budget, spent, reserved and remaining epsilon, and its active jobs.

        With `pld_may_be_pending`, answer at once: if the PLD epsilon of new
        commits is not computed yet, `spent_epsilon` is their RDP epsilon,
        labelled "rdp" (see `budget_figures`).
        """
        caller = self._caller(caller)
        with self._transactions.read() as connection:
            rows = self._status_rows(connection, caller, self._dataset_row(connection, caller, dataset, shared=True))
        return self._status(caller, rows, pld_may_be_pending)

    def list_datasets(
        self, pld_may_be_pending: bool = False, *, caller: Caller | None = None
    ) -> list[DatasetStatus]:
        """Every dataset the caller may see (its own; all for an admin), by tenant and name (see get_budget)."""
        caller = self._caller(caller)
        with self._transactions.read() as connection:
            if caller.admin:
                datasets = connection.execute(
                    f"SELECT {_DATASET_COLUMNS} FROM datasets WHERE block_of IS NULL ORDER BY tenant, name"
                )
            else:
                # Its own datasets, and those where it holds a quota on the dataset or one of its blocks.
                datasets = connection.execute(
                    f"SELECT {_DATASET_COLUMNS} FROM datasets WHERE block_of IS NULL AND (tenant = ? OR id IN "
                    "(SELECT COALESCE(d.block_of, d.id) FROM tenant_use u JOIN datasets d ON d.id = u.budget_id "
                    "WHERE u.tenant = ? AND u.quota_epsilon IS NOT NULL)) ORDER BY tenant, name",
                    (caller.tenant, caller.tenant),
                )
            all_rows = [self._status_rows(connection, caller, _DatasetRow(*row)) for row in datasets.fetchall()]
        return [self._status(caller, rows, pld_may_be_pending) for rows in all_rows]

    # ------------------------------------------------------------ jobs

    def list_jobs(
        self, dataset: str | None = None, state: str | None = None, *, caller: Caller | None = None
    ) -> list[Reservation]:
        """Reservations on the caller's datasets, oldest first; optionally of one dataset or state."""
        caller = self._caller(caller)
        state = check_state(state)
        conditions, parameters = [], []
        with self._transactions.read() as connection:
            if dataset is not None:
                conditions.append("r.dataset_id = ?")
                parameters.append(self._dataset_row(connection, caller, dataset, shared=True).dataset_id)
            if not caller.admin:
                conditions.append("r.tenant = ?")
                parameters.append(caller.tenant)
            if state is not None:
                conditions.append("r.state = ?")
                parameters.append(state)
            where = f"WHERE {' AND '.join(conditions)}" if conditions else ""
            rows = connection.execute(
                f"SELECT {_RESERVATION_COLUMNS} FROM reservations r JOIN datasets d ON d.id = r.dataset_id "
                f"{where} ORDER BY r.{self._database.insertion_order}",
                parameters,
            ).fetchall()
        return [self._reservation(caller, row) for row in rows]

    def _visible(
        self, connection: Connection, caller: Caller, table: str, dataset: str | None, state: str | None
    ) -> tuple[str, list]:
        """The WHERE clause and its parameters for rows of `table` (joined to datasets as d) the caller may list."""
        conditions, parameters = [], []
        if dataset is not None:
            conditions.append(f"{table}.dataset_id = ?")
            parameters.append(self._dataset_row(connection, caller, dataset).dataset_id)
        elif not caller.admin:
            conditions.append("d.tenant = ?")
            parameters.append(caller.tenant)
        if state is not None:
            conditions.append(f"{table}.state = ?")
            parameters.append(state)
        return (f"WHERE {' AND '.join(conditions)}" if conditions else ""), parameters

    @curves_outside_lock
    def reserve(
        self,
        dataset: str,
        job_id: str,
        planned: EventsLike,
        lease_seconds: float | None = None,
        privacy_unit: str = EXAMPLE,
        rows_per_person: int | None = None,
        blocks: tuple[str, ...] | list[str] = (),
        *,
        caller: Caller | None = None,
    ) -> Reservation:
        """Hold budget for all of a job's planned events, or raise BudgetExceeded.

        `planned` protects `privacy_unit`; on a dataset of the other unit it
        is converted or refused by `charged_plan` (an example-level job on a
        user-level dataset is charged its group-privacy bound for people of at
        most `rows_per_person` rows), and the reservation holds the events
        charged. The job is charged to the dataset, or in full to each of
        `blocks` (block composition): every budget's admission rule, and the
        tenant's quota on each where one is set, must admit it; all or
        nothing. A job id holds at most one active reservation per dataset
        and tenant: asking again with the same plan and blocks returns that
        reservation (a retried reserve holds budget once); a different one is
        refused until it is released. With `lease_seconds`, the reservation
        expires that long after this call or its last commit, and its unrun
        steps are released.
        """
        caller = self._caller(caller)
        check_name("job id", job_id)
        blocks = check_block_names(blocks)
        lease_seconds = check_lease_seconds(lease_seconds)
        job_events, planned, rows_per_person = self._charged(caller, dataset, planned, privacy_unit, rows_per_person)
        self._charge_curves(caller, uncached_mechanisms(planned))
        planned_tally = RdpTally.of(planned)  # the costly part, outside the write lock
        with self._transactions.change() as connection:
            row = self._dataset_row(connection, caller, dataset, shared=True)
            tenant = _job_tenant(caller, row)
            self._expire_leases(connection, row.dataset_id)
            existing = connection.execute(
                f"SELECT {_RESERVATION_COLUMNS} FROM reservations r JOIN datasets d ON d.id = r.dataset_id "
                "WHERE r.dataset_id = ? AND r.tenant = ? AND r.job_id = ? AND r.state = ?",
                (row.dataset_id, tenant, job_id, ACTIVE),
            ).fetchone()
            if existing is not None:
                reservation = self._reservation(caller, existing)
                if reservation.planned != planned or reservation.blocks != blocks:
                    raise FailedPrecondition(
                        f"job {job_id!r} already holds reservation {reservation.reservation_id} on dataset "
                        f"{dataset!r} with another plan or blocks; release it first or use another job id"
                    )
                return reservation
            budgets = self._budget_rows(connection, row, blocks, dataset, new_job=True)
            reservation_id = self._hold(
                connection, caller, tenant, dataset, row, budgets, blocks, job_id, planned, planned_tally,
                lease_seconds, _conversion(planned, job_events, rows_per_person),
            )
            self._count_arrival(connection, budgets)
            self._serve_queue(connection, row.dataset_id)
            reserved = connection.execute(
                f"SELECT {_RESERVATION_COLUMNS} FROM reservations r JOIN datasets d ON d.id = r.dataset_id "
                "WHERE r.id = ?",
                (reservation_id,),
            ).fetchone()
        return self._reservation(caller, reserved)

    def _charged(
        self, caller: Caller, dataset: str, planned: EventsLike, privacy_unit: str, rows_per_person: int | None
    ) -> tuple[Composition, Composition, int | None]:
        """A job's own events, the events the dataset charges for them (see `charged_plan`), and the checked bound."""
        job_events = check_plan(planned)
        privacy_unit = check_privacy_unit(privacy_unit)
        rows_per_person = check_rows_per_person(rows_per_person)
        with self._transactions.read() as connection:
            dataset_unit = self._dataset_row(connection, caller, dataset, shared=True).privacy_unit
        charged = charged_plan(dataset, dataset_unit, privacy_unit, job_events, rows_per_person)
        return job_events, charged, rows_per_person

    def refuse_while_limited(self, caller: Caller) -> None:
        """Raise RateLimited when the tenant's bucket of costly requests is empty (a server, before it parses a
        Fits: a tenant that keeps asking costs it next to nothing)."""
        if self.curve_limits is not None and not caller.admin and self.curve_limits.owes(f"tenant {caller.tenant!r}"):
            self._charge_curves(caller, 1)

    def _charge_curves(self, caller: Caller, cost: int) -> None:
        """Take `cost` from the tenant's bucket of costly requests (`curve_limits`), or raise RateLimited.

        A request costs one per mechanism whose RDP curve it would compute,
        and a Fits one more, taken before it does any work. Admins are not
        charged.
        """
        if self.curve_limits is not None and not caller.admin:
            self.curve_limits.take(f"tenant {caller.tenant!r}", cost)

    @staticmethod
    def _count_arrival(connection: Connection, budgets: list[_DatasetRow]) -> None:
        """A job arrived on `budgets` (the dataset, or the blocks it names): what DPF-N unlocks by."""
        for budget in budgets:
            connection.execute("UPDATE datasets SET arrived_jobs = arrived_jobs + 1 WHERE id = ?", (budget.dataset_id,))

    def _hold(
        self,
        connection: Connection,
        caller: Caller,
        tenant: str,
        dataset: str,
        row: _DatasetRow,
        budgets: list[_DatasetRow],
        blocks: tuple[str, ...],
        job_id: str,
        planned: Composition,
        planned_tally: RdpTally,
        lease_seconds: float | None,
        details: dict,
    ) -> str:
        """Admit `tenant`'s plan on `budgets` (the dataset, or its `blocks`) through every budget's filter and
        the tenant's quotas (or raise BudgetExceeded), and hold it; the new reservation's id.

        `dataset` is the name a refusal gives; `details` go into the `reserve` history entry besides the plan.
        """
        checks, quota_checks = self._admission_checks(connection, tenant, row, budgets, planned_tally, dataset)
        for check in [*checks, *quota_checks]:
            if not check.fits:
                raise check.refusal(dataset)
        reservation_id = f"r-{secrets.token_hex(8)}"
        connection.execute(
            "INSERT INTO reservations (id, dataset_id, job_id, planned_events, committed_steps, state, created_at, "
            "lease_seconds, expires_at, tenant, blocks) VALUES (?, ?, ?, ?, 0, ?, ?, ?, ?, ?, ?)",
            (
                reservation_id, row.dataset_id, job_id, planned.to_json(), ACTIVE, now(), lease_seconds,
                expiry(lease_seconds), tenant, json.dumps(list(blocks)),
            ),
        )
        for budget in budgets:
            (held,) = connection.execute(
                "SELECT held_rdp FROM datasets WHERE id = ?", (budget.dataset_id,)
            ).fetchone()
            connection.execute(
                "UPDATE datasets SET held_rdp = ? WHERE id = ?",
                ((RdpTally.from_json(held) + planned_tally).to_json(), budget.dataset_id),
            )
            use_held, use_committed = self._use(connection, budget.dataset_id, tenant)
            self._set_use(connection, budget.dataset_id, tenant, use_held + planned_tally, use_committed)
        # The filter epsilon each budget holds after admission, as verify replays it.
        held_after = [check.held_after_epsilon for check in checks]
        placement = (
            {"blocks": list(blocks), "held_epsilon_filter_by_block": dict(zip(blocks, held_after))}
            if blocks else {"held_epsilon_filter": held_after[0]}
        )
        self._history.record(
            connection,
            caller,
            "reserve",
            tenant,
            row.dataset_id,
            {
                "reservation_id": reservation_id,
                "job_id": job_id,
                "planned_events": planned.to_dict(),
                "lease_seconds": lease_seconds,
                **placement,
                **details,
            },
        )
        return reservation_id

    @curves_outside_lock
    def commit(
        self, reservation_id: str, steps: int, sequence: int, *, caller: Caller | None = None
    ) -> CommitResult:
        """Charge the next `steps` planned steps of a reservation (in plan order) as spent; renew its lease.

        Idempotent per `sequence`: a retry with the same sequence and steps
        charges nothing more and returns the first result; the same sequence
        with other steps is refused. A reservation whose lease expired takes
        no new commit (FailedPrecondition).
        """
        caller = self._caller(caller)
        steps = check_steps(steps)
        sequence = check_sequence(sequence)
        with self._transactions.change() as connection:
            row = self._reservation_row(connection, caller, reservation_id)
            dataset_id = row[_JOB_DATASET_ID]
            if row[4] == ACTIVE and row[10] is not None and row[10] <= now():  # its own lease ran out
                self._expire_leases(connection, dataset_id)
                row = self._reservation_row(connection, caller, reservation_id)
            reservation = self._reservation(caller, row)
            # The reservation and its lease first: a retried sequence does not let a driver that lost its lease,
            # or whose job was released, learn or assume that its charges still stand.
            if reservation.lease_expired:
                raise FailedPrecondition(
                    f"the lease of reservation {reservation_id} expired at {reservation.expires_at} and its unrun "
                    "steps were released, so it takes no more commits; stop the job's steps and reserve again"
                )
            if reservation.state != ACTIVE:
                raise FailedPrecondition(
                    f"reservation {reservation_id} was released; reserve again for more steps"
                )
            earlier = connection.execute(
                "SELECT steps, committed_steps FROM commits WHERE reservation_id = ? AND sequence = ?",
                (reservation_id, sequence),
            ).fetchone()
            if earlier is not None:
                if earlier[0] != steps:
                    raise InvalidArgument(
                        f"sequence {sequence} of reservation {reservation_id} was committed with {earlier[0]} steps "
                        f"(got {steps}); a retry must repeat the same steps, a new block needs a new sequence"
                    )
                return CommitResult(reservation_id, sequence, steps, earlier[1], reservation.planned_steps)
            if steps > reservation.unrun_steps:
                raise InvalidArgument(
                    f"reservation {reservation_id} has {reservation.unrun_steps} unrun steps of "
                    f"{reservation.planned_steps} (got {steps}); commit at most that, or reserve a new plan"
                )
            _, unrun = split_steps(reservation.planned, reservation.committed_steps)
            block, _ = split_steps(unrun, steps)
            dataset = _DatasetRow(
                *connection.execute(f"SELECT {_DATASET_COLUMNS} FROM datasets WHERE id = ?", (dataset_id,)).fetchone()
            )
            tenant = row[_JOB_TENANT]
            budgets = self._budget_rows(connection, dataset, reservation.blocks, reservation.dataset)
            # Admission keeps every commit within the filters; this holds the line for reservations made before
            # a dataset had one (a file of schema version 2), or before a tenant's quota was set or lowered.
            checks, quota_checks = self._admission_checks(
                connection, tenant, dataset, budgets, RdpTally.of(block), reservation.dataset, committed=True
            )
            for check in [*checks, *quota_checks]:
                if not check.fits:
                    raise check.refusal(reservation.dataset)
            for budget in budgets:
                connection.execute(
                    "UPDATE datasets SET committed_events = ? WHERE id = ?",
                    (canonical(Composition.from_json(budget.committed_events).then(block)).to_json(), budget.dataset_id),
                )
                use_held, use_committed = self._use(connection, budget.dataset_id, tenant)
                self._set_use(connection, budget.dataset_id, tenant, use_held, use_committed.then(block))
            committed_steps = reservation.committed_steps + steps
            connection.execute(
                "UPDATE reservations SET committed_steps = ?, expires_at = ? WHERE id = ?",
                (committed_steps, expiry(reservation.lease_seconds), reservation_id),
            )
            connection.execute(
                "INSERT INTO commits (reservation_id, sequence, steps, committed_steps, at) VALUES (?, ?, ?, ?, ?)",
                (reservation_id, sequence, steps, committed_steps, now()),
            )
            self._history.record(
                connection,
                caller,
                "commit",
                tenant,
                dataset_id,
                {
                    "reservation_id": reservation_id,
                    "job_id": reservation.job_id,
                    "sequence": sequence,
                    "events": block.to_dict(),
                    **_blocks_detail(reservation.blocks),
                },
            )
        return CommitResult(reservation_id, sequence, steps, committed_steps, reservation.planned_steps)

    @curves_outside_lock
    def release(self, reservation_id: str, *, caller: Caller | None = None) -> Reservation:
        """Free a reservation's unrun steps; committed steps stay spent. Releasing twice is a no-op."""
        caller = self._caller(caller)
        with self._transactions.change() as connection:
            row = self._reservation_row(connection, caller, reservation_id)
            self._expire_leases(connection, row[_JOB_DATASET_ID])
            self._free(connection, caller, self._reservation_row(connection, caller, reservation_id), "release")
            self._serve_queue(connection, row[_JOB_DATASET_ID])
            row = self._reservation_row(connection, caller, reservation_id)
        return self._reservation(caller, row)

    @curves_outside_lock
    def expire_leases(self) -> None:
        """Release the unrun steps of every reservation whose lease ran out (a server calls this every second).

        Looks first on a reader, so a sweep that finds nothing writes nothing and waits for no fsync.
        """
        with self._transactions.read() as connection:
            due = connection.execute(
                "SELECT 1 FROM reservations WHERE state = ? AND expires_at IS NOT NULL AND expires_at <= ? LIMIT 1",
                (ACTIVE, now()),
            ).fetchone()
        if due is not None:
            with self._transactions.change() as connection:
                self._expire_leases(connection, None)

    def _expire_leases(self, connection: Connection, dataset_id: int | None) -> None:
        condition, parameters = ("AND r.dataset_id = ?", (dataset_id,)) if dataset_id is not None else ("", ())
        expired = connection.execute(
            f"SELECT {_RESERVATION_COLUMNS}, r.dataset_id FROM reservations r JOIN datasets d ON d.id = r.dataset_id "
            f"WHERE r.state = ? AND r.expires_at IS NOT NULL AND r.expires_at <= ? {condition} "
            f"ORDER BY r.{self._database.insertion_order}",
            (ACTIVE, now(), *parameters),
        ).fetchall()
        for row in expired:
            self._free(connection, LEASE_EXPIRY, row, "expire")
        for freed_dataset_id in sorted({row[_JOB_DATASET_ID] for row in expired}):
            self._serve_queue(connection, freed_dataset_id)

    def _free(self, connection: Connection, caller: Caller, row: tuple, action: str) -> None:
        """Release an active reservation's unrun steps (`action`: "release", or "expire" for a lease that ran out)."""
        reservation = self._reservation(caller, row)
        if reservation.state != ACTIVE:
            return
        dataset_id, tenant = row[_JOB_DATASET_ID], row[_JOB_TENANT]
        _, unrun = split_steps(reservation.planned, reservation.committed_steps)
        unrun_tally = RdpTally.of(unrun)
        dataset = _DatasetRow(
            *connection.execute(f"SELECT {_DATASET_COLUMNS} FROM datasets WHERE id = ?", (dataset_id,)).fetchone()
        )
        for budget in self._budget_rows(connection, dataset, reservation.blocks, reservation.dataset):
            (held,) = connection.execute("SELECT held_rdp FROM datasets WHERE id = ?", (budget.dataset_id,)).fetchone()
            connection.execute(
                "UPDATE datasets SET held_rdp = ? WHERE id = ?",
                ((RdpTally.from_json(held) - unrun_tally).to_json(), budget.dataset_id),
            )
            use_held, use_committed = self._use(connection, budget.dataset_id, tenant)
            self._set_use(connection, budget.dataset_id, tenant, use_held - unrun_tally, use_committed)
        connection.execute("UPDATE datasets SET released_jobs = released_jobs + 1 WHERE id = ?", (dataset_id,))
        connection.execute(
            "UPDATE reservations SET state = ?, released_at = ?, lease_expired = ? WHERE id = ?",
            (RELEASED, now(), int(action == "expire"), reservation.reservation_id),
        )
        self._history.record(
            connection,
            caller,
            action,
            tenant,
            dataset_id,
            {
                "reservation_id": reservation.reservation_id,
                "job_id": reservation.job_id,
                "committed_steps": reservation.committed_steps,
                "freed_steps": unrun.steps,
                **_blocks_detail(reservation.blocks),
            },
        )

    # ------------------------------------------------------------ the queue

    @curves_outside_lock
    def enqueue(
        self,
        dataset: str,
        job_id: str,
        planned: EventsLike,
        lease_seconds: float | None = None,
        priority: int = 0,
        max_wait_seconds: float | None = None,
        privacy_unit: str = EXAMPLE,
        rows_per_person: int | None = None,
        blocks: tuple[str, ...] | list[str] = (),
        *,
        caller: Caller | None = None,
    ) -> QueuedJob:
        """Queue a job for budget; the dataset's scheduling policy admits it when it fits (at once if it does).

        Admitted, it holds a reservation like `reserve` gives (`lease_seconds`
        as there). Higher `priority` is served first. With
        `max_wait_seconds`, it gives up waiting that long after now. A plan
        that could never fit, even with every reservation released, is
        refused at once (BudgetExceeded). Queueing the same job id and plan
        again returns the same entry; another plan is refused while it waits.
        `privacy_unit`, `rows_per_person` and `blocks` as in `reserve`: the
        queue holds the events charged, and a job on blocks waits for each.
        Only the dataset's owner (or an admin) queues on it.
        """
        caller = self._caller(caller)
        check_name("job id", job_id)
        blocks = check_block_names(blocks)
        lease_seconds = check_lease_seconds(lease_seconds)
        priority = check_priority(priority)
        max_wait_seconds = check_max_wait_seconds(max_wait_seconds)
        job_events, planned, rows_per_person = self._charged(caller, dataset, planned, privacy_unit, rows_per_person)
        self._charge_curves(caller, uncached_mechanisms(planned))
        planned_tally = RdpTally.of(planned)
        with self._transactions.change() as connection:
            row = self._dataset_row(connection, caller, dataset)
            tenant = _job_tenant(caller, row)
            self._expire_leases(connection, row.dataset_id)
            earlier = connection.execute(
                f"SELECT {_QUEUE_COLUMNS} FROM queued_jobs q JOIN datasets d ON d.id = q.dataset_id "
                "LEFT JOIN reservations r ON r.id = q.reservation_id "
                "WHERE q.dataset_id = ? AND q.job_id = ? AND (q.state = ? OR (q.state = ? AND r.state = ?))",
                (row.dataset_id, job_id, QUEUED, ADMITTED, ACTIVE),
            ).fetchone()
            if earlier is not None:
                queued = self._queued_job(caller, earlier)
                if queued.planned != planned:
                    raise FailedPrecondition(
                        f"job {job_id!r} is already {queued.state} on dataset {dataset!r} as {queued.queue_id} with "
                        "another plan; cancel or release it first, or use another job id"
                    )
                return queued
            if connection.execute(
                "SELECT 1 FROM reservations WHERE dataset_id = ? AND tenant = ? AND job_id = ? AND state = ?",
                (row.dataset_id, tenant, job_id, ACTIVE),
            ).fetchone():
                raise FailedPrecondition(
                    f"job {job_id!r} already holds a reservation on dataset {dataset!r}; release it first or use "
                    "another job id"
                )
            budgets = self._budget_rows(connection, row, blocks, dataset, new_job=True)
            # Committed steps are never freed: a plan that does not fit beside them would wait forever.
            checks, quota_checks = self._admission_checks(
                connection, tenant, row, budgets, planned_tally, dataset, committed=True
            )
            for check in [*checks, *quota_checks]:
                if not check.fits:
                    raise check.refusal(dataset)
            queue_id = f"q-{secrets.token_hex(8)}"
            deadline = expiry(max_wait_seconds)
            connection.execute(
                "INSERT INTO queued_jobs (id, dataset_id, job_id, tenant, blocks, planned_events, conversion, "
                "priority, lease_seconds, created_at, deadline, state) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    queue_id, row.dataset_id, job_id, tenant, json.dumps(list(blocks)), planned.to_json(),
                    json.dumps(_conversion(planned, job_events, rows_per_person)), priority, lease_seconds, now(),
                    deadline, QUEUED,
                ),
            )
            self._count_arrival(connection, budgets)
            self._history.record(
                connection, caller, "enqueue", tenant, row.dataset_id,
                {"queue_id": queue_id, "job_id": job_id, "planned_events": planned.to_dict(), "priority": priority,
                 "deadline": deadline, "lease_seconds": lease_seconds, "blocks": list(blocks)},
            )
            self._serve_queue(connection, row.dataset_id)
            queued = self._queued_job(caller, self._queued_row(connection, caller, queue_id))
        return queued

    @curves_outside_lock
    def queued_job(self, queue_id: str, *, caller: Caller | None = None) -> QueuedJob:
        """A queued job as it stands now; a waiting one is scheduled first, so time-based unlocking shows."""
        caller = self._caller(caller)
        with self._transactions.change() as connection:
            row = self._queued_row(connection, caller, queue_id)
            if row[4] == QUEUED:
                self._expire_leases(connection, row[14])
                self._serve_queue(connection, row[14])
                row = self._queued_row(connection, caller, queue_id)
        return self._queued_job(caller, row)

    @curves_outside_lock
    def cancel_queued(self, queue_id: str, *, caller: Caller | None = None) -> QueuedJob:
        """Take a waiting job out of the queue; a job already admitted holds a reservation: release that instead."""
        caller = self._caller(caller)
        with self._transactions.change() as connection:
            row = self._queued_row(connection, caller, queue_id)
            if row[4] == ADMITTED:
                raise FailedPrecondition(
                    f"queued job {queue_id} was already admitted as reservation {row[11]}; release that instead "
                    "(dpfleet ledger release)"
                )
            if row[4] == QUEUED:
                connection.execute(
                    "UPDATE queued_jobs SET state = ?, ended_at = ?, position = 0, reason = ? WHERE id = ?",
                    (CANCELLED, now(), f"cancelled by {caller.actor}", queue_id),
                )
                self._history.record(
                    connection, caller, "cancel_queued", row[1], row[14], {"queue_id": queue_id, "job_id": row[3]}
                )
                self._serve_queue(connection, row[14])
                row = self._queued_row(connection, caller, queue_id)
        return self._queued_job(caller, row)

    def list_queued(
        self, dataset: str | None = None, state: str | None = QUEUED, *, caller: Caller | None = None
    ) -> list[QueuedJob]:
        """Queued jobs on the caller's datasets (waiting ones by default), by dataset then queue position."""
        caller = self._caller(caller)
        state = check_queue_state(state)
        with self._transactions.read() as connection:
            where, parameters = self._visible(connection, caller, "q", dataset, state)
            rows = connection.execute(
                f"SELECT {_QUEUE_COLUMNS}, q.dataset_id FROM queued_jobs q JOIN datasets d ON d.id = q.dataset_id "
                f"{where} ORDER BY d.tenant, d.name, q.position, q.created_at, q.id",
                parameters,
            ).fetchall()
        return [self._queued_job(caller, row) for row in rows]

    @curves_outside_lock
    def serve_queues(self) -> None:
        """Serve every dataset with waiting jobs, for unlocking over time and deadlines (a server: every second).

        Looks first on a reader, so a sweep with nothing queued writes nothing.
        """
        with self._transactions.read() as connection:
            waiting = [
                dataset_id
                for (dataset_id,) in connection.execute(
                    "SELECT DISTINCT dataset_id FROM queued_jobs WHERE state = ? ORDER BY dataset_id", (QUEUED,)
                ).fetchall()
            ]
        if waiting:
            with self._transactions.change() as connection:
                for dataset_id in waiting:
                    self._serve_queue(connection, dataset_id)

    def _serve_queue(self, connection: Connection, dataset_id: int) -> None:
        """Time out the dataset's overdue waiting jobs, admit those its policy picks, note where the rest stand.

        Each budget a waiting job asks for (the dataset's own, or each block
        it names) is one block of the policy, unlocked from its own creation
        and by the jobs that arrived on it.
        """
        started = now()
        waiting = connection.execute(
            "SELECT id, job_id, planned_events, priority, lease_seconds, position, reason, conversion, tenant, blocks, "
            "deadline FROM queued_jobs WHERE dataset_id = ? AND state = ? ORDER BY created_at, id",
            (dataset_id, QUEUED),
        ).fetchall()
        if not waiting:
            return
        row = _DatasetRow(
            *connection.execute(f"SELECT {_DATASET_COLUMNS} FROM datasets WHERE id = ?", (dataset_id,)).fetchone()
        )
        for queue_id, job_id, *_, deadline in waiting:
            if deadline is not None and deadline <= started:
                connection.execute(
                    "UPDATE queued_jobs SET state = ?, ended_at = ?, position = 0, reason = ? WHERE id = ?",
                    (TIMED_OUT, started, "gave up waiting at its deadline", queue_id),
                )
                self._history.record(
                    connection, QUEUE_TIMEOUT, "queue_timeout", row.tenant, dataset_id,
                    {"queue_id": queue_id, "job_id": job_id},
                )
        waiting = [entry for entry in waiting if entry[-1] is None or entry[-1] > started]
        if not waiting:
            return
        policy = SchedulingPolicy.from_dict(json.loads(row.scheduling))
        reference = f"{row.tenant}/{row.name}"
        jobs, budget_blocks = {}, {}
        for arrival, (queue_id, job_id, planned, priority, lease, position, reason, conversion, tenant, blocks, _) in \
                enumerate(waiting):
            blocks = tuple(json.loads(blocks))
            budgets = self._budget_rows(connection, row, blocks, reference)
            if any(budget.block is not None and budget.block_data is None for budget in budgets):
                # Queued before its blocks had to declare their data: like a new job, it is not admitted there.
                undeclared = "a block it names declared no data, so it takes no new job; cancel it"
                if reason != undeclared:
                    connection.execute("UPDATE queued_jobs SET reason = ? WHERE id = ?", (undeclared, queue_id))
                continue
            plan = Composition.from_json(planned)
            tally = RdpTally.of(plan)
            demand = {}
            for budget in budgets:
                name = budget.block if budget.block is not None else row.name
                rule = _rule(budget)
                if name not in budget_blocks:
                    age = datetime.fromisoformat(started) - datetime.fromisoformat(budget.created_at)
                    budget_blocks[name] = BlockBudget(
                        name, rule.capacities(budget.budget_epsilon),
                        rule.order_divergences(RdpTally.from_json(budget.held_rdp)),
                        policy.unlocked_fraction(budget.arrived_jobs, age.total_seconds()),
                    )
                demand[name] = rule.order_divergences(tally)
            jobs[queue_id] = (
                QueuedDemand(queue_id, demand, float(arrival), priority),
                job_id, plan, tally, lease, position, reason, json.loads(conversion), tenant, blocks, budgets,
            )
        for decision in schedule(policy, budget_blocks, [entry[0] for entry in jobs.values()]):
            _, job_id, plan, tally, lease_seconds, position, reason, conversion, tenant, blocks, budgets = \
                jobs[decision.job]
            holding = connection.execute(
                "SELECT id FROM reservations WHERE dataset_id = ? AND tenant = ? AND job_id = ? AND state = ?",
                (dataset_id, tenant, job_id, ACTIVE),
            ).fetchone() if decision.admitted else None
            if holding is not None:
                # The same job id reserved directly while it waited: one active reservation per job id.
                decision = replace(decision, admitted=False,
                                   reason=f"job id already holds reservation {holding[0]}; cancel this or release that")
            if decision.admitted:
                try:
                    reservation_id = self._hold(
                        connection, QUEUE_ADMISSION, tenant, reference, row, budgets, blocks, job_id, plan, tally,
                        lease_seconds, {**conversion, "queue_id": decision.job, "policy": policy.name},
                    )
                except BudgetExceeded:
                    # The policy's float arithmetic let it through at the very edge, or a tenant's quota refused it.
                    decision = replace(decision, admitted=False,
                                       reason="at the edge of the budget or of the tenant's quota; waits for more")
                else:
                    connection.execute(
                        "UPDATE queued_jobs SET state = ?, reservation_id = ?, ended_at = ?, position = 0, reason = ? "
                        "WHERE id = ?",
                        (ADMITTED, reservation_id, now(), f"admitted by {policy.name}", decision.job),
                    )
                    continue
            if (decision.position, decision.reason) != (position, reason):
                connection.execute(
                    "UPDATE queued_jobs SET position = ?, reason = ? WHERE id = ?",
                    (decision.position, decision.reason, decision.job),
                )

    @staticmethod
    def _queued_row(connection: Connection, caller: Caller, queue_id: str) -> tuple:
        check_name("queued job id", queue_id)
        row = connection.execute(
            f"SELECT {_QUEUE_COLUMNS}, q.dataset_id FROM queued_jobs q JOIN datasets d ON d.id = q.dataset_id "
            "WHERE q.id = ?",
            (queue_id,),
        ).fetchone()
        if row is None and caller.admin:
            raise NotFound(f"queued job {queue_id!r} does not exist (dpfleet ledger jobs --queued lists them)")
        if row is None or not (caller.admin or row[1] == caller.tenant):
            raise PermissionDenied(
                f"queued job {queue_id!r} is not one of yours, or does not exist (dpfleet ledger jobs --queued)"
            )
        return row

    @staticmethod
    def _queued_job(caller: Caller, row: tuple) -> QueuedJob:
        (
            queue_id, tenant, name, job_id, state, planned, priority, created_at, deadline, position, reason,
            reservation_id, ended_at, lease_seconds,
        ) = row[:14]
        return QueuedJob(
            queue_id=queue_id,
            dataset=display_name(caller, DatasetRef(tenant, name)),
            job_id=job_id,
            state=state,
            planned=Composition.from_json(planned),
            priority=priority,
            created_at=created_at,
            deadline=deadline,
            position=position,
            reason=reason,
            reservation_id=reservation_id,
            ended_at=ended_at,
            lease_seconds=lease_seconds,
        )

    def head(self, *, caller: Caller | None = None) -> SignedHead:
        """The history's head (entries, last hash, now) signed with the history key, to keep elsewhere (admin only)."""
        caller = self._caller(caller)
        if not caller.admin:
            raise PermissionDenied("the signed head needs the admin (dpfleet ledger head runs on the file)")
        with self._transactions.read() as connection:
            (entries,) = connection.execute("SELECT COUNT(*) FROM history").fetchone()
            last = connection.execute("SELECT hash FROM history ORDER BY id DESC LIMIT 1").fetchone()
        return sign_head(self._history.key, entries, last[0] if last else "", now())

    def verify(self, head: SignedHead | None = None, *, caller: Caller | None = None) -> Verification:
        """Check the history's keyed hash chain, replay every dataset's, block's, tenant use's, reservation's,
        commit's and tenant's history against its row, and with `head` check that the history extends it
        (admin only)."""
        caller = self._caller(caller)
        if not caller.admin:
            raise PermissionDenied("verifying the ledger needs the admin (dpfleet ledger verify runs on the file)")
        with self._transactions.read() as connection:
            reservations = [
                StoredReservation(
                    reservation_id, dataset_id, tenant, job_id, Composition.from_json(planned), committed_steps,
                    state, lease_seconds, bool(lease_expired), tuple(json.loads(blocks)),
                )
                for (reservation_id, dataset_id, tenant, job_id, planned, committed_steps, state, lease_seconds,
                     lease_expired, blocks) in connection.execute(
                    "SELECT id, dataset_id, tenant, job_id, planned_events, committed_steps, state, lease_seconds, "
                    "lease_expired, blocks FROM reservations ORDER BY id"
                ).fetchall()
            ]
            commits = [
                StoredCommit(*row) for row in connection.execute(
                    "SELECT reservation_id, sequence, steps, committed_steps FROM commits ORDER BY reservation_id, "
                    "sequence"
                ).fetchall()
            ]
            tenants = [
                StoredTenant(name, key_id, stored_token_digest(salt, token_hash))
                for name, key_id, salt, token_hash in connection.execute(
                    "SELECT name, key_id, token_salt, token_hash FROM tenants ORDER BY name"
                ).fetchall()
            ]
            entries = [
                StoredEntry(*row)
                for row in connection.execute(f"SELECT {HISTORY_COLUMNS} FROM history ORDER BY id").fetchall()
            ]
            rows = [
                _DatasetRow(*row)
                for row in connection.execute(f"SELECT {_DATASET_COLUMNS} FROM datasets ORDER BY id").fetchall()
            ]
            uses = [
                StoredTenantUse(
                    budget_id, tenant, quota_epsilon,
                    AdmissionRule.from_dict(json.loads(quota_rule)) if quota_rule else None,
                    RdpTally.from_json(held), Composition.from_json(committed),
                )
                for budget_id, tenant, quota_epsilon, quota_rule, held, committed in connection.execute(
                    "SELECT budget_id, tenant, quota_epsilon, quota_rule, held_rdp, committed_events FROM tenant_use "
                    "ORDER BY budget_id, tenant"
                ).fetchall()
            ]
        datasets = [
            StoredDataset(
                dataset_id=row.dataset_id,
                name=f"{row.tenant}/{row.name}",
                budget_epsilon=row.budget_epsilon,
                delta=row.delta,
                admission=_rule(row),
                held=RdpTally.from_json(row.held_rdp),
                committed_events=Composition.from_json(row.committed_events),
                block_of=row.block_of,
                block=row.block,
                data=json.loads(row.block_data) if row.block_data else None,
            )
            for row in rows
        ]
        return verify_history(
            entries, datasets, uses, key=self._history.key, reservations=reservations, commits=commits,
            tenants=tenants, head=head,
        )

    def history(
        self, dataset: str | None = None, limit: int = 1000, *, caller: Caller | None = None
    ) -> list[HistoryEntry]:
        """The newest `limit` changes the caller may see (its tenant's; all for an admin), oldest first."""
        caller = self._caller(caller)
        limit = check_history_limit(limit)
        conditions, parameters = [], []
        with self._transactions.read() as connection:
            if dataset is not None:
                # A block's own entries (its creation, quotas on it) are the dataset's too.
                conditions.append("(h.dataset_id = ? OR h.dataset_id IN (SELECT id FROM datasets WHERE block_of = ?))")
                dataset_id = self._dataset_row(connection, caller, dataset, shared=True).dataset_id
                parameters += [dataset_id, dataset_id]
            if not caller.admin:
                conditions.append("h.tenant = ?")
                parameters.append(caller.tenant)
            where = f"WHERE {' AND '.join(conditions)}" if conditions else ""
            rows = connection.execute(
                "SELECT h.id, h.at, h.actor, h.action, d.tenant, d.name, h.details FROM history h "
                f"LEFT JOIN datasets d ON d.id = h.dataset_id {where} ORDER BY h.id DESC LIMIT ?",
                (*parameters, limit),
            ).fetchall()
        return [
            HistoryEntry(
                entry_id=entry_id,
                at=at,
                actor=actor,
                action=action,
                dataset=display_name(caller, DatasetRef(tenant, name)) if name is not None else None,
                details=json.loads(details),
            )
            for entry_id, at, actor, action, tenant, name, details in reversed(rows)
        ]


def open_embedded_ledger(path: str | os.PathLike | None = None) -> Ledger:
    """The single-machine ledger: the local user is admin and owns the tenant 'local'.

    `path` defaults to `default_ledger_path()`; its folder is created.
    """
    path = Path(path) if path is not None else default_ledger_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    caller = Caller(actor=f"{local_user()} (embedded)", tenant=LOCAL_TENANT, admin=True)
    ledger = Ledger(path, caller=caller)
    ledger._ensure_tokenless_tenant(LOCAL_TENANT, caller)
    return ledger
