"""The interface every privacy ledger offers, the embedded `Ledger` and the `RemoteLedger` alike."""

from __future__ import annotations

from typing import Protocol

from accounting.events import EventsLike
from accounting.ledger.admission import FitReport
from accounting.ledger.records import (
    CommitResult, DatasetStatus, HistoryEntry, PlanStatus, QueuedJob, Reservation, TenantCreated,
)
from accounting.ledger.scheduling import SchedulingPolicy
from accounting.ledger.validation import EXAMPLE, QUEUED


class PrivacyLedger(Protocol):
    """What the embedded `Ledger` and the `RemoteLedger` both offer; the trainer uses either.

    Datasets are named 'name' within the caller's tenant or 'tenant/name'
    (admins). Every method raises a LedgerError subclass on refusal.
    """

    def create_tenant(self, tenant: str) -> TenantCreated:
        """Create a tenant and return its token (admin only)."""

    def rotate_token(self, tenant: str | None = None) -> TenantCreated:
        """Replace a tenant's token (None: the caller's admin token) with a new one, returned once."""

    def revoke_token(self, tenant: str | None = None, key_id: str | None = None) -> str:
        """Revoke a tenant's token, or the admin token of `key_id` (admin only); the revoked key id."""

    def create_dataset(
        self, dataset: str, epsilon: float, delta: float, privacy_unit: str = EXAMPLE,
        scheduling: SchedulingPolicy | dict | None = None, plan_share: float = 0.0,
    ) -> DatasetStatus:
        """Create a dataset with a budget of (epsilon, delta) per `privacy_unit` ('example' or 'user'), of which
        `plan_share` is set aside as the pool pre-registered plans are charged from."""

    def raise_budget(self, dataset: str, epsilon: float) -> DatasetStatus:
        """Set a dataset's budget epsilon (admin only; never below what is committed and reserved)."""

    def get_budget(self, dataset: str, pld_may_be_pending: bool = False) -> DatasetStatus:
        """One dataset's budget, spending and active jobs (see `budget_figures` for `pld_may_be_pending`)."""

    def list_datasets(self, pld_may_be_pending: bool = False) -> list[DatasetStatus]:
        """Every dataset the caller may see."""

    def list_jobs(
        self, dataset: str | None = None, state: str | None = None, charges: bool = False
    ) -> list[Reservation]:
        """Reservations on the caller's datasets, oldest first, optionally of one dataset or state; with `charges`,
        each with what it took from each budget it is charged to (records.JobCharge)."""

    def reserve(
        self, dataset: str, job_id: str, planned: EventsLike, lease_seconds: float | None = None,
        privacy_unit: str = EXAMPLE, rows_per_person: int | None = None, blocks: tuple[str, ...] | list[str] = (),
        plan: str | None = None,
    ) -> Reservation:
        """Hold budget for a job's planned events, or raise BudgetExceeded; with a lease of `lease_seconds`.

        `privacy_unit` is what the events protect; `rows_per_person` bounds
        each person's rows for an example-level job (see `charged_plan`).
        With `blocks`, the job is charged in full to each of those blocks, all or nothing.
        With `plan`, it is the next job of that pre-registered plan, admitted without the filter.
        """

    def register_plan(
        self, dataset: str, plan: str, jobs: list[EventsLike] | tuple[EventsLike, ...], delta: float | None = None,
        privacy_unit: str = EXAMPLE, rows_per_person: int | None = None,
    ) -> PlanStatus:
        """Pre-register a plan of `jobs` fixed before any runs, charged its PLD ε at `delta` from the dataset's
        plan pool now (BudgetExceeded past the pool)."""

    def list_plans(self, dataset: str) -> list[PlanStatus]:
        """The dataset's pre-registered plans the caller may see, oldest first."""

    def add_block(
        self, dataset: str, block: str, epsilon: float, delta: float | None = None, data: dict | str | None = None
    ) -> DatasetStatus:
        """Add a block with its own (epsilon, delta) budget, bound to the rows `data` declares (owner or admin)."""

    def bind_content(self, dataset: str, content: list[str]) -> DatasetStatus:
        """Bind the SHA-256s of the files a job reads to a dataset on first use, or check they are among its own."""

    def set_quota(self, dataset: str, tenant: str, epsilon: float, block: str | None = None) -> DatasetStatus:
        """Give a tenant a quota on a dataset or one of its blocks (admin only)."""

    def fits(
        self, dataset: str, planned: EventsLike, blocks: tuple[str, ...] | list[str] = (),
        privacy_unit: str = EXAMPLE, rows_per_person: int | None = None,
    ) -> FitReport:
        """Whether a job would be admitted now, what it would cost and what would remain; reserves nothing."""

    def commit(self, reservation_id: str, steps: int, sequence: int) -> CommitResult:
        """Charge the next `steps` planned steps and renew the lease; the same `sequence` twice charges once."""

    def release(self, reservation_id: str) -> Reservation:
        """Free the reservation's unrun steps; what was committed stays spent."""

    def enqueue(
        self, dataset: str, job_id: str, planned: EventsLike, lease_seconds: float | None = None, priority: int = 0,
        max_wait_seconds: float | None = None, privacy_unit: str = EXAMPLE, rows_per_person: int | None = None,
        blocks: tuple[str, ...] = (),
    ) -> QueuedJob:
        """Queue a job for budget; the dataset's scheduling policy admits it (as a reservation) when it fits."""

    def queued_job(self, queue_id: str) -> QueuedJob:
        """A queued job as it stands now: waiting (position and reason), admitted, cancelled or timed out."""

    def cancel_queued(self, queue_id: str) -> QueuedJob:
        """Take a waiting job out of the queue."""

    def list_queued(self, dataset: str | None = None, state: str | None = QUEUED) -> list[QueuedJob]:
        """Queued jobs on the caller's datasets (waiting ones by default; None: any state)."""

    def history(self, dataset: str | None = None, limit: int = 1000) -> list[HistoryEntry]:
        """The newest `limit` changes the caller may see, oldest first."""

    def close(self) -> None:
        """Release files or channels."""
