"""The `queued_jobs` table: jobs waiting for budget, and how each wait ended (admitted, cancelled, timed out)."""

from __future__ import annotations

import json
from typing import NamedTuple

from accounting.events import Composition
from accounting.ledger.callers import Caller, DatasetRef, display_name
from accounting.ledger.databases import Connection
from accounting.ledger.records import QueuedJob
from accounting.ledger.store.clock import now
from accounting.ledger.validation import ACTIVE, ADMITTED, QUEUED

_QUEUE_COLUMNS = (
    "q.id, d.tenant, d.name, q.job_id, q.state, q.planned_events, q.priority, q.created_at, q.deadline, q.position, "
    "q.reason, q.reservation_id, q.ended_at, q.lease_seconds, q.dataset_id"
)
_FROM = "FROM queued_jobs q JOIN datasets d ON d.id = q.dataset_id"


class QueuedRow(NamedTuple):
    """A row of `queued_jobs` as a caller sees it, with its dataset's owner and name."""

    queue_id: str
    dataset_tenant: str
    dataset_name: str
    job_id: str
    state: str
    planned_events: str
    priority: int
    created_at: str
    deadline: str | None
    position: int
    reason: str
    reservation_id: str | None
    ended_at: str | None
    lease_seconds: float | None
    dataset_id: int

    def queued_job(self, caller: Caller) -> QueuedJob:
        """The queued job as `caller` sees it: its dataset named as the caller names it."""
        return QueuedJob(
            queue_id=self.queue_id,
            dataset=display_name(caller, DatasetRef(self.dataset_tenant, self.dataset_name)),
            job_id=self.job_id,
            state=self.state,
            planned=Composition.from_json(self.planned_events),
            priority=self.priority,
            created_at=self.created_at,
            deadline=self.deadline,
            position=self.position,
            reason=self.reason,
            reservation_id=self.reservation_id,
            ended_at=self.ended_at,
            lease_seconds=self.lease_seconds,
        )


class WaitingRow(NamedTuple):
    """A waiting job as the scheduler reads it: what it asks for, and what the last pass said of it."""

    queue_id: str
    job_id: str
    planned_events: str
    priority: int
    lease_seconds: float | None
    position: int
    reason: str
    conversion: str
    tenant: str
    blocks: str
    deadline: str | None


class QueuedJobs:
    """The rows of `queued_jobs`; each method reads or writes on the connection it is given."""

    @staticmethod
    def by_id(connection: Connection, queue_id: str, dataset_tenant: str | None = None) -> QueuedRow | None:
        """The queued job of `queue_id` (with `dataset_tenant`, only when it is on that tenant's dataset), or None."""
        mine, parameters = (" AND d.tenant = ?", (dataset_tenant,)) if dataset_tenant is not None else ("", ())
        row = connection.execute(
            f"SELECT {_QUEUE_COLUMNS} {_FROM} WHERE q.id = ?{mine}", (queue_id, *parameters)
        ).fetchone()
        return QueuedRow(*row) if row is not None else None

    @staticmethod
    def pending_of_job(connection: Connection, dataset_id: int, job_id: str) -> QueuedRow | None:
        """The entry of `job_id` on the dataset that still waits, or was admitted to a reservation still active."""
        row = connection.execute(
            f"SELECT {_QUEUE_COLUMNS} {_FROM} LEFT JOIN reservations r ON r.id = q.reservation_id "
            "WHERE q.dataset_id = ? AND q.job_id = ? AND (q.state = ? OR (q.state = ? AND r.state = ?))",
            (dataset_id, job_id, QUEUED, ADMITTED, ACTIVE),
        ).fetchone()
        return QueuedRow(*row) if row is not None else None

    @staticmethod
    def waiting(connection: Connection, dataset_id: int) -> list[WaitingRow]:
        """The jobs waiting on a dataset, in the order they arrived."""
        return [
            WaitingRow(*row) for row in connection.execute(
                "SELECT id, job_id, planned_events, priority, lease_seconds, position, reason, conversion, tenant, "
                "blocks, deadline FROM queued_jobs WHERE dataset_id = ? AND state = ? ORDER BY created_at, id",
                (dataset_id, QUEUED),
            ).fetchall()
        ]

    @staticmethod
    def datasets_waiting(connection: Connection) -> list[int]:
        """The ids of the datasets with waiting jobs."""
        return [
            dataset_id for (dataset_id,) in connection.execute(
                "SELECT DISTINCT dataset_id FROM queued_jobs WHERE state = ? ORDER BY dataset_id", (QUEUED,)
            ).fetchall()
        ]

    @staticmethod
    def count_waiting(connection: Connection, dataset_id: int) -> int:
        """How many jobs wait on the dataset."""
        (waiting,) = connection.execute(
            "SELECT COUNT(*) FROM queued_jobs WHERE dataset_id = ? AND state = ?", (dataset_id, QUEUED)
        ).fetchone()
        return waiting

    @staticmethod
    def waits_on_dataset_budget(connection: Connection, dataset_id: int) -> bool:
        """Whether a job waits for the dataset's own budget (it names no blocks)."""
        return connection.execute(
            "SELECT 1 FROM queued_jobs WHERE dataset_id = ? AND state = ? AND blocks = '[]' LIMIT 1",
            (dataset_id, QUEUED),
        ).fetchone() is not None

    @staticmethod
    def listed(
        connection: Connection, dataset_id: int | None, dataset_tenant: str | None, state: str | None
    ) -> list[QueuedRow]:
        """Queued jobs by dataset then queue position: of one dataset, datasets of one owner, one state (None: any)."""
        conditions, parameters = [], []
        for condition, value in (("q.dataset_id = ?", dataset_id), ("d.tenant = ?", dataset_tenant),
                                 ("q.state = ?", state)):
            if value is not None:
                conditions.append(condition)
                parameters.append(value)
        where = f"WHERE {' AND '.join(conditions)}" if conditions else ""
        # One dataset's queue is read in order from its index (queued_jobs_in_position).
        order = "q.position, q.created_at, q.id"
        if dataset_id is None:
            order = f"d.tenant, d.name, {order}"
        return [
            QueuedRow(*row) for row in connection.execute(
                f"SELECT {_QUEUE_COLUMNS} {_FROM} {where} ORDER BY {order}",
                parameters,
            ).fetchall()
        ]

    @staticmethod
    def insert(
        connection: Connection, queue_id: str, dataset_id: int, tenant: str, job_id: str, planned: Composition,
        blocks: tuple[str, ...], conversion: dict, priority: int, lease_seconds: float | None, deadline: str | None,
    ) -> None:
        """Add a waiting job."""
        connection.execute(
            "INSERT INTO queued_jobs (id, dataset_id, job_id, tenant, blocks, planned_events, conversion, "
            "priority, lease_seconds, created_at, deadline, state) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (
                queue_id, dataset_id, job_id, tenant, json.dumps(list(blocks)), planned.to_json(),
                json.dumps(conversion), priority, lease_seconds, now(), deadline, QUEUED,
            ),
        )

    @staticmethod
    def end(connection: Connection, queue_id: str, state: str, ended_at: str, reason: str) -> None:
        """A waiting job stops waiting without a reservation (`state`: cancelled or timed out)."""
        connection.execute(
            "UPDATE queued_jobs SET state = ?, ended_at = ?, position = 0, reason = ? WHERE id = ?",
            (state, ended_at, reason, queue_id),
        )

    @staticmethod
    def admit(connection: Connection, queue_id: str, reservation_id: str, reason: str) -> None:
        """A waiting job was admitted now, holding `reservation_id`."""
        connection.execute(
            "UPDATE queued_jobs SET state = ?, reservation_id = ?, ended_at = ?, position = 0, reason = ? "
            "WHERE id = ?",
            (ADMITTED, reservation_id, now(), reason, queue_id),
        )

    @staticmethod
    def note(connection: Connection, queue_id: str, position: int, reason: str) -> None:
        """Where a waiting job stands after a scheduling pass, and why."""
        connection.execute(
            "UPDATE queued_jobs SET position = ?, reason = ? WHERE id = ?", (position, reason, queue_id)
        )

    @staticmethod
    def set_reason(connection: Connection, queue_id: str, reason: str) -> None:
        """Why a waiting job is not admitted, where no scheduling pass places it."""
        connection.execute("UPDATE queued_jobs SET reason = ? WHERE id = ?", (reason, queue_id))
