"""The `reservations` and `commits` tables: budget held for a job, and each block of its steps charged."""

from __future__ import annotations

import json
from typing import NamedTuple

from accounting.events import Composition
from accounting.ledger.callers import Caller, DatasetRef, display_name
from accounting.ledger.databases import Connection, Database
from accounting.ledger.records import Reservation
from accounting.ledger.store.clock import now
from accounting.ledger.validation import ACTIVE, RELEASED
from accounting.ledger.verification import StoredCommit, StoredReservation

_RESERVATION_COLUMNS = (
    "r.id, d.tenant, d.name, r.job_id, r.state, r.planned_events, r.committed_steps, r.created_at, r.released_at, "
    "r.lease_seconds, r.expires_at, r.lease_expired, r.tenant, r.blocks, r.dataset_id, p.plan"
)
_FROM = "FROM reservations r JOIN datasets d ON d.id = r.dataset_id LEFT JOIN plan_jobs p ON p.reservation_id = r.id"


class ReservationRow(NamedTuple):
    """A row of `reservations`, with its dataset's owner and name; `tenant` is whose job it is."""

    reservation_id: str
    dataset_tenant: str
    dataset_name: str
    job_id: str
    state: str
    planned_events: str
    committed_steps: int
    created_at: str
    released_at: str | None
    lease_seconds: float | None
    expires_at: str | None
    lease_expired: int
    tenant: str
    blocks: str
    dataset_id: int
    plan: str | None

    def reservation(self, caller: Caller) -> Reservation:
        """The reservation as `caller` sees it: its dataset named as the caller names it."""
        return Reservation(
            reservation_id=self.reservation_id,
            dataset=display_name(caller, DatasetRef(self.dataset_tenant, self.dataset_name)),
            job_id=self.job_id,
            state=self.state,
            planned=Composition.from_json(self.planned_events),
            committed_steps=self.committed_steps,
            created_at=self.created_at,
            released_at=self.released_at,
            lease_seconds=self.lease_seconds,
            expires_at=self.expires_at,
            lease_expired=bool(self.lease_expired),
            blocks=tuple(json.loads(self.blocks)),
            plan=self.plan,
        )


class CommitRow(NamedTuple):
    """A commit as stored: the steps it charged, and the reservation's committed steps after it."""

    steps: int
    committed_steps: int


class Reservations:
    """The rows of `reservations` and `commits` in `database`; each method works on the connection it is given."""

    def __init__(self, database: Database) -> None:
        self._database = database

    @staticmethod
    def by_id(connection: Connection, reservation_id: str, tenant: str | None = None) -> ReservationRow | None:
        """The reservation of `reservation_id` (with `tenant`, only when it is that tenant's job), or None."""
        mine, parameters = (" AND r.tenant = ?", (tenant,)) if tenant is not None else ("", ())
        row = connection.execute(
            f"SELECT {_RESERVATION_COLUMNS} {_FROM} WHERE r.id = ?{mine}", (reservation_id, *parameters)
        ).fetchone()
        return ReservationRow(*row) if row is not None else None

    @staticmethod
    def active_of_job(connection: Connection, dataset_id: int, tenant: str, job_id: str) -> ReservationRow | None:
        """The active reservation of `tenant`'s job `job_id` on the dataset (at most one), or None."""
        row = connection.execute(
            f"SELECT {_RESERVATION_COLUMNS} {_FROM} "
            "WHERE r.dataset_id = ? AND r.tenant = ? AND r.job_id = ? AND r.state = ?",
            (dataset_id, tenant, job_id, ACTIVE),
        ).fetchone()
        return ReservationRow(*row) if row is not None else None

    def listed(
        self, connection: Connection, dataset_id: int | None, tenant: str | None, state: str | None
    ) -> list[ReservationRow]:
        """Reservations oldest first, of one dataset, tenant and state where given (None: any)."""
        conditions, parameters = [], []
        for condition, value in (("r.dataset_id = ?", dataset_id), ("r.tenant = ?", tenant), ("r.state = ?", state)):
            if value is not None:
                conditions.append(condition)
                parameters.append(value)
        where = f"WHERE {' AND '.join(conditions)}" if conditions else ""
        return [
            ReservationRow(*row) for row in connection.execute(
                f"SELECT {_RESERVATION_COLUMNS} {_FROM} {where} ORDER BY r.{self._database.insertion_order}",
                parameters,
            ).fetchall()
        ]

    def expired(self, connection: Connection, dataset_id: int | None) -> list[ReservationRow]:
        """The active reservations whose lease ran out, oldest first: of one dataset, or (None) of all."""
        condition, parameters = ("AND r.dataset_id = ?", (dataset_id,)) if dataset_id is not None else ("", ())
        return [
            ReservationRow(*row) for row in connection.execute(
                f"SELECT {_RESERVATION_COLUMNS} {_FROM} "
                f"WHERE r.state = ? AND r.expires_at IS NOT NULL AND r.expires_at <= ? {condition} "
                f"ORDER BY r.{self._database.insertion_order}",
                (ACTIVE, now(), *parameters),
            ).fetchall()
        ]

    @staticmethod
    def any_expired(connection: Connection) -> bool:
        """Whether any active reservation's lease ran out."""
        return connection.execute(
            "SELECT 1 FROM reservations WHERE state = ? AND expires_at IS NOT NULL AND expires_at <= ? LIMIT 1",
            (ACTIVE, now()),
        ).fetchone() is not None

    @staticmethod
    def insert(
        connection: Connection, reservation_id: str, dataset_id: int, tenant: str, job_id: str,
        planned: Composition, blocks: tuple[str, ...], lease_seconds: float | None, expires_at: str | None,
    ) -> None:
        """Add an active reservation with nothing committed."""
        connection.execute(
            "INSERT INTO reservations (id, dataset_id, job_id, planned_events, committed_steps, state, created_at, "
            "lease_seconds, expires_at, tenant, blocks) VALUES (?, ?, ?, ?, 0, ?, ?, ?, ?, ?, ?)",
            (
                reservation_id, dataset_id, job_id, planned.to_json(), ACTIVE, now(), lease_seconds, expires_at,
                tenant, json.dumps(list(blocks)),
            ),
        )

    @staticmethod
    def set_committed(
        connection: Connection, reservation_id: str, committed_steps: int, expires_at: str | None
    ) -> None:
        """Set a reservation's committed steps and when its lease now ends."""
        connection.execute(
            "UPDATE reservations SET committed_steps = ?, expires_at = ? WHERE id = ?",
            (committed_steps, expires_at, reservation_id),
        )

    @staticmethod
    def mark_released(connection: Connection, reservation_id: str, lease_expired: bool) -> None:
        """A reservation is released now (by its lease running out, with `lease_expired`)."""
        connection.execute(
            "UPDATE reservations SET state = ?, released_at = ?, lease_expired = ? WHERE id = ?",
            (RELEASED, now(), int(lease_expired), reservation_id),
        )

    @staticmethod
    def commit_of(connection: Connection, reservation_id: str, sequence: int) -> CommitRow | None:
        """The commit of `sequence` to the reservation, or None."""
        row = connection.execute(
            "SELECT steps, committed_steps FROM commits WHERE reservation_id = ? AND sequence = ?",
            (reservation_id, sequence),
        ).fetchone()
        return CommitRow(*row) if row is not None else None

    @staticmethod
    def insert_commit(
        connection: Connection, reservation_id: str, sequence: int, steps: int, committed_steps: int
    ) -> None:
        """Add the commit of `sequence`: `steps` charged, `committed_steps` in all after it."""
        connection.execute(
            "INSERT INTO commits (reservation_id, sequence, steps, committed_steps, at) VALUES (?, ?, ?, ?, ?)",
            (reservation_id, sequence, steps, committed_steps, now()),
        )

    @staticmethod
    def every(connection: Connection) -> list[StoredReservation]:
        """Every reservation, by id, as `verify` replays it against its history."""
        return [
            StoredReservation(
                reservation_id, dataset_id, tenant, job_id, planned, committed_steps, state, lease_seconds,
                bool(lease_expired), blocks,
            )
            for (reservation_id, dataset_id, tenant, job_id, planned, committed_steps, state, lease_seconds,
                 lease_expired, blocks) in connection.execute(
                "SELECT id, dataset_id, tenant, job_id, planned_events, committed_steps, state, lease_seconds, "
                "lease_expired, blocks FROM reservations ORDER BY id"
            ).fetchall()
        ]

    @staticmethod
    def every_commit(connection: Connection) -> list[StoredCommit]:
        """Every commit, by reservation and sequence, as `verify` replays it against its history."""
        return [
            StoredCommit._make(row) for row in connection.execute(
                "SELECT reservation_id, sequence, steps, committed_steps FROM commits ORDER BY reservation_id, "
                "sequence"
            ).fetchall()
        ]
