"""The `plans` and `plan_jobs` tables: pre-registered plans a dataset's pool admitted, and their jobs' reservations."""

from __future__ import annotations

import json
from typing import NamedTuple

from accounting.events import Composition
from accounting.ledger.admission import PoolUse
from accounting.ledger.callers import Caller, DatasetRef, display_name
from accounting.ledger.databases import Connection
from accounting.ledger.records import PlanStatus
from accounting.ledger.store.clock import now
from accounting.ledger.verification import StoredPlan, StoredPlanJob

_PLAN_COLUMNS = "p.dataset_id, p.name, p.tenant, p.jobs, p.epsilon, p.delta, p.started_jobs, p.created_at, " \
                "d.tenant, d.name"


class PlanRow(NamedTuple):
    """A row of `plans`, with its dataset's owner and name."""

    dataset_id: int
    name: str
    tenant: str
    jobs: str
    epsilon: float
    delta: float
    started_jobs: int
    created_at: str
    dataset_tenant: str
    dataset_name: str

    def job_events(self) -> tuple[Composition, ...]:
        """Each job's charged events, in the plan's order."""
        return tuple(Composition.from_dict(job) for job in json.loads(self.jobs))

    def status(self, caller: Caller) -> PlanStatus:
        """The plan as `caller` sees it: its dataset named as the caller names it."""
        return PlanStatus(
            name=self.name,
            dataset=display_name(caller, DatasetRef(self.dataset_tenant, self.dataset_name)),
            tenant=self.tenant,
            jobs=self.job_events(),
            epsilon=self.epsilon,
            delta=self.delta,
            started_jobs=self.started_jobs,
            created_at=self.created_at,
        )


class Plans:
    """The rows of `plans` and `plan_jobs`; each method reads or writes on the connection it is given."""

    @staticmethod
    def by_name(connection: Connection, dataset_id: int, name: str) -> PlanRow | None:
        """The plan `name` of the dataset, or None."""
        row = connection.execute(
            f"SELECT {_PLAN_COLUMNS} FROM plans p JOIN datasets d ON d.id = p.dataset_id "
            "WHERE p.dataset_id = ? AND p.name = ?", (dataset_id, name),
        ).fetchone()
        return PlanRow(*row) if row is not None else None

    @staticmethod
    def of_dataset(connection: Connection, dataset_id: int, tenant: str | None = None) -> list[PlanRow]:
        """The dataset's plans (of `tenant` only, when given), oldest first."""
        mine, parameters = (" AND p.tenant = ?", (tenant,)) if tenant is not None else ("", ())
        return [PlanRow(*row) for row in connection.execute(
            f"SELECT {_PLAN_COLUMNS} FROM plans p JOIN datasets d ON d.id = p.dataset_id "
            f"WHERE p.dataset_id = ?{mine} ORDER BY p.created_at, p.name", (dataset_id, *parameters),
        ).fetchall()]

    @staticmethod
    def pool_use(connection: Connection, dataset_id: int) -> PoolUse:
        """What the dataset's plans took from its pool, summed in their order of admission."""
        use = PoolUse()
        for epsilon, delta in connection.execute(
            "SELECT epsilon, delta FROM plans WHERE dataset_id = ? ORDER BY created_at, name", (dataset_id,)
        ).fetchall():
            use = use.plus(epsilon, delta)
        return use

    @staticmethod
    def insert(connection: Connection, dataset_id: int, name: str, tenant: str, jobs: str, epsilon: float,
               delta: float) -> None:
        """Add a plan with no job started (its name new on the dataset)."""
        connection.execute(
            "INSERT INTO plans (dataset_id, name, tenant, jobs, epsilon, delta, started_jobs, created_at) "
            "VALUES (?, ?, ?, ?, ?, ?, 0, ?)", (dataset_id, name, tenant, jobs, epsilon, delta, now()),
        )

    @staticmethod
    def start_job(connection: Connection, plan: PlanRow, reservation_id: str) -> None:
        """Record that the plan's next job started, held by `reservation_id`."""
        connection.execute(
            "INSERT INTO plan_jobs (reservation_id, dataset_id, plan, job_index) VALUES (?, ?, ?, ?)",
            (reservation_id, plan.dataset_id, plan.name, plan.started_jobs),
        )
        connection.execute(
            "UPDATE plans SET started_jobs = started_jobs + 1 WHERE dataset_id = ? AND name = ?",
            (plan.dataset_id, plan.name),
        )

    @staticmethod
    def every(connection: Connection) -> list[StoredPlan]:
        """Every plan, as `verify` replays it against its history."""
        return [StoredPlan(*row) for row in connection.execute(
            "SELECT dataset_id, name, tenant, jobs, epsilon, delta, started_jobs FROM plans ORDER BY dataset_id, name"
        ).fetchall()]

    @staticmethod
    def every_job(connection: Connection) -> list[StoredPlanJob]:
        """Every started job of a plan, as `verify` replays it against its history."""
        return [StoredPlanJob(*row) for row in connection.execute(
            "SELECT reservation_id, dataset_id, plan, job_index FROM plan_jobs ORDER BY reservation_id"
        ).fetchall()]
